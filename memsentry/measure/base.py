"""The measuring interface every backend implements."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

from memsentry.model import Measured, PeakMode


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
    - ``measured``: what the figures count (tensors only, or the process heap).
    - ``total_memory()``: capacity of the device (physical RAM on CPU), or ``None``.
    - ``restart_peak()``: an iteration begins; a backend whose peak counter it resets there
      (CUDA) counts the next iteration's peak from now; the others do nothing.
    - ``start()`` / ``stop()``: begin and end measuring (the exact CPU mode enters a mode).
    """

    name: str
    device: torch.device
    peak_mode: PeakMode
    measured: Measured
    notes: tuple[str, ...]

    def sample(self) -> tuple[int, int | None]: ...

    def allocated(self) -> int: ...

    def reserved(self) -> int | None: ...

    def peak_since_last_read(self) -> int | None: ...

    def total_memory(self) -> int | None: ...

    def stats(self) -> dict[str, Any]: ...

    def restart_peak(self) -> None: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...


class Passive:
    """The lifecycle of a backend that enters no mode and resets no counter: starting,
    stopping and an iteration's beginning ask nothing of it."""

    def start(self) -> None:
        return None

    def restart_peak(self) -> None:
        return None

    def stop(self) -> None:
        return None


class IntervalPeak:
    """The peak of an interval from a device's peak counter (CUDA, other accelerators).

    An interval's peak is known only when the counter rose during it (a new high since the
    counter was last reset, :meth:`restart`), else :meth:`read` returns ``None`` and the
    tracker's samples give a lower bound. With ``exact``, ``reset`` is called after every
    read, so every interval's peak is exact.
    """

    def __init__(self, first: int, reset: Callable[[], None], *, exact: bool) -> None:
        self._last = first
        self._reset = reset
        self._exact = exact

    def read(self, peak: int) -> int | None:
        """The interval's peak given the counter's value now, or ``None`` when unknown."""
        if self._exact:
            self._reset()
            return peak
        if peak > self._last:
            self._last = peak
            return peak
        return None

    def restart(self, current: int) -> None:
        """The counter was reset: it reads ``current`` (what is allocated) from now on."""
        self._last = current


#: What ``TORCH_INTERNAL_ASSERT`` puts before its message (c10/util/Exception.h: ``<cond>
#: INTERNAL ASSERT FAILED at "<file>":<line>, please report a bug to PyTorch. <message>``).
_ASSERT_PREFIX = "please report a bug to PyTorch. "


def first_sentence(error: BaseException) -> str:
    """The first sentence of torch's message (``CUDAPluggableAllocator does not yet support
    getDeviceStats``), without the issue-filing request or a C++ stack that may follow; of
    a failed internal assert, its own message (``Allocator for mps is not a
    DeviceAllocator``) rather than the file and line it failed at."""
    text = str(error).strip()
    if not text:
        return type(error).__name__
    line = text.splitlines()[0]
    if _ASSERT_PREFIX in line:
        line = line.split(_ASSERT_PREFIX, 1)[1]
    return line.split(". ")[0].rstrip(".") or type(error).__name__
