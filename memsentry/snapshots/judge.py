"""Verdicts on a recorded snapshot: what filled memory at the peak and at the end (by the
user's line and by the phase of training, guessed from the frames), the blocks that piled up
once per iteration, the out-of-memory errors the trace holds, and how the cached memory was
cut up. Pure functions of an :class:`~memsentry.snapshots.read.AllocatorSnapshot`."""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, replace

from memsentry.snapshots.frames import Part, part_of, user_frame
from memsentry.snapshots.read import AllocatorSnapshot, Event, Frame, Segment
from memsentry.snapshots.replay import Alive, Replay, freed_before, replay
from memsentry.snapshots.rhythm import Rhythm, rhythm

#: A stack piles up when blocks it made stay alive from this many iterations or more...
MIN_ITERATIONS = 4
#: ... in at least this share of the iterations from its first kept block to the end...
MIN_SHARE = 0.75
#: ... and a stack with no iterations read from the trace needs this many blocks kept, made
#: at gaps no longer than ``MAX_GAP`` times their median.
MIN_BLOCKS_UNTIMED = 8
MAX_GAP = 3.0
#: Sites the reports list at the peak and at the end (the verdict keeps all).
TOP_SITES = 8


@dataclass(frozen=True)
class SiteMemory:
    """Bytes alive from one line of the user's code (``site``: ``file:line (function)``, or
    ``None`` for stacks with none of the user's frames)."""

    site: str | None
    part: Part
    blocks: int
    bytes: int


@dataclass(frozen=True)
class PileUp:
    """Blocks made by one line of the user's code that stayed alive, once per iteration:
    ``blocks`` of ``bytes`` in all, kept in ``iterations`` of the ``span`` iterations from
    the first one kept to the end (``None``: the trace shows no iterations, and the blocks
    came at regular gaps of about ``gap`` entries). ``before``: blocks of the same line alive
    at the end that were made before the trace began (not in ``blocks``)."""

    site: str | None
    part: Part
    blocks: int
    bytes: int
    iterations: int | None
    span: int | None
    gap: float | None
    before: int = 0


@dataclass(frozen=True)
class OomEvent:
    """An out-of-memory error in the trace: ``requested`` bytes asked for, ``device_free``
    what the device said was free, ``allocated`` what tensors held then (by part and site)."""

    index: int
    requested: int
    device_free: int | None
    allocated: int
    parts: tuple[tuple[Part, int], ...]
    sites: tuple[SiteMemory, ...]


@dataclass(frozen=True)
class Cache:
    """The segments of a device when the snapshot was taken: ``reserved`` from the device,
    ``allocated`` in tensors, ``largest_free`` the largest cached block not in use;
    ``expandable`` whether segments were expandable (``None``: not said)."""

    segments: int
    reserved: int
    allocated: int
    largest_free: int
    expandable: bool | None


@dataclass(frozen=True)
class DeviceVerdict:
    """What one device's record shows; ``name`` is how it is said (``cuda:0``);
    ``phases_known`` is false where the stacks hold the user's frames only (the CPU record
    memsentry keeps), so no phase can be read from them."""

    device: int
    name: str
    phases_known: bool
    entries: int
    dropped: int | None
    before: int
    peak: int
    end: int
    iterations: int | None
    rhythm: str | None
    parts_at_peak: tuple[tuple[Part, int], ...]
    sites_at_peak: tuple[SiteMemory, ...]
    sites_at_end: tuple[SiteMemory, ...]
    pile_ups: tuple[PileUp, ...]
    ooms: tuple[OomEvent, ...]
    cache: Cache


@dataclass(frozen=True)
class SnapshotVerdict:
    """The verdicts on one snapshot file, a device at a time."""

    path: str
    file_bytes: int
    devices: tuple[DeviceVerdict, ...]
    settings: tuple[tuple[str, str | int | float | bool | None], ...]


def judge(snapshot: AllocatorSnapshot) -> SnapshotVerdict:
    """Every device's verdict."""
    devices = snapshot.devices or (0,)
    return SnapshotVerdict(path=snapshot.path, file_bytes=snapshot.file_bytes,
                           devices=tuple(judge_device(snapshot, d) for d in devices),
                           settings=snapshot.settings)


