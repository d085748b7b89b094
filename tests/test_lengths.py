"""The lengths of containers the censuses found growing, read again at every boundary: a
container that fills within the schedule's last gap (full at 50 of 60 iterations, the last
census at 34) is seen staying, and is no leak; a leak that grows in bursts, or whose items
grow, stays one. How a holder is reached again (no code of the user's runs), which are
followed, the rule on built reports, then real loops in both modes on a fake clock."""

from __future__ import annotations

import collections
import dataclasses
import sys
from typing import Any

import pytest
import torch
from builders import KiB, censuses, holder_states, iterations, report
from fake_clock import FakeClock
from seams import tracked, watched
from torch import nn

import memsentry
from memsentry.census.reach import Follower, reach_of
from memsentry.model import (
    Finding,
    HolderKind,
    HolderLength,
    Scope,
    ScopeKind,
    Severity,
    Step,
    StepKind,
    Subject,
    SubjectKind,
)
from memsentry.record.lengths import Lengths, _Track, followed
from memsentry.record.policy import Account, length_stride
from memsentry.rules import analysed
from memsentry.rules.stayed import kept_still
from memsentry.usercode.lines import short_path

MODES = ["track", "watch"]
AT = [2, 3, 4, 6, 10, 18, 34]
ROOT, ATTRIBUTE, KEY, INDEX = StepKind.ROOT, StepKind.ATTRIBUTE, StepKind.KEY, StepKind.INDEX


def _here(function: str) -> Scope:
    return Scope(ScopeKind.FUNCTION, function, short_path(__file__))


def _follower(path: tuple[Step, ...], kind: HolderKind = HolderKind.LOCAL,
              scope: Scope | None = None, model: nn.Module | None = None) -> Follower:
    reach = reach_of(path, kind, scope)
    assert reach is not None
    return Follower(reach, model)


# -- reaching a holder again -----------------------------------------------------------------
def test_a_local_of_a_function_up_the_stack_is_read_through_its_attributes_and_keys() -> None:
    class Logger:
        def __init__(self) -> None:
            self.history: dict[str, list[int]] = {"loss": [1, 2, 3]}

    def inner(follower: Follower) -> int | None:
        return follower.length(sys._getframe())

    def loop() -> list[int | None]:
        log = Logger()
        follower = _follower((Step(ROOT, "log"), Step(ATTRIBUTE, "history"),
                              Step(KEY, "'loss'")), scope=_here("loop"))
        seen = [inner(follower)]
        log.history["loss"].append(4)
        seen.append(inner(follower))  # the depth found is asked for again
        seen.append(follower.length(sys._getframe()))  # from another boundary
        return seen

    assert loop() == [3, 4, 4]


def test_a_holder_not_there_or_not_a_plain_container_is_not_read() -> None:
    class Counted(list[int]):
        def __len__(self) -> int:  # the user's code: never run by a reading
            raise AssertionError("ran")

    def loop() -> list[int | None]:
        counted = Counted([1])
        items = collections.deque([1, 2], maxlen=5)
        assert counted is not None and items is not None
        frame = sys._getframe()
        return [_follower((Step(ROOT, name),), scope=_here("loop")).length(frame)
                for name in ("counted", "items", "missing")]

    assert loop() == [None, 2, None]
    # A function that is not running: nothing to read.
    assert _follower((Step(ROOT, "kept"),), scope=_here("gone")).length(sys._getframe()) is None


def test_a_global_and_an_attribute_of_the_model_are_read() -> None:
    module = sys.modules[__name__]
    module._KEPT = [1, 2]  # type: ignore[attr-defined]
    try:
        scope = Scope(ScopeKind.MODULE, __name__)
        follower = _follower((Step(ROOT, "_KEPT"),), HolderKind.GLOBAL, scope)
        assert follower.length(None) == 2
    finally:
        del module._KEPT  # type: ignore[attr-defined]
    assert follower.length(None) is None
    model = nn.Sequential(nn.Linear(2, 2))
    model.cache = [1, 2, 3]  # type: ignore[assignment]
    path = (Step(ROOT, "Sequential"), Step(ATTRIBUTE, "cache"))
    assert _follower(path, HolderKind.MODEL, model=model).length(None) == 3
    registry = (Step(ROOT, "Sequential"), Step(ATTRIBUTE, "_modules"))
    assert _follower(registry, HolderKind.MODEL, model=model).length(None) == 1


