"""Catching the moment a tracked loop runs out of memory.

An out-of-memory error is ``torch.OutOfMemoryError`` (CUDA, and other accelerators), or a
``RuntimeError`` from the CPU allocator ("DefaultCPUAllocator: can't allocate memory"). When
one goes through a module's forward, that module's post-hook (which PyTorch runs while the
error propagates) notes the innermost layer and what memory held, before the stack unwinds;
otherwise the tracked block's exit finds the phase from the traceback: autograd's engine
(backward), an optimizer's ``step``, or the loop's own code.
"""

from __future__ import annotations

import re
from types import TracebackType

import torch

from memsentry.measure.cuda import CudaBackend
from memsentry.model import OutOfMemory, Phase
from memsentry.record.sampler import Moment, Sampler, at_moment, with_outside
from memsentry.record.timeline import IterationClock
from memsentry.units import parse_size

#: Phrases of the allocators' out-of-memory messages (CPU, CUDA, MPS, XPU).
MARKERS = ("DefaultCPUAllocator: can't allocate memory", "CUDA out of memory",
           "MPS backend out of memory", "XPU out of memory")
_CPU_SIZE = re.compile(r"you tried to allocate (\d+) bytes")
_DEVICE_SIZE = re.compile(r"Tried to allocate (\d+(?:\.\d+)?) ?([KMGT]i?B|B)\b")


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
    found = _CPU_SIZE.search(message)
    if found:
        return int(found.group(1))
    found = _DEVICE_SIZE.search(message)
    if found:
        try:
            return parse_size(f"{found.group(1)} {found.group(2)}")
        except ValueError:
            return None
    return None


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


def explain(error: BaseException, watch: FailureWatch, sampler: Sampler,
            clock: IterationClock) -> OutOfMemory | None:
    """What the tracked block's out-of-memory ``error`` ran into (``None`` when it is another
    error, or nothing was measured): where, the size asked for, the parts of memory then."""
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
    requested = requested_bytes(str(error))
    observed = backend.oom() if isinstance(backend, CudaBackend) else None
    return OutOfMemory(
        error=type(error).__name__, message=(lines[0] if lines else "")[:500], phase=phase,
        layer=layer, iteration=clock.index,
        requested_bytes=observed.requested if observed is not None else requested,
        breakdown=parts, capacity=backend.total_memory(), batch=clock.batch,
        device_free=observed.free if observed is not None else None,
    )


__all__ = ["MARKERS", "FailureWatch", "explain", "is_out_of_memory", "phase_of",
           "requested_bytes"]
