"""CPU memory from glibc's heap counters (``mallinfo2()``): the cheap default.

``MallinfoBackend`` reads every C allocation of the process, tensor storages, autograd nodes
and saved variables included, in about 0.3 microseconds a call. PyTorch's CPU allocator takes
tensor storages from ``malloc``, so a tensor's bytes appear there to within malloc's rounding
(a few dozen bytes, one page for mmapped blocks). Python's own small objects live in pymalloc
arenas and are not counted. The exact alternative is :mod:`memsentry.measure.storage`.
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import Any

import torch

from memsentry.measure.base import Passive
from memsentry.model import Measured, PeakMode

_MALLINFO2_FIELDS = (
    "arena",
    "ordblks",
    "smblks",
    "hblks",
    "hblkhd",
    "usmblks",
    "fsmblks",
    "uordblks",
    "fordblks",
    "keepcost",
)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2_FIELDS]


def _load_mallinfo2() -> tuple[Any, str | None]:
    """Return glibc's ``mallinfo2`` function, or ``None`` and the reason it is unavailable."""
    try:
        libc = ctypes.CDLL(None)
        func = libc.mallinfo2
    except (OSError, AttributeError):
        return None, "glibc mallinfo2() is not available (glibc >= 2.33 on Linux is needed)"
    func.restype = _Mallinfo2
    func.argtypes = []
    return func, None


_MALLINFO2, MALLINFO2_UNAVAILABLE = _load_mallinfo2()


def _in_use(info: _Mallinfo2) -> int:
    """The heap's bytes in use: small chunks in the arenas and mmapped ones."""
    return int(info.uordblks + info.hblkhd)


def heap_in_use() -> int | None:
    """Bytes of the C heap in use now (what :class:`MallinfoBackend` reads), or ``None``
    where glibc's ``mallinfo2()`` is not available."""
    return None if _MALLINFO2 is None else _in_use(_MALLINFO2())


def physical_memory() -> int | None:
    """Total physical RAM in bytes, or ``None`` where the system does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


class MallinfoBackend(Passive):
    """Sampled CPU backend: allocated = in-use heap bytes + mmapped chunks (glibc counters)."""

    name = "cpu-mallinfo2"
    peak_mode = PeakMode.SAMPLED
    measured = Measured.HEAP
    notes: tuple[str, ...] = (
        "CPU figures come from glibc mallinfo2(): all C allocations of the process, "
        "sampled at module, saved-tensor and iteration boundaries (peaks are lower bounds).",
    )

    def __init__(self) -> None:
        if _MALLINFO2 is None:
            raise RuntimeError(MALLINFO2_UNAVAILABLE)
        self.device = torch.device("cpu")
        self._mallinfo2 = _MALLINFO2

    def sample(self) -> tuple[int, int | None]:
        info = self._mallinfo2()  # _in_use() written out: read at every saved-tensor pack
        return info.uordblks + info.hblkhd, None

    def sample_cost(self, calls: int = 5) -> float:
        """Seconds one ``mallinfo2()`` call takes now (the fastest of ``calls``). glibc walks
        every free chunk of every arena, so the cost grows with fragmentation: 0.5 us in a
        fresh process, 4 ms after 10,000 freed tensors of mixed sizes (measured here)."""
        best = float("inf")
        for _ in range(calls):
            started = time.perf_counter()
            self._mallinfo2()
            best = min(best, time.perf_counter() - started)
        return best

    def allocated(self) -> int:
        return _in_use(self._mallinfo2())

    def reserved(self) -> int | None:
        info = self._mallinfo2()
        return info.arena + info.hblkhd

    def peak_since_last_read(self) -> int | None:
        return None

    def total_memory(self) -> int | None:
        return physical_memory()

    def stats(self) -> dict[str, Any]:
        info = self._mallinfo2()
        return {name: int(getattr(info, name)) for name in _MALLINFO2_FIELDS}
