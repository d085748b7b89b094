"""NVML (``pynvml`` from the nvidia-ml-py distribution): what the driver sees of a GPU.

Every call returns a value; a missing library, driver, GPU or permission becomes
``NvmlInfo(available=False, reason=...)``, never an exception.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class NvmlInfo:
    """Driver-side figures of one GPU, or the reason they could not be read."""

    available: bool
    reason: str | None = None
    index: int | None = None
    name: str | None = None
    used: int | None = None
    total: int | None = None
    process_used: int | None = None
    gpu_utilization: int | None = None
    memory_utilization: int | None = None


def _error_text(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text.decode() if isinstance(text, bytes) else text


def _handle_for(pynvml: Any, index: int) -> Any:
    """NVML handle of torch's CUDA device ``index``, found by PCI bus id so that
    ``CUDA_VISIBLE_DEVICES`` renumbering is respected."""
    if torch.cuda.is_available() and index < torch.cuda.device_count():
        props = torch.cuda.get_device_properties(index)
        bus = getattr(props, "pci_bus_id", None)
        if bus is not None:
            domain = getattr(props, "pci_domain_id", 0)
            device = getattr(props, "pci_device_id", 0)
            bus_id = f"{domain:08x}:{bus:02x}:{device:02x}.0"
            try:
                return pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)
            except Exception:
                pass
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def query(index: int = 0) -> NvmlInfo:
    """Read NVML's figures for CUDA device ``index``: used and total memory, this process's
    memory on it, and utilisation. Any failure gives ``available=False`` and the reason."""
    try:
        import pynvml
    except ImportError as exc:
        return NvmlInfo(False, f"the pynvml module is not installed ({_error_text(exc)}); "
                        "pip install nvidia-ml-py")
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        return NvmlInfo(False, f"NVML could not start: {_error_text(exc)}")
    try:
        try:
            handle = _handle_for(pynvml, index)
        except Exception as exc:
            return NvmlInfo(False, f"NVML has no GPU {index}: {_error_text(exc)}")
        values: dict[str, object] = {"available": True, "index": index}
        try:
            name = pynvml.nvmlDeviceGetName(handle)
            values["name"] = name.decode() if isinstance(name, bytes) else name
        except Exception:
            pass
        try:
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            values["used"], values["total"] = int(mem.used), int(mem.total)
        except Exception as exc:
            values["reason"] = f"memory figures unavailable: {_error_text(exc)}"
        try:
            rates = pynvml.nvmlDeviceGetUtilizationRates(handle)
            values["gpu_utilization"] = int(rates.gpu)
            values["memory_utilization"] = int(rates.memory)
        except Exception:
            pass
        values["process_used"] = _process_memory(pynvml, handle)
        return NvmlInfo(**values)  # type: ignore[arg-type]
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _process_memory(pynvml: Any, handle: Any) -> int | None:
    """Device memory NVML attributes to this process, or ``None`` when it will not say."""
    pid = os.getpid()
    for getter in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        func = getattr(pynvml, getter, None)
        if func is None:
            continue
        try:
            for proc in func(handle):
                if proc.pid == pid and proc.usedGpuMemory is not None:
                    return int(proc.usedGpuMemory)
        except Exception:
            continue
    return None
