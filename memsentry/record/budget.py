"""One budget for everything memsentry does while a loop runs.

Every part of memsentry's work is clocked into one ledger: the module hooks (and what PyTorch
adds to a call for having hooks at all), the saved-tensor and backward hooks, the work at
iteration boundaries, reading the four parts, the holder searches (censuses) and running the
rules while the loop runs. The budget is a share of the loop's own time, kept like one bank
account: each iteration of the loop pays ``share`` times its own time into it, and both kinds
of work are paid from it.

- *Judging* (censuses, and the rules run on their results) comes first: a census that is due
  waits until the account holds what the last one cost (the seven of iterations 2 to 34 are
  taken when due, whatever it holds: they decide a short run's trends), and while it waits,
  that sum is put aside for it.
- *Measuring* (hooks, boundaries, parts) is paid from the rest. An iteration is *sampled*
  (every layer call measured, saved tensors and backwards attributed, the parts read) when
  the account holds what a sampled iteration costs over a light one; otherwise it is
  *light*: only its boundaries are read, some of them, and no module keeps a hook (or only
  the module whose calls end its iterations). A sampled iteration that spends more than the
  account held counts its remaining calls instead of measuring them.
- The first :data:`SAMPLED_FIRST` iterations are sampled whatever the account holds, so that
  every layer has figures from the start; but once measuring in one of them has taken more
  than :data:`FIRST_SHARE` of the loop's own time in it so far (and more than
  :data:`FIRST_FLOOR`), it measures only the calls of layers never measured and counts the
  others. An episode of 200 small forwards, or a model of 2,000 layers on a heap where each
  read of ``mallinfo2()`` takes 100 us, would otherwise cost several times its own time in
  each of them.

A program's start (Python, importing torch: 1 to 3 s on this project's machines) is part of
its wall time, so judging has a credit of :data:`STARTUP_SHARE` (or the budget's own share
when smaller: ``watch()``'s 1%) of the time the process ran untracked since it began or since
the last tracking ended (:data:`STARTUP_CREDIT` seconds of it at most): the first censuses of
a short run are paid for at once, and the whole program stays within 1.1 times its time
without memsentry, however many trackers it runs.
Measuring never spends the credit.

So whatever the step size, memsentry's time stays near ``share`` of the loop's, and a loop of
large steps (where measuring costs little next to the step) is sampled in every iteration.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from memsentry.model import Cost, PartCost

#: The parts of the ledger.
HOOKS = "module hooks"
SAVED = "saved tensors"
BACKWARD = "backward hooks"
BOUNDARIES = "boundaries"
PARTS = "parts"
WORKERS = "workers"  # reading the DataLoader workers' memory (inside the batch fetches)
CENSUSES = "censuses"
ANALYSIS = "analysis"
LEDGER = (HOOKS, SAVED, BACKWARD, BOUNDARIES, PARTS, WORKERS, CENSUSES, ANALYSIS)
#: Seconds of the program's life before tracking began that the censuses' account is
#: credited for, at most, and the share of them it may spend.
STARTUP_CREDIT = 10.0
STARTUP_SHARE = 0.05
#: What measuring and judging are charged to.
MEASURING = (HOOKS, SAVED, BACKWARD, BOUNDARIES, PARTS, WORKERS)
JUDGING = (CENSUSES, ANALYSIS)
#: Iterations sampled whatever the account holds, so every layer has figures from the start.
SAMPLED_FIRST = 3
#: In those, measuring stops at layers already measured once memsentry's own time in the
#: iteration is over this share of the loop's own time in it so far, and over the floor.
FIRST_SHARE = 0.25
FIRST_FLOOR = 2e-3
#: memsentry's time in the first iterations (seconds) past which the report says what they
#: cost, when that is over the budget's share of the loop's time in them.
FIRST_NOTED = 0.1
#: How the price of a sampled iteration falls back after a dear one: by this factor at each
#: sampled iteration that cost less.
SAMPLED_DECAY = 0.8
#: What PyTorch adds to a module call for having a pre and a post hook that return at once
#: (5.9 us, measured on this project's CI machine).
DISPATCH = 6e-6
#: What a census costs until one was clocked (a small process: 5 to 30 ms here).
CENSUS_GUESS = 0.02


class _Untracked:
    """When the process last ran untracked: since its start, or since the last tracking
    ended; while any tracker runs, it does not."""

    def __init__(self) -> None:
        self.running = 0
        self.since: float | None = None  # time.monotonic() when tracking last ended

    def begin(self) -> float:
        """A tracker begins: the seconds the process ran untracked until now."""
        now = time.monotonic()
        self.running += 1
        if self.running > 1:
            return 0.0
        return now - self.since if self.since is not None else process_age()

    def end(self) -> None:
        self.running = max(0, self.running - 1)
        if not self.running:
            self.since = time.monotonic()


UNTRACKED = _Untracked()


def process_age() -> float:
    """Seconds since this process started (0 where the system does not say)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / _ticks()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - started)
    except (OSError, ValueError, IndexError):
        return 0.0


