"""What memsentry itself cost a tracking run, part by part, against the loop's own time."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PartCost:
    """One part of memsentry's work: ``seconds`` spent over ``events`` occasions (hook calls,
    boundaries, counter readings, censuses, rule runs)."""

    part: str
    seconds: float
    events: int

    @property
    def each(self) -> float:
        """Seconds per occasion (0 without one)."""
        return self.seconds / self.events if self.events else 0.0


@dataclass(frozen=True)
class Cost:
    """memsentry's own time in a run and the loop's, and how the budget was kept.

    ``budget`` is the share of the loop's time memsentry may take (``None``: no limit);
    ``loop_seconds`` the loop's own time (iterations less memsentry's work in them);
    ``iterations`` the iterations ended, of which ``sampled`` were measured layer by layer
    (the others only at their boundaries); ``censuses_deferred`` the holder searches put off
    until the budget could pay for them. ``first_seconds`` is memsentry's own time inside the
    first iterations, which are measured whatever the budget holds, and
    ``first_loop_seconds`` the loop's own time in them. ``credit`` is what judging could spend
    before the loop earned anything: the budget's share of the ``untracked_seconds`` the
    program ran with no tracker before this one began."""

    budget: float | None
    loop_seconds: float
    parts: tuple[PartCost, ...] = ()
    iterations: int = 0
    sampled: int = 0
    censuses_deferred: int = 0
    first_seconds: float = 0.0
    first_loop_seconds: float = 0.0
    credit: float = 0.0
    untracked_seconds: float = 0.0

    @property
    def own_seconds(self) -> float:
        return sum(p.seconds for p in self.parts)

    @property
    def share(self) -> float:
        """memsentry's time over the loop's own (0.04: 4% on top of the loop)."""
        return self.own_seconds / self.loop_seconds if self.loop_seconds > 0 else 0.0

    def part(self, name: str) -> PartCost:
        for part in self.parts:
            if part.part == name:
                return part
        return PartCost(name, 0.0, 0)
