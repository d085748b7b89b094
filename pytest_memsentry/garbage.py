"""Garbage collection around the heap check's window, at little cost (no torch here).

The heap check reads glibc's heap before a test's setup and after its teardown. Garbage held
in reference cycles must count in neither read: cyclic garbage left before the test (by the
previous test's teardown, say) and freed during it, by the collection before the last read
or by one Python starts on its own, would be subtracted from the test's growth and hide a
leak of the same size; the test's own cyclic garbage would add to it.

A full collection walks every object the collector tracks: with torch and a library such as
torch_geometric imported, 400,000 to 600,000 objects and 0.1 to 0.3 s on a 2-core machine.
Instead, :meth:`Collector.open` collects the young generations and then sets every object
alive aside with ``gc.freeze()``; :meth:`Collector.close` collects, which walks only what
was made during the test and frees the test's own cyclic garbage, and gives the set-aside
objects back with ``gc.unfreeze()``. Nothing made before the test is freed by a collection
inside the window, so both reads see it alike. Garbage among the set-aside objects (a module
fixture with a reference cycle torn down during a test) waits for :meth:`Collector.tidy`,
a full collection between two tests, run when the time since the last one is at least
twenty times what that one cost: at most about 5 % of the session's time.

While a test runs inside the window, ``gc.get_objects()`` and ``gc.get_referrers()`` do not
list the objects made before it (the frozen ones), and a collection does not free them.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

#: The most of the session's time that full collections between tests may take.
TIDY_SHARE = 0.05


class Collector:
    """The session's garbage collections for the heap check (one per plugin instance)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._frozen = False
        self._tidied = clock()
        self._tidy_cost = 0.0

    def open(self) -> None:
        """Before a test's first heap read: free the young garbage and set aside every object
        alive now, so that collections until :meth:`close` walk only what the test makes.
        If something else froze objects (which ``gc.unfreeze()`` would give back too), a full
        collection instead."""
        if gc.get_freeze_count():
            gc.collect()
            return
        gc.collect(1)
        gc.freeze()
        self._frozen = True

    def close(self, *, collect: bool = True) -> None:
        """Before the test's last heap read: free the test's own cyclic garbage (with
        ``collect``), then give back the objects :meth:`open` set aside."""
        if collect:
            gc.collect()
        self.release()

    def release(self) -> None:
        """Give back the set-aside objects without collecting (a test that was not measured)."""
        if self._frozen:
            gc.unfreeze()
            self._frozen = False

    def tidy(self) -> None:
        """Between two tests: a full collection, when the time since the last one is at least
        ``1 / TIDY_SHARE`` times what it cost."""
        now = self._clock()
        if now - self._tidied < self._tidy_cost / TIDY_SHARE:
            return
        gc.collect()
        self._tidied = self._clock()
        self._tidy_cost = self._tidied - now


__all__ = ["TIDY_SHARE", "Collector"]
