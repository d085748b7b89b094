"""The figures of a CUDA out-of-memory failure: which device ran out, what its allocator held
and could have held, what was free, and what NVML counted for the process and the device.

Which device: the one the allocator's message names (``GPU 1 has a total capacity``,
``Allocation on device 1``), else the one its out-of-memory observer was called for (c10/cuda/
CUDACachingAllocator.cpp calls every observer with the device whose allocator gave up), else
the tracked device: a failure outside the allocator (``CUDA error: out of memory``, a library
refusing a handle) names no device, and torch's device guard has put the previous device back
by the time memsentry sees the error, so ``torch.cuda.current_device()`` would not say it.

On another device than the tracked one, its figures are read from torch only where the
process already started CUDA (``torch.cuda.memory_stats(index)``, its properties,
``torch.cuda.mem_get_info(index)``), each read guarded: a reading that fails is left out, and
nothing reaches the program.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from memsentry.measure import nvml_query
from memsentry.measure.cuda import OOM_OBSERVER, AllocatorOom, CudaBackend
from memsentry.model.oom import OomSource
from memsentry.record.oomtext import OomText, OutsideText


@dataclass(frozen=True)
class Figures:
    """The sizes an out-of-memory post-mortem states (see :class:`~memsentry.model.
    OutOfMemory`), with where they come from."""

    requested: int | None
    segment: bool
    capacity: int | None
    free: int | None = None
    limit: int | None = None
    reserved: int | None = None
    total: int | None = None
    source: OomSource = OomSource.ALLOCATOR
    call: str | None = None
    device: str | None = None
    tracked: str | None = None
    process_used: int | None = None
    device_used: int | None = None


def ceiling(limit: int | None, reserved: int | None, free: int | None) -> int | None:
    """The most a CUDA allocator could hold: its ``limit``, and no more than what it
    ``reserved`` plus what was ``free`` on the device (others' memory, the CUDA context)."""
    if limit is None or reserved is None or free is None:
        return limit
    return min(limit, reserved + free)


def observed_since(count: int) -> AllocatorOom | None:
    """The allocator observer's last event, if it came after its ``count``-th."""
    return OOM_OBSERVER.last if OOM_OBSERVER.count > count else None


def _guarded(read: Any, *args: Any) -> Any:
    """``read(*args)``, or ``None`` where CUDA has not started or torch refuses."""
    try:
        if not torch.cuda.is_initialized():
            return None
        return read(*args)
    except Exception:  # a reading's failure never reaches the program
        return None


def _reserved_of(index: int) -> int | None:
    stats = _guarded(torch.cuda.memory_stats, index) or {}
    value = stats.get("reserved_bytes.all.current")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _total_of(index: int) -> int | None:
    props = _guarded(torch.cuda.get_device_properties, index)
    total = getattr(props, "total_memory", None)
    return int(total) if isinstance(total, int) else None


def _free_of(index: int) -> int | None:
    info = _guarded(torch.cuda.mem_get_info, index)
    return int(info[0]) if isinstance(info, tuple) and info else None


def _nvml(index: int) -> tuple[int | None, int | None]:
    """NVML's count of this process's memory on ``cuda:index`` and of every process's."""
    try:
        info = nvml_query(index, initialise=False)
    except Exception:
        return None, None
    return info.process_used, info.used


def _allocator(said: OomText, observed: AllocatorOom | None, reserved: int | None,
               total: int | None) -> Figures:
    """The sizes from the allocator's observer where it told them, else from its message."""
    total = said.total or total
    limit = observed.limit if observed is not None else said.limit
    if limit is None or (total is not None and limit > total):
        limit = total  # no fraction set (cudaMallocAsync then prints UINT64_MAX)
    free = observed.free if observed is not None else said.free
    requested = observed.segment if observed is not None else said.requested
    return Figures(requested, observed is not None or said.segment,
                   ceiling(limit, reserved, free) or total, free=free, limit=limit,
                   reserved=reserved, total=total)


def _outside(backend: CudaBackend, outside: OutsideText, index: int) -> Figures:
    """A failure outside the allocator: no size; the device's memory is the capacity, and the
    free memory is the driver's now (the allocator was not asked, so it told nothing)."""
    total = backend.total_memory()
    return Figures(None, False, total, free=_free_of(index), reserved=backend.reserved(),
                   total=total,
                   source=outside.source, call=outside.call)


def cuda_figures(backend: CudaBackend, said: OomText, outside: OutsideText | None,
                 event: AllocatorOom | None) -> Figures:
    """The figures of a failure seen while ``backend`` measured its device; ``event`` is the
    observer's newest event of this tracking run, if any."""
    own = backend.device.index if backend.device.index is not None else 0
    if outside is not None:
        index, found = own, _outside(backend, outside, own)
    else:
        index = said.device if said.device is not None else (
            event.device if event is not None else own)
        if index == own:
            found = _allocator(said, backend.oom(), backend.reserved(), backend.total_memory())
        else:
            observed = event if event is not None and event.device == index else None
            found = _allocator(said, observed, _reserved_of(index), _total_of(index))
    process, used = _nvml(index)
    return replace(found, device=f"cuda:{index}",
                   tracked=None if index == own else str(backend.device),
                   process_used=process, device_used=used)


__all__ = ["Figures", "ceiling", "cuda_figures", "observed_since"]
