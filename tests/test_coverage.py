"""Layers measured in turn once measuring every call would cost more than its share of the
loop's time: results unchanged, every layer still measured, leaks still found, hooks off the
modules outside the window, and the report saying so."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn.modules import module as module_globals

import memsentry
import memsentry.record.coverage as coverage_module

pytestmark = pytest.mark.in_turn  # these tests keep the timing of measuring


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(6)],
                         nn.Linear(16, 2))


def train(model: nn.Module, steps: int, *, kept: list[torch.Tensor] | None = None,
          watch: list[int] | None = None) -> list[float]:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(1)
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(8, 16)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if kept is not None:
            kept.append(torch.randn(32 * 1024))  # 128 KiB a step, kept
        if watch is not None:  # how many of the model's modules carry a hook now, and
            watch.append(sum(bool(m._forward_pre_hooks) for m in model.modules())  # global
                         + len(module_globals._global_forward_pre_hooks))  # hooks, if any
    return losses


@pytest.fixture
def no_floor(monkeypatch: pytest.MonkeyPatch, ample_budget: None) -> None:
    """Small test models cost less than the floor below which nothing rotates; every
    iteration is sampled (the budget's light iterations are tested in test_budget.py)."""
    monkeypatch.setattr(coverage_module, "FLOOR", 0.0)


def test_over_budget_layers_are_measured_in_turn_with_bitwise_results(no_floor: None) -> None:
    plain_model = make_model()
    plain = train(plain_model, 20)
    model = make_model()
    hooked: list[int] = []
    with memsentry.track(model, overhead=1e-6, on_leak="ignore") as t:
        tracked = train(model, 20, watch=hooked)
    assert plain == tracked
    assert all(torch.equal(a, b) for a, b in
               zip(plain_model.state_dict().values(), model.state_dict().values(), strict=True))
    report = t.report()
    (note,) = [n for n in report.notes if "measured the layers in turn" in n]
    assert "track(overhead=None)" in note
    modules = len(list(model.modules()))
    # In the first iterations every module is hooked; once the window shrank, only the
    # root (it marks iterations) and the window's modules are.
    assert hooked[0] == modules
    assert min(hooked) <= 3 < modules
    # Every layer still has figures, from fewer calls than it ran.
    leaves = [layer for layer in report.layers if layer.type in {"Linear", "Tanh"}]
    assert len(leaves) == 13
    assert all(layer.forward_delta is not None and layer.backward_peak is not None
               for layer in leaves)
    assert all(layer.output_bytes == 8 * 16 * 4 for layer in leaves if layer.type == "Tanh")
    assert not any(f.severity is memsentry.Severity.LEAK for f in report.findings)


def test_a_leak_is_found_while_layers_are_measured_in_turn(no_floor: None) -> None:
    model = make_model()
    kept: list[torch.Tensor] = []
    with memsentry.track(model, overhead=1e-6, on_leak="ignore") as t:
        train(model, 12, kept=kept)
    report = t.report()
    assert any("measured the layers in turn" in n for n in report.notes)
    leaks = [f for f in report.findings if f.severity is memsentry.Severity.LEAK]
    assert [f.rule for f in leaks] == ["tensor-accumulation"]
    assert "`kept`" in leaks[0].message


def test_global_hooks_measure_in_turn_too(no_floor: None) -> None:
    model = make_model()
    with memsentry.track(overhead=1e-6, on_leak="ignore") as t:
        train(model, 16)
    report = t.report()
    assert any("measured the layers in turn" in n for n in report.notes)
    leaves = [layer for layer in report.layers if layer.type in {"Linear", "Tanh"}]
    assert len(leaves) == 13 and all(layer.forward_delta is not None for layer in leaves)
    root = report.layer("Sequential")
    assert root.calls == 16  # outermost calls are all counted


def test_without_a_limit_every_call_is_measured(no_floor: None) -> None:
    model = make_model()
    hooked: list[int] = []
    with memsentry.track(model, overhead=None, on_leak="ignore") as t:
        train(model, 8, watch=hooked)
    report = t.report()
    assert not any("in turn" in n for n in report.notes)
    assert set(hooked) == {len(list(model.modules()))}
    assert {layer.calls for layer in report.layers} == {8}


EndIteration = Callable[[coverage_module.Coverage, int, float, int], None]


def _trained_through(monkeypatch: pytest.MonkeyPatch,
                     end_iteration: EndIteration) -> memsentry.Report:
    """The report of 8 steps of :func:`make_model` under ``track()``, each iteration's end
    going through ``end_iteration`` (which calls the ``Coverage.end_iteration`` it wraps)."""
    monkeypatch.setattr(coverage_module.Coverage, "end_iteration", end_iteration)
    model = make_model()
    with memsentry.track(model, on_leak="ignore") as t:
        train(model, 8)
    return t.report()


def test_a_cheap_loop_is_measured_in_full(monkeypatch: pytest.MonkeyPatch,
                                          ample_budget: None) -> None:
    # The default limit with the floor: while measuring costs under 2 ms an iteration (a small
    # model's hooks take a tenth of that on an idle machine), every call is measured. The
    # test reads what measuring cost, so a loaded machine does not decide it.
    over: list[tuple[int, bool]] = []  # per iteration: did measuring cost over the limit?
    original = coverage_module.Coverage.end_iteration

    def spy(self: coverage_module.Coverage, index: int, seconds: float, layers: int) -> None:
        own = self.own + coverage_module.DISPATCH * self.calls
        allowed = max(coverage_module.OVERHEAD * (seconds - own), coverage_module.FLOOR)
        if index + 1 >= coverage_module.FULL_FIRST:
            over.append((index, own > allowed))
        original(self, index, seconds, layers)

    report = _trained_through(monkeypatch, spy)
    assert over
    # Narrowing after an iteration applies to the next: over the limit in the last of the 8
    # iterations (index 7) alone leaves every call measured.
    if not any(was_over for index, was_over in over if index < 7):  # the usual case
        assert not any("in turn" in n for n in report.notes)
        assert {layer.calls for layer in report.layers} == {8}
    else:  # the machine was too busy: measuring in turn was then the rule's answer
        assert any("in turn" in n for n in report.notes)


def test_measuring_in_turn_from_the_last_iteration_on_is_said(
        monkeypatch: pytest.MonkeyPatch, ample_budget: None) -> None:
    # Measuring the layers in turn began only in the last iteration: its window held the
    # outermost module, and the layers outside it carried no hook, so no call was seen left
    # out, and the report kept quiet while the layers table's calls differed (a flaky test
    # on a loaded machine found it). Iteration 6's cost is raised by hand, nothing else.
    monkeypatch.setattr(coverage_module, "FLOOR", 3600.0)  # no narrowing but the forced one
    original = coverage_module.Coverage.end_iteration

    def costly(self: coverage_module.Coverage, index: int, seconds: float, layers: int) -> None:
        if index == 6:
            self.own += 7200.0
            seconds += 7201.0
        original(self, index, seconds, layers)

    report = _trained_through(monkeypatch, costly)
    assert {layer.calls for layer in report.layers} != {8}
    (note,) = [n for n in report.notes if "in turn" in n]
    assert "in iteration 6" in note and "From iteration 7" in note


@pytest.mark.parametrize("overhead", [0, -0.1, "3%", True, 11])
def test_a_bad_overhead_is_refused_before_anything_is_hooked(overhead: object) -> None:
    model = make_model()
    with pytest.raises(ValueError, match=r"track\(overhead=\.\.\.\)"):
        memsentry.track(model, overhead=overhead)  # type: ignore[arg-type]
    assert not any(m._forward_pre_hooks for m in model.modules())


def test_the_note_names_no_iteration_that_a_later_optimizer_step_merged_away(
        no_floor: None) -> None:
    # A script that evaluates before it trains (YOLO's get_bboxes before train_fn): its first
    # iterations are the model's calls, merged into one when the optimizer first steps. The
    # iteration whose cost narrowed the measuring is gone; the note must not quote it.
    model = make_model()
    with memsentry.track(model, overhead=1e-6, on_leak="ignore") as t:
        with torch.no_grad():
            for _ in range(12):
                model(torch.randn(8, 16))
        train(model, 3)
    report = t.report()
    (note,) = [n for n in report.notes if "measured the layers in turn" in n]
    indices = {it.index for it in report.iterations}
    quoted = [int(word.rstrip(",.")) for word in note.split("iteration ")[1:]
              for word in [word.split()[0]]]
    assert quoted and all(index in indices for index in quoted), (note, sorted(indices))
