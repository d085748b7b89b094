"""Out-of-memory post-mortems: a real CPU allocation failure, and errors raised the way CUDA's
allocator raises them, in the forward, the backward and the optimizer step. The user's
exception stays the same (type, message, traceback) apart from memsentry's note."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable

import pytest
import torch
from fake_clock import FakeClock
from seams import tracked
from torch import nn

import memsentry
from memsentry.model import FixKind, Phase

TIB = 2**40
BATCH, WIDTH = 64, 256
OutOfMemoryError = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


def cuda_message(size: str) -> str:
    """An out-of-memory message as CUDA's caching allocator words it."""
    return (f"CUDA out of memory. Tried to allocate {size}. GPU 0 has a total capacity of "
            "79.10 GiB of which 1.06 GiB is free. Of the allocated memory 75.80 GiB is "
            "allocated by PyTorch, and 1.20 GiB is reserved by PyTorch but unallocated.")


class Failing(nn.Module):
    """A layer that fails from its ``first``-th call on (the third by default), with
    ``fail()``."""

    def __init__(self, fail: Callable[[torch.Tensor], torch.Tensor], first: int = 3) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.fail = fail
        self.calls = 0
        self.first = first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        x = self.linear(x)
        return self.fail(x) if self.calls >= self.first else x


def huge_allocation(x: torch.Tensor) -> torch.Tensor:
    return x + torch.empty(TIB, dtype=torch.uint8)[:1].float()  # 1 TiB: the CPU refuses


def model_with(fail: Callable[[torch.Tensor], torch.Tensor], first: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), Failing(fail, first),
                         nn.Linear(WIDTH, 1))


