"""Reports are never lost: a tracked script stopped by SIGTERM, SIGHUP or Ctrl-C (at a random
moment of its training loop) still gets its report, and the process then ends as python's
would have (dead of the same signal). Under torchrun-like ranks (gloo, on the CPU), a rank
that is killed leaves the others their own files and rank 0 a combined report that names it.

``MEMSENTRY_SIGNAL_RUNS`` sets how many runs each signal gets (5 by default)."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from memsentry import Report

REPO = Path(__file__).resolve().parent.parent
BANNER = f"{'=' * 30} memsentry report {'=' * 30}"
RUNS = int(os.environ.get("MEMSENTRY_SIGNAL_RUNS", "5"))
TIMEOUT = 120

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="POSIX signals")

LOOP = """\
import sys, time
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
started = time.monotonic()
step = 0
while time.monotonic() - started < 60:  # a safety net: the test stops it long before
    loss = model(torch.randn(32, 64)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step == 0:
        print("ready", flush=True)
    if step % 25 == 0:
        print("step", step, float(loss))
    step += 1
"""


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    return env


def _default_signals() -> None:
    """In the child, before it starts: the signals at their default, as a terminal's process
    has them (a test runner started in the background, or under nohup, passes SIGINT or
    SIGHUP on ignored, and python and memsentry then leave them so)."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)


def _start(command: list[str], cwd: Path, **extra: object) -> subprocess.Popen[str]:
    return subprocess.Popen(command, cwd=cwd, env=_environment(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_default_signals,
                            **extra)  # type: ignore[call-overload]


def _memsentry(*args: str) -> list[str]:
    return [sys.executable, "-m", "memsentry", "run", *args]


def _wait_ready(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line != "ready\n":
        proc.kill()
        out, err = proc.communicate(timeout=TIMEOUT)
        raise AssertionError(f"the script did not start: {line}{out}{err[-3000:]}")


def _stop_at_random(proc: subprocess.Popen[str], signum: int, rng: random.Random
                    ) -> tuple[str, str]:
    _wait_ready(proc)
    time.sleep(rng.uniform(0.0, 1.5))
    proc.send_signal(signum)
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"still running {TIMEOUT} s after the signal:\n{err[-3000:]}"
                             ) from None
    return out, err


@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP", "SIGINT"])
def test_a_signal_at_a_random_moment_still_writes_the_report(tmp_path: Path, name: str) -> None:
    signum = getattr(signal, name)
    script = tmp_path / "loop.py"
    script.write_text(LOOP, encoding="utf-8")
    rng = random.Random(f"{name}{os.getpid()}")
    # Python's own status for this signal, once: dead of it (for SIGINT, dead of it or 1:
    # see memsentry.cli.exits), which memsentry's must be.
    plain = _start([sys.executable, str(script)], tmp_path)
    _stop_at_random(plain, signum, rng)
    assert plain.returncode == -signum or (name == "SIGINT" and plain.returncode == 1)
    failures = []
    for run in range(RUNS):
        out_json = tmp_path / f"r{run}.json"
        proc = _start(_memsentry("--json", str(out_json), str(script)), tmp_path)
        out, err = _stop_at_random(proc, signum, rng)
        problems = []
        if proc.returncode != plain.returncode:
            problems.append(f"exit {proc.returncode}, not python's {plain.returncode}")
        if BANNER not in out:
            problems.append("no report printed")
        if not out_json.is_file():
            problems.append("no JSON written")
        else:
            report = Report.from_json(out_json)
            if report.layer("Sequential").calls < 1:
                problems.append("the report has no call of the model")
        if problems:
            failures.append(f"run {run}: {'; '.join(problems)}\n{err[-2000:]}")
    assert not failures, f"{len(failures)} of {RUNS} runs failed:\n" + "\n".join(failures)


def test_a_handler_of_the_script_keeps_the_signal_to_itself(tmp_path: Path) -> None:
    """A script that installs its own SIGTERM handler (one that also calls the handler it
    replaced, as Lightning's does) stops as it decides: memsentry's handler, called so,
    does nothing, as the default it replaced could not be called either."""
    script = tmp_path / "graceful.py"
    script.write_text(LOOP.replace("while time.monotonic()", textwrap.dedent("""\
        import signal
        stop = []
        previous = signal.getsignal(signal.SIGTERM)


        def on_term(signum, frame):
            stop.append(signum)
            if callable(previous):
                previous(signum, frame)


        signal.signal(signal.SIGTERM, on_term)
        while not stop and time.monotonic()""")) + 'print("stopped gracefully")\n',
        encoding="utf-8")
    out_json = tmp_path / "r.json"
    proc = _start(_memsentry("--json", str(out_json), str(script)), tmp_path)
    out, err = _stop_at_random(proc, signal.SIGTERM, random.Random(1))
    assert proc.returncode == 0, err[-3000:]
    assert "stopped gracefully" in out and BANNER in out
    assert Report.from_json(out_json).layer("Sequential").calls >= 1


def test_workers_forked_by_the_script_die_without_reports(tmp_path: Path) -> None:
    """SIGTERM to the whole process group (as a batch system or a closed terminal sends it):
    the DataLoader's forked workers, which inherit memsentry's handler, die as under python;
    only the script's process reports."""
    script = tmp_path / "workers.py"
    script.write_text(LOOP.replace("step = 0\n", textwrap.dedent("""\
        from torch.utils.data import DataLoader, TensorDataset
        loader = DataLoader(TensorDataset(torch.randn(10_000, 64)), batch_size=32,
                            num_workers=2, multiprocessing_context="fork",
                            persistent_workers=True)
        # Epoch after epoch: 313 batches last under a second, less than the test may wait.
        batches = (batch for _ in iter(int, 1) for batch in loader)
        step = 0
        """)).replace("model(torch.randn(32, 64))", "model(next(batches)[0])"),
        encoding="utf-8")
    rng = random.Random(f"workers{os.getpid()}")
    for run in range(RUNS):  # the workers' deaths race with the script's own
        out_json = tmp_path / f"r{run}.json"
        proc = _start(_memsentry("--json", str(out_json), str(script)), tmp_path,
                      start_new_session=True)
        _wait_ready(proc)
        time.sleep(rng.uniform(0.0, 1.0))
        os.killpg(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=TIMEOUT)
        assert proc.returncode == -signal.SIGTERM, f"run {run}: {err[-3000:]}"
        assert out.count(BANNER) == 1
        assert Report.from_json(out_json).layer("Sequential").calls >= 1


# -- ranks, as torchrun starts them -------------------------------------------------------------
RANKS = """\
import datetime, sys, time
import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
torch.manual_seed(rank)
mode = sys.argv[1]
model = nn.Linear(16, 16)
if mode == "ddp":  # gradients all-reduced: rank 0 fails when rank 1 dies
    model = nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
steps = 0
while steps < 5 or mode != "finite":
    loss = model(torch.randn(8, 16)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if mode != "finite":
        time.sleep(0.01)
    if steps == 0:
        print("ready", flush=True)
    steps += 1
print("trained", flush=True)
if rank == 1:
    time.sleep(600)  # killed before it ends
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _start_ranks(tmp_path: Path, mode: str, *options: str) -> list[subprocess.Popen[str]]:
    script = tmp_path / "ranks.py"
    script.write_text(RANKS, encoding="utf-8")
    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = {**_environment(), "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": port}
        procs.append(subprocess.Popen(
            _memsentry("--json", "r.json", *options, str(script), mode), cwd=tmp_path, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=_default_signals))
    return procs


def _wait_for(path: Path, procs: list[subprocess.Popen[str]], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            for proc in procs:
                proc.kill()
            logs = [proc.communicate()[1][-2000:] for proc in procs]
            raise AssertionError(f"{path.name} never came:\n" + "\n---\n".join(logs))
        time.sleep(0.05)


def _missing_rank_1(combined: Report) -> list[str]:
    return [note for note in combined.notes if note.startswith("rank 1 did not hand in")]


def test_a_killed_rank_while_rank_0_waits_then_sigterm(tmp_path: Path) -> None:
    """torchrun's way: rank 1 dies, torchrun sends SIGTERM to rank 0, which is waiting for
    rank 1's report (its own file is written already) and gives it 10 s more, not the whole
    timeout, then writes the combined report naming rank 1 and dies of SIGTERM."""
    rank0, rank1 = procs = _start_ranks(tmp_path, "finite", "--gather-timeout", "300")
    _wait_for(tmp_path / "r.rank0.json", procs, TIMEOUT)  # rank 0 waits from here
    rank1.kill()
    rank1.communicate(timeout=TIMEOUT)
    own = Report.from_json(tmp_path / "r.rank0.json")
    assert (own.rank, own.world_size, own.ranks) == (0, 2, ())
    assert not (tmp_path / "r.json").exists()
    time.sleep(0.5)
    stopped = time.monotonic()
    rank0.send_signal(signal.SIGTERM)
    out, err = rank0.communicate(timeout=TIMEOUT)
    assert rank0.returncode == -signal.SIGTERM, err[-3000:]
    assert time.monotonic() - stopped < 25  # 10 s more, not the 300 s timeout
    combined = Report.from_json(tmp_path / "r.json")
    assert [r.rank for r in combined.ranks] == [0]
    (note,) = _missing_rank_1(combined)
    assert "within 300 s" not in note, note
    assert "Ranks (1 of 2 reported" in out


@pytest.mark.parametrize("mode", ["forever", "ddp"])
def test_a_rank_killed_during_training_then_sigterm(tmp_path: Path, mode: str) -> None:
    """Rank 1 is killed in the middle of training, then rank 0 gets SIGTERM: while it still
    trains (its report is made where the signal found it), or, with DDP, after gloo's
    all-reduce failed and its script raised (it waits for rank 1's report). Either way its
    own file is written and the combined one names rank 1."""
    rank0, rank1 = procs = _start_ranks(tmp_path, mode)
    for proc in procs:
        _wait_ready(proc)
    time.sleep(random.uniform(0.2, 1.0))
    rank1.kill()
    rank1.communicate(timeout=TIMEOUT)
    time.sleep(0.5 if mode == "ddp" else 0.0)
    stopped = time.monotonic()
    rank0.send_signal(signal.SIGTERM)
    _out, err = rank0.communicate(timeout=TIMEOUT)
    assert rank0.returncode == -signal.SIGTERM, err[-3000:]
    assert time.monotonic() - stopped < 25, err[-3000:]
    if mode == "ddp":
        assert "Connection reset by peer" in err or "Connection closed" in err, err[-3000:]
    own = Report.from_json(tmp_path / "r.rank0.json")
    assert own.rank == 0 and own.iterations, err[-3000:]
    combined = Report.from_json(tmp_path / "r.json")
    assert [r.rank for r in combined.ranks] == [0]
    assert _missing_rank_1(combined)
    # Rank 1 died of SIGKILL: what it left is the report the alarm last rewrote while it ran
    # (at a new finding), whole and readable, or nothing when it had nothing to say yet.
    left = tmp_path / "r.rank1.json"
    if left.exists():
        assert Report.from_json(left).rank == 1


def test_a_killed_rank_costs_rank_0_the_gather_timeout_at_most(tmp_path: Path) -> None:
    """No signal for rank 0: it waits --gather-timeout seconds, then combines what came."""
    rank0, rank1 = procs = _start_ranks(tmp_path, "finite", "--gather-timeout", "4")
    _wait_for(tmp_path / "r.rank0.json", procs, TIMEOUT)
    rank1.kill()
    rank1.communicate(timeout=TIMEOUT)
    _out, err = rank0.communicate(timeout=TIMEOUT)
    assert rank0.returncode == 0, err[-3000:]
    combined = Report.from_json(tmp_path / "r.json")
    assert [r.rank for r in combined.ranks] == [0]
    (note,) = _missing_rank_1(combined)
    assert "within 4 s" in note


TORCHRUN = """\
import os, signal, time
import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("gloo")
model = nn.parallel.DistributedDataParallel(nn.Linear(16, 16))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(10_000):
    loss = model(torch.randn(8, 16)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(0.01)
    if dist.get_rank() == 1 and step == 30:
        os.kill(os.getpid(), signal.SIGKILL)
"""


def test_under_torchrun_a_killed_rank_leaves_rank_0s_reports(tmp_path: Path) -> None:
    """The real thing: torchrun sees rank 1 die and sends SIGTERM to rank 0, whose script
    failed in DDP's all-reduce and which waits for rank 1's report: rank 0 dies of SIGTERM
    within torchrun's 30 s, its own file and the combined report written."""
    pytest.importorskip("torch.distributed.run")
    script = tmp_path / "dies.py"
    script.write_text(TORCHRUN, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", "-m", "memsentry", "run", "--json", "r.json", str(script)],
        cwd=tmp_path, env=_environment(), capture_output=True, text=True, timeout=TIMEOUT,
        check=False, preexec_fn=_default_signals)
    assert done.returncode != 0
    assert "exitcode  : -15" in done.stderr and "exitcode  : -9" in done.stderr, \
        done.stderr[-3000:]
    own = Report.from_json(tmp_path / "r.rank0.json")
    assert (own.rank, own.world_size) == (0, 2)
    combined = Report.from_json(tmp_path / "r.json")
    assert [r.rank for r in combined.ranks] == [0]
    assert _missing_rank_1(combined)
    assert "Ranks (1 of 2 reported" in done.stdout


def test_a_signal_while_standard_output_is_full_still_saves_the_report(tmp_path: Path) -> None:
    """The script blocks writing to a pipe nobody reads when SIGTERM comes: the report is
    not printed into the middle of that write, the JSON file is saved, and the process dies
    of SIGTERM once the pipe is read."""
    script = tmp_path / "noisy.py"
    script.write_text(LOOP.replace('print("step", step, float(loss))',
                                   'print("x" * 1000)').replace("step % 25 == 0", "True"),
                      encoding="utf-8")
    out_json = tmp_path / "r.json"
    proc = _start(_memsentry("--json", str(out_json), str(script)), tmp_path)
    _wait_ready(proc)
    time.sleep(1.0)  # the pipe (64 KiB) is full long before
    proc.send_signal(signal.SIGTERM)
    time.sleep(4.0)  # longer than memsentry waits for the write to end
    _out, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == -signal.SIGTERM, err[-3000:]
    assert Report.from_json(out_json).layer("Sequential").calls >= 1
    assert "stopped by SIGTERM" in err
