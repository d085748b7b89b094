"""When censuses are taken, and taking them: after warm-up, then at doubling gaps, each
within a time budget. Once a census found tensors in garbage cycles, what the interpreter's own
full collections free is measured between censuses (a ``gc.callbacks`` entry, added only then:
Python code run by the collector can lose an exception, so none runs before it is useful)."""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from torch import nn

from memsentry.census import garbage_census, take_census
from memsentry.census.hooks import hook_counts
from memsentry.census.take import GRAPH_SHARE, Named
from memsentry.measure import heap_in_use
from memsentry.model import Census, HolderStats, Measured, Step
from memsentry.record.budget import ANALYSIS, CENSUSES, Budget
from memsentry.record.layers import LayerRegistry
from memsentry.record.lengths import Lengths, last_two
from memsentry.record.policy import CensusState, Standing, census_step, closing_census, stands
from memsentry.record.sampler import Sampler
from memsentry.record.threads import Owner, collector_paused


class CensusSchedule:
    """The censuses of one recorder, and what the automatic full collections freed between
    them. Its memory and what its own collections free are kept out of the sampler's figures
    (``sampler.own``)."""

    def __init__(self, sampler: Sampler, registry: LayerRegistry, budget: float,
                 owner: Owner | None = None, ledger: Budget | None = None) -> None:
        self.active = False
        self._owner = owner
        self.censuses: list[Census] = []
        self.errors: list[str] = []
        self.budget = budget  # the CPU seconds one census may take (track(holder_budget=))
        self._next_budget = budget  # the next census's: wider after one was cut short
        self._budgets: dict[int, float] = {}  # the budget each census had, by iteration
        self.ledger = ledger if ledger is not None else Budget(None)
        self.clock = self.ledger.clock
        self.wanted = False  # a census is due and waits for the ledger to afford it
        self.free = False  # the one wanted is taken whatever the account holds
        # The iteration from which a census would confirm a leak found but not yet said (set
        # by the alarm after each census): the first then is taken whatever it costs.
        self.settles: int | None = None
        self.last_cost = self.ledger.tuning.census_guess  # what the last census took (seconds)
        self.on_taken: Callable[[], None] | None = None  # called after each census
        self._sampler = sampler
        self._registry = registry
        self._cycles_seen = False  # then every census collects all generations
        self._full_collections = 0
        self._full_freed = 0
        self._full_start = 0
        self._collecting = False  # the census's own collections are not the interpreter's
        self.pending: int | None = None  # a census due, to be taken when the next iteration
        # begins: after the code that follows the boundary (clearing lists, del) has run
        self._basis: Standing | None = None  # what the last census taken saw (:meth:`_standing`)
        self._records = 0  # the backend's memory the censuses' records take
        self._probe = False  # the pending census waits for the account: only carried, if at all
        self._heap_records = 0  # the same in the C heap
        self.lengths = Lengths()  # the containers found growing, read at each boundary

    def gc_event(self, phase: str, info: dict[str, Any]) -> None:
        """``gc.callbacks`` entry: measure what automatic full collections free (cycles)."""
        backend = self._sampler.backend
        if info.get("generation") != 2 or backend is None or not self.active \
                or self._collecting or (self._owner is not None and not self._owner.mine()):
            return
        if phase == "start":
            self._full_start = backend.allocated()
        else:
            self._full_collections += 1
            self._full_freed += max(0, self._full_start - backend.allocated())

    def watch_collections(self) -> None:
        if self.gc_event not in gc.callbacks:
            gc.callbacks.append(self.gc_event)

    def unwatch_collections(self) -> None:
        if self.gc_event in gc.callbacks:
            gc.callbacks.remove(self.gc_event)

    def take(self, iteration: int, *, model: nn.Module | None, own_hooks: set[int],
             skip: set[int], named: Sequence[Named] = ()) -> bool:
        """One census now, labelled with the ``iteration`` whose boundary it judges; a failure
        becomes a note, never the user's exception. Returns whether it was taken."""
        backend = self._sampler.backend
        assert backend is not None
        collections, freed = self._full_collections, self._full_freed
        self._full_collections = self._full_freed = 0
        before, blocks = backend.allocated(), sys.getallocatedblocks()
        self._collecting = True
        try:
            garbage = garbage_census(backend.allocated, collections, freed,
                                     everything=self._cycles_seen)
            if garbage.tensors > 0 and not self._cycles_seen:
                self._cycles_seen = True
                self.watch_collections()
            collected, heap_collected = backend.allocated(), heap_in_use()
            # The walk's short-lived records would start collections of the oldest
            # generation, which in a process of millions of objects take longer than the
            # walk itself (0.17 s of a 0.5 s budget beside 3 million tuples).
            with collector_paused():
                census = take_census(
                    iteration,
                    frame=sys._getframe(1),
                    model=model,
                    modules=self._registry.modules(),
                    static=self._registry.static_storages,
                    own_hooks=own_hooks,
                    skip=skip,
                    budget=self._next_budget,
                    garbage=garbage,
                    named=named,
                    since=self.censuses[-1].graph_newest if self.censuses else None,
                )
        except Exception as exc:  # the user's loop must go on whatever the search meets
            self.errors.append(
                f"The holder search at iteration {iteration} failed "
                f"({type(exc).__name__}: {exc}); please report this to memsentry."
            )
            return False
        finally:
            self._collecting = False
        self.censuses.append(census)
        self._budgets[iteration] = self._next_budget
        self._next_budget = widened(self._next_budget, self.budget, cut=not (
            census.complete and census.graphs_complete))
        self.lengths.follow(self.censuses, model)
        # What memory and hooks were as it began (its hooks are those it counted).
        self._basis = self._standing(iteration, collected, heap_collected,
                                     tuple((h.module, h.count) for h in census.hooks))
        after = backend.allocated()
        self._sampler.own += after - before
        # Python's blocks too: the census's records are not the program's small objects.
        self._sampler.own_blocks += sys.getallocatedblocks() - blocks
        self._records += after - collected
        heap_after = heap_in_use()
        if heap_collected is not None and heap_after is not None:
            self._heap_records += heap_after - heap_collected
        return True

    def read_lengths(self, iteration: int) -> None:
        """At the boundary closing ``iteration``: the lengths of the containers followed
        (:class:`~memsentry.record.lengths.Lengths`); a failure becomes a note."""
        if not self.lengths.tracks:
            return
        try:
            self.lengths.read(iteration, sys._getframe(1))
        except Exception as exc:  # the user's loop must go on whatever the reading meets
            self.lengths.tracks.clear()
            self.errors.append(
                f"Reading the lengths of growing containers at iteration {iteration} failed "
                f"({type(exc).__name__}: {exc}); please report this to memsentry.")

    def _standing(self, iteration: int, allocated: int, heap: int | None,
                  hooks: tuple[tuple[str | None, int], ...]) -> Standing:
        """What a census at ``iteration`` sees, to compare with another: the backend's
        ``allocated`` and the C ``heap`` read as it begins (after its collection, for one
        taken), less what the censuses' records take, and the user's ``hooks``."""
        backend = self._sampler.backend
        if backend is None or backend.measured is Measured.HEAP:
            heap = None  # the backend's figure is the heap's
        return Standing(iteration, allocated - self._records,
                        None if heap is None else heap - self._heap_records, hooks)

    def _carried(self, iteration: int, own_hooks: set[int]) -> bool:
        """Whether the last census taken stands for the one of ``iteration``; then it is
        recorded again as its copy."""
        backend = self._sampler.backend
        if self._basis is None or backend is None:
            return False
        now = self._standing(iteration, backend.allocated(), heap_in_use(),
                             hook_counts(self._registry.modules(), own_hooks))
        if not stands(self._basis, now, heap_backend=backend.measured is Measured.HEAP,
                      tuning=self.ledger.tuning):
            return False
        last = self.censuses[-1]
        origin = last.iteration if last.carried is None else last.carried
        self.censuses.append(replace(last, iteration=iteration, seconds=0.0, garbage=None,
                                     carried=origin))
        return True

    def plan(self, index: int, *, due: bool, scheduled: bool = False) -> None:
        """At the boundary that closed iteration ``index``: a census is wanted when ``due``
        (``scheduled``: the schedule has one; else growth asks for one); the policy says
        whether it is taken as the next iteration begins or waits, with the first claim on
        the account, for a boundary that can pay for it
        (:func:`~memsentry.record.policy.census_step`)."""
        if not due and not self.wanted:  # census_step would leave every field as it is
            return
        state = census_step(
            CensusState(wanted=self.wanted, pending=self.pending, free=self.free,
                        deferred=self.ledger.deferred, last_cost=self.last_cost,
                        settles=self.settles),
            self.ledger.account(), index=index, due=due, scheduled=scheduled,
            tuning=self.ledger.tuning)
        self.wanted, self.pending, self.free = state.wanted, state.pending, state.free
        self.ledger.deferred = state.deferred
        self.ledger.reserved = state.reserved
        if due and self.wanted and self.pending is None and self._basis is not None:
            # The account cannot pay for it, but the last one may still stand: that is seen
            # as the next iteration begins, at no cost.
            self.pending, self._probe = index, True

    def take_pending(self, *, model: nn.Module | None, own_hooks: set[int],
                     skip: set[int], named: Sequence[Named] = ()) -> float:
        """Take the census due at the last boundary now, or carry the last one where it
        still stands (:func:`~memsentry.record.policy.stands`: memory and the user's hooks
        where they were when it was taken); returns the seconds it took."""
        iteration, self.pending = self.pending, None
        probe, self._probe = self._probe, False
        if iteration is None:
            return 0.0
        started = self.clock()
        carried = self._carried(iteration, own_hooks)
        if carried and probe:  # it need not wait any more
            self.wanted, self.ledger.reserved = False, 0.0
            self.ledger.deferred -= 1
        if carried or probe:  # a look at two counters, not a census: no event counted
            spent = self.clock() - started
            self.ledger.charge(CENSUSES, spent, 0, inside=False)
            return spent
        self.take(iteration, model=model, own_hooks=own_hooks, skip=skip, named=named)
        spent = self.clock() - started
        self.last_cost = spent
        self.ledger.charge(CENSUSES, spent, inside=False)  # moved out of the iteration's time
        if self.on_taken is not None:  # the rules judge what the census found (the alarm)
            began = self.clock()
            self.on_taken()
            judged = self.clock() - began
            self.ledger.charge(ANALYSIS, judged, inside=False)
            spent += judged
        return spent

    def take_now(self, iteration: int, *, model: nn.Module | None, own_hooks: set[int],
                 skip: set[int], named: Sequence[Named] = ()) -> float:
        """A census asked for between boundaries (a framework's epoch end, after its
        evaluation; the end of training), judged as of ``iteration``, the last one closed:
        the pending census if there is one, else a new one unless ``iteration`` is still in
        warm-up or within one iteration of the last census. (Scheduled censuses are taken as
        the next iteration begins, this one as the last ends: one iteration apart, they could
        see the same state and read a steady growth as a pause.) Returns the seconds it
        took."""
        if self.pending is None:
            near = bool(self.censuses) and iteration - self.censuses[-1].iteration < 2
            if iteration < self.ledger.tuning.first_census or near:
                return 0.0
            self.pending = iteration
        return self.take_pending(model=model, own_hooks=own_hooks, skip=skip, named=named)

    def take_closing(self, iteration: int, *, model: nn.Module | None, own_hooks: set[int],
                     skip: set[int], named: Sequence[Named] = ()) -> float:
        """As tracking ends, judged as of ``iteration`` (the last one closed): a census when a
        holder still grew at the last one taken and the run went on long enough since
        (:func:`~memsentry.record.policy.closing_census`), so that a container that filled
        and then stayed is seen staying. Like the first seven it is taken whatever the
        budget holds (and charged to it): a verdict rests on it, and a budget drained by the
        first seven would make that verdict hang on the machine's load. It is never carried
        (memory standing still would say as much, but this one is rare and decides a
        verdict). A census that
        was pending is dropped either way: as the next iteration began, it would have seen
        what this one sees. Returns the seconds it took."""
        self.pending = None
        last = self.censuses[-1].iteration if self.censuses else None
        tuning = self.ledger.tuning
        if not closing_census(last, iteration, rising=still_rising(self.censuses),
                              tuning=tuning):
            return 0.0
        started = self.clock()
        if self.take(iteration, model=model, own_hooks=own_hooks, skip=skip, named=named):
            self.censuses[-1] = replace(self.censuses[-1], closing=True)
        spent = self.clock() - started
        self.ledger.charge(CENSUSES, spent, inside=False)
        return spent

    def forget_since(self, iteration: int) -> None:
        """Censuses of iterations from ``iteration`` on judged parts of an iteration that were
        merged into one: they are dropped, as is a pending one."""
        self.censuses = [c for c in self.censuses if c.iteration < iteration]
        self.pending = None
        self._basis, self._probe = None, False
        self.wanted = self.free = False
        self.ledger.reserved = 0.0

    def budget_notes(self) -> list[str]:
        """Searches that stopped at their budget, and those a search before stood for."""
        return self._carried_notes() + [
            f"The holder search at iteration {c.iteration} stopped at its "
            f"{self._budgets.get(c.iteration, self.budget):g} s budget (CPU time) after "
            f"{c.objects:,} objects; holders beyond them were not examined (raise "
            "track(holder_budget=...))."
            for c in self.censuses if not c.complete
        ] + self._graph_notes()

    def _carried_notes(self) -> list[str]:
        carried = [c for c in self.censuses if c.carried is not None]
        if not carried:
            return []
        at = ", ".join(str(c.iteration) for c in carried[:8]) + (", ..." if len(carried) > 8
                                                                  else "")
        backend = self._sampler.backend
        heap = f"the C heap within {self.ledger.tuning.still_bytes} bytes"
        how = heap if backend is None or backend.measured is Measured.HEAP \
            else f"device memory to the byte, {heap}"
        return [
            f"{len(carried)} holder search(es) were not run (iteration {at}): as each was due, "
            f"memory stood where it stood when the last one ran, {self.ledger.tuning.carry_gap} "
            f"or more iterations before ({how}), and no hook came or went, so that search's "
            "holders stand for them (one small tensor kept while as much was freed elsewhere "
            "would pass unseen until the next search)."
        ]

    def _graph_notes(self) -> list[str]:
        cut = [c for c in self.censuses if c.complete and not c.graphs_complete]
        if not cut:
            return []
        widest = max(self._budgets.get(c.iteration, self.budget) for c in cut)
        return [
            f"The autograd graphs behind the holders at iteration "
            f"{', '.join(str(c.iteration) for c in cut)} were too large to walk within "
            f"the budget (at most {widest * GRAPH_SHARE:g} s of CPU time): their node counts "
            "are lower "
            "bounds, so graph growth was not judged there; the holders' own figures are whole "
            "(raise track(holder_budget=...))."
        ]


