"""Which allocator serves CUDA memory in this process, and what torch lets memsentry read of it.

``torch.cuda.get_allocator_backend()`` names it (torch/csrc/cuda/Module.cpp returns the
allocator's ``name()``):

- ``native``, torch's caching allocator: per-pool counters, an out-of-memory observer, an
  allocation history for memory_viz.
- ``cudaMallocAsync`` (``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync``): c10/cuda/
  CUDAMallocAsyncAllocator.cpp fills only the aggregate allocated, active and reserved bytes
  and their peaks, and refuses ``attachOutOfMemoryObserver``, ``recordHistory`` and
  ``snapshot`` with a ``RuntimeError``.
- ``pluggable`` (``torch.cuda.memory.change_current_allocator``: RMM, a custom ``.so``):
  torch/csrc/cuda/CUDAPluggableAllocator.cpp refuses ``getDeviceStats``,
  ``resetPeakStats``, ``attachOutOfMemoryObserver``, ``recordHistory`` and ``snapshot``:
  every statistic torch has to give.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memsentry.model.allocators import BACKEND_NAMES, CudaAllocator

#: How torch refuses a pluggable allocator's statistics (CUDAPluggableAllocator.cpp).
PLUGGABLE_REFUSAL = "CUDAPluggableAllocator does not yet support getDeviceStats"


@dataclass(frozen=True)
class AllocatorSupport:
    """What torch gives memsentry under one allocator: the device's counters
    (``memory_stats``, ``reset_peak_memory_stats``), the out-of-memory observer, the
    allocation history (``_record_memory_history``, ``_snapshot``); ``refusal`` is how torch
    words its refusal of the history."""

    allocator: CudaAllocator
    counters: bool
    observer: bool
    history: bool
    refusal: str = ""

    @property
    def backend_name(self) -> str:
        return BACKEND_NAMES[self.allocator]


SUPPORT = {
    CudaAllocator.NATIVE: AllocatorSupport(CudaAllocator.NATIVE, True, True, True),
    CudaAllocator.ASYNC: AllocatorSupport(
        CudaAllocator.ASYNC, True, False, False,
        "cudaMallocAsync does not yet support recordHistory"),
    CudaAllocator.PLUGGABLE: AllocatorSupport(
        CudaAllocator.PLUGGABLE, False, False, False,
        "CUDAPluggableAllocator does not yet support recordHistory"),
}


def current_allocator() -> CudaAllocator:
    """The allocator ``torch.cuda.get_allocator_backend()`` names; the native one where this
    torch cannot say (before 2.0 it was the only one; a build without CUDA has none)."""
    reader = getattr(torch.cuda, "get_allocator_backend", None)
    try:
        return CudaAllocator(reader()) if callable(reader) else CudaAllocator.NATIVE
    except Exception:  # no CUDA in this build, or a name this memsentry does not know
        return CudaAllocator.NATIVE


def support() -> AllocatorSupport:
    """What torch gives memsentry under the allocator this process runs."""
    return SUPPORT[current_allocator()]


def async_note(device: torch.device) -> str:
    """What memsentry reads and what it cannot, under ``backend:cudaMallocAsync``."""
    return (
        f"{device} runs CUDA's cudaMallocAsync allocator (PYTORCH_CUDA_ALLOC_CONF="
        "backend:cudaMallocAsync): torch keeps only its totals (allocated and reserved bytes "
        "and their peaks) and attaches no out-of-memory observer to it, so an out-of-memory "
        "post-mortem takes its figures from the error's message.")


def unmeasured_note(device: torch.device, refusal: str) -> str:
    """Why nothing was measured on ``device``: torch refuses every statistic of a pluggable
    allocator (``refusal``: its words)."""
    return (
        f"Nothing was measured on {device}: its memory comes from a pluggable allocator "
        "(torch.cuda.memory.change_current_allocator: RMM, a custom .so), and torch refuses "
        f"its statistics ({refusal}), so every figure for {device} here reads 0 and no "
        "verdict rests on them. The holder censuses still ran; report.nvml has the driver's "
        "view of this process. For memory figures, track a run on torch's own allocator, or "
        "read your allocator's statistics.")


def history_refused() -> str | None:
    """Why no memory_viz snapshot can be recorded under this process's CUDA allocator, or
    ``None`` where it can."""
    found = support()
    if found.history:
        return None
    if found.allocator is CudaAllocator.ASYNC:
        fix = "unset backend:cudaMallocAsync in PYTORCH_CUDA_ALLOC_CONF to record one"
    else:
        fix = "track a run on torch's own allocator to record one"
    return (f"No memory_viz snapshot: CUDA memory comes from the {found.allocator} allocator "
            f"here, which records no allocation history (torch: '{found.refusal}'); {fix}.")


__all__ = ["PLUGGABLE_REFUSAL", "SUPPORT", "AllocatorSupport", "async_note",
           "current_allocator", "history_refused", "support", "unmeasured_note"]
