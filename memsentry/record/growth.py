"""Evidence that asks for a census in the always-on mode (``memsentry.watch``): the floor of
allocated memory at the boundaries read, rising since the last census.

A loop that keeps nothing comes back to the same floor every iteration (what an iteration
makes is freed by the next boundary, or replaced); one that keeps something raises it. The
floor is the lowest reading over the last :data:`WINDOW` boundaries read, so a peak that
happens to fall on a boundary asks for nothing. Once it stands :data:`STEP` bytes above the
floor when the last census was planned, a census is asked for: it names what grew.
"""

from __future__ import annotations

from collections import deque

#: Boundary readings the floor is taken over.
WINDOW = 8
#: Bytes the floor must rise by since the last census to ask for another.
STEP = 1 << 20


class GrowthEvidence:
    """The boundary readings of the running window, and the floor at the last census."""

    def __init__(self, step: int = STEP) -> None:
        self.step = step
        self._reads: deque[int] = deque(maxlen=WINDOW)
        self._floor_then: int | None = None

    def add(self, allocated: int) -> None:
        self._reads.append(allocated)

    def asks(self) -> bool:
        """Whether the floor rose by :attr:`step` since the last census was planned."""
        if len(self._reads) < WINDOW:
            return False
        floor = min(self._reads)
        if self._floor_then is None:
            self._floor_then = floor
            return False
        return floor - self._floor_then >= self.step

    def planned(self) -> None:
        """A census was planned: growth is measured from the floor now."""
        if self._reads:
            self._floor_then = min(self._reads)
