"""Any other accelerator through ``torch.accelerator`` (torch 2.6 and newer): XPU, MPS, HPU and
the like, read from the device-generic allocator statistics.

Used for a device whose type is the current accelerator's and that has no dedicated backend
(CUDA has one). Each sample reads the flattened ``memory_stats()`` dict, which costs more
than the CUDA backend's nested read; peaks follow the CUDA rules: the device's peak counter
is never reset unless ``exact=True``.
"""

from __future__ import annotations

from typing import Any

import torch

from memsentry.measure.base import IntervalPeak
from memsentry.model import Measured, PeakMode

_ALLOCATED = "allocated_bytes.all.current"
_RESERVED = "reserved_bytes.all.current"
_PEAK = "allocated_bytes.all.peak"


def accelerator_type() -> str | None:
    """The type of this process's accelerator (``"xpu"``, ``"mps"``, ...), or ``None``."""
    api = getattr(torch, "accelerator", None)
    if api is None or not hasattr(api, "memory_stats"):
        return None
    try:
        current = api.current_accelerator()
    except Exception:
        return None
    return None if current is None else str(current.type)


class AcceleratorBackend:
    """Allocated, reserved and peak bytes of one accelerator device via ``torch.accelerator``."""

    measured = Measured.TENSORS

    def __init__(self, device: torch.device, *, exact: bool = False) -> None:
        api = getattr(torch, "accelerator", None)
        if api is None or accelerator_type() != device.type:
            raise RuntimeError(f"{device.type} is not this process's accelerator")
        self._api = api
        index = device.index if device.index is not None else api.current_device_index()
        self.device = torch.device(device.type, index)
        self._index = index
        self.name = f"{device.type}-accelerator"
        self.peak_mode = PeakMode.EXACT if exact else PeakMode.SAMPLED
        self.notes: tuple[str, ...] = (
            f"{device.type} figures come from torch.accelerator.memory_stats(); "
            + ("its peak counter was reset at every hook (exact peaks)." if exact
               else "its peak counter was read, never reset."),
        )
        self._peak = IntervalPeak(int(self._stats().get(_PEAK, 0)),
                                  lambda: api.reset_peak_memory_stats(index), exact=exact)

    def _stats(self) -> dict[str, Any]:
        return dict(self._api.memory_stats(self._index))

    def sample(self) -> tuple[int, int | None]:
        stats = self._stats()
        return int(stats.get(_ALLOCATED, 0)), self._peak.read(int(stats.get(_PEAK, 0)))

    def allocated(self) -> int:
        return int(self._stats().get(_ALLOCATED, 0))

    def reserved(self) -> int | None:
        value = self._stats().get(_RESERVED)
        return None if value is None else int(value)

    def peak_since_last_read(self) -> int | None:
        return self._peak.read(int(self._stats().get(_PEAK, 0)))

    def total_memory(self) -> int | None:
        info = getattr(self._api, "get_memory_info", None)
        if info is None:
            return None
        try:
            return int(info(self._index)[1])
        except Exception:
            return None

    def stats(self) -> dict[str, Any]:
        return self._stats()

    def start(self) -> None:
        return None

    def stop(self) -> None:
        return None
