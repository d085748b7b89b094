"""Layers measured in turn once measuring every call would cost more than its share of the
loop's time: results unchanged, every layer still measured, leaks still found, hooks off the
modules outside the window, and the report saying so."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from fake_clock import FakeClock
from seams import tracked
from torch import nn
from torch.nn.modules import module as module_globals

import memsentry


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(6)],
                         nn.Linear(16, 2))


def train(model: nn.Module, steps: int, *, kept: list[torch.Tensor] | None = None,
          watch: list[int] | None = None, clock: FakeClock | None = None,
          step: float = 1e-3) -> list[float]:
    """``steps`` Adam steps on random batches; on ``clock``, each step's own work takes
    ``step`` seconds."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(1)
    losses = []
    for _ in range(steps):
        if clock is not None:
            clock.advance(step)
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


#: The loop's own work per step, on a clock where each of memsentry's readings takes 0.1 ms:
#: measuring every layer call then costs about 14% of a step, over the 5% budget, and the
#: account pays for a sampled iteration of part of the layers from iteration 12 on.
STEP = 0.1


def in_turn(model: nn.Module | None = None, **options: object) -> tuple[memsentry.Tracker,
                                                                        FakeClock]:
    """A tracker under a 5% budget on a clock where measuring every call is too dear."""
    clock = FakeClock(tick=1e-4)
    return tracked(model, overhead=0.05, on_leak="ignore", credit=0.0, clock=clock,
                   **options), clock


def test_over_budget_layers_are_measured_in_turn_with_bitwise_results() -> None:
    plain_model = make_model()
    plain = train(plain_model, 20)
    model = make_model()
    hooked: list[int] = []
    tracker, clock = in_turn(model)
    with tracker as t:
        losses = train(model, 20, watch=hooked, clock=clock, step=STEP)
    assert plain == losses
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


def test_a_leak_is_found_while_layers_are_measured_in_turn() -> None:
    model = make_model()
    kept: list[torch.Tensor] = []
    tracker, clock = in_turn(model)
    with tracker as t:
        train(model, 20, kept=kept, clock=clock, step=STEP)
    report = t.report()
    assert any("measured the layers in turn" in n for n in report.notes)
    leaks = [f for f in report.findings if f.severity is memsentry.Severity.LEAK]
    assert [f.rule for f in leaks] == ["tensor-accumulation"]
    assert "`kept`" in leaks[0].message


def test_global_hooks_measure_in_turn_too() -> None:
    model = make_model()
    tracker, clock = in_turn()
    with tracker as t:
        train(model, 20, clock=clock, step=STEP)
    report = t.report()
    assert any("measured the layers in turn" in n for n in report.notes)
    leaves = [layer for layer in report.layers if layer.type in {"Linear", "Tanh"}]
    assert len(leaves) == 13 and all(layer.forward_delta is not None for layer in leaves)
    # The outermost module ran 20 times; light iterations run with no hook on it, so its
    # count is a lower bound, and the table says so.
    root = report.layer("Sequential")
    assert not root.calls_complete and 3 <= root.calls < 20
    assert f">={root.calls}" in report.format()
    assert memsentry.Report.from_dict(json.loads(report.to_json())).layer("Sequential") == root


def test_without_a_limit_every_call_is_measured() -> None:
    model = make_model()
    hooked: list[int] = []
    with memsentry.track(model, overhead=None, on_leak="ignore") as t:
        train(model, 8, watch=hooked)
    report = t.report()
    assert not any("in turn" in n for n in report.notes)
    assert set(hooked) == {len(list(model.modules()))}
    assert {layer.calls for layer in report.layers} == {8}


def test_a_cheap_loop_is_measured_in_full() -> None:
    # The default limit: while measuring costs a small share of the step, every call of every
    # iteration is measured. On a clock where each reading takes 1 us and a step 100 ms
    # (measuring an iteration's 280 readings takes 0.3% of it).
    model = make_model()
    clock = FakeClock(tick=1e-6)
    with tracked(model, on_leak="ignore", clock=clock) as t:
        train(model, 8, clock=clock, step=0.1)
    report = t.report()
    assert not any("in turn" in n or "kept to its budget" in n for n in report.notes)
    assert {layer.calls for layer in report.layers} == {8}
    assert {layer.measured_calls for layer in report.layers} == {8}
    assert all(layer.calls_complete for layer in report.layers)


