"""CUDA rules: ``allocator-fragmentation`` and ``non-pytorch-memory``."""

from __future__ import annotations

import math
import statistics

from memsentry.model import Finding, ReportData, Severity, Subject, SubjectKind, complete
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


@rule(FRAGMENTATION, severities={Severity.WASTE}, devices={"cuda"})
def allocator_fragmentation(report: ReportData) -> list[Finding]:
    """CUDA: reserved memory far above the highest peak, or growing while the peak is flat:
    freed blocks that the caching allocator cannot reuse for new sizes."""
    its = complete([it for it in report.iterations if it.reserved is not None], skip=WARMUP)
    if not is_cuda(report) or len(its) < 4:
        return []
    peak = max(it.peak for it in its)
    reserved = its[-1].reserved or 0
    unused = reserved - peak
    reserved_rate = statistics.linear_regression(
        [float(it.index) for it in its], [float(it.reserved or 0) for it in its]
    ).slope
    peak_rate = statistics.linear_regression(
        [float(it.index) for it in its], [float(it.peak) for it in its]
    ).slope
    growing = reserved_rate >= FRAGMENT_RATE and peak_rate < 0.1 * reserved_rate
    large = unused >= max(FRAGMENT_SHARE * reserved, FRAGMENT_BYTES)
    if not (growing or large):
        return []
    stats = report.allocator_stats or {}
    split = _number(stats.get("inactive_split_bytes.all.current"))
    message = (
        f"{format_bytes(reserved)} reserved on {report.device} against a highest peak of "
        f"{format_bytes(peak)} after warm-up: {format_bytes(max(unused, 0))} the caching "
        "allocator holds but cannot reuse"
    )
    if growing:
        message += (
            f"; reserved grows {format_bytes(round(reserved_rate))}/iter while the peak stays "
            "flat, the mark of variable input shapes splitting cached blocks"
        )
    if split:
        message += f"; {format_bytes(int(split))} sit in inactive split blocks"
    fix = (
        "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before the first CUDA call; pad "
        "or bucket inputs to a few fixed shapes"
    )
    return [Finding(rule=FRAGMENTATION, severity=Severity.WASTE, message=message, fix=fix,
                    bytes=max(unused, 0), rate=reserved_rate if growing else None,
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


__all__ = ["allocator_fragmentation", "device_subject", "is_cuda", "non_pytorch_memory"]