def judge_device(snapshot: AllocatorSnapshot, device: int) -> DeviceVerdict:
    played = replay(snapshot, device)
    trace = snapshot.trace(device)
    beat = rhythm(trace, snapshot.iteration_ends if device == 0 else None)
    return DeviceVerdict(
        device=device, name=snapshot.device_name(device),
        phases_known=snapshot.device_type != "cpu" or snapshot.phases, entries=played.entries,
        dropped=snapshot.dropped,
        before=played.before, peak=played.peak, end=played.end,
        iterations=beat.iterations if beat else None,
        rhythm=beat.source if beat else None, parts_at_peak=parts(played.at_peak.values()),
        sites_at_peak=sites(played.at_peak.values()),
        sites_at_end=sites(played.at_end.values()), pile_ups=pile_ups(played, trace, beat),
        ooms=tuple(_oom(index, event.size, event.device_free, alive)
                   for index, event, alive in played.ooms),
        cache=cache(snapshot, device))


def site_name(frame: Frame | None) -> str | None:
    return None if frame is None else f"{frame.filename}:{frame.line} ({frame.name})"


def parts(blocks: Iterable[Alive]) -> tuple[tuple[Part, int], ...]:
    """Bytes by part, largest first."""
    found: dict[Part, int] = {}
    for size, frames, _at in blocks:
        part = part_of(frames)
        found[part] = found.get(part, 0) + size
    return tuple(sorted(found.items(), key=lambda item: -item[1]))


def sites(blocks: Iterable[Alive]) -> tuple[SiteMemory, ...]:
    """The user's lines holding bytes among ``blocks``, largest first: all of them (the
    reports show the first :data:`TOP_SITES`; a diff of two records needs every one)."""
    found: dict[tuple[str | None, Part], list[int]] = {}
    for size, frames, _at in blocks:
        key = (site_name(user_frame(frames)), part_of(frames))
        tally = found.setdefault(key, [0, 0])
        tally[0] += 1
        tally[1] += size
    ranked = sorted(found.items(), key=lambda item: -item[1][1])
    return tuple(SiteMemory(site, part, count, size) for (site, part), (count, size) in ranked)


def pile_ups(played: Replay, trace: tuple[Event, ...], beat: Rhythm | None
             ) -> tuple[PileUp, ...]:
    """The user's lines whose stacks kept a block alive once per iteration (see
    :func:`piles_up`), each line's stacks summed, largest first."""
    kept: dict[tuple[Frame, ...], list[Alive]] = {}
    for block in played.at_end.values():
        if block[2] >= 0:
            kept.setdefault(block[1], []).append(block)
    freed = freed_before(trace, {stack: _first_and_next(blocks, beat, played.entries)
                                 for stack, blocks in kept.items()})
    found: dict[str | None, PileUp] = {}
    for stack, blocks in kept.items():
        pile = piles_up(stack, blocks, freed.get(stack, 0), beat, played.entries)
        if pile is not None:
            found[pile.site] = _merged(found.get(pile.site), pile)
    older = _older_by_site(played)
    return tuple(sorted((replace(pile, before=older.get(pile.site, 0))
                         for pile in found.values()), key=lambda pile: -pile.bytes))


def _older_by_site(played: Replay) -> dict[str | None, int]:
    """Blocks alive at the end made before the trace began, by the user's line."""
    found: dict[str | None, int] = {}
    for _size, frames, at in played.at_end.values():
        if at < 0:
            site = site_name(user_frame(frames))
            found[site] = found.get(site, 0) + 1
    return found


def _first_and_next(blocks: list[Alive], beat: Rhythm | None, entries: int
                    ) -> tuple[int, int]:
    """The ``alloc`` indices of the first of ``blocks`` and of the first one kept from a later
    iteration (without iterations: from the next burst, :func:`burst_near`). A block made
    before the first and freed after the second outlived an iteration; the temporaries of
    the first iteration (saved for its backward, freed by it) did not."""
    made = sorted(block[2] for block in blocks)
    first, near = made[0], burst_near(len(made), entries)
    for index in made[1:]:
        if _later_iteration(first, index, beat, near):
            return first, index
    return first, made[-1]


def _later_iteration(first: int, index: int, beat: Rhythm | None, near: float) -> bool:
    if beat is not None:
        return beat.iteration_of(index) > beat.iteration_of(first)
    return index - first > near


