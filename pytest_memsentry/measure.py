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
from collections.abc import Iterator
from typing import Any, Protocol

import pytest
import torch

from memsentry.census import Root, find_holders
from memsentry.measure.allocators import support
from memsentry.measure.peaks import CUDA_PEAKS, Account, allocated_peak
from memsentry.measure.storage import StorageCounter
from memsentry.model import HeldTensor, HolderKind, Location, Scope, ScopeKind, Step, StepKind
from memsentry.units import format_bytes
from memsentry.usercode.lines import short_path
from pytest_memsentry.cycles import kept_by_autograd
from pytest_memsentry.marks import Limits
from pytest_memsentry.results import (
    TOP,
    DeviceFigures,
    LeakedTensor,
    Measurement,
    plural,
)
from pytest_memsentry.threads import ThreadWatch

#: Seconds the holder search may take for all the listed tensors of one test together.
HOLDER_BUDGET = 1.0
#: Leaked storages, largest first, whose holders are searched for (those named are listed).
SEARCHED = 500
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


# -- who holds it ----------------------------------------------------------------------------
def _fixture_label(argname: str, scope: str) -> str:
    for prefix, name in _XUNIT.items():
        if argname.startswith(prefix):
            return f"{name} ({scope} scope)"
    return f"fixture {argname!r} ({scope} scope)"


def _wider_fixtures(item: pytest.Item) -> Iterator[tuple[str, str, Any]]:
    """(name, scope, value) of the item's fixtures wider than function scope that are still
    set up. Reads pytest's private fixture state, defensively."""
    try:
        definitions = item._fixtureinfo.name2fixturedefs  # type: ignore[attr-defined]
        for name, defs in definitions.items():
            fixturedef = defs[-1]
            cached = fixturedef.cached_result
            if fixturedef.scope != "function" and cached is not None and cached[2] is None:
                yield name, fixturedef.scope, cached[0]
    except Exception:
        return


def _root(*names: str) -> tuple[Step, ...]:
    return (Step(StepKind.ROOT, names[0]), *(Step(StepKind.ATTRIBUTE, n) for n in names[1:]))


def holder_roots(item: pytest.Item) -> list[Root]:
    """Where to look for what a test left behind, named as the test file spells it: the test
    instance (pytest keeps it until the session ends), the test class's attributes, the test
    module's globals and the wider-scoped fixtures still set up."""
    roots: list[Root] = []
    instance = getattr(item, "instance", None)
    if instance is not None:
        roots.append((_root("self"), instance, HolderKind.TEST_INSTANCE, None))
    cls = getattr(item, "cls", None)
    if cls is not None:
        scope = Scope(ScopeKind.CLASS, cls.__qualname__)
        for name, value in list(vars(cls).items()):
            if not name.startswith("__"):
                roots.append((_root(cls.__qualname__, name), value, HolderKind.CLASS_ATTRIBUTE,
                              scope))
    module = getattr(item, "module", None)
    path = getattr(module, "__file__", None)
    if module is not None:
        scope = Scope(ScopeKind.SCRIPT, short_path(path)) if path \
            else Scope(ScopeKind.MODULE, module.__name__)
        for name, value in list(vars(module).items()):
            if not name.startswith("__"):
                roots.append((_root(name), value, HolderKind.GLOBAL, scope))
    for name, fixture_scope, value in _wider_fixtures(item):
        roots.append((_root(f"fixture {name!r}"), value, HolderKind.FIXTURE,
                      Scope(ScopeKind.FIXTURE, fixture_scope)))
    return roots


def _describe(held: HeldTensor) -> tuple[str, str]:
    tensor = f"{held.dtype}[{', '.join(map(str, held.shape))}]"
    if held.kind == HolderKind.TEST_INSTANCE:
        where = "test instance; pytest keeps it until the session ends"
    elif held.kind == HolderKind.FIXTURE:
        where = f"{held.scope} fixture"
    elif held.kind == HolderKind.GLOBAL and held.scope:
        where = f"global in {held.scope.name}"
    else:
        where = str(held.kind)
    return tensor, f"{held.name} ({where})"


