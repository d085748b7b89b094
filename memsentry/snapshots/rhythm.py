"""The iterations of a recorded trace, from its rhythm: each optimizer step (a run of
allocations made inside ``torch/optim``) ends one; without steps, each backward does. A trace
of neither (inference, or a trace with no stacks) has no iterations read from it."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from memsentry.snapshots.frames import Part, part_of
from memsentry.snapshots.read import Event


@dataclass(frozen=True)
class Rhythm:
    """Iteration ends (the index of each step's or backward's last ``alloc`` entry) and what
    they were read from (``"its optimizer steps"``, ``"its backwards"``, memsentry's marks)."""

    ends: tuple[int, ...]
    source: str
    open_end: bool = False

    @property
    def iterations(self) -> int:
        """Iterations the trace covers: each end closes one; allocations after the last end
        are one more (begun, not ended: ``open_end``)."""
        return len(self.ends) + self.open_end

    def iteration_of(self, index: int) -> int:
        """The iteration an entry at ``index`` belongs to (0: up to the first end)."""
        return bisect.bisect_left(self.ends, index)


def rhythm(trace: tuple[Event, ...], marks: tuple[int, ...] | None = None) -> Rhythm | None:
    """The iterations of ``trace``: where ``marks`` says they ended (memsentry marked them
    while recording), else by its optimizer steps, else by its backwards; ``None`` when it
    shows fewer than two of either."""
    allocs = [index for index, event in enumerate(trace) if event.action == "alloc"]
    last = allocs[-1] if allocs else -1
    marked = _marked(marks, len(trace), last)
    if marked is not None:
        return marked
    parts = [(index, part_of(trace[index].frames)) for index in allocs]
    for part, source in ((Part.STEP, "its optimizer steps"), (Part.BACKWARD, "its backwards")):
        ends = _run_ends(parts, part)
        if len(ends) >= 2:
            return Rhythm(tuple(ends), source, open_end=last > ends[-1])
    return None


def _marked(marks: tuple[int, ...] | None, entries: int, last: int) -> Rhythm | None:
    """The iterations memsentry's ``marks`` give a trace of ``entries`` whose last
    allocation is at ``last``; ``None`` with fewer than two."""
    ends = sorted(end for end in marks or () if end < entries)
    if len(ends) < 2:
        return None
    return Rhythm(tuple(ends), "the iteration ends memsentry marked", open_end=last > ends[-1])


def _run_ends(parts: list[tuple[int, Part]], wanted: Part) -> list[int]:
    """The index of the last allocation of each run of allocations made in ``wanted``."""
    ends: list[int] = []
    last: int | None = None
    for index, part in parts:
        if part is wanted:
            last = index
        elif last is not None:
            ends.append(last)
            last = None
    if last is not None:
        ends.append(last)
    return ends


__all__ = ["Rhythm", "rhythm"]
