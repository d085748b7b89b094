"""The peak as a line in the batch size: ``fixed + per_sample * batch``.

From two or more batch sizes the run measured (each one's highest peak after the warm-up
iterations), the line runs through the two nearest the batch asked for. From one batch size,
the activations saved for backward at its peak are the part that scales, and the rest of that
peak is taken as fixed. Pure functions of a recorded report; ``report.forecast``,
``report.max_batch``, ``memsentry run --fit`` and the ``memory-headroom`` rule use them.
"""

from __future__ import annotations

from dataclasses import dataclass

from memsentry.model import (
    Forecast,
    ForecastMethod,
    ForecastPoint,
    IterationStats,
    ReportData,
    complete,
)
from memsentry.rules.series import WARMUP
from memsentry.units import parse_size

ONE_BATCH_CAVEAT = (
    "Measured at one batch size: only the activations saved for backward are taken to grow "
    "with the batch, added to the peak as it was (temporaries that grow with the batch, the "
    "loss's, softmax outputs, workspaces, count as fixed); run two batch sizes for a fitted "
    "line."
)
FITTED_CAVEAT = (
    "The line through the two measured batch sizes nearest the batch asked for: trust it "
    "between and near them; beyond the largest it is a lower bound where another moment of "
    "the step (the backward, the optimizer step) grows faster, and on CUDA the allocator's "
    "rounding and fragmentation add to it."
)


SAMPLED_CAVEAT = (
    "The measured peaks are lower bounds (the highest of the samples at hooks, blind to "
    "temporaries inside a layer), so the forecast may be low; track(exact=True) counts every "
    "allocation (on CUDA every iteration's peak is counted already)."
)


@dataclass(frozen=True)
class Line:
    fixed: float
    per_sample: float
    method: ForecastMethod
    points: tuple[ForecastPoint, ...]
    spread: float | None

    def at(self, batch: int) -> int:
        return round(self.fixed + self.per_sample * batch)


def _peak_read(it: IterationStats) -> bool:
    """Whether ``it``'s peak was read inside it: a sampled iteration's, or the allocator's own
    (CUDA); a light iteration's peak on other devices is its boundary's allocated figure,
    which would put the forecast peak too low."""
    return it.sampled or it.peak_exact


def _measured(report: ReportData) -> list[IterationStats]:
    """The iterations with a batch size and a peak read inside them, after the warm-up ones
    where enough remain."""
    closed = [it for it in complete(report.iterations) if it.batch and _peak_read(it)]
    later = closed[WARMUP:]
    return later if later else closed


def points(report: ReportData) -> tuple[ForecastPoint, ...]:
    """Each batch size measured, with its highest peak."""
    by_batch: dict[int, list[int]] = {}
    for it in _measured(report):
        assert it.batch is not None
        by_batch.setdefault(it.batch, []).append(it.peak)
    return tuple(ForecastPoint(batch, max(peaks), len(peaks))
                 for batch, peaks in sorted(by_batch.items()))


def _segment(found: tuple[ForecastPoint, ...], batch: int | None
             ) -> tuple[ForecastPoint, ForecastPoint]:
    """The two measured batch sizes whose line serves ``batch``: the two around it, or the
    two nearest when it is outside them (``None``: the two largest)."""
    if batch is None or batch >= found[-1].batch:
        return found[-2], found[-1]
    if batch <= found[0].batch:
        return found[0], found[1]
    upper = next(k for k, point in enumerate(found) if point.batch >= batch)
    return found[upper - 1], found[upper]


def peak_line(report: ReportData, batch: int | None = None) -> Line | None:
    """The peak against the batch size near ``batch`` (``None``: above the largest batch
    measured), or ``None`` when no iteration had a batch size.

    A peak is the highest of the moments of a step (the end of the forward, the backward,
    the optimizer step), each a line in the batch size, so the peak bends upward where
    another moment takes over: the line through the two measured batch sizes nearest
    ``batch`` is used, and the other points' distance from it is the ``spread``."""
    found = points(report)
    if len(found) >= 2:
        line = _fitted(found, batch)
        if line is not None:
            return line
        found = (found[-1],)  # flat: from the activations at the largest batch
    if not found:
        return None
    return _from_activations(report, found[-1])


