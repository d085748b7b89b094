"""When censuses are taken, and taking them: after warm-up, then at doubling gaps, each
within a time budget. Once a census found tensors in garbage cycles, what the interpreter's own
full collections free is measured between censuses (a ``gc.callbacks`` entry, added only then:
Python code run by the collector can lose an exception, so none runs before it is useful)."""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from memsentry.census import garbage_census, take_census
from memsentry.census.take import GRAPH_SHARE, Named
from memsentry.model import Census
from memsentry.record.budget import ANALYSIS, CENSUSES, Budget
from memsentry.record.layers import LayerRegistry
from memsentry.record.policy import CensusState, census_step
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
        self.budget = budget  # the seconds one census may take
        self.ledger = ledger if ledger is not None else Budget(None)
        self.clock = self.ledger.clock
        self.wanted = False  # a census is due and waits for the ledger to afford it
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
             skip: set[int], named: Sequence[Named] = ()) -> None:
        """One census now, labelled with the ``iteration`` whose boundary it judges; a failure
        becomes a note, never the user's exception."""
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
                    budget=self.budget,
                    garbage=garbage,
                    named=named,
                )
        except Exception as exc:  # the user's loop must go on whatever the search meets
            self.errors.append(
                f"The holder search at iteration {iteration} failed "
                f"({type(exc).__name__}: {exc}); please report this to memsentry."
            )
            return
        finally:
            self._collecting = False
        self.censuses.append(census)
        self._sampler.own += backend.allocated() - before
        # Python's blocks too: the census's records are not the program's small objects.
        self._sampler.own_blocks += sys.getallocatedblocks() - blocks

    def plan(self, index: int, *, due: bool) -> None:
        """At the boundary that closed iteration ``index``: a census is wanted when ``due``
        (the schedule, or growth asking for one); the policy says whether it is taken as the
        next iteration begins or waits, with the first claim on the account, for a boundary
        that can pay for it (:func:`~memsentry.record.policy.census_step`)."""
        if not due and not self.wanted:  # census_step would leave every field as it is
            return
        state = census_step(
            CensusState(wanted=self.wanted, pending=self.pending, taken=len(self.censuses),
                        deferred=self.ledger.deferred, last_cost=self.last_cost),
            self.ledger.account(), index=index, due=due, tuning=self.ledger.tuning)
        self.wanted, self.pending, self.ledger.deferred = state.wanted, state.pending, \
            state.deferred
        self.ledger.reserved = state.reserved

    def take_pending(self, *, model: nn.Module | None, own_hooks: set[int],
                     skip: set[int], named: Sequence[Named] = ()) -> float:
        """Take the census due at the last boundary now; returns the seconds it took."""
        iteration, self.pending = self.pending, None
        if iteration is None:
            return 0.0
        started = self.clock()
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

    def forget_since(self, iteration: int) -> None:
        """Censuses of iterations from ``iteration`` on judged parts of an iteration that were
        merged into one: they are dropped, as is a pending one."""
        self.censuses = [c for c in self.censuses if c.iteration < iteration]
        self.pending = None
        self.wanted = False
        self.ledger.reserved = 0.0

    def budget_notes(self) -> list[str]:
        """Searches that stopped at their budget."""
        return [
            f"The holder search at iteration {c.iteration} stopped at its "
            f"{self.budget:g} s budget after {c.objects:,} objects; holders beyond "
            "them were not examined (raise track(holder_budget=...))."
            for c in self.censuses if not c.complete
        ] + self._graph_notes()

    def _graph_notes(self) -> list[str]:
        cut = [str(c.iteration) for c in self.censuses if c.complete and not c.graphs_complete]
        if not cut:
            return []
        return [
            f"The autograd graphs behind the holders at iteration {', '.join(cut)} were too "
            f"large to walk in {self.budget * GRAPH_SHARE:g} s: their node counts are lower "
            "bounds, so graph growth was not judged there; the holders' own figures are whole "
            "(raise track(holder_budget=...))."
        ]