# -- one test --------------------------------------------------------------------------------
class Window:
    """The measurement of one test, from before its setup (:meth:`start`) to after its
    teardown (:meth:`finish`); the plugin calls :meth:`fixture_starting` and
    :meth:`fixture_done` around every wider-scoped fixture set up in between.

    ``fixture_growth`` is the session's record of what each wider-scoped fixture added on each
    CUDA device when it was set up (kept across tests by the plugin).
    """

    def __init__(self, cuda: CudaApi, fixture_growth: dict[Any, dict[int, int]], *,
                 sites: bool = True) -> None:
        self._sites = sites  # the line of each storage (for the table of a failed test)
        self._cuda = cuda
        self._fixture_growth = fixture_growth
        self._counter: StorageCounter | None = None
        self._active = False
        self._modules: set[str] = set()
        self._cuda_start: dict[int, tuple[int, int]] = {}
        self._alive_fixtures: set[Any] = set()
        self._new_fixtures: set[Any] = set()
        self._stack: list[tuple[set[int], dict[int, int], dict[int, int]]] = []
        self._owned: dict[int, str] = {}  # storage pointer -> the fixture that made it
        self._kept: dict[int, int] = {}  # CPU storages left behind -> bytes, after finish()
        self._threads: ThreadWatch | None = None

    def start(self) -> None:
        """Before setup: note the modules imported, settle and read CUDA, start counting."""
        self._modules = set(sys.modules)
        if self._cuda.ready():
            gc.collect()
            devices = self._cuda.devices()
            self._cuda.settle(devices)
            for device in devices:
                self._cuda_start[device] = (self._cuda.allocated(device),
                                            self._cuda.driver_used(device))
                self._cuda.reset_peak(device)
            self._alive_fixtures = {f for f in self._fixture_growth if _alive(f)}
        self._counter = StorageCounter(sites=self._sites, other_devices=bool(self._cuda_start))
        self._counter.__enter__()
        self._threads = ThreadWatch(self._counter)
        self._active = True

    def _stop(self) -> None:
        if self._active and self._counter is not None:
            self._active = False
            self._counter.__exit__(None, None, None)
            if self._threads is not None:
                self._threads.stop()

    def abort(self) -> None:
        """Stop counting without measuring (a skipped test, an interrupted run)."""
        self._stop()

    def _live(self) -> dict[int, tuple[str, int, Location | None]]:
        counter = self._counter
        assert counter is not None
        live = {p: ("cpu", size, (counter.sites or {}).get(p))
                for p, size in list(counter.live.items())}
        live.update(counter.device_live or {})
        return live

    # -- wider-scoped fixtures ---------------------------------------------------------------
    def fixture_starting(self) -> None:
        cuda = {d: self._cuda.allocated(d) for d in self._cuda_start}
        self._stack.append((set(self._live()), cuda, {d: 0 for d in cuda}))

    def fixture_done(self, fixturedef: Any) -> None:
        if not self._stack:
            return
        before, cuda, inner = self._stack.pop()
        label = _fixture_label(fixturedef.argname, fixturedef.scope)
        for pointer in set(self._live()) - before:
            self._owned.setdefault(pointer, label)  # nested fixtures claimed theirs first
        total = {d: self._cuda.allocated(d) - cuda[d] for d in cuda}
        if self._stack:
            for device, grown in total.items():
                self._stack[-1][2][device] += grown
        if cuda:
            self._fixture_growth[fixturedef] = {d: total[d] - inner[d] for d in cuda}
            self._new_fixtures.add(fixturedef)

    # -- after teardown ----------------------------------------------------------------------
    def still_kept(self) -> int:
        """Bytes of the CPU storages :meth:`finish` counted as left behind that are still
        alive now (a second run of the test may have replaced them)."""
        counter = self._counter
        assert counter is not None
        live = counter.live
        return sum(size for pointer, size in self._kept.items() if pointer in live)

    def finish(self, item: pytest.Item, limits: Limits, *, judged: bool,
               holders: bool = True) -> Measurement:
        """After teardown: the figures, and for a judged test over its limit (with
        ``holders``), the largest leaked tensors with their holders. A test that is not
        judged (it failed) gets raw figures only: its traceback keeps its frames alive, so
        there is nothing to search."""
        self._stop()
        counter = self._counter
        assert counter is not None
        live = self._live()
        if judged and any(p not in self._owned for p in live):
            gc.collect()  # what only reference cycles kept is not a leak
            live = self._live()
        notes: list[str] = []
        owned = [(p, v) for p, v in live.items() if p in self._owned]
        for label in sorted({self._owned[p] for p, _v in owned}):
            mine = [v for p, v in owned if self._owned[p] == label]
            notes.append(f"not counted: {format_bytes(sum(v[1] for v in mine))} "
                         f"({plural(len(mine), 'tensor')}) made by {label} while it was set "
                         "up: the fixture keeps it until its scope ends")
        candidates = {p: v for p, v in live.items() if p not in self._owned}
        imported = self._imported_files()
        once = {p: v for p, v in candidates.items() if v[2] is not None and v[2].file in imported}
        if once:
            notes.append(f"not counted: {format_bytes(sum(v[1] for v in once.values()))} "
                         f"({plural(len(once), 'tensor')}) made by modules first imported "
                         "during the test (a one-time initialisation)")
            candidates = {p: v for p, v in candidates.items() if p not in once}
        self._kept = {p: v[1] for p, v in candidates.items() if v[0] == "cpu"}
        devices = [DeviceFigures(
            "cpu", sum(v[1] for v in candidates.values() if v[0] == "cpu"), counter.peak,
            sum(1 for v in candidates.values() if v[0] == "cpu"),
        )]
        if self._cuda_start:
            adjust = self._cuda_adjustment(once)
            devices += self._cuda_figures(candidates, adjust, limits, judged=judged)
        if not (judged and holders) or not any(d.leaked > limits.max_leak for d in devices):
            return Measurement(tuple(devices), notes=tuple(notes))
        over = {d.device for d in devices if d.leaked > limits.max_leak}
        ranked = sorted(((p, v) for p, v in candidates.items() if v[0] in over),
                        key=lambda pv: -pv[1][1])
        # One search for the largest SEARCHED storages; the listing shows those it named
        # first, so that a small tensor a global keeps (a loss history) is not hidden behind
        # the larger ones its graph saved.
        searched = ranked[:SEARCHED]
        found, complete = find_holders({p for p, _v in searched}, holder_roots(item),
                                       budget=HOLDER_BUDGET)
        held = {h.storage: h for h in found}
        order = sorted(range(len(searched)), key=lambda i: searched[i][0] not in held)
        shown = [searched[i] for i in order[:TOP]]
        shown_pointers = {p for p, _v in shown}
        tensors: list[LeakedTensor] = []
        unreached = []
        for pointer, (device, size, site) in shown:
            holder = held.get(pointer)
            tensor, name = _describe(holder) if holder else (None, None)
            if holder is None:
                unreached.append(len(tensors))
            tensors.append(LeakedTensor(size, device, tensor, name,
                                        str(site) if site is not None else None,
                                        grad_fn=holder is not None and holder.grad_fn))
        if unreached:
            tensors = kept_by_autograd(tensors, unreached, [p for p, _v in shown])
        if not complete:
            notes.append(f"the holder search stopped after {HOLDER_BUDGET:g} s: some holders "
                         "may be missing")
        ranked = shown + [pv for pv in ranked if pv[0] not in shown_pointers]
        hidden = ranked[TOP:]
        return Measurement(tuple(devices), tuple(tensors), len(hidden),
                           sum(v[1] for _p, v in hidden), tuple(notes))

    def _imported_files(self) -> set[str]:
        files = set()
        for name in set(sys.modules) - self._modules:
            path = getattr(sys.modules.get(name), "__file__", None)
            if isinstance(path, str):
                files.add(short_path(path))
        return files

    def _cuda_adjustment(self, once: dict[int, tuple[str, int, Location | None]]) -> dict[int, int]:
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
        for device_name, size, _site in once.values():
            index = torch.device(device_name).index
            if index is not None and index in adjust:
                adjust[index] += size
        return adjust

    def _cuda_figures(self, candidates: dict[int, tuple[str, int, Location | None]],
                      adjust: dict[int, int], limits: Limits, *,
                      judged: bool) -> list[DeviceFigures]:
        cuda = self._cuda
        if not cuda.ready():
            return []
        present = set(cuda.devices())
        devices = [d for d in self._cuda_start if d in present]
        figures = []
        for device in devices:
            allocated_before, driver_before = self._cuda_start[device]
            peak = max(0, cuda.peak(device) - allocated_before)
            leaked = cuda.allocated(device) - allocated_before - adjust[device]
            driver = None
            if judged and leaked > limits.max_leak:
                for _read in range(CUDA_READS):
                    gc.collect()
                    cuda.settle([device])
                    leaked = cuda.allocated(device) - allocated_before - adjust[device]
                    driver = cuda.driver_used(device) - driver_before - adjust[device]
                    if leaked <= limits.max_leak and driver <= limits.max_leak:
                        break  # it was transient
            name = f"cuda:{device}"
            figures.append(DeviceFigures(
                name, max(0, leaked), peak,
                sum(1 for v in candidates.values() if v[0] == name),
                driver=driver if leaked > limits.max_leak else None,
                confirmed=driver is None or driver > limits.max_leak,
            ))
        return figures


def _alive(fixturedef: Any) -> bool:
    try:
        return fixturedef.cached_result is not None
    except Exception:
        return False


__all__ = ["CudaApi", "TorchCuda", "Window", "holder_roots", "warm_up"]
