"""The default first look at a test: how much glibc's heap in use grew from before its setup to
after its teardown. Two ``mallinfo2()`` reads a test, nothing on the test's own ops.

Both reads come after a garbage collection, and nothing made before the test is freed by
one in between (:class:`pytest_memsentry.garbage.Collector`): collecting only at the end
would subtract cyclic garbage left before the test from its growth, and hide a leak of the
same size.

The heap counts every C allocation of the process: CPU tensor storages, and also pytest's
reports, captured output and the caches libraries fill on first use. So growth is only a
suspicion, never a verdict. A test whose heap grew by more than :data:`TRIGGER` (or its
``max_leak``) is run again when every test has run (at once under ``--maxfail``), first
reading the heap only (growth on the first run alone passes without a word: nothing names
a tensor), then with its tensor storages counted one by one
(:class:`pytest_memsentry.measure.Window`), and judged on those runs. A test leaking less
than that per run is not seen by this check; ``--memsentry-strict`` counts storages on every
test's first run.

What wider-scoped fixtures allocate while they are set up during this test's setup is theirs,
as in the exact window.
"""

from __future__ import annotations

from typing import Any

import pytest

from memsentry.measure.cpu import MALLINFO2_UNAVAILABLE, MallinfoBackend
from memsentry.units import format_bytes
from pytest_memsentry.garbage import Collector
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

    def __init__(self, collector: Collector) -> None:
        self._heap = MallinfoBackend()
        self._collector = collector
        self._start = 0
        self._fixtures = 0  # what wider-scoped fixtures allocated while they were set up
        self._stack: list[int] = []

    def start(self) -> None:
        self._collector.open()  # until finish(), collections free only what the test made
        self._start = self._heap.allocated()

    def abort(self) -> None:
        self._collector.release()

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
        ``gc.collect()``, as at :meth:`start`), else nothing."""
        trigger = max(limits.max_leak, TRIGGER)
        self._collector.close()
        grown = self.grown()
        self._collector.tidy()  # garbage older than the test, outside its window
        if grown <= trigger:
            return Measurement((DeviceFigures("cpu", 0, 0, 0),), heap=True)
        note = (f"the process's heap grew by {format_bytes(grown)} over the test (glibc "
                "mallinfo2(), every allocation), more than the "
                f"{format_bytes(trigger)} that starts a closer look: run again with its "
                "tensor storages counted")
        return Measurement((DeviceFigures("cpu", grown, 0, 0),), notes=(note,), heap=True)

    def still_kept(self) -> int:
        return 0