#: A holder search cut short gives the next one twice its budget, up to this many times
#: ``holder_budget``: what the first could not reach, a later one reaches.
WIDEST = 8


def widened(budget: float, base: float, *, cut: bool) -> float:
    """The next holder search's budget after one with ``budget`` (``base``: holder_budget):
    doubled when that one was cut short, up to :data:`WIDEST` times ``base``; else kept (a
    narrower one would be cut again)."""
    return min(budget * 2, base * WIDEST) if cut else budget


def still_rising(censuses: Sequence[Census]) -> bool:
    """Whether a holder kept more at the last complete census than at the one before (by
    count or by bytes), or a new one appeared beside those that census saw (a dict's new
    string key is a holder of its own): what a verdict of growth would rest on."""
    pair = last_two(censuses)
    return pair is not None and any(_grew(holder, pair.before.get(holder.path), pair.parents)
                                    for holder in pair.holders)


def _grew(holder: HolderStats, was: HolderStats | None,
          siblings: set[tuple[Step, ...]]) -> bool:
    """Whether ``holder`` keeps more than it did (``was``), or is new in a container the
    census before saw (its path's parent among ``siblings``)."""
    if was is None:
        return len(holder.path) > 1 and holder.path[:-1] in siblings
    return holder.held > was.held or holder.bytes > was.bytes