def run(model: nn.Module, optimizer: torch.optim.Optimizer, tracked: bool
        ) -> tuple[BaseException, memsentry.Report | None]:
    tracker = memsentry.track(model, on_leak="ignore") if tracked else None
    try:
        if tracker is not None:
            tracker.start()
        for _ in range(5):
            model(torch.randn(BATCH, WIDTH)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    except BaseException as error:  # the test looks at it
        report = tracker.stop() if tracker is not None else None
        return error, report
    raise AssertionError("the loop did not fail")


def frames(error: BaseException) -> list[tuple[str, str]]:
    """The frames of this file in the error's traceback (torch's own call path differs when
    a module has hooks)."""
    return [(f.name, f.line or "") for f in traceback.extract_tb(error.__traceback__)
            if f.filename == __file__]


def notes(error: BaseException) -> list[str]:
    return list(getattr(error, "__notes__", []))


def test_a_real_cpu_allocation_failure_in_a_forward_is_explained() -> None:
    plain, _ = run(model := model_with(huge_allocation),
                   torch.optim.SGD(model.parameters(), lr=0.01), tracked=False)
    model = model_with(huge_allocation)
    error, report = run(model, torch.optim.SGD(model.parameters(), lr=0.01), tracked=True)
    assert type(error) is type(plain) is RuntimeError
    assert str(error) == str(plain)
    assert "DefaultCPUAllocator: can't allocate memory" in str(error)
    assert frames(error) == frames(plain)  # raised at the same place
    assert report is not None and report.oom is not None
    oom = report.oom
    assert (oom.phase, oom.layer, oom.iteration) == (Phase.FORWARD, "2", 2)
    assert oom.requested_bytes == TIB
    assert oom.batch == BATCH
    assert oom.breakdown.parameters == sum(p.numel() * 4 for p in model.parameters())
    # The first Linear saved its input, the ReLU its output: both alive mid-forward.
    assert oom.breakdown.activations >= 2 * BATCH * WIDTH * 4
    # By the arithmetic, 1 TiB at batch 64 is 16 GiB a sample (a batch of 1 fits in 24 GiB).
    # As 1 TiB is more than the machine on its own, the shape is named as well.
    kinds = [f.kind for f in oom.fixes]
    assert kinds[:2] == [FixKind.BATCH, FixKind.REQUEST]
    held, capacity = oom.breakdown, oom.capacity or 0
    per_sample = held.activations / BATCH + TIB / BATCH
    assert oom.fixes[0].batch == int((capacity - (held.total - held.activations)) // per_sample)
    assert "more than the device's" in oom.fixes[1].text
    assert not [f for f in report.findings if f.rule == "missing-no-grad"]
    if sys.version_info >= (3, 11):
        (note,) = notes(error)
        lines = note.splitlines()
        assert len(lines) == 3
        assert lines[0].startswith("memsentry: out of memory in the forward of `2` "
                                   "(iteration 2) asking for 1.0 TiB")
        assert "would have fit" in lines[1]
    assert "Out of memory: RuntimeError in the forward of `2`" in str(report)


def test_a_failure_in_a_light_iteration_names_its_layer_and_batch_from_the_traceback() -> None:
    """Past the first iterations a loop over its budget runs light: no hook on the failing
    layer (a bare iteration hooks none) sees the error go by. The frames of the module calls
    it went through still name the layer, and the outermost call's argument the batch."""
    model = model_with(huge_allocation, first=8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    clock = FakeClock(tick=1e-3)  # every reading costs 1 ms: the budget runs out at once
    tracker = tracked(model, clock=clock, credit=0.0, on_leak="ignore")
    with pytest.raises(RuntimeError, match="can't allocate memory"), tracker:
        for _ in range(10):
            clock.advance(0.002)
            model(torch.randn(BATCH, WIDTH)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    report = tracker.report()
    # Three sampled iterations, then light ones up to the failure (the end's row, 7, is read
    # in full as every end is).
    assert [it.index for it in report.iterations if it.sampled] == [0, 1, 2, 7]
    assert report.iterations[-1].boundary == "exit"
    oom = report.oom
    assert oom is not None
    assert (oom.phase, oom.layer, oom.iteration, oom.batch) == (Phase.FORWARD, "2", 7, BATCH)
    assert FixKind.BATCH in [f.kind for f in oom.fixes]


class FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        raise OutOfMemoryError(cuda_message("2.00 GiB"))


def test_an_error_in_the_backward_names_the_phase_and_keeps_its_type() -> None:
    model = model_with(FailingBackward.apply)
    error, report = run(model, torch.optim.SGD(model.parameters(), lr=0.01), tracked=True)
    assert type(error) is OutOfMemoryError
    assert str(error) == cuda_message("2.00 GiB")
    assert report is not None and report.oom is not None
    assert report.oom.phase is Phase.BACKWARD
    assert report.oom.requested_bytes == 2 * 2**30
    assert report.oom.error == OutOfMemoryError.__name__
    if sys.version_info >= (3, 11):
        assert notes(error)[0].startswith("memsentry: out of memory in the backward")


class FailingAdam(torch.optim.Adam):
    def step(self, closure: object = None) -> object:  # type: ignore[override]
        if self.state:  # its second step: the state exists
            raise OutOfMemoryError(cuda_message("20.00 MiB"))
        return super().step()


@pytest.mark.parametrize("overdrawn", [False, True], ids=["measured", "budget-spent"])
def test_an_error_in_the_optimizer_step_shows_gradients_and_state(
        overdrawn: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if overdrawn:  # a loaded machine: the budget measures no call after the first iteration
        from memsentry.record.budget import Budget
        monkeypatch.setattr(Budget, "overdrawn", lambda self: True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 1))
    error, report = run(model, FailingAdam(model.parameters()), tracked=True)
    assert type(error) is OutOfMemoryError
    assert report is not None and report.oom is not None
    oom = report.oom
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert (oom.phase, oom.layer, oom.iteration) == (Phase.STEP, None, 1)
    assert oom.breakdown.parameters == weights
    assert oom.breakdown.gradients == weights  # the backward made every gradient
    assert oom.breakdown.optimizer_state == 2 * weights + 4 * 4  # Adam's moments and steps
    assert [f.kind for f in oom.fixes if f.kind is FixKind.OPTIMIZER]
    assert not [f for f in oom.fixes if f.kind is FixKind.BATCH]  # a step does not scale


def test_the_batch_that_fits_follows_from_what_scales_with_the_batch() -> None:
    from memsentry.measure.cpu import physical_memory

    capacity = physical_memory()
    assert capacity
    asked = capacity - 64 * 2**20  # just under the machine's memory: too much with the rest

    def fail(x: torch.Tensor) -> torch.Tensor:
        raise OutOfMemoryError(cuda_message(f"{asked / 2**30:.2f} GiB"))

    model = model_with(fail)
    _error, report = run(model, torch.optim.SGD(model.parameters(), lr=0.01), tracked=True)
    assert report is not None and report.oom is not None
    oom = report.oom
    asked = oom.requested_bytes or 0  # as the message rounds it
    assert abs(asked - (capacity - 64 * 2**20)) < 0.01 * 2**30
    (fix,) = [f for f in oom.fixes if f.kind is FixKind.BATCH]
    held = oom.breakdown
    per_sample = held.activations / BATCH + asked / BATCH
    expected = int((capacity - (held.total - held.activations)) // per_sample)
    assert fix.batch == expected
    assert 0 < fix.batch < BATCH
    assert f"a batch of at most {expected} (now {BATCH}) would have fit" in fix.text


def test_other_errors_get_no_post_mortem_and_no_note() -> None:
    def fail(x: torch.Tensor) -> torch.Tensor:
        raise ValueError("a bug in the loop")

    model = model_with(fail)
    error, report = run(model, torch.optim.SGD(model.parameters(), lr=0.01), tracked=True)
    assert type(error) is ValueError and str(error) == "a bug in the loop"
    assert notes(error) == []
    assert report is not None and report.oom is None
    assert not [f for f in report.findings if f.rule == "missing-no-grad"]


def test_the_post_mortem_survives_json(tmp_path: pytest.TempPathFactory) -> None:
    model = model_with(huge_allocation)
    _error, report = run(model, torch.optim.SGD(model.parameters(), lr=0.01), tracked=True)
    assert report is not None and report.oom is not None
    path = f"{tmp_path}/report.json"
    report.to_json(path)
    again = memsentry.Report.from_json(path)
    assert again.oom == report.oom
