"""Any other accelerator through ``torch.accelerator`` (torch 2.6 and newer): XPU, MPS, HPU and
the like, read from the device-generic allocator statistics.

Used for a device whose type is the current accelerator's and that has no dedicated backend
(CUDA has one). Each sample reads the flattened ``memory_stats()`` dict, which costs more
than the CUDA backend's nested read; peaks follow the CUDA rules: the device's peak counters
are never reset unless ``exact=True`` (and then all of them are: ``reset_peak_memory_stats``
resets every peak the device's allocator keeps).

torch may refuse these calls: ``torch.accelerator.memory_stats`` asks
``at::getDeviceAllocator`` for the device's allocator, and c10/core/CachingDeviceAllocator.cpp
(``GetDeviceAllocator``) fails an internal assert, "Allocator for mps is not a
DeviceAllocator", on releases whose MPS allocator is not yet a device allocator. No refusal
reaches the user's code: met when tracking starts or later in a hook, it makes the backend
measure nothing from then on and say why (for MPS, :mod:`memsentry.measure.mps` then reads
``torch.mps``'s own counters where it can).
"""

from __future__ import annotations

from typing import Any

import torch

from memsentry.measure.base import IntervalPeak, Passive, first_sentence
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


def refused_note(device: torch.device, refusal: str) -> str:
    """Why nothing was measured on ``device``: torch refused its memory statistics
    (``refusal``: its words, or what was missing)."""
    return (
        f"Nothing was measured on {device}: torch refused its memory statistics ({refusal}), "
        f"so every figure for {device} here reads 0 and no verdict rests on them. The holder "
        f"censuses still ran. For memory figures, track with a torch whose "
        f"torch.accelerator.memory_stats() serves {device.type}, or track the run on the CPU "
        "(device='cpu').")


def _current_index(api: Any) -> int:
    """The accelerator's current device index; 0 where torch cannot say (an MPS process has
    one device)."""
    try:
        return int(api.current_device_index())
    except Exception:
        return 0


def _peak_note(device_type: str, exact: bool) -> str:
    source = f"{device_type} figures come from torch.accelerator.memory_stats(); "
    if not exact:
        return source + "its peak counters were read, never reset."
    return source + (
        "its peak counters were reset at every hook (exact peaks). "
        "torch.accelerator.reset_peak_memory_stats() resets every peak the allocator keeps, "
        "so torch.accelerator.max_memory_allocated(), max_memory_reserved() and every '.peak' "
        "of memory_stats() now read from memsentry's last sample; track without exact=True "
        "to keep them.")


class AcceleratorBackend(Passive):
    """Allocated, reserved and peak bytes of one accelerator device via ``torch.accelerator``.

    ``refusal`` is torch's words when it refused a call (``None`` while it answers): from
    then on every figure reads 0, the device's memory is not given, and the notes say why."""

    measured = Measured.TENSORS

    def __init__(self, device: torch.device, *, exact: bool = False) -> None:
        api = getattr(torch, "accelerator", None)
        if api is None or accelerator_type() != device.type:
            raise RuntimeError(f"{device.type} is not this process's accelerator")
        self._api = api
        index = device.index if device.index is not None else _current_index(api)
        self.device = torch.device(device.type, index)
        self._index = index
        self.name = f"{device.type}-accelerator"
        self.peak_mode = PeakMode.EXACT if exact else PeakMode.SAMPLED
        self.notes: tuple[str, ...] = (_peak_note(device.type, exact),)
        self.refusal: str | None = None
        self._peak = IntervalPeak(self._read()[1], self._reset_peak, exact=exact)

    def _step_aside(self, error: BaseException) -> None:
        """Measure nothing from now on, and say why."""
        self.refusal = first_sentence(error)
        self.peak_mode = PeakMode.SAMPLED
        self.notes = (refused_note(self.device, self.refusal),)

    def _stats(self) -> dict[str, Any]:
        """The flattened statistics; ``{}`` once torch refused them."""
        if self.refusal is not None:
            return {}
        try:
            return dict(self._api.memory_stats(self._index))
        except Exception as error:  # torch refused: the loop must not see it
            self._step_aside(error)
            return {}

    def _read(self) -> tuple[int, int, int | None]:
        """(allocated, peak allocated, reserved) in one call."""
        stats = self._stats()
        reserved = stats.get(_RESERVED)
        return (int(stats.get(_ALLOCATED, 0)), int(stats.get(_PEAK, 0)),
                None if reserved is None else int(reserved))

    def _reset_peak(self) -> None:
        if self.refusal is not None:
            return
        try:
            self._api.reset_peak_memory_stats(self._index)
        except Exception as error:
            self._step_aside(error)

    def _interval_peak(self, peak: int) -> int | None:
        if self.refusal is not None:
            return None
        found = self._peak.read(peak)
        return None if self.refusal is not None else found

    def sample(self) -> tuple[int, int | None]:
        allocated, peak, _ = self._read()
        return allocated, self._interval_peak(peak)

    def allocated(self) -> int:
        return self._read()[0]

    def reserved(self) -> int | None:
        return self._read()[2]

    def peak_since_last_read(self) -> int | None:
        return self._interval_peak(self._read()[1])

    def total_memory(self) -> int | None:
        info = getattr(self._api, "get_memory_info", None)
        if info is None or self.refusal is not None:
            return None
        try:
            return int(info(self._index)[1])
        except Exception:
            return None

    def stats(self) -> dict[str, Any]:
        return self._stats()
