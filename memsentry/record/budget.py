"""The ledger of one recorder: every part of memsentry's work clocked, and the time account
the policy (:mod:`memsentry.record.policy`) decides from.

Every part of memsentry's work is clocked into one ledger: the module hooks (and what PyTorch
adds to a call for having hooks at all), the saved-tensor and backward hooks, the work at
iteration boundaries, reading the four parts, the holder searches (censuses) and running the
rules while the loop runs. Measuring (hooks, boundaries, parts) and judging (censuses,
analysis) are paid from one account that earns ``share`` of the loop's own time at every
iteration. Judging also begins with a credit: the same share of the time the program ran with
no tracker (a program's start, Python and importing torch, is part of its wall time: 1 to 3 s
here; 10 s of it at most), so that the first censuses of a run are paid for at once. The
report says what the credit was and what it paid.
"""

from __future__ import annotations

import time
from pathlib import Path

from memsentry.model import Cost, PartCost
from memsentry.record.clock import Clock
from memsentry.record.policy import (
    DEFAULT,
    Account,
    Ended,
    Kind,
    Tuning,
    bank,
    credit_for,
    held,
    is_first,
    next_kind,
    overdrawn,
    prices_after,
    shortfall,
)
from memsentry.record.unseen import CALL_SECONDS, Unseen, call_seconds

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
#: What judging is charged to; measuring is charged to the other parts.
JUDGING = (CENSUSES, ANALYSIS)


class Untracked:
    """How long the process ran with no tracker: its life (``age``) less the time some tracker
    ran (on ``clock``, the wall clock of the process)."""

    def __init__(self, age: Clock | None = None, clock: Clock = time.monotonic) -> None:
        self.running = 0
        self.tracked = 0.0  # seconds some tracker ran, before the running ones began
        self._began = 0.0  # the clock's reading when the running trackers began
        self._age = age if age is not None else process_age
        self._clock = clock

    def begin(self) -> float:
        """A tracker begins: the seconds the process ran with no tracker until now (none for
        a tracker nested in another: the outer one's loop runs)."""
        self.running += 1
        if self.running > 1:
            return 0.0
        self._began = self._clock()
        return max(0.0, self._age() - self.tracked)

    def end(self) -> None:
        if self.running == 1:
            self.tracked += max(0.0, self._clock() - self._began)
        self.running = max(0, self.running - 1)


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


#: The process's one record of when it last ran untracked.
UNTRACKED = Untracked()


