"""``memory-headroom``: CUDA memory left unused by the peak, and the batch that would fit."""

from __future__ import annotations

from memsentry.model import Finding, ForecastMethod, IterationStats, ReportData, Severity
from memsentry.rules.device import device_subject, is_cuda
from memsentry.rules.forecast import Line, peak_line
from memsentry.rules.registry import rule
from memsentry.rules.series import after_warmup
from memsentry.units import format_bytes

HEADROOM = "memory-headroom"

#: The peak uses less than this share of the device: worth saying.
HEADROOM_SHARE = 0.5
#: The share of the device a suggested batch may fill.
TARGET_SHARE = 0.85
#: The share of the peak that may be memory the four parts do not explain (temporaries,
#: workspaces) when the run measured one batch size: above it, how the peak grows with the
#: batch is not known.
UNEXPLAINED_SHARE = 0.25


def _unexplained(highest: IterationStats) -> bool:
    """Whether most of the peak is memory none of the four parts holds, measured at one
    batch size: a temporary that may grow with the batch (attention scores, a loss's
    logits) or may not, so no batch that fits can be told."""
    parts = highest.parts
    return parts is not None and parts.other > UNEXPLAINED_SHARE * highest.peak


def _unknown_growth(highest: IterationStats, line: Line | None) -> bool:
    """Whether how the peak grows with the batch is not known: one batch size measured, and
    most of the peak temporaries."""
    fitted = line is not None and line.method is ForecastMethod.BATCHES
    return not fitted and _unexplained(highest)


@rule(HEADROOM, severities={Severity.HINT}, devices={"cuda"})
def memory_headroom(report: ReportData) -> list[Finding]:
    """CUDA: the peak uses a small part of the device; from the activation memory per sample,
    estimate the batch that would fit. Judged on exact peaks only (a peak sampled at hooks
    misses the temporaries inside layers), and not where most of the peak is temporaries
    whose growth with the batch one batch size cannot tell."""
    its = [it for it in after_warmup(report) if it.peak_exact]
    total = report.total_memory
    if not is_cuda(report) or not total or len(its) < 2:
        return []
    highest = max(its, key=lambda it: it.peak)
    peak = highest.peak
    line = peak_line(report)  # the arithmetic of report.max_batch()
    if peak >= HEADROOM_SHARE * total or _unknown_growth(highest, line):
        return []
    message = (
        f"the peak, {format_bytes(peak)}, uses {peak / total:.0%} of {report.device}'s "
        f"{format_bytes(total)}"
    )
    if line is not None:
        fits = int((TARGET_SHARE * total - line.fixed) // line.per_sample)
        measured = ", ".join(str(p.batch) for p in line.points)
        message += (
            f"; with {format_bytes(round(line.fixed))} that does not grow with the batch and "
            f"{format_bytes(round(line.per_sample))} per sample (from {line.method} at "
            f"batch {measured}), a batch of about {fits:,} would fit in {TARGET_SHARE:.0%} of it"
        )
    fix = (
        "raise the batch size (and scale the learning rate), train a larger model, or share "
        "the GPU between jobs (MPS, MIG); turn off memory savers you do not need "
        "(activation checkpointing, CPU offload)"
    )
    return [Finding(rule=HEADROOM, severity=Severity.HINT, message=message, fix=fix,
                    bytes=total - peak, subject=device_subject(report),
                    iteration=highest.index)]
