"""``memory-growth``: allocated memory rising steadily across iterations after warm-up."""

from __future__ import annotations

import itertools

from memsentry.model import (
    Finding,
    IterationStats,
    ReportData,
    Severity,
    Subject,
    SubjectKind,
    growth_per_iteration,
)
from memsentry.rules.registry import rule
from memsentry.rules.series import WARMUP, after_warmup
from memsentry.units import format_bytes

RULE_ID = "memory-growth"

#: Iterations after warm-up needed before growth is judged.
MIN_ITERATIONS = 4
#: Share of consecutive iterations that must end higher than the one before.
MIN_RISING_SHARE = 0.75
#: Below this rate growth is noise of the measurement (malloc bookkeeping on CPU).
MIN_RATE = 1024
#: Share of all the rises that must still be held at the end: a leak keeps what it gains,
#: a list cleared every epoch (a sawtooth) gives it back.
MIN_RETAINED_SHARE = 0.5


def _steady_growth(its: list[IterationStats]) -> tuple[float, float] | None:
    """(bytes per iteration, share of rising steps) when ``its`` grow steadily, else None."""
    steps = [b.allocated - a.allocated for a, b in itertools.pairwise(its)]
    rising = sum(step > 0 for step in steps) / len(steps)
    slope = growth_per_iteration(its, warmup=0)
    if slope is None or rising < MIN_RISING_SHARE or slope < MIN_RATE:
        return None
    gained = sum(step for step in steps if step > 0)
    if its[-1].allocated - its[0].allocated < MIN_RETAINED_SHARE * gained:
        return None  # memory given back: a sawtooth or a bounded cache, not a climb
    return slope, rising


@rule(RULE_ID, severities={Severity.LEAK}, fallback=True)
def memory_growth(report: ReportData) -> list[Finding]:
    """Allocated memory climbs steadily after warm-up, at identical iteration boundaries.

    Reports the rate, the growth so far and, when the device size is known, a forecast of the
    iteration at which the device (or RAM, on CPU) runs out.
    """
    complete = after_warmup(report)
    if len(complete) < MIN_ITERATIONS:
        return []
    growth = _steady_growth(complete)
    if growth is None:
        return []
    rate, rising = growth
    first, last = complete[0], complete[-1]
    grown = last.allocated - first.allocated
    where = "RAM" if report.device == "cpu" else report.device
    message = (
        f"allocated memory grows by {format_bytes(round(rate))}/iter on {report.device}: "
        f"+{format_bytes(grown)} from iteration {first.index} to {last.index}, "
        f"higher after {rising:.0%} of the iterations"
    )
    if report.total_memory:
        left = report.total_memory - last.allocated
        iterations_left = int(left / rate)
        message += (
            f"; at this rate the {format_bytes(report.total_memory)} of {where} run out "
            f"around iteration {last.index + iterations_left:,}"
        )
    fix = (
        "something keeps tensors from every iteration alive: look for losses or metrics "
        "summed without .item(), outputs appended to lists or dicts, tensors stored on "
        "modules or loggers, and state carried across iterations without .detach()"
    )
    return [
        Finding(
            rule=RULE_ID,
            severity=Severity.LEAK,
            message=message,
            fix=fix,
            bytes=grown,
            rate=rate,
            subject=Subject(SubjectKind.DEVICE, report.device),
        )
    ]


__all__ = ["MIN_ITERATIONS", "RULE_ID", "WARMUP", "memory_growth"]
