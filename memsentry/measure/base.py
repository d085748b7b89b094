"""The measuring interface every backend implements."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from memsentry.model import PeakMode


@runtime_checkable
class MemoryBackend(Protocol):
    """Reads the memory of one device. Implementations must be cheap to call (hook hot path).

    - ``sample()``: ``(allocated, peak)`` in one read, the hook hot path: ``peak`` is what
      ``peak_since_last_read()`` would return.
    - ``allocated()``: bytes currently allocated to tensors (and, on CPU, other C allocations).
    - ``reserved()``: bytes held from the system by the allocator, or ``None`` if unknown.
    - ``peak_since_last_read()``: the highest ``allocated()`` since the previous call, when
      the backend can know it (CUDA's peak counter, the exact CPU mode); ``None`` when it only
      samples, in which case the tracker's samples are the peak.
    - ``total_memory()``: capacity of the device (physical RAM on CPU), or ``None``.
    - ``start()`` / ``stop()``: begin and end measuring (the exact CPU mode enters a mode).
    """

    name: str
    device: torch.device
    peak_mode: PeakMode
    notes: tuple[str, ...]

    def sample(self) -> tuple[int, int | None]: ...

    def allocated(self) -> int: ...

    def reserved(self) -> int | None: ...

    def peak_since_last_read(self) -> int | None: ...

    def total_memory(self) -> int | None: ...

    def stats(self) -> dict[str, Any]: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...
