"""Catching the moment a tracked loop runs out of memory.

An out-of-memory error is ``torch.OutOfMemoryError`` (CUDA, and other accelerators), a
``RuntimeError`` from the CPU allocator ("DefaultCPUAllocator: can't allocate memory"), or a
failure outside PyTorch's allocator: a CUDA call or a CUDA library that ran out of device
memory of its own (``CUDA error: out of memory``, raised as ``torch.AcceleratorError`` since
torch 2.8; ``CUBLAS_STATUS_ALLOC_FAILED`` and the others :mod:`memsentry.record.oomtext`
lists, with the torch source each follows). When one goes through a module's forward, the
post-hook of the innermost module still hooked (PyTorch runs it while the error propagates)
notes what memory held, before the stack unwinds. The tracked block's exit reads the rest from
the traceback: the innermost module whose call it went through (its frames of
``Module._call_impl`` hold the module and its arguments, hooked or not: a light iteration
hooks few modules or none) and the outermost call's batch; else the phase: autograd's engine
(backward), an optimizer's ``step``, or the loop's own code. memsentry only records: the
error goes on as it was raised.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

import torch
from torch import nn

from memsentry.measure import MemoryBackend
from memsentry.measure.cuda import OOM_OBSERVER, CudaBackend
from memsentry.model import OutOfMemory, Phase
from memsentry.record.cudafail import Figures, ceiling, cuda_figures, observed_since
from memsentry.record.oomtext import read_message, read_outside
from memsentry.record.sampler import Moment, Sampler, at_moment, with_outside
from memsentry.record.timeline import IterationClock, batch_size

#: Phrases of the allocators' out-of-memory messages (CPU, CUDA's caching and cudaMallocAsync
#: allocators, MPS, XPU).
MARKERS = ("DefaultCPUAllocator: can't allocate memory", "CUDA out of memory",
           "would exceed allowed memory. (out of memory)", "MPS backend out of memory",
           "XPU out of memory")


def out_of_memory_type() -> type[BaseException] | None:
    return getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError",
                                                               None)


def is_out_of_memory(error: BaseException | None) -> bool:
    """Whether ``error`` is an allocator's out-of-memory error, or memory running out outside
    the allocator (``torch.AcceleratorError`` is a ``RuntimeError``)."""
    if error is None:
        return False
    kind = out_of_memory_type()
    if kind is not None and isinstance(error, kind):
        return True
    if not isinstance(error, RuntimeError):
        return False
    text = str(error)
    return any(m in text for m in MARKERS) or read_outside(text) is not None


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


#: The frames of a module's call in torch/nn/modules/module.py (``_wrapped_call_impl`` calls
#: ``_call_impl(self, *args, **kwargs)``, which calls ``forward``).
_CALL_FRAMES = ("_wrapped_call_impl", "_call_impl")


@dataclass(frozen=True)
class CallsBroken:
    """What an error's traceback says of the module calls it went through: the innermost
    module with a name and the batch size of the outermost call (``None`` when unknown)."""

    layer: str | None
    batch: int | None


def calls_broken(traceback: TracebackType | None,
                 name_of: Callable[[nn.Module], str | None]) -> CallsBroken:
    """The module calls an error went through, read from its traceback's frames: in an
    iteration without module hooks (a light one) no post-hook noted the layer, but the frames
    of ``Module._call_impl`` are still there, each with its module and arguments."""
    layer: str | None = None
    batch: int | None = None
    while traceback is not None:
        frame = traceback.tb_frame
        traceback = traceback.tb_next
        if frame.f_code.co_name not in _CALL_FRAMES:
            continue
        module = frame.f_locals.get("self")
        if not isinstance(module, nn.Module):
            continue
        if batch is None:
            batch = batch_size(frame.f_locals.get("args", ()))
        layer = name_of(module) or layer
    return CallsBroken(layer, batch)


class FailureWatch:
    """The first sight of an out-of-memory error: inside a module's forward, the innermost
    layer and what memory held there."""

    def __init__(self) -> None:
        self.error_id: int | None = None
        self.layer: str | None = None
        self.moment: Moment | None = None
        self.total = 0
        self.observed = OOM_OBSERVER.count  # the allocator's events before this run

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


def figures(backend: MemoryBackend, message: str, watch: FailureWatch | None = None
            ) -> Figures:
    """The sizes of an out-of-memory error on ``backend``'s device: on CUDA the allocator's
    own, of the device that ran out; elsewhere the size the message gives, in the device's
    memory. ``watch`` dates the allocator observer's events of this run."""
    said, outside = read_message(message), read_outside(message)
    if isinstance(backend, CudaBackend):
        event = observed_since(watch.observed) if watch is not None else None
        return cuda_figures(backend, said, outside, event)
    if outside is not None:
        return Figures(None, False, backend.total_memory(), source=outside.source,
                       call=outside.call)
    return Figures(said.requested, said.segment, backend.total_memory())


