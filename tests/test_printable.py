"""Names from the watched program cannot drive the terminal: a module named
"\\x1b]0;x\\x07\\x1b[2J" (retitle the window, clear the screen) or an attribute holding a leak
named with a bidirectional override prints as visible escapes in the text report, `memsentry
show`, `memsentry diff`, `memsentry run`, the out-of-memory note and the command's errors;
JSON keeps the names as they are and HTML escapes them as HTML."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import memsentry
from memsentry import Report
from memsentry.cli import main
from memsentry.model import Breakdown, OutOfMemory, Phase
from memsentry.reporters.oom import oom_note, render_oom
from memsentry.usercode.text import printable, printable_values

CLEAR = "\x1b]0;x\x07\x1b[2J"  # an OSC title, a bell, an erase-display
CLEAR_SHOWN = "\\x1b]0;x\\x07\\x1b[2J"
HOLDER = "\u202ehist\x1b[31m"  # right-to-left override, then red
HOLDER_SHOWN = "\\u202ehist\\x1b[31m"
MARKUP = "<script>alert(1)</script>"

#: What no text output may hold raw: every control but the layout's newline, DEL, C1, the
#: bidirectional controls, and lone surrogates.
RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e"
                 "\u2066-\u2069\ud800-\udfff]")


class Logger:
    pass


def _run(odd: bool) -> Report:
    """A real run; with ``odd``, a layer named CLEAR, one named MARKUP and a leak kept in an
    attribute named HOLDER."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
    model.add_module(CLEAR if odd else "head", nn.Linear(32, 4))
    if odd:
        model.add_module(MARKUP, nn.Identity())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    logger = Logger()
    name = HOLDER if odd else "hist"
    setattr(logger, name, [])
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(8):
            out = model(torch.randn(8, 16))
            out.pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            getattr(logger, name).append(out)
    return t.report()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Report, Path, Path]:
    odd, plain = _run(True), _run(False)
    folder = tmp_path_factory.mktemp("runs")
    odd.to_json(folder / "odd.json")
    plain.to_json(folder / "plain.json")
    return odd, folder / "odd.json", folder / "plain.json"


def _clean(text: str) -> None:
    found = RAW.search(text)
    assert found is None, (found.group(), text[max(0, found.start() - 40):found.start() + 40])


@pytest.mark.parametrize(("text", "shown"), [
    ("plain name", "plain name"),
    ("layers.0.Δ-é-日本", "layers.0.Δ-é-日本"),
    ("C:\\runs\\model.py", "C:\\runs\\model.py"),  # a backslash stays itself
    ("\x00\x07\x08\t\n\r\x1b\x7f", "\\x00\\x07\\x08\\x09\\x0a\\x0d\\x1b\\x7f"),
    ("\x85\x9b31m", "\\x85\\x9b31m"),  # C1: NEL and the one-byte CSI
    ("a\u202eb\u2066c\u2069\u200f", "a\\u202eb\\u2066c\\u2069\\u200f"),
    ("line\u2028break", "line\\u2028break"),
    ("\udcff.py", "\\udcff.py"),  # an undecodable byte of a file name (surrogateescape)
])
def test_printable_writes_controls_as_escapes(text: str, shown: str) -> None:
    assert printable(text) == shown
    assert printable(shown) == shown  # escaping twice changes nothing


def test_printable_values_rebuilds_only_what_holds_a_control() -> None:
    oom = OutOfMemory(error="RuntimeError", message="plain", phase=Phase.FORWARD, layer=CLEAR,
                      iteration=2, requested_bytes=None,
                      breakdown=Breakdown.of(10, parameters=1, gradients=1, optimizer_state=0,
                                             activations=4))
    shown = printable_values(oom)
    assert shown.layer == CLEAR_SHOWN and oom.layer == CLEAR  # the value is not changed
    assert shown.breakdown is oom.breakdown  # nothing to escape: the same object
    assert printable_values(shown) is shown
    assert printable_values({"k\x1b": ("a", "\x07")}) == {"k\\x1b": ("a", "\\x07")}


def test_the_text_report_escapes_names_from_the_program(runs: tuple[Report, Path, Path]) -> None:
    report, _, _ = runs
    assert CLEAR in [layer.name for layer in report.layers]  # the value keeps the name
    text = str(report)
    _clean(text)
    assert re.search(re.escape(CLEAR_SHOWN) + " +Linear", text)  # its row of the table
    assert f"`logger.{HOLDER_SHOWN}`" in text  # the leak's holder, in its finding


