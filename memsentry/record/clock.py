"""The one clock of a recorder: every duration memsentry measures or charges is a difference
of its readings. ``time.perf_counter`` unless a test gives another (tests/fake_clock.py), so
that what the policy decides from durations can be tested without depending on the machine's
load."""

from __future__ import annotations

from collections.abc import Callable

#: A clock: seconds since an arbitrary start, never going back.
Clock = Callable[[], float]

__all__ = ["Clock"]