def test_paths_that_cannot_be_followed_without_running_the_users_code() -> None:
    scope = _here("loop")
    assert reach_of((Step(ROOT, "s"), Step(StepKind.MEMBER, "0")), HolderKind.LOCAL,
                    scope) is None
    assert reach_of((Step(ROOT, "d"), Step(KEY, "Key(3)")), HolderKind.LOCAL, scope) is None
    assert reach_of((Step(ROOT, "Logger"),), HolderKind.CLASS_ATTRIBUTE, None) is None
    assert reach_of((Step(ROOT, "x"),), HolderKind.LOCAL, Scope(ScopeKind.CLASS, "C")) is None
    assert reach_of((Step(ROOT, "d"), Step(KEY, "3"), Step(INDEX, "-1")), HolderKind.LOCAL,
                    scope) is not None


def test_the_containers_followed_are_those_whose_items_grew_and_dicts_that_gained_keys() -> None:
    scope = _here("loop")
    grown = holder_states("window", items=[4, 6], tensors=[4, 6], scope=scope)
    steady = holder_states("model_cache", items=[3, 3], tensors=[3, 3], scope=scope)
    tensor = holder_states("bank", items=None, tensors=[1, 1], bytes=[4 * KiB, 8 * KiB],
                           scope=scope)
    old = holder_states("bufs['a']", items=[None, None], scope=scope)
    new = holder_states("bufs['b']", items=[None, None], scope=scope)
    built = censuses([2, 3], grown, steady, tensor, old, [None, new[1]])
    assert [reach.root for _, reach in followed(built)] == ["window", "bufs"]
    assert followed(built[:1]) == []


def test_a_reading_keeps_when_the_length_last_changed_its_longest_pause_and_spacing() -> None:
    track = _Track(_follower((Step(ROOT, "x"),), scope=_here("loop")))
    for iteration, items in [(4, 4), (5, 5), (9, 5), (12, 5), (13, 6), (20, 6), (24, 6)]:
        track.read(iteration, items)
    assert (track.items, track.since, track.until, track.first) == (6, 13, 24, 4)
    assert (track.pause, track.spacing) == (7, 7)
    track.read(10, 9)  # iterations merged: an earlier index is not read again
    assert track.items == 6


def test_lengths_are_read_as_often_as_their_share_of_the_budget_pays() -> None:
    assert length_stride(1e-5, Account(share=None)) == 1
    assert length_stride(1e-5, Account(share=0.05)) == 1  # no iteration clocked yet
    # 1 ms an iteration at 5%: 50 us paid in, a quarter of it for readings of 10 us.
    assert length_stride(1e-5, Account(share=0.05, loop=1.0, iterations=1000)) == 1
    assert length_stride(4e-5, Account(share=0.05, loop=1.0, iterations=1000)) == 4
    assert length_stride(1.0, Account(share=0.05, loop=1.0, iterations=1000)) == 256


# -- the rule on built reports ---------------------------------------------------------------
def _window_leak() -> Finding:
    path = (Step(ROOT, "window"),)
    return Finding(rule="tensor-accumulation", severity=Severity.LEAK, message="m", fix="f",
                   subject=Subject(SubjectKind.HOLDER, "window", path=path))


def _filled(**length: Any) -> memsentry.ReportData:
    """A list that gained a tensor of 2 KiB an iteration at every census (2..34); read at
    every boundary after, it kept 50 from iteration 50 to 60 unless ``length`` says else."""
    counts = [a + 2 for a in AT]
    rows = holder_states("window", items=counts, tensors=counts,
                         bytes=[2 * KiB * n for n in counts])
    figures = {"items": 50, "since": 50, "until": 60, "first": 3, "pause": 0, "spacing": 1,
               **length}
    return report(iterations=iterations([0] * 61), censuses=censuses(AT, rows),
                  lengths=(HolderLength((Step(ROOT, "window"),), **figures),))


def test_a_list_that_kept_its_length_to_the_end_filled_and_stayed() -> None:
    note = kept_still(_filled(), [c for c in _filled().censuses], _window_leak())
    assert note is not None and note.startswith("`window` grew from 4 to 36 tensors between "
                                                "iterations 2 and 34")
    assert "stayed at 50 from iteration 50 to the end (60)" in note


@pytest.mark.parametrize("length", [
    {"since": 55},               # 5 iterations still: too few to tell
    {"until": 57},               # not read up to the end (the function returned)
    {"pause": 6},                # it paused 6 iterations while growing: 10 tell nothing
    {"spacing": 6},              # read every 6: a pause of 5 could go unseen
], ids=["short", "not-to-the-end", "bursts", "sparse"])
def test_a_stillness_that_tells_nothing_leaves_the_leak(length: dict[str, int]) -> None:
    built = _filled(**length)
    assert kept_still(built, list(built.censuses), _window_leak()) is None


