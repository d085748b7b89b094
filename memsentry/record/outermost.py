"""Outermost module calls made with autograd on, watched until a backward reaches them: a
forward whose graph no backward used by the end of its iteration wasted what it saved
(``missing-no-grad``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from memsentry.model import Location, UnusedGraph
from memsentry.record.backward import grad_nodes
from memsentry.record.calls import PassEnd
from memsentry.record.timeline import IterationClock
from memsentry.usercode.frames import user_site

#: Outermost calls watched at once before the oldest are judged without a boundary.
MAX_RUNNING = 10_000
#: In light iterations, the calls of one module watched in each doubling of its calls (all of
#: its first 2 * WATCHED, then every second, every fourth...): a module called 25,000 times
#: has about 600 of its calls watched.
WATCHED = 64


def watched(calls: int) -> bool:
    """Whether a module's ``calls``-th light call is watched (see :data:`WATCHED`)."""
    stride = 1 << max(0, (calls // WATCHED).bit_length() - 1)
    return calls % stride == 0


class RootCall:
    """An outermost module call made with autograd on, until a backward reaches its output."""

    __slots__ = ("eval_mode", "generation", "handles", "members", "name", "pass_end", "saved",
                 "used", "where")

    def __init__(self, name: str, eval_mode: bool, saved: int | None,
                 where: Location | None, generation: int, pass_end: PassEnd | None) -> None:
        self.generation = generation
        self.pass_end = pass_end
        self.name = name
        self.eval_mode = eval_mode
        self.saved = saved
        self.used = False
        self.handles: list[Any] = []
        self.where = where
        #: For a call of a model entered through its own method: the layers called so far in
        #: it (a layer called again starts the model's next call); ``None`` once judged.
        self.members: set[str] | None = set()

    def mark_used(self, _grad_outputs: Any) -> None:
        """A backward pass reached the call's output; its end is reported when it comes."""
        self.used = True
        if self.pass_end is not None:
            self.pass_end.arm()

    def takes(self, name: str, generation: int) -> bool:
        """Whether a call of layer ``name`` in iteration ``generation`` belongs to this call
        of a model entered through its own method: not judged yet, of the same iteration,
        and of a layer it did not call yet (one called again starts the model's next call)."""
        return self.members is not None and name not in self.members \
            and self.generation == generation

    def fold_into(self, known: UnusedGraph | None) -> UnusedGraph:
        """This unused call added to what is ``known`` of its module's unused calls."""
        saved = self.saved
        if known is not None and known.saved_bytes is not None and saved is not None:
            saved = max(saved, known.saved_bytes)
        return UnusedGraph(
            module=self.name,
            calls=(known.calls if known else 0) + 1,
            eval_calls=(known.eval_calls if known else 0) + self.eval_mode,
            saved_bytes=saved,
            where=known.where if known and known.where else self.where,
            unwatched=known.unwatched if known else 0,
        )


class OutermostCalls:
    """The outermost calls of the running and the previous iteration, and the unused ones of
    those before. A call is judged one boundary after its own iteration ended: a backward may
    come after the boundary (a GAN's generator loss, backpropagated after the discriminator's
    optimizer step)."""

    def __init__(self, clock: IterationClock,
                 backward_done: Callable[[], None] | None = None) -> None:
        self._clock = clock
        self._backward_done = backward_done
        self._pass_end = PassEnd(self._passed) if backward_done is not None else None
        self._pass_seen = False  # a backward pass reached a watched call since last asked
        self._running: list[RootCall] = []
        #: Unused calls by module and call site: each site is a line to put under no_grad.
        self._unused: dict[tuple[str, Location | None], UnusedGraph] = {}
        self._entries: dict[str, RootCall] = {}  # the latest call of each model so entered
        self._owners: dict[str, str] = {}  # a layer called by such a model's method: the model
        self.thin = False  # light calls are watched thinned out (see :data:`WATCHED`)
        self._light: dict[str, int] = {}  # light calls with autograd on, by module
        self._unwatched: dict[str, int] = {}  # of those, the ones not watched

    def _passed(self) -> None:
        self._pass_seen = True
        assert self._backward_done is not None
        self._backward_done()

    def pass_seen(self) -> bool:
        """Whether a backward pass reached a watched call since the last time this was asked
        (the end of that pass was reported)."""
        seen, self._pass_seen = self._pass_seen, False
        return seen

    @property
    def thinned(self) -> bool:
        """Whether some calls were left unwatched (a backward may have reached only those)."""
        return bool(self._unwatched)

    def watch_light(self, name: str, eval_mode: bool, outputs: list[torch.Tensor],
                    entry: Callable[[], tuple[str | None, Location | None]] | None = None
                    ) -> None:
        """An outermost call of a light iteration ended with autograd on: watched like any
        other, or with :attr:`thin` only as :func:`watched` says (counted otherwise)."""
        if self.thin:
            calls = self._light[name] = self._light.get(name, 0) + 1
            if not watched(calls):
                self._unwatched[name] = self._unwatched.get(name, 0) + 1
                return
        self.watch(name, eval_mode, None, outputs, entry)

    def watch(self, name: str, eval_mode: bool, saved: int | None,
              outputs: list[torch.Tensor],
              entry: Callable[[], tuple[str | None, Location | None]] | None = None) -> None:
        """An outermost call ended with autograd on: watch the nodes of its outputs.
        ``entry`` says which named module's own method made the call (a model entered through
        ``self.forward()``: its layers' calls are one call of it) and the user's line that
        called in."""
        nodes = grad_nodes(outputs)
        if not nodes:
            return
        owner, where = entry() if entry is not None else (None, user_site())
        if owner is not None:
            self._owners[name] = owner
            if self._join(self._entries.get(owner), name, saved, nodes):
                return
        if len(self._running) >= MAX_RUNNING:  # no boundary settles them (inference)
            self.settle(everything=True)
        self._running.append(self._new_call(name, owner, eval_mode, saved, where, nodes))

    def _join(self, call: RootCall | None, name: str, saved: int | None, nodes: list[Any]
              ) -> bool:
        """Whether layer ``name``'s call is another layer of ``call``, the latest call of the
        model entered through its own method (one of its iteration, by a layer it did not
        call yet); if so, its nodes and what it saved are that call's too."""
        if call is None or not call.takes(name, self._clock.index):
            return False
        assert call.members is not None
        call.members.add(name)
        call.handles += [node.register_prehook(call.mark_used) for node in nodes]
        if call.saved is not None and saved is not None:
            call.saved += saved
        return True

    def _new_call(self, name: str, owner: str | None, eval_mode: bool, saved: int | None,
                  where: Location | None, nodes: list[Any]) -> RootCall:
        """A call watched through its output ``nodes``: of module ``name``, or of the model
        ``owner`` whose own method called it (its first layer's call)."""
        call = RootCall(owner or name, eval_mode, saved, where, self._clock.index,
                        self._pass_end)
        call.handles = [node.register_prehook(call.mark_used) for node in nodes]
        if owner is not None:
            assert call.members is not None
            call.members.add(name)
            self._entries[owner] = call
        return call

    def settle(self, *, everything: bool = False) -> None:
        """An iteration ended: the calls made before it (all calls, with ``everything``) are
        judged, those no backward reached are unused, and their hooks are removed."""
        kept = []
        for call in self._running:
            if not everything and not call.used and call.generation >= self._clock.index:
                kept.append(call)
                continue
            for handle in call.handles:
                handle.remove()
            call.members = None
            if not call.used:
                key = (call.name, call.where)
                self._unused[key] = call.fold_into(self._unused.get(key))
        self._running = kept

    def abandon(self) -> None:
        """The block ends with an error: the running iteration's calls are not judged (the
        error took their backward's chance away)."""
        for call in self._running:
            if call.generation >= self._clock.index:
                for handle in call.handles:
                    handle.remove()
        self._running = [c for c in self._running if c.generation < self._clock.index]

    def unused(self) -> tuple[UnusedGraph, ...]:
        """Settled unused graphs plus those of the running iteration that are still unused,
        each with the calls of its module left unwatched."""
        unused = dict(self._unused)
        for call in self._running:
            if not call.used and (call.name, call.where) not in unused:
                unused[call.name, call.where] = call.fold_into(None)
        return tuple(replace(graph, unwatched=self._unwatched_of(graph.module))
                     for graph in unused.values())

    def _unwatched_of(self, module: str) -> int:
        """Calls of ``module`` left unwatched; for a model entered through its own method,
        those of its busiest layer (each of its calls called each layer once, or more)."""
        counts = [count for name, count in self._unwatched.items()
                  if self._owners.get(name, name) == module]
        return max(counts, default=0)
