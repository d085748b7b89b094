"""The CUDA devices a program used, each as its caching allocator and the driver count it: a
model spread over several GPUs is described device by device, not by its first one alone."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceMemory:
    """One CUDA device that held memory when tracking stopped. ``device`` is torch's name of
    it (``cuda:1``); ``allocated`` and ``reserved`` the caching allocator's bytes in tensors and
    held from the driver; ``allocator_peak`` the most the allocator ever had allocated on it,
    since the process began or the program's last ``torch.cuda.reset_peak_memory_stats()`` (not
    this run's peak; ``None`` where the allocator does not count it).

    The rest is NVML's view of the same device, found by its UUID: ``name``; ``nvml_used`` and
    ``nvml_total`` the memory used by every process and the memory there is (a MIG slice's own
    when ``mig``); ``process_used`` what NVML counts for this process (``None`` where it will
    not say, as it may for a MIG slice); ``nvml_reason`` why NVML's figures are missing or
    partial (``None`` when they are all there)."""

    device: str
    allocated: int
    reserved: int
    allocator_peak: int | None = None
    name: str | None = None
    nvml_used: int | None = None
    nvml_total: int | None = None
    process_used: int | None = None
    mig: bool = False
    nvml_reason: str | None = None
