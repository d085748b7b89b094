"""What the lengths read at every boundary say of a LEAK the censuses found: a container that
grew at each census and then kept one length to the end filled to a size and stayed.

The recorder follows the containers the censuses found growing and reads their length at
each boundary it closes (:class:`~memsentry.model.HolderLength`). A LEAK about such a holder
is dropped when the growth was in its items (what each item keeps did not grow), and it has
kept one length up to the last boundary of the run for :data:`~memsentry.rules.closing.
MIN_GAP` iterations or more, over which its own pace promised 2 items or more, and for
twice as long as it ever paused before and twice the widest spacing of the readings (a
leak that grows in bursts pauses between them; a pause shorter than the spacing could go
unseen).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from memsentry.model import (
    Census,
    Finding,
    HolderLength,
    HolderStats,
    ReportData,
    Step,
    SubjectKind,
)
from memsentry.rules.series import Held, held_by, holders_under

#: The share by which what each item keeps may rise while the growth is still in the items.
PER_ITEM = 0.25
#: Iterations it must keep one length (at least), and the least gain its pace must promise.
MIN_STILL = 8
MIN_ITEMS = 2.0
#: How many times longer than its longest pause, and the readings' widest spacing.
LONGER = 2


def kept_still(report: ReportData, regular: Sequence[Census], finding: Finding) -> str | None:
    """The note saying that ``finding``'s holder filled and stayed, by the lengths read at
    the boundaries; ``None`` when it did not, or that cannot be told."""
    subject = finding.subject
    if subject is None or subject.kind is not SubjectKind.HOLDER or subject.path is None \
            or not report.iterations:
        return None
    own = _read_still(report, subject.path)
    growth = _growth(regular, subject.path)
    if own is None or growth is None:
        return None
    first, last = growth
    pace = (last.length - first.length) / (last.held.iteration - first.held.iteration)
    if pace * own.still < MIN_ITEMS:
        return None
    return _note(subject.name, first, last, own)


def _read_still(report: ReportData, path: tuple[Step, ...]) -> HolderLength | None:
    """The lengths read of the container at ``path``, when it and every container followed
    under it kept one length up to the run's last boundary long enough to tell."""
    under = [held for held in report.lengths if held.path[:len(path)] == path]
    own = next((held for held in under if held.path == path), None)
    end = report.iterations[-1].index
    if own is None or not all(_still(held, end) for held in under):
        return None
    return own


class _Kept(NamedTuple):
    """What a holder (with what is under it) kept at one census, and its ``length`` (a dict
    whose keys are holders of their own: the keys seen)."""

    held: Held
    length: int


def _growth(regular: Sequence[Census], path: tuple[Step, ...]) -> tuple[_Kept, _Kept] | None:
    """What the holder at ``path`` kept at the first and last of the schedule's censuses
    that saw it, when it grew by its length, and what it keeps for each entry (objects,
    bytes) did not grow by more than :data:`PER_ITEM`: entries that grow themselves (lists
    that lengthen) are not told by the length."""
    seen = [kept for census in regular if (kept := _kept(census, path)) is not None]
    if len(seen) < 2:
        return None
    first, last = seen[0], seen[-1]
    if last.held.iteration <= first.held.iteration or last.length <= first.length \
            or first.length <= 0:
        return None
    for name in ("items", "bytes"):
        if getattr(last.held, name) / last.length > \
                (1 + PER_ITEM) * getattr(first.held, name) / first.length:
            return None
    return first, last


def _kept(census: Census, path: tuple[Step, ...]) -> _Kept | None:
    under = holders_under(census, path)
    if not under:
        return None
    return _Kept(held_by(census.iteration, under), _length(under, path))


def _length(under: list[HolderStats], path: tuple[Step, ...]) -> int:
    """The length of the container at ``path``: its own count, or the keys seen under it
    (a dict whose keys are holders of their own)."""
    own = next((h.items for h in under if h.path == path and h.items is not None), None)
    if own is not None:
        return own
    return len({h.path[len(path)] for h in under if len(h.path) > len(path)})


def _still(held: HolderLength, end: int) -> bool:
    """Whether the container kept one length from long enough before ``end`` (the run's
    last boundary) up to it."""
    least = max(MIN_STILL, LONGER * held.pause, LONGER * held.spacing)
    return held.until >= end - 1 and held.still >= least


def _note(name: str, first: _Kept, last: _Kept, held: HolderLength) -> str:
    begun, ended = first.held, last.held
    what = "tensors" if ended.items == ended.tensors else "objects"
    return (
        f"`{name}` grew from {begun.items:,.0f} to {ended.items:,.0f} {what} between "
        f"iterations {begun.iteration} and {ended.iteration}, and its length, read at every "
        f"boundary since, stayed at {held.items:,} from iteration {held.since} to the end "
        f"({held.until}): it filled to a size and stayed, which is no leak, so no finding "
        "is made of it."
    )
