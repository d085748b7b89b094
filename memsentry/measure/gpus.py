"""Every CUDA device the program holds memory on, read once when tracking stops: a model spread
over ``cuda:0`` and ``cuda:1`` is measured on both, not on its first parameter's device alone.

Nothing here starts CUDA (a process that never initialised it used no device), and no error
reaches the caller: a device whose figures cannot be read is left out.
"""

from __future__ import annotations

from typing import Any

import torch

from memsentry.measure.nvml import query as nvml_query
from memsentry.model import DeviceMemory


def _figure(stats: dict[str, Any], key: str) -> int | None:
    value = stats.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def _device(index: int) -> DeviceMemory | None:
    """``cuda:index`` as its allocator (``torch.cuda.memory_stats``) and NVML count it, or
    ``None`` when it holds nothing or cannot be read."""
    try:
        stats = dict(torch.cuda.memory_stats(index))
    except Exception:
        return None
    allocated = _figure(stats, "allocated_bytes.all.current") or 0
    reserved = _figure(stats, "reserved_bytes.all.current") or 0
    if not allocated and not reserved:
        return None
    nvml = nvml_query(index, initialise=False)
    return DeviceMemory(
        device=f"cuda:{index}", allocated=allocated, reserved=reserved,
        allocator_peak=_figure(stats, "allocated_bytes.all.peak"), name=nvml.name,
        nvml_used=nvml.used, nvml_total=nvml.total, process_used=nvml.process_used,
        mig=nvml.mig, nvml_reason=nvml.reason,
    )


def read_devices() -> tuple[DeviceMemory, ...]:
    """Each CUDA device holding memory (allocated or reserved), in index order, in a process
    that initialised CUDA and sees more than one device; ``()`` otherwise."""
    try:
        if not torch.cuda.is_initialized():
            return ()
        count = torch.cuda.device_count()
    except Exception:
        return ()
    if count < 2:
        return ()
    found = []
    for index in range(count):
        try:
            device = _device(index)
        except Exception:  # a reader's surprise never reaches the program
            continue
        if device is not None:
            found.append(device)
    return tuple(found)
