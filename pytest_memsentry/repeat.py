"""Telling growth from memory retained once: a test that left memory behind is run twice more
when every test has run, and judged on what the last run kept beyond the one before. Both
runs count tensor storages. When the first look at the test was the heap check, a run that
reads the heap only comes first: a test whose heap grew on its first run only (a cache
filled on first use, torch's own one-time set-up of an op) stops there and passes without a
line, since the heap names no tensor that a person could look for. Otherwise the first counted
run gives the figures and the holders the verdict shows.

A test that overwrites state on every call (``model.last = x``) or fills a cache on first use
keeps memory after its first run but no more after the next: retained once. A test that
appends to a global, a class attribute or a session fixture keeps more each time: growth.
Both repeats keep the fixtures of wider scope set up between them (they are torn down as if a
sibling test came next), so a session fixture's list grows as it would between two tests;
they are torn down afterwards. Repeating at the end of the session keeps the repeats' side
effects away from every other test.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import pytest
from _pytest.runner import runtestprotocol

from pytest_memsentry.marks import Limits
from pytest_memsentry.results import Measurement, Repeat, leaking

if TYPE_CHECKING:
    from pytest_memsentry.garbage import Collector
    from pytest_memsentry.heap import HeapCheck
    from pytest_memsentry.measure import CudaApi, Window


@dataclass
class Pending:
    """A test that passed but left memory behind: its first measurement and its reports,
    whose verdict waits for the repeats."""

    item: pytest.Item
    limits: Limits
    measurement: Measurement
    reports: list[pytest.TestReport]
    target: pytest.TestReport


class Rerun(NamedTuple):
    """One more run of the test: its window (which still counts what that run kept) and its
    measurement."""

    window: Window | HeapCheck
    measurement: Measurement
    failed: bool = False


class Measuring(Protocol):
    """What the repeats need from the plugin: the CUDA calls, the fixtures' CUDA record, the
    window that wider-scoped fixtures set up during a run report to, and the session's garbage
    collections (for the heap check)."""

    collector: Collector
    cuda: CudaApi | None
    fixture_growth: dict[object, dict[int, int]]
    window: Window | HeapCheck | None


def _window(plugin: Measuring, *, holders: bool, heap: bool) -> Window | HeapCheck:
    """A new window for one more run: the heap check with ``heap``, else storages counted
    (with the line of each with ``holders``)."""
    from pytest_memsentry.heap import HeapCheck
    from pytest_memsentry.measure import TorchCuda, Window, warm_up

    if heap:
        return HeapCheck(plugin.collector)
    warm_up()
    # Only the run whose figures the verdict shows needs each storage's line: without
    # it an op costs about a third less.
    return Window(plugin.cuda or TorchCuda(), plugin.fixture_growth, sites=holders,
                  collector=plugin.collector)


#: The hooks a repeat must not call: what reports a result (a subtest's too: pytest's
#: unittest support and its ``subtests`` fixture report each subtest through the item's hook
#: proxy, not through ``runtestprotocol``'s ``log``) or stops the run to debug it.
SILENCED = frozenset({"pytest_runtest_logreport", "pytest_exception_interact"})


class QuietHooks:
    """A node's hook proxy that passes every hook through but those of :data:`SILENCED`,
    which do nothing: a repeat is not a test the terminal, junit-xml, xdist's controller or
    the subtests' counts may hear of."""

    def __init__(self, hooks: Any) -> None:
        self._hooks = hooks

    def __getattr__(self, name: str) -> Any:
        if name in SILENCED:
            return _nothing
        return getattr(self._hooks, name)


def _nothing(**_kwargs: Any) -> list[Any]:
    return []


@contextlib.contextmanager
def _quiet(item: pytest.Item) -> Iterator[None]:
    """While a repeat of ``item`` runs, every node's hook proxy (``item.ihook``, read through
    ``session.gethookproxy``) is quiet (:class:`QuietHooks`), and the count of the item's
    failed subtests that pytest keeps (it fails a test that passed but has one) is left as
    the test's own run set it."""
    session = item.session
    proxy = session.gethookproxy

    def quiet(path: Any) -> Any:
        return QuietHooks(proxy(path))

    session.gethookproxy = quiet  # type: ignore[method-assign,assignment]
    failed = _failed_subtests(item.config)
    key = getattr(item, "id", item.nodeid)  # pytest 9 keys it by the structured node id
    before = failed.get(key) if failed is not None else None
    try:
        yield
    finally:
        del session.gethookproxy  # the class's method again
        if failed is not None:
            failed.pop(key, None)
            if before is not None:
                failed[key] = before


def _failed_subtests(config: pytest.Config) -> dict[Any, int] | None:
    """pytest's count of failed subtests by test id (pytest 9's built-in subtests keep it in
    the config's stash under a private key), or ``None`` where there is none."""
    try:
        from _pytest.subtests import failed_subtests_key
    except ImportError:  # an older pytest: subtests come from a plugin, or not at all
        return None
    counts = config.stash.get(failed_subtests_key, None)
    return counts if isinstance(counts, dict) else None


