"""The peak forecast at another batch size: from two batch sizes a run measured, the peak of
a third within 10% of what a run at that batch size measures."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from builders import MiB, iterations, report
from torch import nn

import memsentry
from memsentry.cli import main
from memsentry.model import ForecastMethod
from memsentry.rules.forecast import points

WIDTH = 1024


def train(batches: list[int], *, exact: bool) -> memsentry.Report:
    """SGD on an MLP whose activations outgrow its parameters: the peak grows with the batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH), nn.GELU(),
                          nn.Linear(WIDTH, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    # the forecasts rest on the peak and batch size of every iteration: no budget
    with memsentry.track(model, exact=exact, on_leak="ignore", overhead=None) as tracker:
        for batch in batches:
            x = torch.randn(batch, 256)
            target = torch.zeros(batch, dtype=torch.long)
            nn.functional.cross_entropy(model(x), target).backward()
            optimizer.step()
            optimizer.zero_grad()
    return tracker.report()


def measured_peak(report: memsentry.Report) -> int:
    return max(it.peak for it in report.iterations[2:] if it.boundary != "exit")


@pytest.mark.parametrize("exact", [False, True], ids=["default", "exact"])
@pytest.mark.parametrize("third", [4096, 1536])
def test_two_batch_sizes_predict_a_third_within_ten_percent(exact: bool, third: int) -> None:
    fitted = train([1024] * 4 + [2048] * 4, exact=exact)
    forecast = fitted.forecast(batch=third)
    assert forecast.method is ForecastMethod.BATCHES
    assert [(p.batch, p.iterations) for p in forecast.points] == [(1024, 2), (2048, 4)]
    actual = measured_peak(train([third] * 5, exact=exact))
    assert abs(forecast.peak - actual) <= 0.10 * actual, (forecast, actual)
    # Explained: the parts of the line and the batch sizes it comes from.
    text = str(forecast)
    assert text.startswith(f"peak at batch {third}: ")
    assert "per sample, from the peaks measured at batch 1024 (2 iterations), 2048" in text
    assert forecast.fixed + round(forecast.per_sample * third) == pytest.approx(forecast.peak,
                                                                                abs=1)


def test_the_largest_batch_that_fits_is_the_last_whose_forecast_fits() -> None:
    report = train([1024] * 4 + [2048] * 4, exact=True)
    for memory in (64 * 2**20, "256 MiB", 30 * 2**20):
        fits = report.max_batch(memory)
        size = memsentry.parse_size(memory)
        assert report.forecast(batch=fits).peak <= size < report.forecast(batch=fits + 1).peak
    assert report.max_batch(1024) == 0  # not even the fixed part fits in 1 KiB


def test_one_batch_size_forecasts_from_its_activations_and_says_so() -> None:
    report = train([2048] * 6, exact=True)
    forecast = report.forecast(batch=4096)
    assert forecast.method is ForecastMethod.ACTIVATIONS
    assert "Measured at one batch size" in forecast.caveat
    peak = measured_peak(report)
    assert forecast.peak > peak  # twice the batch, more activations on top


@pytest.mark.parametrize("batch", [0, -3, 2.5, True, "64"])
def test_a_bad_batch_is_refused(batch: object) -> None:
    report = train([256] * 4, exact=True)
    with pytest.raises(ValueError, match=r"forecast\(batch=.*positive int"):
        report.forecast(batch=batch)  # type: ignore[arg-type]


def test_no_batch_size_means_no_forecast_and_bad_sizes_are_named() -> None:
    model = nn.Linear(4, 4)
    with memsentry.track(model, on_leak="ignore") as tracker:
        for _ in range(4):
            model.forward(torch.randn(2, 4))  # forward() itself: no hooks, no batch size
            tracker.step()
    with pytest.raises(ValueError, match="no iteration recorded a batch size"):
        tracker.report().forecast(batch=8)
    report = train([256] * 4, exact=True)
    with pytest.raises(ValueError, match="lots"):
        report.max_batch("lots")
    with pytest.raises(ValueError, match="positive size"):
        report.max_batch(0)


def test_memsentry_run_fit_says_the_batch_that_fits(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\nfrom torch import nn\n"
        "model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 1))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.01)\n"
        "for batch in [256] * 4 + [512] * 4:\n"
        "    model(torch.randn(batch, 64)).pow(2).mean().backward()\n"
        "    opt.step(); opt.zero_grad()\n", encoding="utf-8")
    assert main(["run", "--fit", "1GiB", str(script)]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the explanation is wrapped
    assert "Batch that fits 1GiB: " in out
    assert "from the peaks measured at batch 256 (2 iterations), 512 (4 iterations)" in out
    assert main(["run", "--fit", "0", str(script)]) == 2  # refused before running
    assert "--fit" in capsys.readouterr().err


def test_light_iterations_peaks_are_left_out_of_the_forecast() -> None:
    """Under a budget a light iteration reads no peak inside (on CPU its peak is the
    boundary's allocated figure): its batch size is not a measured point, or the line would
    run too low and the batch said to fit would not. The allocator's own peak (CUDA, read
    in light iterations too) counts."""
    sampled = iterations([100 * MiB] * 5, peak=300 * MiB, batch=256, sampled=True)
    light = iterations([100 * MiB] * 5, first=5, batch=512, sampled=False)
    built = report(iterations=(*sampled, *light))
    assert [(p.batch, p.peak) for p in points(built)] == [(256, 300 * MiB)]
    exact = iterations([100 * MiB] * 5, peak=500 * MiB, first=5, batch=512,
                                sampled=False, peak_exact=True)
    built = report(iterations=(*sampled, *exact))
    assert [(p.batch, p.peak) for p in points(built)] == [(256, 300 * MiB), (512, 500 * MiB)]
