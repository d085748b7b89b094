"""A fix, applied as its text says, clears the finding that gave it, or the text says what
remains and why: the validation outputs a loop keeps, with and without their graphs."""

from __future__ import annotations

import torch
from conftest import make_mlp
from torch import nn

import memsentry
from memsentry import Report, Severity

STEPS = 40
K = 3


def _loop(*, detach: bool, no_grad: bool, trim: bool) -> tuple[Report, list[torch.Tensor]]:
    """An MLP trained 40 steps; every second step a validation batch's outputs are kept in
    ``val_outputs`` (with their graphs unless ``detach`` or ``no_grad``; the last ``K`` only
    with ``trim``)."""
    torch.manual_seed(0)
    model = make_mlp(16, 64, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    val_outputs: list[torch.Tensor] = []
    with memsentry.track(model, on_leak="ignore") as tracker:
        for step in range(STEPS):
            loss = nn.functional.mse_loss(model(torch.randn(32, 16)), torch.zeros(32, 4))
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % 2 == 0:
                if no_grad:
                    with torch.no_grad():
                        out = model(torch.randn(64, 16))
                else:
                    out = model(torch.randn(64, 16))
                val_outputs.append(out.detach() if detach else out)
                if trim:
                    del val_outputs[:-K]
    return tracker.report(), val_outputs[-1:]


def _about_outputs(report: Report) -> list[memsentry.Finding]:
    return [f for f in report.findings if f.severity is Severity.LEAK
            and f.subject is not None and f.subject.name == "val_outputs"]


def test_the_graph_fix_says_the_list_still_grows_and_trimming_it_clears_the_leak() -> None:
    report, _ = _loop(detach=False, no_grad=False, trim=False)
    (leak,) = _about_outputs(report)
    assert leak.rule == "tensor-accumulation"
    assert "run evaluation under `torch.no_grad()`: that frees their graphs" in leak.fix
    assert "`val_outputs` still gains a tensor each time" in leak.fix
    assert "`del val_outputs[:-k]`" in leak.fix

    # Its first half, applied: the graphs go, the list still grows, as the text said.
    report, _ = _loop(detach=True, no_grad=True, trim=False)
    (still,) = _about_outputs(report)
    assert still.rule == "tensor-accumulation"
    assert "carry an autograd graph" not in still.message
    assert "`del val_outputs[:-k]`" in still.fix

    # All of it, applied: no finding about the list, and its last item still slices.
    report, last = _loop(detach=True, no_grad=True, trim=True)
    assert _about_outputs(report) == []
    assert not any(f.severity is Severity.LEAK for f in report.findings), report.findings
    assert len(last) == 1 and last[0].shape == (64, 4)
