"""Measuring one test: what it leaves allocated on the CPU and on CUDA, and who holds it.

Imported only when a checked test starts and torch is already imported (this module imports
torch and memsentry).

CPU: a storage-counting dispatch mode (``memsentry.measure.storage.StorageCounter``) is active from
before the test's setup to after its teardown; afterwards it holds the storages made in that
window that are still alive, their bytes and the line that made each (where CUDA is
initialised, the CUDA storages too, so that a CUDA leak can name its tensors).

CUDA, once PyTorch initialised CUDA (a test that initialises it is not checked there: the
context is a one-time cost): the caching allocator's allocated bytes and the driver's used
memory before setup and after teardown, per device, re-read up to three times after
``gc.collect()``, synchronising and emptying the cache, as PyTorch's own
``CudaMemoryLeakCheck`` does. A leak fails only when both the allocator and the driver show it.

What does not count as the test's leak:

- memory ``gc.collect()`` frees (garbage reference cycles);
- memory made while a wider-scoped fixture (class, module, package, session; xunit
  ``setup_module``/``setup_class`` too) was set up during this test's setup: it belongs to the
  fixture, which keeps it on purpose until its scope ends, not to the first test that used it.
  The rule is by creation, not by holder: a tensor the test itself made and put into a
  session fixture's list is the test's leak, and is reported as held by that fixture;
- memory made by code of a module first imported during the test (a one-time initialisation),
  and on CUDA the context a test creates;
- on CUDA, memory a wider-scoped fixture releases at this test's teardown is added back, so it
  cannot hide a leak (the figure is what the fixture's set-up added, measured when it ran).
"""

from __future__ import annotations

import functools
import gc
import sys
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import pytest
import torch

from memsentry.measure.allocators import support
from memsentry.measure.peaks import CUDA_PEAKS, Account, allocated_peak
from memsentry.measure.storage import StorageCounter
from memsentry.usercode.lines import short_path
from pytest_memsentry.garbage import Collector
from pytest_memsentry.holders import list_leaked, search_notes
from pytest_memsentry.marks import Limits
from pytest_memsentry.results import DeviceFigures, Measurement
from pytest_memsentry.storages import (
    CPU,
    Accounting,
    LiveStorage,
    Storages,
    account,
    cpu_figures,
    on_device,
    over_limit,
)
from pytest_memsentry.threads import ThreadWatch

#: Reads of the allocator and the driver before a CUDA leak is believed (PyTorch's count).
CUDA_READS = 3
_XUNIT = {"_xunit_setup_module_fixture_": "setup_module", "_xunit_setup_class_fixture_":
          "setup_class", "_unittest_setUpClass_fixture_": "setUpClass"}


# -- CUDA ------------------------------------------------------------------------------------
class CudaApi(Protocol):
    """The few CUDA calls the plugin makes (``TorchCuda``; the tests give a fake)."""

    def ready(self) -> bool: ...
    def devices(self) -> list[int]: ...
    def allocated(self, device: int) -> int: ...
    def driver_used(self, device: int) -> int: ...
    def peak(self, device: int) -> int: ...
    def reset_peak(self, device: int) -> None: ...
    def settle(self, devices: list[int]) -> None: ...


class TorchCuda:
    """``torch.cuda``: never initialises CUDA, nor a device's context. The peak is reset
    before each test through :data:`memsentry.measure.peaks.CUDA_PEAKS`, so the peaks the
    tests themselves read (``torch.cuda.max_memory_allocated()``, their own resets) are as
    without the plugin. A pluggable allocator, whose statistics torch refuses, is not
    measured."""

    def __init__(self) -> None:
        self._accounts: dict[int, Account] = {}

    def ready(self) -> bool:
        return torch.cuda.is_initialized() and support().counters

    def devices(self) -> list[int]:
        """Devices with a CUDA context (querying another would create one, ~300 MiB)."""
        has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)
        if has_context is None:
            return [torch.cuda.current_device()]
        return [d for d in range(torch.cuda.device_count()) if has_context(d)]

    def allocated(self, device: int) -> int:
        return torch.cuda.memory_allocated(device)

    def driver_used(self, device: int) -> int:
        free, total = torch.cuda.mem_get_info(device)
        return total - free

    def peak(self, device: int) -> int:
        """The highest allocated since :meth:`reset_peak`, whoever reset the counter since."""
        reader = CUDA_PEAKS.reader()
        peak = allocated_peak(reader(device)) if reader is not None else 0
        account = self._accounts.get(device)
        return account.high(peak) if account is not None else peak

    def reset_peak(self, device: int) -> None:
        account = self._accounts.get(device)
        if account is None:
            account = self._accounts[device] = CUDA_PEAKS.join(device)
        CUDA_PEAKS.restart(device, account)

    def settle(self, devices: list[int]) -> None:
        """Finish pending work, drop cuBLAS workspaces (not the test's memory) and return the
        allocator's free blocks to the driver."""
        for device in devices:
            torch.cuda.synchronize(device)
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            clear_workspaces()
        torch.cuda.empty_cache()


