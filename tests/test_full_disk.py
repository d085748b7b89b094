"""Nothing the user produced is lost when a write fails: every file memsentry writes (the
report as JSON, text or HTML, a diff, the live ``report_path``, the command's outputs) is
written beside its destination and moved in place whole, so a full disk leaves the last good
file as it was; an unwritable destination is one line and exit status 2, said before any
long work, and a live report file that cannot be written is warned about once."""

from __future__ import annotations

import builtins
import errno
import io
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import memsentry
from memsentry import Report, Severity
from memsentry.cli import main
from memsentry.model import Finding
from memsentry.reporters import write_report
from memsentry.reporters.plotly import have_plotly

SCRIPT = """\
import torch
from torch import nn

model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
print("script ran")
"""


class _Disk:
    """Files opened while ``full`` is set fail part way through, as on a full disk: half of
    the first write lands, then the system says there is no space left."""

    def __init__(self) -> None:
        self.full = False

    def wrap(self, stream: Any) -> Any:
        return _FullFile(stream) if self.full else stream


class _FullFile:
    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(text[: len(text) // 2])
        self._stream.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def __enter__(self) -> _FullFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stream.close()


@pytest.fixture
def disk(monkeypatch: pytest.MonkeyPatch) -> _Disk:
    """The disk files are written to; set ``full`` to fill it up."""
    real, disk = io.open, _Disk()

    def opening(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        stream = real(file, mode, *args, **kwargs)
        return disk.wrap(stream) if "w" in mode or "a" in mode else stream

    monkeypatch.setattr(builtins, "open", opening)
    monkeypatch.setattr(io, "open", opening)
    return disk


def _report(message: str = "`kept` grows by 1 KiB per iteration") -> Report:
    finding = Finding(rule="tensor-accumulation", severity=Severity.LEAK, message=message,
                      fix="append loss.item()", bytes=1024)
    return Report(device="cpu", backend="none", baseline=0, findings=(finding,))


def _good_file(tmp_path: Path, name: str) -> tuple[Path, bytes]:
    """A file the user already has: the last good report."""
    path = tmp_path / name
    _report("the last good run").to_json(path)
    path.chmod(0o640)
    return path, path.read_bytes()


WRITERS: dict[str, Callable[[Report, Path], object]] = {
    "Report.to_json": lambda report, path: report.to_json(path),
    "write_report as text": lambda report, path: write_report(report, path, format="text"),
    "Diff.to_json": lambda report, path: memsentry.diff(report, report).to_json(path),
    "Report.to_html": lambda report, path: report.to_html(path),
}


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_full_disk_leaves_the_last_good_file_whole(
        tmp_path: Path, disk: _Disk, writer: str) -> None:
    if writer.endswith("html") and not have_plotly():
        pytest.skip("the HTML page needs plotly")
    path, before = _good_file(tmp_path, "report.json")
    disk.full = True
    with pytest.raises(OSError) as info:
        WRITERS[writer](_report(), path)
    assert info.value.errno == errno.ENOSPC  # the caller hears of it
    assert path.read_bytes() == before  # byte for byte the last good report
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]  # no temporary left
    disk.full = False  # space freed: the next write replaces it, keeping its permissions
    WRITERS[writer](_report(), path)
    assert path.read_bytes() != before
    assert path.stat().st_mode & 0o777 == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]


def _one_line(err: str, command: str) -> str:
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"memsentry {command}: "), err
    return lines[0]


def test_show_into_a_full_disk_is_one_line_and_keeps_the_old_output(
        tmp_path: Path, disk: _Disk,
        capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "run.json"
    _report().to_json(source)
    target, before = _good_file(tmp_path, "shown.txt")
    disk.full = True
    assert main(["show", str(source), "-o", str(target)]) == 2
    line = _one_line(capsys.readouterr().err, "show")
    assert f"-o: could not write {str(target)!r} (No space left on device)" in line
    assert target.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json", "shown.txt"]


def test_diff_into_a_full_disk_keeps_the_old_output(
        tmp_path: Path, disk: _Disk,
        capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "run.json"
    _report().to_json(source)
    target, before = _good_file(tmp_path, "diff.json")
    disk.full = True
    assert main(["diff", str(source), str(source), "--json", str(target)]) == 2
    assert "No space left on device" in _one_line(capsys.readouterr().err, "diff")
    assert target.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["diff.json", "run.json"]


def test_run_whose_json_meets_a_full_disk_keeps_the_last_report(
        tmp_path: Path, disk: _Disk,
        capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT, encoding="utf-8")
    target, before = _good_file(tmp_path, "run.json")
    disk.full = True
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert main(["run", "--json", str(target), str(script)]) == 2
    captured = capsys.readouterr()
    assert "script ran" in captured.out and "memsentry report" in captured.out
    errors = [line for line in captured.err.splitlines() if line.startswith("memsentry run:")]
    assert errors == [f"memsentry run: --json: could not write {str(target)!r} "
                      "(No space left on device)"]
    assert target.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json", "train.py"]


@pytest.mark.parametrize("command", [
    ["show", "{source}", "-o", "{dest}"],
    ["show", "{source}", "--html", "{dest}"],
    ["diff", "{source}", "{source}", "-o", "{dest}"],
    ["run", "--json", "{dest}", "{script}"],
])
def test_a_destination_under_a_file_is_one_line_and_exit_2_before_any_work(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str]) -> None:
    source, script = tmp_path / "run.json", tmp_path / "train.py"
    _report().to_json(source)
    script.write_text(SCRIPT, encoding="utf-8")
    dest = str(source / "out.txt")  # a folder that is a file: nothing can be written there
    argv = [word.format(source=source, dest=dest, script=script) for word in command]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "script ran" not in captured.out and "memsentry report" not in captured.out
    line = _one_line(captured.err, command[0])
    option = command[command.index("{dest}") - 1]
    assert line == (f"memsentry {command[0]}: {option}: the folder of {dest!r} is a file "
                    f"({str(source)!r}); give a path in a folder")


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))


def test_a_report_path_that_cannot_be_written_is_warned_once_and_the_run_goes_on(
        tmp_path: Path, disk: _Disk, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("memsentry.alarm.REWRITE_SECONDS", 0.0)  # rewritten at every step
    path, before = _good_file(tmp_path, "live.json")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kept = []
    disk.full = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with memsentry.track(model, on_leak="ignore", report_path=path) as t:
            for _ in range(12):
                loss = model(torch.randn(8, 16)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                kept.append(loss)
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
            and "report_path" in str(w.message)]
    assert said == [f"memsentry: report_path {str(path)!r} could not be written (No space "
                    "left on device); it keeps the last report written whole and the run "
                    "goes on; free space there or give report_path a writable place"]
    assert len(kept) == 12  # the loop ran to its end
    assert any("could not be written" in note for note in t.report().notes)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["live.json"]
