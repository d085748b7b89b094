"""The GPUs in the text report: NVML's view of the tracked device (a whole GPU or a MIG slice)
and, when the program held memory on more than one device, a line for each."""

from __future__ import annotations

from typing import Any

from memsentry.model import DeviceMemory, ReportData
from memsentry.units import format_bytes


def _nvml_bytes(nvml: dict[str, Any], key: str) -> str:
    """A figure of NVML's free-form record: ``-`` where it is absent or not a number."""
    value = nvml.get(key)
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return format_bytes(value if ok else None)


def nvml_line(nvml: dict[str, Any]) -> str:
    """``NVML: device used 3.0 GiB of 80 GiB, this process 2.5 GiB, GPU utilisation 40%``;
    ``MIG slice`` in place of ``device`` when the figures are a slice's."""
    if not nvml.get("available"):
        return f"NVML: unavailable: {nvml.get('reason')}"
    what = "MIG slice" if nvml.get("mig") is True else "device"
    line = (f"NVML: {what} used {_nvml_bytes(nvml, 'used')} of {_nvml_bytes(nvml, 'total')}, "
            f"this process {_nvml_bytes(nvml, 'process_used')}")
    if nvml.get("gpu_utilization") is not None:
        line += f", GPU utilisation {nvml['gpu_utilization']}%"
    return line


def device_line(device: DeviceMemory) -> str:
    """One device: the allocator's figures, then NVML's (or why there are none)."""
    name = f" ({device.name})" if device.name else ""
    line = (f"{device.device}{name}: allocated {format_bytes(device.allocated)}, reserved "
            f"{format_bytes(device.reserved)}")
    if device.allocator_peak is not None:
        line += f", allocator's all-time peak {format_bytes(device.allocator_peak)}"
    if device.nvml_total is not None:
        what = "MIG slice" if device.mig else "device"
        line += (f"; NVML: {what} used {format_bytes(device.nvml_used)} of "
                 f"{format_bytes(device.nvml_total)}, this process "
                 f"{format_bytes(device.process_used)}")
    elif device.nvml_reason:
        line += f"; NVML: unavailable: {device.nvml_reason}"
    return line


def device_lines(report: ReportData) -> list[str]:
    """A heading and a line per device, when the devices are more than the report's own."""
    devices = report.devices
    if not devices or (len(devices) == 1 and devices[0].device == report.device):
        return []
    return [f"memory on {len(devices)} CUDA device{'s' * (len(devices) != 1)}:",
            *(f"  {device_line(device)}" for device in devices)]


__all__ = ["device_line", "device_lines", "nvml_line"]
