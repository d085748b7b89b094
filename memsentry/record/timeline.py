"""The iteration clock and the bounded timeline of closed iterations."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from memsentry.measure.processes import ResidentReader
from memsentry.model import Boundary, Breakdown, IterationStats
from memsentry.model.processes import ProcessSample, WorkerMemory
from memsentry.record.batches import install, uninstall, waited
from memsentry.record.clock import Clock
from memsentry.record.signals import Signals
from memsentry.record.workers import recorded, sample


def batch_size(args: Any) -> int | None:
    """The first dimension of the first tensor among a call's arguments."""
    for value in args if isinstance(args, tuple) else (args,):
        if isinstance(value, torch.Tensor):
            return int(value.shape[0]) if value.dim() else None
    return None


class IterationClock:
    """The running iteration: its index, when it began, its module calls, its batch size and
    the batch fetches its thread made since it began (see :mod:`memsentry.record.batches`)."""

    def __init__(self, clock: Clock = time.perf_counter) -> None:
        self.now = clock  # the recorder's one clock
        self.index = 0
        self.started = clock()
        self.calls = 0
        self.batch: int | None = None
        self._fetched = waited()
        self._timing = False
        self._began = clock()
        self._processes: tuple[tuple[WorkerMemory, ...], tuple[ProcessSample, ...]] = ((), ())
        self._resident = ResidentReader()

    def time_batches(self) -> None:
        """Time the DataLoader fetches, and follow the loaders' worker processes, from now on
        until :meth:`stop_timing_batches`."""
        if not self._timing:
            install()
            self._timing = True
            self._fetched = waited()
            self._began = self.now()
            sample(charged=False)  # the process's memory as tracking begins

    def stop_timing_batches(self) -> None:
        if self._timing:
            sample(charged=False)  # the workers' and the process's memory as tracking ends
            self._resident.close()
            self._processes = recorded(self._began)
            uninstall()
            self._timing = False

    def processes(self) -> tuple[tuple[WorkerMemory, ...], tuple[ProcessSample, ...]]:
        """The DataLoader workers followed and the process's own readings (see
        :mod:`memsentry.record.workers`), as they stood when tracking stopped."""
        return recorded(self._began) if self._timing else self._processes

    def data_seconds(self, iterations: int = 1) -> float | None:
        """Seconds the running iteration's thread waited for DataLoader batches since it
        began, per iteration over ``iterations``; ``None`` when it fetched none (the loop
        reads its data some other way, or did not read any)."""
        batches, seconds = waited()
        if batches <= self._fetched[0]:
            return None
        return (seconds - self._fetched[1]) / iterations

    def module_called(self, args: Any, *, outermost: bool) -> None:
        if outermost and self.batch is None:
            self.batch = batch_size(args)
        self.calls += 1

    def close(self, boundary: Boundary, allocated: int, reserved: int | None, peak: int,
              now: float, parts: Breakdown | None = None, *,
              exact: bool = False, own_blocks: int = 0) -> IterationStats:
        """The record of the iteration ending now (``exact``: its peak counts every
        allocation; ``own_blocks``: Python blocks memsentry's censuses added, left out)."""
        return IterationStats(
            index=self.index, allocated=allocated, reserved=reserved, peak=peak,
            peak_exact=exact,
            seconds=now - self.started, boundary=boundary, forward_calls=self.calls,
            data_seconds=self.data_seconds(), batch=self.batch, parts=parts,
            resident=self.resident(), python_blocks=self.python_blocks(own_blocks),
        )

    @staticmethod
    def python_blocks(own_blocks: int) -> int:
        """Python's small-object blocks in use, less ``own_blocks`` (the censuses' records).
        The count walks every arena of Python's allocator (30 us with torch imported, 100 us
        beside a million lists): it is read at full boundaries, and at light ones only
        where a census ran in the iteration (whose milliseconds dwarf it)."""
        return sys.getallocatedblocks() - own_blocks

    def resident(self) -> int | None:
        """The process's resident bytes now (1.4 us: ``statm`` kept open)."""
        return self._resident.read()

    def advance(self, now: float) -> None:
        """Begin the next iteration at ``now`` (after what the boundary's own work took)."""
        self.index += 1
        self.started = now
        self.calls = 0
        self.batch = None
        self._fetched = waited()


@dataclass
class Timeline:
    """Per-iteration records, bounded: past ``capacity`` every other record is dropped, and
    from then on only every ``stride``-th iteration is kept, so a long run costs fixed memory."""

    capacity: int = 10_000
    items: list[IterationStats] = field(default_factory=list)
    stride: int = 1
    dropped: int = 0
    merged_sampled: int = 0  # sampled iterations the last close merged into the one it closed

    def add(self, item: IterationStats) -> None:
        if item.index % self.stride and item.boundary != Boundary.EXIT:  # the end is kept
            self.dropped += 1
            return
        self.items.append(item)
        if len(self.items) > self.capacity:
            self.stride *= 2
            kept = [it for it in self.items if it.index % self.stride == 0]
            self.dropped += len(self.items) - len(kept)
            self.items = kept

    def close(self, closing: IterationStats, *, merge: bool = False) -> int | None:
        """Add the iteration ``closing``; with ``merge``, as one with the newest items that
        weaker boundaries closed just before it (they were parts of it). Returns the merged
        iteration's index, or ``None`` when nothing was merged."""
        parts: list[IterationStats] = []
        if merge:
            for item in reversed(self.items):
                if not Signals.weaker(item.boundary, than=closing.boundary):
                    break
                parts.insert(0, item)
        self.merged_sampled = sum(part.sampled for part in parts)
        if not parts:
            self.add(closing)
            return None
        return self.merge_tail(parts, closing)

    def merge_tail(self, parts: list[IterationStats], closing: IterationStats) -> int:
        """Replace ``parts`` (the newest items) and the iteration ``closing`` by one iteration
        numbered as the first part; returns its index."""
        del self.items[len(self.items) - len(parts):]
        first = parts[0] if parts else closing
        highest = max([*parts, closing], key=lambda p: p.peak)
        self.items.append(replace(
            closing, index=first.index, peak=highest.peak, parts=highest.parts,
            peak_exact=all(part.peak_exact for part in [*parts, closing]),
            seconds=closing.seconds + sum(p.seconds for p in parts),
            forward_calls=closing.forward_calls + sum(p.forward_calls for p in parts),
            data_seconds=first.data_seconds, batch=first.batch,
        ))
        return first.index
