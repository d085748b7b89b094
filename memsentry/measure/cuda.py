"""CUDA memory: the caching allocator's own counters, per device.

Reading ``torch.cuda.memory_allocated()`` builds and flattens the whole statistics dict in
Python; the hook hot path reads the nested dict from ``torch._C._cuda_memoryStats`` once per
sample instead, and falls back to the public functions where that binding is missing.

Peaks: an iteration's peak is exact by default. torch's peak counter is an all-time high
(c10/core/CachingDeviceAllocator.h: ``Stat::increase`` keeps ``peak = max(current, peak)``),
so the backend resets it where each iteration begins (:meth:`CudaBackend.restart_peak`), and
:mod:`memsentry.measure.peaks` keeps what the program reads as it would be without memsentry:
``max_memory_allocated()``, every ``.peak`` of ``memory_stats()`` and the program's own
``reset_peak_memory_stats()``. Inside an iteration, a layer's peak is exact when the counter
rose during it (a new high of the iteration); otherwise the samples at hooks give a lower
bound. ``exact=True`` resets the counter at every sample, so every layer's peak is exact too.

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
from memsentry.measure.peaks import CUDA_PEAKS, Account
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
    detach one): it keeps the last event, numbered, and nothing else.

    It is attached only once the program has started CUDA: c10/cuda/CUDACachingAllocator.cpp's
    ``NativeCachingAllocator::attachOutOfMemoryObserver`` hands the observer to each device's
    allocator in ``device_allocator``, which ``init`` fills when CUDA starts, so an observer
    attached before then is attached to no device (and the attach itself would be a CUDA call
    in a process that made none)."""

    def __init__(self) -> None:
        self.attached = False
        self.count = 0
        self.last: AllocatorOom | None = None

    def attach(self) -> None:
        attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
        if self.attached or not callable(attach) or not torch.cuda.is_initialized():
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
    if reader is None or not torch.cuda.is_initialized():
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

    The peak counter is reset where each iteration begins (:meth:`restart_peak`; at every
    sample with ``exact``), through :data:`memsentry.measure.peaks.CUDA_PEAKS`, which keeps the
    program's own reads of it unchanged. Nothing is read or reset before the program has
    started CUDA (torch's raw statistics call refuses the device then; there is nothing to
    read).

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
        self.peak_mode = PeakMode.EXACT if exact else PeakMode.ITERATIONS
        self.notes: tuple[str, ...] = (_peak_note(exact),)
        if self.support.allocator is CudaAllocator.ASYNC:
            self.notes += (async_note(self.device),)
        self._account: Account | None = None
        self._observe = False  # the out-of-memory observer waits for CUDA to start
        self._blind = False
        if not self.support.counters:
            self._step_aside(PLUGGABLE_REFUSAL)
        self._peak = IntervalPeak(0, self._reset_peak, exact=exact)

    def _step_aside(self, refusal: str) -> None:
        """Measure nothing from now on, and say why (``refusal``: torch's words)."""
        self._blind = True
        self.peak_mode = PeakMode.SAMPLED
        self.notes = (unmeasured_note(self.device, refusal),)
        self._leave()

    def _read(self) -> tuple[int, int, int]:
        """(allocated, reserved, peak allocated) in one allocator call; zeros once the
        allocator refused, or before the program started CUDA."""
        if self._blind or not torch.cuda.is_initialized():
            return 0, 0, 0
        if self._observe:  # the program started CUDA since tracking began
            self._observe = False
            if support().observer:  # the allocator it started with, maybe another
                OOM_OBSERVER.attach()
        try:
            nested = self._raw_stats(self._index)
            allocated = int(nested["allocated_bytes"]["all"]["current"])
            reserved = int(nested["reserved_bytes"]["all"]["current"])
            peak = int(nested["allocated_bytes"]["all"]["peak"])
        except Exception as error:  # torch refused: the loop must not see it
            self._step_aside(first_sentence(error))
            return 0, 0, 0
        account = self._account
        return allocated, reserved, peak if account is None else account.high(peak)

    def _raw_stats(self, index: int) -> dict[str, Any]:
        """torch's own nested statistics of device ``index``, not the program's view."""
        reader = CUDA_PEAKS.reader()
        if reader is None:
            raise RuntimeError("this torch has no torch._C._cuda_memoryStats")
        return reader(index)

    def _reset_peak(self) -> None:
        """Reset the peak counter for this backend (the program's view kept); ``_last`` of
        the interval peak becomes what is allocated now."""
        if self._blind or self._account is None or not torch.cuda.is_initialized():
            return
        try:
            stats = CUDA_PEAKS.restart(self._index, self._account)
        except Exception as error:
            self._step_aside(first_sentence(error))
            return
        self._peak.restart(int(stats["allocated_bytes"]["all"]["current"]))

    def restart_peak(self) -> None:
        """An iteration begins: its peak is counted from here."""
        if self.peak_mode is PeakMode.ITERATIONS:
            self._reset_peak()

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
            self._observe = not OOM_OBSERVER.attached  # at the first reading once CUDA runs
        self._oom_seen = OOM_OBSERVER.count
        if not self._blind:
            self._account = CUDA_PEAKS.join(self._index)
            self._reset_peak()  # the first iteration's peak is its own too

    def oom(self) -> AllocatorOom | None:
        """The allocator's last out-of-memory event on this device since :meth:`start`."""
        event = OOM_OBSERVER.last
        if OOM_OBSERVER.count == getattr(self, "_oom_seen", OOM_OBSERVER.count) \
                or event is None or event.device != self._index:
            return None
        return event

    def stop(self) -> None:
        self._leave()

    def _leave(self) -> None:
        account, self._account = self._account, None
        if account is not None:
            CUDA_PEAKS.leave(self._index, account)


def _peak_note(exact: bool) -> str:
    kept = ("torch.cuda.max_memory_allocated(), max_memory_reserved(), memory_stats() and "
            "your own reset_peak_memory_stats() read as they would without memsentry")
    if exact:
        return ("CUDA peaks are exact, layers' too: memsentry reset the allocator's peak "
                f"counter at every hook, and {kept}.")
    return ("CUDA iteration peaks are exact: memsentry reset the allocator's peak counter where "
            "each iteration began, and " + kept + ". A layer's peak is exact where it set its "
            "iteration's high, else a lower bound (samples at hooks); track(exact=True) makes "
            "every layer's exact.")
