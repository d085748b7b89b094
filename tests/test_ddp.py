"""memsentry around DistributedDataParallel on CPU processes (gloo): rank 0's report combines
every rank's, a leak on rank 1 only is reported there with its holder, a rank that raises or
dies inside the block hangs nobody, and tracking changes no loss and no parameter.

The ranks run this file as a script (``python test_ddp.py SCENARIO RANK WORLD INIT OUT``),
each in its own process, and write what they saw to ``OUT`` for the tests to judge.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import memsentry

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

STEPS = 8
#: Seconds all the ranks of one scenario may take together (they take a few).
DEADLINE = 120.0
#: What rank 0 waits for the others' reports in these tests.
GATHER = 8.0
#: The timeout of the run whose rank 0 waits out a grace only: far above the grace (2 s) and
#: above any run time on a loaded machine, so a run under it proves the grace.
LONG_GATHER = 120.0

kept_outputs: list[torch.Tensor] = []


# -- what each rank runs -------------------------------------------------------------------
def _train(scenario: str, tracked: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    if scenario == "rank0_only" and dist.get_rank() != 0:
        tracked = False  # this rank runs untracked: rank 0 must not wait out the timeout
    timeout = LONG_GATHER if scenario == "rank0_only" else GATHER
    tracker = memsentry.track(ddp, on_leak="ignore", gather_timeout=timeout) if tracked else None
    losses = []
    error = None
    try:
        if tracker is not None:
            tracker.start()
        for _ in range(STEPS):
            out = ddp(torch.randn(8, 16, generator=generator))
            loss = out.pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            if scenario == "rank1_keeps" and dist.get_rank() == 1:
                kept_outputs.append(out)  # with its graph, on this rank only
        if tracked and dist.get_rank() == 1:
            if scenario == "rank1_raises":
                raise ValueError("rank 1 fails after its last step")
            if scenario == "rank1_dies":
                os._exit(0)  # gone without a word: rank 0 must not wait forever
    except ValueError as caught:
        error = str(caught)
        if tracker is not None:
            tracker.stop()  # from the except block: the error ends the run
    report = tracker.stop() if tracker is not None else None
    return {"losses": losses, "parameters": [p.detach().clone() for p in model.parameters()],
            "report": report, "error": error}


def _summary(plain: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    report = run["report"]
    if report is None:  # an untracked rank
        return {"losses_equal": run["losses"] == plain["losses"], "untracked": True}
    return {
        "losses_equal": run["losses"] == plain["losses"],
        "parameters_equal": all(torch.equal(a, b) for a, b in
                                zip(plain["parameters"], run["parameters"], strict=True)),
        "error": run["error"],
        "rank": report.rank, "world_size": report.world_size, "host": report.host,
        "layers": [layer.name for layer in report.layers],
        "findings": [{"rule": f.rule, "severity": f.severity.value, "rank": f.rank,
                      "message": f.message} for f in report.findings],
        "ranks": [r.rank for r in report.ranks],
        "notes": list(report.notes),
        "text": str(report),
    }


def _rank_main(scenario: str, rank: int, world: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    plain = _train("plain", tracked=False)
    kept_outputs.clear()
    dist.barrier()
    started = time.monotonic()
    summary = _summary(plain, _train(scenario, tracked=True))
    summary["seconds"] = time.monotonic() - started
    Path(out).write_text(json.dumps(summary), encoding="utf-8")
    if scenario != "rank1_dies":
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's destructors can abort when a peer has closed first


# -- the tests -------------------------------------------------------------------------------
def run_ranks(scenario: str, world: int, folder: Path) -> list[dict[str, Any] | None]:
    """Start ``world`` ranks of ``scenario``; what each wrote (``None``: nothing)."""
    folder.mkdir(parents=True)
    init = (folder / "rendezvous").as_uri()
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    procs = []
    for rank in range(world):
        log = (folder / f"rank{rank}.log").open("w")
        procs.append((subprocess.Popen(
            [sys.executable, __file__, scenario, str(rank), str(world), init,
             str(folder / f"rank{rank}.json")],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root), log))
    deadline = time.monotonic() + DEADLINE
    for proc, log in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    logs = "\n".join(f"--- rank {r} (exit {p.returncode}) ---\n"
                     + (folder / f"rank{r}.log").read_text()[-3000:]
                     for r, (p, _log) in enumerate(procs))
    assert all(p.returncode == 0 for p, _log in procs), f"a rank failed or hung:\n{logs}"
    return [json.loads(path.read_text()) if (path := folder / f"rank{r}.json").is_file()
            else None for r in range(world)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ddp")


def test_a_clean_ddp_loop_is_combined_on_rank_0_with_no_finding(folder: Path) -> None:
    ranks = run_ranks("clean", 2, folder / "clean")
    for rank, seen in enumerate(ranks):
        assert seen is not None
        assert seen["losses_equal"] and seen["parameters_equal"], f"rank {rank} changed"
        assert (seen["rank"], seen["world_size"]) == (rank, 2)
        # The model's own names, through the DDP wrapper.
        assert seen["layers"][:4] == ["DistributedDataParallel", "Sequential", "0", "1"]
        # No verdict; a hint of heap growth may come from what a loaded machine does to the
        # process heap (glibc's counters count it all), never one of another rule.
        assert [f for f in seen["findings"] if f["severity"] != "hint"] == []
        assert {f["rule"] for f in seen["findings"]} <= {"memory-growth"}
    assert ranks[0]["ranks"] == [0, 1]  # rank 0 combines both
    assert ranks[1]["ranks"] == []  # the others keep their own
    assert "Ranks (2 of 2 reported" in ranks[0]["text"]
    header = next(line for line in ranks[0]["text"].splitlines()
                  if line.startswith("memsentry: cpu"))
    assert header.endswith(f"rank 0 of 2 on {ranks[0]['host']}")


def test_a_leak_on_rank_1_only_is_reported_on_rank_0_with_its_holder(folder: Path) -> None:
    ranks = run_ranks("rank1_keeps", 3, folder / "keeps")
    assert all(seen is not None and seen["losses_equal"] for seen in ranks)
    combined = ranks[0]
    assert combined is not None and combined["ranks"] == [0, 1, 2]
    leaks = [f for f in combined["findings"] if f["severity"] == "leak"]
    assert leaks, combined["text"]
    assert {f["rank"] for f in leaks} == {1}
    assert any("`kept_outputs`" in f["message"] for f in leaks)
    assert "rank 1: " in combined["text"]
    own = ranks[1]
    assert own is not None and any(f["severity"] == "leak" for f in own["findings"])
    assert not [f for f in ranks[2]["findings"] if f["severity"] == "leak"]  # type: ignore[index]


def test_a_rank_that_raises_still_reports_and_hangs_nobody(folder: Path) -> None:
    ranks = run_ranks("rank1_raises", 2, folder / "raises")
    assert ranks[1] is not None and ranks[1]["error"] == "rank 1 fails after its last step"
    assert ranks[0] is not None and ranks[0]["ranks"] == [0, 1]
    assert ranks[0]["seconds"] < GATHER + 20


def test_a_rank_that_dies_costs_rank_0_the_timeout_and_is_named(folder: Path) -> None:
    ranks = run_ranks("rank1_dies", 2, folder / "dies")
    assert ranks[1] is None
    combined = ranks[0]
    assert combined is not None and combined["ranks"] == [0]
    assert any(note.startswith("rank 1 did not hand in a report within 8 s")
               for note in combined["notes"])
    assert GATHER - 1 < combined["seconds"] < GATHER + 20


def test_tracking_on_rank_0_only_costs_it_a_grace_not_the_timeout(folder: Path) -> None:
    ranks = run_ranks("rank0_only", 2, folder / "rank0_only")
    assert ranks[1] is not None and ranks[1]["untracked"]
    combined = ranks[0]
    assert combined is not None and combined["ranks"] == [0]
    assert any(note.startswith("rank 1 did not hand in a report") and "does not track" in note
               for note in combined["notes"])
    assert combined["seconds"] < LONG_GATHER / 2  # the grace (2 s), not the timeout


if __name__ == "__main__":
    _rank_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])


#: The bundled sample: DDP on two CPU processes, only rank 1 keeps its outputs, and the
#: script destroys its process group before memsentry's tracker ends.
DDP_SAMPLE = Path(__file__).resolve().parent.parent / "samples" / "train_ddp.py"


def test_memsentry_run_under_torchrun_prints_one_combined_report(tmp_path: Path) -> None:
    script = tmp_path / "train_ddp.py"
    script.write_text(DDP_SAMPLE.read_text(encoding="utf-8"), encoding="utf-8")
    assert "dist.destroy_process_group()" in script.read_text(encoding="utf-8")
    out_json = tmp_path / "r.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [
               str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "memsentry", "run", "--json", str(out_json), str(script)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=DEADLINE, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert out.count("memsentry report") == 1  # rank 0 prints, rank 1 says where its went
    assert "memsentry: rank 1 of 2 handed its report to rank 0" in out
    assert "Ranks (2 of 2 reported" in out
    assert "rank 1: tensor-accumulation: `outputs`" in out
    combined = memsentry.Report.from_json(out_json)
    assert [r.rank for r in combined.ranks] == [0, 1]
    assert {f.rank for f in combined.findings if f.severity == "leak"} == {1}
    for rank in (0, 1):
        own = memsentry.Report.from_json(tmp_path / f"r.rank{rank}.json")
        assert (own.rank, own.world_size, own.ranks) == (rank, 2, ())
