"""One set of peak counters, two readers: memsentry's iterations and the program's own reads.

torch's allocators keep one high-water mark per statistic: c10/core/CachingDeviceAllocator.h
(``Stat::increase`` raises ``peak`` to ``current``, ``reset_peak`` brings it back down to
``current``), and c10/cuda/CUDACachingAllocator.cpp's ``DeviceCachingAllocator::resetPeakStats``
resets the peak of every statistic of every pool at once: there is no reset of one peak.
memsentry needs each iteration's true peak, which only a reset at the iteration's start gives;
the program needs the peaks it would read without memsentry (``max_memory_allocated()``, the
``.peak`` entries of ``memory_stats()``, ``memory_summary()``) and its own resets.

So each reset, memsentry's or the program's, is preceded by a fold of what the counters held
into the accounts of everyone that reset would rob:

- the *program's account* of a device keeps, per statistic, the highest peak memsentry's
  resets hid. The program reads the counters through torch's Python functions
  (torch/cuda/memory.py's ``memory_stats_as_nested_dict`` calls ``torch._C._cuda_memoryStats``,
  torch/accelerator/memory.py's ``memory_stats`` calls ``torch._C._accelerator_getDeviceStats``),
  so those two bindings are wrapped: each ``peak`` they return is raised to the kept one. The
  program's own reset (``_cuda_resetPeakMemoryStats``, ``_accelerator_resetPeakStats``) empties
  its account, as it would have emptied the counters;
- each memsentry reader (a tracker's backend) has an :class:`Account` holding the highest
  allocated bytes a reset by someone else (the program, another tracker) hid from it since its
  own last reset: its interval's peak is the larger of the counter and that.

While tracking runs, and afterwards for as long as the program's account keeps a peak higher
than the counters know, the wrappers stay in place (a read costs a walk of about thirty small
dicts); once nothing is kept and no tracker reads the device, torch's bindings are put back.
Exceptions from torch's calls reach the program as they are. A peak another thread makes
between memsentry's read and its reset is kept by neither: memsentry reads just before it
resets, on its own thread.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

#: A statistic's place in torch's nested statistics: ("allocated_bytes", "all"),
#: ("oversize_allocations",).
Path = tuple[str, ...]


class Account:
    """One memsentry reader of a device's counters: ``hidden`` is the highest allocated bytes a
    reset by someone else hid since this reader last reset them."""

    __slots__ = ("hidden",)

    def __init__(self) -> None:
        self.hidden = 0

    def high(self, counter: int) -> int:
        """This reader's peak, given the allocated bytes' peak counter reads ``counter``."""
        return counter if counter >= self.hidden else self.hidden


def peaks_in(stats: dict[str, Any]) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Each statistic of torch's nested statistics that has a ``peak``, with its path: a
    statistic by pool (``{"allocated_bytes": {"all": {...}}}``) or alone
    (``{"oversize_allocations": {...}}``), the two depths torch/csrc/cuda/Module.cpp nests."""
    for key, value in stats.items():
        if type(value) is not dict:
            continue
        if "peak" in value:
            yield (key,), value
            continue
        for pool, stat in value.items():
            if type(stat) is dict and "peak" in stat:
                yield (key, pool), stat


def allocated_peak(stats: dict[str, Any]) -> int:
    """The peak of allocated bytes in torch's nested statistics (0 where absent)."""
    return int(stats.get("allocated_bytes", {}).get("all", {}).get("peak", 0))


class _Device:
    """What is kept for one device: the program's highest peaks, and memsentry's readers."""

    def __init__(self) -> None:
        self.kept: dict[Path, int] = {}
        self.accounts: list[Account] = []


class _Binding:
    """A pair of torch bindings that read and reset one allocator's counters."""

    def __init__(self, read: str, reset: str) -> None:
        self.read_name, self.reset_name = read, reset
        self.read: Callable[..., Any] | None = None  # torch's own, while wrapped
        self.reset: Callable[..., Any] | None = None
        self.read_wrapper: Callable[..., Any] | None = None
        self.reset_wrapper: Callable[..., Any] | None = None

    def wrapped(self) -> bool:
        current = getattr(torch._C, self.read_name, None)
        return current is not None and current is self.read_wrapper

    def originals(self) -> tuple[Callable[..., Any] | None, Callable[..., Any] | None]:
        """torch's own read and reset, wrapped or not (``None`` where torch has none)."""
        if self.wrapped():
            return self.read, self.reset
        return getattr(torch._C, self.read_name, None), getattr(torch._C, self.reset_name, None)


