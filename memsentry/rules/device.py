"""CUDA rules: ``memory-headroom``, ``allocator-fragmentation``, ``non-pytorch-memory``."""

from __future__ import annotations

import collections
import statistics

from memsentry.report import Finding, Report, Severity
from memsentry.rules.growth import WARMUP
from memsentry.units import format_bytes

HEADROOM = "memory-headroom"
FRAGMENTATION = "allocator-fragmentation"
NON_PYTORCH = "non-pytorch-memory"

#: The peak uses less than this share of the device: worth saying.
HEADROOM_SHARE = 0.5
#: The share of the device a suggested batch may fill.
TARGET_SHARE = 0.85
#: Reserved beyond the highest peak that counts as fragmentation.
FRAGMENT_SHARE = 0.25
FRAGMENT_BYTES = 256 * 2**20
#: Reserved growth per iteration that counts, while the peak is flat.
FRAGMENT_RATE = 2**20
#: Device memory of the process beyond PyTorch's reservation worth a hint (the CUDA
#: context and kernel images alone take 0.3 to 1 GiB).
NON_PYTORCH_BYTES = 2**31


def _cuda(report: Report) -> bool:
    return report.device.startswith("cuda")


def memory_headroom(report: Report) -> list[Finding]:
    """CUDA: the peak uses a small part of the device; from the activation memory per sample,
    estimate the batch that would fit."""
    its = [it for it in report.iterations if it.boundary != "exit"][WARMUP:]
    total = report.total_memory
    if not _cuda(report) or not total or len(its) < 2:
        return []
    peak = max(it.peak for it in its)
    if peak >= HEADROOM_SHARE * total:
        return []
    resident = min(it.allocated for it in its)
    batches = collections.Counter(it.batch for it in its if it.batch)
    message = (
        f"the peak, {format_bytes(peak)}, uses {peak / total:.0%} of {report.device}'s "
        f"{format_bytes(total)}"
    )
    activations = peak - resident
    if batches and activations > 0:
        batch = batches.most_common(1)[0][0]
        per_sample = activations / batch
        fits = int((TARGET_SHARE * total - resident) / per_sample)
        message += (
            f"; with {format_bytes(resident)} resident and {format_bytes(round(per_sample))} "
            f"of activations per sample (batch {batch}), a batch of about {fits:,} would fit "
            f"in {TARGET_SHARE:.0%} of it"
        )
    fix = (
        "raise the batch size (and scale the learning rate), train a larger model, or share "
        "the GPU between jobs (MPS, MIG); turn off memory savers you do not need "
        "(activation checkpointing, CPU offload)"
    )
    return [Finding(rule=HEADROOM, severity=Severity.HINT, message=message, fix=fix,
                    bytes=total - peak)]


def allocator_fragmentation(report: Report) -> list[Finding]:
    """CUDA: reserved memory far above the highest peak, or growing while the peak is flat:
    freed blocks that the caching allocator cannot reuse for new sizes."""
    its = [it for it in report.iterations
           if it.boundary != "exit" and it.reserved is not None][WARMUP:]
    if not _cuda(report) or len(its) < 4:
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
    split = stats.get("inactive_split_bytes.all.current")
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
                    bytes=max(unused, 0), rate=reserved_rate if growing else None)]


def non_pytorch_memory(report: Report) -> list[Finding]:
    """CUDA + NVML: device memory of this process beyond what PyTorch reserved."""
    nvml = report.nvml or {}
    used = nvml.get("process_used")
    if not _cuda(report) or used is None or report.reserved is None:
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
                    bytes=extra)]


__all__ = ["allocator_fragmentation", "memory_headroom", "non_pytorch_memory"]