def burst_near(blocks: int, entries: int) -> float:
    """Without iterations, allocations of one stack closer than this many trace entries are
    one burst (one iteration's): half the gap they would have if the ``blocks`` were spread
    evenly over the trace's ``entries``."""
    return entries / max(1, blocks) / 2


def piles_up(stack: tuple[Frame, ...], blocks: list[Alive], freed_before: int,
             beat: Rhythm | None, entries: int) -> PileUp | None:
    """A pile-up when the blocks ``stack`` made and kept to the end came once per iteration:
    kept from at least :data:`MIN_ITERATIONS` iterations, in :data:`MIN_SHARE` of those from
    the first kept to the end, with none of the stack's earlier blocks freed (more than one
    iteration's worth: a bounded buffer frees its oldest); without iterations, at regular
    gaps, spread over the trace (``entries`` long)."""
    made = sorted(block[2] for block in blocks)
    each = max(1, round(len(made) / max(1, len({*made}))))
    if freed_before > each:
        return None
    site, part = site_name(user_frame(stack)), part_of(stack)
    size = sum(block[0] for block in blocks)
    if beat is not None:
        kept = {beat.iteration_of(index) for index in made}
        span = beat.iterations - min(kept)
        if len(kept) < MIN_ITERATIONS or len(kept) < MIN_SHARE * span:
            return None
        return PileUp(site, part, len(made), size, len(kept), span, None)
    gap = _regular_gap(made, entries)
    if gap is None:
        return None
    return PileUp(site, part, len(made), size, None, None, gap)


def _regular_gap(made: list[int], entries: int) -> float | None:
    """The median gap between the bursts of allocations at ``made`` (:func:`burst_near`)
    when there are :data:`MIN_BLOCKS_UNTIMED` bursts or more, spread
    over half the trace at least, none much further apart than the median; else ``None``."""
    if len(made) < MIN_BLOCKS_UNTIMED:
        return None
    near = burst_near(len(made), entries)
    starts = [made[0]] + [later for earlier, later in itertools.pairwise(made)
                          if later - earlier > near]
    if len(starts) < MIN_BLOCKS_UNTIMED or made[-1] - made[0] < entries / 2:
        return None
    gaps = [later - earlier for earlier, later in itertools.pairwise(starts)]
    middle = statistics.median(gaps)
    if middle <= 0 or max(gaps) > MAX_GAP * middle:
        return None
    return float(middle)


def _merged(old: PileUp | None, new: PileUp) -> PileUp:
    """Two stacks of one line: blocks and bytes summed, the iterations of the steadier one."""
    if old is None:
        return new
    steadier = old if (old.iterations or 0) >= (new.iterations or 0) else new
    return PileUp(new.site, steadier.part, old.blocks + new.blocks, old.bytes + new.bytes,
                  steadier.iterations, steadier.span, steadier.gap)


def _oom(index: int, requested: int, device_free: int | None, alive: dict[int, Alive]
         ) -> OomEvent:
    blocks = list(alive.values())
    return OomEvent(index=index, requested=requested, device_free=device_free,
                    allocated=sum(size for size, _frames, _at in blocks), parts=parts(blocks),
                    sites=sites(blocks))


def cache(snapshot: AllocatorSnapshot, device: int) -> Cache:
    """How ``device``'s segments were used when the snapshot was taken (a block waiting for
    another stream, ``active_pending_free``, still holds its memory)."""
    mine = [segment for segment in snapshot.segments if segment.device == device]
    blocks = [block for segment in mine for block in segment.blocks]
    free = [block.size for block in blocks if block.state == "inactive"]
    return Cache(segments=len(mine), reserved=sum(s.total_size for s in mine),
                 allocated=sum(block.size for block in blocks if block.state != "inactive"),
                 largest_free=max(free, default=0), expandable=_expandable(snapshot, mine))


def _expandable(snapshot: AllocatorSnapshot, segments: list[Segment]) -> bool | None:
    """Whether segments were expandable: as the segments say (``is_expandable``), else as
    ``allocator_settings`` does; ``None`` when neither says."""
    said = {segment.expandable for segment in segments if segment.expandable is not None}
    if said:
        return True in said
    setting = snapshot.setting("expandable_segments")
    return setting if isinstance(setting, bool) else None


__all__ = ["Cache", "DeviceVerdict", "OomEvent", "PileUp", "SiteMemory", "SnapshotVerdict",
           "judge", "judge_device", "parts", "piles_up", "sites"]
