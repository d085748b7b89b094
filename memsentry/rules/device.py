"""CUDA rules: ``allocator-fragmentation`` and ``non-pytorch-memory``."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

from memsentry.model import (
    Finding,
    IterationStats,
    ReportData,
    Severity,
    Subject,
    SubjectKind,
    complete,
)
from memsentry.model.allocators import CudaAllocator, allocator_of
from memsentry.rules.registry import rule
from memsentry.rules.series import WARMUP
from memsentry.units import format_bytes

FRAGMENTATION = "allocator-fragmentation"
NON_PYTORCH = "non-pytorch-memory"

#: Reserved beyond the highest peak that counts as fragmentation.
FRAGMENT_SHARE = 0.25
FRAGMENT_BYTES = 256 * 2**20
#: Reserved growth per iteration that counts, while the peak is flat.
FRAGMENT_RATE = 2**20
#: Device memory of the process beyond PyTorch's reservation worth a hint (the CUDA
#: context and kernel images alone take 0.3 to 1 GiB).
NON_PYTORCH_BYTES = 2**31


def is_cuda(report: ReportData) -> bool:
    return report.device.startswith("cuda")


def device_subject(report: ReportData) -> Subject:
    return Subject(SubjectKind.DEVICE, report.device)


def _number(value: object) -> int | None:
    """A figure of the backend's or NVML's free-form record, or ``None`` where it is not a
    number."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return int(value)
    return None


def runs_native(report: ReportData) -> bool:
    """Whether the run's memory came from torch's own caching allocator: every CUDA run but
    those measured under ``backend:cudaMallocAsync`` or a pluggable allocator."""
    return allocator_of(report.backend) in (None, CudaAllocator.NATIVE)


def _fragmentation_fix(native: bool) -> str:
    """``expandable_segments`` is a setting of the native allocator alone (the others never
    read it)."""
    if native:
        return ("set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before the first CUDA "
                "call; pad or bucket inputs to a few fixed shapes")
    return ("pad or bucket inputs to a few fixed shapes (expandable_segments:True is a setting "
            "of torch's native allocator and does nothing under this one)")


def _slope(its: list[IterationStats], value: Callable[[IterationStats], float]) -> float:
    """How fast ``value`` changes per iteration over ``its`` (0 when they share one index:
    a report edited by hand)."""
    indexes = [float(it.index) for it in its]
    if len(set(indexes)) < 2:
        return 0.0
    return statistics.linear_regression(indexes, [value(it) for it in its]).slope


def _fragmentation_details(report: ReportData, reserved_rate: float | None,
                           native: bool) -> str:
    """The growth of reserved memory (``reserved_rate`` where it grows while the peak is
    flat) and the bytes in inactive split blocks, as clauses of the finding's message."""
    details = ""
    if reserved_rate is not None:
        details += (
            f"; reserved grows {format_bytes(round(reserved_rate))}/iter while the peak stays "
            "flat, the mark of variable input shapes"
            + (" splitting cached blocks" if native else "")
        )
    split = _number((report.allocator_stats or {}).get("inactive_split_bytes.all.current"))
    if split:
        details += f"; {format_bytes(int(split))} sit in inactive split blocks"
    return details


def _fragmented(its: list[IterationStats]) -> tuple[int, int, float | None] | None:
    """(reserved, highest peak, the rate at which reserved grows while the peak stays flat,
    or ``None``) where reserved sits far above the peak or grows that way; ``None`` where
    it does neither."""
    peak = max(it.peak for it in its)
    reserved = its[-1].reserved or 0
    rate = _slope(its, lambda it: float(it.reserved or 0))
    growing = rate >= FRAGMENT_RATE and _slope(its, lambda it: float(it.peak)) < 0.1 * rate
    large = reserved - peak >= max(FRAGMENT_SHARE * reserved, FRAGMENT_BYTES)
    if not (growing or large):
        return None
    return reserved, peak, rate if growing else None


@rule(FRAGMENTATION, severities={Severity.WASTE}, devices={"cuda"})
def allocator_fragmentation(report: ReportData) -> list[Finding]:
    """CUDA: reserved memory far above the highest peak, or growing while the peak is flat:
    freed blocks that the caching allocator cannot reuse for new sizes. Judged on exact
    peaks only: against a peak sampled at hooks, a temporary made and freed inside a layer
    would look like reserved memory nothing uses."""
    its = complete([it for it in report.iterations
                    if it.reserved is not None and it.peak_exact], skip=WARMUP)
    found = _fragmented(its) if is_cuda(report) and len(its) >= 4 else None
    if found is None:
        return []
    reserved, peak, rate = found
    unused = max(reserved - peak, 0)
    native = runs_native(report)
    message = (
        f"{format_bytes(reserved)} reserved on {report.device} against a highest peak of "
        f"{format_bytes(peak)} after warm-up: {format_bytes(unused)} the "
        f"{'caching ' if native else ''}allocator holds but cannot reuse"
        + _fragmentation_details(report, rate, native)
    )
    return [Finding(rule=FRAGMENTATION, severity=Severity.WASTE, message=message,
                    fix=_fragmentation_fix(native), bytes=unused, rate=rate,
                    subject=device_subject(report))]


@rule(NON_PYTORCH, severities={Severity.HINT}, devices={"cuda"})
def non_pytorch_memory(report: ReportData) -> list[Finding]:
    """CUDA + NVML: device memory of this process beyond what PyTorch reserved."""
    nvml = report.nvml or {}
    used = _number(nvml.get("process_used"))  # free-form: a report read back may hold anything
    if not is_cuda(report) or used is None or report.reserved is None:
        return []
    extra = int(used) - report.reserved
    if extra < NON_PYTORCH_BYTES:
        return []
    message = (
        f"NVML counts {format_bytes(int(used))} on {report.device} for this process, "
        f"{format_bytes(extra)} more than PyTorch reserved ({format_bytes(report.reserved)}). "
        "The CUDA context and kernel images take 0.3 to 1 GiB; the rest belongs to other "
        "libraries (NCCL buffers, cuDNN/cuBLAS workspaces, CuPy, TensorRT, JAX)"
    )
    fix = (
        "find the library: NCCL_BUFFSIZE and fewer communicators for NCCL, "
        "XLA_PYTHON_CLIENT_PREALLOCATE=false for JAX, CuPy's memory pool limit; "
        "CUDA_MODULE_LOADING=LAZY shrinks the kernel images"
    )
    return [Finding(rule=NON_PYTORCH, severity=Severity.HINT, message=message, fix=fix,
                    bytes=extra, subject=device_subject(report))]


__all__ = ["allocator_fragmentation", "device_subject", "is_cuda", "non_pytorch_memory",
           "runs_native"]
