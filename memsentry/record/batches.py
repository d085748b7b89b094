"""The wait for the next batch: the time a thread spends in a ``DataLoader`` iterator fetching
the next batch (``_next_data``: collating in the process, or waiting on the workers' queue),
summed per thread while any tracker runs.

The fetch method of torch's two DataLoader iterator classes is wrapped while at least one
tracker is started, and put back when the last stops; the wrapper returns and raises exactly
what the original does. ``__next__`` itself is left alone: its warnings name their caller's
line (``stacklevel=2``), which must stay the user's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from memsentry.record.workers import fetched, reset, starting

_lock = threading.Lock()
_users = 0
#: (class, the method found there) for each class wrapped.
_wrapped: list[tuple[type, Callable[..., Any]]] = []
#: Thread ident -> [batches fetched, seconds spent fetching], since the first tracker started.
_waits: dict[int, list[float]] = {}


def _iterator_classes() -> list[type]:
    try:
        from torch.utils.data import dataloader
    except Exception:  # a torch without DataLoader: nothing to time
        return []
    names = ("_SingleProcessDataLoaderIter", "_MultiProcessingDataLoaderIter")
    return [cls for cls in (getattr(dataloader, name, None) for name in names)
            if isinstance(cls, type) and callable(vars(cls).get("_next_data"))]


def _timed(original: Callable[..., Any], workers: bool) -> Callable[..., Any]:
    def _next_data(self: Any) -> Any:
        if workers:
            try:
                starting(self)  # a new iterator's workers: their baseline, not in the wait
            except Exception:
                pass
        began = time.perf_counter()
        try:
            data = original(self)
        finally:
            spent = time.perf_counter() - began
            ident = threading.get_ident()
            entry = _waits.get(ident)
            if entry is None:
                entry = _waits.setdefault(ident, [0, 0.0])
            entry[0] += 1
            entry[1] += spent
        if workers:
            try:
                fetched(self)
            except Exception:
                pass
        return data

    _next_data.__wrapped__ = original  # type: ignore[attr-defined]
    _next_data.__qualname__ = getattr(original, "__qualname__", "_next_data")
    return _next_data


def install() -> None:
    """Start timing batch fetches (once for all trackers)."""
    global _users
    with _lock:
        _users += 1
        if _users > 1:
            return
        reset()
        for cls in _iterator_classes():
            original = vars(cls)["_next_data"]
            _wrapped.append((cls, original))
            workers = cls.__name__ == "_MultiProcessingDataLoaderIter"
            setattr(cls, "_next_data", _timed(original, workers))  # noqa: B010


def uninstall() -> None:
    """Stop timing when the last tracker stops (a method someone else replaced meanwhile is
    left as they made it)."""
    global _users
    with _lock:
        _users = max(0, _users - 1)
        if _users:
            return
        while _wrapped:
            cls, original = _wrapped.pop()
            current = vars(cls).get("_next_data")
            if getattr(current, "__wrapped__", None) is original:
                setattr(cls, "_next_data", original)  # noqa: B010
        _waits.clear()


def waited() -> tuple[int, float]:
    """(batches fetched, seconds spent fetching) by the calling thread so far."""
    entry = _waits.get(threading.get_ident())
    return (0, 0.0) if entry is None else (int(entry[0]), entry[1])
