"""Reading the backend on the hot path: every sample raises the peaks of the iteration, of the
innermost running forward and of the running backwards.

It also watches glibc ``mallinfo2()``'s cost, which grows with heap fragmentation: when the
mean of a window of calls passes :data:`SLOW_SAMPLE_IN_RUN`, it samples only at iteration
boundaries from then on, and says so in a note.
"""

from __future__ import annotations

import time

from memsentry.measure import MallinfoBackend, MemoryBackend
from memsentry.record.calls import BackwardCall, ForwardCall
from memsentry.record.timeline import IterationClock

#: mallinfo2() calls averaging more than this over a window switch to boundary-only sampling.
SLOW_SAMPLE_IN_RUN = 50e-6
#: Calls per window (the mean of a window, not one preempted call, decides).
SAMPLE_WINDOW = 256


class Sampler:
    """Samples one backend for one recorder. ``forward`` is the recorder's stack of running
    forwards and ``backward`` its running backwards (shared, not copied)."""

    def __init__(self, forward: list[ForwardCall], backward: dict[int, BackwardCall],
                 clock: IterationClock) -> None:
        self.backend: MemoryBackend | None = None
        self._forward = forward
        self._backward = backward
        self._clock = clock
        self.in_ops = False  # mallinfo2: also sample at saved-tensor packs, and watch its cost
        self.baseline = 0
        self.last = 0  # allocated at the newest sample
        self.peak = 0  # highest allocated in the running iteration
        self.own = 0  # allocated memory memsentry's censuses added (their records) or freed (gc)
        self.coarse = False  # sample at iteration boundaries only (mallinfo2 became slow)
        self.coarse_note: str | None = None
        self._samples = 0
        self._sample_time = 0.0

    def start(self, backend: MemoryBackend) -> None:
        backend.start()
        self.backend = backend
        self.in_ops = isinstance(backend, MallinfoBackend)
        self.baseline = self.last = self.peak = backend.allocated()

    def sample(self, *, boundary: bool = False) -> int:
        """Allocated bytes now (less memsentry's own), raising every running peak."""
        backend = self.backend
        assert backend is not None
        if self.coarse and not boundary:
            return self.last
        if self.in_ops:  # mallinfo2: watch its cost, which grows with fragmentation
            started = time.perf_counter()
            allocated, peak = backend.sample()
            self._sample_time += time.perf_counter() - started
            self._samples += 1
            if self._samples == SAMPLE_WINDOW:
                if self._sample_time / SAMPLE_WINDOW > SLOW_SAMPLE_IN_RUN:
                    self._go_coarse()
                self._samples, self._sample_time = 0, 0.0
        else:
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

    def _go_coarse(self) -> None:
        """mallinfo2() became slow (the heap fragmented while the loop ran): from now on sample
        only at iteration boundaries, so that tracking cannot slow training down."""
        self.coarse = True
        self.in_ops = False
        self.coarse_note = (
            f"From iteration {self._clock.index} glibc mallinfo2() took "
            f"{self._sample_time / SAMPLE_WINDOW * 1e6:.0f} us a call on average (a "
            "fragmented heap), so memsentry sampled only at iteration boundaries: later "
            "layer figures are not measured. "
            "track(exact=True) counts tensor storages at a constant cost instead."
        )
