"""Trackers in threads: each thread's tracker counts its own loop (module calls, optimizer
steps, backward passes), nothing crashes or raises in any thread, results are bit for bit
those of the untracked run, and what several trackers share (the optimizer step hook, the
paused garbage collector) is as the user left it when they are done. Each case is repeated:
the failures these tests guard against came in 1 of 15 runs."""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
from conftest import iterations_run
from torch import nn

import memsentry
from memsentry.model import (
    Census,
    HolderKind,
    HolderStats,
    IterationStats,
    Measured,
    ReportData,
    Step,
    StepKind,
)
from memsentry.rules import analyse, remarks

STEPS = 12
REPEATS = 8
_SEEDING = threading.Lock()


def _loop(seed: int, tracker_of: Callable[[nn.Module], memsentry.Tracker | None],
          results: dict[int, Any], steps: int = STEPS) -> None:
    """A training loop of its own (model, optimizer, data) in the calling thread."""
    try:
        gen = torch.Generator().manual_seed(seed)
        with _SEEDING:  # the global generator is the process's: one thread at a time
            torch.manual_seed(seed)
            model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        tracker = tracker_of(model)
        if tracker is not None:
            tracker.start()
        kept = []
        try:
            for step in range(steps):
                loss = model(torch.randn(16, 32, generator=gen)).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=step % 2 == 0)
                if seed == 1:  # this thread's loop leaks; the others do not
                    kept.append(loss)
        finally:
            report = tracker.stop() if tracker is not None else None
        results[seed] = (report, [p.detach().clone() for p in model.parameters()])
    except BaseException as error:
        results[seed] = error


