"""Tracker.start()/stop(): tracking from a framework's callbacks keeps every guarantee of the
with-block (same figures and findings, hooks removed, nothing kept alive, leaks signalled)."""

from __future__ import annotations

import gc
import warnings
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.modules.module as module_globals
from conftest import iterations_run, make_mlp
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

import memsentry
from memsentry import LeakError, LeakWarning, Report, TrackerStateError


class Callback:
    """What a Lightning or HF Trainer callback does: start at fit start, stop at fit end."""

    def __init__(self, **options: object) -> None:
        self.options = options
        self.tracker: memsentry.Tracker | None = None
        self.report: Report | None = None

    def on_train_start(self, model: nn.Module) -> None:
        self.tracker = memsentry.track(model, **self.options)  # type: ignore[arg-type]
        self.tracker.start()

    def on_train_end(self) -> None:
        assert self.tracker is not None
        self.report = self.tracker.stop()


def _fit(model: nn.Module, steps: int, history: list[torch.Tensor] | None,
         callback: Callback | None = None) -> list[float]:
    """A trainer's loop: the callback starts and stops tracking in other frames."""
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    if callback is not None:
        callback.on_train_start(model)
    for _ in range(steps):
        loss = model(torch.randn(8, 16)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if history is not None:
            history.append(loss)  # keeps every step's graph
    if callback is not None:
        callback.on_train_end()
    return losses


def test_start_and_stop_record_what_the_with_block_records() -> None:
    torch.manual_seed(0)
    model = make_mlp()
    # Figures compared call by call and iteration by iteration: no budget for either.
    with memsentry.track(model, on_leak="ignore", overhead=None) as t:
        _fit(model, 7, [])
    in_block = t.report()
    torch.manual_seed(0)
    model = make_mlp()
    callback = Callback(on_leak="ignore", overhead=None)
    _fit(model, 7, [], callback)
    report = callback.report
    assert report is not None
    assert [layer.name for layer in report.layers] == [layer.name for layer in in_block.layers]
    assert [(layer.calls, layer.output_bytes, layer.saved_bytes) for layer in report.layers] == [
        (layer.calls, layer.output_bytes, layer.saved_bytes) for layer in in_block.layers
    ]
    assert len(report.iterations) == len(in_block.iterations) == 7
    assert [c.iteration for c in report.censuses] == [c.iteration for c in in_block.censuses]
    rules = [(f.rule, f.severity) for f in report.findings]
    assert rules == [(f.rule, f.severity) for f in in_block.findings]
    assert ("tensor-accumulation", memsentry.Severity.LEAK) in rules


def test_training_is_bitwise_identical_under_start_and_stop() -> None:
    torch.manual_seed(1)
    plain_model = make_mlp()
    plain = _fit(plain_model, 6, None)
    torch.manual_seed(1)
    model = make_mlp()
    tracked = _fit(model, 6, None, Callback(on_leak="ignore"))
    assert tracked == plain
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_stop_removes_every_hook_and_keeps_nothing_alive() -> None:
    model = make_mlp()
    before = (len(module_globals._global_forward_hooks),
              len(module_globals._global_forward_pre_hooks))
    callback = Callback(on_leak="ignore")
    _fit(model, 3, None, callback)
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
    assert (len(module_globals._global_forward_hooks),
            len(module_globals._global_forward_pre_hooks)) == before
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert _get_current_dispatch_mode() is None
    model_ref = weakref.ref(model)
    del model
    gc.collect()
    assert model_ref() is None
    assert callback.tracker is not None and not callback.tracker.active


def test_stop_returns_the_final_report_and_a_second_stop_changes_nothing() -> None:
    model = make_mlp()
    tracker = memsentry.track(model).start()
    assert tracker.active
    history: list[torch.Tensor] = []
    with pytest.warns(LeakWarning, match="tensor-accumulation") as caught:
        _fit(model, 36, history)  # said as the census of iteration 34 confirms it
    forward = next(n for n, line in enumerate(Path(__file__).read_text().splitlines(), 1)
                   if "loss = model(torch.randn(8, 16))" in line)
    assert {(w.filename, w.lineno) for w in caught} == {(__file__, forward)}  # the loop's
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: stop() does not repeat it
        first = tracker.stop()
    assert isinstance(first, Report) and not tracker.active
    assert [f.rule for f in first.findings] == ["tensor-accumulation"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        again = tracker.stop()
    assert again == first == tracker.report()


def test_stop_raises_the_leak_with_on_leak_raise() -> None:
    # Raised in the loop at the first boundary after the census that confirms it (that of
    # iteration 34, taken as iteration 35 begins); a framework's on_exception then calls
    # stop(error).
    model = make_mlp()
    tracker = memsentry.track(model, on_leak="raise").start()
    history: list[torch.Tensor] = []
    with pytest.raises(LeakError) as caught:
        _fit(model, 40, history)
    assert len(history) == 35
    assert [f.rule for f in caught.value.findings] == ["tensor-accumulation"]
    assert tracker.active
    report = tracker.stop(caught.value)  # not raised again
    assert [f.rule for f in report.findings] == ["tensor-accumulation"]
    assert not tracker.active
    for module in model.modules():
        assert not module._forward_hooks


def test_stop_raises_a_leak_it_finds_at_the_end() -> None:
    # A leak proven only by the end's census is raised by stop(), after every hook went.
    model = make_mlp()
    tracker = memsentry.track(model, on_leak="raise").start()
    history: list[torch.Tensor] = []
    _fit(model, 7, history)  # proven by the censuses of 2, 3, 4 and 6, not yet confirmed
    tracker.census()
    with pytest.raises(LeakError) as caught:
        tracker.stop()
    assert [f.rule for f in caught.value.findings] == ["tensor-accumulation"]
    assert not tracker.active
    for module in model.modules():
        assert not module._forward_hooks  # the hooks went before the error was raised


def test_start_twice_and_stop_before_start_are_refused() -> None:
    tracker = memsentry.track(make_mlp())
    with pytest.raises(TrackerStateError, match=r"before start\(\)"):
        tracker.stop()
    tracker.start()
    with pytest.raises(TrackerStateError, match="already used"):
        tracker.start()
    tracker.stop()
    with pytest.raises(TrackerStateError, match="already used"):
        tracker.start()
    with pytest.raises(TrackerStateError, match="already used"), tracker:
        pass


def test_step_between_start_and_stop_closes_iterations() -> None:
    model = make_mlp()
    tracker = memsentry.track(model, on_leak="ignore").start()
    for _ in range(4):
        model(torch.randn(8, 16))
        tracker.step()
    report = tracker.stop()
    assert iterations_run(report) == 4
    assert {it.boundary for it in report.iterations if it.boundary != "exit"} == {"step"}
    with pytest.raises(TrackerStateError, match="outside its with-block"):
        tracker.step()


def test_the_user_error_between_start_and_stop_is_not_swallowed() -> None:
    model = make_mlp()
    tracker = memsentry.track(model, on_leak="ignore").start()
    with pytest.raises(ValueError, match="bad batch"):
        try:
            model(torch.randn(8, 16))
            raise ValueError("bad batch")
        finally:
            report = tracker.stop()
    assert report.layers and not model[0]._forward_hooks


def _epochs(census: bool) -> Report:
    """Three epochs of eight steps; each epoch ends with an evaluation that keeps its
    outputs in ``kept`` (never cleared), followed by ``t.census()`` when asked."""
    torch.manual_seed(0)
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kept: list[torch.Tensor] = []
    with memsentry.track(model, on_leak="ignore") as t:
        for _epoch in range(3):
            for _ in range(8):
                model(torch.randn(8, 16)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            with torch.no_grad():
                kept.extend(model(torch.randn(8, 16)) for _ in range(4))
            if census:
                t.census()
    return t.report()


def test_census_on_demand_sees_what_grows_only_at_epoch_ends() -> None:
    assert [f for f in _epochs(census=False).findings if f.severity.value == "leak"] == []
    report = _epochs(census=True)
    found = [f for f in report.findings if f.severity.value == "leak"]
    assert [f.subject.name for f in found if f.subject] == ["kept"]
    assert {15, 23} <= {c.iteration for c in report.censuses}  # epoch ends (7 is next to 6)
    tracker = memsentry.track(on_leak="ignore")
    with pytest.raises(TrackerStateError, match="outside its with-block"):
        tracker.census()
