"""``track(snapshot=...)`` and ``memsentry run --snapshot``: the allocation history as the pickle
PyTorch's memory_viz opens, read back here with torch's own snapshot tooling
(``torch.cuda._memory_viz``), on CPU runs of real models; the CUDA surface against a fake of
the allocator's history functions."""

from __future__ import annotations

import contextlib
import copy
import gc
import io
import itertools
import pickle
import sys
import types
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.cuda import _memory_viz

import memsentry
from memsentry.cli import main
from memsentry.measure.history import MAX_FRAMES
from memsentry.record import Options
from memsentry.record.snapshot import SnapshotRecording
from memsentry.usercode.phases import torch_phase

SAMPLES = Path(__file__).resolve().parent.parent / "samples"
STEPS = 8
LEAK_LINE = next(number for number, line in enumerate(Path(__file__).read_text().splitlines(), 1)
                 if line.endswith("# the leak: outputs with their graphs"))


TORCH = Path(torch.__file__).parent


def _users(frames: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The frames of a recorded stack that are not torch's (the record keeps those of
    torch's frames that say the phase of training)."""
    return [f for f in frames if not Path(f["filename"]).is_relative_to(TORCH)]


def leaky_loop(model: nn.Module, *, steps: int = STEPS) -> list[torch.Tensor]:
    """SGD steps; after each, a forward with autograd on whose output is kept: the input,
    the activations saved for backward and the output stay alive, all made on one line."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    kept = []
    for _ in range(steps):
        loss = model(torch.randn(32, 64)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        kept.append(model(torch.randn(32, 64)))  # the leak: outputs with their graphs
    return kept


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def load(path: Path) -> dict[str, Any]:
    raw = path.read_bytes()
    assert raw[:2] == b"\x80\x04", "memory_viz's page reads pickle protocols 2 to 4"
    data = pickle.loads(raw)
    assert isinstance(data, dict)
    return data


def plain(value: object) -> bool:
    """Whether ``value`` holds only dicts, lists, tuples, strings, ints and bools."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and plain(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return all(plain(item) for item in value)
    return isinstance(value, str | int | bool)


def torch_reads(data: dict[str, Any]) -> None:
    """Every offline function of torch's memory_viz runs on ``data`` without a complaint."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        summary = _memory_viz.segsum(data)
        trace = _memory_viz.trace(data)
        flat = _memory_viz.segments(data, format_flamegraph=lambda lines: lines)
        stacks = _memory_viz.memory(data, format_flamegraph=lambda lines: lines)
        pages = [_memory_viz.trace_plot(data), _memory_viz.segment_plot(data),
                 _memory_viz.trace_plot(data, plot_segments=True),
                 _memory_viz.trace_plot(copy.deepcopy(data), filter_freed=True)]  # edits
    assert printed.getvalue() == ""  # filter_freed says so of a free without its request
    assert f"segments: {len(data['segments'])}\n" in summary
    assert f"{len(data['device_traces'][0])} entries" in trace
    assert flat.count("\n") == stacks.count("\n") >= len(data["segments"])
    assert all(page.lstrip().startswith("<!DOCTYPE html>") for page in pages)


def replay(data: dict[str, Any]) -> None:
    """Walk the trace back from the final state as memory_viz's segment view does: every block
    alive at any point lies in a segment alive then (the page fails on a block outside)."""
    segments = {s["address"]: s["total_size"] for s in data["segments"]}
    blocks = {b["address"]: b["size"] for s in data["segments"] for b in s["blocks"]}
    for entry in reversed(data["device_traces"][0]):
        action, addr, size = entry["action"], entry["addr"], entry["size"]
        if action == "free_completed":
            blocks[addr] = size
        elif action == "alloc":
            assert blocks.pop(addr) == size
        elif action == "segment_free":
            segments[addr] = size
        elif action == "segment_alloc":
            assert segments.pop(addr) == size
        assert all(b in segments and blocks[b] <= segments[b] for b in blocks)


def test_a_leaky_loop_writes_a_snapshot_that_torch_reads(tmp_path: Path) -> None:
    path = tmp_path / "leaky.pickle"
    net = make_model()
    with memsentry.track(net, snapshot=path, on_leak="ignore") as tracker:
        kept = leaky_loop(net)
    report = tracker.report()
    data = load(path)
    torch_reads(data)
    replay(data)
    assert plain(data)  # ints and strings: the snapshot keeps no tensor alive
    # snapshot turned exact storage counting on, and the report says so.
    assert report.backend == "cpu-storages"
    assert any("turned on exact storage counting" in note for note in report.notes)
    trace = data["device_traces"][0]
    assert {e["action"] for e in trace} == {"segment_alloc", "alloc", "free_requested",
                                            "free_completed", "segment_free"}
    assert all(e["stream"] == 0 and e["time_us"] > 0 for e in trace)
    # The storages alive at the end are the report's final figure, byte for byte.
    assert sum(s["total_size"] for s in data["segments"]) == report.allocated
    # Those made on the leaking line are what the loop kept, STEPS times the growth per
    # iteration that the report's timeline measured.
    here = str(Path(__file__))
    leaked = [s for s in data["segments"] if _users(s["frames"])
              and _users(s["frames"])[0] == {"filename": here, "line": LEAK_LINE,
                                             "name": "leaky_loop"}]
    complete = [it.allocated for it in report.iterations if it.boundary != "exit"]
    growth = {after - before for before, after in itertools.pairwise(complete[1:])}
    assert len(growth) == 1 and growth.pop() == sum(s["total_size"] for s in leaked) // STEPS
    # each leaked step kept its input (32 x 64), the ReLU's output (32 x 128), the output.
    assert sorted({s["total_size"] for s in leaked}) == [32 * 10 * 4, 32 * 64 * 4, 32 * 128 * 4]
    assert len(leaked) == 3 * STEPS
    # innermost first: the loop's line, then this test's; memsentry's frames left out, and
    # of torch's only those that say the phase (the module's call: these are a forward's).
    outer = _users(leaked[0]["frames"])[1]
    assert outer["filename"] == here and outer["name"] == sys._getframe().f_code.co_name
    assert {torch_phase(f["filename"], f["name"]) for s in leaked for f in s["frames"]
            if Path(f["filename"]).is_relative_to(TORCH)} <= {"forward"}
    frames = {(f["filename"], f["name"]) for e in trace for f in e["frames"]}
    assert here in {name for name, _ in frames}
    # (by package folder, not by a path's words: the checkout itself may be named memsentry)
    mine = Path(memsentry.__file__).parent
    assert not [f for f, _ in frames if Path(f).is_relative_to(mine)], frames
    assert all(torch_phase(f, name) is not None for f, name in frames
               if Path(f).is_relative_to(TORCH)), frames
    # A kept output is alive; dropped, nothing of memsentry's keeps it.
    probe = weakref.ref(kept[0])
    del kept
    gc.collect()
    assert probe() is None


def test_the_trace_keeps_the_newest_snapshot_entries(tmp_path: Path) -> None:
    def run(entries: int) -> tuple[memsentry.Tracker, list[dict[str, Any]]]:
        net = make_model()
        torch.manual_seed(1)
        with memsentry.track(net, snapshot=True, snapshot_entries=entries,
                             on_leak="ignore") as tracker:
            leaky_loop(net)
        data = load(Path(tracker.snapshot(tmp_path / f"{entries}.pickle")))
        return tracker, data["device_traces"][0]

    _, whole = run(100_000)
    tracker, trace = run(50)
    assert len(whole) > 500 and len(trace) == 50
    # the newest 50: the same events as the whole run's last 50 (addresses differ per run).
    assert [(e["action"], e["size"]) for e in trace] == [(e["action"], e["size"])
                                                        for e in whole[-50:]]
    data = load(tmp_path / "50.pickle")
    report = tracker.report()
    assert any("keeps the last 50 of the" in note for note in report.notes)
    # The storages alive at the end are all there, whatever the trace dropped.
    assert sum(s["total_size"] for s in data["segments"]) == report.allocated
    torch_reads_bounded(data)
    replay(data)


def torch_reads_bounded(data: dict[str, Any]) -> None:
    """A bounded trace may begin inside a storage's events; torch's readers still run."""
    _memory_viz.segsum(data)
    _memory_viz.trace(data)
    _memory_viz.trace_plot(data)
    _memory_viz.segment_plot(data)


@pytest.mark.parametrize(("arguments", "error", "message"), [
    ({"snapshot": 3}, TypeError,
     r"track\(snapshot=...\) takes False \(the default\), True .* or the path .* got 3$"),
    ({"snapshot": b"x.pickle"}, TypeError, r"got b'x.pickle'$"),
    ({"snapshot": "missing/s.pickle"}, ValueError,
     r"track\(snapshot='.*missing/s.pickle'\): the folder of .* does not exist; create it"),
    ({"snapshot": "."}, ValueError, r"'.*' is a directory; give a file name"),
    ({"snapshot": True, "snapshot_entries": 0}, ValueError,
     r"track\(snapshot_entries=...\) takes an int of at least 1 \(default 100000: the "
     r"memory_viz trace entries kept, .*\); got 0$"),
    ({"snapshot_entries": True}, ValueError, r"got True$"),
])
def test_bad_snapshot_arguments_are_refused_before_anything_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arguments: dict[str, Any],
        error: type[Exception], message: str) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(error, match=message):
        memsentry.track(make_model(), **arguments)
    assert list(tmp_path.iterdir()) == []


def test_results_are_bitwise_equal_with_and_without_a_snapshot(tmp_path: Path) -> None:
    def run(**snapshot: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        net = make_model()
        torch.manual_seed(1)
        with memsentry.track(net, exact=True, on_leak="ignore", **snapshot):
            outputs = leaky_loop(net)
        return [o.detach() for o in outputs], [p.detach() for p in net.parameters()]

    plain_outputs, plain_weights = run()
    outputs, weights = run(snapshot=tmp_path / "same.pickle")
    assert (tmp_path / "same.pickle").stat().st_size > 0
    for a, b in zip(plain_outputs + plain_weights, outputs + weights, strict=True):
        assert torch.equal(a, b)


def test_frames_are_the_users_innermost_first_and_at_most_sixteen(tmp_path: Path) -> None:
    def deep(depth: int) -> torch.Tensor:
        if depth:
            return deep(depth - 1)
        return torch.ones(1000)  # the innermost line

    line = deep.__code__.co_firstlineno + 3
    with memsentry.track(snapshot=True, device="cpu", on_leak="ignore") as tracker:
        kept = deep(30)
        path = tracker.snapshot(tmp_path / "now.pickle")  # while tracking: as it stands
    data = load(Path(path))
    (alive,) = [s for s in data["segments"] if s["total_size"] == kept.numel() * 4]
    frames = alive["frames"]
    assert len(frames) == MAX_FRAMES
    assert frames[0] == {"filename": __file__, "line": line, "name": "deep"}
    assert [f["name"] for f in frames] == ["deep"] * MAX_FRAMES
    assert [f["line"] for f in frames[1:]] == [line - 1] * (MAX_FRAMES - 1)


def test_a_snapshot_that_cannot_be_written_is_a_note_not_an_error(tmp_path: Path) -> None:
    target = tmp_path / "later.pickle"
    net = make_model()
    with memsentry.track(net, snapshot=target, on_leak="ignore") as tracker:
        leaky_loop(net, steps=5)
        target.mkdir()  # the path turned into a folder while the loop ran
    report = tracker.report()
    (note,) = [n for n in report.notes if "could not be written" in n]
    assert note.startswith(f"The memory_viz snapshot could not be written to {str(target)!r} (")
    assert "tracker.snapshot(path) writes it elsewhere" in note
    assert [f.rule for f in report.findings if f.severity is memsentry.Severity.LEAK]
    assert report.iterations and report.layers  # the report is whole
    data = load(Path(tracker.snapshot(tmp_path / "elsewhere.pickle")))
    assert sum(s["total_size"] for s in data["segments"]) == report.allocated


def test_tracker_snapshot_needs_a_tracker_that_records(tmp_path: Path) -> None:
    with pytest.raises(memsentry.TrackerStateError, match=r"snapshot=True"):
        memsentry.track(make_model()).snapshot(tmp_path / "x.pickle")
    tracker = memsentry.track(make_model(), snapshot=True)
    with pytest.raises(memsentry.TrackerStateError, match=r"before start\(\)"):
        tracker.snapshot(tmp_path / "x.pickle")
    with tracker:
        with pytest.raises(ValueError, match=r"Tracker.snapshot\('.*nowhere/x.pickle'\): the "
                                             r"folder of .* does not exist"):
            tracker.snapshot(tmp_path / "nowhere" / "x.pickle")
    assert not (tmp_path / "x.pickle").exists()


# -- CUDA: the allocator records; memsentry switches it on and off ---------------------------


class FakeHistory:
    """``torch.cuda.memory._record_memory_history``, ``_snapshot`` and
    ``torch._C._cuda_isHistoryEnabled``, recording their calls, with the state the caching
    allocator keeps (c10/cuda/CUDACachingAllocator.cpp, ``recordHistory``): the settings of
    the last call that switched recording on (``settings``; torch has no getter for them),
    the ``record_history`` flag that ``isHistoryEnabled`` returns, and a trace that switching
    recording off empties."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.fail = fail
        self.settings: dict[str, Any] | None = None  # while recording
        self.snapshot = {
            "segments": [{"device": 0, "address": 1 << 32, "total_size": 2 << 20,
                          "stream": 0, "segment_type": "large", "allocated_size": 512,
                          "active_size": 512, "blocks": [
                              {"address": 1 << 32, "size": 512, "requested_size": 500,
                               "state": "active_allocated",
                               "frames": [{"filename": "train.py", "line": 7, "name": "f"}]},
                              {"address": (1 << 32) + 512, "size": (2 << 20) - 512,
                               "requested_size": 0, "state": "inactive", "frames": []}]}],
            "device_traces": [[{"action": "segment_alloc", "addr": 1 << 32, "size": 2 << 20,
                                "stream": 0, "frames": [], "time_us": 1},
                               {"action": "alloc", "addr": 1 << 32, "size": 512, "stream": 0,
                                "frames": [{"filename": "train.py", "line": 7, "name": "f"}],
                                "time_us": 2}]],
        }

    def record(self, enabled: str | None = "all", **kwargs: Any) -> None:
        self.calls.append(("record", {"enabled": enabled, **kwargs}))
        if enabled is None:
            self.settings = None
            self.snapshot = {**self.snapshot, "device_traces": [[]]}
        else:
            self.settings = {"enabled": enabled, **kwargs}

    def is_enabled(self) -> bool:
        return self.settings is not None

    def take(self) -> dict[str, Any]:
        self.calls.append(("snapshot", {}))
        if self.fail:
            raise RuntimeError("the allocator refused")
        return self.snapshot


def cuda_recorder() -> Any:
    """What SnapshotRecording reads of a recorder measuring cuda:0."""
    return types.SimpleNamespace(device=torch.device("cuda", 0),
                                 _sampler=types.SimpleNamespace(backend=None))


@pytest.fixture
def fake_history(monkeypatch: pytest.MonkeyPatch) -> FakeHistory:
    fake = FakeHistory()
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", fake.record)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", fake.take)
    monkeypatch.setattr(torch._C, "_cuda_isHistoryEnabled", fake.is_enabled, raising=False)
    return fake