def _where(error: BaseException, watch: FailureWatch, sampler: Sampler, calls: CallsBroken
           ) -> tuple[Phase, str | None, Moment, int]:
    """(phase, layer, the moment memory was read, the total then) of an out-of-memory error:
    as a module's post-hook saw it go by, else read now, in the phase its traceback shows; in
    a forward, the layer is the innermost module call the traceback holds. Read now, the parts
    are read in full."""
    if watch.seen(error) and watch.moment is not None:
        phase, layer, moment, total = Phase.FORWARD, watch.layer, watch.moment, watch.total
    else:
        phase = phase_of(error.__traceback__)
        # Read in full: the iteration may not have (the budget measured none of its
        # backward, so no gradient was counted), and a failure is read once.
        sampler.parts.read_all()
        total, moment = sampler.sample(), sampler.moment()
        layer = moment.layer if phase is Phase.BACKWARD else None
        if phase is Phase.BETWEEN and calls.layer is not None:
            phase = Phase.FORWARD
    if phase is Phase.FORWARD:
        layer = calls.layer or layer
    return phase, layer, moment, total


def explain(error: BaseException, watch: FailureWatch, sampler: Sampler,
            clock: IterationClock, name_of: Callable[[nn.Module], str | None]
            ) -> OutOfMemory | None:
    """What the tracked block's out-of-memory ``error`` ran into (``None`` when it is another
    error, or nothing was measured): where, the size asked for, the parts of memory then,
    and what the allocator could have held. ``name_of`` names a module: the innermost named
    one whose call the traceback holds is the layer (a post-hook sees the error only in the
    modules still hooked)."""
    backend = sampler.backend
    if backend is None or not is_out_of_memory(error):
        return None
    calls = calls_broken(error.__traceback__, name_of)
    phase, layer, moment, total = _where(error, watch, sampler, calls)
    batch = clock.batch if clock.batch is not None else calls.batch
    parts = at_moment(moment, with_outside(sampler, total), phase=phase, layer=layer)
    lines = str(error).strip().splitlines()
    sizes = figures(backend, str(error), watch)
    return OutOfMemory(
        error=type(error).__name__, message=(lines[0] if lines else "")[:500], phase=phase,
        layer=layer, iteration=clock.index, requested_bytes=sizes.requested,
        breakdown=parts, capacity=sizes.capacity, batch=batch,
        device_free=sizes.free, segment=sizes.segment, limit=sizes.limit,
        reserved=sizes.reserved, device_total=sizes.total, source=sizes.source,
        call=sizes.call, device=sizes.device, tracked=sizes.tracked,
        process_used=sizes.process_used, device_used=sizes.device_used,
    )


__all__ = ["MARKERS", "CallsBroken", "FailureWatch", "calls_broken", "ceiling", "explain",
           "figures", "is_out_of_memory", "phase_of", "requested_bytes"]
