"""Reporters and `memsentry show`: a saved report renders again exactly as it was printed,
as text or JSON; bad files get a clear message; reports of memsentry 0.1.0 still read."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from conftest import make_mlp

import memsentry
from memsentry import REPORTERS, Report, Severity
from memsentry.cli import main
from memsentry.reporters import Reporter, make_reporter


@pytest.fixture(scope="module")
def leaky_report() -> Report:
    """A real run with a leak: outputs kept with their graphs in a list."""
    torch.manual_seed(0)
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kept = []
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(7):
            out = model(torch.randn(8, 16))
            out.pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            kept.append(out)
    report = t.report()
    # (timing hints such as input-bound may join on a loaded machine; the verdicts may not)
    assert [f.rule for f in report.findings if f.severity is not Severity.HINT] == [
        "tensor-accumulation"]
    return report


def _saved(report: Report, tmp_path: Path) -> Path:
    path = tmp_path / "report.json"
    report.to_json(path)
    return path


def test_show_prints_the_text_the_run_printed(
    leaky_report: Report, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["show", str(_saved(leaky_report, tmp_path))]) == 0
    out = capsys.readouterr().out
    assert out == str(leaky_report) + "\n"
    assert "LEAK  tensor-accumulation: `kept`" in out


def test_show_passes_the_table_options(
    leaky_report: Report, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(_saved(leaky_report, tmp_path))
    assert main(["show", "--depth", "0", "--width", "80", path]) == 0
    out = capsys.readouterr().out
    assert out == leaky_report.format(max_depth=0, width=80) + "\n"
    assert "1 of 4 shown: depth <= 0" in out


def test_show_as_json_gives_the_saved_report_back(
    leaky_report: Report, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["show", "--format", "json", str(_saved(leaky_report, tmp_path))]) == 0
    again = Report.from_dict(json.loads(capsys.readouterr().out))
    assert again == leaky_report
    finding = again.findings[0]
    assert finding.subject is not None and finding.subject.name == "kept"
    assert finding.location is not None and finding.location.file.endswith("test_show.py")


def test_show_writes_to_a_file(leaky_report: Report, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "report.txt"
    assert main(["show", str(_saved(leaky_report, tmp_path)), "-o", str(target)]) == 0
    assert capsys.readouterr().out == ""
    assert target.read_text(encoding="utf-8") == str(leaky_report) + "\n"


@pytest.mark.parametrize(("content", "message"), [
    (None, "no such file"),
    ("{not json", "not JSON (Expecting property name enclosed in double quotes at line 1, "
                  "column 2)"),
    ('{"layers": []}', "not a memsentry report"),
    ('{"device": "cpu", "backend": "cpu-mallinfo2", "baseline": 0, "schema": 99}',
     "schema 99, newer than this memsentry reads"),
])
def test_show_says_what_is_wrong_with_the_file(
    content: str | None, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    assert main(["show", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("memsentry show: ") and message in captured.err


def test_show_rejects_an_unknown_format(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["show", "--format", "yaml", str(tmp_path / "r.json")])
    assert exited.value.code == 2
    assert "invalid choice: 'yaml'" in capsys.readouterr().err


SCHEMA_1 = {
    "schema": 1, "device": "cpu", "backend": "cpu-mallinfo2", "baseline": 1000,
    "layers": [], "peak_mode": "sampled", "notes": [],
    "iterations": [{"index": i, "allocated": 1000 + i, "reserved": None, "peak": 1000 + i,
                    "seconds": 0.01, "boundary": "optimizer"} for i in range(3)],
    "findings": [{"rule": "retained-graph", "severity": "leak", "message": "`total` grows",
                  "fix": "use .item()", "bytes": 64, "rate": 8.0, "where": "train.py:12"},
                 {"rule": "hook-accumulation", "severity": "leak", "message": "hooks",
                  "fix": "remove them", "bytes": None, "rate": None, "where": "head"}],
    "censuses": [{"iteration": 2, "seconds": 0.001, "complete": True, "objects": 10,
                  "holders": [{"name": "total", "kind": "local", "scope": "train() in t.py",
                               "where": "t.py:5", "items": None, "tensors": 1, "bytes": 4}],
                  "hooks": [{"module": "<global>", "count": 2, "hook": "log",
                             "where": "t.py:9"}],
                  "garbage": None}],
    "unused_graphs": [{"module": "Net", "calls": 3, "eval_calls": 3, "saved_bytes": 128,
                       "where": "t.py:20", "function": "evaluate"}],
}


def test_a_report_of_memsentry_0_1_still_reads_and_shows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "old.json"
    path.write_text(json.dumps(SCHEMA_1), encoding="utf-8")
    assert main(["show", str(path)]) == 0
    assert "LEAK  retained-graph [train.py:12]: `total` grows" in capsys.readouterr().out
    report = Report.from_json(path)
    assert report.iterations[0].boundary is memsentry.Boundary.OPTIMIZER
    first, second = report.findings
    assert first.location == memsentry.Location("train.py", 12)
    assert second.location is None and second.subject is not None
    assert second.subject.name == "head"
    (holder,) = report.censuses[0].holders
    assert holder.name == "total" and holder.kind is memsentry.HolderKind.LOCAL
    assert holder.scope == memsentry.Scope(memsentry.ScopeKind.FUNCTION, "train", "t.py")
    assert str(holder.scope) == "train() in t.py"
    assert report.censuses[0].hooks[0].module is None
    assert report.unused_graphs[0].where == memsentry.Location("t.py", 20, "evaluate")


@pytest.mark.parametrize("name", sorted(REPORTERS))
def test_every_reporter_renders_a_report_it_is_given(name: str, leaky_report: Report) -> None:
    reporter = make_reporter(name)
    assert isinstance(reporter, Reporter) and reporter.name == name
    out = io.StringIO()
    reporter.render(leaky_report, out)
    assert out.getvalue() == reporter.text(leaky_report) + "\n"
    assert "tensor-accumulation" in out.getvalue()


def test_reporters_need_only_the_values(leaky_report: Report) -> None:
    # A reporter renders the model's value as it renders a Report: it never needs a tracker.
    data = memsentry.ReportData.from_dict(leaky_report.to_dict())
    assert type(data) is memsentry.ReportData
    assert make_reporter("text").text(data) == str(leaky_report)


def test_an_unknown_format_names_the_known_ones() -> None:
    with pytest.raises(ValueError,
                       match="unknown report format 'pdf': use one of text, json, html"):
        make_reporter("pdf")


def test_show_does_not_import_torch(leaky_report: Report, tmp_path: Path) -> None:
    # Re-reading a report is formatting only: it must work, quickly, where torch is absent.
    import subprocess
    import sys

    path = _saved(leaky_report, tmp_path)
    code = (
        "import sys\n"
        "from memsentry.cli import main\n"
        f"assert main(['show', {str(path)!r}]) == 0\n"
        "assert 'torch' not in sys.modules, 'show imported torch'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "tensor-accumulation" in done.stdout


@pytest.mark.parametrize(("content", "message"), [
    ("{not json", "not JSON (Expecting property name enclosed in double quotes at line 1, "
                  "column 2)"),
    ('{"device": "cpu", "backend": "x", "schema": 99}', "this report has schema 99, newer "
                                                        "than this memsentry reads"),
    ("[1, 2]", "not a memsentry report"),
])
def test_report_from_json_names_the_file_and_what_is_wrong(
        tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError) as caught:
        memsentry.Report.from_json(path)
    assert str(caught.value).startswith(f"{path}: ")
    assert message in str(caught.value)


def test_a_damaged_figure_fails_when_the_report_is_read(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 4)
    with memsentry.track(model, on_leak="ignore") as t:
        model(torch.randn(2, 4))
    good = tmp_path / "good.json"
    t.report().to_json(good)
    data = json.loads(good.read_text())
    data["baseline"] = "lots"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"bad\.json: Report\.baseline: expected int, "
                                         r"got 'lots'"):
        memsentry.Report.from_json(bad)
