"""``gc.collect()`` before and after every test, at little cost (no torch here).

The heap check reads glibc's heap before a test's setup and after its teardown. Garbage held
in reference cycles must be freed before both reads: cyclic garbage left by the previous
test's teardown and freed during this test (by the collection after it, or by one Python
starts on its own) would otherwise be subtracted from this test's growth and hide a leak
of the same size.

A full collection walks every object the collector tracks: with torch and a library such as
kornia imported, about 400,000 objects and 200 to 300 ms on a 2-core machine, each time. So
the first collection of a session is followed by ``gc.freeze()``: the objects alive then
(modules, classes, functions, the collected test items) move to the collector's permanent
generation, and every later collection walks only what was made since, about 1 ms a test on
the same machine. ``gc.unfreeze()`` at the end of the session gives them back. The cost of
the freeze: an object alive before the first checked test that later becomes garbage in a
reference cycle is freed only after the session (a module dropped from ``sys.modules``, for
instance); objects made during the tests are collected as usual.
"""

from __future__ import annotations

import gc


class Collector:
    """The session's garbage collections for the heap check (one per plugin instance)."""

    def __init__(self) -> None:
        self._frozen = False
        self._thaw = False  # whether release() unfreezes (nobody had frozen objects before us)

    def collect(self) -> None:
        """Free what only reference cycles keep; the first call freezes what survives."""
        gc.collect()
        if not self._frozen:
            self._thaw = gc.get_freeze_count() == 0
            gc.freeze()
            self._frozen = True

    def release(self) -> None:
        """Unfreeze the objects frozen by the first :meth:`collect` (at the session's end)."""
        if self._frozen and self._thaw:
            gc.unfreeze()
        self._frozen = False


__all__ = ["Collector"]
