"""The HTML report: a self-contained page of a real leaky run, its charts' data, thinning of
long timelines, the notebook display and the command-line options that write it."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

import memsentry
from memsentry import Boundary, IterationStats, Report
from memsentry.cli import main
from memsentry.model import Breakdown
from memsentry.reporters import plotly as plotly_source
from memsentry.reporters.charts import thin, timeline_figure
from memsentry.reporters.plotly import ChartsUnavailable

pytest.importorskip("plotly", reason="the HTML report needs plotly (memsentry[html])")

REPO = Path(__file__).resolve().parent.parent


def leaky_loop(steps: int = 12) -> tuple[Report, list[float]]:
    """A small classifier whose loop keeps every step's loss with its graph in a list."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    kept_losses = []
    with memsentry.track(model, exact=True, on_leak="ignore") as tracker:
        for _ in range(steps):
            loss = nn.functional.cross_entropy(model(torch.randn(32, 64)),
                                               torch.randint(0, 10, (32,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
            kept_losses.append(loss)  # the leak: every step's graph stays alive
    return tracker.report(), [x.item() for x in kept_losses]


@pytest.fixture(scope="module")
def leaky() -> Report:
    return leaky_loop()[0]


def _data_of(page: str, dom: str = "memsentry") -> dict:
    found = re.search(rf'<script type="application/json" id="{dom}-data">(.*?)</script>',
                      page, re.S)
    assert found is not None
    return json.loads(found.group(1).replace("<\\/", "</"))


def test_page_of_a_leaky_run_carries_findings_timeline_and_layers(
        leaky: Report, tmp_path: Path) -> None:
    path = tmp_path / "report.html"
    page = leaky.to_html(path)
    assert path.read_text(encoding="utf-8") == page + "\n"
    # The verdict, its holder, line and fix are on the page.
    finding = next(f for f in leaky.findings if f.rule == "tensor-accumulation")
    assert "<code>kept_losses</code>" in page
    assert f"test_html.py:{finding.location.line}" in page  # type: ignore[union-attr]
    assert "store <code>.detach()</code>" in page or "<code>.item()</code>" in page
    # The finding links to the iteration whose census saw it, and the chart marks it there.
    assert finding.iteration is not None
    assert f'data-iteration="{finding.iteration}"' in page
    figure = _data_of(page)["figures"]["timeline"]
    names = [trace["name"] for trace in figure["data"]]
    assert {"allocated", "peak", "census", "LEAK finding"} <= set(names)
    assert {"parameters", "gradients", "optimizer state", "activations", "other"} <= set(names)
    marked = next(t for t in figure["data"] if t["name"] == "LEAK finding")
    assert finding.iteration in marked["x"]
    allocated = next(t for t in figure["data"] if t["name"] == "allocated")
    assert allocated["x"] == [it.index for it in leaky.iterations]
    # Every layer is a row of the table, nested under its parent.
    for layer in leaky.layers:
        assert f"<code>{layer.name}</code>" in page
    assert page.count('data-parent="0"') == 5  # the five children of the Sequential
    # Self-contained: plotly.js is inside, nothing is loaded from elsewhere.
    assert "plotly.js v" in page
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=", page)


def test_tracking_with_html_in_mind_changes_nothing() -> None:
    """The loop's results are the same bitwise whatever is made of the report later."""
    first, losses = leaky_loop(6)
    first.to_html()
    torch.manual_seed(0)
    _again, losses_again = leaky_loop(6)
    assert losses == losses_again


def _iteration(index: int, allocated: int, peak: int) -> IterationStats:
    return IterationStats(index=index, allocated=allocated, reserved=None, peak=peak,
                          seconds=0.01, boundary=Boundary.STEP)


def test_a_10k_iteration_timeline_is_thinned_keeping_every_peak() -> None:
    mib = 2**20
    iterations = [_iteration(i, 100 * mib + (i % 50) * mib, 160 * mib) for i in range(10_000)]
    iterations[7_777] = _iteration(7_777, 120 * mib, 900 * mib)  # one spike
    iterations[123] = _iteration(123, 20 * mib, 160 * mib)  # one dip
    report = Report(device="cpu", backend="cpu-storages", baseline=0,
                    iterations=tuple(iterations), peak=900 * mib)
    shown = thin(report.iterations, 1500)
    assert len(shown) <= 1500
    assert [it.index for it in shown] == sorted(it.index for it in shown)
    assert any(it.index == 7_777 for it in shown)
    assert any(it.index == 123 for it in shown)
    figure = timeline_figure(report)
    assert figure is not None
    peak = next(t for t in figure["data"] if t["name"] == "peak")
    assert max(peak["y"]) == 900.0  # MiB, the unit of the axis
    assert "MiB" in figure["layout"]["yaxis"]["title"]["text"]
    assert f"{len(shown):,} drawn" in figure["layout"]["title"]["text"]
    page = report.to_html()
    assert len(page) < len(plotly_source.plotly_js()) + 1_000_000


def test_a_short_run_has_a_tick_at_each_whole_iteration_only() -> None:
    mib = 2**20
    short = Report(device="cpu", backend="cpu-storages", baseline=0, peak=9 * mib,
                   iterations=tuple(_iteration(i, mib, 9 * mib) for i in range(4)))
    figure = timeline_figure(short)
    assert figure is not None and figure["layout"]["xaxis"]["dtick"] == 1  # no 0.5, 1.5, ...
    long = Report(device="cpu", backend="cpu-storages", baseline=0, peak=9 * mib,
                  iterations=tuple(_iteration(i, mib, 9 * mib) for i in range(200)))
    figure = timeline_figure(long)
    assert figure is not None and "dtick" not in figure["layout"]["xaxis"]  # plotly's choice


def test_the_breakdown_is_stacked_only_where_a_peak_was_broken_down() -> None:
    """Under a cost budget only some iterations break their peak down: the stacked parts
    join those, and never fall to zero in between (plotly stacks a gap as zero)."""
    mib = 2**20
    parts = Breakdown.of(8 * mib, parameters=2 * mib, gradients=2 * mib, optimizer_state=mib,
                         activations=2 * mib)
    iterations = tuple(replace(_iteration(i, 4 * mib, 8 * mib),
                               parts=parts if i % 5 == 0 else None) for i in range(20))
    report = Report(device="cpu", backend="cpu-storages", baseline=0, peak=8 * mib,
                    iterations=iterations)
    figure = timeline_figure(report)
    assert figure is not None
    stacked = [t for t in figure["data"] if t.get("stackgroup") == "peak"]
    assert stacked and all(t["x"] == [0, 5, 10, 15] for t in stacked)
    assert all(None not in t["y"] and 0 not in t["y"] for t in stacked if t["name"] != "other")
    allocated = next(t for t in figure["data"] if t["name"] == "allocated")
    assert allocated["x"] == list(range(20))


def test_the_page_title_is_the_verdict(leaky: Report) -> None:
    page = leaky.to_html()
    title = re.search(r"<title>(.*?)</title>", page)
    assert title is not None
    assert re.fullmatch(r"memsentry: 1 leak: `kept_losses` at \S*test_html\.py:\d+ "
                        r"\(tensor-accumulation\) \(cpu\)", title.group(1))
    assert title.group(1).endswith("(cpu)")
    assert f"<h1>{title.group(1)}</h1>" in page
    clean = Report(device="cpu", backend="cpu-storages", baseline=0)
    assert "<title>memsentry: no finding (cpu)</title>" in clean.to_html()


def test_notebook_display_is_compact_and_sends_plotly_once(leaky: Report,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import memsentry.report as report_module

    monkeypatch.setattr(report_module, "_PLOTLY_SENT", False)
    first, second = leaky._repr_html_(), leaky._repr_html_()
    assert "plotly.js v" in first and "plotly.js v" not in second
    ids = re.findall(r'<div class="memsentry" id="([^"]+)"', first + second)
    assert len(ids) == 2 and ids[0] != ids[1]
    # Findings, then the timeline, then the folded tables.
    findings, timeline = first.index("Findings ("), first.index("-timeline")
    layers = first.index("Layers (")
    assert findings < timeline < layers
    assert "<details><summary>Tables and notes" in first


def test_without_plotly_the_page_says_how_to_get_it(
        leaky: Report, monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import memsentry.report as report_module

    monkeypatch.setattr(plotly_source, "have_plotly", lambda: False)
    monkeypatch.setattr(report_module, "have_plotly", lambda: False)
    plotly_source.plotly_js.cache_clear()
    try:
        with pytest.raises(ChartsUnavailable, match=r"pip install 'memsentry\[html\]'"):
            leaky.to_html()
        # A notebook still shows the findings and tables, and says why there is no chart.
        fragment = leaky._repr_html_()
        assert "Findings (" in fragment and "plotly.js v" not in fragment
        # The command refuses before running the script, so no run is wasted.
        script = tmp_path / "script.py"
        script.write_text("open('ran', 'w').write('yes')\n", encoding="utf-8")
        code = main(["run", "--html", str(tmp_path / "r.html"), str(script)])
        assert code == 2
        assert "memsentry[html]" in capsys.readouterr().err
        assert not (tmp_path / "ran").exists()
    finally:
        plotly_source.plotly_js.cache_clear()


def test_run_and_show_write_the_page(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code = main(["run", "--json", "r.json", "--html", "r.html",
                 str(REPO / "samples" / "train_leaky.py"), "--steps", "6", "--batch", "16",
                 "--device", "cpu"])
    captured = capsys.readouterr()
    assert code == 0
    assert "HTML report written to r.html" in captured.err  # standard output: reports only
    assert "HTML report written" not in captured.out
    page = (tmp_path / "r.html").read_text(encoding="utf-8")
    assert "running_loss" in page and "val_logits" in page
    assert main(["show", "r.json", "--html", "again.html"]) == 0
    again = (tmp_path / "again.html").read_text(encoding="utf-8")
    assert _data_of(again) == _data_of(page)
    assert main(["show", "r.json", "--format", "html", "-o", "third.html"]) == 0
    assert (tmp_path / "third.html").read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    # A folder that does not exist is refused before the script runs.
    assert main(["run", "--html", "no/such/r.html", str(REPO / "samples" / "toy.py")]) == 2
    assert "--html" in capsys.readouterr().err


def test_ipython_displays_a_report_as_the_page(leaky: Report,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A real IPython shell's display formatter picks the HTML; the text stays the plain
    form (what a terminal or a log shows)."""
    interactive = pytest.importorskip("IPython.core.interactiveshell")
    import memsentry.report as report_module

    monkeypatch.setattr(report_module, "_PLOTLY_SENT", False)
    shell = interactive.InteractiveShell.instance()
    bundle, _metadata = shell.display_formatter.format(leaky)
    assert "Findings (" in bundle["text/html"] and "plotly.js v" in bundle["text/html"]
    assert bundle["text/plain"].startswith("Report(")
