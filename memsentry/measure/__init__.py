"""Measuring: how memory is read on each kind of device, and which backend a tracker uses.

The bottom of the pipeline (measure -> record -> analyse -> report): it imports only the
values (:mod:`memsentry.model`) and the foundation modules.
"""

from __future__ import annotations

import torch

from memsentry.measure.accelerator import AcceleratorBackend
from memsentry.measure.base import MemoryBackend
from memsentry.measure.cpu import MALLINFO2_UNAVAILABLE, MallinfoBackend, heap_in_use
from memsentry.measure.cuda import CudaBackend, read_pinned
from memsentry.measure.devices import (
    DEDICATED_DEVICE_TYPES,
    check_supported,
    device_of_module,
    parse_device,
    supported_device_types,
)
from memsentry.measure.mps import MpsBackend
from memsentry.measure.nvml import NvmlInfo
from memsentry.measure.nvml import query as nvml_query
from memsentry.measure.processes import resident_peak
from memsentry.measure.storage import StorageBackend, StorageCounter

__all__ = [
    "DEDICATED_DEVICE_TYPES",
    "AcceleratorBackend",
    "CudaBackend",
    "MallinfoBackend",
    "MemoryBackend",
    "MpsBackend",
    "NvmlInfo",
    "StorageBackend",
    "StorageCounter",
    "device_of_module",
    "heap_in_use",
    "make_backend",
    "nvml_query",
    "parse_device",
    "read_pinned",
    "resident_peak",
    "supported_device_types",
]

def make_backend(device: torch.device, *, exact: bool = False) -> MemoryBackend:
    """The backend measuring ``device``: CUDA's allocator, another accelerator's statistics
    (on MPS, ``torch.mps``'s counters where torch refuses those), glibc counters, or storage
    counting (``exact``, or where glibc has no ``mallinfo2``).
    However slow ``mallinfo2()`` is on a fragmented heap, the recorder keeps its cost within
    its budget (:mod:`memsentry.record.coverage`)."""
    check_supported(device, f"device {str(device)!r}")
    if device.type == "cuda":
        return CudaBackend(device, exact=exact)
    if device.type != "cpu":
        return _accelerator_backend(device, exact=exact)
    if exact or MALLINFO2_UNAVAILABLE is not None:
        return StorageBackend()
    return MallinfoBackend()


def _accelerator_backend(device: torch.device, *, exact: bool) -> MemoryBackend:
    """``torch.accelerator``'s statistics; on MPS, where torch refused them when tracking
    began, ``torch.mps``'s own counters instead."""
    backend = AcceleratorBackend(device, exact=exact)
    if backend.refusal is None or device.type != "mps":
        return backend
    return MpsBackend(device, backend.refusal, exact=exact)
