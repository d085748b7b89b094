"""One fake of NVML as nvidia-ml-py's pynvml serves it, for the tests that run without a GPU
(the fakes of torch's own CUDA are in tests/fake_cuda.py).

It follows pynvml: ``nvmlDeviceGetHandleByUUID`` takes a GPU's ``GPU-<hex>`` or a MIG
device's ``MIG-<hex>`` and returns its handle, refusing any other name with ``NVMLError``
("Not Found"), as NVML does; ``nvmlDeviceGetHandleByPciBusId`` finds whole GPUs only (a bus
id names the board); a MIG device handle's memory is the slice's and its utilisation is not
supported; ``nvmlDeviceIsMigDeviceHandle`` returns a ctypes ``c_uint``;
``nvmlDeviceGetMigMode`` returns the current and pending modes; a process's
``usedGpuMemory`` is ``None`` where NVML gives NVML_VALUE_NOT_AVAILABLE. NVML counts the
memory of a process on a device as the driver does: what the caching allocator reserved plus
the CUDA context and the libraries' own memory.
"""

from __future__ import annotations

import ctypes
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class NVMLError(Exception):
    pass


def _read(figure: Any) -> Any:
    return figure() if callable(figure) else figure


@dataclass
class Gpu:
    """One NVML device: a whole GPU or a MIG slice (``is_mig``) of one. ``used`` and each of
    ``processes`` (pid: bytes, ``None`` where NVML does not say) is a number or a callable
    read at each call (memory that changes while a loop runs); ``utilization`` is the GPU's
    and its memory's busy percentages."""

    uuid: str
    name: str
    total: int
    used: int | Callable[[], int]
    bus_id: str | None = None
    processes: dict[int, int | Callable[[], int] | None] = field(default_factory=dict)
    mig_mode: int = 0
    slices: list[Gpu] = field(default_factory=list)
    is_mig: bool = False
    utilization: tuple[int, int] = (40, 25)


def fake_pynvml(gpus: list[Gpu]) -> types.ModuleType:
    """pynvml over ``gpus`` in NVML's (PCI) order, their MIG slices found by UUID;
    ``by_index`` records each index asked of ``nvmlDeviceGetHandleByIndex``."""
    nvml = types.ModuleType("pynvml")
    every = [*gpus, *(part for gpu in gpus for part in gpu.slices)]
    by_index: list[int] = []

    def find(match: Callable[[Gpu], bool]) -> Gpu:
        for gpu in every:
            if match(gpu):
                return gpu
        raise NVMLError("Not Found")

    def by_index_(index: int) -> Gpu:
        by_index.append(index)
        if not 0 <= index < len(gpus):
            raise NVMLError("Invalid Argument")
        return gpus[index]

    def memory(gpu: Gpu) -> Any:
        used = _read(gpu.used)
        return types.SimpleNamespace(used=used, total=gpu.total, free=gpu.total - used)

    def utilisation(gpu: Gpu) -> Any:
        if gpu.is_mig:
            raise NVMLError("Not Supported")
        return types.SimpleNamespace(gpu=gpu.utilization[0], memory=gpu.utilization[1])

    functions: dict[str, Any] = {
        "nvmlInit": lambda: None, "nvmlShutdown": lambda: None,
        "nvmlDeviceGetCount": lambda: len(gpus),
        "nvmlDeviceGetHandleByIndex": by_index_,
        "nvmlDeviceGetHandleByUUID": lambda uuid: find(lambda g: g.uuid == uuid),
        "nvmlDeviceGetHandleByPciBusId": lambda bus: find(
            lambda g: not g.is_mig and g.bus_id == bus.lower()),
        "nvmlDeviceGetUUID": lambda gpu: gpu.uuid,
        "nvmlDeviceGetName": lambda gpu: gpu.name,
        "nvmlDeviceGetMemoryInfo": memory,
        "nvmlDeviceGetUtilizationRates": utilisation,
        "nvmlDeviceGetComputeRunningProcesses": lambda gpu: [
            types.SimpleNamespace(pid=pid, usedGpuMemory=_read(used))
            for pid, used in gpu.processes.items()],
        "nvmlDeviceGetMigMode": lambda gpu: [gpu.mig_mode, gpu.mig_mode],
        "nvmlDeviceIsMigDeviceHandle": lambda gpu: ctypes.c_uint(int(gpu.is_mig)),
        "NVMLError": NVMLError, "NVML_DEVICE_MIG_ENABLE": 1, "by_index": by_index,
    }
    for name, value in functions.items():
        setattr(nvml, name, value)
    return nvml
