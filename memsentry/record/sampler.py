"""Reading the backend on the hot path: every sample raises the peaks of the iteration, of the
innermost running forward and of the running backwards. What the samples cost is clocked by
:mod:`memsentry.record.coverage`, which keeps it within its share of the loop's time.
"""

from __future__ import annotations

import time
from typing import NamedTuple

from memsentry.measure import MallinfoBackend, MemoryBackend
from memsentry.model import Breakdown, PeakMode, Phase
from memsentry.record.calls import BackwardCall, ForwardCall
from memsentry.record.clock import Clock
from memsentry.record.parts import Parts

#: Samples at saved-tensor packs stop when this many in a row cost more than
#: :data:`SLOW_PACK_SAMPLE` seconds each on average: ``mallinfo2()`` walks every free chunk,
#: and a heap fragmented by kept graphs made it 1.6 ms a call (an LBFGS loop ran 13x slower).
PACK_SAMPLES_JUDGED = 200
SLOW_PACK_SAMPLE = 250e-6


class Moment(NamedTuple):
    """What the four parts held when a peak was read (bytes), and where the loop was: its
    phase, and the layer running (``None`` outside any)."""

    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    phase: Phase
    layer: str | None


class Sampler:
    """Samples one backend for one recorder. ``forward`` is the recorder's stack of running
    forwards and ``backward`` its running backwards (shared, not copied)."""

    def __init__(self, forward: list[ForwardCall], backward: dict[int, BackwardCall],
                 parts: Parts, clock: Clock = time.perf_counter) -> None:
        self.backend: MemoryBackend | None = None
        self._now = clock
        self.parts = parts
        self.at_peak = Moment(0, 0, 0, 0, Phase.BETWEEN, None)
        self._forward = forward
        self._backward = backward
        self.in_ops = False  # mallinfo2: also sample at saved-tensor packs
        self.baseline = 0
        self.last = 0  # allocated at the newest sample
        self.peak = 0  # highest allocated in the running iteration
        self.own = 0  # allocated memory memsentry's censuses added (their records) or freed (gc)
        self.own_blocks = 0  # the same in Python's small-object blocks
        self.notes: list[str] = []
        self._packs, self._pack_seconds = 0, 0.0

    def start(self, backend: MemoryBackend) -> None:
        backend.start()
        self.backend = backend
        self.in_ops = isinstance(backend, MallinfoBackend)
        self.baseline = self.last = self.peak = backend.allocated()

    def sample(self, *, step: bool = False) -> int:
        """Allocated bytes now (less memsentry's own), raising every running peak; at a new
        peak of the iteration, what the four parts held (``step``: in an optimizer step)."""
        backend = self.backend
        assert backend is not None
        allocated, peak = backend.sample()
        if self.own:  # what the censuses kept or freed is not the program's memory
            allocated -= self.own
            peak = None if peak is None else peak - self.own
        high = allocated if peak is None or peak < allocated else peak
        self._raise_peaks(high, step)
        self.last = allocated
        return allocated

    def _raise_peaks(self, high: int, step: bool) -> None:
        """The highest memory read by a sample raises the iteration's peak (noting what the
        parts held there), the innermost running forward's and the running backwards'."""
        if high > self.peak:
            self.peak = high
            self.at_peak = self.moment(step=step)
        if self._forward:
            top = self._forward[-1]
            if high > top.peak:
                top.peak = high
        for call in self._backward.values():
            if high > call.peak:
                call.peak = high

    def begin_iteration(self, allocated: int) -> None:
        """An iteration begins with ``allocated`` bytes: its peak is counted from here."""
        assert self.backend is not None
        self.backend.restart_peak()
        self.peak = allocated
        self.at_peak = self.moment()

    def peaks_exact(self) -> bool:
        """Whether the running iteration's peak counts every allocation in it."""
        mode = self.backend.peak_mode if self.backend is not None else PeakMode.SAMPLED
        return mode is not PeakMode.SAMPLED

    def sample_at_pack(self) -> None:
        """A sample at a saved-tensor pack (mallinfo2 only), while those stay cheap."""
        started = self._now()
        self.sample()
        self._packs += 1
        self._pack_seconds += self._now() - started
        if self._packs % PACK_SAMPLES_JUDGED == 0:  # judged on each window of reads
            each, self._pack_seconds = self._pack_seconds / PACK_SAMPLES_JUDGED, 0.0
            if each > SLOW_PACK_SAMPLE:
                self.in_ops = False
                self.notes.append(
                    f"Reading glibc's heap took {each * 1e3:.2f} ms a call (mallinfo2() walks "
                    f"every free chunk, and this heap is fragmented): after {self._packs:,} "
                    "reads at saved-tensor packs memsentry read it only at module and "
                    "iteration boundaries, so peaks inside layers are lower bounds from there; "
                    "track(exact=True) (`memsentry run --exact`) counts storages instead.")

    def moment(self, *, step: bool = False) -> Moment:
        """What the four parts hold now, and where the loop is."""
        parts = self.parts
        if self._backward:
            phase, layer = Phase.BACKWARD, next(reversed(self._backward.values())).record.name
        elif self._forward:
            phase, layer = Phase.FORWARD, self._forward[-1].record.name
        else:
            phase, layer = (Phase.STEP if step else Phase.BETWEEN), None
        return Moment(parts.parameters, parts.gradients, parts.optimizer_state,
                      parts.live.total, phase, layer)


def with_outside(sampler: Sampler, total: int) -> int:
    """``total`` plus the parts' storages the backend does not count (the storage-counting
    backend counts only storages made while tracking)."""
    counted = getattr(sampler.backend, "counts", None)
    return total + sampler.parts.outside(counted) if counted is not None else total


def breakdown(sampler: Sampler, index: int) -> Breakdown:
    """The four parts at iteration ``index``'s peak, read in it or carried from the last
    iteration that read them."""
    parts = sampler.parts
    if not parts.due and parts.fresh is not None:
        # The parts' storage keys are those of the reading carried: a gradient freed since
        # would look uncounted, so the bytes outside the backend are the reading's too.
        last, read_in, outside = parts.fresh
        return Breakdown.of(sampler.peak + outside, parameters=last.parameters,
                            gradients=last.gradients, optimizer_state=last.optimizer_state,
                            activations=last.activations, phase=last.phase, layer=last.layer,
                            read_in=read_in)
    total = with_outside(sampler, sampler.peak)
    found = at_moment(sampler.at_peak, total)
    parts.fresh = (found, index, total - sampler.peak)
    return found


def at_moment(moment: Moment, total: int, *, phase: Phase | None = None,
              layer: str | None = None) -> Breakdown:
    """The breakdown of ``total`` by the parts a sample noted at ``moment``; ``phase`` (with
    ``layer``) replaces where the moment placed the loop."""
    at, at_layer = moment.phase, moment.layer
    if phase is not None:
        at, at_layer = phase, layer
    return Breakdown.of(total, parameters=moment.parameters, gradients=moment.gradients,
                        optimizer_state=moment.optimizer_state, activations=moment.activations,
                        phase=at, layer=at_layer)