class PeakKeeper:
    """The peak counters of one device type's allocator, shared by the program and memsentry
    (``bindings``: the torch bindings that read and reset them, by name)."""

    def __init__(self, *bindings: tuple[str, str]) -> None:
        self._bindings = [_Binding(read, reset) for read, reset in bindings]
        self._devices: dict[int, _Device] = {}
        self._lock = threading.RLock()

    # -- memsentry's side ---------------------------------------------------------------------
    def join(self, index: int) -> Account:
        """A reader's account on device ``index``; the program's reads are wrapped from now on."""
        with self._lock:
            self._wrap()
            account = Account()
            self._devices.setdefault(index, _Device()).accounts.append(account)
            return account

    def leave(self, index: int, account: Account) -> None:
        """The reader is done; torch's bindings are put back once nothing needs them."""
        with self._lock:
            device = self._devices.get(index)
            if device is not None and account in device.accounts:
                device.accounts.remove(account)
            self._unwrap_when_idle()

    def reader(self) -> Callable[[int], dict[str, Any]] | None:
        """torch's own statistics call (unwrapped), for memsentry's reads."""
        return self._bindings[0].originals()[0]

    def restart(self, index: int, account: Account) -> dict[str, Any]:
        """Reset device ``index``'s peaks for ``account``, after folding what they held into
        everyone else's accounts; returns the statistics read just before (torch's refusal
        propagates)."""
        with self._lock:
            self._wrap()  # a test or library may have replaced torch's bindings since
            binding = self._bindings[0]
            read, reset = binding.originals()
            if read is None or reset is None:
                raise RuntimeError(f"this torch has no torch._C.{binding.read_name} and "
                                   f"{binding.reset_name}")
            stats = read(index)
            device = self._devices.setdefault(index, _Device())
            self._fold(device, stats, spare=account)
            reset(index)
            account.hidden = 0
            return stats

    # -- the program's side -------------------------------------------------------------------
    def _program_read(self, binding: _Binding, device: Any, *args: Any, **kwargs: Any) -> Any:
        assert binding.read is not None
        stats = binding.read(device, *args, **kwargs)
        kept = self._devices.get(device) if isinstance(device, int) else None
        if kept is not None and kept.kept and isinstance(stats, dict):
            with self._lock:
                for path, stat in peaks_in(stats):
                    high = kept.kept.get(path)
                    if high is not None and high > stat["peak"]:
                        stat["peak"] = high
        return stats

    def _program_reset(self, binding: _Binding, device: Any, *args: Any, **kwargs: Any) -> Any:
        assert binding.read is not None and binding.reset is not None
        with self._lock:
            kept = self._devices.get(device) if isinstance(device, int) else None
            if kept is not None and kept.accounts:
                try:
                    self._fold(kept, binding.read(device), spare=None, program=False)
                except Exception:  # torch refuses the read: its reset will say why
                    pass
            result = binding.reset(device, *args, **kwargs)
            if kept is not None:
                kept.kept.clear()
            self._unwrap_when_idle()
            return result

    # -- both ---------------------------------------------------------------------------------
    @staticmethod
    def _fold(device: _Device, stats: dict[str, Any], *, spare: Account | None,
              program: bool = True) -> None:
        """What the counters hold, kept for the program (``program``) and for every reader
        but ``spare``."""
        if program:
            kept = device.kept
            for path, stat in peaks_in(stats):
                peak = int(stat["peak"])
                if peak > kept.get(path, -1):
                    kept[path] = peak
        peak = allocated_peak(stats)
        for account in device.accounts:
            if account is not spare and peak > account.hidden:
                account.hidden = peak

    def _wrap(self) -> None:
        for binding in self._bindings:
            read = getattr(torch._C, binding.read_name, None)
            reset = getattr(torch._C, binding.reset_name, None)
            if read is None or reset is None or binding.wrapped():
                continue
            # torch's bindings, or a replacement made since memsentry's last wrap: what was
            # kept belonged to the counters behind the old ones.
            for device in self._devices.values():
                device.kept.clear()
            binding.read, binding.reset = read, reset
            binding.read_wrapper = functools.wraps(read)(
                functools.partial(self._program_read, binding))
            binding.reset_wrapper = functools.wraps(reset)(
                functools.partial(self._program_reset, binding))
            setattr(torch._C, binding.read_name, binding.read_wrapper)
            setattr(torch._C, binding.reset_name, binding.reset_wrapper)

    def _unwrap_when_idle(self) -> None:
        if any(device.kept or device.accounts for device in self._devices.values()):
            return
        for binding in self._bindings:
            if binding.wrapped():
                setattr(torch._C, binding.read_name, binding.read)
                setattr(torch._C, binding.reset_name, binding.reset)
            binding.read = binding.reset = binding.read_wrapper = binding.reset_wrapper = None
        self._devices.clear()


#: CUDA's caching allocator, as ``torch.cuda`` reads it and as ``torch.accelerator`` does on a
#: CUDA machine (torch/csrc/DeviceAccelerator.cpp serves the current accelerator's allocator:
#: the same counters).
CUDA_PEAKS = PeakKeeper(("_cuda_memoryStats", "_cuda_resetPeakMemoryStats"),
                        ("_accelerator_getDeviceStats", "_accelerator_resetPeakStats"))