# -- counting storages -----------------------------------------------------------------------
@functools.cache
def warm_up() -> None:
    """Run one op under each counter, once per process and outside any test: the first op
    under a dispatch mode imports ``torch._dynamo`` (about a second), a one-time cost that is
    no test's time or memory."""
    for counter in (StorageCounter(), StorageCounter(sites=True, other_devices=True)):
        with counter:
            torch.zeros(1).add_(1)


# -- wider-scoped fixtures -------------------------------------------------------------------
def _fixture_label(argname: str, scope: str) -> str:
    for prefix, name in _XUNIT.items():
        if argname.startswith(prefix):
            return f"{name} ({scope} scope)"
    return f"fixture {argname!r} ({scope} scope)"


@dataclass
class _FixtureSetUp:
    """A wider-scoped fixture being set up: the storages alive before it, each CUDA device's
    allocated bytes before it, and what the fixtures it set up in turn added on each device
    (theirs, not its own)."""

    before: set[int]
    cuda: dict[int, int]
    inner: dict[int, int]


class CudaStart(NamedTuple):
    """One CUDA device read before the test's setup: the allocator's allocated bytes and the
    driver's used memory."""

    allocated: int
    driver: int


class CudaReading(NamedTuple):
    """A CUDA device's growth over the test: the allocator's (``leaked``) and, when it was
    read again to confirm a leak, the driver's (``driver``)."""

    leaked: int
    driver: int | None


