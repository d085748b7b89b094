"""Every report file is read or refused in one line: `memsentry show`, `memsentry diff` and
`Report.from_json` on real reports damaged at random (keys deleted, values replaced by nulls,
strings, huge numbers, nested lists; the file truncated or garbled) and on the files that
used to escape as tracebacks or never return (10**400, null, deep nesting, /dev/zero, a
FIFO, a directory, a file over the size limit)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import io
import json
import math
import os
import subprocess
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import make_mlp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import memsentry
from memsentry import Report, ReportData, ReportError
from memsentry.cli import main
from memsentry.measure.nvml import NvmlInfo
from memsentry.model.reading import MAX_BYTES_VARIABLE

TIB = 2**40


def _leaky() -> Report:
    """A real run with a leak, censuses and a breakdown at every iteration."""
    torch.manual_seed(0)
    model = make_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    kept = []
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(7):
            out = model(torch.randn(8, 16))
            out.pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            kept.append(out)
    return t.report()


class _Failing(nn.Module):
    """Asks for 1 TiB at its third call: a real out-of-memory error of the CPU allocator."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        x = self.linear(x)
        return x + torch.empty(TIB, dtype=torch.uint8)[:1].float() if self.calls >= 3 else x


def _out_of_memory() -> Report:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), _Failing(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tracker = memsentry.track(model, on_leak="ignore")
    tracker.start()
    try:
        for _ in range(5):
            model(torch.randn(8, 16)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    except RuntimeError:
        return tracker.stop()
    raise AssertionError("the loop did not fail")


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Real reports as plain data: a leaky run, a run ended by an out-of-memory error, and
    the leaky run as rank 0's report of a two-process group (its ranks inside)."""
    leaky, oom = _leaky(), _out_of_memory()
    assert oom.oom is not None and leaky.censuses and leaky.findings
    own = ReportData.from_dict(leaky.to_dict())
    # What a CUDA run adds, as the recorder writes it: NVML's record (with its nulls) and
    # the caching allocator's counters.
    gpu = dataclasses.asdict(NvmlInfo(True, index=0, name="NVIDIA H100 80GB HBM3",
                                      used=3 * 2**30, total=80 * 2**30,
                                      process_used=2**30, gpu_utilization=7))
    counters = {"allocated_bytes.all.current": 2**20, "num_alloc_retries": 0,
                "inactive_split_bytes.all.current": 512}
    oom = dataclasses.replace(oom, nvml=dataclasses.asdict(NvmlInfo(False, reason="no NVML")))
    group = dataclasses.replace(leaky, rank=0, world_size=2, host="a", nvml=gpu,
                                allocator_stats=counters,
                                ranks=(dataclasses.replace(own, rank=0, world_size=2),
                                       dataclasses.replace(own, rank=1, world_size=2)))
    folder = tmp_path_factory.mktemp("good")
    good = folder / "good.json"
    leaky.to_json(good)
    return {"leaky": leaky.to_dict(), "oom": oom.to_dict(), "group": group.to_dict(),
            "good": str(good)}


# -- what a value read may hold ---------------------------------------------------------------

def _holds(kind: Any, value: Any) -> bool:
    """Whether ``value`` is of the declared type ``kind`` (deeply)."""
    origin = typing.get_origin(kind)
    if origin is typing.Union or origin is types.UnionType:
        return any(_holds(arm, value) for arm in typing.get_args(kind))
    if kind is type(None):
        return value is None
    if kind is Any:
        return True
    if origin is tuple:
        args = typing.get_args(kind)
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_holds(args[0], item) for item in value)
        return len(args) == len(value) and all(map(_holds, args, value))
    if origin is dict:
        return isinstance(value, dict) and all(isinstance(k, str) for k in value)
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        hints = typing.get_type_hints(kind)
        return isinstance(value, kind) and all(
            _holds(hints[f.name], getattr(value, f.name)) for f in dataclasses.fields(kind))
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return isinstance(value, kind)
    if kind is int:
        return type(value) is int and abs(value) < 2**64
    if kind is float:
        return type(value) is float and math.isfinite(value)
    return type(value) is kind


# -- damaging a report ------------------------------------------------------------------------

def _paths(tree: Any, here: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield here
    if isinstance(tree, dict):
        for key, item in tree.items():
            yield from _paths(item, (*here, key))
    elif isinstance(tree, list):
        for index, item in enumerate(tree):
            yield from _paths(item, (*here, index))


JUNK = st.sampled_from([
    None, "", "lots", "\x1b[2J", 10**400, -(10**400), 2**64, -1, -(2**63), 0.5, 1e308,
    float("inf"), float("-inf"), float("nan"), True, False, [], {}, [[[[]]]], [None],
    {"device": None}, "0" * 50, 10**24, 0, 2**64 - 1, "\u202e\ud800", "step", "exit",
    {"available": True, "used": "x", "total": [1], "process_used": None, "reason": 3},
]) | st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                max_size=3),
    max_leaves=6,
)


