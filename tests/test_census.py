"""The holder search (census) itself: it keeps nothing alive, respects its budget and its
switch, survives odd objects, and its records round-trip through JSON."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch
from conftest import MiB, make_mlp
from fake_clock import FakeClock
from torch import nn

import memsentry
from memsentry.census import hook_census
from memsentry.census.walk import WALL_CEILING, Budget
from memsentry.measure.cpu import MALLINFO2_UNAVAILABLE, MallinfoBackend
from memsentry.record import census_due
from memsentry.record.schedule import widened


def _train(model: nn.Module, steps: int, **options) -> memsentry.Report:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with memsentry.track(model, on_leak="ignore", **options) as t:
        for _ in range(steps):
            model(torch.randn(8, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
    return t.report()


def test_censuses_come_after_warmup_then_at_doubling_gaps() -> None:
    assert [i for i in range(80) if census_due(i)] == [2, 3, 4, 6, 10, 18, 34, 66]
    report = _train(make_mlp(), 12)
    assert [c.iteration for c in report.censuses] == [2, 3, 4, 6, 10]
    assert all(c.complete and c.seconds > 0 for c in report.censuses)


def test_a_local_rebound_after_a_census_is_freed_at_once() -> None:
    # Reading a frame's locals leaves a snapshot that would keep the old value alive; the
    # census must not turn "loop variables" into leaks of its own.
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    refs = []
    with gc_off(), memsentry.track(model, on_leak="ignore"):
        for _ in range(6):
            activations = torch.ones(1024)
            refs.append(weakref.ref(activations))
            model(torch.randn(8, 16)).sum().backward()
            opt.step()  # censuses at iterations 2, 3, 4 read this frame's locals
            opt.zero_grad()
        del activations
    assert [r() for r in refs] == [None] * 6


class gc_off:
    def __enter__(self) -> None:
        self.was = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self.was:
            gc.enable()


def test_holders_false_turns_the_search_off() -> None:
    report = _train(make_mlp(), 8, holders=False)
    assert report.censuses == ()


@pytest.mark.parametrize("budget", [0, -1, "1s", True])
def test_holder_budget_must_be_a_positive_number(budget: object) -> None:
    with pytest.raises(ValueError, match="holder_budget"):
        memsentry.track(holder_budget=budget)  # type: ignore[arg-type]


def test_a_search_over_budget_stops_and_says_so() -> None:
    big = [torch.zeros(1) for _ in range(20_000)]  # many objects to walk
    report = _train(make_mlp(), 6, holder_budget=1e-6)
    assert big
    assert report.censuses and not any(c.complete for c in report.censuses)
    assert any("budget" in note and "holder_budget" in note for note in report.notes)
    assert [f for f in report.findings if f.rule == "tensor-accumulation"] == []


def test_each_search_cut_short_gives_the_next_twice_its_budget_up_to_eight_times() -> None:
    big = [torch.zeros(1) for _ in range(20_000)]  # many objects to walk
    report = _train(make_mlp(), 12, holder_budget=1e-6)
    assert big
    said = [note for note in report.notes if "stopped at its" in note]
    budgets = [float(note.split("stopped at its ")[1].split(" s budget")[0]) for note in said]
    assert len(budgets) == len(report.censuses) >= 5
    assert budgets[:5] == [1e-6, 2e-6, 4e-6, 8e-6, 8e-6]
    assert all("(CPU time)" in note for note in said)


@pytest.mark.parametrize(("cut", "budget", "wanted"), [
    (True, 0.5, 1.0), (True, 2.0, 4.0), (True, 4.0, 4.0), (False, 2.0, 2.0), (False, 0.5, 0.5)])
def test_the_next_budget_widens_after_a_cut_and_stays(cut: bool, budget: float,
                                                      wanted: float) -> None:
    assert widened(budget, 0.5, cut=cut) == wanted


def test_a_walk_is_bounded_by_its_threads_cpu_time_not_the_wall_clock() -> None:
    cpu, wall = FakeClock(), FakeClock()
    budget = Budget(0.5, cpu=cpu, wall=wall)
    wall.advance(5.0)  # other processes held the cores: ten times the budget went by
    assert not any(budget.spent() for _ in range(4096))
    cpu.advance(0.6)  # the walk's own work passed its budget
    assert any(budget.spent() for _ in range(256)) and budget.exhausted


def test_a_walk_that_waits_for_the_interpreter_lock_still_ends() -> None:
    cpu, wall = FakeClock(), FakeClock()
    budget = Budget(0.5, cpu=cpu, wall=wall)
    wall.advance(0.5 * WALL_CEILING - 0.1)
    assert not any(budget.spent() for _ in range(256))
    wall.advance(0.2)
    assert any(budget.spent() for _ in range(256))


def test_the_search_walks_past_objects_that_raise() -> None:
    class Hostile:
        @property
        def __dict__(self):  # type: ignore[override]
            raise RuntimeError("no peeking")

    hostile = Hostile()
    dead = weakref.proxy(nn.Linear(2, 2))  # a proxy to an object already gone
    kept = []
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(7):
            kept.append(torch.ones(4096))
            model(torch.randn(8, 16)).sum().backward()
            opt.step()
    report = t.report()
    assert hostile is not None and dead is not None
    assert not any("failed" in note for note in report.notes)
    assert [f.rule for f in report.findings] == ["tensor-accumulation"]


def test_memsentrys_own_hooks_are_not_counted() -> None:
    model = make_mlp()
    with memsentry.track(model, on_leak="ignore") as t:
        model(torch.randn(2, 16))
        own = t._recorder._census_roots()["own_hooks"]
        assert hook_census([("mlp", model)], own) == ()
        handle = model.register_forward_hook(lambda m, a, o: None)
        (stats,) = hook_census([("mlp", model)], own)
        assert (stats.module, stats.count, stats.hook) == ("mlp", 1, "<lambda>")
        handle.remove()


def test_censuses_round_trip_through_json(tmp_path) -> None:
    kept = []
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(7):
            kept.append(model(torch.randn(4, 16)))
            model(torch.randn(8, 16)).sum().backward()
            opt.step()
    report = t.report()
    path = tmp_path / "report.json"
    report.to_json(path)
    again = memsentry.Report.from_json(path)
    assert again.censuses == report.censuses
    assert again.unused_graphs == report.unused_graphs
    assert memsentry.analyse(again) == report.findings


def test_a_module_that_lost_its_file_is_no_longer_walked_as_the_users() -> None:
    # A script's `__main__` freed by `memsentry run` and an IPython shell's `__main__` (no
    # file) made later at its address: once judged the user's, every census then raised.
    import sys
    import types

    from memsentry.usercode.frames import user_modules

    module = types.ModuleType("memsentry_test_lost_file")
    module.__file__ = __file__
    sys.modules[module.__name__] = module
    try:
        assert module in user_modules()
        del module.__file__
        assert module not in user_modules()
        model = nn.Linear(4, 4)
        with memsentry.track(model, on_leak="ignore") as t:
            for _ in range(5):
                model(torch.randn(2, 4)).sum().backward()
                t.step()
        assert t.report().censuses  # taken, not lost to an AttributeError
    finally:
        del sys.modules[module.__name__]


def test_user_modules_follow_sys_modules_between_censuses(tmp_path: Path) -> None:
    # The answer is reused while sys.modules is unchanged: a module imported, replaced or
    # removed between two censuses must still be seen as it is now.
    import sys
    import types

    from memsentry.usercode.frames import user_modules

    first = types.ModuleType("memsentry_test_later")
    first.__file__ = str(tmp_path / "later.py")
    before = user_modules()
    assert first not in before
    sys.modules[first.__name__] = first
    try:
        assert first in user_modules()
        second = types.ModuleType("memsentry_test_later")
        second.__file__ = str(tmp_path / "later.py")
        sys.modules[first.__name__] = second  # same size, same name, another module
        now = user_modules()
        assert second in now and first not in now
    finally:
        del sys.modules[first.__name__]
    assert all(m.__name__ != "memsentry_test_later" for m in user_modules())


class _Node:
    pass


class _ProxyNet(nn.Module):
    """A model holding a weakref.proxy whose referent died, as Lightning's objects hold
    proxies to one another."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1)
        gone = _Node()
        self.dead = weakref.proxy(gone)
        del gone
        self.kept: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_dead_weak_proxies_in_garbage_and_on_the_model_do_not_stop_the_census() -> None:
    """Seen on a Lightning run: every holder search failed with "ReferenceError:
    weakly-referenced object no longer exists" (isinstance() asks a proxy for its referent's
    class), and the leak below went unnamed."""
    model = _ProxyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with memsentry.track(model, on_leak="ignore", overhead=None) as t:
        for _ in range(12):
            node, target = _Node(), _Node()
            node.proxy, node.me = weakref.proxy(target), node  # a cycle holding a proxy
            del node, target  # the referent dies, the cycle is garbage for the census
            model.kept.append(model(torch.randn(4, 8)).sum())
            model.kept[-1].backward(retain_graph=True)
            opt.step()
            opt.zero_grad()
    report = t.report()
    assert not [note for note in report.notes if "holder search" in note]
    assert report.censuses
    (finding,) = [f for f in report.findings if f.rule == "tensor-accumulation"]
    assert "kept" in finding.message


class _Cyclic:
    """An object that refers to itself: only a collection frees it and what it holds."""


@pytest.mark.skipif(MALLINFO2_UNAVAILABLE is not None, reason="needs glibc mallinfo2")
def test_what_a_cycle_held_is_counted_as_freed_by_the_census_that_collected_it() -> None:
    """The census's full collection frees the tensors the cycles it found owned: the figure
    it reports is what they held (before, the last object found was still referenced while
    the collection ran, and a cycle's tensor was counted but not freed)."""
    from memsentry.census.garbage import garbage_census

    backend = MallinfoBackend()
    gc.collect()
    for _ in range(3):
        held = _Cyclic()
        held.me = held  # type: ignore[attr-defined]
        held.tensor = torch.ones(MiB)  # type: ignore[attr-defined]  # 4 MiB of floats
        del held
        stats = garbage_census(backend.allocated)
        assert (stats.tensors, stats.bytes) == (1, 4 * MiB)
        assert stats.freed >= 4 * MiB
