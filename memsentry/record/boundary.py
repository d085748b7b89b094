"""Closing iterations: what happens at each boundary (an optimizer step, ``t.step()``, the end
of a backward pass, the next call of the first outermost module).

A *sampled* iteration closes in full: the four parts are read, the iteration's record gets
its peak and its breakdown, and a census due is planned. A *light* one (the budget could not
pay for measuring it, :mod:`memsentry.record.budget`) closes with as little as keeps the
iteration count, the censuses and the growth series right: its boundary is read once in a
while (often enough for the growth rules, within the budget), and the layers' hooks stay off.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from memsentry.model import Boundary, IterationStats
from memsentry.record.backward import BackwardTimer
from memsentry.record.budget import ANALYSIS, BOUNDARIES, HOOKS, PARTS, WORKERS, Budget
from memsentry.record.coverage import Coverage
from memsentry.record.forward import ForwardRecorder
from memsentry.record.growth import GrowthEvidence
from memsentry.record.layers import LayerRegistry
from memsentry.record.outermost import OutermostCalls
from memsentry.record.parts import Parts
from memsentry.record.policy import (
    Account,
    HookState,
    IterationPlan,
    Signal,
    census_in,
    ends_unhooked,
    length_stride,
    passes,
    plan_next,
)
from memsentry.record.ranks import remember_store
from memsentry.record.sampler import Sampler, breakdown
from memsentry.record.schedule import CensusSchedule
from memsentry.record.signals import Signals
from memsentry.record.threads import mark_activity
from memsentry.record.timeline import IterationClock, Timeline
from memsentry.record.workers import reading_seconds


class Boundaries:
    """Closes the iterations of one recorder. ``census_roots()`` gives what a census needs
    from the recorder (the model, memsentry's own hooks, the objects to skip); ``signals``
    which event ends its iterations."""

    def __init__(self, *, sampler: Sampler, parts: Parts, coverage: Coverage, budget: Budget,
                 clock: IterationClock, timeline: Timeline, censuses: CensusSchedule,
                 backward: BackwardTimer | None, outermost: OutermostCalls,
                 forward: ForwardRecorder, registry: LayerRegistry, holders: bool,
                 census_roots: Callable[[], dict[str, Any]], signals: Signals) -> None:
        self._sampler = sampler
        self._parts = parts
        self._coverage = coverage
        self._budget = budget
        self._clock = clock
        self._timeline = timeline
        self._censuses = censuses
        self._backward = backward
        self._outermost = outermost
        self._forward = forward
        self._registry = registry
        self._holders = holders
        self._census_roots = census_roots
        self._signals = signals
        self.overall_peak = 0
        self.growth: GrowthEvidence | None = None  # watch(): censuses when memory grows
        self._close_cost = 0.0  # seconds the last light iteration's closing took
        self.skip = 0  # boundaries still to pass with a count only (bare light iterations)
        self._passed = 0  # boundaries passed so since the last closed iteration
        self._stepped = 0  # of them, ended by a step or a backward (no clock saw their cost)
        self._workers_read = reading_seconds()  # charged to the budget up to here
        self._now = budget.clock
        self.plan: IterationPlan | None = None  # the running iteration's, from the policy
        self._censuses_seen = 0  # censuses taken at the last light boundary
        self._next_length = 0  # the next passed boundary whose lengths are read
        # Called as each iteration closes, while a memory_viz snapshot records the CPU's
        # storages (record/snapshot.py): it marks where the iteration ends in the trace.
        self.mark: Callable[[int], None] | None = None
        forward.on_passed = self._passed_unhooked

    def passes(self, event: Boundary, strongest: Boundary | None) -> bool:
        """Whether the boundary ``event`` only counts an iteration: in a run of bare light
        iterations (no hook, nothing read), each but the last ends with a count, and the
        last closes them all (:meth:`close`)."""
        if self._forward.hooks.counter.on:  # another signal: the counted calls first
            self._forward.stop_counting()
        if self.skip and event is strongest:
            self.skip -= 1
            self._passed += 1
            self._clock.index += 1
            if event is not Boundary.FORWARD:  # a forward's is clocked in its hook
                self._stepped += 1
            if self.mark is not None:
                self.mark(self._clock.index - 1)
            return True
        return False

    def pass_step(self) -> None:
        """An optimizer step passed with a count, the short way (:meth:`passes` without the
        checks the recorder made): at every step of a light stretch."""
        self.skip -= 1
        self._passed += 1
        self._stepped += 1
        self._clock.index += 1
        if self.mark is not None:
            self.mark(self._clock.index - 1)
        if self._censuses.lengths.tracks and self._clock.index > self._next_length:
            self._read_lengths(self._clock.index - 1)

    def _read_lengths(self, index: int) -> None:
        """At a boundary passed with a count (closing ``index``): the lengths of the
        containers found growing, as often as their share of the budget pays for."""
        began = self._now()
        self._censuses.read_lengths(index)
        spent = self._now() - began
        self._budget.charge(BOUNDARIES, spent, 0)
        self._next_length = index + length_stride(spent, self._budget.account(),
                                                  self._budget.tuning)

    def _charge_passed(self) -> None:
        """What the steps passed since the last closing cost beyond any clock
        (:mod:`memsentry.record.unseen`): inside the iteration that ends now."""
        if self._stepped:
            self._budget.charge(BOUNDARIES, self._stepped * self._budget.unseen.passed_step, 0)
            self._stepped = 0

    def _passed_unhooked(self, calls: int) -> None:
        """``calls`` calls of the lean module were counted with no hook: each was a boundary
        passed with a count."""
        self.skip = max(0, self.skip - calls)
        self._passed += calls
        self._clock.index += calls
        self._budget.charge(HOOKS, calls * self._budget.unseen.counted_call, 0)

    def end(self) -> None:
        """Tracking ends: the boundaries passed since the last closed iteration count as
        light iterations, and the partial iteration at the end is closed when boundaries
        were passed (its row's index tells them, which no row would otherwise), when it ran
        module calls, when none could be seen (a bare light iteration hooks no module), or
        when no iteration ended at all."""
        self._forward.stop_counting()
        self._charge_passed()
        passed = self._passed
        if passed:
            self._budget.end_iteration(self._now() - self._clock.started, passed)
            self.skip = 0  # _passed stays: the closing below spans those boundaries
        if passed or self._clock.calls or not self._timeline.items or self._forward.hooks.bare:
            self.close(Boundary.EXIT)
        self._passed = 0

    def close(self, boundary: Boundary, *, merge: bool = False) -> None:
        """Close the running iteration; with ``merge``, together with the iterations weaker
        signals closed just before (they were parts of this one)."""
        began = self._now()
        self._charge_passed()
        if boundary != Boundary.EXIT:
            mark_activity()  # an iteration of this thread's loop (see Owner.others)
        read = reading_seconds()  # the workers' readings ran in this iteration's time
        if read > self._workers_read:
            self._budget.charge(WORKERS, read - self._workers_read)
            self._workers_read = read
        if self._budget.light and not merge and boundary != Boundary.EXIT:
            census = self._close_light(boundary, began)
            light = True
        else:
            census = self._close_full(boundary, began, merge=merge)
            light = False
        spent = self._now() - began - census
        self._budget.charge(BOUNDARIES, spent)
        if light:
            self._close_cost = spent

    def _close_full(self, boundary: Boundary, now: float, *, merge: bool) -> float:
        sampler = self._sampler
        assert sampler.backend is not None
        if self._parts.due:
            self._parts.read_all()  # the step may have made optimizer state
            self._coverage.count_closing(now, PARTS)
        # The peak counter ran over the boundaries passed with a count: not one iteration's.
        exact = sampler.peaks_exact() and not self._passed
        self.skip = self._passed = 0  # a stronger signal, or the end, within passed ones
        allocated = sampler.sample(step=boundary == Boundary.OPTIMIZER)
        closing = self._clock.close(boundary, allocated, sampler.backend.reserved(),
                                    sampler.peak, now,
                                    parts=breakdown(sampler, self._clock.index), exact=exact,
                                    own_blocks=sampler.own_blocks)
        merged = self._timeline.close(closing, merge=merge)
        if merged is not None:
            # The iterations merged: those the timeline kept and those it left out (passed
            # with a count, or thinned), which were all light.
            self._budget.merged(self._clock.index - merged, self._timeline.merged_sampled)
            self._clock.index = merged
            self._censuses.forget_since(merged)
            self._coverage.merged(merged)
        self.overall_peak = max(self.overall_peak, sampler.peak)
        if boundary != Boundary.FORWARD:  # a backward may still come (an episode's update)
            self._settle_calls()
        census = self._pending_census()
        if census:
            now = self._now()  # the census's own time is not the loop's
            allocated = sampler.sample()
        self._advance(boundary, closing.seconds, now)
        sampler.begin_iteration(allocated)
        return census

    def _close_light(self, boundary: Boundary, now: float) -> float:
        """A light iteration ends: its boundary is read when the reading fits in its share of
        the budget (a light record: no peak inside, no parts), the rest as in full."""
        passed, self._passed = self._passed, 0
        seconds = now - self._clock.started
        each = seconds / (passed + 1)
        allocated = self._sampler.sample()
        # A peak counter reset where the iteration began gives its peak, hooks or none.
        exact = self._sampler.peaks_exact() and not passed
        resident = self._clock.resident()
        peak = self._sampler.peak if exact else allocated
        # What a light iteration read is memory the run held: the run's peak is at least it.
        self.overall_peak = max(self.overall_peak, peak)
        self._timeline.add(IterationStats(
            index=self._clock.index, allocated=allocated, reserved=None,
            peak=peak, peak_exact=exact,
            seconds=each, boundary=boundary, forward_calls=self._clock.calls,
            data_seconds=self._clock.data_seconds(passed + 1), sampled=False,
            resident=resident, python_blocks=self._blocks_after_census()))
        if boundary != Boundary.FORWARD:
            self._settle_calls()
        census = self._pending_census()
        if census:
            now = self._now()
        account = self._advance(boundary, seconds, now, iterations=passed + 1)
        self._sampler.begin_iteration(allocated)
        if self._forward.hooks.bare or self._signals.signal in (Boundary.FORWARD,
                                                                 Boundary.BACKWARD):
            # The next iteration is light with no hook, or with the anchors' hooks alone
            # (they end its iterations): pass some boundaries with a count; where the lean
            # module's calls end them, with no hook (its call that began here counts them).
            self.skip = self._to_pass(account, each)
            lean = self.plan is not None and self.plan.hooks is HookState.LEAN
            self._forward.pass_after = self.skip if lean else 0
        return census

    def _blocks_after_census(self) -> int | None:
        """Python's block count at a light boundary when a census ran since the last one
        (so that the readings of Python values keep their pace whatever the budget allows),
        else ``None``: counting costs tens of microseconds."""
        taken = len(self._censuses.censuses)
        if taken == self._censuses_seen:
            return None
        self._censuses_seen = taken
        return self._clock.python_blocks(self._sampler.own_blocks)

    def _to_pass(self, account: Account, each: float) -> int:
        """How many of the next boundaries only count (:func:`~memsentry.record.policy.
        passes`), from the ``account`` the closing left; ``each`` the loop's seconds per
        iteration."""
        return passes(account, each=each, closing=self._close_cost,
                      running=self._clock.index,
                      census_pending=self._censuses.pending is not None,
                      tuning=self._budget.tuning)

    def _signal(self) -> Signal:
        """The loop's iteration signal, as the policy reads it."""
        signal = self._signals.signal
        return Signal(step=signal in (Boundary.OPTIMIZER, Boundary.STEP),
                      backward=signal is Boundary.BACKWARD,
                      seen=self._signals.passes_wrapped, forward=signal is Boundary.FORWARD)

    def ends_unhooked(self) -> bool:
        """Whether the running iteration is light and its end needs no module hook (an
        optimizer step, ``t.step()``, or a backward pass the wrapped
        ``torch.autograd.backward`` sees end)."""
        return self._budget.light and ends_unhooked(self._signal())

    def unclocked(self, started: float) -> None:
        """Work of memsentry's since ``started`` at a boundary (the alarm rewriting the
        report file): charged to the budget's judging, and not the loop's time."""
        spent = self._now() - started
        self._budget.charge(ANALYSIS, spent, inside=False)
        self._clock.started += spent

    def _settle_calls(self) -> None:
        if self._backward is not None:
            self._backward.drop_hooks()
        self._outermost.settle()

    def census_at_call(self) -> float:
        """The first outermost call of an iteration takes the census pending since its
        boundary (if any); its seconds. When the census was all that kept this light
        iteration's hooks on, they come off as the call ends (a bare plan): the hundreds of
        forwards after it in an episode run with no hook."""
        if self._censuses.pending is None:
            return 0.0
        spent = self._pending_census()
        self._forward.unhook_after = self._censuses.pending is None and self.ends_unhooked()
        return spent

    def _pending_census(self) -> float:
        """A census pending since the last boundary, when no module ran since; its seconds."""
        if self._censuses.pending is None:
            return 0.0
        return self._censuses.take_pending(**self._census_roots())

    def _advance(self, boundary: Boundary, seconds: float, now: float, *,
                 iterations: int = 1) -> Account:
        """Plan the census, bring the account and the window up to date, apply the policy's
        plan of the next iteration to the hooks, and begin it at ``now`` (``iterations``: the
        iterations ending, the passed ones with this one). Returns the account the plan was
        made from."""
        index = self._clock.index
        if self._holders:
            self._censuses.read_lengths(index)
        if self._holders and boundary != Boundary.EXIT:
            scheduled = census_in(index, iterations, self._budget.tuning)
            self._censuses.plan(index, due=self._census_wanted(scheduled),
                                scheduled=scheduled)
        if self.mark is not None and boundary != Boundary.EXIT:
            self.mark(index)
        remember_store()  # a script may destroy its process group before the block ends
        self._coverage.end_iteration(index, seconds, len(self._registry.records))
        if boundary != Boundary.EXIT:  # the partial iteration at the end is no iteration
            account = self._budget.end_iteration(seconds, iterations, began=now)
        else:
            account = self._budget.account()
        signal = self._signal()
        plan = plan_next(account, self._coverage.current, signal,
                         index=index + 1, census_pending=self._censuses.pending is not None,
                         forward_running=bool(self._forward.stack),
                         tuning=self._budget.tuning)
        self.plan = plan
        self._forward.unhook_after = False
        self._forward.pass_after = 0
        lean = self._signals.first() if plan.hooks is HookState.LEAN else None
        self._forward.hooks.follow(bare=plan.hooks is HookState.BARE, lean=lean)
        # Light calls are watched thinned out unless the ends of backward passes close the
        # iterations (they are seen through the watched calls).
        self._outermost.thin = signal.step or signal.forward
        self._clock.advance(now)
        return account

    def _census_wanted(self, scheduled: bool) -> bool:
        """Whether a census is due at the boundary being closed: the schedule has
        one (``scheduled``), or under ``watch()`` memory left at boundaries climbs."""
        due = scheduled
        growth = self.growth
        if growth is not None:
            growth.add(self._sampler.last)
            due = growth.asks() or due  # asks() keeps the floor's first reading
            if due:
                growth.planned()
        return due
