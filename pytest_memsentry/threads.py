"""Counting what threads make during a test: dispatch modes are per thread, so the test's own
storage counter does not see a tensor made in a worker thread."""

from __future__ import annotations

import threading

from memsentry.measure.storage import StorageCounter, ThreadCounter


class ThreadWatch:
    """Counts what threads started during a test make: each new thread runs under a
    :class:`~memsentry.measure.storage.ThreadCounter` of the test's counter (dispatch modes
    are per thread, so the test's own mode does not see them). Threads that outlive the test
    stop counting when it ends; threads started before it (a session's pool) are not seen."""

    _lock = threading.Lock()

    def __init__(self, counter: StorageCounter) -> None:
        self._counter = counter
        self._modes: list[ThreadCounter] = []
        self._original = getattr(threading.Thread, "_bootstrap_inner", None)
        if self._original is None:
            return
        watch = self
        original = self._original

        def bootstrap_inner(thread: threading.Thread) -> None:
            mode = watch.enter()
            if mode is None:
                original(thread)
                return
            with mode:
                original(thread)

        with self._lock:
            threading.Thread._bootstrap_inner = bootstrap_inner  # type: ignore[attr-defined]

    def enter(self) -> ThreadCounter | None:
        """The mode a thread starting now runs under (``None`` once the test has ended)."""
        with self._lock:
            if self._original is None:
                return None
            mode = self._counter.in_thread()
            self._modes.append(mode)
            return mode

    def stop(self) -> None:
        with self._lock:
            if self._original is not None:
                threading.Thread._bootstrap_inner = self._original  # type: ignore[attr-defined]
                self._original = None
            for mode in self._modes:
                mode.counting = False


__all__ = ["ThreadWatch"]
