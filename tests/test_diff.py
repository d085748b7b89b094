"""`memsentry diff` and `memsentry.diff()`: two real runs of the same program compared.

The runs are the bundled leaky sample's loop and its fixed twin (samples/train_leaky.py and
samples/train_fixed.py, with their model and data), tracked here with memsentry.track and
exact storage counting so that their figures do not depend on what else the test process
allocated; one test runs the samples themselves through `memsentry run` and `memsentry diff`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn

import memsentry
from memsentry import Limits, Report, Severity
from memsentry.cli import main
from memsentry.model import Measured, PeakMode
from memsentry.model.diff import format_share

SAMPLES = Path(__file__).resolve().parent.parent / "samples"
STEPS, BATCH = 10, 64
LEAKS = {"retained-graph", "tensor-accumulation"}


def _toy() -> ModuleType:
    """samples/toy.py (the samples' model and data), under a name of its own."""
    spec = importlib.util.spec_from_file_location("memsentry_diff_toy", SAMPLES / "toy.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _train(*, leaky: bool) -> Report:
    """samples/train_leaky.py's loop (``leaky``) or samples/train_fixed.py's, tracked."""
    toy = _toy()
    torch.manual_seed(0)
    model = toy.Classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    criterion = nn.CrossEntropyLoss()
    x_val, y_val = next(toy.batches(1, BATCH, "cpu"))
    running_loss: torch.Tensor | float = 0.0
    val_logits = []
    correct = 0
    with memsentry.track(model, exact=True, on_leak="ignore") as tracker:
        for x, y in toy.batches(STEPS, BATCH, "cpu"):
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            model.eval()
            if leaky:
                running_loss += loss  # keeps every step's graph
                val_logits.append(model(x_val))  # autograd on: each keeps its activations
            else:
                running_loss += loss.item()
                with torch.no_grad():
                    correct += int((model(x_val).argmax(-1) == y_val).sum())
            model.train()
    return tracker.report()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The leaky run's report and the fixed run's, saved as JSON: (leaky, fixed)."""
    folder = tmp_path_factory.mktemp("diff")
    leaky, fixed = _train(leaky=True), _train(leaky=False)
    assert LEAKS <= {f.rule for f in leaky.findings}
    leaky.to_json(folder / "leaky.json")
    fixed.to_json(folder / "fixed.json")
    return folder / "leaky.json", folder / "fixed.json"


def test_the_fix_lowers_the_peak_and_the_growth_and_its_leaks_disappear(
    runs: tuple[Path, Path],
) -> None:
    leaky_path, fixed_path = runs
    change = memsentry.diff(leaky_path, fixed_path)
    leaky, fixed = Report.from_json(leaky_path), Report.from_json(fixed_path)
    assert change.old.label == str(leaky_path) and change.new.label == str(fixed_path)
    # The peak fell: the leaky loop keeps ten validation forwards' activations alive.
    assert change.peak.old == leaky.peak and change.peak.new == fixed.peak
    delta, share = change.peak_change
    assert leaky.peak is not None and fixed.peak is not None
    assert delta == fixed.peak - leaky.peak < -1024 * 1024
    assert share == pytest.approx(delta / leaky.peak)
    # Growth fell: hundreds of KiB an iteration (a graph and a validation forward a step), 0.
    assert change.growth.old is not None and change.growth.old > 256 * 1024
    assert change.growth.new is not None and abs(change.growth.new) < 1024
    assert change.growth_change == pytest.approx(change.growth.new - change.growth.old)
    assert change.iterations.old == change.iterations.new == STEPS
    # The leaks and the missing no_grad disappeared; the fix brought no finding of its own.
    gone = {f.rule for f in change.disappeared}
    assert gone >= LEAKS | {"missing-no-grad"}
    assert [f for f in change.appeared if f.severity is not Severity.HINT] == []
    # At the peak, the activations saved for the validation forwards are gone.
    categories = {c.name: c.bytes for c in change.categories}
    assert (categories["activations"].old or 0) > 1024 * 1024
    assert categories["activations"].new == 0
    assert categories["parameters"].delta == 0
    assert change.mismatches == ()
    assert not change.unchanged
    # str() is the text: the headline says it in bytes and as a share.
    text = str(change)
    assert text == change.format()
    peak_line = next(line for line in text.splitlines() if line.startswith("peak"))
    assert memsentry.format_bytes(leaky.peak) in peak_line
    assert memsentry.format_bytes(fixed.peak) in peak_line
    assert memsentry.format_bytes(delta, signed=True) in peak_line
    assert format_share(share) in peak_line
    assert "Findings that disappeared" in text and "`running_loss`" in text
    assert "`val_logits`" in text and "Findings that appeared" not in text


def test_the_command_prints_the_diff_and_exits_0_without_limits(
    runs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    leaky_path, fixed_path = runs
    assert main(["diff", str(leaky_path), str(fixed_path)]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert captured.out == str(memsentry.diff(leaky_path, fixed_path)) + "\n"
    assert f"memsentry diff: {leaky_path} -> {fixed_path}" in captured.out
    assert "Findings that disappeared" in captured.out
    assert "tensor-accumulation" in captured.out and "retained-graph" in captured.out
    assert "Limits" not in captured.out and "Within limits" not in captured.out


def test_a_regression_over_the_peak_limit_exits_1_naming_the_increase_and_the_limit(
    runs: tuple[Path, Path], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    leaky_path, fixed_path = runs  # the fixed run is the old one: the leak is the regression
    change = memsentry.diff(fixed_path, leaky_path)
    _, share = change.peak_change
    assert share is not None and share > 0.05
    saved = tmp_path / "diff.json"
    code = main(["diff", str(fixed_path), str(leaky_path), "--max-peak-increase", "5%",
                 "--json", str(saved)])
    assert code == 1
    captured = capsys.readouterr()
    seen = format_share(share)
    assert "limit crossed: --max-peak-increase" in captured.err
    assert seen in captured.err and "over the limit of +5%" in captured.err
    assert "Limits crossed (1)" in captured.out and seen in captured.out
    assert "fix:" in captured.out
    data = json.loads(saved.read_text())
    assert data["passed"] is False
    [breach] = data["breaches"]
    assert breach["limit"] == "max-peak-increase"
    assert breach["observed"] == pytest.approx(share) and breach["allowed"] == 0.05
    assert data["peak"]["delta"] == change.peak.delta


def test_limits_in_bytes_growth_and_new_findings(
    runs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    leaky_path, fixed_path = runs
    old, new = str(fixed_path), str(leaky_path)
    # A peak increase in bytes above the one seen: within the limit.
    assert main(["diff", old, new, "--max-peak-increase", "64MiB"]) == 0
    assert "Within limits: peak increase at most 64 MiB" in capsys.readouterr().out
    # The growth rose by hundreds of KiB an iteration.
    assert main(["diff", old, new, "--max-growth-increase", "1KiB/iter"]) == 1
    err = capsys.readouterr().err
    assert "--max-growth-increase: memory growth rose by +" in err
    assert "over the limit of +1.0 KiB/iter" in err
    # The leaks are new findings.
    assert main(["diff", old, new, "--fail-on-new-findings"]) == 1
    err = capsys.readouterr().err
    assert "--fail-on-new-findings" in err
    assert "tensor-accumulation" in err and "retained-graph" in err
    # The other way round nothing is worse: every limit holds.
    assert main(["diff", new, old, "--max-peak-increase", "0%", "--max-growth-increase", "0",
                 "--fail-on-new-findings"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and "Within limits" in captured.out


def test_the_api_checks_limits_too(runs: tuple[Path, Path]) -> None:
    leaky_path, fixed_path = runs
    change = memsentry.diff(fixed_path, leaky_path)
    limits = Limits.parse(max_peak_increase="5%", max_growth_increase="1MiB")
    assert limits.max_peak_increase_share == 0.05 and limits.max_growth_increase == 1 << 20
    [breach] = change.breaches(limits)
    assert breach.limit == "max-peak-increase"
    assert breach.observed == change.peak.relative and breach.allowed == 0.05
    assert "Limits crossed (1)" in change.format(limits=limits)
    assert change.breaches(Limits(max_peak_increase=64 << 20)) == ()
    assert Limits.parse(max_peak_increase="64MiB").max_peak_increase == 64 << 20


@pytest.mark.parametrize(
    ("option", "value"),
    [("--max-peak-increase", "5x"), ("--max-peak-increase", "five%"),
     ("--max-peak-increase", "=-5%"), ("--max-growth-increase", "fast")],
)
def test_bad_limits_exit_2_naming_the_value_before_reading_anything(
    option: str, value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = str(tmp_path / "absent.json")
    argv = ["diff", missing, missing]
    argv += [option + value] if value.startswith("=") else [option, value]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert option in err and repr(value.lstrip("=")) in err
    assert "e.g." in err and "absent.json" not in err


def test_a_missing_file_or_not_a_report_exits_2(
    runs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    leaky_path, _ = runs
    missing = tmp_path / "absent.json"
    assert main(["diff", str(leaky_path), str(missing)]) == 2
    assert f"NEW.json: no such file: {str(missing)!r}" in capsys.readouterr().err
    other = tmp_path / "other.json"
    other.write_text('{"hello": 1}')
    assert main(["diff", str(other), str(leaky_path)]) == 2
    assert "OLD.json" in (err := capsys.readouterr().err) and "not a memsentry report" in err
    with pytest.raises(FileNotFoundError):
        memsentry.diff(missing, leaky_path)


def test_a_report_against_itself_shows_no_change(
    runs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    leaky_path, _ = runs
    report = Report.from_json(leaky_path)
    change = memsentry.diff(report, report)
    assert change.unchanged
    assert change.peak.delta == 0 and change.peak.relative == 0
    assert change.growth.delta == 0
    assert change.appeared == () and change.disappeared == ()
    assert [(p.old, p.new) for p in change.persisted] == [(f, f) for f in report.findings]
    assert change.largest_layer_changes() == () and change.mismatches == ()
    assert all(c.bytes.delta == 0 for c in change.categories)
    text = str(change)
    assert "peak" in text and "(no change)" in text and "no change:" in text
    assert "Layers: no layer changed" in text
    assert main(["diff", str(leaky_path), str(leaky_path), "--max-peak-increase", "0%",
                 "--fail-on-new-findings"]) == 0
    assert "no change:" in capsys.readouterr().out


def test_findings_match_by_rule_and_holder_not_by_message(runs: tuple[Path, Path]) -> None:
    leaky = Report.from_json(runs[0])
    reworded = dataclasses.replace(leaky, findings=tuple(
        dataclasses.replace(f, message=f.message.upper(), bytes=(f.bytes or 0) + 1)
        for f in leaky.findings))
    change = memsentry.diff(leaky, reworded)
    assert change.appeared == () and change.disappeared == ()
    assert len(change.persisted) == len(leaky.findings)
    # The same rule about another holder is another finding.
    moved = dataclasses.replace(leaky, findings=tuple(
        dataclasses.replace(f, subject=dataclasses.replace(f.subject, name="x", path=()))
        if f.rule == "tensor-accumulation" and f.subject is not None else f
        for f in leaky.findings))
    change = memsentry.diff(leaky, moved)
    assert [f.rule for f in change.appeared] == ["tensor-accumulation"]
    assert [f.rule for f in change.disappeared] == ["tensor-accumulation"]


def test_layers_only_in_one_run_are_added_or_removed(runs: tuple[Path, Path]) -> None:
    leaky = Report.from_json(runs[0])
    head = leaky.layer("head")
    renamed = dataclasses.replace(leaky, layers=tuple(
        dataclasses.replace(layer, name="classifier") if layer is head else layer
        for layer in leaky.layers))
    change = memsentry.diff(leaky, renamed)
    assert [layer.name for layer in change.added_layers] == ["classifier"]
    assert [layer.name for layer in change.removed_layers] == ["head"]
    [removed] = change.removed_layers
    assert removed.activation.old == head.saved_bytes and removed.activation.new is None
    assert removed.forward_peak.old == head.forward_peak
    shown = {layer.name for layer in change.largest_layer_changes()}
    assert shown == {"classifier", "head"}
    text = str(change)
    assert "classifier (added)" in text and "head (removed)" in text


def test_runs_measured_differently_are_flagged(runs: tuple[Path, Path]) -> None:
    leaky = Report.from_json(runs[0])
    heap = dataclasses.replace(leaky, backend="cpu-mallinfo2", measured=Measured.HEAP,
                               peak_mode=PeakMode.SAMPLED, torch_version="2.4.0")
    change = memsentry.diff(heap, leaky)
    fields = [m.field for m in change.mismatches]
    assert fields == ["backend", "torch_version"]
    backend = change.mismatches[0]
    assert "misleading" in backend.message and "exact=True" in backend.message
    assert backend.old == "cpu-mallinfo2" and backend.new == leaky.backend
    text = str(change)
    assert "warning: the runs were measured by different backends" in text
    assert "old on cpu (cpu-mallinfo2, peaks sampled, torch 2.4.0)" in text


def test_the_samples_through_memsentry_run_and_diff(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = {}
    for name in ("train_leaky", "train_fixed"):
        saved[name] = str(tmp_path / f"{name}.json")
        assert main(["run", "--exact", "--json", saved[name], str(SAMPLES / f"{name}.py"),
                     "--steps", str(STEPS), "--batch", str(BATCH), "--device", "cpu"]) == 0
    capsys.readouterr()
    assert main(["diff", saved["train_leaky"], saved["train_fixed"]]) == 0
    out = capsys.readouterr().out
    change = memsentry.diff(saved["train_leaky"], saved["train_fixed"])
    assert out == str(change) + "\n"
    assert change.peak.delta is not None and change.peak.delta < 0
    assert change.growth.delta is not None and change.growth.delta < -256 * 1024
    assert LEAKS <= {f.rule for f in change.disappeared}
    assert main(["diff", saved["train_fixed"], saved["train_leaky"],
                 "--max-peak-increase", "5%"]) == 1
    assert "--max-peak-increase" in capsys.readouterr().err


def _page_data(page: str) -> dict[str, object]:
    """The figures a diff page embeds for its charts."""
    start = page.index('id="memsentry-diff-data">') + len('id="memsentry-diff-data">')
    loaded: dict[str, object] = json.loads(page[start:page.index("</script>", start)])
    return loaded


def test_the_html_page_draws_both_runs_on_one_axis(runs: tuple[Path, Path]) -> None:
    pytest.importorskip("plotly", reason="the HTML page needs plotly (memsentry[html])")
    leaky_path, fixed_path = runs
    change = memsentry.diff(fixed_path, leaky_path)  # the leak is the regression
    page = change.to_html(limits=Limits.parse(max_peak_increase="5%"))
    assert page.startswith("<!DOCTYPE html>")
    # Offline: no script, style or image is loaded from elsewhere (the browser test
    # watches the requests themselves).
    assert re.search(r"<(script|img|iframe)[^>]*\ssrc=|<link[\s>]", page) is None
    figures = _page_data(page)["figures"]
    assert isinstance(figures, dict)
    traces = {t["name"]: t for t in figures["timeline"]["data"]}
    highest = {}
    for which, path in (("old", fixed_path), ("new", leaky_path)):
        report = Report.from_json(path)
        # Every iteration, the partial one at the end too (a run's peak may be there).
        assert report.iterations[-1].boundary.value == "exit"
        assert traces[f"{which} allocated"]["x"] == [it.index for it in report.iterations]
        highest[which] = max(it.peak for it in report.iterations)
    # Both lines on one unit: the highest points stand as the runs' highest peaks do.
    drawn = {which: max(traces[f"{which} peak"]["y"]) for which in highest}
    assert drawn["new"] / drawn["old"] == pytest.approx(highest["new"] / highest["old"])
    # The leaky run climbs, the fixed one is flat (to the last closed iteration: the partial
    # one after it is read after the loop let go of its batch).
    new_line, old_line = traces["new allocated"]["y"], traces["old allocated"]["y"]
    assert new_line[-2] - new_line[2] > 5 * abs(old_line[-2] - old_line[2])
    # The findings that appeared are marked at their iteration and shown with holder and fix.
    marked = traces["finding appeared"]
    assert sorted(marked["x"]) == sorted(f.iteration for f in change.appeared
                                         if f.iteration is not None)
    assert "<code>val_logits</code>" in page and "<code>running_loss</code>" in page
    assert "Findings that appeared (new run)" in page
    assert "verdict crossed" in page and "--max-peak-increase" in page
    # The categories: old and new bars, the activations' rise in the table.
    bars = {t["name"]: t for t in figures["categories"]["data"]}
    assert set(bars) == {"old", "new"}
    assert "activations (saved for backward)" in bars["new"]["x"]


def test_the_command_writes_the_html_page(
    runs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("plotly", reason="the HTML page needs plotly (memsentry[html])")
    leaky_path, fixed_path = runs
    page = tmp_path / "diff.html"
    assert main(["diff", str(leaky_path), str(fixed_path), "--html", str(page),
                 "--max-peak-increase", "5%"]) == 0
    captured = capsys.readouterr()
    assert f"HTML page written to {page}" in captured.err
    assert captured.out == memsentry.diff(leaky_path, fixed_path).format(
        limits=Limits.parse(max_peak_increase="5%")) + "\n"
    text = page.read_text(encoding="utf-8")
    assert "Findings that disappeared (old run) (3)" in text and "verdict within" in text
    # A page that cannot be written is refused before the reports are read.
    assert main(["diff", str(leaky_path), str(tmp_path / "absent.json"), "--html",
                 str(tmp_path / "no" / "such" / "d.html")]) == 2
    err = capsys.readouterr().err
    assert "--html" in err and "absent.json" not in err


def test_heap_noise_in_forward_peaks_is_not_a_layer_change() -> None:
    from memsentry.model import Change, LayerChange

    def layer(noise: int) -> LayerChange:
        return LayerChange(name="encoder.0", type="Linear", activation=Change(1024, 1024),
                           forward_peak=Change(65_536, 65_536 + 2_048), noise=noise)

    assert layer(noise=0).size == 2_048  # runs counting tensors only: a real change
    assert layer(noise=4_096).size == 0  # the process heap's bookkeeping: not a change
    grown = LayerChange(name="encoder.0", type="Linear", activation=Change(1024, 9216),
                        forward_peak=Change(65_536, 65_536), noise=4_096)
    assert grown.size == 8_192  # saved bytes are counted exactly whatever the backend