class Budget:
    """The ledger of one recorder, and the account the policy reads (:meth:`account`).

    ``share`` is the share of the loop's own time memsentry may take (``None``: no limit,
    every iteration sampled and every census taken when due). ``light`` says whether the
    running iteration is light (set from the plan at each boundary). ``clock`` is the one
    clock of the recorder (``time.perf_counter`` unless a test gives another)."""

    def __init__(self, share: float | None, *, credit: float | None = None,
                 tuning: Tuning = DEFAULT, clock: Clock = time.perf_counter,
                 untracked: Untracked | None = None) -> None:
        self.share = share
        self._untracked = untracked if untracked is not None else UNTRACKED
        self.tuning = tuning
        self.clock = clock
        # What PyTorch's calls into memsentry cost beyond its clocked work, on this machine
        # (a test's clock has none to calibrate on).
        self.unseen = Unseen.of(call_seconds() if clock is time.perf_counter else CALL_SECONDS)
        self.light = False
        self.loop = 0.0  # the loop's own seconds so far
        self._given = credit  # the untracked seconds to credit (None: as the process ran)
        self.credit = 0.0  # seconds judging may spend before the loop earned any
        self.untracked = 0.0  # the untracked seconds it was given for
        self.reserved = 0.0  # put aside for a census that waits for the account
        if credit is not None:
            self.credit = credit_for(credit, share, tuning)
            self.untracked = credit
        self._open = False
        self._seconds = dict.fromkeys(LEDGER, 0.0)
        self._events = dict.fromkeys(LEDGER, 0)
        self.spent = 0.0  # on measuring
        self.judged = 0.0  # on judging
        self._inside = 0.0  # own seconds clocked inside the running iteration's time
        self.iterations = 0
        self.sampled = 0
        self.deferred = 0
        self._prices = (0.0, 0.0)  # own seconds of a sampled and of a light iteration
        self._cut = False  # the running sampled iteration stopped measuring (overdrawn)
        self._began = clock()  # when the running iteration began
        self._judged_began = 0.0  # what judging had spent then
        self._first = (0.0, 0.0)  # own and loop seconds inside the first iterations

    def open(self) -> None:
        """Tracking begins: the judging account is credited for the untracked time before."""
        if not self._open:
            self._open = True
            untracked = self._untracked.begin()
            if self._given is None:
                self.credit = credit_for(untracked, self.share, self.tuning)
                self.untracked = untracked
            self._began = self.clock()

    def close(self) -> None:
        if self._open:
            self._open = False
            self._untracked.end()

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
        """Charge ``part`` with the time since ``started`` (a reading of :attr:`clock`)."""
        self.charge(part, self.clock() - started, events)

    def account(self) -> Account:
        """The account as the policy reads it."""
        sampled, light = self._prices
        return Account(share=self.share, loop=self.loop, credit=self.credit, spent=self.spent,
                       judged=self.judged, reserved=self.reserved, iterations=self.iterations,
                       sampled_price=sampled, light_price=light)

    @property
    def held(self) -> float:
        """Seconds the account holds (``inf`` without a limit)."""
        return held(self.share, self.loop, self.credit, self.spent, self.judged)

    @property
    def bank(self) -> float:
        """Seconds measuring may still spend (``inf`` without a limit)."""
        return bank(self.held, self.credit, self.judged, self.reserved)

    def overdrawn(self) -> bool:
        """Whether the running sampled iteration has spent more than it may
        (:func:`memsentry.record.policy.overdrawn`): its calls of layers already measured
        are then counted, not measured. Marks the iteration as cut, so that its cost does
        not lower the price of the next sampled one."""
        if self.share is None:
            return False
        first = self.first
        loop = 0.0
        if first:  # the loop's own time in the iteration so far
            loop = max(0.0, self.clock() - self._began - self._inside
                       - (self.judged - self._judged_began))
        if not overdrawn(self.bank, first=first, own=self._inside, loop=loop,
                         tuning=self.tuning):
            return False
        self._cut = True
        return True

    @property
    def first(self) -> bool:
        """Whether the running iteration is one of the first, sampled whatever the account
        holds."""
        return is_first(self.iterations, self.tuning)

    # -- iterations ----------------------------------------------------------------------
    def end_iteration(self, seconds: float, iterations: int = 1, *,
                      began: float | None = None) -> Account:
        """The running iteration (or ``iterations`` light ones) ended after ``seconds`` of
        clocked time: the loop's time and the prices are brought up to date, and the next
        iteration is sampled or light as the policy says. ``began``: when the next one began
        on the iteration clock (the boundary's own work, charged after this call, is inside
        it); now when not given. Returns the account as it stands after the ended iteration
        (what :meth:`account` would build until the next charge)."""
        own = self._inside
        self._inside = 0.0
        self.loop += max(0.0, seconds - own)
        if self.first:
            spent, loop = self._first
            self._first = (spent + own, loop + max(0.0, seconds - own))
        ended = Ended(index=self.iterations, seconds=seconds, own=own, light=self.light,
                      cut=self._cut, iterations=iterations)
        self.iterations += iterations
        if not self.light:
            self.sampled += 1
        account = prices_after(self.account(), ended, self.tuning)
        self._prices = (account.sampled_price, account.light_price)
        self._cut = False
        self.light = next_kind(account, self.tuning)[0] is Kind.LIGHT
        self._began = self.clock() if began is None else began
        self._judged_began = self.judged
        return account

    def merged(self, iterations: int, sampled: int) -> None:
        """``iterations`` ended iterations, ``sampled`` of them sampled, were parts of the one
        ending now."""
        self.iterations = max(0, self.iterations - iterations)
        self.sampled = max(0, min(self.sampled - sampled, self.iterations))

    def short(self) -> float:
        """Seconds the bank lacks to pay for a sampled iteration over a light one (0 or
        less: it can)."""
        return shortfall(self.account())

    def cost(self) -> Cost:
        return Cost(
            budget=self.share, loop_seconds=self.loop,
            parts=tuple(PartCost(part, self._seconds[part], self._events[part])
                        for part in LEDGER),
            iterations=self.iterations, sampled=self.sampled,
            censuses_deferred=self.deferred, first_seconds=self._first[0],
            first_loop_seconds=self._first[1], credit=self.credit,
            untracked_seconds=self.untracked,
        )


def budget_notes(cost: Cost, tuning: Tuning = DEFAULT) -> list[str]:
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
    if cost.first_seconds >= tuning.first_noted and cost.first_seconds > cost.budget * ran:
        notes.append(
            f"The first {tuning.sampled_first} iterations are measured whatever the budget "
            "holds, so that every layer has figures from the start: memsentry's clocked work took "
            f"{cost.first_seconds:.2f} s of the {ran:.2f} s they ran (PyTorch's calls into "
            "its hooks come on top). Every layer is measured once in them; the other calls "
            f"stop being measured once measuring took {tuning.first_share:.0%} of the loop's time. "
            "That is paid once: a longer run spreads it.")
    credit = credit_note(cost, tuning)
    if credit:
        notes.append(credit)
    if cost.censuses_deferred:
        notes.append(
            f"{cost.censuses_deferred:,} holder search(es) waited until the budget could pay "
            f"for them ({cost.part(CENSUSES).each * 1e3:.0f} ms each); a leak is named "
            "later than it would be without a budget (track(overhead=None) takes each when "
            "due).")
    return notes


def credit_note(cost: Cost, tuning: Tuning = DEFAULT) -> str | None:
    """What the report says of the judging credit, when holder searches spent from it."""
    judged = cost.part(CENSUSES).seconds + cost.part(ANALYSIS).seconds
    if cost.budget is None or cost.credit <= 0 or judged <= 0:
        return None
    paid = min(judged, cost.credit)
    counted = min(cost.untracked_seconds, tuning.startup_credit)
    return (
        f"memsentry's holder searches began on a credit of {cost.credit * 1e3:.1f} ms: "
        f"{cost.credit / counted:.0%} (the budget's share) of the {counted:.1f} s the program "
        f"ran with no tracker before ({tuning.startup_credit:.0f} s at most are counted); "
        f"they spent {paid * 1e3:.1f} ms of it and {max(0.0, judged - paid) * 1e3:.1f} ms "
        "of what the loop's time earned.")