def _fitted(found: tuple[ForecastPoint, ...], batch: int | None) -> Line | None:
    """The line through the two measured batch sizes that serve ``batch``, with the other
    points' largest distance from it (a share of their peak); ``None`` when the peak does
    not rise with the batch."""
    low, high = _segment(found, batch)
    slope = (high.peak - low.peak) / (high.batch - low.batch)
    if slope <= 0:
        return None
    fixed = low.peak - slope * low.batch
    others = [p for p in found if p not in (low, high)]
    spread = max((abs(fixed + slope * p.batch - p.peak) / p.peak for p in others),
                 default=None)
    return Line(fixed, slope, ForecastMethod.BATCHES, found, spread)


def _from_activations(report: ReportData, point: ForecastPoint) -> Line | None:
    """From one batch size: what one forward saves for backward grows with the batch, and
    the rest of the peak is fixed; ``None`` when nothing was saved."""
    held = _held_activations(report, point)
    # What one forward saves for backward: at the peak when it held the activations, else
    # the outermost layers' largest call (a peak in the optimizer step holds none).
    saved = held or sum(layer.saved_bytes or 0 for layer in report.layers if layer.depth == 0)
    if not saved:
        return None
    return Line(point.peak - held, saved / point.batch, ForecastMethod.ACTIVATIONS, (point,),
                None)


def _held_activations(report: ReportData, point: ForecastPoint) -> int:
    """The activations held at the highest peak measured at ``point``'s batch size (0 when
    no such iteration has a breakdown)."""
    best = max((it for it in _measured(report) if it.parts is not None
                and it.batch == point.batch), key=lambda it: it.peak, default=None)
    return best.parts.activations if best is not None and best.parts is not None else 0


def _line_or_error(report: ReportData, batch: int | None = None) -> Line:
    line = peak_line(report, batch)
    if line is None:
        raise ValueError(
            "no forecast: no iteration recorded a batch size (the first dimension of the "
            "outermost module's first tensor) with activations saved for backward; track a "
            "training loop whose model takes the batch as its first argument")
    return line


def forecast(report: ReportData, batch: int) -> Forecast:
    """The peak predicted at ``batch``."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"forecast(batch={batch!r}): give the batch size as a positive int")
    line = _line_or_error(report, batch)
    caveat = FITTED_CAVEAT if line.method is ForecastMethod.BATCHES else ONE_BATCH_CAVEAT
    if not all(it.peak_exact for it in _measured(report)):
        caveat += " " + SAMPLED_CAVEAT
    return Forecast(batch=batch, peak=line.at(batch), fixed=round(line.fixed),
                    per_sample=line.per_sample, method=line.method, points=line.points,
                    spread=line.spread, caveat=caveat)


def max_batch(report: ReportData, memory: int | str) -> int:
    """The largest batch whose forecast peak fits in ``memory`` (bytes, or ``"80 GiB"``);
    0 when not even the fixed part fits."""
    size = parse_size(memory)
    if size <= 0:
        raise ValueError(f"max_batch(memory={memory!r}): give a positive size, e.g. '80 GiB'")
    line = _line_or_error(report)  # the line above the largest batch measured
    fits = max(0, int((size - line.fixed) // line.per_sample))
    if line.method is ForecastMethod.BATCHES and fits < line.points[-1].batch:
        # Inside the measured range: the line of the segment it falls in.
        fits = max(0, int((size - (inner := _line_or_error(report, fits)).fixed)
                          // inner.per_sample))
    return fits


__all__ = ["Line", "forecast", "max_batch", "peak_line", "points"]
