"""Backward passes that no module hook sees: a loop with no ``nn.Module`` and no optimizer
(weights as plain tensors updated by hand, as in many tutorials and notebooks) has no other
event to close its iterations.

While tracking, ``torch.autograd.backward`` (which ``Tensor.backward`` calls) is wrapped: the
wrapper runs the original unchanged, with the same arguments, result and exceptions, and after
a pass that returned tells the recorder. The original is put back at the end, unless something
else replaced it since (it is then left alone, and the wrapper does nothing).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.autograd

from memsentry.record.calls import graph_task

_compiling = torch.compiler.is_compiling

#: The trackers listening now (a tuple, replaced whole: the wrapper reads it at every
#: backward), and torch's function with the wrapper put in its place (one wrapper however many
#: trackers run, so that nesting never chains wrappers).
_listeners: tuple[PlainPasses, ...] = ()
_installed: tuple[Callable[..., Any], Callable[..., Any]] | None = None
_lock = threading.Lock()


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        nested = graph_task() != -1  # reentrant checkpointing's backward inside the pass
        result = original(tensors, *args, **kwargs)
        listeners = _listeners
        if listeners and not nested and not _compiling():
            for listener in listeners:
                try:
                    listener.ended(tensors)
                except Exception:  # measuring never breaks the user's backward
                    pass
        return result

    return backward


class PlainPasses:
    """Calls ``ended(tensors)`` after each ``torch.autograd.backward`` that returned, while
    installed; ``tensors`` are what the pass started from, as given to it (a tensor or a
    sequence of them)."""

    def __init__(self, ended: Callable[[Any], None]) -> None:
        self.ended = ended

    def install(self) -> None:
        global _installed, _listeners
        with _lock:  # trackers of several threads start and stop at any time
            if self in _listeners:
                return
            if _installed is None or torch.autograd.backward is not _installed[1]:
                original = torch.autograd.backward
                _installed = (original, _wrap(original))
                torch.autograd.backward = _installed[1]
            _listeners = (*_listeners, self)

    def remove(self) -> None:
        global _installed, _listeners
        with _lock:
            _listeners = tuple(known for known in _listeners if known is not self)
            if not _listeners and _installed is not None:
                original, wrapper = _installed
                if torch.autograd.backward is wrapper:  # else replaced since: leave it
                    torch.autograd.backward = original
                _installed = None