def options(**snapshot: Any) -> Options:
    return Options.checked(device=None, exact=False, saved_tensors=True, backward=True,
                           max_iterations=100, on_leak="ignore", holders=True,
                           holder_budget=0.5, **snapshot)


def test_on_cuda_the_allocators_history_is_switched_on_taken_and_off(
        tmp_path: Path, fake_history: FakeHistory) -> None:
    path = tmp_path / "cuda.pickle"
    recording = SnapshotRecording(options(snapshot=path, snapshot_entries=5000))
    recording.start(cuda_recorder())
    assert fake_history.calls == [("record", {"enabled": "all", "max_entries": 5000,
                                              "stacks": "python"})]
    assert recording.data() == fake_history.snapshot  # while tracking: taken now
    recorded = copy.deepcopy(fake_history.snapshot)
    recording.end(torch.device("cuda", 0))
    assert fake_history.calls[1:] == [("snapshot", {}), ("snapshot", {}),
                                      ("record", {"enabled": None})]
    assert recording.notes == [] and not fake_history.is_enabled()
    data = load(path)
    assert data == recorded
    torch_reads(data)
    recording.end(torch.device("cuda", 0))  # once
    assert len(fake_history.calls) == 4


def test_on_cuda_a_failed_snapshot_still_switches_recording_off(
        tmp_path: Path, fake_history: FakeHistory) -> None:
    fake_history.fail = True
    path = tmp_path / "cuda.pickle"
    recording = SnapshotRecording(options(snapshot=path))
    recording.start(cuda_recorder())
    recording.end(torch.device("cuda", 0))
    assert fake_history.calls[-1] == ("record", {"enabled": None})
    assert recording.notes == ["No memory_viz snapshot: taking it failed (the allocator "
                               "refused)."]
    assert not path.exists() and recording.data() is None


