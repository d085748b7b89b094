"""Growth another thread made, for ``memory-growth``: when other threads ran loops in the
process, figures that count the whole process (the C heap on CPU, a device's allocator, the
resident memory) grow with their memory too. A tracker's verdict then rests on what its own
loop holds: the tensors, graphs and containers its censuses found. When those stayed flat,
the growth is not judged; a note says what grew and why it was left alone."""

from __future__ import annotations

from collections.abc import Sequence

from memsentry.model import Census, IterationStats, Measured, ReportData
from memsentry.rules.series import (
    MIN_CENSUSES,
    complete_censuses,
    holder_series,
    plural,
    trend,
)
from memsentry.units import format_bytes

#: What the loop's own holders must gain, as a share of the growth, to make it the loop's.
MIN_OWN_SHARE = 0.25


def shared_figures(report: ReportData) -> bool:
    """Whether the allocated figures count every thread's memory: the process heap, or a
    device's allocator. Counting tensor storages (``track(exact=True)``) sees only the ops of
    the tracker's thread."""
    return report.measured == Measured.HEAP or report.device != "cpu"


def _containers_climb(report: ReportData) -> bool:
    """Whether a holder's item count climbs across censuses (values piled up each step)."""
    censuses, rows = holder_series(report)
    return any(trend(censuses, row, lambda h: float(h.items or 0)).climbs()
               for row in rows.values())


def _held_rate(censuses: Sequence[Census]) -> float:
    """Bytes per iteration the tensors (and the graphs' saved tensors) the holders keep grew,
    first to last census."""
    first, last = censuses[0], censuses[-1]
    span = last.iteration - first.iteration
    held = [sum(h.bytes + h.graph_saved_bytes for h in c.holders) for c in (first, last)]
    return (held[1] - held[0]) / span if span else 0.0


def holds_growth(report: ReportData, rate: float) -> bool:
    """Whether what this loop holds grows with a growth of ``rate`` bytes per iteration: its
    complete censuses (three at least) saw autograd nodes pile up, tensors gain
    :data:`MIN_OWN_SHARE` of ``rate`` or more, or a container's items climb. With fewer
    censuses nothing shows that it does."""
    censuses = complete_censuses(report)
    if len(censuses) < MIN_CENSUSES:
        return False
    nodes = [sum(h.graph_nodes for h in c.holders) for c in (censuses[0], censuses[-1])]
    return (nodes[1] > nodes[0] or _held_rate(censuses) >= MIN_OWN_SHARE * rate
            or _containers_climb(report))


def _flat(report: ReportData) -> str:
    censuses = complete_censuses(report)
    if len(censuses) < MIN_CENSUSES:
        return (f"too few holder searches of this loop finished to tell whether what it holds "
                f"grows ({len(censuses)}; {MIN_CENSUSES} are needed)")
    own = _held_rate(censuses)
    return (f"the tensors this loop holds grew {format_bytes(round(max(own, 0)), signed=True)}"
            f"/iter over {len(censuses)} censuses, less than {MIN_OWN_SHARE:.0%} of that")


def _what(report: ReportData, figure: str) -> str:
    if figure == "resident":
        return "the process's resident memory"
    if report.measured == Measured.HEAP:
        return "the process heap"
    return f"allocated memory on {report.device}"


def _fix(report: ReportData) -> str:
    if report.device == "cpu":
        return ("to measure this loop's tensors alone, track it with track(exact=True), "
                "which counts the storages its own thread makes")
    return "the report of the thread whose loop holds the growth names its holder"


def other_threads_grew(report: ReportData, its: Sequence[IterationStats], figure: str,
                       rate: float) -> str | None:
    """The note for a growth of ``figure`` (``"allocated"`` or ``"resident"``) over ``its``
    at ``rate`` bytes per iteration that this loop's holders do not explain while other
    threads ran loops; ``None`` when the growth is this loop's to judge."""
    if not report.other_threads or (figure == "allocated" and not shared_figures(report)):
        return None
    if holds_growth(report, rate):
        return None
    values = [getattr(it, figure) for it in its if getattr(it, figure) is not None]
    grown = values[-1] - values[0] if values else 0
    return (f"memory-growth not judged: {_what(report, figure)} grew by "
            f"{format_bytes(round(rate))}/iter (+{format_bytes(grown)} from iteration "
            f"{its[0].index} to {its[-1].index}), while {_flat(report)}; "
            f"{plural(report.other_threads, 'other thread')} ran a training loop in this "
            f"process meanwhile, and these figures count their memory too: the growth is "
            f"likely theirs; {_fix(report)}")


__all__ = ["MIN_OWN_SHARE", "holds_growth", "other_threads_grew", "shared_figures"]
