"""Outermost module calls made with autograd on, watched until a backward reaches them: a
forward whose graph no backward used by the end of its iteration wasted what it saved
(``missing-no-grad``)."""

from __future__ import annotations

from typing import Any

import torch

from memsentry.model import Location, UnusedGraph
from memsentry.record.backward import grad_nodes
from memsentry.usercode.frames import user_site


class RootCall:
    """An outermost module call made with autograd on, until a backward reaches its output."""

    __slots__ = ("eval_mode", "handles", "name", "saved", "used", "where")

    def __init__(self, name: str, eval_mode: bool, saved: int | None,
                 where: Location | None) -> None:
        self.name = name
        self.eval_mode = eval_mode
        self.saved = saved
        self.used = False
        self.handles: list[Any] = []
        self.where = where

    def mark_used(self, _grad_outputs: Any) -> None:
        self.used = True

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
        )


class RootCalls:
    """The outermost calls of the running iteration, and the unused ones of past iterations."""

    def __init__(self) -> None:
        self._running: list[RootCall] = []
        self._unused: dict[str, UnusedGraph] = {}

    def watch(self, name: str, eval_mode: bool, saved: int | None,
              outputs: list[torch.Tensor]) -> None:
        """An outermost call ended with autograd on: watch the nodes of its outputs."""
        nodes = grad_nodes(outputs)
        if not nodes:
            return
        call = RootCall(name, eval_mode, saved, user_site())
        call.handles = [node.register_prehook(call.mark_used) for node in nodes]
        self._running.append(call)

    def settle(self) -> None:
        """The iteration ended: calls no backward reached are unused; hooks removed."""
        for call in self._running:
            for handle in call.handles:
                handle.remove()
            if not call.used:
                self._unused[call.name] = call.fold_into(self._unused.get(call.name))
        self._running.clear()

    def unused(self) -> tuple[UnusedGraph, ...]:
        """Settled unused graphs plus those of the running iteration that are still unused."""
        unused = dict(self._unused)
        for call in self._running:
            if not call.used and call.name not in unused:
                unused[call.name] = call.fold_into(None)
        return tuple(unused.values())