def _at(tree: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        tree = tree[step]
    return tree


def _damage(data: st.DataObject, tree: Any) -> Any:
    """One change at a random place of ``tree``: a key deleted, a value replaced by junk, or
    by the value of a field of the same name elsewhere (well typed, but not as memsentry
    writes it: two iterations of one index, say)."""
    paths = list(_paths(tree))
    top = [p for p in paths if len(p) == 1]
    path = data.draw(st.sampled_from(top) if top and data.draw(st.booleans(), label="top")
                     else st.sampled_from(paths[1:] or paths), label="path")
    if not path:
        return data.draw(JUNK, label="whole")
    parent = _at(tree, path[:-1])
    how = data.draw(st.sampled_from(["delete", "junk", "junk", "copy", "resample"]),
                    label="how")
    value = parent[path[-1]]
    if how == "resample" and isinstance(value, list) and value:
        # the list's own items, some repeated or left out: [it3, it3, it3]
        picks = data.draw(st.lists(st.integers(0, len(value) - 1), max_size=len(value) + 2),
                          label="picks")
        parent[path[-1]] = [copy.deepcopy(value[i]) for i in picks]
        return tree
    namesakes = [p for p in paths if p and p[-1] == path[-1] and p != path
                 and not p[:len(path)] == path and not path[:len(p)] == p]
    if how == "delete" and isinstance(parent, dict):
        del parent[path[-1]]
    elif how == "copy" and namesakes:
        source = data.draw(st.sampled_from(namesakes), label="from")
        parent[path[-1]] = copy.deepcopy(_at(tree, source))
    else:
        parent[path[-1]] = data.draw(JUNK, label="value")
    return tree


def _file_bytes(data: st.DataObject, tree: Any) -> bytes:
    """The damaged report as a file, sometimes cut short or with bytes garbled."""
    raw = json.dumps(tree).encode()
    how = data.draw(st.sampled_from(["whole", "whole", "whole", "truncated", "garbled",
                                     "random"]), label="file")
    if how == "truncated":
        raw = raw[:data.draw(st.integers(0, len(raw)), label="cut")]
    elif how == "garbled":
        at = data.draw(st.integers(0, len(raw)), label="at")
        raw = raw[:at] + data.draw(st.binary(min_size=1, max_size=8), label="bytes") + raw[at:]
    elif how == "random":
        raw = data.draw(st.binary(max_size=64), label="random")
    return raw


def _command(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def _read_or_refused(path: Path) -> Report | None:
    """``Report.from_json``: a report holding only its declared types, or ReportError."""
    try:
        report = Report.from_json(path)
    except ReportError as error:
        assert "\n" not in str(error) and str(error).startswith(f"{path}: ")
        return None
    assert _holds(Report, report)
    assert Report.from_dict(report.to_dict()) == report
    return report


def _one_line_or_works(code: int, out: str, err: str, command: str) -> None:
    if code == 2:
        assert out == "" or command == "diff"
        assert err.startswith(f"memsentry {command}: ") and err.count("\n") == 1, err
    else:
        assert code == 0, (code, err)
        assert out


@settings(max_examples=int(os.environ.get("MEMSENTRY_FUZZ_EXAMPLES", "200")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_damaged_reports_are_read_or_refused_in_one_line(
    reports: dict[str, Any], tmp_path: Path, data: st.DataObject
) -> None:
    tree = copy.deepcopy(reports[data.draw(st.sampled_from(["leaky", "oom", "group"]),
                                            label="report")])
    if data.draw(st.booleans(), label="legacy"):
        tree["schema"] = 1  # read as memsentry 0.1.0's layout, upgraded first
    for _ in range(data.draw(st.integers(1, 3), label="changes")):
        tree = _damage(data, tree)
    path = tmp_path / "damaged.json"
    path.write_bytes(_file_bytes(data, tree))

    report = _read_or_refused(path)
    code, out, err = _command(["show", str(path)])
    _one_line_or_works(code, out, err, "show")
    assert (code == 0) == (report is not None)
    if report is not None:
        assert out == str(report) + "\n"
        code, out, err = _command(["show", "--format", "json", str(path)])
        assert (code, err) == (0, "") and Report.from_dict(json.loads(out)) == report
    for argv in (["diff", reports["good"], str(path)], ["diff", str(path), reports["good"]]):
        code, out, err = _command(argv)
        _one_line_or_works(code, out, err, "diff")
        assert (code == 0) == (report is not None)


# -- the cases that escaped ------------------------------------------------------------------

def _edited(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "edited.json"
    path.write_text(text, encoding="utf-8")
    return path


def _refused(path: Path | str, *message: str) -> None:
    """``show``, ``diff`` and ``from_json`` each refuse ``path`` in one line saying
    ``message``."""
    with pytest.raises(ReportError) as caught:
        Report.from_json(path)
    for part in message:
        assert part in str(caught.value)
    assert caught.value.path == str(path)
    for argv in (["show", str(path)], ["diff", str(path), str(path)]):
        code, out, err = _command(argv)
        assert (code, out) == (2, "")
        assert err.count("\n") == 1 and all(part in err for part in message), err


def test_a_number_of_400_digits_is_refused_naming_the_field(
        reports: dict[str, Any], tmp_path: Path) -> None:
    data = copy.deepcopy(reports["leaky"])
    data["iterations"][3]["allocated"] = 10**400
    text = json.dumps(data)
    _refused(_edited(tmp_path, text), "Report.iterations[3].allocated: expected int "
             "below 2**64, got a whole number of 401 digits", "save the report again")


@pytest.mark.parametrize(("where", "value", "message"), [
    (("iterations", 3, "allocated"), None, "Report.iterations[3].allocated: expected int, "
                                           "got null"),
    (("layers", 1, "name"), None, "Report.layers[1].name: expected str, got null"),
    (("findings", 0, "message"), None, "Report.findings[0].message: expected str, got null"),
    (("iterations", 2, "seconds"), float("inf"), "Report.iterations[2].seconds: expected a "
                                                 "finite float, got inf"),
    (("iterations", 2, "peak"), -1, "Report.iterations[2].peak: expected int of 0 or more, "
                                    "got -1"),
    (("layers", 0, "calls"), "7", "Report.layers[0].calls: expected int, got '7'"),
    (("iterations", 0, "boundary"), "lunch", "Report.iterations[0].boundary: expected one "
                                             "of 'optimizer', 'step'"),
    (("censuses", 0, "holders", 0, "path"), [[]], "Report.censuses[0].holders[0].path[0]: "
                                                  "expected an object (Step), got a list"),
    (("layers",), {"a": 1}, "Report.layers: expected a list, got an object with 1 key"),
    (("nvml",), {"used": [[[]]] * 2, "deep": json.loads("[" * 40 + "]" * 40)},
     "Report.nvml['deep']" + "[0]" * 31 + ": nested deeper than 32 levels"),
])
def test_a_field_of_the_wrong_type_is_refused_naming_its_path(
        reports: dict[str, Any], tmp_path: Path, where: tuple[Any, ...], value: Any,
        message: str) -> None:
    data = copy.deepcopy(reports["leaky"])
    parent = data
    for step in where[:-1]:
        parent = parent[step]
    parent[where[-1]] = value
    _refused(_edited(tmp_path, json.dumps(data)), message)


def test_a_missing_field_is_named(reports: dict[str, Any], tmp_path: Path) -> None:
    data = copy.deepcopy(reports["leaky"])
    del data["layers"][2]["calls"]
    _refused(_edited(tmp_path, json.dumps(data)),
             "Report.layers[2].calls: missing; expected int")


def test_negative_changes_stay_readable(reports: dict[str, Any], tmp_path: Path) -> None:
    # A layer's backward can free more than it allocates: its delta is below zero.
    data = copy.deepcopy(reports["leaky"])
    data["layers"][1]["backward_delta"] = -4096
    report = Report.from_dict(data)
    assert report.layers[1].backward_delta == -4096


@pytest.mark.parametrize("depth", [100, 100_000])
def test_deep_nesting_is_refused(reports: dict[str, Any], tmp_path: Path, depth: int) -> None:
    nested = "[" * depth + "]" * depth
    head = '{"device": "cpu", "backend": "x", "baseline": 0, "schema": 2, "nvml": '
    path = _edited(tmp_path, head + nested + "}")
    _refused(path, "nest")


def test_deeply_nested_ranks_are_refused(reports: dict[str, Any]) -> None:
    data: dict[str, Any] = {"device": "cpu", "backend": "x", "baseline": 0}
    for _ in range(300):
        data = {"device": "cpu", "backend": "x", "baseline": 0, "ranks": [data]}
    with pytest.raises(ReportError, match="nested deeper than 32 levels"):
        Report.from_dict(data)


def test_a_directory_is_refused(tmp_path: Path) -> None:
    _refused(tmp_path, "is a directory, not a report")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    done = subprocess.run([sys.executable, "-m", "memsentry", "show", str(fifo)],
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (f"memsentry show: {fifo}: is a FIFO (named pipe), not a report: a "
                           "report is a file written by `memsentry run --json` or "
                           "Report.to_json()\n")
    _refused(fifo, "FIFO")


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero here")
def test_dev_zero_is_refused_at_once() -> None:
    done = subprocess.run([sys.executable, "-m", "memsentry", "show", "/dev/zero"],
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == ("memsentry show: /dev/zero: is a character device, not a report: a "
                           "report is a file written by `memsentry run --json` or "
                           "Report.to_json()\n")
    _refused("/dev/zero", "is a character device")


def test_a_file_over_the_limit_is_refused_before_it_is_read(tmp_path: Path) -> None:
    big = tmp_path / "big.json"
    with open(big, "wb") as handle:
        handle.truncate(300 * 2**20)  # sparse: nothing is written, nothing need be read
    _refused(big, "is 300 MiB, larger than the 256 MiB memsentry reads",
             f"{MAX_BYTES_VARIABLE}=1GiB")


def test_the_limit_is_set_by_the_environment(
        reports: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    size = os.path.getsize(reports["good"])
    monkeypatch.setenv(MAX_BYTES_VARIABLE, "1KiB")
    _refused(reports["good"], "larger than the 1.0 KiB memsentry reads")
    monkeypatch.setenv(MAX_BYTES_VARIABLE, str(size))
    assert Report.from_json(reports["good"]).device == "cpu"
    monkeypatch.setenv(MAX_BYTES_VARIABLE, "lots")
    with pytest.raises(ReportError, match=f"{MAX_BYTES_VARIABLE}='lots' is not a size"):
        Report.from_json(reports["good"])


def test_json_that_would_swell_in_memory_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Three bytes of "{}," become a 64-byte dict: 256 MiB of them took 6.5 GB.
    monkeypatch.setenv(MAX_BYTES_VARIABLE, "64KiB")
    head = '{"device": "cpu", "backend": "x", "baseline": 0, "x": '
    path = _edited(tmp_path, head + "[" + "{}," * 20_000 + "{}]}")
    _refused(path, "holds 20,003 lists and objects, more than the 2,048 memsentry reads in a "
                   "file of at most 64 KiB", f"{MAX_BYTES_VARIABLE}=1GiB")
    path = _edited(tmp_path, head + "[" + "0," * 20_000 + "0]}")
    _refused(path, "holds 20,003 values, more than the 8,192")


def test_not_utf8_and_too_many_digits_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "latin.json"
    path.write_bytes(b'{"device": "caf\xe9"}')
    _refused(path, "not UTF-8 text (byte 0xe9 at offset 15)")
    path.write_text('{"device": "cpu", "backend": "x", "baseline": ' + "9" * 5000 + "}")
    _refused(path, "a number of more than 4,300 digits")


def test_the_error_is_a_value_error_and_a_memsentry_error(tmp_path: Path) -> None:
    assert issubclass(ReportError, ValueError)
    assert issubclass(ReportError, memsentry.MemsentryError)
    with pytest.raises(FileNotFoundError):  # the system's own error, as open() raises it
        Report.from_json(tmp_path / "absent.json")
    with pytest.raises(ReportError, match="not a file name: it holds a NUL character"):
        Report.from_json("report\0.json")


def test_a_real_report_reads_back_whole(reports: dict[str, Any], tmp_path: Path) -> None:
    for name in ("leaky", "oom", "group"):
        path = _edited(tmp_path, json.dumps(reports[name]))
        report = _read_or_refused(path)
        assert report is not None and report.to_dict() == reports[name]


def test_well_typed_oddities_still_show_and_diff(reports: dict[str, Any], tmp_path: Path) -> None:
    # Well typed, but not as memsentry writes them: iterations of one index (no growth rate
    # can be fitted), NVML figures that are not numbers.
    data = copy.deepcopy(reports["leaky"])
    for iteration in data["iterations"]:
        iteration["index"] = 3
    data["nvml"] = {"available": True, "used": "a lot", "total": [1], "process_used": None}
    path = _edited(tmp_path, json.dumps(data))
    code, out, err = _command(["show", str(path)])
    assert (code, err) == (0, "")
    assert "NVML: device used - of -, this process -" in out
    assert "/iter after the first iteration" not in out
    code, out, err = _command(["diff", reports["good"], str(path)])
    assert (code, err) == (0, "")
    assert "a run has too few iterations for a growth rate" in out