def test_show_prints_escapes_and_json_keeps_the_names(
    runs: tuple[Report, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report, odd, _ = runs
    assert main(["show", str(odd)]) == 0
    out = capsys.readouterr().out
    _clean(out)
    assert out == str(report) + "\n" and CLEAR_SHOWN in out
    assert main(["show", str(odd), "-o", str(tmp_path / "r.txt")]) == 0
    _clean((tmp_path / "r.txt").read_text(encoding="utf-8"))
    assert main(["show", "--format", "json", str(odd)]) == 0
    out = capsys.readouterr().out
    _clean(out)  # JSON writes them as \u001b
    again = Report.from_dict(json.loads(out))
    assert again == report and CLEAR in [layer.name for layer in again.layers]


def test_diff_prints_escapes(runs: tuple[Report, Path, Path],
                             capsys: pytest.CaptureFixture[str]) -> None:
    _, odd, plain = runs
    assert main(["diff", str(plain), str(odd), "--top", "30"]) == 0
    out = capsys.readouterr().out
    _clean(out)
    assert f"{CLEAR_SHOWN} (added)" in out
    assert out == memsentry.diff(plain, odd).format(top=30) + "\n"  # the API's text too


def test_the_html_page_escapes_markup(runs: tuple[Report, Path, Path]) -> None:
    pytest.importorskip("plotly")
    report, _, _ = runs
    page = report.to_html()
    assert MARKUP not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page


def test_the_out_of_memory_note_escapes_the_layer_and_message() -> None:
    oom = OutOfMemory(error="RuntimeError", message=f"failed in {CLEAR}", phase=Phase.FORWARD,
                      layer=CLEAR, iteration=2, requested_bytes=2**30,
                      breakdown=Breakdown.of(2**20, parameters=1, gradients=1,
                                             optimizer_state=0, activations=4))
    for text in (oom_note(oom), render_oom(oom)):
        _clean(text)
        assert f"forward of `{CLEAR_SHOWN}`" in text
    assert f"error: failed in {CLEAR_SHOWN}" in render_oom(oom)


def test_the_commands_errors_escape_the_paths_they_echo(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / f"{CLEAR}.json"
    folder.mkdir()
    assert main(["show", str(folder)]) == 2
    err = capsys.readouterr().err
    _clean(err)
    assert f"{CLEAR_SHOWN}.json: is a directory, not a report" in err
    assert main(["diff", str(folder), str(folder)]) == 2
    _clean(capsys.readouterr().err)


SCRIPT = f"""
import torch
from torch import nn

model = nn.Sequential(nn.Linear(4, 4))
model.add_module({CLEAR!r}, nn.Linear(4, 2))
for _ in range(3):
    model(torch.randn(2, 4)).sum().backward()
"""


def test_run_prints_escapes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "odd_names.py"
    script.write_text(SCRIPT, encoding="utf-8")
    assert main(["run", "--json", str(tmp_path / "r.json"), str(script)]) == 0
    out = capsys.readouterr().out
    _clean(out)
    assert f"{CLEAR_SHOWN} Linear" in out
    saved = Report.from_json(tmp_path / "r.json")
    assert CLEAR in [layer.name for layer in saved.layers]


def test_an_undecodable_file_name_is_written_as_an_escape_in_every_output(
    runs: tuple[Report, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A file name with a byte that is not UTF-8 reaches Python as a lone surrogate
    # (surrogateescape); JSON keeps it as "\udcff", and no output may fail to encode it.
    pytest.importorskip("plotly")
    _, odd, plain = runs
    data = json.loads(odd.read_text(encoding="utf-8"))
    data["layers"][1]["name"] = "caf\udcff.py"
    damaged = tmp_path / "surrogate.json"
    damaged.write_text(json.dumps(data), encoding="utf-8")
    assert main(["show", str(damaged), "-o", str(tmp_path / "r.txt")]) == 0
    assert "caf\\udcff.py" in (tmp_path / "r.txt").read_text(encoding="utf-8")
    assert main(["show", str(damaged), "--html", str(tmp_path / "r.html")]) == 0
    assert main(["diff", str(plain), str(damaged), "--html", str(tmp_path / "d.html")]) == 0
    for page in ("r.html", "d.html"):
        assert "caf\\udcff.py" in (tmp_path / page).read_text(encoding="utf-8")
    capsys.readouterr()


def test_the_leak_warning_escapes_the_holders_name() -> None:
    """The LeakWarning is printed to a terminal by Python's warning machinery."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    logger = Logger()
    setattr(logger, HOLDER, [])
    with pytest.warns(memsentry.LeakWarning) as caught:
        with memsentry.track(model):
            for _ in range(8):
                out = model(torch.randn(4, 8))
                out.sum().backward()
                opt.step()
                opt.zero_grad()
                getattr(logger, HOLDER).append(out)
    text = str(caught[0].message)
    _clean(text)
    assert f"`logger.{HOLDER_SHOWN}`" in text
