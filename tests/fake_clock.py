"""A clock that moves only when a test moves it: given to a recorder (through
``Tracker._with_policy(clock=...)``), every duration memsentry clocks is what the test says,
so what the policy decides from durations no longer depends on the machine's load."""

from __future__ import annotations


class FakeClock:
    """Seconds that advance by ``tick`` at each reading (0: only through :meth:`advance`)."""

    def __init__(self, start: float = 1000.0, tick: float = 0.0) -> None:
        self.now = start
        self.tick = tick
        self.readings = 0

    def __call__(self) -> float:
        self.readings += 1
        self.now += self.tick
        return self.now

    def advance(self, seconds: float) -> None:
        """The loop's own work took ``seconds``."""
        self.now += seconds