def test_items_that_grow_themselves_leave_the_leak() -> None:
    """One list per key whose lists lengthen: the length of the outer one says nothing."""
    counts = [a + 2 for a in AT]
    rows = holder_states("window", items=counts, tensors=[n * n for n in counts],
                         bytes=[2 * KiB * n * n for n in counts])
    built = dataclasses.replace(_filled(), censuses=censuses(AT, rows))
    assert kept_still(built, list(built.censuses), _window_leak()) is None


def test_a_leak_dropped_so_takes_the_growth_fallback_with_it() -> None:
    """The growth a container that filled explains is no leak either."""
    built = _filled()
    growing = report(iterations=iterations([1000 * i for i in range(61)]),
                     censuses=built.censuses, lengths=built.lengths)
    findings, notes = analysed(growing)
    assert not [f for f in findings if f.severity is Severity.LEAK], findings
    assert any("it filled to a size and stayed" in note for note in notes)


# -- real loops ------------------------------------------------------------------------------
def _window_loop(mode: str, steps: int, *, every: int = 1, burst: int = 1,
                 cap: int | None = None) -> memsentry.Report:
    """``burst`` tensors kept every ``every`` steps, the oldest dropped past ``cap``; on a
    clock that moves a millisecond a step."""
    torch.manual_seed(0)
    model = nn.Linear(32, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    window: list[torch.Tensor] = []
    clock = FakeClock()
    wrap = tracked if mode == "track" else watched
    with wrap(model, clock=clock, on_leak="ignore") as t:
        for step in range(steps):
            clock.advance(1e-3)
            if step % every == 0:
                window.extend(torch.randn(16, 32) for _ in range(burst))
            if cap is not None and len(window) > cap:
                window.pop(0)
            loss = model(torch.randn(8, 32)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return t.report()


def _leaks(found: memsentry.Report) -> list[str | None]:
    return [f.subject.name if f.subject else f.rule for f in found.findings
            if f.severity is Severity.LEAK]


@pytest.mark.parametrize("steps", [60, 70])
@pytest.mark.parametrize("mode", MODES)
def test_a_list_trimmed_to_50_is_no_leak_when_it_fills_after_the_last_census(
        mode: str, steps: int) -> None:
    """Full at 50: at 60 steps the closing census finds it 14 larger than at 34; at 70 the
    census of 66 still sees its climb, and the end comes 3 iterations later."""
    found = _window_loop(mode, steps, cap=50)
    assert _leaks(found) == [], [f.message for f in found.findings]
    assert any(note.startswith("`window` grew from") and "stayed at 50" in note
               for note in found.notes), found.notes
    assert [(held.name, held.items, held.until) for held in found.lengths] == \
        [("window", 50, steps - 1)]


@pytest.mark.parametrize("mode", MODES)
def test_a_leak_that_grows_in_bursts_or_every_step_stays_a_leak(mode: str) -> None:
    assert _leaks(_window_loop(mode, 120, every=20, burst=4)) == ["window"]
    assert _leaks(_window_loop(mode, 60)) == ["window"]


def test_a_method_s_attribute_is_followed_through_self() -> None:
    class Trainer:
        def __init__(self) -> None:
            self.model = nn.Linear(32, 32)
            self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
            self.recent: list[torch.Tensor] = []

        def fit(self, steps: int) -> memsentry.Report:
            clock = FakeClock()
            with tracked(self.model, clock=clock, on_leak="ignore") as t:
                for _ in range(steps):
                    clock.advance(1e-3)
                    self.recent.append(torch.randn(16, 32))
                    del self.recent[:-45]
                    loss = self.model(torch.randn(8, 32)).pow(2).mean()
                    self.opt.zero_grad()
                    loss.backward()
                    self.opt.step()
            return t.report()

    found = Trainer().fit(60)
    assert _leaks(found) == [], [f.message for f in found.findings]
    assert [held.name for held in found.lengths] == ["self.recent"]


def test_lengths_travel_with_the_report_file(tmp_path: Any) -> None:
    found = _window_loop("track", 60, cap=50)
    path = tmp_path / "r.json"
    found.to_json(path)
    assert memsentry.Report.from_json(path).lengths == found.lengths


def test_nothing_is_followed_in_a_loop_that_keeps_nothing() -> None:
    tracker = Lengths()
    tracker.read(5, sys._getframe())
    assert tracker.freeze() == ()
    found = _window_loop("track", 40, cap=0)
    assert found.lengths == ()
