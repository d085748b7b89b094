"""Catching the moment a tracked loop runs out of memory.

An out-of-memory error is ``torch.OutOfMemoryError`` (CUDA, and other accelerators), or a
``RuntimeError`` from the CPU allocator ("DefaultCPUAllocator: can't allocate memory"). When
one goes through a module's forward, that module's post-hook (which PyTorch runs while the
error propagates) notes the innermost layer and what memory held, before the stack unwinds;
otherwise the tracked block's exit finds the phase from the traceback: autograd's engine
(backward), an optimizer's ``step``, or the loop's own code.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType

import torch

from memsentry.measure import MemoryBackend
from memsentry.measure.cuda import CudaBackend
from memsentry.model import OutOfMemory, Phase
from memsentry.record.oomtext import OomText, read_message
from memsentry.record.sampler import Moment, Sampler, at_moment, with_outside
from memsentry.record.timeline import IterationClock

#: Phrases of the allocators' out-of-memory messages (CPU, CUDA's caching and cudaMallocAsync
#: allocators, MPS, XPU).
MARKERS = ("DefaultCPUAllocator: can't allocate memory", "CUDA out of memory",
           "would exceed allowed memory. (out of memory)", "MPS backend out of memory",
           "XPU out of memory")


def out_of_memory_type() -> type[BaseException] | None:
    return getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError",
                                                               None)


def is_out_of_memory(error: BaseException | None) -> bool:
    """Whether ``error`` is an allocator's out-of-memory error."""
    if error is None:
        return False
    kind = out_of_memory_type()
    if kind is not None and isinstance(error, kind):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in MARKERS)


def requested_bytes(message: str) -> int | None:
    """The size of the failed allocation, as the allocator's message gives it."""
    return read_message(message).requested


def phase_of(traceback: TracebackType | None) -> Phase:
    """Where the error was raised, from its traceback: inside autograd's engine, inside an
    optimizer's ``step``, or elsewhere (between layers)."""
    phase = Phase.BETWEEN
    while traceback is not None:
        frame = traceback.tb_frame
        name = frame.f_globals.get("__name__", "")
        function = frame.f_code.co_name
        if name.startswith("torch.autograd") or (name == "torch._tensor"
                                                 and function == "backward"):
            return Phase.BACKWARD
        if function == "step" and isinstance(frame.f_locals.get("self"), torch.optim.Optimizer):
            phase = Phase.STEP
        traceback = traceback.tb_next
    return phase


class FailureWatch:
    """The first sight of an out-of-memory error: inside a module's forward, the innermost
    layer and what memory held there."""

    def __init__(self) -> None:
        self.error_id: int | None = None
        self.layer: str | None = None
        self.moment: Moment | None = None
        self.total = 0

    def check(self, error: BaseException, layer: str, sampler: Sampler) -> None:
        """A module's post-hook ran while ``error`` propagates through it: if it is an
        out-of-memory error not seen yet, note it here (the innermost module sees it
        first)."""
        if id(error) == self.error_id or not is_out_of_memory(error):
            return
        self.error_id, self.layer = id(error), layer
        self.total = sampler.sample()
        self.moment = sampler.moment()

    def seen(self, error: BaseException) -> bool:
        return self.error_id == id(error)


@dataclass(frozen=True)
class _Figures:
    """The sizes an out-of-memory post-mortem states (see :class:`OutOfMemory`)."""

    requested: int | None
    segment: bool
    capacity: int | None
    free: int | None = None
    limit: int | None = None
    reserved: int | None = None
    total: int | None = None


def ceiling(limit: int | None, reserved: int | None, free: int | None) -> int | None:
    """The most a CUDA allocator could hold: its ``limit``, and no more than what it
    ``reserved`` plus what was ``free`` on the device (others' memory, the CUDA context)."""
    if limit is None or reserved is None or free is None:
        return limit
    return min(limit, reserved + free)


def _cuda_figures(backend: CudaBackend, said: OomText) -> _Figures:
    """The sizes from the allocator's observer where it told them, else from its message."""
    observed = backend.oom()
    total = said.total or backend.total_memory()
    limit = observed.limit if observed is not None else said.limit
    if limit is None or (total is not None and limit > total):
        limit = total  # no fraction set (cudaMallocAsync then prints UINT64_MAX)
    free = observed.free if observed is not None else said.free
    reserved = backend.reserved()
    requested = observed.segment if observed is not None else said.requested
    return _Figures(requested, observed is not None or said.segment,
                    ceiling(limit, reserved, free) or backend.total_memory(), free=free,
                    limit=limit, reserved=reserved, total=total)


def figures(backend: MemoryBackend, message: str) -> _Figures:
    """The sizes of an out-of-memory error on ``backend``'s device: on CUDA the allocator's
    own; elsewhere the size the message gives, in the device's memory."""
    said = read_message(message)
    if isinstance(backend, CudaBackend):
        return _cuda_figures(backend, said)
    return _Figures(said.requested, said.segment, backend.total_memory())


def explain(error: BaseException, watch: FailureWatch, sampler: Sampler,
            clock: IterationClock) -> OutOfMemory | None:
    """What the tracked block's out-of-memory ``error`` ran into (``None`` when it is another
    error, or nothing was measured): where, the size asked for, the parts of memory then,
    and what the allocator could have held."""
    backend = sampler.backend
    if backend is None or not is_out_of_memory(error):
        return None
    if watch.seen(error) and watch.moment is not None:
        phase, layer, moment, total = Phase.FORWARD, watch.layer, watch.moment, watch.total
    else:
        phase = phase_of(error.__traceback__)
        total, moment = sampler.sample(), sampler.moment()
        layer = moment[5] if phase is Phase.BACKWARD else None
    parts = at_moment(moment, with_outside(sampler, total), phase=phase, layer=layer)
    lines = str(error).strip().splitlines()
    sizes = figures(backend, str(error))
    return OutOfMemory(
        error=type(error).__name__, message=(lines[0] if lines else "")[:500], phase=phase,
        layer=layer, iteration=clock.index, requested_bytes=sizes.requested,
        breakdown=parts, capacity=sizes.capacity, batch=clock.batch,
        device_free=sizes.free, segment=sizes.segment, limit=sizes.limit,
        reserved=sizes.reserved, device_total=sizes.total,
    )


__all__ = ["MARKERS", "FailureWatch", "ceiling", "explain", "figures", "is_out_of_memory",
           "phase_of", "requested_bytes"]
