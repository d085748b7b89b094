"""memsentry's cost budget (``track(overhead=...)``): past it, iterations are light (their
boundaries read, no hook on any module), censuses wait until the budget can pay for them,
the results stay bit for bit what they were, and the report says what was thinned."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import pytest
import torch
from conftest import iterations_run
from fake_clock import FakeClock
from seams import tracked
from test_coverage import make_model, train
from torch import nn
from torch.nn.modules import module as module_globals

import memsentry
from memsentry.record import budget as budget_module
from memsentry.record.budget import Budget, Untracked
from memsentry.record.policy import DEFAULT


def test_a_loop_over_its_budget_runs_light_with_bitwise_results() -> None:
    plain_model = make_model()
    plain = train(plain_model, 30)
    model = make_model()
    hooked: list[int] = []
    with tracked(model, overhead=1e-6, on_leak="ignore", credit=0.0) as t:
        losses = train(model, 30, watch=hooked)
    assert plain == losses
    assert all(torch.equal(a, b) for a, b in
               zip(plain_model.state_dict().values(), model.state_dict().values(), strict=True))
    report = t.report()
    cost = report.cost
    assert cost is not None and cost.budget == pytest.approx(1e-6)
    # Three iterations are sampled (every layer gets figures), the rest are light: no module
    # carries a hook, and only some boundaries are read, within the budget.
    assert cost.sampled == 3 and cost.iterations >= 27
    assert hooked[0] == len(list(model.modules()))
    # (the outermost module keeps its hooks while a census waits for its next call)
    assert set(hooked[5:]) <= {0, 1} and hooked[5:].count(0) > len(hooked[5:]) // 2
    light = [it for it in report.iterations if not it.sampled]
    assert light and all(it.parts is None and it.peak == it.allocated for it in light)
    assert all(layer.calls >= 1 and layer.forward_delta is not None for layer in report.layers)
    (note,) = [n for n in report.notes if "kept to its budget" in n]
    assert "in 3 of" in note and "track(overhead=None)" in note
    assert not [f for f in report.findings if f.severity is memsentry.Severity.LEAK]


@pytest.mark.parametrize("by_hand", [False, True], ids=["model", "by-hand"])
@pytest.mark.parametrize("steps", range(20, 41, 4))
def test_the_timeline_accounts_for_every_iteration_the_last_ones_passed_included(
        steps: int, by_hand: bool) -> None:
    """Light iterations pass boundaries with a count only; when the block ends among them,
    the row of its end carries their index, so the rows still say how many iterations ran."""
    clock = FakeClock(tick=1e-5)
    history: list[torch.Tensor] = []  # one tensor kept a step (by hand only)
    if by_hand:  # no module, no optimizer: backward passes end the iterations
        with tracked(overhead=0.01, on_leak="ignore", credit=0.0, clock=clock) as t:
            weights = torch.randn(16, 4, requires_grad=True)
            for _ in range(steps):
                clock.advance(1e-3)
                loss = (torch.randn(8, 16) @ weights).pow(2).mean()
                loss.backward()
                with torch.no_grad():
                    weights.sub_(0.1 * weights.grad)
                weights.grad = None
                history.append(loss.detach())
    else:
        model = make_model()
        with tracked(model, overhead=0.01, on_leak="ignore", credit=0.0, clock=clock) as t:
            train(model, steps, clock=clock)
    report = t.report()
    assert report.cost is not None and report.cost.iterations == steps
    assert iterations_run(report) == steps
    indices = [it.index for it in report.iterations]
    passed = sum(b - a - 1 for a, b in itertools.pairwise(indices))
    assert passed > 0  # the budget made some boundaries pass with a count
    title = f"Iterations ({len(indices)} recorded, {passed} passed with a count only"
    assert title in str(report)
    # Each census ran while the loop ran, within an iteration of the one it is filed under:
    # none waited past passed boundaries (at worst to the block's end).
    for census in report.censuses if by_hand else ():
        (kept,) = [h for h in census.holders if h.name == "history"]
        assert census.iteration + 1 <= kept.items <= census.iteration + 2, census.iteration


def test_global_hooks_come_off_in_light_iterations() -> None:
    model = make_model()
    before = len(module_globals._global_forward_pre_hooks)
    hooked: list[int] = []
    with tracked(overhead=1e-6, on_leak="ignore", credit=0.0) as t:
        train(model, 12, watch=hooked)
    assert hooked[0] == before + 1  # the first iterations are measured
    assert hooked[-1] == before  # then nothing of memsentry's runs at module calls
    assert len(module_globals._global_forward_pre_hooks) == before
    assert t.report().layer("Sequential").calls >= 3


def test_without_a_limit_every_iteration_is_sampled() -> None:
    model = make_model()
    with memsentry.track(model, overhead=None, on_leak="ignore") as t:
        train(model, 10)
    report = t.report()
    assert report.cost is not None and report.cost.budget is None
    assert report.cost.sampled == report.cost.iterations == 10
    assert all(it.sampled for it in report.iterations)
    assert {layer.calls for layer in report.layers} == {10}
    assert not any("budget" in n for n in report.notes)


def test_censuses_after_the_first_seven_wait_for_the_budget() -> None:
    model = make_model()
    kept: list[torch.Tensor] = []
    with tracked(model, overhead=1e-6, on_leak="ignore", credit=0.0) as t:
        train(model, 70, kept=kept)
    report = t.report()
    # Iterations 2 to 34 are searched whatever the budget (they decide a short run's
    # trends): the leak is named; that of 66 waits, and the report says so. So is the one as
    # tracking ends, as `kept` still grew at 34: it shows the leak going on.
    assert [c.iteration for c in report.censuses if not c.closing] == [2, 3, 4, 6, 10, 18, 34]
    assert report.censuses[-1].closing
    assert report.cost is not None and report.cost.censuses_deferred >= 1
    assert any("waited until the budget could pay" in n for n in report.notes)
    leaks = [f for f in report.findings if f.severity is memsentry.Severity.LEAK]
    assert [f.rule for f in leaks] == ["tensor-accumulation"] and "`kept`" in leaks[0].message


def test_the_ledger_keeps_memsentry_near_its_share() -> None:
    # A loop of small steps, where measuring every layer costs several times the step: the
    # ledger's own time over the loop's stays near the budget (it was 2.5x the loop before
    # the budget covered everything). On a clock where each of memsentry's readings takes
    # 10 us and the loop's own work 100 us a step, whatever the machine's load.
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    clock = FakeClock(tick=1e-5)
    with tracked(model, overhead=0.05, on_leak="ignore", credit=0.0, clock=clock) as t:
        for _ in range(600):
            clock.advance(1e-4)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    cost = t.report().cost
    assert cost is not None
    assert cost.iterations >= 590
    assert 3 <= cost.sampled < cost.iterations
    # Measuring (hooks, boundaries, parts) keeps near its share; the seven censuses taken
    # whatever the budget are a fixed cost, which a 0.2 s loop in a big process does not
    # pay back, and the later ones wait.
    judging = {"censuses", "analysis"}
    measuring = sum(p.seconds for p in cost.parts if p.part not in judging)
    assert measuring / cost.loop_seconds < 0.25, cost
    assert cost.part("censuses").events <= 8
    assert {p.part for p in cost.parts} >= {"module hooks", "boundaries", "censuses"}


def test_the_budget_pays_for_a_sampled_iteration_only_when_it_can() -> None:
    budget = Budget(0.1, credit=0.0, clock=FakeClock())
    for _ in range(3):  # the first iterations are sampled whatever they cost
        assert not budget.light
        budget.charge(budget_module.HOOKS, 0.004)
        budget.end_iteration(0.005)  # 1 ms of loop, 4 ms of memsentry
    assert budget.light
    assert budget.bank == pytest.approx(0.1 * 0.003 - 0.012)
    # Light iterations cost nothing here; each pays 0.1 ms in, until the 11.7 ms owed and
    # the 4 ms a sampled iteration costs are covered: 157 of them.
    light = 0
    while budget.light:
        budget.end_iteration(0.001)
        light += 1
    assert light == 157
    assert budget.cost().sampled == 3 and budget.cost().iterations == 3 + light


def test_the_time_the_program_ran_with_no_tracker_is_credited() -> None:
    # A program's start is part of its wall time: the budget's share of it (of 10 s at most)
    # pays for the first censuses (measuring never spends it). The time a tracker ran is not
    # credited to the next one; one nested in a running tracker finds none.
    age = FakeClock(start=3.0)  # the process started 3 s ago
    untracked = Untracked(age=age, clock=age)
    first = Budget(0.05, untracked=untracked)
    first.open()
    assert first.credit == pytest.approx(0.15) and first.untracked == pytest.approx(3.0)
    nested = Budget(0.05, untracked=untracked)
    nested.open()
    assert nested.credit == 0.0
    age.advance(2.0)  # the loop runs 2 s
    nested.close()
    first.close()
    age.advance(0.1)
    again = Budget(0.05, untracked=untracked)
    again.open()
    assert again.untracked == pytest.approx(3.1)  # the 2 s tracked are not counted
    assert again.credit == pytest.approx(0.155)
    again.close()
    assert not untracked.running
    # watch()'s budget is 1% of the loop's time: its credit is 1% of the start, not 5%
    assert Budget(0.01, credit=3.0).credit == pytest.approx(0.03)
    assert Budget(0.05, credit=30.0).credit == pytest.approx(0.5)  # 10 s of it at most


def test_judging_and_measuring_share_one_account() -> None:
    budget = Budget(0.1, credit=10.0, clock=FakeClock())  # 10 s untracked: 0.5 s for censuses
    for _ in range(3):
        budget.end_iteration(0.01)  # 30 ms of loop: 3 ms in the account
    assert budget.bank == pytest.approx(0.003)  # measuring never spends the credit
    assert budget.held >= 0.5 and budget.held < 0.504  # a census's 0.5 s is affordable
    budget.charge(budget_module.CENSUSES, 0.502, inside=False)
    assert budget.bank == pytest.approx(0.001)  # past the credit, a census spent what
    assert 0.001 <= budget.held < 0.0015  # measuring would have
    budget.reserved = 0.001  # a census waits for the account: measuring leaves it be
    assert budget.bank == pytest.approx(0.0)


def test_a_sampled_iteration_that_overdraws_stops_measuring() -> None:
    clock = FakeClock()  # moved by hand
    budget = Budget(0.1, credit=0.0, clock=clock)
    for _ in range(3):  # the first three are sampled whatever the account holds, but stop
        clock.advance(0.2)  # measuring past a quarter of the loop's own time in them so far
        budget.charge(budget_module.HOOKS, 0.04)  # 40 ms of 200: the loop's own is 160
        assert not budget.overdrawn()
        budget.charge(budget_module.HOOKS, 0.02)  # 60 ms of 200: over a quarter of 140
        assert budget.overdrawn()
        budget.end_iteration(0.2)
    while budget.light:  # the account refills
        budget.end_iteration(0.1)
    assert not budget.overdrawn()
    budget.charge(budget_module.HOOKS, budget.bank + 0.001)  # an episode longer than the last
    assert budget.overdrawn()
    budget.end_iteration(0.2)
    # That iteration stopped half way: its cost says only that a whole one costs more, so
    # the price of the next sampled iteration does not fall.
    assert budget.short() > 0


def test_long_first_iterations_measure_each_layer_and_count_the_rest() -> None:
    """Episodes of 100 forwards of a small policy, the first iterations allowed no time for
    measuring (as when each read of a fragmented heap takes 100 us and more): they still
    measure every layer, but count its other calls instead of measuring each; the results
    stay bit for bit, and a list kept across episodes is still named. On a clock where each
    of memsentry's readings takes 1 ms and each forward's own work 1 s (the account, at
    overhead=1.0, is never short), with the ten episodes all among the first."""
    no_time = replace(DEFAULT, first_share=0.0, sampled_first=10)
    clock = FakeClock(tick=1e-3)

    def forward(policy: nn.Module) -> torch.Tensor:
        clock.advance(1.0)
        return policy(torch.randn(1, 4)).sum()

    def episodes(policy: nn.Module, kept: list[torch.Tensor]) -> list[float]:
        opt = torch.optim.SGD(policy.parameters(), lr=1e-2)
        torch.manual_seed(1)
        losses = []
        for _ in range(10):
            total = sum(forward(policy) for _ in range(100))
            assert isinstance(total, torch.Tensor)
            opt.zero_grad()
            total.backward()
            opt.step()
            losses.append(total.item())
            kept.append(torch.randn(32 * 1024))  # 128 KiB an episode, kept
        return losses

    def policy() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 2))

    plain = episodes(policy(), [])
    model, kept_outputs = policy(), []  # type: ignore[var-annotated]
    with tracked(model, on_leak="ignore", tuning=no_time, clock=clock, overhead=1.0) as t:
        losses = episodes(model, kept_outputs)
    assert losses == plain
    report = t.report()
    layers = [layer for layer in report.layers if layer.type in {"Linear", "ReLU"}]
    # Each layer has figures, from a few calls an episode; every call is counted.
    assert len(layers) == 3 and all(layer.forward_peak is not None for layer in layers)
    assert all(layer.calls == 1000 and 1 <= layer.measured_calls <= 100 for layer in layers), [
        (layer.name, layer.calls, layer.measured_calls) for layer in layers]
    leaks = [f for f in report.findings if f.severity is memsentry.Severity.LEAK]
    assert any("`kept` (a local of episodes()" in f.message for f in leaks)


def test_first_iterations_that_stop_measuring_still_count_the_activations() -> None:
    """A loop that keeps each step's validation forward with its graph (its activations
    pile up): first iterations that stopped measuring at once still put those activations
    in the breakdown, as iterations that measured every call do. (Every iteration is one of
    the first here, sampled whatever the account holds.)"""

    def run(first_share: float) -> memsentry.Report:
        tuning = replace(DEFAULT, sampled_first=1 << 60, first_share=first_share, floor=0.0)
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        torch.manual_seed(1)
        x_val = torch.randn(256, 16)
        val_logits = []
        with tracked(model, on_leak="ignore", holders=False, tuning=tuning) as t:
            for _ in range(4):
                model(torch.randn(8, 16)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                val_logits.append(model(x_val))  # with its graph: 13 layers' activations
        return t.report()

    cut, whole = run(0.0), run(1e9)
    # At each optimizer step's peak, the validation graphs kept so far: about 96 KiB each.
    counted = [b.activations for b in cut.breakdown.iterations[1:4]]
    measured = [b.activations for b in whole.breakdown.iterations[1:4]]
    assert measured[-1] > 3 * 96 * 1024
    # The training step's own activations (13 saved tensors of 8 x 16 floats: 6.5 KiB) may be
    # alive at the peak one run samples and gone at the other's.
    assert all(abs(c - m) <= 13 * 8 * 16 * 4 for c, m in zip(counted, measured, strict=True)), (
        counted, measured)
    assert all(layer.measured_calls < layer.calls for layer in cut.layers
               if layer.type == "Linear")  # the cut run measured fewer calls


def test_first_iterations_dearer_than_the_budget_say_what_they_cost() -> None:
    # The first three iterations measure every layer whatever the budget holds: on a model of
    # many small modules that is most of a short run's time, and the report says so, with the
    # ledger's seconds; a cheap model's report has no such note. On a clock where each of
    # memsentry's readings takes 50 us and a step of the loop 1 ms.
    noted = replace(DEFAULT, first_noted=0.0)  # any cost over the share
    wide = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(150)])
    clock = FakeClock(tick=5e-5)
    with tracked(wide, on_leak="ignore", tuning=noted, clock=clock) as t:
        train(wide, 6, clock=clock)
    report = t.report()
    cost = report.cost
    assert cost is not None and cost.first_seconds > 0 and cost.first_loop_seconds > 0
    ran = cost.first_seconds + cost.first_loop_seconds
    assert cost.first_seconds > 0.04 * ran  # 301 modules measured once: far over 4%
    (note,) = [n for n in report.notes if n.startswith("The first 3 iterations")]
    assert f"took {cost.first_seconds:.2f} s of the {ran:.2f} s they ran" in note
    assert memsentry.Report.from_dict(json.loads(report.to_json())).cost == cost

    model = make_model()  # a cheap model, on a clock where the loop's step takes 1 s
    clock = FakeClock(tick=1e-6)
    with tracked(model, on_leak="ignore", clock=clock) as t:
        train(model, 6, clock=clock, step=1.0)
    assert not [n for n in t.report().notes if n.startswith("The first 3 iterations")]