# -- one test --------------------------------------------------------------------------------
class Window:
    """The measurement of one test, from before its setup (:meth:`start`) to after its
    teardown (:meth:`finish`); the plugin calls :meth:`fixture_starting` and
    :meth:`fixture_done` around every wider-scoped fixture set up in between.

    ``fixture_growth`` is the session's record of what each wider-scoped fixture added on each
    CUDA device when it was set up (kept across tests by the plugin). ``collector`` (the
    plugin's, shared by every test) sets the
    objects alive before the test aside while it runs, as for the heap check
    (:class:`pytest_memsentry.garbage.Collector`), so that the collection after its teardown
    walks only what the test made: a full one took about a second a test in a process with
    pyro and scipy imported.
    """

    def __init__(self, cuda: CudaApi, fixture_growth: dict[Any, dict[int, int]], *,
                 collector: Collector, sites: bool = True) -> None:
        self._sites = sites  # the line of each storage (for the table of a failed test)
        self._collector = collector
        self._cuda = cuda
        self._fixture_growth = fixture_growth
        self._counter: StorageCounter | None = None
        self._active = False
        self._modules: set[str] = set()
        self._cuda_start: dict[int, CudaStart] = {}
        self._alive_fixtures: set[Any] = set()
        self._new_fixtures: set[Any] = set()
        self._stack: list[_FixtureSetUp] = []
        self._owned: dict[int, str] = {}  # storage pointer -> the fixture that made it
        self._kept: dict[int, int] = {}  # CPU storages left behind -> bytes, after finish()
        self._threads: ThreadWatch | None = None

    def start(self) -> None:
        """Before setup: set the objects alive aside, note the modules imported, settle and
        read CUDA, start counting."""
        self._collector.open()
        self._modules = set(sys.modules)
        if self._cuda.ready():
            self._read_cuda_start()
        self._counter = StorageCounter(sites=self._sites, other_devices=bool(self._cuda_start))
        self._counter.__enter__()
        self._threads = ThreadWatch(self._counter)
        self._active = True

    def _read_cuda_start(self) -> None:
        """Settle CUDA, read each device with a context and restart its peak; note the
        wider-scoped fixtures still set up."""
        gc.collect()
        devices = self._cuda.devices()
        self._cuda.settle(devices)
        for device in devices:
            self._cuda_start[device] = CudaStart(self._cuda.allocated(device),
                                                 self._cuda.driver_used(device))
            self._cuda.reset_peak(device)
        self._alive_fixtures = {f for f in self._fixture_growth if _alive(f)}

    def _stop(self) -> None:
        if self._active and self._counter is not None:
            self._active = False
            self._counter.__exit__(None, None, None)
            if self._threads is not None:
                self._threads.stop()

    def abort(self) -> None:
        """Stop counting without measuring (a skipped test, an interrupted run)."""
        self._stop()
        self._collector.release()

    def _counted(self) -> StorageCounter:
        counter = self._counter
        assert counter is not None
        return counter

    def _live(self) -> dict[int, LiveStorage]:
        """The storages made since :meth:`start` that are still alive: the CPU's, then the
        other devices'."""
        counter = self._counted()
        sites = counter.sites or {}
        live = {pointer: LiveStorage(CPU, size, sites.get(pointer))
                for pointer, size in list(counter.live.items())}
        live.update((pointer, LiveStorage(*entry))
                    for pointer, entry in counter.device_sites.items())
        return live

    def _live_pointers(self) -> set[int]:
        counter = self._counted()
        return set(counter.live) | set(counter.device_live or {})

    # -- wider-scoped fixtures ---------------------------------------------------------------
    def fixture_starting(self) -> None:
        cuda = {d: self._cuda.allocated(d) for d in self._cuda_start}
        self._stack.append(_FixtureSetUp(self._live_pointers(), cuda, {d: 0 for d in cuda}))

    def fixture_done(self, fixturedef: Any) -> None:
        if not self._stack:
            return
        setup = self._stack.pop()
        label = _fixture_label(fixturedef.argname, fixturedef.scope)
        for pointer in self._live_pointers() - setup.before:
            self._owned.setdefault(pointer, label)  # nested fixtures claimed theirs first
        total = {d: self._cuda.allocated(d) - setup.cuda[d] for d in setup.cuda}
        if self._stack:
            for device, grown in total.items():
                self._stack[-1].inner[device] += grown
        if setup.cuda:
            self._fixture_growth[fixturedef] = {d: total[d] - setup.inner[d] for d in setup.cuda}
            self._new_fixtures.add(fixturedef)

    # -- after teardown ----------------------------------------------------------------------
    def still_kept(self) -> int:
        """Bytes of the CPU storages :meth:`finish` counted as left behind that are still
        alive now (a second run of the test may have replaced them)."""
        live = self._counted().live
        return sum(size for pointer, size in self._kept.items() if pointer in live)

    def finish(self, item: pytest.Item, limits: Limits, *, judged: bool,
               holders: bool = True) -> Measurement:
        """After teardown: the figures, and for a judged test over its limit (with
        ``holders``), the largest leaked tensors with their holders. A test that is not
        judged (it failed) gets raw figures only: its traceback keeps its frames alive, so
        there is nothing to search."""
        self._stop()
        try:
            live = self._settled_live(judged=judged)
        finally:
            self._collector.release()  # the holder search must see every object
        self._collector.tidy()  # garbage older than the test, outside its window
        accounting = account(live, self._owned, self._imported_files())
        candidates = accounting.candidates
        self._kept = {p: s.nbytes for p, s in on_device(candidates, CPU).items()}
        devices = self._figures(accounting, limits, judged=judged)
        over = over_limit(devices, limits)
        if not (judged and holders and over):
            return Measurement(tuple(devices), notes=tuple(accounting.notes))
        listing = list_leaked(item, candidates, over)
        notes = (*accounting.notes, *search_notes(listing))
        return Measurement(tuple(devices), listing.tensors, listing.hidden,
                           listing.hidden_bytes, notes)

    def _settled_live(self, *, judged: bool) -> dict[int, LiveStorage]:
        """What is still alive after teardown; for a judged test that left storages no
        wider-scoped fixture made, after ``gc.collect()`` (what only reference cycles kept
        is not a leak; the objects set aside at :meth:`start` are not walked)."""
        live = self._live()
        if judged and any(p not in self._owned for p in live):
            gc.collect()
            live = self._live()
        return live

    def _figures(self, accounting: Accounting, limits: Limits, *,
                 judged: bool) -> list[DeviceFigures]:
        """The CPU's figures, then each CUDA device's (when CUDA was read at the start)."""
        devices = [cpu_figures(accounting.candidates, self._counted().peak)]
        if self._cuda_start:
            adjust = self._cuda_adjustment(accounting.once)
            devices += self._cuda_figures(accounting.candidates, adjust, limits, judged=judged)
        return devices

    def _imported_files(self) -> set[str]:
        files = set()
        for name in set(sys.modules) - self._modules:
            path = getattr(sys.modules.get(name), "__file__", None)
            if isinstance(path, str):
                files.add(short_path(path))
        return files

    def _cuda_adjustment(self, once: Storages) -> dict[int, int]:
        """Bytes per CUDA device the test is not answerable for: what wider-scoped fixtures set
        up in this test still hold and what first imports made (minus), and what
        wider-scoped fixtures set up before it released at its teardown (plus)."""
        adjust = dict.fromkeys(self._cuda_start, 0)
        for fixturedef in self._new_fixtures:
            if _alive(fixturedef):
                for device, grown in self._fixture_growth.get(fixturedef, {}).items():
                    adjust[device] = adjust.get(device, 0) + grown
            else:  # set up and torn down within this test: its memory came and went
                self._fixture_growth.pop(fixturedef, None)
        for fixturedef in self._alive_fixtures - self._new_fixtures:
            if not _alive(fixturedef):
                for device, grown in self._fixture_growth.pop(fixturedef, {}).items():
                    adjust[device] = adjust.get(device, 0) - grown
        for storage in once.values():
            index = torch.device(storage.device).index
            if index is not None and index in adjust:
                adjust[index] += storage.nbytes
        return adjust

    def _cuda_figures(self, candidates: Storages, adjust: dict[int, int], limits: Limits, *,
                      judged: bool) -> list[DeviceFigures]:
        """The figures of each CUDA device read at the start that still has a context."""
        if not self._cuda.ready():
            return []
        present = set(self._cuda.devices())
        return [self._device_figures(device, candidates, adjust[device], limits, judged=judged)
                for device in self._cuda_start if device in present]

    def _device_figures(self, device: int, candidates: Storages, adjust: int, limits: Limits,
                        *, judged: bool) -> DeviceFigures:
        """One CUDA device's figures; a judged leak is read again (:meth:`_confirm`)."""
        before = self._cuda_start[device]
        peak = max(0, self._cuda.peak(device) - before.allocated)
        reading = CudaReading(self._cuda.allocated(device) - before.allocated - adjust, None)
        if judged and reading.leaked > limits.max_leak:
            reading = self._confirm(device, adjust, limits, reading)
        name = f"cuda:{device}"
        leaking = reading.leaked > limits.max_leak
        return DeviceFigures(
            name, max(0, reading.leaked), peak, len(on_device(candidates, name)),
            driver=reading.driver if leaking else None,
            confirmed=reading.driver is None or reading.driver > limits.max_leak,
        )

    def _confirm(self, device: int, adjust: int, limits: Limits, first: CudaReading
                 ) -> CudaReading:
        """Read the allocator and the driver again, up to :data:`CUDA_READS` times after
        ``gc.collect()`` and settling, until neither shows a leak (it was transient)."""
        before = self._cuda_start[device]
        reading = first
        for _read in range(CUDA_READS):
            gc.collect()
            self._cuda.settle([device])
            leaked = self._cuda.allocated(device) - before.allocated - adjust
            driver = self._cuda.driver_used(device) - before.driver - adjust
            reading = CudaReading(leaked, driver)
            if leaked <= limits.max_leak and driver <= limits.max_leak:
                break
        return reading


def _alive(fixturedef: Any) -> bool:
    try:
        return fixturedef.cached_result is not None
    except Exception:
        return False


__all__ = ["CudaApi", "TorchCuda", "Window", "warm_up"]
