"""Stepping aside for ``torch.jit.trace``: the TorchScript tracer does not see ops that a
Python dispatch mode ran, so tracing a convolution under memsentry's counting modes fails
("Cannot insert a Tensor that requires grad as a constant"; checked with torch 2.13 and a mode
that only calls the op). While a counting mode is active, the tracer's entry points in
``torch.jit._trace`` run with the counting modes off the mode stack: the ops a trace runs are
not counted, and the trace is the one the user's program makes without memsentry.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch.utils._python_dispatch import (
    _get_current_dispatch_mode,
    _pop_mode_temporarily,
)

#: The functions of ``torch.jit._trace`` that start a trace (``torch.jit.trace`` calls the
#: first through the module's globals, modules' traces go through the second).
ENTRY_POINTS = ("_trace_impl", "trace_module")

_lock = threading.Lock()
_users = 0
_originals: dict[str, Callable[..., Any]] = {}


@contextmanager
def _counting_modes_off(kind: type) -> Iterator[None]:
    """Take the counting modes on top of this thread's mode stack off it for the block."""
    mode = _get_current_dispatch_mode()
    if not isinstance(mode, kind):
        yield
        return
    with _pop_mode_temporarily(), _counting_modes_off(kind):
        yield


def _aside(function: Callable[..., Any], kind: type) -> Callable[..., Any]:
    @functools.wraps(function)
    def traced_without_counting(*args: Any, **kwargs: Any) -> Any:
        with _counting_modes_off(kind):
            return function(*args, **kwargs)

    traced_without_counting.__memsentry_original__ = function  # type: ignore[attr-defined]
    return traced_without_counting


def enter(kind: type) -> None:
    """A counting mode of class ``kind`` became active: wrap the tracer's entry points."""
    global _users
    with _lock:
        _users += 1
        if _users > 1:
            return
        try:
            from torch.jit import _trace
        except ImportError:  # a torch without TorchScript
            return
        for name in ENTRY_POINTS:
            function = getattr(_trace, name, None)
            if callable(function):
                _originals[name] = function
                setattr(_trace, name, _aside(function, kind))


def leave() -> None:
    """A counting mode ended: when it was the last, put the entry points back."""
    global _users
    with _lock:
        _users = max(0, _users - 1)
        if _users:
            return
        try:
            from torch.jit import _trace
        except ImportError:
            return
        for name, function in _originals.items():
            current = getattr(_trace, name, None)
            if getattr(current, "__memsentry_original__", None) is function:
                setattr(_trace, name, function)
        _originals.clear()


__all__ = ["ENTRY_POINTS", "enter", "leave"]
