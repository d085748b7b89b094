"""What the census taken as tracking ended says of the leaks the schedule's censuses found.

The schedule takes censuses at doubling gaps (2, 3, 4, 6, 10, 18, 34, 66, ...), so the last
one can fall half a run before the end: 34 of 60 iterations. A container that fills to a
size and then stays (a cache of 30 batch shapes, a top-k that is full) climbs at every one of
those censuses and looks like a leak. When a holder still grew at the last of them, the
recorder takes one more census as tracking ends (``Census.closing``). The rules judge growth
on the schedule's censuses alone (their figures assume its spacing); this module then drops a
LEAK whose holder (or module's hooks) gained, between the last of them and the closing one,
less than a quarter of what its own pace promised over those iterations: it filled and
stayed. A holder whose series fell before (a container emptied every epoch: the closing
census may land just after a reset), one the closing census did not see (the function that
ran the loop may have returned), and a pace too slow for the gap to tell are left as judged.
A container that fills within the last few iterations of that gap is told by the lengths
read at every boundary instead (:mod:`memsentry.rules.stayed`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from memsentry.model import (
    Census,
    Finding,
    IterationStats,
    ReportData,
    Severity,
    Step,
    SubjectKind,
)
from memsentry.rules.series import Held, complete_censuses, held_by, holders_under
from memsentry.rules.stayed import kept_still
from memsentry.units import format_bytes

#: The share of the gain its pace promised that a holder must still gain by the end.
STILL = 0.25
#: Gains the pace must promise over the gap before their absence says anything: items
#: (tensors, models, arrays, nodes, buffers, hooks) and bytes.
MIN_ITEMS = 2.0
MIN_BYTES = 4096.0
#: The figures judged, with the least gain each must promise.
FIGURES = (("items", MIN_ITEMS), ("bytes", MIN_BYTES), ("nodes", MIN_ITEMS))
#: Iterations between the last one recorded and the end before the end says anything (the
#: recorder's own gap for the closing census: ``Tuning.carry_gap``).
MIN_GAP = 8


def settle(report: ReportData, findings: Sequence[Finding]) -> tuple[list[Finding], list[str]]:
    """``findings`` less the LEAKs the closing census shows stopped, and a note for each."""
    closing = _closing(report)
    if closing is None and not report.lengths:
        return list(findings), []
    regular = complete_censuses(report)
    kept, notes = [], []
    for finding in findings:
        note = _settled(report, regular, closing, finding) \
            if finding.severity is Severity.LEAK else None
        if note is None:
            kept.append(finding)
        else:
            notes.append(note)
    return kept, notes


def _settled(report: ReportData, regular: list[Census], closing: Census | None,
             finding: Finding) -> str | None:
    """The note saying that ``finding``'s subject stopped growing, by the closing census or
    by the lengths read at every boundary (:func:`~memsentry.rules.stayed.kept_still`)."""
    note = _stopped(regular, closing, finding) if closing is not None else None
    return note if note is not None else kept_still(report, regular, finding)


def _closing(report: ReportData) -> Census | None:
    last = report.censuses[-1] if report.censuses else None
    return last if last is not None and last.closing and last.complete else None


def _stopped(regular: list[Census], closing: Census, finding: Finding) -> str | None:
    """The note saying that ``finding``'s subject stopped growing, or ``None`` when it did
    not, or that cannot be told."""
    row = _row(regular, closing, finding)
    if row is None:
        return None
    seen = [held for held in row[:-1] if held is not None]
    end = row[-1]
    if len(seen) < 2 or row[-2] is None or end is None or not stayed(seen, end):
        return None
    subject = finding.subject
    assert subject is not None
    return _note(subject.name, seen[0], seen[-1], end, hooks=subject.kind is SubjectKind.MODULE)


def _row(regular: list[Census], closing: Census, finding: Finding
         ) -> list[Held | None] | None:
    """What the finding's subject kept at each census, the closing one last; ``None`` for a
    finding about no holder nor module."""
    subject = finding.subject
    censuses = (*regular, closing)
    if subject is not None and subject.kind is SubjectKind.HOLDER and subject.path is not None:
        path = subject.path
        return [_holder(census, path) for census in censuses]
    if subject is not None and subject.kind is SubjectKind.MODULE:
        module = None if subject.name == "<global hooks>" else subject.name
        return [_hooks(census, module) for census in censuses]
    return None


def stayed(seen: Sequence[Held], end: Held) -> bool:
    """Whether a subject that grew over ``seen`` (the schedule's censuses that saw it, the
    last one the latest) stayed, at ``end``, where it was: in every figure that grew (and
    never fell before) it gained less than :data:`STILL` of what its pace promised and gave
    back less than that share of its growth (a container emptied after the loop grew all
    through the run), with a promise large enough to tell in at least one."""
    first, last = seen[0], seen[-1]
    span, gap = last.iteration - first.iteration, end.iteration - last.iteration
    grew = _grew(seen)
    if span <= 0 or gap <= 0 or not grew:
        return False
    told = False
    for name, least in grew:
        promised = flat(getattr(first, name), getattr(last, name), getattr(end, name),
                        span=span, gap=gap)
        if promised is None:
            return False
        told = told or promised >= least
    return told


def _grew(seen: Sequence[Held]) -> list[tuple[str, float]]:
    """The figures (with their least promise) that grew from the first of ``seen`` to the
    last; none when one of them fell on the way (a container emptied at an epoch's start:
    the closing census may land just after a reset)."""
    first, last = seen[0], seen[-1]
    grew = [(name, least) for name, least in FIGURES
            if getattr(last, name) > getattr(first, name)]
    return [] if any(_fell(seen, name) for name, _ in grew) else grew


def flat(first: float, last: float, end: float, *, span: int, gap: int) -> float | None:
    """What a figure that went from ``first`` to ``last`` over ``span`` iterations promised
    over the ``gap`` that followed, when it ended there (``end``) within :data:`STILL` of
    that promise above and of its growth below; ``None`` when it moved on (a leak goes on
    growing; a container emptied at the end grew all through the run)."""
    grown = last - first
    promised = grown / span * gap
    if last - STILL * grown <= end < last + STILL * promised:
        return promised
    return None


def exit_stayed(first: IterationStats, last: IterationStats, end: IterationStats) -> bool:
    """Whether allocated memory, which grew from iteration ``first`` to ``last`` (the last
    one recorded: ``watch()`` records few), stayed where it was at ``end``, the partial
    iteration tracking closed :data:`MIN_GAP` or more iterations later, with a promise of
    :data:`MIN_BYTES` or more (:func:`flat`)."""
    span, gap = last.index - first.index, end.index - last.index
    if span <= 0 or gap < MIN_GAP or last.allocated <= first.allocated:
        return False
    promised = flat(first.allocated, last.allocated, end.allocated, span=span, gap=gap)
    return promised is not None and promised >= MIN_BYTES


def _fell(seen: Sequence[Held], name: str) -> bool:
    return any(getattr(b, name) < getattr(a, name) for a, b in itertools.pairwise(seen))


def _holder(census: Census, path: tuple[Step, ...]) -> Held | None:
    """The holder at ``path`` and those under it (a dict's keys, judged as one) at
    ``census``; ``None`` when it saw none."""
    under = holders_under(census, path)
    return held_by(census.iteration, under) if under else None


def _hooks(census: Census, module: str | None) -> Held | None:
    count = next((h.count for h in census.hooks if h.module == module), None)
    return None if count is None else Held(census.iteration, float(count), 0.0, 0.0)


def _note(name: str, first: Held, last: Held, end: Held, *, hooks: bool) -> str:
    if last.items > first.items:
        what = "hooks" if hooks else "tensors" if last.items == last.tensors else "objects"
        amounts = [f"{held.items:,.0f} {what}" for held in (first, last, end)]
    else:
        amounts = [format_bytes(round(held.bytes)) for held in (first, last, end)]
    return (
        f"`{name}` grew from {amounts[0]} to {amounts[1]} between iterations "
        f"{first.iteration} and {last.iteration}, and the holder search as tracking ended "
        f"(iteration {end.iteration}) found {amounts[2]}: it filled to a size and stayed, "
        "which is no leak, so no finding is made of it."
    )
