"""The lengths of the containers the censuses found growing, read at every boundary closed.

The censuses fall at doubling gaps, so the last can come half a run before the end: a cache
that fills within that gap climbed at every census. Its length, read again at each boundary
(:mod:`memsentry.census.reach`: a few lookups, no census), shows when it stopped. Which
holders are followed is decided from the censuses alone (:func:`followed`); at most
:data:`LIMIT` of them.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from torch import nn

from memsentry.census.reach import Follower, Reach, reach_of
from memsentry.model import Census, HolderLength, HolderStats, Step

#: The most containers followed at once.
LIMIT = 8


class LastTwo(NamedTuple):
    """The last complete census's ``holders``, those of the complete census before by path
    (``before``), and the paths of the containers whose keys that one saw (``parents``: a
    dict's string key is a holder of its own)."""

    holders: tuple[HolderStats, ...]
    before: dict[tuple[Step, ...], HolderStats]
    parents: set[tuple[Step, ...]]


def last_two(censuses: Sequence[Census]) -> LastTwo | None:
    """The last two complete censuses, to compare; ``None`` before there are two."""
    complete = [c for c in censuses if c.complete]
    if len(complete) < 2:
        return None
    before = {h.path: h for h in complete[-2].holders}
    return LastTwo(complete[-1].holders, before,
                   {path[:-1] for path in before if len(path) > 1})


def followed(censuses: Sequence[Census]) -> list[tuple[tuple[Step, ...], Reach]]:
    """The containers to follow after the last complete census: those that kept more items
    than at the complete census before, and the dicts that gained a key beside those it saw
    (each key a holder of its own), as each can be reached again."""
    pair = last_two(censuses)
    if pair is None:
        return []
    chosen: dict[tuple[Step, ...], Reach] = {}
    for holder in pair.holders:
        for path in _grown(holder, pair.before.get(holder.path), pair.parents):
            reach = reach_of(path, holder.kind, holder.scope)
            if reach is not None:
                chosen.setdefault(path, reach)
    return list(chosen.items())


def _grown(holder: HolderStats, was: HolderStats | None, parents: set[tuple[Step, ...]]
           ) -> list[tuple[Step, ...]]:
    """The paths of containers that grew: ``holder``'s when it holds more items than it
    did, its parent's when it is a new key of a container the census before saw."""
    if was is None:
        return [holder.path[:-1]] if len(holder.path) > 1 and holder.path[:-1] in parents \
            else []
    grew = holder.items is not None and was.items is not None and holder.items > was.items
    return [holder.path] if grew else []


@dataclass
class _Track:
    """One container followed (mutable: the recorder's state)."""

    follower: Follower
    items: int | None = None
    since: int = 0
    until: int = 0
    first: int = 0
    pause: int = 0
    spacing: int = 0

    def read(self, iteration: int, items: int) -> None:
        """Its length ``items`` at the boundary closing ``iteration``."""
        if self.items is None:
            self.items, self.since, self.until, self.first = items, iteration, iteration, \
                iteration
            return
        if iteration <= self.until:  # iterations merged: read again from here
            return
        if items != self.items:
            self.pause = max(self.pause, self.until - self.since)
            self.items, self.since = items, iteration
        self.spacing = max(self.spacing, iteration - self.until)
        self.until = iteration


class Lengths:
    """The containers followed and what was read of them."""

    def __init__(self) -> None:
        self.tracks: dict[tuple[Step, ...], _Track] = {}

    def follow(self, censuses: Sequence[Census], model: nn.Module | None) -> None:
        """After a census: follow the containers it found growing (up to :data:`LIMIT`)."""
        for path, reach in followed(censuses):
            if path in self.tracks or len(self.tracks) >= LIMIT:
                continue
            self.tracks[path] = _Track(Follower(reach, model))

    def read(self, iteration: int, frame: types.FrameType | None) -> None:
        """At the boundary closing ``iteration``: each container's length, where it is
        reached (``frame``: the boundary's)."""
        for track in self.tracks.values():
            items = track.follower.length(frame)
            if items is not None:
                track.read(iteration, items)

    def freeze(self) -> tuple[HolderLength, ...]:
        return tuple(
            HolderLength(path, track.items, track.since, track.until, track.first,
                         pause=track.pause, spacing=track.spacing)
            for path, track in self.tracks.items() if track.items is not None)
