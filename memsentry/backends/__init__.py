"""Backends: how memory is read on each kind of device, and which one a tracker uses."""

from __future__ import annotations

import torch

from memsentry.backends.base import MemoryBackend
from memsentry.backends.cpu import MALLINFO2_UNAVAILABLE, MallinfoBackend, StorageBackend
from memsentry.backends.cuda import CudaBackend
from memsentry.backends.nvml import NvmlInfo
from memsentry.backends.nvml import query as nvml_query
from memsentry.errors import UnsupportedDeviceError

SUPPORTED_DEVICE_TYPES = ("cpu", "cuda")

__all__ = [
    "SUPPORTED_DEVICE_TYPES",
    "CudaBackend",
    "MallinfoBackend",
    "MemoryBackend",
    "NvmlInfo",
    "StorageBackend",
    "device_of_module",
    "make_backend",
    "nvml_query",
    "parse_device",
]


def parse_device(device: object) -> torch.device:
    """Turn a ``device=`` argument into a ``torch.device`` memsentry can measure, or say why not."""
    if isinstance(device, torch.device):
        parsed = device
    elif isinstance(device, int) and not isinstance(device, bool):
        if device < 0:
            raise UnsupportedDeviceError(
                f"device={device}: a CUDA device index cannot be negative; use 0, 1, ... or 'cpu'"
            )
        parsed = torch.device("cuda", device)
    elif isinstance(device, str):
        try:
            parsed = torch.device(device)
        except RuntimeError as exc:
            raise UnsupportedDeviceError(
                f"device={device!r} is not a device name torch understands ({exc}); "
                "use 'cpu', 'cuda' or 'cuda:N'"
            ) from None
    else:
        raise TypeError(
            f"device must be a torch.device, a string such as 'cuda:0', or an int, "
            f"got {type(device).__name__}"
        )
    _check_supported(parsed, f"device={str(device)!r}")
    return parsed


def _check_supported(device: torch.device, origin: str) -> None:
    if device.type not in SUPPORTED_DEVICE_TYPES:
        raise UnsupportedDeviceError(
            f"{origin} is on {device.type!r}, which memsentry cannot measure yet: it measures "
            "'cpu' and 'cuda' memory. Move the model with .to('cpu') or .to('cuda') while "
            "tracking, or pass device='cpu' / device='cuda' explicitly."
        )
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UnsupportedDeviceError(
                f"{origin} is on CUDA, but CUDA is not available in this process "
                f"(torch {torch.__version__}); track on 'cpu' or install a CUDA build of torch"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise UnsupportedDeviceError(
                f"{origin}: there is no CUDA device {device.index}; this machine has {count} "
                f"(cuda:0 .. cuda:{count - 1})"
            )


def device_of_module(module: torch.nn.Module) -> torch.device | None:
    """The device of a module's first parameter or buffer (``None`` when it has neither).

    A model spread over several devices is measured on the device of its first parameter.
    """
    for tensor in module.parameters():
        return _checked_tensor_device(tensor, module)
    for tensor in module.buffers():
        return _checked_tensor_device(tensor, module)
    return None


def _checked_tensor_device(tensor: torch.Tensor, module: torch.nn.Module) -> torch.device:
    _check_supported(tensor.device, f"model {type(module).__name__!r} ({tensor.device})")
    return tensor.device


#: A mallinfo2() call slower than this (seconds) makes the CPU backend count storages instead;
#: a tracker takes some 250 samples a step, so 20 us is 5 ms a step.
SLOW_SAMPLE = 20e-6


def make_backend(device: torch.device, *, exact: bool = False) -> MemoryBackend:
    """The backend measuring ``device``: CUDA's allocator, glibc counters, or storage counting."""
    _check_supported(device, f"device {str(device)!r}")
    if device.type == "cuda":
        return CudaBackend(device, exact=exact)
    if exact or MALLINFO2_UNAVAILABLE is not None:
        return StorageBackend()
    backend = MallinfoBackend()
    cost = backend.sample_cost()
    if cost > SLOW_SAMPLE:
        storages = StorageBackend()
        storages.notes = (
            *storages.notes,
            f"glibc mallinfo2() took {cost * 1e6:,.0f} us a call on this process's fragmented "
            "heap (it walks every free chunk), so memsentry counts tensor storages instead.",
        )
        return storages
    return backend