def _protocol(entry: Pending, plugin: Measuring, window: Window | HeapCheck
              ) -> list[pytest.TestReport]:
    """Run the test's protocol once more with ``window`` as the plugin's window, heard by no
    reporter."""
    plugin.window = window
    try:
        # Torn down as if the next test were a sibling: the function's fixtures go, those of
        # the class, module and session stay for the next run.
        with _quiet(entry.item):
            return runtestprotocol(entry.item,
                                   nextitem=entry.item.parent,  # type: ignore[arg-type]
                                   log=False)
    except BaseException:
        window.abort()
        raise
    finally:
        plugin.window = None


def _not_rerun(reports: list[pytest.TestReport]) -> str | None:
    """Why the run does not count (its setup or teardown failed, or it was skipped), or
    ``None``: a call that failed still counts."""
    bad = next((r for r in reports if (r.failed and r.when != "call") or r.skipped), None)
    return None if bad is None else f"its {bad.when} {bad.outcome} when it was run again"


def _forget_last_failure() -> None:
    """A test that asserts on the state it grows (``assert len(history) == 4``) fails when it
    is repeated; what it kept still counts. pytest keeps the failure's traceback (and with
    it the test's frames) in ``sys.last_*``: dropped first, so those frames are not counted."""
    for name in ("last_exc", "last_value", "last_traceback", "last_type"):
        if hasattr(sys, name):
            setattr(sys, name, None)


def _run(entry: Pending, plugin: Measuring, *, holders: bool = False, heap: bool = False
         ) -> Rerun | str:
    """One more run of the test, its storages counted (with ``heap``, only the heap's growth
    read); or why it could not be."""
    window = _window(plugin, holders=holders, heap=heap)
    try:
        window.start()
    except Exception as error:
        window.abort()
        return f"measuring it failed: {error!r}"
    reports = _protocol(entry, plugin, window)
    reason = _not_rerun(reports)
    if reason is not None:
        window.abort()
        return reason
    _forget_last_failure()
    failed = any(r.failed and r.when == "call" for r in reports)
    return Rerun(window, window.finish(entry.item, entry.limits, judged=True, holders=holders),
                 failed)


def run_twice(entry: Pending, plugin: Measuring) -> Repeat:
    """Run the test twice more; per device, what the second of those kept beyond the first
    (on the CPU, storages the first kept and the second freed count against it). The
    fixtures the runs kept set up are torn down afterwards."""
    try:
        return _twice(entry, plugin)
    finally:
        tear_down(entry.item.session)


def _twice(entry: Pending, plugin: Measuring) -> Repeat:
    heap = entry.measurement.heap
    if heap:  # first a second look at the heap, at no cost to the test's ops
        settled = _heap_again(entry, plugin)
        if settled is not None:
            return settled
    first = _run(entry, plugin, holders=heap)
    if isinstance(first, str):
        return Repeat({}, first)
    before = first.measurement
    if heap:  # the heap check only suspected it: the verdict is on counted storages
        entry.measurement = replace(before, notes=(*entry.measurement.notes, *before.notes))
    second = _run(entry, plugin)
    if isinstance(second, str):
        return Repeat({}, second)
    return Repeat(growth(before, second.measurement, first.window.still_kept()),
                  failed=first.failed + second.failed)


def _heap_again(entry: Pending, plugin: Measuring) -> Repeat | None:
    """A second look at the heap only: the verdict when it settles the question (it could not
    be run, or the heap grew on the first run only), else ``None``."""
    again = _run(entry, plugin, heap=True)
    if isinstance(again, str):
        return Repeat({}, again)
    if not leaking(again.measurement, entry.limits):
        return Repeat({"cpu": 0})  # the heap grew on the first run only
    return None


def growth(before: Measurement, after: Measurement, still_kept: int) -> dict[str, int]:
    """Per device, what the run measured in ``after`` kept beyond the one measured in
    ``before``: on the CPU, what the second run left less the part of what the first run left
    that the second freed (``still_kept``: the bytes of the first run's storages still alive);
    on CUDA the allocator's figure, already the net change."""
    left = {f.device: f.leaked for f in before.devices}
    grown = {}
    for figures in after.devices:
        if figures.device == "cpu":
            grown["cpu"] = figures.leaked - (left.get("cpu", 0) - still_kept)
        else:
            grown[figures.device] = figures.leaked
    return grown


def tear_down(session: pytest.Session) -> None:
    """Tear down the fixtures the repeats kept set up (pytest's own call, private state)."""
    state = getattr(session, "_setupstate", None)
    if state is not None:
        state.teardown_exact(None)


__all__ = ["Pending", "run_twice", "tear_down"]
