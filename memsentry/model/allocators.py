"""CUDA's allocator backends, as ``torch.cuda.get_allocator_backend()`` names them, and the name
memsentry's measuring backend carries under each (``report.backend``), so that the rules can
tell which advice applies to a recorded run."""

from __future__ import annotations

from memsentry.model.kinds import _Text


class CudaAllocator(_Text):
    """Which allocator serves CUDA memory in a process: torch's caching allocator
    (``native``), CUDA's stream-ordered allocator (``PYTORCH_CUDA_ALLOC_CONF=
    backend:cudaMallocAsync``), or one loaded with ``torch.cuda.memory.
    change_current_allocator`` (``pluggable``: RMM, a custom ``.so``)."""

    NATIVE = "native"
    ASYNC = "cudaMallocAsync"
    PLUGGABLE = "pluggable"


#: ``report.backend`` of a run measured under each allocator.
BACKEND_NAMES: dict[CudaAllocator, str] = {
    CudaAllocator.NATIVE: "cuda-caching-allocator",
    CudaAllocator.ASYNC: "cuda-malloc-async",
    CudaAllocator.PLUGGABLE: "cuda-pluggable-allocator",
}


def allocator_of(backend: str) -> CudaAllocator | None:
    """The allocator a run measured by ``backend`` (``report.backend``) ran under, or
    ``None`` where the name is none of memsentry's CUDA backends."""
    for allocator, name in BACKEND_NAMES.items():
        if name == backend:
            return allocator
    return None


__all__ = ["BACKEND_NAMES", "CudaAllocator", "allocator_of"]
