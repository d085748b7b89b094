"""What this machine offers memsentry: torch, devices, allocator and NVML figures (data only)."""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from memsentry.measure.cpu import MALLINFO2_UNAVAILABLE, MallinfoBackend, physical_memory
from memsentry.measure.nvml import NvmlInfo
from memsentry.measure.nvml import query as nvml_query


@dataclass(frozen=True)
class CudaDeviceInfo:
    """One CUDA device as torch's caching allocator and NVML see it."""

    index: int
    name: str
    total: int
    allocated: int
    reserved: int
    peak: int
    nvml: NvmlInfo


@dataclass(frozen=True)
class MachineInfo:
    """The answer of ``memsentry info``."""

    memsentry_version: str
    torch_version: str
    python_version: str
    platform: str
    cpu_backend: str
    cpu_allocated: int | None
    cpu_reserved: int | None
    ram_total: int | None
    cuda_available: bool
    cuda_reason: str | None
    cuda_devices: tuple[CudaDeviceInfo, ...] = field(default_factory=tuple)
    nvml: NvmlInfo | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _cuda_reason() -> str:
    if torch.version.cuda is None:
        return f"this torch build ({torch.__version__}) has no CUDA support"
    return "torch was built with CUDA but finds no usable GPU or driver"


def collect() -> MachineInfo:
    """Survey this machine. Never raises for a missing GPU, driver or NVML."""
    from memsentry.version import __version__

    if MALLINFO2_UNAVAILABLE is None:
        cpu = MallinfoBackend()
        cpu_backend, cpu_alloc, cpu_res = cpu.name, cpu.allocated(), cpu.reserved()
    else:
        cpu_backend, cpu_alloc, cpu_res = f"cpu-storages ({MALLINFO2_UNAVAILABLE})", None, None
    available = torch.cuda.is_available()
    devices = []
    if available:
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            devices.append(
                CudaDeviceInfo(
                    index=index,
                    name=props.name,
                    total=int(props.total_memory),
                    allocated=torch.cuda.memory_allocated(index),
                    reserved=torch.cuda.memory_reserved(index),
                    peak=torch.cuda.max_memory_allocated(index),
                    nvml=nvml_query(index),
                )
            )
    return MachineInfo(
        memsentry_version=__version__,
        torch_version=torch.__version__,
        python_version=platform.python_version(),
        platform=f"{platform.system()} {platform.machine()}",
        cpu_backend=cpu_backend,
        cpu_allocated=cpu_alloc,
        cpu_reserved=cpu_res,
        ram_total=physical_memory(),
        cuda_available=available,
        cuda_reason=None if available else _cuda_reason(),
        cuda_devices=tuple(devices),
        nvml=None if available else nvml_query(0),
    )
