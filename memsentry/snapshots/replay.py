"""Replaying a device's trace: the blocks alive at each entry, the peak, and what was alive
at the peak, at an out-of-memory error and at the end.

The allocated figure follows torch's own reading of a trace (``trace()`` in
torch/cuda/_memory_viz.py, and the viewer's "Active Memory Timeline"): an ``alloc`` adds its
size (the bytes requested, before rounding), a ``free_completed`` takes it away (a
``free_requested`` block waits for another stream and still holds its memory). The trace
keeps only the newest entries (``max_entries``), so blocks made before it began are found
from what it shows of them: a free of an address it never allocated, and the blocks alive in
the snapshot's segments that it never allocated. Those count from the first entry, with the
stack their free or their block carries.
"""

from __future__ import annotations

from dataclasses import dataclass

from memsentry.snapshots.read import AllocatorSnapshot, Event, Frame

#: What a block alive in the replay is: (size, stack, index of its ``alloc`` entry, or -1
#: when it was made before the trace began).
Alive = tuple[int, tuple[Frame, ...], int]


@dataclass(frozen=True)
class Replay:
    """One device's trace replayed. ``before`` is what was allocated when the trace began,
    ``peak`` the highest allocated figure (``peak_at``: the index of the entry that reached
    it, -1 when the trace never went above ``before``), ``end`` the figure after the last
    entry; ``at_peak`` and ``at_end`` the blocks alive then, by address."""

    device: int
    entries: int
    before: int
    peak: int
    peak_at: int
    end: int
    at_peak: dict[int, Alive]
    at_end: dict[int, Alive]
    ooms: tuple[tuple[int, Event, dict[int, Alive]], ...]


def initial_blocks(snapshot: AllocatorSnapshot, device: int) -> dict[int, Alive]:
    """The blocks alive when ``device``'s trace began, as the viewer finds them
    (``process_alloc_data`` in torch's MemoryViz.js): a free with no ``alloc`` before it in
    the trace, with the stack it carries, and each ``active_allocated`` block of the segments
    whose address the trace leaves unallocated, at its requested size."""
    trace = snapshot.trace(device)
    made, found = _frees_before(trace)
    for segment in snapshot.segments:
        if segment.device != device:
            continue
        for block in segment.blocks:
            if block.state == "active_allocated" and block.address not in made \
                    and block.address not in found:
                found[block.address] = (block.requested, block.frames, -1)
    return found


def _frees_before(trace: tuple[Event, ...]) -> tuple[set[int], dict[int, Alive]]:
    """(the addresses the trace leaves allocated, the blocks it frees without having made
    them)."""
    made: set[int] = set()
    found: dict[int, Alive] = {}
    for event in trace:
        if event.address is None:
            continue
        if event.action == "alloc":
            made.add(event.address)
        elif event.action == "free_completed":
            if event.address not in made and event.address not in found:
                found[event.address] = (event.size, event.frames, -1)
            made.discard(event.address)
    return made, found


def replay(snapshot: AllocatorSnapshot, device: int) -> Replay:
    """``device``'s trace replayed from the blocks alive when it began."""
    trace = snapshot.trace(device)
    start = initial_blocks(snapshot, device)
    before = sum(size for size, _frames, _at in start.values())
    peak_at, peak = _peak(trace, before)
    alive = dict(start)
    at_peak = dict(start) if peak_at < 0 else {}
    ooms = []
    for index, event in enumerate(trace):
        _apply(alive, event, index)
        if index == peak_at:
            at_peak = dict(alive)
        if event.action == "oom":
            ooms.append((index, event, dict(alive)))
    end = sum(size for size, _frames, _at in alive.values())
    return Replay(device=device, entries=len(trace), before=before, peak=peak,
                  peak_at=peak_at, end=end, at_peak=at_peak, at_end=alive, ooms=tuple(ooms))


def _peak(trace: tuple[Event, ...], before: int) -> tuple[int, int]:
    """(index, bytes) of the highest allocated figure; (-1, ``before``) when never above."""
    now, peak, peak_at = before, before, -1
    for index, event in enumerate(trace):
        if event.action == "alloc":
            now += event.size
            if now > peak:
                peak, peak_at = now, index
        elif event.action == "free_completed":
            now -= event.size
    return peak_at, peak


def _apply(alive: dict[int, Alive], event: Event, index: int) -> None:
    if event.address is None:
        return
    if event.action == "alloc":
        alive[event.address] = (event.size, event.frames, index)
    elif event.action == "free_completed":
        alive.pop(event.address, None)





def freed_before(trace: tuple[Event, ...], kept: dict[tuple[Frame, ...], tuple[int, int]]
                 ) -> dict[tuple[Frame, ...], int]:
    """For each stack of ``kept`` (stack -> the indices of the ``alloc`` entries of its first
    two blocks kept to the end), how many blocks it made before the first were freed after
    the second was made: blocks that outlived an iteration and were let go (the oldest of a
    bounded window), not the temporaries of the first iteration."""
    made: dict[int, tuple[tuple[Frame, ...], int]] = {}
    freed: dict[tuple[Frame, ...], int] = {}
    for index, event in enumerate(trace):
        if event.address is None:
            continue
        if event.action == "alloc" and event.frames in kept:
            made[event.address] = (event.frames, index)
        elif event.action == "free_completed" and event.address in made:
            stack, at = made.pop(event.address)
            first, second = kept[stack]
            if at < first and index > second:
                freed[stack] = freed.get(stack, 0) + 1
    return freed


__all__ = ["Alive", "Replay", "freed_before", "initial_blocks", "replay"]