def _ticks() -> int:
    import os

    try:
        return int(os.sysconf("SC_CLK_TCK"))
    except (ValueError, OSError, AttributeError):
        return 100


class Budget:
    """The ledger of one recorder, and what it may still afford.

    ``share`` is the share of the loop's own time memsentry may take (``None``: no limit, every
    iteration sampled and every census taken when due). ``light`` says whether the running
    iteration is light."""

    def __init__(self, share: float | None, *, credit: float | None = None) -> None:
        self.share = share
        self.light = False
        self.loop = 0.0  # the loop's own seconds so far
        self._given = credit  # the untracked seconds to credit (None: as the process ran)
        self.credit = 0.0  # seconds memsentry may spend before the loop earned any
        self.reserved = 0.0  # put aside for a census that waits for the account
        if credit is not None:
            self.credit = self._credit_for(credit)
        self._open = False
        self._seconds = dict.fromkeys(LEDGER, 0.0)
        self._events = dict.fromkeys(LEDGER, 0)
        self.spent = 0.0  # on measuring
        self.judged = 0.0  # on judging
        self._inside = 0.0  # own seconds clocked inside the running iteration's time
        self.iterations = 0
        self.sampled = 0
        self.deferred = 0
        self._sampled_cost = 0.0  # own seconds a sampled iteration may cost (see below)
        self._cut = False  # the running sampled iteration stopped measuring (overdrawn)
        self._light_cost = 0.0  # own seconds of the last light one
        self._began = time.perf_counter()  # when the running iteration began
        self._judged_began = 0.0  # what judging had spent then
        self._first = (0.0, 0.0)  # own and loop seconds inside the first iterations

    def open(self) -> None:
        """Tracking begins: the judging account is credited for the untracked time before."""
        if not self._open:
            self._open = True
            untracked = UNTRACKED.begin()
            if self._given is None:
                self.credit = self._credit_for(untracked)
            self._began = time.perf_counter()

    def _credit_for(self, untracked: float) -> float:
        """The judging credit for ``untracked`` seconds before tracking began."""
        share = STARTUP_SHARE if self.share is None else min(STARTUP_SHARE, self.share)
        return share * min(untracked, STARTUP_CREDIT)

    def close(self) -> None:
        if self._open:
            self._open = False
            UNTRACKED.end()

    # -- the ledger ----------------------------------------------------------------------
    def charge(self, part: str, seconds: float, events: int = 1, *, inside: bool = True) -> None:
        """``seconds`` of memsentry's work on ``part``; ``inside``: they ran within the
        running iteration's clocked time (its hooks), not moved out of it (a census)."""
        self._seconds[part] += seconds
        self._events[part] += events
        if part in JUDGING:
            self.judged += seconds
        else:
            self.spent += seconds
        if inside:
            self._inside += seconds

    def since(self, part: str, started: float, events: int = 1) -> None:
        """Charge ``part`` with the time since ``started`` (``time.perf_counter()``)."""
        self.charge(part, time.perf_counter() - started, events)

    @property
    def held(self) -> float:
        """Seconds the account holds (``inf`` without a limit)."""
        if self.share is None:
            return math.inf
        return self.share * self.loop + self.credit - self.spent - self.judged

    @property
    def bank(self) -> float:
        """Seconds memsentry may still spend measuring: what the account holds less the
        credit judging has not spent (the credit is for censuses) and what a waiting census
        needs (``inf`` without a limit)."""
        if self.share is None:
            return math.inf
        return self.held - max(0.0, self.credit - self.judged) - self.reserved

    def overdrawn(self) -> bool:
        """Whether a sampled iteration has spent more than it may: past the first ones, more
        than the budget held (an episode far longer than the last one sampled); in the first
        ones, more than :data:`FIRST_SHARE` of the loop's own time in it so far. Its calls of
        layers already measured are then counted, not measured. Marks the iteration as cut,
        so that its cost does not lower the price of the next sampled one."""
        if self.share is None:
            return False
        if self.first:
            own = self._inside
            if own <= FIRST_FLOOR:
                return False
            loop = max(0.0, time.perf_counter() - self._began - own
                       - (self.judged - self._judged_began))
            if own <= FIRST_SHARE * loop:
                return False
        elif self.bank >= 0:
            return False
        self._cut = True
        return True

    @property
    def first(self) -> bool:
        """Whether the running iteration is one of the first, sampled whatever the account
        holds."""
        return self.iterations < SAMPLED_FIRST

    def afford(self, seconds: float) -> bool:
        """Whether judging (a census, the rules after it) can spend ``seconds`` now."""
        return self.held >= seconds

    # -- iterations ----------------------------------------------------------------------
    def end_iteration(self, seconds: float, iterations: int = 1, *,
                      began: float | None = None) -> None:
        """The running iteration (or ``iterations`` light ones) ended after ``seconds`` of
        clocked time; decides whether the next one is sampled. ``began``: when the next one
        began on the iteration clock (``time.perf_counter()``; the boundary's own work,
        charged after this call, is inside it); now when not given."""
        own = self._inside
        self._inside = 0.0
        self.loop += max(0.0, seconds - own)
        if self.first:
            spent, loop = self._first
            self._first = (spent + own, loop + max(0.0, seconds - own))
        self.iterations += iterations
        if self.light:
            self._light_cost = own / iterations
        else:
            self.sampled += 1
            # Iterations of one loop differ (an RL episode's acting, then its updates): the
            # dearest recent one sets the price, or one dear iteration after cheap ones
            # would overdraw the budget each time the bank refills.
            # One that stopped measuring half way says only that a whole one costs more.
            decay = 1.0 if self._cut else SAMPLED_DECAY
            self._sampled_cost = max(own, decay * self._sampled_cost)
        self._cut = False
        self.light = not (self.first or self.short() <= 0)
        self._began = time.perf_counter() if began is None else began
        self._judged_began = self.judged

    def merged(self, iterations: int, sampled: int) -> None:
        """``iterations`` ended iterations, ``sampled`` of them sampled, were parts of the one
        ending now."""
        self.iterations = max(0, self.iterations - iterations)
        self.sampled = max(0, min(self.sampled - sampled, self.iterations))

    def short(self) -> float:
        """Seconds the bank lacks to pay for a sampled iteration over a light one (0 or
        less: it can)."""
        return max(0.0, self._sampled_cost - self._light_cost) - self.bank

    def cost(self) -> Cost:
        return Cost(
            budget=self.share, loop_seconds=self.loop,
            parts=tuple(PartCost(part, self._seconds[part], self._events[part])
                        for part in LEDGER),
            iterations=self.iterations, sampled=self.sampled,
            censuses_deferred=self.deferred, first_seconds=self._first[0],
            first_loop_seconds=self._first[1],
        )


