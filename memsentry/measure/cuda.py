"""CUDA memory: the caching allocator's own counters, per device.

Reading ``torch.cuda.memory_allocated()`` builds and flattens the whole statistics dict in
Python; the hook hot path reads the nested dict from ``torch._C._cuda_memoryStats`` once per
sample instead, and falls back to the public functions where that binding is missing.

Peaks: by default the backend never resets the allocator's peak counters, so what users
read from ``torch.cuda.max_memory_allocated()`` and the other peaks stays theirs. It reports
a peak for an interval only when the counter rose during it (a new high: exact); otherwise
the tracker's samples give a lower bound. ``exact=True`` resets the counters at every sample
to get every interval's true peak. torch has one reset, and it resets every peak: in
c10/cuda/CUDACachingAllocator.cpp ``DeviceCachingAllocator::resetPeakStats`` calls
``reset_peak_stat`` on the allocation, segment, active, inactive_split, allocated_bytes,
reserved_bytes, active_bytes, inactive_split_bytes and requested_bytes stats of every pool,
and on oversize_allocations and oversize_segments. Exact mode cannot spare the peaks it does
not read, so its note names them all: after it, ``max_memory_allocated()``,
``max_memory_reserved()`` and every ``.peak`` of ``memory_stats()`` reflect only the time
since memsentry's last sample.

Allocators (:mod:`memsentry.measure.allocators`): under ``backend:cudaMallocAsync`` the same
totals are read and no out-of-memory observer is attached (torch refuses one); under a
pluggable allocator torch refuses every counter and the backend measures nothing, saying so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from memsentry.measure.allocators import (
    PLUGGABLE_REFUSAL,
    async_note,
    support,
    unmeasured_note,
)
from memsentry.measure.base import IntervalPeak, first_sentence
from memsentry.model import Measured, PeakMode, PinnedMemory
from memsentry.model.allocators import CudaAllocator


@dataclass(frozen=True)
class AllocatorOom:
    """What the caching allocator told its out-of-memory observers when it gave up.

    c10/cuda/CUDACachingAllocator.cpp (``DeviceCachingAllocator::malloc``) calls each one as
    ``obs(device, alloc_size, set_fraction ? allowed_memory_maximum : device_total,
    device_free)``: ``segment`` is ``alloc_size``, the segment it asked the driver for
    (``get_allocation_size``: 2 MiB for a request up to 1 MiB, 20 MiB for one up to 10 MiB,
    larger ones rounded up to 2 MiB), not the tensor's own size; ``limit`` is the cap
    ``set_per_process_memory_fraction`` set, else the device's memory; ``free`` is what
    ``cudaMemGetInfo`` said was free on the device."""

    device: int
    segment: int
    limit: int
    free: int


class _OomObserver:
    """The caching allocator's out-of-memory observer (``torch._C.
    _cuda_attach_out_of_memory_observer``), attached once per process (torch has no way to
    detach one): it keeps the last event, numbered, and nothing else."""

    def __init__(self) -> None:
        self.attached = False
        self.count = 0
        self.last: AllocatorOom | None = None

    def attach(self) -> None:
        attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
        if self.attached or not callable(attach):
            return
        try:
            attach(self._observed)
        except (RuntimeError, TypeError):  # a torch that refuses: messages still give sizes
            return
        self.attached = True

    def _observed(self, device: int, segment: int, limit: int, device_free: int) -> None:
        self.count += 1
        self.last = AllocatorOom(int(device), int(segment), int(limit), int(device_free))


OOM_OBSERVER = _OomObserver()


def read_pinned() -> PinnedMemory | None:
    """The pinned host allocator's counters (``torch.cuda.host_memory_stats()``), or ``None``
    where CUDA has not started, this torch has no such counters (before 2.5), or nothing was
    ever pinned."""
    reader = getattr(torch.cuda, "host_memory_stats", None)
    if reader is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    try:
        stats = reader()
        held, in_use = int(stats["allocated_bytes.current"]), int(stats["active_bytes.current"])
        pinned = PinnedMemory(held=held, in_use=in_use if in_use <= held else None,
                              peak=int(stats["allocated_bytes.peak"]),
                              blocks=int(stats["allocations.current"]))
    except (RuntimeError, KeyError, TypeError, ValueError):  # a torch that names them otherwise
        return None
    return pinned if pinned.peak else None


class CudaBackend:
    """Allocated, reserved and peak bytes of one CUDA device from its allocator's counters.

    Under a pluggable allocator torch refuses every counter: the backend measures nothing
    (every figure reads 0, the device's memory is not given, so that no rule judges it) and
    says why in its notes. A refusal met later, in a hook (a torch that names no allocator,
    an allocator swapped after tracking began), makes it step aside the same way: no call it
    makes raises into the training loop."""

    measured = Measured.TENSORS

    def __init__(self, device: torch.device, *, exact: bool = False) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA is not available")
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        self._index = index
        self.support = support()
        self.name = self.support.backend_name
        self.peak_mode = PeakMode.EXACT if exact else PeakMode.SAMPLED
        self.notes: tuple[str, ...] = _peak_notes(exact)
        if self.support.allocator is CudaAllocator.ASYNC:
            self.notes += (async_note(self.device),)
        self._raw_stats = getattr(torch._C, "_cuda_memoryStats", None)
        self._blind = False
        if not self.support.counters:
            self._step_aside(PLUGGABLE_REFUSAL)
        self._peak = IntervalPeak(self._read()[2], self._reset_peak, exact=exact)

    def _step_aside(self, refusal: str) -> None:
        """Measure nothing from now on, and say why (``refusal``: torch's words)."""
        self._blind = True
        self.peak_mode = PeakMode.SAMPLED
        self.notes = (unmeasured_note(self.device, refusal),)

    def _read(self) -> tuple[int, int, int]:
        """(allocated, reserved, peak allocated) in one allocator call; zeros once the
        allocator refused."""
        if self._blind:
            return 0, 0, 0
        try:
            return self._read_counters()
        except Exception as error:  # torch refused: the loop must not see it
            self._step_aside(first_sentence(error))
            return 0, 0, 0

    def _read_counters(self) -> tuple[int, int, int]:
        # The raw call refuses a device index before CUDA is initialised ("Invalid device
        # argument"); torch's own readers answer 0 then.
        if self._raw_stats is not None and torch.cuda.is_initialized():
            nested = self._raw_stats(self._index)
            return (
                int(nested["allocated_bytes"]["all"]["current"]),
                int(nested["reserved_bytes"]["all"]["current"]),
                int(nested["allocated_bytes"]["all"]["peak"]),
            )
        return (
            torch.cuda.memory_allocated(self._index),
            torch.cuda.memory_reserved(self._index),
            torch.cuda.max_memory_allocated(self._index),
        )

    def _reset_peak(self) -> None:
        if self._blind:
            return
        try:
            torch.cuda.reset_peak_memory_stats(self._index)
        except Exception as error:
            self._step_aside(first_sentence(error))

    def sample(self) -> tuple[int, int | None]:
        allocated, _, peak = self._read()
        return allocated, None if self._blind else self._peak.read(peak)

    def allocated(self) -> int:
        return self._read()[0]

    def reserved(self) -> int | None:
        reserved = self._read()[1]
        return None if self._blind else reserved

    def peak_since_last_read(self) -> int | None:
        peak = self._read()[2]
        return None if self._blind else self._peak.read(peak)

    def total_memory(self) -> int | None:
        if self._blind:
            return None
        return int(torch.cuda.get_device_properties(self._index).total_memory)

    def stats(self) -> dict[str, Any]:
        if self._blind:
            return {}
        try:
            return dict(torch.cuda.memory_stats(self._index))
        except Exception as error:
            self._step_aside(first_sentence(error))
            return {}

    def summary(self) -> str:
        if not self._blind:
            try:
                return torch.cuda.memory_summary(self._index, abbreviated=True)
            except Exception as error:
                self._step_aside(first_sentence(error))
        return self.notes[0]

    def start(self) -> None:
        if self.support.observer:
            OOM_OBSERVER.attach()
        self._oom_seen = OOM_OBSERVER.count

    def oom(self) -> AllocatorOom | None:
        """The allocator's last out-of-memory event on this device since :meth:`start`."""
        event = OOM_OBSERVER.last
        if OOM_OBSERVER.count == getattr(self, "_oom_seen", OOM_OBSERVER.count) \
                or event is None or event.device != self._index:
            return None
        return event

    def stop(self) -> None:
        return None


def _peak_notes(exact: bool) -> tuple[str, ...]:
    if exact:
        return ("CUDA peaks are exact: memsentry reset the allocator's peak counters at every "
                "hook. torch.cuda.reset_peak_memory_stats() resets every peak the allocator "
                "keeps (bytes allocated, reserved, active and requested, and their counts), so "
                "torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved() and every "
                "'.peak' of torch.cuda.memory_stats() now read from memsentry's last sample, "
                "not from the start of your run; track without exact=True to keep them.",)
    return ("CUDA peaks use the allocator's peak counter when it rose, else samples taken at "
            "hooks (lower bounds); no peak statistic was reset: "
            "torch.cuda.max_memory_allocated(), max_memory_reserved() and memory_stats() are "
            "as your program left them.",)
