"""The default first look at a test: how much glibc's heap in use grew from before its setup to
after its teardown. Two ``mallinfo2()`` reads a test, nothing on the test's own ops.

The heap counts every C allocation of the process: CPU tensor storages, and also pytest's
reports, captured output and the caches libraries fill on first use. So growth is only a
suspicion. A test whose heap grew by more than :data:`TRIGGER` (or its ``max_leak``) after
``gc.collect()`` is run again when every test has run, with its tensor storages counted one
by one (:class:`pytest_memsentry.measure.Window`), and judged on those runs. A test leaking
less than that per run is not seen by this check; ``--memsentry-strict`` counts storages on
every test's first run.

What wider-scoped fixtures allocate while they are set up during this test's setup is theirs,
as in the exact window.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest

from memsentry.measure.cpu import MALLINFO2_UNAVAILABLE, MallinfoBackend
from memsentry.units import format_bytes
from pytest_memsentry.marks import Limits
from pytest_memsentry.results import DeviceFigures, Measurement

#: Heap growth (bytes) past which a test is run again with its storages counted. Measured
#: on two public suites: 99% of the tests that kept no tensor grew the heap by less.
TRIGGER = 64 * 1024


def available() -> bool:
    """Whether this process has glibc's ``mallinfo2()``."""
    return MALLINFO2_UNAVAILABLE is None


class HeapCheck:
    """One test's heap growth; the plugin calls :meth:`fixture_starting` and
    :meth:`fixture_done` around every wider-scoped fixture set up in between."""

    def __init__(self) -> None:
        self._heap = MallinfoBackend()
        self._start = 0
        self._fixtures = 0  # what wider-scoped fixtures allocated while they were set up
        self._stack: list[int] = []

    def start(self) -> None:
        self._start = self._heap.allocated()

    def abort(self) -> None:
        return None

    def fixture_starting(self) -> None:
        self._stack.append(self._heap.allocated())

    def fixture_done(self, fixturedef: Any) -> None:
        if not self._stack:
            return
        grown = self._heap.allocated() - self._stack.pop()
        if not self._stack:  # nested fixtures are inside their parent's figure
            self._fixtures += grown

    def grown(self) -> int:
        return self._heap.allocated() - self._start - self._fixtures

    def finish(self, item: pytest.Item, limits: Limits, *, judged: bool,
               holders: bool = True) -> Measurement:
        """The heap's growth as the CPU's figure when it passes the trigger (after
        ``gc.collect()``, which frees what only reference cycles kept), else nothing."""
        trigger = max(limits.max_leak, TRIGGER)
        grown = self.grown()
        if judged and grown > trigger:
            gc.collect()
            grown = self.grown()
        if grown <= trigger:
            return Measurement((DeviceFigures("cpu", 0, 0, 0),), heap=True)
        note = (f"the process's heap grew by {format_bytes(grown)} over the test (glibc "
                "mallinfo2(), every allocation), more than the "
                f"{format_bytes(trigger)} that starts a closer look: run again with its "
                "tensor storages counted")
        return Measurement((DeviceFigures("cpu", grown, 0, 0),), notes=(note,), heap=True)

    def still_kept(self) -> int:
        return 0