def test_on_cuda_the_programs_own_recording_is_used_and_left_as_it_was(
        tmp_path: Path, fake_history: FakeHistory) -> None:
    """The program records CUDA's history itself, with C++ stacks and 100 entries: tracking
    with a snapshot takes the snapshot from that recording and leaves it on, with the
    program's settings and what it recorded before tracking."""
    torch.cuda.memory._record_memory_history(stacks="all", max_entries=100)
    theirs = copy.deepcopy(fake_history.settings)
    path = tmp_path / "cuda.pickle"
    recording = SnapshotRecording(options(snapshot=path, snapshot_entries=5000))
    recording.start(cuda_recorder())
    recording.end(torch.device("cuda", 0))
    assert fake_history.is_enabled() and fake_history.settings == theirs
    assert [call for call, _ in fake_history.calls] == ["record", "snapshot"]
    assert load(path) == fake_history.snapshot  # their entries, kept
    assert recording.notes == [
        "Your program was already recording CUDA's allocation history "
        "(torch.cuda.memory._record_memory_history): the memory_viz snapshot was taken from "
        "that recording, which memsentry left as it was (still on, with your stacks and "
        "max_entries rather than snapshot_entries), so it also holds what was recorded before "
        "tracking began."]


def test_on_cuda_a_torch_that_cannot_say_whether_the_program_records_gets_no_snapshot(
        tmp_path: Path, fake_history: FakeHistory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without torch._C._cuda_isHistoryEnabled memsentry cannot tell whether switching its
    recording on and off would end the program's: it records nothing and says what to do."""
    monkeypatch.delattr(torch._C, "_cuda_isHistoryEnabled")
    torch.cuda.memory._record_memory_history(stacks="all", max_entries=100)
    path = tmp_path / "cuda.pickle"
    recording = SnapshotRecording(options(snapshot=path))
    recording.start(cuda_recorder())
    recording.end(torch.device("cuda", 0))
    assert [call for call, _ in fake_history.calls] == ["record"]  # the program's own
    assert fake_history.settings == {"enabled": "all", "stacks": "all", "max_entries": 100}
    assert not path.exists() and recording.data() is None
    (note,) = recording.notes
    assert note.startswith("No memory_viz snapshot: this torch cannot say whether your "
                           "program records CUDA's allocation history")
    assert note.endswith("Record it yourself with torch.cuda.memory._record_memory_history() "
                         "and take torch.cuda.memory._snapshot() when tracking ends.")


@pytest.mark.cuda
def test_a_cuda_run_writes_the_allocators_snapshot(tmp_path: Path) -> None:
    path = tmp_path / "gpu.pickle"
    net = make_model().cuda()
    with memsentry.track(net, snapshot=path, on_leak="ignore"):
        for _ in range(3):
            net(torch.randn(32, 64, device="cuda")).sum().backward()
    data = load(path)
    assert any(e["action"] == "alloc" for e in data["device_traces"][0])
    _memory_viz.segsum(data)
    _memory_viz.trace_plot(data)


# -- memsentry run --snapshot ----------------------------------------------------------------


def test_run_writes_a_snapshot_of_the_leaky_sample(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "leaky.pickle"
    script = SAMPLES / "train_leaky.py"
    code = main(["run", "--snapshot", str(path), str(script), "--steps", "5", "--batch", "16",
                 "--device", "cpu"])
    captured = capsys.readouterr()
    assert code == 0
    assert "memsentry: cpu (cpu-storages" in captured.out  # --snapshot implied --exact
    assert f"memsentry: memory_viz snapshot written to {path} (" in captured.err
    data = load(path)
    torch_reads(data)
    replay(data)
    # The script's globals are gone when its module ends, before tracking does: the trace
    # has the history, the segments what outlived the script.
    stacks = [[(f["filename"], f["line"]) for f in e["frames"]]
              for e in data["device_traces"][0] if e["action"] == "alloc"]
    kept = [stack for stack in stacks if (str(script), 29) in stack]  # val_logits.append(...)
    assert len(kept) >= 5 * 3  # each validation forward's activations and output
    users = [[f for f, _ in stack if not Path(f).is_relative_to(TORCH)] for stack in kept]
    assert all(files[0] == str(SAMPLES / "toy.py") for files in users)  # Classifier.forward


def test_run_checks_the_snapshot_path_before_the_script(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "missing" / "s.pickle"
    code = main(["run", "--snapshot", str(target), str(SAMPLES / "train_leaky.py")])
    captured = capsys.readouterr()
    assert code == 2
    assert "validation accuracy" not in captured.out  # the script never started
    assert captured.err == (f"memsentry run: --snapshot: the folder of {str(target)!r} does "
                            "not exist; create it first\n")
