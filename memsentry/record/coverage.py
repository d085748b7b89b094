"""Which module calls are measured: every call while that is cheap, a rotating share of the
layers once measuring every call would cost more than its share of the loop's time.

Measuring a call costs a few microseconds of Python in its hooks, a backend read at each of
its boundaries (glibc ``mallinfo2()`` walks every free chunk of the heap, so on a fragmented
heap one read takes 100 us and more) and the saved-tensor and backward hooks of its ops. On a
model of thousands of small modules, or once the heap fragments, that is many times the step.
So the time memsentry spends inside the hooks of measured calls is clocked, and at the end
of each iteration the number of layers measured in the next one is set so that this time
stays within ``overhead`` of the loop's own time. The layers measured move on by that many
each iteration, so every layer keeps being measured for the whole run, each in fewer calls.

Layers are numbered in first-call order (``LayerRecord.index``). A layer is measured in an
iteration when its number falls in that iteration's window; the first iterations measure
every call, so every layer has figures from the start.
"""

from __future__ import annotations

import math
import time

from memsentry.record.budget import DISPATCH, HOOKS, Budget

__all__ = ["DISPATCH", "FLOOR", "FULL_FIRST", "OVERHEAD", "Coverage", "coverage_notes"]
from memsentry.record.layers import LayerRegistry
from memsentry.settings import OVERHEAD

#: Own time per iteration (seconds) that never makes the window shrink, whatever the share:
#: a loop of small steps is measured in full.
FLOOR = 2e-3
#: Iterations measured in full before the window may shrink.
FULL_FIRST = 3


class Coverage:
    """The window of measured layers, and the clock of the time spent measuring them.

    ``overhead`` is the share of the loop's time measuring may take (``None``: no limit).
    Hooks add to ``own`` the seconds they spent on measured calls, and count every call they
    saw in ``calls``; :meth:`end_iteration` sets the next window from them.
    """

    def __init__(self, overhead: float | None, budget: Budget | None = None) -> None:
        self.overhead = overhead
        self.budget = budget if budget is not None else Budget(overhead)
        self.layers = 0  # layers known (numbered 0 .. layers - 1)
        self.size = math.inf  # layers measured per iteration
        self.offset = 0  # the first layer of the window
        self.own = 0.0
        self.calls = 0
        self.since: int | None = None  # the first iteration measured in part
        self.busiest: tuple[float, float] | None = None  # (own cost, loop time) that shrank it
        self.narrowest = math.inf
        # Iterations that ran module calls with part of the layers in the window (the run
        # may end before any: then no note). The calls of layers outside it are not counted:
        # those layers' hooks are off (:mod:`memsentry.record.hooks`).
        self.thinned = 0

    @property
    def full(self) -> bool:
        return self.size >= self.layers and not self.budget.light

    @property
    def light(self) -> bool:
        """Whether the running iteration is light (:mod:`memsentry.record.budget`): no layer
        it already knows is measured, only its boundaries."""
        return self.budget.light

    def measures(self, index: int, first: bool = False) -> bool:
        """Whether the call of layer ``index`` is measured in this iteration; ``first``: no
        call of that layer was measured yet (an iteration that overdrew still measures it)."""
        if index >= self.layers:
            return True  # a layer first seen in this iteration is measured
        if self.budget.light or (not first and self.budget.overdrawn()):
            return False
        return self.size >= self.layers or (index - self.offset) % self.layers < self.size

    def reads_parts(self, index: int) -> bool:
        """Whether an iteration whose outermost call is of layer ``index`` reads the parts:
        when that call is measured; in the first iterations, always (they stop measuring
        calls past their share, not reading the parts)."""
        return self.measures(index, self.budget.first)

    def window(self) -> set[int] | None:
        """The layers measured in this iteration (``None``: all)."""
        if self.budget.light:
            return set()
        if self.size >= self.layers:
            return None
        return {(self.offset + k) % self.layers for k in range(int(self.size))}

    def count(self, started: float, part: str = HOOKS) -> None:
        """A hook that began at ``started`` (``time.perf_counter()``) measured a call."""
        spent = time.perf_counter() - started
        self.own += spent
        self.budget.charge(part, spent, 0)

    def aside(self, started: float) -> None:
        """A hook that began at ``started`` only counted a call (nothing measured)."""
        self.budget.charge(HOOKS, time.perf_counter() - started, 0)

    def merged(self, into: int) -> None:
        """The iterations after ``into`` were merged into it (a stronger boundary came: the
        calls a model made before the first optimizer step): the iteration whose cost
        narrowed the measuring is gone, and measuring in turn began within ``into``."""
        if self.since is not None and self.since > into:
            self.since = into
            self.busiest = None

    def end_iteration(self, index: int, seconds: float, layers: int) -> None:
        """Iteration ``index`` ended after ``seconds``; ``layers`` layers are known now.
        Sets the window of the next iteration: its size in proportion to the time left in
        the budget (at most doubling at once), its start moved past this iteration's."""
        own = self.own + DISPATCH * self.calls
        self.budget.charge(HOOKS, DISPATCH * self.calls, self.calls)
        was_full = self.size >= self.layers
        if self.calls and not was_full and not self.budget.light:
            self.thinned += 1
        self.own, self.calls = 0.0, 0
        current = float(layers) if was_full else self.size
        self.layers = layers
        if self.overhead is None or index + 1 < FULL_FIRST or layers == 0 or self.budget.light:
            return  # a light iteration measured nothing to judge the window by
        loop = max(seconds - own, 1e-9)
        allowed = max(self.overhead * loop, FLOOR)
        if was_full and own <= allowed:
            return
        size = math.floor(current * min(2.0, allowed / own if own > 0 else 2.0))
        if size >= layers:
            self.size, self.offset = math.inf, 0
            return
        size = max(1, size)
        if was_full:
            self.since = index + 1
            self.busiest = (own, loop)
            self.offset = 0
        else:
            self.offset = (self.offset + int(current)) % layers
        self.size = size
        self.narrowest = min(self.narrowest, size)


def coverage_notes(coverage: Coverage, registry: LayerRegistry) -> list[str]:
    """What the report says when layers were measured in turn (nothing when every call was)."""
    if coverage.since is None or not coverage.thinned:
        return []
    measured = [r for r in registry.records.values() if r.calls]
    fewest = min(measured, key=lambda r: (r.measured, r.index)) if measured else None
    share = f"{coverage.overhead:.0%}" if coverage.overhead is not None else "no limit"
    detail = (f" The least measured layer, `{fewest.name}`, was measured in {fewest.measured} "
              "calls." if fewest is not None else "")
    if coverage.busiest is not None:
        own, loop = coverage.busiest
        why = (
            f"Measuring every layer call took {own * 1e3:.1f} ms in iteration "
            f"{coverage.since - 1}, {own / loop:.0%} of that iteration's {loop * 1e3:.1f} ms of "
            f"the loop's own work (the limit is {share}, track(overhead=...); the iterations "
            f"table's durations include memsentry's work). From iteration {coverage.since} "
        )
    else:  # the iteration that narrowed it was merged into a later one
        why = (
            f"Measuring every layer call took more than {share} of the loop's own work "
            f"(track(overhead=...)). From iteration {coverage.since} "
        )
    return [
        f"{why}memsentry measured the layers "
        f"in turn, as few as {int(coverage.narrowest)} of {coverage.layers} an iteration, so "
        "each layer's figures come from some of its calls (the iterations table still has "
        f"every boundary).{detail} track(overhead=None) measures every call."
    ]
