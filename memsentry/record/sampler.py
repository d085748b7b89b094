"""Reading the backend on the hot path: every sample raises the peaks of the iteration, of the
innermost running forward and of the running backwards. What the samples cost is clocked by
:mod:`memsentry.record.coverage`, which keeps it within its share of the loop's time.
"""

from __future__ import annotations

from memsentry.measure import MallinfoBackend, MemoryBackend
from memsentry.record.calls import BackwardCall, ForwardCall


class Sampler:
    """Samples one backend for one recorder. ``forward`` is the recorder's stack of running
    forwards and ``backward`` its running backwards (shared, not copied)."""

    def __init__(self, forward: list[ForwardCall], backward: dict[int, BackwardCall]) -> None:
        self.backend: MemoryBackend | None = None
        self._forward = forward
        self._backward = backward
        self.in_ops = False  # mallinfo2: also sample at saved-tensor packs
        self.baseline = 0
        self.last = 0  # allocated at the newest sample
        self.peak = 0  # highest allocated in the running iteration
        self.own = 0  # allocated memory memsentry's censuses added (their records) or freed (gc)

    def start(self, backend: MemoryBackend) -> None:
        backend.start()
        self.backend = backend
        self.in_ops = isinstance(backend, MallinfoBackend)
        self.baseline = self.last = self.peak = backend.allocated()

    def sample(self, *, boundary: bool = False) -> int:
        """Allocated bytes now (less memsentry's own), raising every running peak."""
        backend = self.backend
        assert backend is not None
        allocated, peak = backend.sample()
        if self.own:  # what the censuses kept or freed is not the program's memory
            allocated -= self.own
            peak = None if peak is None else peak - self.own
        high = allocated if peak is None or peak < allocated else peak
        if high > self.peak:
            self.peak = high
        if self._forward:
            top = self._forward[-1]
            if high > top.peak:
                top.peak = high
        for call in self._backward.values():
            if high > call.peak:
                call.peak = high
        self.last = allocated
        return allocated
