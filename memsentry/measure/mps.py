"""MPS memory from ``torch.mps``'s own counters, where ``torch.accelerator`` refuses it.

On torch releases whose MPS allocator is not yet a device allocator,
``torch.accelerator.memory_stats()`` fails an internal assert (see
:mod:`memsentry.measure.accelerator`). torch/mps/__init__.py has two counters of its own
there: ``current_allocated_memory()``, the memory occupied by tensors (without the blocks
cached in the MPS allocator's pools), and ``driver_allocated_memory()``, all the Metal driver
allocated for the process (the pools' cached blocks and the MPS/MPSGraph frameworks' own
allocations included). memsentry reads the first as allocated and the second as reserved.
Neither keeps a peak, so peaks are the samples taken at hooks. A refusal of either, when
tracking starts or later in a hook, makes the backend measure nothing from then on and say
why; it never reaches the user's code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from memsentry.measure.accelerator import refused_note
from memsentry.measure.base import Passive, first_sentence
from memsentry.model import Measured, PeakMode

_COUNTERS = ("current_allocated_memory", "driver_allocated_memory")


def _counters() -> tuple[Callable[[], int], Callable[[], int]] | None:
    """``torch.mps``'s two counters, or ``None`` where this torch lacks either."""
    allocated, driver = (getattr(getattr(torch, "mps", None), name, None) for name in _COUNTERS)
    if not callable(allocated) or not callable(driver):
        return None
    return allocated, driver


def _counters_note(refusal: str, exact: bool) -> str:
    note = (
        "mps figures come from torch.mps.current_allocated_memory() (tensors) and "
        "driver_allocated_memory() (everything the Metal driver holds for this process, "
        "shown as reserved): torch refused torch.accelerator.memory_stats() on mps "
        f"({refusal}). torch.mps keeps no peak counter, so peaks are the samples taken at "
        "hooks (lower bounds)")
    return note + (", even with exact=True." if exact else ".")


class MpsBackend(Passive):
    """Allocated and driver-held bytes of the MPS device from ``torch.mps``, for a torch
    whose ``torch.accelerator`` refused them (``refusal``: its words).

    Where ``torch.mps`` lacks the counters or refuses them, the backend measures nothing
    and says why, as :class:`~memsentry.measure.accelerator.AcceleratorBackend` does."""

    measured = Measured.TENSORS
    peak_mode = PeakMode.SAMPLED

    def __init__(self, device: torch.device, refusal: str, *, exact: bool = False) -> None:
        self.device = torch.device("mps", device.index or 0)
        self.name = "mps-counters"
        self.notes: tuple[str, ...] = (_counters_note(refusal, exact),)
        self._accelerator_refusal = refusal
        self._counters = _counters()
        if self._counters is None:
            self._step_aside("this torch has no torch.mps.current_allocated_memory() and "
                             "driver_allocated_memory()")
        self._read()

    def _step_aside(self, why: str) -> None:
        self._counters = None
        self.notes = (refused_note(self.device, f"torch.accelerator: "
                                   f"{self._accelerator_refusal}; torch.mps: {why}"),)

    def _read(self) -> tuple[int, int | None]:
        """(allocated, held by the driver); ``(0, None)`` once refused."""
        if self._counters is None:
            return 0, None
        allocated, driver = self._counters
        try:
            return int(allocated()), int(driver())
        except Exception as error:  # torch refused: the loop must not see it
            self._step_aside(first_sentence(error))
            return 0, None

    def sample(self) -> tuple[int, int | None]:
        return self._read()[0], None

    def allocated(self) -> int:
        return self._read()[0]

    def reserved(self) -> int | None:
        return self._read()[1]

    def peak_since_last_read(self) -> int | None:
        return None

    def total_memory(self) -> int | None:
        return None

    def stats(self) -> dict[str, Any]:
        allocated, driver = self._read()
        if driver is None:
            return {}
        return {"current_allocated_memory": allocated, "driver_allocated_memory": driver}
