"""``loop-variables``: the previous iteration's tensors still alive when the next one starts."""

from __future__ import annotations

import itertools
import statistics

from memsentry.model import (
    Census,
    Finding,
    HolderKind,
    HolderStats,
    ReportData,
    Severity,
    Step,
    Subject,
)
from memsentry.rules.registry import rule
from memsentry.rules.series import (
    after_warmup,
    complete_censuses,
    function_of,
    grows_steadily,
    holder_series,
    trend,
)
from memsentry.units import format_bytes

RULE_ID = "loop-variables"
#: Bytes below which holding on to a batch does not matter.
MIN_BYTES = 1 << 20
#: Share of the iteration's rise from boundary to peak that the kept locals must reach.
MIN_SHARE = 0.1


def _plain_locals(holders: tuple[HolderStats, ...]) -> dict[str, HolderStats]:
    """Locals that are tensors themselves (not containers, not graphs kept on purpose)."""
    return {
        h.name: h for h in holders
        if h.kind == HolderKind.LOCAL and len(h.path) == 1 and h.items is None
        and h.tensors and not h.modules and not h.graph_saved_bytes
    }


@rule(RULE_ID, severities={Severity.HINT})
def loop_variables(report: ReportData) -> list[Finding]:
    """At two censuses in a row the loop's locals (``x``, ``out``, ``loss``) hold tensors of
    the iteration just finished; they stay allocated until the next iteration rebinds them,
    after it has made its own: the peak carries one batch more than it needs."""
    censuses = complete_censuses(report)
    if len(censuses) < 2:
        return []
    kept = _kept_locals(report, censuses)
    size = sum(h.bytes - h.shared_bytes for h in kept)
    rise = _peak_rise(report)
    if size < MIN_BYTES or size < MIN_SHARE * rise:
        return []
    kept.sort(key=lambda h: h.bytes, reverse=True)
    return [_finding(kept, size, rise)]


def _kept_locals(report: ReportData, censuses: list[Census]) -> list[HolderStats]:
    """The plain locals the last two of ``censuses`` (the complete ones) both saw, whose
    deletion would free memory."""
    before, last = _plain_locals(censuses[-2].holders), _plain_locals(censuses[-1].holders)
    _, table = holder_series(report)
    return [holder for name, holder in last.items()
            if name in before and _frees_memory(censuses, table, holder)]


def _frees_memory(censuses: list[Census],
                  table: dict[tuple[Step, ...], list[HolderStats | None]],
                  holder: HolderStats) -> bool:
    """Whether deleting the local ``holder`` (``table``: each holder at each census) would
    free memory.

    A local whose tensors another holder keeps too (`outputs.append(out)`) frees nothing
    when deleted, nor do locals whose storage another local counted. A local that grows at
    every census (`bank = torch.cat([bank, x])`) is a leak, which tensor-accumulation
    reports; rebinding it earlier would not help."""
    return holder.bytes > holder.shared_bytes and not grows_steadily(
        trend(censuses, table[holder.path], lambda h: h.bytes))


def _peak_rise(report: ReportData) -> float:
    """How far the peak rises above the memory left at the boundary before it: the median
    over the iterations after warm-up whose peak was read inside them (0 with none)."""
    its = [it for it in after_warmup(report) if it.sampled]
    rises = [b.peak - a.allocated for a, b in itertools.pairwise(its)]
    return statistics.median(rises) if rises else 0


def _finding(kept: list[HolderStats], size: int, rise: float) -> Finding:
    """The HINT about the locals ``kept`` (largest first), which keep ``size`` bytes."""
    names = ", ".join(f"`{h.name}` ({format_bytes(h.bytes)})" for h in kept[:4])
    scope = function_of(kept[0])
    message = (
        f"{names} (locals of {scope or 'the loop'}) keep {format_bytes(size)} of the finished "
        "iteration alive until the next one rebinds them, after it has made its own"
    )
    message += _rise_note(size, rise)
    fix = (
        f"end the step with `del {', '.join(h.name for h in kept[:4])}` (or move the step "
        "into a function, whose locals die when it returns)"
    )
    return Finding(rule=RULE_ID, severity=Severity.HINT, message=message, fix=fix,
                   bytes=size, objects=sum(h.tensors for h in kept),
                   subject=Subject.holder(kept[0].path), location=kept[0].where)


def _rise_note(size: int, rise: float) -> str:
    """The share of the peak's rise that deleting the locals first would free."""
    if not 0 < size <= rise:
        return ""
    return (
        f": the peak rises {format_bytes(round(rise))} above each boundary, and "
        f"{size / rise:.0%} of that could be freed first"
    )
