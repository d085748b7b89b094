"""Which event closes iterations: every loop has some of them, and the strongest one seen wins.

From strongest to weakest: ``t.step()``, a step of the (first) ``torch.optim`` optimizer, the
end of a backward pass that reached an outermost module's output (loops that update weights
by hand, or with an optimizer of their own), the next call of the first outermost module
(inference). A weaker event is ignored once a stronger one was seen. When a stronger event
is seen for the first time, the iterations the weaker one closed since the last boundary of
the stronger kind were parts of one iteration (the micro-batches of gradient accumulation,
the actions of an episode before its update): they are merged into the iteration the
stronger event closes.
"""

from __future__ import annotations

import enum
import weakref

import torch
from torch import nn

from memsentry.model import Boundary

_STRENGTH = {Boundary.FORWARD: 1, Boundary.BACKWARD: 2, Boundary.OPTIMIZER: 3, Boundary.STEP: 4}


class Action(enum.Enum):
    IGNORE = "ignore"
    CLOSE = "close"
    MERGE = "merge"  # close, merging the iterations weaker events closed before


class Signals:
    """The strongest iteration signal seen so far, and what each new event does."""

    def __init__(self) -> None:
        self.signal: Boundary | None = None
        self._first: weakref.ref[nn.Module] | None = None
        self._optimizer: weakref.ref[torch.optim.Optimizer] | None = None
        self._wrapped = False  # the wrapper saw the end of a pass the engine ended
        self._unwrapped = False  # an engine pass ended that no wrapped call made (for good)
        self._engine_ended = False  # an engine pass ended that the wrapper has not seen yet

    @property
    def passes_wrapped(self) -> bool:
        """Whether ``torch.autograd.backward`` (wrapped) was seen ending every backward pass
        the engine ended (``torch.autograd.grad`` is not wrapped): then the iterations closed
        at the ends of backward passes can be counted with no module hook."""
        return self._wrapped and not self._unwrapped

    def engine_pass_ended(self) -> None:
        """The end of a backward pass that reached a watched call (autograd's engine)."""
        if self._engine_ended:  # the one before ended with no wrapped call: autograd.grad
            self._unwrapped = True
        self._engine_ended = True

    def wrapped_pass_ends_iteration(self, *, bare: bool, reached: bool, thinned: bool) -> bool:
        """Whether the wrapped ``torch.autograd.backward``, returning, ends an iteration:
        without modules (weights as plain tensors); in a light iteration with no hook
        (``bare``), where the wrapper alone sees the pass end; or when the pass ``reached``
        none of the calls watched while some were left unwatched (``thinned``) in a loop of
        forwards."""
        counted = self._wrapped_pass_ended()  # the engine's end of it closed the iteration
        if bare and self.signal is Boundary.BACKWARD and not counted:
            return True
        return not self.module_seen or (thinned and not reached
                                        and self.signal is Boundary.FORWARD)

    def _wrapped_pass_ended(self) -> bool:
        """The wrapped ``torch.autograd.backward`` returned; whether the engine's end of its
        pass was seen (and closed the iteration) already."""
        seen = self._engine_ended
        if seen:
            self._wrapped = True
            self._engine_ended = False
        return seen

    def primary(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether a step of ``optimizer`` is an OPTIMIZER event: the first optimizer to step
        (while it lives) is the loop's; the others step inside its iterations."""
        if self._optimizer is None or self._optimizer() is None:
            self._optimizer = weakref.ref(optimizer)
        return self._optimizer() is optimizer

    def repeats_first_call(self, module: nn.Module) -> bool:
        """Whether an outermost call of ``module`` is a new call of the first outermost module
        (a FORWARD event); the first outermost call names that module."""
        first = self._first() if self._first is not None else None
        if first is None:
            self._first = weakref.ref(module)
            return False
        return first is module

    def first(self) -> nn.Module | None:
        """The first outermost module, while it lives (its next call is a FORWARD event)."""
        return self._first() if self._first is not None else None

    @property
    def module_seen(self) -> bool:
        """Whether an outermost module call was seen (its backward passes close iterations)."""
        return self._first is not None

    def forget_modules(self) -> None:
        self._first = self._optimizer = None

    def decide(self, event: Boundary, *, calls_since: int) -> Action:
        """What ``event`` does, ``calls_since`` module calls after the last boundary."""
        strength = _STRENGTH[event]
        previous = self.signal
        if previous is not None and strength < _STRENGTH[previous]:
            return Action.IGNORE
        self.signal = event
        if event == Boundary.FORWARD and not calls_since:
            return Action.IGNORE
        if previous is not None and strength > _STRENGTH[previous]:
            return Action.MERGE
        return Action.CLOSE

    @staticmethod
    def weaker(boundary: Boundary, than: Boundary) -> bool:
        return _STRENGTH.get(boundary, 0) < _STRENGTH[than]

    def note(self) -> str | None:
        """What the report says when iterations came from a weak signal."""
        if self.signal == Boundary.BACKWARD:
            return ("No torch.optim optimizer stepped and t.step() was not called: iterations "
                    "were closed at the end of each backward pass.")
        if self.signal == Boundary.FORWARD:
            return ("No backward pass, optimizer step or t.step() was seen: iterations were "
                    "closed at each call of the first outermost module (inference).")
        return None
