"""``memsentry show snap.pickle``: verdicts on a recorded allocator snapshot. Snapshots built
as torch's caching allocator records them (tests/snapshot_factory.py names the sources), and
the snapshots memsentry itself records on the CPU in real loops."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import snapshot_factory as fake
import torch
from snapshot_factory import KIB, MIB, FakeAllocator, snapshot, training, write
from torch import nn

import memsentry
from memsentry.snapshots import SnapshotError, read_snapshot
from memsentry.snapshots.findings import findings
from memsentry.snapshots.frames import Part
from memsentry.snapshots.judge import judge
from memsentry.snapshots.read import snapshot_of

LEAK = "tensor-accumulation"


def verdict_of(data: dict) -> tuple:
    verdict = judge(snapshot_of(data))
    return verdict, findings(verdict)


def show(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "memsentry", "show", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


# -- leaks and their not-a-leak twins -----------------------------------------------------
def test_outputs_kept_every_iteration_are_a_leak_at_the_forward_line() -> None:
    verdict, found = verdict_of(snapshot(training(20, keep="output")))
    [leak] = found
    assert leak.rule == LEAK and leak.severity is memsentry.Severity.LEAK
    assert str(leak.location) == "/home/me/train.py:42"
    assert leak.objects == 20 and leak.bytes == 20 * 32 * KIB
    assert "kept from 20 of the last 20 iterations (read from its optimizer steps)" \
        in leak.message
    assert "a forward" in leak.message and "detach()" in leak.fix
    assert verdict.devices[0].iterations == 20


def test_without_an_optimizer_state_the_backwards_count_the_iterations() -> None:
    verdict, found = verdict_of(snapshot(training(16, keep="output", adam=False)))
    assert verdict.devices[0].rhythm == "its backwards"
    [leak] = found
    assert "kept from 16 of the last 16 iterations (read from its backwards)" in leak.message


def test_a_loss_summed_as_a_tensor_names_its_lines() -> None:
    _verdict, found = verdict_of(snapshot(training(12, keep="loss")))
    assert sorted(str(f.location) for f in found) == ["/home/me/train.py:42",
                                                       "/home/me/train.py:43"]
    assert found[0].bytes == 12 * 128 * KIB  # the hidden activations the graph saved
    assert all(f.rule == LEAK and "12 of the last 12 iterations" in f.message for f in found)


@pytest.mark.parametrize("kwargs", [{}, {"keep": "output", "ring": 5}],
                         ids=["clean", "bounded-window"])
def test_a_clean_loop_and_a_bounded_window_have_no_finding(kwargs: dict) -> None:
    verdict, found = verdict_of(snapshot(training(20, **kwargs)))
    assert found == ()
    device = verdict.devices[0]
    # parameters and Adam's state stay alive, made once: at the end, not a pile-up
    at_end = {site.site: site.bytes for site in device.sites_at_end}
    assert at_end["/home/me/train.py:45 (train)"] == 8 * 256 * KIB
    assert at_end["/home/me/train.py:20 (train)"] == 4 * 256 * KIB


def test_a_short_record_says_nothing() -> None:
    _verdict, found = verdict_of(snapshot(training(3, keep="output")))
    assert found == ()  # 3 iterations kept: fewer than a verdict needs


def test_the_peak_and_its_parts_follow_the_trace() -> None:
    verdict, _found = verdict_of(snapshot(training(6)))
    device = verdict.devices[0]
    params, state = 4 * 256 * KIB, 8 * 256 * KIB
    # the first step: parameters, input, both outputs, the loss, four gradients, the state
    # and the step's scratch buffer are alive at once
    # (sizes as requested: the loss is 4 bytes, the seed gradient freed before the step)
    assert device.peak == params + 64 * KIB + 160 * KIB + 4 + params + state + 256 * KIB
    assert device.end == params + state and device.before == 0
    parts = dict(device.parts_at_peak)
    assert parts[fake_part("STEP")] == state + 256 * KIB
    assert parts[fake_part("BACKWARD")] == params


def fake_part(name: str) -> object:
    from memsentry.snapshots.frames import Part

    return Part[name]


def test_a_trace_cut_by_max_entries_counts_what_was_alive_before_it() -> None:
    whole = training(20, keep="output")
    cut = training(20, keep="output", allocator=FakeAllocator(max_entries=300))
    full, _ = verdict_of(snapshot(whole))
    part, found = verdict_of(snapshot(cut))
    assert part.devices[0].end == full.devices[0].end  # the segments hold the same blocks
    assert part.devices[0].before > 0 and part.devices[0].entries == 300
    assert [f.rule for f in found] == [LEAK]  # still once per iteration in what is left


def test_an_out_of_memory_error_says_what_was_asked_and_what_held_memory() -> None:
    gpu = training(5)
    for _ in range(3):
        gpu.alloc(512 * MIB, fake.stack(fake.FORWARD, 42))
    gpu.oom(2 * 1024 * MIB, device_free=300 * MIB, frames=fake.stack(fake.FORWARD, 42))
    _verdict, found = verdict_of(snapshot(gpu))
    [oom] = [f for f in found if f.rule == "out-of-memory"]
    assert "asked for 2.0 GiB; the device had 300 MiB free" in oom.message
    assert "a forward (activations, outputs) 1.5 GiB" in oom.message
    assert str(oom.location) == "/home/me/train.py:42"
    assert "smaller batch" in oom.fix and "expandable_segments" not in oom.fix


def test_an_out_of_memory_error_with_memory_cached_in_pieces_says_expandable_segments() -> None:
    gpu = training(5)
    gpu.oom(64 * MIB, device_free=0, frames=fake.stack(fake.FORWARD, 42))
    data = snapshot(gpu, cached_free=48 * MIB)
    data["segments"][0]["blocks"].append({"address": 1, "size": 40 * MIB,
                                          "requested_size": 0, "state": "inactive",
                                          "frames": []})
    data["segments"][0]["total_size"] += 40 * MIB
    _verdict, found = verdict_of(data)
    [oom] = [f for f in found if f.rule == "out-of-memory"]
    assert "88 MiB was cached but free in pieces of at most 48 MiB" in oom.fix
    assert "expandable_segments:True" in oom.fix


def test_cached_memory_far_above_what_tensors_use_is_fragmentation() -> None:
    data = snapshot(training(5), cached_free=900 * MIB,
                    settings={"expandable_segments": False, "max_split_size": -1})
    _verdict, found = verdict_of(data)
    [waste] = [f for f in found if f.rule == "allocator-fragmentation"]
    assert "900 MiB cached and unused" in waste.message
    assert "expandable segments were off" in waste.message
    assert "expandable_segments:True" in waste.fix


def test_two_devices_are_judged_apart() -> None:
    first = training(12, keep="output")
    second = training(12, allocator=FakeAllocator(device=1))
    verdict, found = verdict_of(snapshot(first, second))
    assert [d.name for d in verdict.devices] == ["cuda:0", "cuda:1"]
    assert [f.subject.name for f in found if f.subject] == ["cuda:0"]


# -- files: hostile, cut short, too large, not a snapshot ---------------------------------
class _Payload:
    def __reduce__(self) -> tuple:
        return (os.system, ("echo ran > ran.txt",))


def test_a_pickle_that_asks_for_a_function_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    path = tmp_path / "hostile.pickle"
    path.write_bytes(pickle.dumps({"segments": [_Payload()], "device_traces": []}))
    result = subprocess.run([sys.executable, "-m", "memsentry", "show", str(path)],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert "refused: it asks to load `posix.system`" in result.stderr \
        or "refused: it asks to load `nt.system`" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "ran.txt").exists()


def test_a_file_cut_short_is_refused_in_one_line(tmp_path: Path) -> None:
    whole = pickle.dumps(snapshot(training(5)))
    path = tmp_path / "cut.pickle"
    path.write_bytes(whole[: len(whole) // 2])
    result = show(path)
    assert result.returncode == 2
    assert "not a readable pickle" in result.stderr and "cut short" in result.stderr


def test_a_file_past_the_limit_is_refused_before_reading(tmp_path: Path) -> None:
    path = write(snapshot(training(5)), tmp_path / "big.pickle")
    result = show(path, "--max-snapshot-size", "1 KiB")
    assert result.returncode == 2
    assert f"--max-snapshot-size {path.stat().st_size}" in result.stderr
    assert show(path, "--max-snapshot-size", str(path.stat().st_size)).returncode == 0


@pytest.mark.parametrize("data, said", [
    ({"hello": 1}, "not of an allocator snapshot"),
    ({"segments": [{"blocks": [{"size": "big"}]}]}, "segments[0].blocks[0].size is str"),
    ({"device_traces": [[{"action": "alloc", "addr": 1, "size": 5, "frames": [3]}]]},
     "device_traces[0][0].frames[0] is int"),
], ids=["other-pickle", "bad-size", "bad-frame"])
def test_a_pickle_that_is_not_a_snapshot_names_the_field(data: dict, said: str) -> None:
    with pytest.raises(SnapshotError, match=said.replace("[", r"\[").replace("]", r"\]")):
        snapshot_of(data)


# -- the command --------------------------------------------------------------------------
def test_show_prints_the_verdict_as_text_and_json(tmp_path: Path) -> None:
    path = write(snapshot(training(20, keep="output")), tmp_path / "leak.pickle")
    text = show(path)
    assert text.returncode == 0, text.stderr
    assert "LEAK  tensor-accumulation: 640 KiB in 20 blocks from /home/me/train.py:42" \
        in text.stdout
    assert "at the end, by your line:" in text.stdout
    brief = show(path, "--findings-only")
    assert "LEAK  tensor-accumulation" in brief.stdout and "by your line" not in brief.stdout
    data = json.loads(show(path, "--format", "json").stdout)
    assert data["kind"] == "allocator-snapshot"
    assert [f["rule"] for f in data["findings"]] == [LEAK]
    assert data["devices"][0]["pile_ups"][0]["blocks"] == 20
    out = tmp_path / "verdict.txt"
    assert show(path, "-o", out).returncode == 0 and "LEAK" in out.read_text()


def test_show_writes_the_verdict_as_a_page(tmp_path: Path) -> None:
    path = write(snapshot(training(20, keep="output")), tmp_path / "leak <1>.pickle")
    page = tmp_path / "verdict.html"
    result = show(path, "--html", page)
    assert result.returncode == 0 and "the verdict's page written to" in result.stderr
    text = page.read_text()
    assert "<title>memsentry: 1 LEAK in " in text and "leak &lt;1&gt;.pickle" in text
    assert "/home/me/train.py:42 (train)" in text and "<script" not in text
    clean = write(snapshot(training(20)), tmp_path / "clean.pickle")
    assert show(clean, "--html", page).returncode == 0
    assert "<title>memsentry: no finding in " in page.read_text()


def test_show_of_a_report_is_unchanged(tmp_path: Path) -> None:
    model = nn.Linear(4, 4)
    with memsentry.track(model, on_leak="ignore") as tracker:
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
            tracker.step()
    report = tmp_path / "r.json"
    tracker.report().to_json(report)
    result = show(report, "--findings-only")
    assert result.returncode == 0 and "memsentry" in result.stdout


# -- snapshots memsentry recorded in real CPU loops ---------------------------------------
def _recorded(path: Path, *, leak: bool) -> memsentry.Report:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    kept: list[torch.Tensor] = []
    # overhead=None: every iteration sampled, so the report's peak is every iteration's (a
    # light iteration's peak is not read: the report's is then a lower bound of the trace's)
    with memsentry.track(model, snapshot=str(path), on_leak="ignore",
                         overhead=None) as tracker:
        for _ in range(24):
            out = model(torch.randn(16, 64))
            out.pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            if leak:
                kept.append(out)  # the line the verdict must name
            else:
                kept = [out.detach()]
    return tracker.report()


def test_a_snapshot_memsentry_recorded_agrees_with_its_report(tmp_path: Path) -> None:
    report = _recorded(tmp_path / "leak.pickle", leak=True)
    snap = read_snapshot(str(tmp_path / "leak.pickle"))
    assert snap.device_type == "cpu" and snap.iteration_ends
    verdict = judge(snap)
    device = verdict.devices[0]
    assert device.peak == report.peak  # the same storages counted: byte for byte
    assert device.end == report.allocated
    assert device.rhythm == "the iteration ends memsentry marked"
    assert device.iterations == report.iterations[-1].index + 1
    live = [f for f in report.findings if f.rule == LEAK]
    found = [f for f in findings(verdict) if f.rule == LEAK]
    assert live and found
    source = Path(__file__).read_text().splitlines()
    out_line = next(i for i, text in enumerate(source, 1)
                    if text.strip() == "out = model(torch.randn(16, 64))")
    [pile] = found
    assert pile.location is not None and pile.location.line == out_line
    assert "kept from 24 of the last" in pile.message and "on cpu" in pile.message
    assert pile.objects == 24 and pile.bytes == 24 * 16 * 8 * 4  # one output a step


def test_a_snapshot_memsentry_recorded_of_a_clean_loop_has_no_finding(tmp_path: Path) -> None:
    report = _recorded(tmp_path / "clean.pickle", leak=False)
    verdict = judge(read_snapshot(str(tmp_path / "clean.pickle")))
    assert findings(verdict) == ()
    assert verdict.devices[0].peak == report.peak


def diff(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "memsentry", "diff", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def test_diff_of_two_snapshots_names_the_line_that_grew_and_fails_past_limits(
        tmp_path: Path) -> None:
    old = write(snapshot(training(20)), tmp_path / "old.pickle")
    new = write(snapshot(training(20, keep="output")), tmp_path / "new.pickle")
    plain = diff(old, new)
    assert plain.returncode == 0, plain.stderr
    assert "+640 KiB  /home/me/train.py:42 (train)  (0 B -> 640 KiB)" in plain.stdout
    assert "Appeared (1)" in plain.stdout and "LEAK  tensor-accumulation" in plain.stdout
    gated = diff(old, new, "--fail-on-new-findings", "--max-peak-increase", "5%",
                 "--json", tmp_path / "d.json")
    assert gated.returncode == 1
    assert "limit crossed: --max-peak-increase: the peak rose by 13.3%" in gated.stderr
    assert "new LEAK tensor-accumulation at /home/me/train.py:42" in gated.stderr
    data = json.loads((tmp_path / "d.json").read_text())
    assert data["kind"] == "allocator-snapshot-diff" and len(data["limits_crossed"]) == 2
    assert diff(old, old, "--fail-on-new-findings", "--max-peak-increase", "0%"
                ).returncode == 0


def test_diff_refuses_a_snapshot_against_a_report_and_report_only_options(
        tmp_path: Path) -> None:
    snap = write(snapshot(training(5)), tmp_path / "s.pickle")
    report = tmp_path / "r.json"
    report.write_text("{}")
    mixed = diff(snap, report)
    assert mixed.returncode == 2 and "compare a snapshot with a snapshot" in mixed.stderr
    growth = diff(snap, snap, "--max-growth-increase", "1MiB")
    assert growth.returncode == 2 and "--max-growth-increase applies to reports" in growth.stderr


@pytest.mark.parametrize("filename, mine", [
    ("/home/me/train.py", True), (r"C:\Users\me\train.py", True),
    ("/home/me/lib/train.py", True), ("/usr/lib/python3.11/threading.py", False),
    (r"C:\Python311\Lib\threading.py", False), ("<frozen runpy>", False),
    ("/opt/conda/lib/python3.10/site-packages/torch/nn/modules/module.py", False),
    ("/usr/lib/python3/dist-packages/numpy/core.py", False),
    ("/pytorch/c10/cuda/CUDACachingAllocator.cpp", False), ("??", False),
])
def test_the_users_frames_are_told_from_the_path_alone(filename: str, mine: bool) -> None:
    from memsentry.snapshots.frames import is_user_frame
    from memsentry.snapshots.read import Frame

    assert is_user_frame(Frame(filename, 1, "f")) is mine


def test_a_line_that_keeps_some_of_what_it_makes_each_iteration_is_a_leak() -> None:
    # `log_probs.extend(...)` of an episode: the line makes temporaries its backward frees at
    # the episode's end, beside the tensors a global list keeps (the same stack for both)
    gpu = FakeAllocator()
    line = [fake.user(89, "act"), fake.MAIN]
    for _ in range(12):
        temporaries = []
        for _ in range(5):
            temporaries.append(gpu.alloc(4 * KIB, line))
            gpu.alloc(512, line)  # kept
        gpu.free(gpu.alloc(4, fake.stack(fake.STEP, 95)))  # the update ends the episode
        for address in temporaries:
            gpu.free(address)
    _verdict, found = verdict_of(snapshot(gpu))
    [leak] = found
    assert str(leak.location) == "/home/me/train.py:89" and leak.objects == 60
    assert "kept from 12 of the last 12 iterations" in leak.message


def test_a_trace_that_dropped_its_oldest_entries_says_so(tmp_path: Path) -> None:
    path = tmp_path / "cut.pickle"
    script = tmp_path / "loop.py"
    script.write_text(
        "import torch\n"
        "kept = []\n"
        "model = torch.nn.Linear(8, 8)\n"
        "for _ in range(40):\n"
        "    out = model(torch.randn(4, 8))\n"
        "    out.sum().backward()\n"
        "    kept.append(out)\n")
    run = subprocess.run([sys.executable, "-m", "memsentry", "run", "--snapshot", str(path),
                          "--snapshot-entries", "300", str(script)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    text = " ".join(show(path).stdout.split())  # as one line, whatever the wrapping
    assert "oldest were dropped (raise --snapshot-entries" in text
    assert "more from this line are alive from before the trace began" in text


def test_diff_compares_every_line_not_only_the_largest(tmp_path: Path) -> None:
    def record(extra: int) -> Path:
        gpu = FakeAllocator()
        for line in range(100, 112):  # twelve lines, each holding one block at the end
            gpu.alloc((line - 99) * MIB, [fake.user(line), fake.MAIN])
        gpu.alloc(extra or 1, [fake.user(300), fake.MAIN])
        return write(snapshot(gpu), tmp_path / f"r{extra}.pickle")

    plain = diff(record(0), record(5 * KIB))
    assert plain.returncode == 0
    lines = [text for text in plain.stdout.splitlines() if "train.py:" in text]
    assert len(lines) == 1 and "train.py:300" in lines[0]  # the others held the same


def test_a_leak_in_a_folder_whose_name_has_brackets_keeps_its_line() -> None:
    gpu = FakeAllocator()
    here = fake.user(42, filename="/home/me/run (copy)/train.py")
    for _ in range(8):
        gpu.alloc(KIB, [*fake.FORWARD, here, fake.MAIN])
        gpu.free(gpu.alloc(4, fake.stack(fake.STEP, 45)))
    [leak] = verdict_of(snapshot(gpu))[1]
    assert str(leak.location) == "/home/me/run (copy)/train.py:42"
    assert leak.location.function == "train"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this system")
def test_a_fifo_is_refused_as_a_snapshot_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.pickle"
    os.mkfifo(fifo)
    with pytest.raises(SnapshotError, match=r"is a FIFO \(named pipe\), not a snapshot"):
        read_snapshot(str(fifo))


def test_bursts_are_told_apart_one_way_where_no_iteration_is_marked() -> None:
    """Without iterations, one stack's blocks closer than half their even spacing are one
    burst, for the pile-up's regular gap and for the blocks freed before the next burst
    alike: two blocks every 100 entries of 1,000 are ten bursts, 100 entries apart, and the
    block kept from the second burst is the one at 100 (not the first after half the trace,
    the spacing once taken from the number of stacks)."""
    from memsentry.snapshots.judge import _first_and_next, _regular_gap, burst_near

    made = [index for start in range(0, 1000, 100) for index in (start, start + 1)]
    assert burst_near(len(made), 1000) == 25
    assert _regular_gap(made, 1000) == 100
    blocks = [(4 * KIB, (), index) for index in made]
    assert _first_and_next(blocks, None, 1000) == (0, 100)


def test_a_snapshot_memsentry_recorded_tells_the_parts_its_report_measured(
        tmp_path: Path) -> None:
    """The CPU record keeps torch's frames that say the phase, so the parts at the peak are
    read from it as from a GPU's: Adam's state, made in its first step, is the report's
    optimizer state to the byte, and nothing is left to the program's own code but what its
    lines make outside the modules (the batch, the loss)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    path = tmp_path / "adam.pickle"
    with memsentry.track(model, snapshot=str(path), on_leak="ignore", overhead=None) as t:
        for _ in range(12):
            loss = model(torch.randn(128, 64)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    report = t.report()
    device = judge(read_snapshot(str(path))).devices[0]
    assert device.phases_known and device.peak == report.peak
    parts = dict(device.parts_at_peak)
    assert sum(parts.values()) == device.peak
    assert report.breakdown.peak is not None
    params = list(model.parameters())
    state = 2 * 4 * sum(p.numel() for p in params) + 4 * len(params)  # exp_avg, exp_avg_sq, step
    assert parts[Part.STEP] == report.breakdown.peak.optimizer_state == state
    assert parts[Part.FORWARD] > 0 and parts[Part.BACKWARD] > 0
    assert parts[Part.OTHER] <= 2 * 128 * 64 * 4 + 8  # the batch and pow's output, the loss
