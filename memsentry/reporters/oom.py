"""The out-of-memory post-mortem: a section of the text report, and the three-line note
added to the user's exception."""

from __future__ import annotations

from memsentry.model import CATEGORIES, OutOfMemory
from memsentry.model.oom import OomSource
from memsentry.reporters.wrap import fill
from memsentry.units import format_bytes
from memsentry.usercode.text import printable_values

_NAMES = {"optimizer_state": "optimizer state"}

#: What ran out, for each failure outside PyTorch's allocator.
_WHAT = {
    OomSource.CUDA_RUNTIME: "a CUDA runtime call ran out of device memory",
    OomSource.CUDA_DRIVER: "a CUDA driver call ran out of device memory",
    OomSource.CUBLAS: "cuBLAS could not allocate device memory",
    OomSource.CUDNN: "cuDNN could not allocate device memory",
    OomSource.CUDNN_START: "cuDNN could not start (CUDNN_STATUS_NOT_INITIALIZED)",
    OomSource.CUFFT: "cuFFT could not allocate device memory for a plan",
    OomSource.CUSOLVER: "cuSOLVER could not allocate device memory",
}

_RUNTIME = ("the CUDA runtime allocates this memory itself (the CUDA context and the kernels "
            "it loads, a kernel launch's resources, an extension's own cudaMalloc)")
_LIBRARY = ("{lib} allocates its handle and its internal buffers with cudaMalloc itself")
#: Why such a failure happens on a device where PyTorch's allocator may still hold memory.
_WHY = {
    OomSource.CUDA_RUNTIME: _RUNTIME,
    OomSource.CUDA_DRIVER: ("a CUDA driver call torch makes directly (mapping memory, sharing "
                            "it with another process) allocates this memory itself"),
    OomSource.CUDNN_START: ("cudnnCreate answers this when CUDA cannot start cuDNN on the "
                            "device: most often no device memory left for its handle (if "
                            "much was free, a cuDNN that does not match the driver gives it "
                            "too)"),
}
_UNLENT = (", outside PyTorch's caching allocator, which cannot lend it what it holds cached; "
           "the error gives no size, so no batch is worked out")


def _held(oom: OutOfMemory) -> str:
    parts = oom.breakdown
    split = ", ".join(f"{_NAMES.get(name, name)} {format_bytes(parts.part(name))}"
                      for name in CATEGORIES)
    if oom.tracked is not None:  # the breakdown is the tracked device's, not the failed one's
        of = f" on {oom.tracked}"
    else:
        of = f" of {format_bytes(oom.capacity)}" if oom.capacity else ""
    return f"{format_bytes(parts.total)} in use{of} ({split})"


def _asked(oom: OutOfMemory) -> str:
    if oom.outside:
        call = f" in `{oom.call}`" if oom.call else ""
        return f": {_WHAT.get(oom.source, 'memory ran out')}{call}"
    if oom.requested_bytes is None:
        return ""
    if oom.segment:
        return f" asking the driver for a {format_bytes(oom.requested_bytes)} segment"
    return f" asking for {format_bytes(oom.requested_bytes)}"


def _kind(oom: OutOfMemory) -> str:
    """`` outside PyTorch's caching allocator`` or `` on cuda:1`` (another device than the
    tracked one), or nothing."""
    if oom.outside:
        return " outside PyTorch's caching allocator"
    return f" on {oom.device}" if oom.tracked is not None else ""


def _why(oom: OutOfMemory) -> str:
    library = str(oom.source).split(" ")[0]
    why = _WHY.get(oom.source, _LIBRARY.format(lib=library))
    return f"  why: {why}{_UNLENT}"


def _nvml(oom: OutOfMemory) -> list[str]:
    """The process's memory outside the allocator and other processes' memory, by NVML."""
    device = oom.device or "the device"
    lines = []
    outside = oom.outside_allocator
    if outside is not None:
        lines.append(
            f"  outside the allocator: {format_bytes(outside)}: NVML counted "
            f"{format_bytes(oom.process_used)} for this process on {device}, of which the caching "
            f"allocator reserved {format_bytes(oom.reserved)}; the rest is the CUDA context, "
            "cuBLAS and cuDNN handles and workspaces, NCCL buffers, other libraries")
    elif oom.outside:
        lines.append(f"  outside the allocator: not measured: NVML gave no figure for this "
                     f"process on {device} (without NVML, pip install nvidia-ml-py); the "
                     f"caching allocator reserved {format_bytes(oom.reserved)}")
    others = oom.others
    if others:
        lines.append(f"  other processes: {format_bytes(others)} on {device} (NVML: "
                     f"{format_bytes(oom.device_used)} used by every process)")
    return lines