def test_measuring_in_turn_from_the_last_iteration_on_is_said() -> None:
    # Measuring the layers in turn began only in the last iteration: its window held the
    # outermost module, and the layers outside it carried no hook, so no call was seen left
    # out, and the report kept quiet while the layers table's calls differed (a flaky test
    # on a loaded machine found it). On a clock where the loop's step takes 1 s and a reading
    # 1 us, but 1 ms in iteration 6: measuring it costs three times the 4% budget of its
    # step, which the account, rich from six cheap iterations, still pays.
    model = make_model()
    clock = FakeClock(tick=1e-6)
    with tracked(model, on_leak="ignore", clock=clock, credit=0.0) as t:
        for step in range(8):
            clock.tick = 1e-3 if step == 6 else 1e-6
            train(model, 1, clock=clock, step=1.0)
    report = t.report()
    assert not any("kept to its budget" in n for n in report.notes)  # every one sampled
    assert {layer.calls for layer in report.layers} != {8}
    (note,) = [n for n in report.notes if "in turn" in n]
    assert "in iteration 6" in note and "From iteration 7" in note


@pytest.mark.parametrize("overhead", [0, -0.1, "3%", True, 11])
def test_a_bad_overhead_is_refused_before_anything_is_hooked(overhead: object) -> None:
    model = make_model()
    with pytest.raises(ValueError, match=r"track\(overhead=\.\.\.\)"):
        memsentry.track(model, overhead=overhead)  # type: ignore[arg-type]
    assert not any(m._forward_pre_hooks for m in model.modules())


def test_the_note_names_no_iteration_that_a_later_optimizer_step_merged_away() -> None:
    # A script that evaluates before it trains (YOLO's get_bboxes before train_fn): its first
    # iterations are the model's calls, merged into one when the optimizer first steps. The
    # iteration whose cost narrowed the measuring is gone; the note must not quote it.
    model = make_model()
    tracker, clock = in_turn(model)
    with tracker as t:
        with torch.no_grad():
            for _ in range(12):  # each evaluation step 30 ms: measuring it is too dear
                clock.advance(0.03)
                model(torch.randn(8, 16))
        train(model, 3, clock=clock, step=STEP)
    report = t.report()
    (note,) = [n for n in report.notes if "measured the layers in turn" in n]
    indices = {it.index for it in report.iterations}
    quoted = [int(word.rstrip(",.")) for word in note.split("iteration ")[1:]
              for word in [word.split()[0]]]
    assert quoted and all(index in indices for index in quoted), (note, sorted(indices))


def test_what_the_closing_read_costs_is_not_taken_from_the_loops_time() -> None:
    """Reading the parts as an iteration closes comes after the iteration's seconds end: the
    loop's own time is the iteration's seconds less what memsentry did inside them, never a
    negative floored to nothing (the note once said "7700169700% of that iteration's 0.0 ms")."""
    from memsentry.record.budget import PARTS
    from memsentry.record.coverage import Coverage

    clock = FakeClock()
    coverage = Coverage(0.05, clock=clock)
    coverage.current = replace(coverage.current, layers=4)
    started = clock()
    clock.advance(0.002)  # hooks inside the iteration: 2 ms
    coverage.count(started)
    started = clock()
    clock.advance(0.077)  # the parts read as it closed: 77 ms, after its 10 ms ended
    coverage.count_closing(started, PARTS)
    coverage.end_iteration(50, 0.010, 4)
    assert coverage.busiest is not None
    own, loop = coverage.busiest
    assert own == pytest.approx(0.079)
    assert loop == pytest.approx(0.008)  # 10 ms less the 2 ms of hooks inside them
    assert coverage.after == 0.0 and coverage.own == 0.0


@pytest.mark.parametrize(("own", "loop", "said"), [
    (0.077, 0.008, "962% of that iteration's 8.0 ms of the loop's own work"),
    (0.077, 1e-9, "about all of that iteration's time"),
])
def test_the_note_gives_a_share_only_of_time_the_loop_had(own: float, loop: float,
                                                          said: str) -> None:
    from memsentry.record.coverage import _busiest_words

    words = _busiest_words(own, loop, since=98, share="5%")
    assert words.startswith("Measuring every layer call took 77.0 ms in iteration 97, " + said)