def budget_notes(cost: Cost) -> list[str]:
    """What the report says when memsentry thinned out to keep its budget."""
    notes: list[str] = []
    if cost.budget is None:
        return notes
    light = cost.iterations - cost.sampled
    if light > 0:
        notes.append(
            f"memsentry kept to its budget of {cost.budget:.0%} of the loop's time "
            f"(track(overhead=...)): it measured layers in {cost.sampled:,} of "
            f"{cost.iterations:,} iterations and read only the boundaries of the others, so "
            "the layer table comes from those iterations; the holder searches are whole. "
            "track(overhead=None) measures every iteration.")
    ran = cost.first_seconds + cost.first_loop_seconds
    if cost.first_seconds >= FIRST_NOTED and cost.first_seconds > cost.budget * ran:
        notes.append(
            f"The first {SAMPLED_FIRST} iterations are measured whatever the budget holds, so "
            f"that every layer has figures from the start: memsentry's clocked work took "
            f"{cost.first_seconds:.2f} s of the {ran:.2f} s they ran (PyTorch's calls into "
            "its hooks come on top). Every layer is measured once in them; the other calls "
            f"stop being measured once measuring took {FIRST_SHARE:.0%} of the loop's time. "
            "That is paid once: a longer run spreads it.")
    if cost.censuses_deferred:
        notes.append(
            f"{cost.censuses_deferred:,} holder search(es) waited until the budget could pay "
            f"for them ({cost.part(CENSUSES).each * 1e3:.0f} ms each); a leak is named "
            "later than it would be without a budget (track(overhead=None) takes each when "
            "due).")
    return notes
