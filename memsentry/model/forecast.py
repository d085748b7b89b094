"""A forecast of the peak at another batch size, and what it rests on."""

from __future__ import annotations

from dataclasses import dataclass

from memsentry.model.kinds import ForecastMethod
from memsentry.units import format_bytes


@dataclass(frozen=True)
class ForecastPoint:
    """A batch size the run measured: the highest peak of its ``iterations``."""

    batch: int
    peak: int
    iterations: int


@dataclass(frozen=True)
class Forecast:
    """``report.forecast(batch=B)``: the peak predicted at batch ``batch``, in bytes on the
    scale of the iterations table's peak, as ``fixed + per_sample * batch``.

    ``method`` says where the line comes from: the peaks measured at two or more batch sizes
    (``points``, fitted by least squares; ``spread`` is the largest distance of a point from
    the line, as a share of its peak, ``None`` with two points), or the activations per
    sample at one batch size (the rest of that peak taken as fixed). ``caveat`` says how far
    to trust it.
    """

    batch: int
    peak: int
    fixed: int
    per_sample: float
    method: ForecastMethod
    points: tuple[ForecastPoint, ...]
    spread: float | None = None
    caveat: str = ""

    def __str__(self) -> str:
        measured = ", ".join(f"{p.batch} ({p.iterations} iteration"
                             f"{'s' if p.iterations != 1 else ''})" for p in self.points)
        text = (f"peak at batch {self.batch}: {format_bytes(self.peak)} = "
                f"{format_bytes(self.fixed)} fixed + {format_bytes(round(self.per_sample))} "
                f"per sample, from {self.method} at batch {measured}")
        if self.spread is not None:
            text += f"; the measured peaks lie within {self.spread:.1%} of the line"
        return text + (f". {self.caveat}" if self.caveat else "")


__all__ = ["Forecast", "ForecastPoint"]
