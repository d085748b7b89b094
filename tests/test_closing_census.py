"""The census taken as tracking ends: a container that fills to a size and then stays is no
leak, even where the schedule's last census (34 of 60 iterations) saw it still climbing; a
holder that goes on growing stays a leak, with the figures of the schedule's censuses; what
that census cannot see (a local of a function that returned) and a pace too slow for the
iterations since to tell leave the verdict as it was. Pure decisions on built reports, then
real loops in both modes."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest
import torch
from builders import (
    KiB,
    censuses,
    exit_iteration,
    holder,
    holder_states,
    hook_states,
    iterations,
    report,
)
from fake_clock import FakeClock
from seams import tracked, watched
from torch import nn

import memsentry
from memsentry.model import Census, Finding, Severity, Subject, SubjectKind
from memsentry.record.policy import DEFAULT, closing_census
from memsentry.record.schedule import still_rising
from memsentry.rules import analysed
from memsentry.rules.closing import Held, exit_stayed, settle, stayed
from memsentry.rules.series import Trend, complete_censuses

AT = [2, 3, 4, 6, 10, 18, 34]
MODES = ["track", "watch"]


def _closing(built: tuple[Census, ...]) -> tuple[Census, ...]:
    return (*built[:-1], dataclasses.replace(built[-1], closing=True))


def _leaks(found: tuple[Finding, ...] | list[Finding]) -> list[Finding]:
    return [f for f in found if f.severity is Severity.LEAK]


# -- the pure decisions ----------------------------------------------------------------------
def test_the_census_is_taken_when_a_holder_still_grew_and_the_run_went_on() -> None:
    gap = DEFAULT.carry_gap
    assert closing_census(34, 34 + gap, rising=True)
    assert not closing_census(34, 34 + gap - 1, rising=True)  # the last one is recent enough
    assert not closing_census(34, 60, rising=False)  # nothing grew: no verdict rests on it
    assert not closing_census(None, 60, rising=True)  # no census yet


def test_still_rising_reads_the_last_two_complete_censuses() -> None:
    grows = censuses([10, 18], holder_states("kept", tensors=[11, 19]))
    flat = censuses([10, 18], holder_states("kept", tensors=[19, 19]))
    heavier = censuses([10, 18], holder_states("bank", tensors=1, bytes=[8 * KiB, 16 * KiB]))
    assert still_rising(grows)
    assert not still_rising(flat)
    assert still_rising(heavier)
    cut = (grows[0], dataclasses.replace(grows[1], complete=False))
    assert not still_rising(cut)
    keys = censuses([10, 18], [holder("bufs['n8']"), holder("bufs['n8']")],
                    [None, holder("bufs['n9']")])
    assert still_rising(keys)  # a new key of a dict the census before saw
    fresh = censuses([10, 18], [holder("x"), holder("x")], [None, holder("y")])
    assert not still_rising(fresh)  # a new name of its own: nothing grew


def _held(iteration: int, items: float, bytes: float = 0.0) -> Held:
    return Held(iteration, items, bytes, 0.0, items)


def test_a_holder_that_filled_and_stayed_is_told_from_one_that_grows_on() -> None:
    climb = [_held(2, 3), _held(18, 19), _held(34, 29)]
    assert stayed(climb, _held(60, 29))  # 21 promised over 26 iterations, none came
    assert stayed(climb, _held(60, 31))  # 2 of 21: less than a quarter
    assert not stayed(climb, _held(60, 35))  # 6 of 21: it still grows
    slow = [_held(2, 1), _held(18, 2), _held(34, 4)]  # one tensor every ten iterations
    assert not stayed(slow, _held(42, 4))  # 0.75 promised over 8 iterations: too few to tell
    sawtooth = [_held(2, 3), _held(10, 1), _held(34, 29)]  # emptied once: a reset may follow
    assert not stayed(sawtooth, _held(60, 2))


def test_a_container_emptied_after_the_loop_grew_all_through_the_run() -> None:
    climb = [_held(2, 3), _held(18, 19), _held(34, 29)]
    assert not stayed(climb, _held(60, 0))  # cleared at the end: it grew until then
    assert stayed(climb, _held(60, 25))  # a few evicted: less than a quarter of its growth


def test_allocated_memory_judged_at_the_partial_iteration_of_the_end() -> None:
    first, last = exit_iteration(2, 100 * KiB), exit_iteration(35, 200 * KiB)
    assert exit_stayed(first, last, exit_iteration(60, 200 * KiB))
    assert not exit_stayed(first, last, exit_iteration(60, 300 * KiB))  # it went on
    assert not exit_stayed(first, last, exit_iteration(60, 0))  # freed at the end
    assert not exit_stayed(first, last, exit_iteration(40, 200 * KiB))  # too soon to tell


def test_a_tensor_that_grows_is_judged_by_its_bytes() -> None:
    bank = [_held(2, 1, 4 * KiB), _held(18, 1, 68 * KiB), _held(34, 1, 132 * KiB)]
    assert stayed(bank, _held(60, 1, 132 * KiB))
    assert not stayed(bank, _held(60, 1, 200 * KiB))


def test_a_climb_goes_on_only_when_its_latest_step_keeps_a_quarter_of_its_pace() -> None:
    at = (2, 3, 4, 6, 10, 18, 34, 66)
    guarded = Trend(at, (4, 5, 6, 8, 12, 20, 36, 40))  # a list kept below 40 entries
    assert not guarded.climbs()  # 4 over the last 32 iterations, where its pace promised 32
    assert Trend(at, (4, 5, 6, 8, 12, 20, 36, 44)).climbs()  # 8: a quarter, it goes on
    assert Trend(at, (4, 5, 6, 8, 12, 20, 36, 68)).climbs()


def test_a_short_run_whose_last_step_lost_its_pace_is_no_growth() -> None:
    """L-BFGS's history (100 pairs, 20 a step) fills in 5 steps: on a run of 6 the allocated
    memory rose by 10 MiB a step, then by 0.5 MiB (the trial's figures)."""
    rising = [10_882_288, 21_218_240, 31_549_440, 41_880_640, 52_211_840]
    filled = report(iterations=[*iterations([*rising, 52_728_400]),
                                exit_iteration(6, 52_717_816)])
    assert not [f for f in analysed(filled)[0] if f.rule == "memory-growth"]
    going = report(iterations=[*iterations([*rising, 62_543_040]), exit_iteration(6, 62_543_040)])
    assert [f.severity for f in analysed(going)[0]] == [Severity.LEAK]


# -- the verdicts on reports built by hand ------------------------------------------------------
CACHE = holder_states("buffers", tensors=[3, 4, 5, 7, 11, 19, 29], items=[3, 4, 5, 7, 11, 19, 29],
                      bytes=[3 * KiB, 4 * KiB, 5 * KiB, 7 * KiB, 11 * KiB, 19 * KiB, 29 * KiB])


def _cache_report(end: int | None) -> tuple[Finding, ...]:
    """The cache's LEAK as the schedule's censuses judge it; with ``end``, a closing census
    at iteration 60 that sees it hold ``end`` tensors (``None``: it did not see it)."""
    rows = [*CACHE, None] if end is None else [
        *CACHE, holder_states("buffers", tensors=[end], items=[end], bytes=[end * KiB])[0]]
    built = _closing(censuses([*AT, 60], rows))
    return analysed(report(censuses=built))[0]


def test_a_cache_that_stopped_growing_by_the_end_is_no_leak_and_a_note_says_why() -> None:
    regular = report(censuses=censuses(AT, CACHE))
    assert [f.subject.name for f in _leaks(analysed(regular)[0]) if f.subject] == ["buffers"]
    built = report(censuses=_closing(censuses([*AT, 60], [*CACHE, CACHE[-1]])))
    findings, notes = analysed(built)
    assert not _leaks(findings)
    assert notes == (
        "`buffers` grew from 3 tensors to 29 tensors between iterations 2 and 34, and the holder "
        "search as tracking ended (iteration 60) found 29 tensors: it filled to a size and "
        "stayed, which is no leak, so no finding is made of it.",)


def test_a_holder_still_growing_at_the_end_keeps_the_schedules_figures() -> None:
    leak = _leaks(_cache_report(55))  # 26 more over 26 iterations: it grows on
    assert len(leak) == 1
    assert "29 (29 KiB) at iteration 34, up from 3 at iteration 2" in leak[0].message


def test_a_holder_the_closing_census_does_not_see_stays_as_judged() -> None:
    assert len(_leaks(_cache_report(None))) == 1  # the loop's function may have returned


def test_the_closing_census_is_not_one_of_the_series_the_rules_read() -> None:
    built = report(censuses=_closing(censuses([*AT, 60], [*CACHE, CACHE[-1]])))
    assert [c.iteration for c in complete_censuses(built)] == AT


def test_hooks_that_stopped_piling_up_are_no_leak() -> None:
    counts = [2, 3, 4, 6, 10, 18, 34]
    grown = censuses(AT, hooks=[hook_states("fc", counts)])
    assert _leaks(analysed(report(censuses=grown))[0])
    stopped = _closing(censuses([*AT, 60], hooks=[hook_states("fc", [*counts, 34])]))
    findings, notes = analysed(report(censuses=stopped))
    assert not _leaks(findings)
    assert "`fc` grew from 2 hooks to 34 hooks" in notes[0]
    going = _closing(censuses([*AT, 60], hooks=[hook_states("fc", [*counts, 60])]))
    assert _leaks(analysed(report(censuses=going))[0])


def test_settle_leaves_other_findings_and_reports_without_a_closing_census() -> None:
    hint = Finding(rule="memory-growth", severity=Severity.HINT, message="m", fix="f",
                   objects=1, subject=Subject(SubjectKind.HOLDER, "buffers", CACHE[0].path))
    built = report(censuses=_closing(censuses([*AT, 60], [*CACHE, CACHE[-1]])))
    assert settle(built, [hint]) == ([hint], [])
    assert settle(report(censuses=censuses(AT, CACHE)), [hint]) == ([hint], [])


# -- real loops ------------------------------------------------------------------------------
def _cache_loop(mode: str, steps: int, shapes: int, **options: Any) -> memsentry.Report:
    """A cache of one buffer per batch size: ``shapes`` sizes, then they repeat; on a clock
    that moves a millisecond a step (what the budget decides does not hang on the load)."""
    torch.manual_seed(0)
    model = nn.Linear(32, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    buffers: dict[int, torch.Tensor] = {}
    clock = options.pop("clock", FakeClock())
    wrap = tracked if mode == "track" else watched
    options.setdefault("on_leak", "ignore")
    with wrap(model, clock=clock, **options) as t:
        for step in range(steps):
            clock.advance(1e-3)
            n = 8 + step % shapes
            if n not in buffers:
                buffers[n] = torch.zeros(n, 32)
            loss = model(buffers[n].normal_()).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return t.report()


@pytest.mark.parametrize("mode", MODES)
def test_a_cache_of_batch_shapes_is_no_leak_by_the_end(mode: str) -> None:
    """30 sizes over 60 steps: the schedule's last census (34) saw it climbing."""
    found = _cache_loop(mode, 60, 30)
    assert not _leaks(found.findings), [f.message for f in found.findings]
    assert found.censuses[-1].closing
    assert any("`buffers` grew from" in note and "it filled to a size and stayed" in note
               for note in found.notes), found.notes


@pytest.mark.parametrize("mode", MODES)
def test_a_cache_that_never_stops_growing_is_still_a_leak(mode: str) -> None:
    found = _cache_loop(mode, 60, 1000)
    leaks = _leaks(found.findings)
    assert [f.subject.name for f in leaks if f.subject] == ["buffers"], \
        [f.message for f in found.findings]
    assert "gains 1 tensor/iter" in leaks[0].message


@pytest.mark.parametrize("mode", MODES)
def test_a_list_filled_to_a_size_between_two_censuses_is_no_leak(mode: str) -> None:
    """Kept below 40 entries: the 40th comes at step 39, the censuses at 34 and 66."""
    torch.manual_seed(0)
    model = nn.Linear(32, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    pool: list[torch.Tensor] = []
    wrap = tracked if mode == "track" else watched
    with wrap(model, clock=FakeClock(), on_leak="ignore") as t:
        for step in range(70):
            if len(pool) < 40:
                pool.append(torch.randn(16, 32))
            loss = model(pool[step % len(pool)]).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert not _leaks(t.report().findings), [f.message for f in t.report().findings]


def test_the_closing_census_is_taken_whatever_the_budget_holds() -> None:
    """Like the first seven: a verdict rests on it, and a budget those drained would make it
    hang on the machine's load."""
    found = _cache_loop("watch", 60, 30, clock=FakeClock(tick=1e-3), overhead=1e-6, credit=0.0)
    assert found.censuses[-1].closing
    assert not _leaks(found.findings), [f.message for f in found.findings]


@pytest.mark.parametrize("mode", MODES)
def test_a_dict_that_gains_a_string_key_until_it_is_full_is_no_leak(mode: str) -> None:
    torch.manual_seed(0)
    model = nn.Linear(32, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    bufs: dict[str, torch.Tensor] = {}
    wrap = tracked if mode == "track" else watched
    with wrap(model, clock=FakeClock(), on_leak="ignore") as t:
        for step in range(60):
            key = f"n{8 + step % 28}"
            if key not in bufs:
                bufs[key] = torch.zeros(8 + step % 28, 32)
            loss = model(bufs[key].normal_()).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert t.report().censuses[-1].closing
    assert not _leaks(t.report().findings), [f.message for f in t.report().findings]


def test_a_leak_said_while_the_run_lived_and_taken_back_at_the_end_is_noted() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = _cache_loop("track", 60, 30, on_leak="warn")
    said = [w for w in caught if issubclass(w.category, memsentry.LeakWarning)]
    assert len(said) == 1 and "`buffers`" in str(said[0].message)  # said at iteration 34
    assert not _leaks(found.findings)
    assert any(note.startswith("The leak said at iteration 34 (tensor-accumulation: "
                               "`buffers`) did not hold to the end") for note in found.notes)


@pytest.mark.parametrize("mode", MODES)
def test_a_list_kept_all_run_and_cleared_after_the_loop_is_still_a_leak(mode: str) -> None:
    model = nn.Linear(32, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kept: list[torch.Tensor] = []
    tracker = memsentry.track(model, on_leak="ignore") if mode == "track" \
        else memsentry.watch(model, on_leak="ignore")
    with tracker as t:
        _fill(kept, model, opt, 60)
        kept.clear()
    assert [f.subject.name for f in _leaks(t.report().findings) if f.subject] == ["kept"], \
        [f.message for f in t.report().findings]


def _fill(kept: list[torch.Tensor], model: nn.Module, opt: torch.optim.Optimizer,
          steps: int) -> None:
    for _ in range(steps):
        loss = model(torch.randn(4, 32)).pow(2).mean()
        kept.append(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_a_leak_in_a_function_that_returned_before_stop_is_still_a_leak() -> None:
    """start()/stop() around a call: the closing census cannot see the function's locals."""
    model = nn.Linear(32, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    t = memsentry.track(model, on_leak="ignore").start()

    def train() -> None:
        kept: list[torch.Tensor] = []
        _fill(kept, model, opt, 60)

    train()
    found = t.stop()
    assert [f.subject.name for f in _leaks(found.findings) if f.subject] == ["kept"], \
        [f.message for f in found.findings]
