"""The process as the system sees it, for ``memory-growth``: resident memory that climbs while
the allocator's count stays flat, and what the readings say of its source (Python's small
objects, the C heap, or neither)."""

from __future__ import annotations

from collections.abc import Sequence

from memsentry.model import (
    Finding,
    IterationStats,
    Measured,
    ReportData,
    Severity,
    Subject,
    SubjectKind,
)
from memsentry.rules.series import steady_climb
from memsentry.units import format_bytes

#: Resident growth below this, first to last iteration judged, is left alone: pages first
#: touched by kernels, the allocator's arenas and lazily loaded libraries come in such steps.
MIN_GROWTH = 16 * 1024 * 1024
#: The allocator's count must explain less than this share of the resident growth.
MAX_EXPLAINED = 0.25
#: Python objects are named as the source when their blocks, at this many bytes each (a
#: float, a small tuple), make up this share of the resident growth.
BLOCK_BYTES = 32
MIN_OBJECTS_SHARE = 0.25


def _rate(its: Sequence[IterationStats], figure: str) -> float:
    """Per iteration, first to last of ``its``, of the figure named (``None`` readings out)."""
    points = [(it.index, getattr(it, figure)) for it in its if getattr(it, figure) is not None]
    if len(points) < 2 or points[-1][0] == points[0][0]:
        return 0.0
    return (points[-1][1] - points[0][1]) / (points[-1][0] - points[0][0])


#: The fix when Python values pile up.
PILE_UP_FIX = ("look for a list, dict or log that gets entries every step and is never cleared "
               "(a history of metrics, a cache keyed by input, records kept by a callback); "
               "keep a running summary instead, or write the entries to disk")


def python_values(its: Sequence[IterationStats], rate: float) -> str | None:
    """What Python's small-object blocks say of a growth of ``rate`` bytes per iteration over
    ``its``: a clause naming them when they grow enough to be its source (use it with
    :data:`PILE_UP_FIX`), else ``None``."""
    blocks = _rate(its, "python_blocks")
    if blocks * BLOCK_BYTES < MIN_OBJECTS_SHARE * rate:
        return None
    return (f"Python's small objects grew by {blocks:,.0f} per iteration (numbers, strings, "
            "tuples, small lists and dicts: each takes 16 to 512 bytes): Python values pile "
            "up")


def _source(report: ReportData, its: Sequence[IterationStats], rate: float) -> tuple[str, str]:
    """(what the readings say of the source, the fix)."""
    objects = python_values(its, rate)
    if objects is not None:
        return objects, PILE_UP_FIX
    heap = (" nor in the C heap (malloc)" if report.measured == Measured.HEAP else "")
    return (f"the growth is not in Python's small objects{heap}: memory the process maps "
            "itself (files, a library's own pool, thread stacks), or a C heap that "
            "fragments",
            "if it does not level off, look for a library cache that grows with each new input "
            "shape, or set MALLOC_ARENA_MAX=2 (glibc) to rule fragmentation out")


def resident_climb(its: list[IterationStats]
                   ) -> tuple[list[IterationStats], float, float] | None:
    """(the iterations of ``its`` with a reading, bytes per iteration, share of rising steps)
    when the process's resident memory climbs steadily over ``its`` (the complete iterations
    after warm-up) by :data:`MIN_GROWTH` at least, and the allocator's count (``allocated``:
    tensors, or the C heap on CPU's default backend) explains less than
    :data:`MAX_EXPLAINED` of it; else ``None``."""
    read = [it for it in its if it.resident is not None]
    climb = steady_climb([(it.index, it.resident) for it in read if it.resident is not None])
    if climb is None:
        return None
    rate, rising = climb
    grown = (read[-1].resident or 0) - (read[0].resident or 0)
    if grown < MIN_GROWTH or _rate(read, "allocated") >= MAX_EXPLAINED * rate:
        return None
    return read, rate, rising


def resident_growth(report: ReportData, its: list[IterationStats]) -> list[Finding]:
    """A hint when the process's resident memory climbs while the allocator's count stays
    flat (see :func:`resident_climb`), with what the readings tell of its source."""
    climb = resident_climb(its)
    if climb is None:
        return []
    read, rate, rising = climb
    first, last = read[0], read[-1]
    assert first.resident is not None and last.resident is not None
    grown = last.resident - first.resident
    counted = _rate(read, "allocated")
    source, fix = _source(report, read, rate)
    what = "the process heap" if report.measured == Measured.HEAP else "tensors"
    message = (
        f"the process's resident memory grows by {format_bytes(round(rate))}/iter: "
        f"+{format_bytes(grown)} from iteration {first.index} to {last.index}, higher after "
        f"{rising:.0%} of the iterations, while the allocator's count of {what} on "
        f"{report.device} changed {format_bytes(round(counted), signed=True)}/iter: no tensor "
        f"explains it; {source}"
    )
    return [Finding(rule="memory-growth", severity=Severity.HINT, message=message, fix=fix,
                    bytes=grown, rate=rate, subject=Subject(SubjectKind.PROCESS, "resident"),
                    iteration=last.index)]


__all__ = ["MIN_GROWTH", "PILE_UP_FIX", "python_values", "resident_climb", "resident_growth"]
