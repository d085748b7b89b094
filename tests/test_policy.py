"""The policy on sequences of iteration facts, without torch or a clock: which iterations are
sampled, how the window of layers moves, which hooks a light iteration keeps, when censuses
are taken. Each decision is a pure function, so each test states the facts it decides from."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from fake_clock import FakeClock

from memsentry.record.budget import HOOKS, Budget
from memsentry.record.policy import (
    DEFAULT,
    Account,
    CensusState,
    Ended,
    HookState,
    Kind,
    Signal,
    Window,
    always_taken_through,
    census_due,
    census_step,
    next_census,
    next_kind,
    next_window,
    overdrawn,
    passes,
    plan_next,
    prices_after,
    shortfall,
)

MS = 1e-3



def _run(budget: Budget, clock: FakeClock, steps: int, *, loop: float,
         sampled_cost: float, light_cost: float = 0.0) -> list[bool]:
    """Drive ``budget`` through ``steps`` iterations of ``loop`` seconds of the loop's own
    work, measuring costing ``sampled_cost`` in a sampled one and ``light_cost`` in a light
    one; returns which iterations were light."""
    light = []
    for _ in range(steps):
        light.append(budget.light)
        own = light_cost if budget.light else sampled_cost
        began = clock.now
        clock.advance(loop + own)
        budget.charge(HOOKS, own)
        budget.end_iteration(clock.now - began)
    return light


# -- sampled or light -----------------------------------------------------------------------


def test_the_first_iterations_are_sampled_whatever_the_account_holds() -> None:
    account = Account(share=0.01, iterations=0, sampled_price=10.0)
    assert [next_kind(replace(account, iterations=n))[0] for n in range(5)] == [
        Kind.SAMPLED, Kind.SAMPLED, Kind.SAMPLED, Kind.LIGHT, Kind.LIGHT]
    assert "first 3" in next_kind(account)[1]


def test_without_a_budget_every_iteration_is_sampled() -> None:
    account = Account(share=None, iterations=1_000, sampled_price=10.0)
    kind, reason = next_kind(account)
    assert kind is Kind.SAMPLED and "overhead=None" in reason
    assert account.held == math.inf and account.bank == math.inf


def test_an_iteration_is_sampled_once_the_account_pays_for_it() -> None:
    # 5% of 100 ms of loop time earned, 1 ms spent: 4 ms held; a sampled iteration costs
    # 4 ms more than a light one (5 ms against 1 ms).
    account = Account(share=0.05, loop=0.1, spent=1 * MS, iterations=10,
                      sampled_price=5 * MS, light_price=1 * MS)
    assert shortfall(account) == pytest.approx(0.0)
    assert next_kind(account)[0] is Kind.SAMPLED
    poorer = replace(account, spent=1.5 * MS)
    assert shortfall(poorer) == pytest.approx(0.5 * MS)
    kind, reason = next_kind(poorer)
    assert kind is Kind.LIGHT and "0.500 ms" in reason


def test_a_census_waiting_and_the_unspent_credit_are_not_measurings_to_spend() -> None:
    account = Account(share=0.1, loop=1.0, credit=0.5, judged=0.2, reserved=0.05)
    assert account.held == pytest.approx(0.1 + 0.5 - 0.2)
    # The credit not spent by judging (0.3 s) and the census's reserve are set apart.
    assert account.bank == pytest.approx(0.4 - 0.3 - 0.05)


def test_the_dearest_recent_sampled_iteration_sets_the_price_which_decays() -> None:
    account = Account(share=0.05)
    account = prices_after(account, Ended(index=0, seconds=1.0, own=0.010))
    assert account.sampled_price == pytest.approx(0.010)
    account = prices_after(account, Ended(index=1, seconds=1.0, own=0.002))
    assert account.sampled_price == pytest.approx(0.008)  # 0.8 of the dearest
    account = prices_after(account, Ended(index=2, seconds=1.0, own=0.001, cut=True))
    assert account.sampled_price == pytest.approx(0.008)  # a cut one lowers nothing
    account = prices_after(account, Ended(index=3, seconds=3.0, own=0.003, light=True,
                                          iterations=3))
    assert account.light_price == pytest.approx(0.001)  # each of three light ones


def test_a_loop_keeps_memsentry_within_its_share_on_a_fake_clock() -> None:
    # Measuring a sampled iteration takes 10 ms beside 20 ms of the loop's own work, a light
    # one 0.1 ms; with 5% of the loop's time, about one in ten iterations can be sampled.
    clock = FakeClock()
    budget = Budget(0.05, credit=0.0, clock=clock)
    light = _run(budget, clock, 300, loop=0.020, sampled_cost=0.010, light_cost=1e-4)
    assert light[:3] == [False, False, False]
    sampled_later = light[3:].count(False)
    assert 20 <= sampled_later <= 35
    cost = budget.cost()
    assert cost.sampled == 3 + sampled_later
    # What memsentry spent stays near its share of the loop's own time (the first three, paid
    # whatever the account held, are the excess).
    assert budget.spent <= 0.05 * budget.loop + 3 * 0.010


def test_a_cheap_loop_is_sampled_in_every_iteration() -> None:
    clock = FakeClock()
    budget = Budget(0.05, credit=0.0, clock=clock)
    assert not any(_run(budget, clock, 50, loop=0.1, sampled_cost=0.001))


# -- overdrawn inside an iteration ----------------------------------------------------------


def test_the_first_iterations_stop_measuring_past_their_share_and_the_floor() -> None:
    bank = Account(share=0.05).bank
    floor = DEFAULT.floor
    assert not overdrawn(bank, first=True, own=floor, loop=0.0)  # at the floor: never
    assert not overdrawn(bank, first=True, own=0.01, loop=0.04)  # a quarter of the loop
    assert overdrawn(bank, first=True, own=0.011, loop=0.04)


def test_later_iterations_stop_measuring_when_the_bank_is_overdrawn() -> None:
    account = Account(share=0.05, loop=1.0, spent=0.04, iterations=10)
    assert not overdrawn(account.bank, first=False, own=0.0, loop=0.0)
    assert overdrawn(replace(account, spent=0.06).bank, first=False, own=0.0, loop=0.0)


def test_a_budget_on_a_fake_clock_is_overdrawn_in_a_dear_first_iteration() -> None:
    clock = FakeClock()
    budget = Budget(0.1, credit=0.0, clock=clock)
    clock.advance(0.2)  # 200 ms of the loop's own work so far
    budget.charge(HOOKS, 0.04)  # 40 ms of measuring: a fifth of it, under a quarter
    assert not budget.overdrawn()
    budget.charge(HOOKS, 0.03)  # 70 ms: over a quarter of the 200 ms
    assert budget.overdrawn()
    budget.end_iteration(0.27)
    assert budget.cost().sampled == 1


# -- the window of layers -------------------------------------------------------------------


def test_the_window_shrinks_to_what_the_share_pays_for_and_moves_on() -> None:
    full = Window(layers=100)
    # 10 ms of measuring beside 100 ms of the loop (110 ms clocked), 5% allowed: 5 ms.
    ended = Ended(index=5, seconds=0.110, own=0.010)
    narrowed = next_window(full, layers=100, ended=ended, share=0.05)
    assert (narrowed.size, narrowed.offset) == (50, 0)
    assert len(narrowed.members() or ()) == 50
    cheaper = Ended(index=6, seconds=0.1025, own=0.0025)  # half the window costs half
    moved = next_window(narrowed, layers=100, ended=cheaper, share=0.05)
    assert (moved.size, moved.offset) == (100, 50) or moved.full
    assert not narrowed.measures(60) and narrowed.measures(10)
    assert narrowed.measures(150)  # a layer first seen in this iteration


def test_the_window_at_most_doubles_and_wraps_around_the_layers() -> None:
    window = Window(layers=100, size=10, offset=95)
    ended = Ended(index=9, seconds=1.0, own=1e-9)  # measuring cost nothing
    grown = next_window(window, layers=100, ended=ended, share=0.05)
    assert (grown.size, grown.offset) == (20, 5)
    assert grown.members() == set(range(5, 25))
    assert Window(layers=10, size=4, offset=8).members() == {8, 9, 0, 1}


def test_the_window_stays_whole_in_the_first_iterations_light_ones_and_below_the_floor() -> None:
    full = Window(layers=100)
    dear = Ended(index=0, seconds=0.2, own=0.1)
    assert next_window(full, layers=100, ended=dear, share=0.05).full  # a first iteration
    light = replace(dear, index=10, light=True)
    assert next_window(full, layers=100, ended=light, share=0.05).full
    under_floor = Ended(index=10, seconds=0.002, own=0.0015)  # 1.5 ms of 2 ms
    assert next_window(full, layers=100, ended=under_floor, share=0.05).full
    assert next_window(full, layers=100, ended=replace(dear, index=10), share=None).full


# -- boundaries passed with a count, hooks ----------------------------------------------------


def test_light_iterations_pass_boundaries_to_keep_reading_within_half_the_budget() -> None:
    poor = Account(share=0.01, loop=1.0, spent=0.02, iterations=100, sampled_price=0.01)
    # Each iteration earns 10 us; a closing that took 100 us is read once in 20 boundaries.
    assert passes(poor, each=1 * MS, closing=100e-6, running=200) == 19
    # No more than until the next census (iteration 258 after 200) ...
    assert passes(poor, each=1 * MS, closing=100e-6, running=250) == 8
    # ... nor past max_passed, nor any when the next iteration is sampled.
    assert passes(poor, each=1e-6, closing=1.0, running=600) == DEFAULT.max_passed
    rich = replace(poor, spent=0.0)
    assert passes(rich, each=1 * MS, closing=100e-6, running=200) == 0
    # ... nor while a census is pending: the next closing takes it, under its iteration.
    assert passes(poor, each=1 * MS, closing=100e-6, running=200, census_pending=True) == 0


@pytest.mark.parametrize(("signal", "pending", "running", "hooks"), [
    (Signal(step=True), False, False, HookState.BARE),
    (Signal(step=True), True, False, HookState.ANCHORS),  # a census waits for a call
    (Signal(step=True), False, True, HookState.ANCHORS),  # a forward runs now
    (Signal(backward=True, seen=True), False, False, HookState.BARE),
    (Signal(backward=True), False, False, HookState.ANCHORS),  # its end is seen by a hook
    (Signal(forward=True), False, False, HookState.LEAN),
])
def test_a_light_iteration_keeps_only_the_hooks_its_end_needs(
        signal: Signal, pending: bool, running: bool, hooks: HookState) -> None:
    poor = Account(share=0.01, iterations=10, sampled_price=1.0)
    plan = plan_next(poor, Window(layers=5), signal, index=11, census_pending=pending,
                     forward_running=running)
    assert plan.kind is Kind.LIGHT and plan.light
    assert plan.hooks is hooks


def test_a_sampled_iteration_keeps_its_window_hooked() -> None:
    plan = plan_next(Account(share=None), Window(layers=5), Signal(step=True), index=4,
                     census_pending=False, forward_running=False)
    assert plan.kind is Kind.SAMPLED and plan.hooks is HookState.WINDOW
    assert plan.index == 4 and "overhead=None" in plan.reason


# -- censuses ---------------------------------------------------------------------------------


def test_censuses_are_due_at_two_three_four_then_at_doubling_gaps() -> None:
    assert [i for i in range(70) if census_due(i)] == [2, 3, 4, 6, 10, 18, 34, 66]
    assert [next_census(i) for i in (0, 4, 6, 11, 34)] == [2, 6, 10, 18, 66]


def test_the_first_seven_censuses_are_taken_when_due_whatever_the_account_holds() -> None:
    broke = Account(share=0.01, loop=0.0, spent=1.0)
    assert always_taken_through() == 34
    state = census_step(CensusState(), broke, index=34, due=True, scheduled=True)
    assert (state.pending, state.wanted, state.deferred) == (34, False, 0)


def test_a_census_growth_asks_for_takes_none_of_the_first_seven() -> None:
    # Under watch() growth asked for one at iteration 8: it waits for the account, and the
    # schedule's census of iteration 34 is still taken whatever the account holds (it was
    # left to the account once eight had been taken, and a short run's verdict lacked it).
    broke = Account(share=0.01, loop=1.0, spent=0.5)
    asked = census_step(CensusState(last_cost=0.03), broke, index=8, due=True)
    assert (asked.pending, asked.wanted, asked.deferred) == (None, True, 1)
    scheduled = census_step(CensusState(last_cost=0.03), broke, index=34, due=True,
                            scheduled=True)
    assert (scheduled.pending, scheduled.wanted) == (34, False)
    later = census_step(CensusState(last_cost=0.03), broke, index=66, due=True, scheduled=True)
    assert (later.pending, later.wanted) == (None, True)
    # The one growth asked for still waits when the schedule's of 34 falls due: it is taken
    # then, whatever the account holds (it was not, and a short run's verdict lacked it).
    waiting = census_step(asked, broke, index=30, due=False)
    assert (waiting.pending, waiting.wanted) == (None, True)
    behind = census_step(waiting, broke, index=34, due=True, scheduled=True)
    assert (behind.pending, behind.wanted, behind.free, behind.deferred) == (34, False, False, 1)


def test_the_census_that_would_confirm_a_leak_is_taken_whatever_the_account_holds() -> None:
    # The alarm found a leak at 34 that held from 6: a census at 48 or later would confirm it.
    broke = Account(share=0.01, loop=1.0, spent=0.5)
    settling = CensusState(last_cost=0.03, settles=48)
    early = census_step(settling, broke, index=40, due=True)  # growth asks, before 48: waits
    assert (early.pending, early.wanted) == (None, True)
    assert census_step(early, broke, index=47, due=False).pending is None
    assert census_step(early, broke, index=48, due=False).pending == 48  # now it settles
    due = census_step(settling, broke, index=66, due=True, scheduled=True)
    assert (due.pending, due.deferred) == (66, 0)
    assert census_step(CensusState(last_cost=0.03), broke, index=66, due=True,
                       scheduled=True).pending is None  # nothing to confirm: it waits


def test_later_censuses_wait_for_the_account_with_the_first_claim_on_it() -> None:
    broke = Account(share=0.01, loop=1.0, spent=0.01)
    state = census_step(CensusState(last_cost=0.03), broke, index=66, due=True, scheduled=True)
    assert (state.pending, state.wanted, state.deferred) == (None, True, 1)
    assert state.reserved == pytest.approx(0.03)
    # Still waiting at the next boundary: counted once.
    state = census_step(state, broke, index=67, due=False)
    assert state.deferred == 1 and state.wanted
    paid = replace(broke, loop=5.0)  # the account now holds 40 ms
    state = census_step(state, paid, index=70, due=False)
    assert (state.pending, state.wanted, state.reserved) == (70, False, 0.0)