def _device(oom: OutOfMemory) -> str | None:
    """Which device the figures are of, where that needs saying."""
    if oom.tracked is not None:
        return (f"  device: {oom.device} ran out; memsentry tracked {oom.tracked}, so `held "
                f"then` is {oom.tracked}'s and the other figures are {oom.device}'s; track "
                f"{oom.device} (memsentry.track(model, device=\"{oom.device}\")) to break "
                "down what filled it")
    if oom.outside and oom.device is not None:
        return (f"  device: the error names none; the figures are those of {oom.device}, the "
                "device memsentry tracked")
    return None


def _free(oom: OutOfMemory) -> str | None:
    if oom.device_free is None:
        return None
    if oom.outside:
        return (f"  free on the device: {format_bytes(oom.device_free)} (cudaMemGetInfo, when "
                "memsentry caught the error)")
    return (f"  the allocator: {format_bytes(oom.device_free)} free on the device when it gave "
            "up")


#: Below this share of the device, a limit is a memory fraction's cap rather than the
#: device's memory read twice (the message rounds it to 0.01 GiB).
_CAPPED = 0.99


def _limit(oom: OutOfMemory) -> str:
    """``the 40 GiB torch.cuda.set_per_process_memory_fraction allows of the device's
    80 GiB``, or ``the device's 80 GiB``."""
    limit, total = oom.limit or 0, oom.device_total
    if total and limit < _CAPPED * total:
        return (f"the {format_bytes(limit)} torch.cuda.set_per_process_memory_fraction "
                f"allows of the device's {format_bytes(total)}")
    return f"the device's {format_bytes(limit)}"


def _ceiling(oom: OutOfMemory) -> str | None:
    """Where the allocator's ceiling came from, where it is known (CUDA)."""
    if oom.limit is None or oom.capacity is None:
        return None
    reserved, free = oom.reserved, oom.device_free
    if reserved is None or free is None or oom.capacity >= oom.limit:
        return f"  ceiling: {format_bytes(oom.capacity)}, {_limit(oom)}"
    return (f"  ceiling: {format_bytes(oom.capacity)}, what the allocator could still get: "
            f"the {format_bytes(reserved)} it reserved plus {format_bytes(free)} free on the "
            f"device, below {_limit(oom)}; the rest was held outside PyTorch's allocator (the "
            "CUDA context, other libraries, other processes)")


_SEGMENT = ("  the size is the segment the caching allocator asked the driver for: 2 MiB for "
            "a request up to 1 MiB, 20 MiB for one up to 10 MiB, larger ones rounded up to "
            "2 MiB; the tensor itself asked for that much or less")


def oom_note(oom: OutOfMemory) -> str:
    """Three lines: where and what memory held; the largest activations and the first fix;
    where the rest is."""
    oom = printable_values(oom)
    first = (f"memsentry: out of memory{_kind(oom)} in the {oom.where} (iteration "
             f"{oom.iteration}){_asked(oom)}, {_held(oom)}.")
    second = []
    if oom.largest:
        second.append("largest activations: " + ", ".join(
            f"`{entry.layer}` {format_bytes(entry.bytes)}" for entry in oom.largest))
    if oom.fixes:
        second.append(f"fix: {oom.fixes[0].text}")
    lines = [first, "; ".join(second) or "no activations were measured before the failure.",
             "memsentry's report has the breakdown and every fix: tracker.report().oom, or the "
             "report `memsentry run` printed."]
    return "\n".join(lines)


def _figures(oom: OutOfMemory) -> list[str]:
    """What memory held, on which device, why, and the allocator's and the driver's figures."""
    said = [f"  held then: {_held(oom)}", _device(oom),
            _why(oom) if oom.outside else None, _ceiling(oom), *_nvml(oom), _free(oom),
            _SEGMENT if oom.segment and oom.requested_bytes is not None else None]
    return [line for line in said if line is not None]


def render_oom(oom: OutOfMemory, *, width: int = 100) -> str:
    """The post-mortem section of the text report."""
    oom = printable_values(oom)
    lines = [fill(
        f"Out of memory{_kind(oom)}: {oom.error} in the {oom.where} (iteration {oom.iteration}"
        + (f", batch {oom.batch}" if oom.batch else "") + f"){_asked(oom)}", width)]
    lines += [fill(line, width, subsequent_indent="    ") for line in _figures(oom)]
    if oom.message:
        lines.append(fill(f"  error: {oom.message}", width, subsequent_indent="    "))
    if oom.largest:
        lines.append("  largest activations: " + ", ".join(
            f"`{entry.layer}` {format_bytes(entry.bytes)}" for entry in oom.largest))
    for fix in oom.fixes:
        lines.append(fill(f"  fix ({fix.kind}): {fix.text}", width, subsequent_indent="    "))
    return "\n".join(lines)


__all__ = ["oom_note", "render_oom"]
