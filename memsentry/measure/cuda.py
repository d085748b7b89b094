"""CUDA memory: the caching allocator's own counters, per device.

Reading ``torch.cuda.memory_allocated()`` builds and flattens the whole statistics dict in
Python; the hook hot path reads the nested dict from ``torch._C._cuda_memoryStats`` once per
sample instead, and falls back to the public functions where that binding is missing.

Peaks: by default the backend never resets the allocator's peak counter, so what users
read from ``torch.cuda.max_memory_allocated()`` stays theirs. It reports a peak for an
interval only when the counter rose during it (a new high: exact); otherwise the tracker's
samples give a lower bound. ``exact=True`` resets the counter at every sample to get every
interval's true peak, and then ``torch.cuda.max_memory_allocated()`` only reflects the time
since memsentry's last sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from memsentry.measure.base import IntervalPeak
from memsentry.model import Measured, PeakMode, PinnedMemory


@dataclass(frozen=True)
class AllocatorOom:
    """What the caching allocator's out-of-memory observer told: the device, the size it
    could not allocate, what it had allocated and what the device had free then."""

    device: int
    requested: int
    allocated: int
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

    def _observed(self, device: int, alloc: int, device_allocated: int,
                  device_free: int) -> None:
        self.count += 1
        self.last = AllocatorOom(int(device), int(alloc), int(device_allocated),
                                 int(device_free))


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
    """Allocated, reserved and peak bytes of one CUDA device from the caching allocator."""

    name = "cuda-caching-allocator"
    measured = Measured.TENSORS

    def __init__(self, device: torch.device, *, exact: bool = False) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA is not available")
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        self._index = index
        self.peak_mode = PeakMode.EXACT if exact else PeakMode.SAMPLED
        if exact:
            self.notes: tuple[str, ...] = (
                "CUDA peaks are exact: memsentry reset the allocator's peak counter at every "
                "hook, so torch.cuda.max_memory_allocated() now reads from its last sample.",
            )
        else:
            self.notes = (
                "CUDA peaks use the allocator's peak counter when it rose, else samples taken "
                "at hooks (lower bounds); torch.cuda.max_memory_allocated() is left untouched.",
            )
        raw = getattr(torch._C, "_cuda_memoryStats", None)
        self._raw_stats = raw
        self._peak = IntervalPeak(
            self._read()[2], lambda: torch.cuda.reset_peak_memory_stats(index), exact=exact
        )

    def _read(self) -> tuple[int, int, int]:
        """(allocated, reserved, peak allocated) in one allocator call."""
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

    def sample(self) -> tuple[int, int | None]:
        allocated, _, peak = self._read()
        return allocated, self._peak.read(peak)

    def allocated(self) -> int:
        if self._raw_stats is not None and torch.cuda.is_initialized():
            return int(self._raw_stats(self._index)["allocated_bytes"]["all"]["current"])
        return torch.cuda.memory_allocated(self._index)

    def reserved(self) -> int | None:
        return torch.cuda.memory_reserved(self._index)

    def peak_since_last_read(self) -> int | None:
        return self._peak.read(self._read()[2])

    def total_memory(self) -> int | None:
        return int(torch.cuda.get_device_properties(self._index).total_memory)

    def stats(self) -> dict[str, Any]:
        return dict(torch.cuda.memory_stats(self._index))

    def summary(self) -> str:
        return torch.cuda.memory_summary(self._index, abbreviated=True)

    def start(self) -> None:
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
