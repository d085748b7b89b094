"""Loops with no ``nn.Module`` and no optimizer: weights kept as plain tensors and updated by
hand (the style of many tutorials and notebooks). The end of each backward pass closes an
iteration, so leaks there are found like anywhere else, and nothing of torch is left changed.
"""

from __future__ import annotations

import torch
from conftest import iterations_run

import memsentry
from memsentry import Severity

BACKWARD = torch.autograd.backward


def _train(*, keep_graph: bool, track: bool, steps: int = 30
           ) -> tuple[torch.Tensor, list[object], memsentry.Report | None]:
    """A bigram-style model trained by hand: ``W`` and ``b`` updated under ``no_grad``."""
    generator = torch.Generator().manual_seed(0)
    weights = torch.randn(27, 27, generator=generator, requires_grad=True)
    bias = torch.zeros(27, requires_grad=True)
    history: list[object] = []
    tracker = memsentry.track(on_leak="ignore") if track else None

    def loop() -> None:
        for _ in range(steps):
            x = torch.randint(0, 27, (64,), generator=generator)
            y = torch.randint(0, 27, (64,), generator=generator)
            logits = torch.nn.functional.one_hot(x, 27).float() @ weights + bias
            loss = torch.nn.functional.cross_entropy(logits, y)
            weights.grad = bias.grad = None
            loss.backward()
            with torch.no_grad():
                weights.sub_(0.1 * weights.grad)
                bias.sub_(0.1 * bias.grad)
            history.append(loss if keep_graph else loss.item())

    if tracker is None:
        loop()
        return weights.detach().clone(), history, None
    with tracker:
        loop()
    return weights.detach().clone(), history, tracker.report()


def test_a_kept_loss_is_found_without_modules_or_optimizer() -> None:
    _, _, report = _train(keep_graph=True, track=True)
    assert report is not None
    assert iterations_run(report) == 30  # each backward pass closed one
    assert any("end of each backward pass" in note for note in report.notes)
    (leak,) = [f for f in report.findings if f.severity is Severity.LEAK]
    assert leak.rule == "tensor-accumulation"
    assert leak.subject is not None and leak.subject.name == "history"
    assert leak.location is not None and leak.location.line == 37  # history.append(...)


def test_a_clean_loop_gives_no_finding_and_the_same_weights() -> None:
    plain, plain_history, _ = _train(keep_graph=False, track=False)
    tracked, tracked_history, report = _train(keep_graph=False, track=True)
    assert report is not None
    assert [f for f in report.findings if f.severity is not Severity.HINT] == []
    assert torch.equal(plain, tracked)
    assert plain_history == tracked_history


def test_torch_autograd_backward_is_put_back() -> None:
    with memsentry.track(on_leak="ignore"):
        assert torch.autograd.backward is not BACKWARD
        with memsentry.track(on_leak="ignore"):  # nested: one wrapper, not two
            inner = torch.autograd.backward
        assert torch.autograd.backward is inner
    assert torch.autograd.backward is BACKWARD


def test_errors_of_backward_come_out_unchanged() -> None:
    leaf = torch.ones(3)  # no grad: backward raises
    caught: list[BaseException] = []
    for track in (False, True):
        try:
            if track:
                with memsentry.track(on_leak="ignore"):
                    leaf.sum().backward()
            else:
                leaf.sum().backward()
        except RuntimeError as error:
            caught.append(error)
    assert len(caught) == 2
    assert str(caught[0]) == str(caught[1])
    assert torch.autograd.backward is BACKWARD
