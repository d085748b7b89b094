"""Trackers in threads: which thread a tracker's loop runs in, and the process-wide pieces that
several trackers share without one thread ever changing what another is reading.

- Each tracker's loop belongs to one thread (:class:`Owner`): the thread that started it, or,
  for a tracker given a model, the thread that calls that model first. Module calls,
  optimizer steps and backward calls from other threads are not its own.
- PyTorch runs the global optimizer step hooks in a Python ``for`` loop over its registry, so
  registering or removing one while another thread steps an optimizer raises
  ``OrderedDict mutated during iteration`` in that thread. memsentry registers one hook for
  the process (:func:`listen_to_steps`), which calls the trackers listening now (a tuple,
  replaced whole, never changed in place), and removes it only when no other live thread
  was seen stepping an optimizer.
- A census pauses the garbage collector; trackers in several threads pause it together
  (:func:`collector_paused`), and the last one to finish puts back what the user had.
- The process's figures (the C heap on CPU, a device's allocator) count every thread's
  memory. Each thread's optimizer steps and tracked iterations are counted
  (:func:`mark_activity`), so that a tracker can say how many other threads ran a loop while
  it tracked its own (:meth:`Owner.others`): the rules judge its figures on that.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Callable, Iterator
from typing import Any

from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.hooks import RemovableHandle

StepListener = Callable[[Any, Any, Any], None]

#: Optimizer steps and tracked iterations by thread, since the first tracker began. Each
#: thread writes only its own entry; readers copy the dict whole.
_activity: dict[int, int] = {}
_get_ident = threading.get_ident  # bound once: the step hook below runs at every step


def mark_activity() -> None:
    """Count a step of the calling thread's loop (an optimizer step, an iteration ended)."""
    ident = _get_ident()
    _activity[ident] = _activity.get(ident, 0) + 1


class Owner:
    """The thread whose loop a tracker measures, and the other threads that ran a loop while
    it did."""

    __slots__ = ("_others", "_since", "adoptable", "ident")

    def __init__(self, *, adoptable: bool) -> None:
        self.ident: int | None = None
        # A tracker given a model follows the thread that calls it first, when that is not
        # the thread that started it (a loop started in one thread and run in another).
        self.adoptable = adoptable
        self._since: dict[int, int] = {}
        self._others: int | None = None  # frozen by release()

    def claim(self) -> None:
        self.ident = threading.get_ident()
        self._since, self._others = dict(_activity), None

    def others(self) -> int:
        """How many threads other than the loop's stepped an optimizer or ended a tracked
        iteration between :meth:`claim` and :meth:`release` (or now)."""
        if self._others is not None:
            return self._others
        now = dict(_activity)
        return sum(1 for ident, count in now.items()
                   if ident != self.ident and count != self._since.get(ident, 0))

    def release(self) -> None:
        """Tracking ended: :meth:`others` keeps its count from now on."""
        if self._others is None:
            self._others = self.others()

    def mine(self) -> bool:
        return threading.get_ident() == self.ident

    def adopt(self) -> None:
        self.ident = threading.get_ident()


# -- the optimizer step hook of the process ------------------------------------------------
_lock = threading.Lock()
_listeners: tuple[StepListener, ...] = ()
_handle: RemovableHandle | None = None


_steppers: set[int] = set()  # threads seen stepping an optimizer while the hook was there


def _dispatch(optimizer: Any, args: Any, kwargs: Any) -> None:
    ident = _get_ident()
    _steppers.add(ident)
    _activity[ident] = _activity.get(ident, 0) + 1  # mark_activity(), inlined: every step
    for listener in _listeners:
        listener(optimizer, args, kwargs)


def _others_step() -> bool:
    """Whether a thread other than this one, still alive, was seen stepping an optimizer."""
    others = {thread.ident for thread in threading.enumerate()} - {threading.get_ident()}
    return bool(others & _steppers)


def listen_to_steps(listener: StepListener) -> None:
    """Call ``listener(optimizer, args, kwargs)`` after every optimizer step."""
    global _listeners, _handle
    with _lock:
        if listener not in _listeners:
            _listeners = (*_listeners, listener)
        if _handle is None:
            _handle = register_optimizer_step_post_hook(_dispatch)


def forget_steps(listener: StepListener) -> None:
    """Stop calling ``listener``. The process's hook goes when nothing listens and no other
    live thread was seen stepping an optimizer (one that is might be in a step: removing the
    hook then would break it); else it stays, calling nobody, until a later stop can remove
    it."""
    global _listeners, _handle
    with _lock:
        _listeners = tuple(known for known in _listeners if known != listener)
        if not _listeners and _handle is not None and not _others_step():
            _handle.remove()
            _handle = None
            _steppers.clear()


def step_hook_ids() -> set[int]:
    """The id of memsentry's optimizer step hook in PyTorch's registry (none: empty)."""
    handle = _handle
    return {handle.id} if handle is not None else set()


# -- the garbage collector, paused by censuses ----------------------------------------------
_paused = 0
_was_enabled = True


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Automatic collections off for the block; the user's setting back when the last
    overlapping block (of any thread) ends."""
    global _paused, _was_enabled
    with _lock:
        if _paused == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _paused += 1
    try:
        yield
    finally:
        with _lock:
            _paused -= 1
            if _paused == 0 and _was_enabled:
                gc.enable()


__all__ = ["Owner", "collector_paused", "forget_steps", "listen_to_steps",
           "mark_activity", "step_hook_ids"]
