"""What no clock of memsentry's sees is charged to its ledger per event (PyTorch's long path for a
hooked call, a call through the counter, an optimizer step passed with a count), and the credit
that pays for the first censuses is what the report says it is. On a fake clock each of
memsentry's clock readings takes 1 us: its clocked work is a small, known part of the ledger."""

from __future__ import annotations

import pytest
import torch
from fake_clock import FakeClock
from seams import tracked
from torch import nn

from memsentry.record.unseen import CALL_SECONDS, Unseen, call_seconds

UNSEEN = Unseen.of(CALL_SECONDS)


def _tiny() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def test_steps_passed_with_a_count_are_charged_to_the_boundaries() -> None:
    model, opt = _tiny()
    x, y = torch.randn(2, 4), torch.randn(2, 1)
    clock = FakeClock(tick=1e-6)
    with tracked(model, clock=clock, credit=0.0, overhead=1e-4, holders=False,
                 on_leak="ignore") as t:
        for _ in range(400):
            clock.advance(1e-3)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    cost = t.report().cost
    assert cost is not None
    boundaries = cost.part("boundaries")
    closings = boundaries.events
    passed = cost.iterations - closings
    assert passed > 300, closings
    # Every step passed was charged its unseen cost; the closings' clocked work is the rest
    # (a few readings each).
    charged = passed * UNSEEN.passed_step
    assert charged <= boundaries.seconds < charged + closings * 50e-6


def test_calls_counted_with_no_hook_are_charged_to_the_module_hooks() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    x = torch.randn(4, 16)
    clock = FakeClock(tick=1e-6)
    with tracked(model, clock=clock, credit=0.0, overhead=1e-4, holders=False,
                 on_leak="ignore") as t:
        for _ in range(400):
            clock.advance(1e-3)
            with torch.no_grad():
                model(x)
    report = t.report()
    cost = report.cost
    assert cost is not None
    hooks = cost.part("module hooks")
    hooked = hooks.events  # calls that went through memsentry's hooks
    counted = 400 - hooked
    assert counted > 300
    charged = hooked * UNSEEN.hooked_call + counted * UNSEEN.counted_call
    assert charged <= hooks.seconds < charged + hooked * 50e-6


def test_the_unit_is_timed_once_and_is_a_call_not_a_millisecond() -> None:
    first = call_seconds()
    assert call_seconds() == first
    assert 1e-9 < first < 1e-4  # a call of a Python function that returns at once


def test_the_credit_that_paid_the_first_censuses_is_in_the_report() -> None:
    model, opt = _tiny()
    x, y = torch.randn(2, 4), torch.randn(2, 1)
    kept = []
    with tracked(model, credit=2.0, overhead=0.04, on_leak="ignore") as t:
        for _ in range(12):
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            kept.append(loss)
    report = t.report()
    cost = report.cost
    assert cost is not None
    assert cost.credit == pytest.approx(0.08) and cost.untracked_seconds == pytest.approx(2.0)
    (note,) = [n for n in report.notes if "credit" in n]
    assert "credit of 80.0 ms: 4% (the budget's share) of the 2.0 s the program ran" in note
