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

from memsentry.record.budget import HOOKS, Budget
from memsentry.record.clock import Clock
from memsentry.record.layers import LayerRegistry
from memsentry.record.policy import Ended, Window, next_window

__all__ = ["Coverage", "coverage_notes"]


class Coverage:
    """The window of measured layers (a :class:`~memsentry.record.policy.Window` the policy
    sets at each boundary), and the clock of the time spent measuring them.

    ``overhead`` is the share of the loop's time measuring may take (``None``: no limit).
    Hooks add to ``own`` the seconds they spent on measured calls, and count every call they
    saw in ``calls``; :meth:`end_iteration` asks the policy for the next window.
    """

    def __init__(self, overhead: float | None, budget: Budget | None = None,
                 clock: Clock = time.perf_counter) -> None:
        self.overhead = overhead
        self.budget = budget if budget is not None else Budget(overhead, clock=clock)
        self.clock = clock
        self.current = Window()
        self.own = 0.0
        self.after = 0.0  # of ``own``: spent at the closing boundary, after the iteration's end
        self.calls = 0
        self.since: int | None = None  # the first iteration measured in part
        self.busiest: tuple[float, float] | None = None  # (own cost, loop time) that shrank it
        self.narrowest = math.inf
        # Iterations that ran module calls with part of the layers in the window (the run
        # may end before any: then no note). The calls of layers outside it are not counted:
        # those layers' hooks are off (:mod:`memsentry.record.hooks`).
        self.thinned = 0

    @property
    def layers(self) -> int:
        """Layers known (numbered 0 .. layers - 1)."""
        return self.current.layers

    @property
    def full(self) -> bool:
        return self.current.full and not self.budget.light

    @property
    def light(self) -> bool:
        """Whether the running iteration is light: no layer it already knows is measured,
        only its boundaries."""
        return self.budget.light

    def measures(self, index: int, overdrawn_too: bool = False) -> bool:
        """Whether the call of layer ``index`` is measured in this iteration;
        ``overdrawn_too``: even when the iteration overdrew the account (a layer no call of
        which was measured yet is)."""
        if index >= self.current.layers:
            return True  # a layer first seen in this iteration is measured
        if self.budget.light or (not overdrawn_too and self.budget.overdrawn()):
            return False
        return self.current.measures(index)

    def reads_parts(self, index: int) -> bool:
        """Whether an iteration whose outermost call is of layer ``index`` reads the parts:
        when that call is measured; in the first iterations, always (they stop measuring
        calls past their share, not reading the parts)."""
        return self.measures(index, self.budget.first)

    def window(self) -> set[int] | None:
        """The layers measured in this iteration (``None``: all)."""
        if self.budget.light:
            return set()
        return self.current.members()

    def count(self, started: float, part: str = HOOKS) -> None:
        """A hook that began at ``started`` (a reading of the clock) measured a call."""
        spent = self.clock() - started
        self.own += spent
        self.budget.charge(part, spent, 0)

    def count_closing(self, started: float, part: str) -> None:
        """Work that began at ``started`` as the iteration closed (reading the parts) was
        charged to it: it comes after the iteration's end, so the iteration's seconds do not
        hold it, and the loop's own time is not what is left of them."""
        before = self.own
        self.count(started, part)
        self.after += self.own - before

    def counted(self, started: float) -> None:
        """A hook that began at ``started`` only counted a call (nothing measured)."""
        self.budget.charge(HOOKS, self.clock() - started, 0)

    def merged(self, into: int) -> None:
        """The iterations after ``into`` were merged into it (a stronger boundary came: the
        calls a model made before the first optimizer step): the iteration whose cost
        narrowed the measuring is gone, and measuring in turn began within ``into``."""
        if self.since is not None and self.since > into:
            self.since = into
            self.busiest = None

    def end_iteration(self, index: int, seconds: float, layers: int) -> None:
        """Iteration ``index`` ended after ``seconds``; ``layers`` layers are known now.
        The policy sets the window of the next iteration (:func:`~memsentry.record.policy.
        next_window`); this keeps what the notes say of it."""
        dispatched = self.budget.unseen.hooked_call * self.calls
        self.budget.charge(HOOKS, dispatched, self.calls)
        was = self.current
        if self.calls and not was.full and not self.budget.light:
            self.thinned += 1
        # The iteration's seconds end where its closing began: what memsentry did after
        # that, counted in ``own``, is added, so that the loop's time is what remains.
        seconds += self.after
        ended = Ended(index=index, seconds=seconds, own=self.own, light=self.budget.light)
        self.own, self.after, self.calls = 0.0, 0.0, 0
        self.current = next_window(was, layers=layers, ended=ended, share=self.overhead,
                                   dispatched=dispatched, tuning=self.budget.tuning)
        if self.current.full:
            return
        if was.full:  # measuring every layer cost more than its share: from here in turn
            own = ended.own + dispatched
            self.since = index + 1
            self.busiest = (own, max(seconds - own, 1e-9))
        self.narrowest = min(self.narrowest, self.current.size)


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
        why = _busiest_words(*coverage.busiest, since=coverage.since, share=share)
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


def _busiest_words(own: float, loop: float, *, since: int, share: str) -> str:
    """What measuring every call cost in the iteration that narrowed it, beside the loop's own
    work in it; where clocks left the loop no time, that is said instead of a share."""
    took = f"Measuring every layer call took {own * 1e3:.1f} ms in iteration {since - 1}, "
    if loop < 1e-6:
        took += "about all of that iteration's time"
    else:
        took += f"{own / loop:.0%} of that iteration's {loop * 1e3:.1f} ms of the loop's own work"
    return (f"{took} (the limit is {share}, track(overhead=...); the iterations table's "
            f"durations include memsentry's work). From iteration {since} ")