def _threads(tracker_of: Callable[[nn.Module], memsentry.Tracker | None],
             count: int) -> dict[int, Any]:
    results: dict[int, Any] = {}
    threads = [threading.Thread(target=_loop, args=(seed, tracker_of, results))
               for seed in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a tracked thread hung"
    return results


def _untracked(seed: int) -> list[torch.Tensor]:
    results: dict[int, Any] = {}
    _loop(seed, lambda model: None, results)
    return results[seed][1]


def _own_calls(layer: memsentry.LayerStats) -> bool:
    """A layer of the thread's loop was called ``STEPS`` times: its count says so when every
    call was seen; under the budget, calls in light iterations are not counted, and what is
    counted must be the thread's own (no more than ``STEPS``)."""
    if layer.calls_complete:
        return layer.calls == STEPS
    return 0 < layer.calls <= STEPS


@pytest.mark.parametrize("count", [2, 3])
@pytest.mark.parametrize("how", ["track(model)", "track()", "exact"])
def test_trackers_in_threads_count_their_own_loop_and_change_nothing(count: int,
                                                                      how: str) -> None:
    def tracker_of(model: nn.Module) -> memsentry.Tracker:
        if how == "track()":
            return memsentry.track(on_leak="ignore")
        return memsentry.track(model, on_leak="ignore", exact=how == "exact")

    expected = {seed: _untracked(seed) for seed in range(count)}
    gc_was = gc.isenabled()
    for _ in range(REPEATS):
        results = _threads(tracker_of, count)
        for seed in range(count):
            outcome = results[seed]
            assert not isinstance(outcome, BaseException), f"thread {seed}: {outcome!r}"
            report, params = outcome
            assert iterations_run(report) == STEPS, f"thread {seed}"
            assert all(it.boundary is memsentry.Boundary.OPTIMIZER for it in report.iterations
                       if it.boundary is not memsentry.Boundary.EXIT)
            assert {layer.name for layer in report.layers} >= {"0", "1", "2"}
            assert all(_own_calls(layer) for layer in report.layers
                       if layer.name in ("0", "1", "2")), f"thread {seed}"
            for a, b in zip(expected[seed], params, strict=True):
                assert torch.equal(a, b)
    assert gc.isenabled() == gc_was


def test_each_thread_is_judged_on_its_own_holders() -> None:
    results = _threads(lambda model: memsentry.track(model, on_leak="ignore"), 3)
    leaks = {seed: [f.subject.name for f in results[seed][0].findings
                    if f.severity is memsentry.Severity.LEAK and f.subject is not None]
             for seed in range(3)}
    assert leaks[1] == ["kept"]  # the loop that keeps its losses
    assert leaks[0] == [] and leaks[2] == []


def test_a_tracker_with_no_model_ignores_an_untracked_thread() -> None:
    """Global hooks see every module call of the process: another thread's loop is not this
    tracker's, neither its calls nor its optimizer steps."""
    results: dict[int, Any] = {}
    other = threading.Thread(target=_loop, args=(5, lambda model: None, results, 200))
    with memsentry.track(on_leak="ignore") as tracker:
        other.start()
        _loop(0, lambda model: None, results)
    other.join(timeout=120)
    report = tracker.report()
    assert not isinstance(results[5], BaseException)
    assert iterations_run(report) == STEPS
    assert all(_own_calls(layer) for layer in report.layers)
    assert max(layer.calls for layer in report.layers) <= STEPS


def test_a_loop_run_in_another_thread_than_the_tracker_started_in_is_followed() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train() -> None:
        for _ in range(STEPS):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()

    with memsentry.track(model, on_leak="ignore") as tracker:
        worker = threading.Thread(target=train)
        worker.start()
        worker.join(timeout=60)
    report = tracker.report()
    assert iterations_run(report) == STEPS
    assert _own_calls(report.layer("0"))


# -- verdicts on process-wide figures -------------------------------------------------------
LEAK_STEP = 256 * 1024  # bytes the leaking loop keeps each step
CLEAN = 5


def _beside(seed: int, start: threading.Barrier, results: dict[int, Any]) -> None:
    """A tracked loop of 20 steps started with the others; seed 0 keeps 256 KiB a step."""
    try:
        gen = torch.Generator().manual_seed(seed)
        with _SEEDING:
            torch.manual_seed(seed)
            model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        kept = []
        start.wait(timeout=60)
        with memsentry.track(model, on_leak="ignore") as tracker:
            for _ in range(20):
                model(torch.randn(16, 32, generator=gen)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                if seed == 0:
                    kept.append(torch.ones(LEAK_STEP // 4))
        results[seed] = tracker.report()
    except BaseException as error:
        results[seed] = error


def test_clean_threads_beside_a_leaking_one_get_no_growth_verdict() -> None:
    """On CPU the figures are the whole process heap: the leaking thread's growth shows in
    every tracker's figures, and only the leaking thread's loop holds it."""
    for _ in range(3):
        results: dict[int, Any] = {}
        start = threading.Barrier(CLEAN + 1)
        threads = [threading.Thread(target=_beside, args=(seed, start, results))
                   for seed in range(CLEAN + 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not any(isinstance(r, BaseException) for r in results.values()), results
        leaks = [(f.rule, f.subject.name) for f in results[0].findings
                 if f.severity is memsentry.Severity.LEAK and f.subject is not None]
        assert leaks == [("tensor-accumulation", "kept")]
        for seed in range(1, CLEAN + 1):
            growth = [f for f in results[seed].findings if f.rule == "memory-growth"
                      or f.severity is memsentry.Severity.LEAK]
            assert growth == [], f"clean thread {seed}: {growth[0].message}"


MiB = 1 << 20


def _hand_built(*, others: int, kept_per_step: int = 0, items_per_step: int = 0,
                measured: Measured = Measured.HEAP, backend: str = "cpu-mallinfo2"
                ) -> ReportData:
    """Twelve iterations whose figures grow 1 MiB each; censuses at 2, 4, 8 and 11 see the
    model's weights and a list ``kept`` of 3 tensors gaining ``kept_per_step`` bytes and
    ``items_per_step`` items an iteration."""
    its = tuple(IterationStats(index=i, allocated=100 * MiB + i * MiB, reserved=None,
                               peak=101 * MiB + i * MiB, seconds=0.01,
                               boundary=memsentry.Boundary.OPTIMIZER) for i in range(12))

    def census(at: int) -> Census:
        holders = (
            HolderStats(path=(Step(StepKind.ROOT, "model"),), kind=HolderKind.MODEL,
                        scope=None, where=None, items=None, tensors=4, bytes=40_000),
            HolderStats(path=(Step(StepKind.ROOT, "kept"),), kind=HolderKind.LOCAL,
                        scope=None, where=None, items=3 + at * items_per_step, tensors=3,
                        bytes=3 * 4096 + at * kept_per_step),
        )
        return Census(iteration=at, seconds=0.01, complete=True, objects=1000,
                      holders=holders)

    return ReportData(device="cpu", backend=backend, baseline=100 * MiB, iterations=its,
                      measured=measured, censuses=tuple(census(at) for at in (2, 4, 8, 11)),
                      other_threads=others)


def test_heap_growth_nothing_this_loop_holds_explains_is_left_to_the_other_threads() -> None:
    """The list ``kept`` holds as much at every census while the heap gains 1 MiB a step:
    with 5 other threads training, no finding, and a note says why."""
    alone = _hand_built(others=0)
    (finding,) = analyse(alone, rules=["memory-growth"])  # one thread: judged as before
    assert finding.severity is memsentry.Severity.HINT
    assert remarks(alone, analyse(alone)) == ()

    beside = _hand_built(others=5)
    assert analyse(beside, rules=["memory-growth"]) == ()
    (note,) = remarks(beside, analyse(beside))
    assert "the process heap grew by 1.0 MiB/iter (+9.0 MiB from iteration 2 to 11)" in note
    assert "tensors this loop holds grew 0 B/iter over 4 censuses, less than 25%" in note
    assert "5 other threads ran a training loop" in note and "exact=True" in note


def test_growth_this_loop_holds_is_still_judged_beside_other_threads() -> None:
    leaking = _hand_built(others=5, kept_per_step=MiB)
    (finding,) = analyse(leaking, rules=["memory-growth"])
    assert finding.severity is memsentry.Severity.LEAK
    assert remarks(leaking, [finding]) == ()
    # Values piled up in a list of this loop's: its own growth, judged as alone.
    piling = _hand_built(others=5, items_per_step=1000)
    assert [f.severity for f in analyse(piling, rules=["memory-growth"])] == [
        memsentry.Severity.HINT]
    # Counting tensor storages sees only the tracker's thread: its growth is its own.
    exact = _hand_built(others=5, measured=Measured.TENSORS, backend="cpu-storages")
    (finding,) = analyse(exact, rules=["memory-growth"])
    assert finding.severity is memsentry.Severity.LEAK
    # Too few holder searches finished to say what this loop holds: not judged either.
    unsearched = replace(_hand_built(others=2), censuses=())
    assert analyse(unsearched, rules=["memory-growth"]) == ()
    (note,) = remarks(unsearched, ())
    assert "too few holder searches of this loop finished" in note and "(0; 3 are" in note
