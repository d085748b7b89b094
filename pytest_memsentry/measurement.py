"""What one test's measurement found: per device, the memory left allocated and the peak; the
largest leaked tensors with their holders; and what a second run of the test kept. Plain
values, no torch, no pytest state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memsentry.units import format_bytes
from pytest_memsentry.marks import Limits

#: Leaked tensors listed in a failure's section; the rest are counted.
TOP = 10


@dataclass(frozen=True)
class LeakedTensor:
    """A storage the test created that is still alive after it: its size and device, the
    tensor that holds it (``float32[512, 1024]``) and who holds that tensor (``None`` when
    the holder search did not reach it), the line that created it, and whether that tensor
    carries an autograd graph (``grad_fn``)."""

    bytes: int
    device: str
    tensor: str | None
    holder: str | None
    site: str | None
    grad_fn: bool = False


@dataclass(frozen=True)
class DeviceFigures:
    """One device's figures for one test, in bytes above what was allocated before its setup.

    ``leaked``: still allocated after the test (after its teardown and ``gc.collect()``), less
    what wider-scoped fixtures and one-time imports made. ``peak``: the most allocated at once
    while the test, its fixtures and their teardown ran. ``tensors``: how many storages make up
    ``leaked``. CUDA only: ``driver``, the growth of the device memory the driver reports used;
    ``confirmed``, whether the driver saw the leak too (unconfirmed leaks warn, not fail).
    """

    device: str
    leaked: int
    peak: int
    tensors: int
    driver: int | None = None
    confirmed: bool = True


@dataclass(frozen=True)
class Measurement:
    """Everything measured for one test: per-device figures, the largest leaked tensors (at
    most :data:`TOP`; ``hidden`` more were not listed) and what was left out and why.
    ``heap``: the figures are the heap check's (:mod:`pytest_memsentry.heap`)."""

    devices: tuple[DeviceFigures, ...]
    tensors: tuple[LeakedTensor, ...] = ()
    hidden: int = 0
    hidden_bytes: int = 0
    notes: tuple[str, ...] = ()
    heap: bool = False  # from the heap check: growth of all allocations, no tensors, no peak

    def figures(self, verdict: str) -> dict[str, Any]:
        """The figures carried on the test's report (``user_properties``), plain data so that
        pytest-xdist can ship them to the controller for ``--memsentry-report``."""
        return {
            "verdict": verdict,
            "devices": {d.device: {"leaked": d.leaked, "peak": d.peak} for d in self.devices},
        }


@dataclass(frozen=True)
class Repeat:
    """A flagged test run a second time: per device, the bytes the second run kept beyond
    what the first run had left (``grown``), or why it could not be run again (``error``);
    ``failed`` counts the repeats whose call failed its own checks (they are still judged on
    what they kept)."""

    grown: dict[str, int]
    error: str | None = None
    failed: int = 0

    def failures(self) -> str | None:
        """The clause saying that repeats failed, or ``None`` when none did."""
        if not self.failed:
            return None
        which = "one of its repeats" if self.failed == 1 else f"{self.failed} of its repeats"
        return (f"{which} failed its own checks (a flaky test, or one that depends on state "
                "it changes); what it kept still counts")

    def grows(self, device: str, limits: Limits) -> bool:
        return self.error is None and self.grown.get(device, 0) > limits.max_leak

    def figures(self) -> str:
        if self.error is not None:
            return self.error
        grown = {d: b for d, b in self.grown.items() if b > 0} or {"cpu": 0}
        return ", ".join(f"{format_bytes(b)} more on {d}" for d, b in grown.items())


__all__ = ["TOP", "DeviceFigures", "LeakedTensor", "Measurement", "Repeat"]
