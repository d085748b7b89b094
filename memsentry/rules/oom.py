"""What would have made an out-of-memory run fit: the arithmetic behind ``report.oom.fixes``.

Pure functions of a recorded report. The memory the run needed is what it held when the
error came plus the allocation that failed; it had ``capacity``: on CUDA the allocator's
limit (a memory fraction's cap, else the device's memory), and no more than what it reserved
plus what was free on the device. Activations (and the failed allocation, inside a forward
or backward) grow with the batch; parameters, gradients and optimizer state do not.
"""

from __future__ import annotations

from dataclasses import replace

from memsentry.model import (
    FixKind,
    LayerBytes,
    LayerStats,
    OomFix,
    OutOfMemory,
    Phase,
    ReportData,
)
from memsentry.units import format_bytes

#: Layers named as the largest activation holders, and as checkpointing candidates.
LARGEST = 3


def largest_layers(layers: tuple[LayerStats, ...]) -> tuple[LayerBytes, ...]:
    """The layers below the outermost one that save the most for backward, outer layers
    first among equals (a block rather than its last Linear)."""
    inner = [layer for layer in layers if layer.depth > 0 and layer.saved_bytes]
    if not inner:
        return ()
    shallowest = min(layer.depth for layer in inner)
    blocks = [layer for layer in inner if layer.depth == shallowest]
    if len(blocks) < 2:  # one container: look inside it
        blocks = inner
    blocks.sort(key=lambda layer: (-(layer.saved_bytes or 0), layer.depth))
    return tuple(LayerBytes(layer.name, layer.saved_bytes or 0) for layer in blocks[:LARGEST])


def _activations(report: ReportData, oom: OutOfMemory) -> tuple[int, int | None]:
    """Activation bytes and the batch they were measured at: those of the failing moment when
    it held any, else of the iteration that held the most."""
    if oom.breakdown.activations and oom.batch:
        return oom.breakdown.activations, oom.batch
    best = max((it for it in report.iterations if it.parts is not None and it.batch),
               key=lambda it: it.parts.activations if it.parts else 0, default=None)
    if best is None or best.parts is None:
        return oom.breakdown.activations, oom.batch
    return best.parts.activations, best.batch


def room(oom: OutOfMemory) -> str:
    """The memory the run had, as the post-mortem names it: ``the device's 80 GiB``, or on
    CUDA, where the allocator's limit is known, ``the 40 GiB the allocator could have``."""
    if oom.limit is None:
        return f"the device's {format_bytes(oom.capacity)}"
    return f"the {format_bytes(oom.capacity)} the allocator could have"


def _request_fix(oom: OutOfMemory) -> OomFix | None:
    """An allocation larger than the device, where the batch cannot explain it."""
    requested, capacity = oom.requested_bytes, oom.capacity
    if not requested or not capacity or requested <= capacity:
        return None
    if oom.segment:
        asked = f"the segment the allocator asked the driver for, {format_bytes(requested)}, is"
    else:
        asked = f"the allocation that failed asks for {format_bytes(requested)},"
    return OomFix(FixKind.REQUEST, (
        f"{asked} more than {room(oom)} on its own; check the shape your code builds there"))


def _earlier_batches(report: ReportData, batch: int) -> str:
    """`` (iterations before ran batches of 256)`` when the failing batch differs."""
    earlier = sorted({it.batch for it in report.iterations if it.batch and it.batch != batch})
    if not earlier:
        return ""
    shown = ", ".join(map(str, earlier[:3])) + (" ..." if len(earlier) > 3 else "")
    return f"; the iterations before ran batches of {shown}"


def _batch_fix(report: ReportData, oom: OutOfMemory) -> OomFix | None:
    capacity, batch = oom.capacity, oom.batch
    activations, measured_at = _activations(report, oom)
    if oom.phase is Phase.STEP:  # an optimizer step's memory does not depend on the batch
        return None
    if not capacity or not batch or not measured_at:
        return _request_fix(oom)
    # Activations grow with the batch, and so does the allocation that failed in a forward
    # or a backward; the rest held at the failure does not.
    requested = oom.requested_bytes or 0
    per_sample = activations / measured_at + requested / batch
    fixed = oom.breakdown.total - oom.breakdown.activations
    if per_sample <= 0:
        return _request_fix(oom)
    fits = int((capacity - fixed) // per_sample)
    if fits >= batch:
        return None
    if fits < 1:
        return OomFix(FixKind.BATCH, (
            f"not even a batch of 1 fits: {format_bytes(fixed)} is held apart from "
            f"activations, and one sample needs {format_bytes(round(per_sample))} more"))
    saves = round((batch - fits) * per_sample)
    return OomFix(FixKind.BATCH, (
        f"a batch of at most {fits} (now {batch}{_earlier_batches(report, batch)}) would have "
        f"fit: {format_bytes(fixed)} does not depend on the batch and each sample needs "
        f"{format_bytes(round(per_sample))} of activations and temporaries, in "
        f"{room(oom)}"), saves=saves, batch=fits)


def fixes(report: ReportData, oom: OutOfMemory, largest: tuple[LayerBytes, ...]
          ) -> tuple[OomFix, ...]:
    found: list[OomFix] = []
    batch = _batch_fix(report, oom)
    if batch is not None:
        found.append(batch)
    request = _request_fix(oom)
    if request is not None and (batch is None or batch.kind is not FixKind.REQUEST):
        found.append(request)  # larger than the device alone: perhaps not the batch at all
    for entry in largest[:2]:
        found.append(OomFix(FixKind.CHECKPOINT, (
            f"checkpoint `{entry.layer}` (torch.utils.checkpoint.checkpoint): its largest "
            f"call measured saved {format_bytes(entry.bytes)} for backward; checkpointed, it "
            "keeps its input and recomputes the rest in the backward"), saves=entry.bytes))
    activations, _batch = _activations(report, oom)
    if activations:
        found.append(OomFix(FixKind.AUTOCAST, (
            "run the forward under torch.autocast(device_type, dtype=torch.bfloat16): "
            f"activations saved in 2 bytes instead of 4, about {format_bytes(activations // 2)} "
            "less if they are float32 now"), saves=activations // 2))
    params, state = oom.breakdown.parameters, oom.breakdown.optimizer_state
    if params and state >= 1.5 * params:
        found.append(OomFix(FixKind.OPTIMIZER, (
            f"the optimizer keeps {format_bytes(state)} of state, {state / params:.1f}x the "
            "parameters (Adam keeps two tensors per parameter): SGD with momentum keeps one "
            f"({format_bytes(state - params)} less); Adafactor or 8-bit Adam less again"),
            saves=state - params))
    return tuple(found)


def explain_oom(report: ReportData) -> OutOfMemory | None:
    """``report.oom`` with its largest activation holders and its fixes filled in."""
    oom = report.oom
    if oom is None:
        return None
    largest = largest_layers(report.layers)
    return replace(oom, largest=largest, fixes=fixes(report, oom, largest))


__all__ = ["explain_oom", "fixes", "largest_layers", "room"]
