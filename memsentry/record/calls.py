"""The calls running while a loop runs: module forwards on the stack and module backwards,
whose peaks the sampler raises as it reads memory."""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memsentry.record.layers import LayerRecord


def _no_graph_task() -> int:
    return -1


#: The id of the backward pass running in this thread, -1 outside one (torch >= 2.1 has it).
graph_task: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", _no_graph_task)


def in_backward() -> bool:
    """Whether this thread runs inside a backward pass now (autograd's engine runs the hooks
    and, under activation checkpointing, the recomputed forwards and nested backward calls)."""
    return graph_task() != -1


class PassEnd:
    """Runs ``callback`` once when the running backward pass ends, however often it is armed
    during the pass (from inside autograd hooks)."""

    __slots__ = ("_callback", "_queued")

    def __init__(self, callback: Callable[[], None]) -> None:
        self._callback = callback
        self._queued = False

    def arm(self) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._run)

    def _run(self) -> None:
        self._queued = False
        self._callback()


class BackwardCall:
    """The backward of one module call: opened when the gradient of its output is complete,
    closed when the gradients of its inputs are (or when the backward pass ends)."""

    __slots__ = ("generation", "handles", "input_nodes", "peak", "record", "start", "state")

    WAITING, RUNNING, DONE = 0, 1, 2

    def __init__(self, record: LayerRecord, generation: int) -> None:
        self.record = record
        self.generation = generation  # the iteration whose forward made the call
        self.state = BackwardCall.WAITING
        self.start = 0
        self.peak = 0
        self.handles: list[Any] = []
        self.input_nodes: set[int] = set()


@dataclass(eq=False)
class ForwardCall:
    """One module call whose forward is running: memory at its start, the highest seen since,
    and the storages saved for backward inside it (pointer -> bytes). An outermost call that
    is not ``measured`` is only counted (see :mod:`memsentry.record.coverage`); ``pushed``:
    the call put the saved-tensor hooks on the stack and takes them off when it ends; ``hooks``
    names the saved-tensor hooks not memsentry's that the call ran under."""

    record: LayerRecord
    start: int
    peak: int
    saved: dict[int, int] = field(default_factory=dict)
    saved_bytes: int = 0
    backward: BackwardCall | None = None
    measured: bool = True
    pushed: bool = False
    hooks: str | None = None  # someone else's saved-tensor hooks it ran under
    frame: int = 0  # id() of the frame that runs the call, while it runs


def stale_calls(stack: list[ForwardCall], frame: types.FrameType,
                record_of: Callable[[nn.Module], LayerRecord | None]) -> list[ForwardCall]:
    """Take off ``stack`` (and return) the calls whose frames are gone, ``frame`` running now:
    an exception that is not an ``Exception`` (KeyboardInterrupt, SystemExit) leaves a forward
    without running its hooks, and a later call would be taken for a child of the call it
    ended. A new frame can take a dead one's address, so each frame's module is compared
    too."""
    alive: dict[int, types.FrameType] = {}
    running: types.FrameType | None = frame
    while running is not None:
        alive[id(running)] = running
        running = running.f_back
    gone = []
    while stack:
        found = alive.get(stack[-1].frame)
        module = found.f_locals.get("self") if found is not None else None
        if isinstance(module, nn.Module) and record_of(module) is stack[-1].record:
            break
        gone.append(stack.pop())
    return gone
