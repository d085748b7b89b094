"""What would have made an out-of-memory run fit: the arithmetic behind ``report.oom.fixes``.

Pure functions of a recorded report. The memory the run needed is what it held when the
error came plus the allocation that failed; it had ``capacity``: on CUDA the allocator's
limit (a memory fraction's cap, else the device's memory), and no more than what it reserved
plus what was free on the device. Activations (and the failed allocation, inside a forward
or backward) grow with the batch; parameters, gradients and optimizer state do not.

A failure outside PyTorch's allocator (a CUDA call or library that ran out of device memory
of its own) gives no size, so no batch is worked out: its fixes leave the device headroom
outside the allocator (its cache given back, the library's handle made early, a memory
fraction, other processes, the library's own settings). On another device than the tracked
one, the breakdown is not that device's: only a request larger than that device is said.
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
from memsentry.model.oom import OomSource
from memsentry.units import format_bytes

#: Layers named as the largest activation holders, and as checkpointing candidates.
LARGEST = 3


def largest_layers(layers: tuple[LayerStats, ...]) -> tuple[LayerBytes, ...]:
    """The layers below the outermost one that save the most for backward, outer layers
    first among equals (a block rather than its last Linear)."""
    inner = [layer for layer in layers if layer.depth > 0 and layer.saved_bytes]
    if not inner:
        return ()
    blocks = sorted(_blocks(inner), key=_most_saved)
    return tuple(LayerBytes(layer.name, layer.saved_bytes or 0) for layer in blocks[:LARGEST])


def _blocks(inner: list[LayerStats]) -> list[LayerStats]:
    """The shallowest of the ``inner`` layers when there are several (a model's blocks);
    all of them when there is one (a container: look inside it)."""
    shallowest = min(layer.depth for layer in inner)
    blocks = [layer for layer in inner if layer.depth == shallowest]
    return inner if len(blocks) < 2 else blocks


def _most_saved(layer: LayerStats) -> tuple[int, int]:
    """Most saved for backward first, the outer layer first among equals."""
    return -(layer.saved_bytes or 0), layer.depth


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


#: Memory below this (64 MiB) is not worth a fix of its own: the allocator's cache, or what
#: other processes hold.
WORTH = 64 << 20
#: The room a memory fraction leaves beyond what is outside the allocator now: 1 GiB for the
#: next handle or workspace.
SPARE = 1 << 30
#: A small call that makes each library's handle.
_FIRST_CALL = {OomSource.CUBLAS: "matmul", OomSource.CUDNN: "convolution",
               OomSource.CUDNN_START: "convolution", OomSource.CUFFT: "torch.fft call",
               OomSource.CUSOLVER: "torch.linalg call"}


def _library(oom: OutOfMemory) -> str:
    return "the CUDA runtime" if oom.source in (OomSource.CUDA_RUNTIME, OomSource.CUDA_DRIVER) \
        else str(oom.source).split(" ")[0]


def _cache_fix(oom: OutOfMemory) -> OomFix | None:
    """The allocator's cache, which a library's own cudaMalloc cannot use."""
    reserved, in_use = oom.reserved, oom.breakdown.total
    if reserved is None or reserved - in_use < WORTH:
        return None
    cached = reserved - in_use
    return OomFix(FixKind.HEADROOM, (
        f"call torch.cuda.empty_cache() before the call that failed: PyTorch's caching "
        f"allocator reserved {format_bytes(reserved)} and its tensors used "
        f"{format_bytes(in_use)}; the {format_bytes(cached)} it kept cached is memory "
        f"{_library(oom)} cannot use until empty_cache() gives it back to the driver"),
        saves=cached)


def _handle_fix(oom: OutOfMemory) -> OomFix | None:
    first = _FIRST_CALL.get(oom.source)
    if first is None:
        return None
    return OomFix(FixKind.HEADROOM, (
        f"make {_library(oom)}'s handles while the device is empty: one small forward and "
        f"backward (a batch of 1, which runs a {first}) right after the model moves to the GPU "
        "creates them before activations and the allocator's cache fill the device, and torch "
        "keeps them for the process (one per device and thread, the backward's included)"))


def _others_fix(oom: OutOfMemory) -> OomFix | None:
    others = oom.others
    if others is None or others < WORTH:
        return None
    on = f"{oom.device}'s {format_bytes(oom.device_total)}" if oom.device_total else "the device"
    return OomFix(FixKind.HEADROOM, (
        f"other processes held {format_bytes(others)} of {on} (NVML): end them, or give this "
        "run a GPU of its own (CUDA_VISIBLE_DEVICES)"), saves=others)


def _fraction_fix(oom: OutOfMemory) -> OomFix | None:
    """A memory fraction that leaves what is outside the allocator now, and a spare GiB."""
    total, outside = oom.device_total, oom.outside_allocator
    if not total:
        return None
    if outside is None:
        return OomFix(FixKind.HEADROOM, (
            "cap the caching allocator with torch.cuda.set_per_process_memory_fraction(f): it "
            f"then leaves (1 - f) x {format_bytes(total)} to memory outside it; how much that "
            "needs is not known here (NVML gave no figure for this process)"))
    fraction = int(100 * (total - outside - (oom.others or 0) - SPARE) / total) / 100
    if fraction < 0.05:
        return None
    return OomFix(FixKind.HEADROOM, (
        f"cap the caching allocator: torch.cuda.set_per_process_memory_fraction({fraction:.2f})"
        f" holds it to {format_bytes(round(fraction * total))} of {format_bytes(total)}, "
        f"leaving the {format_bytes(outside)} held outside it now"
        + (f" and other processes' {format_bytes(oom.others)}" if oom.others else "")
        + f" plus {format_bytes(SPARE)} for the next handle or workspace"))


def _setting_fix(oom: OutOfMemory) -> OomFix | None:
    """The failing part's own setting that makes it take less."""
    source, index = oom.source, (oom.device or "cuda:0").rpartition(":")[2]
    if source is OomSource.CUBLAS:
        # The sizes: parseChosenWorkspaceSize in aten/src/ATen/cuda/CublasHandlePool.cpp.
        text = ("CUBLAS_WORKSPACE_CONFIG=:16:8 (in the environment before the first matmul: "
                "torch reads it once) shrinks each handle and stream's cuBLAS workspace from "
                "torch's default, 2 x 4096 KiB + 8 x 16 KiB (8 x 4096 KiB on Hopper and "
                "later GPUs), to 8 x 16 KiB; torch takes these workspaces from its caching "
                "allocator, so with empty_cache() the room goes to the driver, where "
                "cublasCreate needs it; some matmuls run slower")
    elif source in (OomSource.CUDA_RUNTIME, OomSource.CUDA_DRIVER):
        # aten/src/ATen/cuda/detail/CUDAHooks.cpp (CUDAHooks::init) sets LAZY when unset.
        text = ("CUDA_MODULE_LOADING=LAZY (torch sets it where the environment leaves it "
                "unset) loads each kernel when first used; EAGER loads every kernel of every "
                "library into the CUDA context at start, which then takes more of the device")
    elif source is OomSource.CUFFT:
        text = (f"torch.backends.cuda.cufft_plan_cache[{index}].max_size = 16 (or fewer): "
                "each cached cuFFT plan keeps device memory outside the allocator")
    else:
        return None
    return OomFix(FixKind.HEADROOM, text)


def headroom_fixes(oom: OutOfMemory) -> tuple[OomFix, ...]:
    """What leaves room on the device outside PyTorch's allocator."""
    found = (_cache_fix(oom), _handle_fix(oom), _others_fix(oom), _fraction_fix(oom),
             _setting_fix(oom))
    return tuple(fix for fix in found if fix is not None)


def fixes(report: ReportData, oom: OutOfMemory, largest: tuple[LayerBytes, ...]
          ) -> tuple[OomFix, ...]:
    """The fixes of ``oom``: leaving room outside the allocator, when it ran out outside it;
    on another device than the tracked one, only a request larger than that device (the
    breakdown is not its); else the allocator's arithmetic."""
    if oom.outside:
        return headroom_fixes(oom)
    if oom.tracked is not None:
        return tuple(fix for fix in (_request_fix(oom),) if fix is not None)
    return _allocator_fixes(report, oom, largest)


def _allocator_fixes(report: ReportData, oom: OutOfMemory, largest: tuple[LayerBytes, ...]
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


__all__ = ["explain_oom", "fixes", "headroom_fixes", "largest_layers", "room"]
