"""The heuristics engine: the ``memory-growth`` rule on its own (holder search off), how cause
rules replace it, ``on_leak`` and the text of findings. The field guide's patterns, with the
holder search on, are in test_scenarios.py."""

from __future__ import annotations

import collections
import warnings

import pytest
import torch
from conftest import make_mlp
from torch import nn

import memsentry
from memsentry.rules import analyse
from memsentry.rules.growth import MIN_ITERATIONS, WARMUP

MiB = 1 << 20


def _loop(steps: int, body, *, on_leak: str = "ignore", holders: bool = False
          ) -> memsentry.Report:
    """Run ``body(step)`` in a tracked Adam loop of a small MLP; one optimizer step each."""
    torch.manual_seed(0)
    model = make_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 16), torch.randn(32, 4)
    with memsentry.track(model, on_leak=on_leak, holders=holders) as t:
        for step in range(steps):
            loss = (model(x) - y).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            body(step, loss, model, x)
    return t.report()


def _leaks(report: memsentry.Report) -> list[memsentry.Finding]:
    return [f for f in report.findings if f.severity is memsentry.Severity.LEAK]


# -- leaks ---------------------------------------------------------------------------------


def test_a_list_gaining_a_mib_per_iteration_is_a_memory_growth_leak() -> None:
    kept: list[torch.Tensor] = []
    report = _loop(12, lambda step, loss, model, x: kept.append(torch.ones(MiB // 4)))
    (finding,) = _leaks(report)
    assert finding.rule == "memory-growth"
    assert finding.rate is not None and 0.9 * MiB <= finding.rate <= 1.1 * MiB
    assert finding.bytes is not None and finding.bytes >= 8 * MiB
    assert "1.0 MiB/iter" in finding.message
    assert "run out around iteration" in finding.message  # the forecast, RAM on CPU
    assert ".item()" in finding.fix
    # The text report shows findings before the tables.
    text = str(report)
    assert text.index("memory-growth") < text.index("Layers")


def test_a_cause_rule_replaces_memory_growth() -> None:
    # The same leak with the holder search on: reported once, under its cause, naming `kept`.
    kept: list[torch.Tensor] = []
    report = _loop(12, lambda step, loss, model, x: kept.append(torch.ones(MiB // 4)),
                   holders=True)
    (finding,) = _leaks(report)
    assert finding.rule == "tensor-accumulation"
    assert "`kept`" in finding.message
    assert finding.rate is not None and 0.9 * MiB <= finding.rate <= 1.1 * MiB
    # analyse() on the growth rule alone still sees the growth.
    assert [f.rule for f in analyse(report, rules=["memory-growth"])] == ["memory-growth"]


def test_the_leak_is_reported_within_warmup_plus_five_iterations() -> None:
    kept: list[torch.Tensor] = []
    report = _loop(WARMUP + 5, lambda step, loss, model, x: kept.append(torch.ones(MiB // 4)))
    assert [f.rule for f in _leaks(report)] == ["memory-growth"]
    assert MIN_ITERATIONS <= 5


def test_a_loss_summed_as_a_tensor_is_a_leak_even_after_backward() -> None:
    # Field guide #1: only autograd nodes pile up after backward(), a few KiB per step on CPU.
    total = [torch.zeros(())]

    def accumulate(step, loss, model, x):
        total[0] = total[0] + loss

    report = _loop(20, accumulate)
    assert [f.rule for f in _leaks(report)] == ["memory-growth"]


def test_validation_outputs_kept_with_their_graph_are_a_leak() -> None:
    kept: list[torch.Tensor] = []

    def validate(step, loss, model, x):
        model.eval()
        kept.append(model(torch.randn(256, 16)))  # no torch.no_grad(): the graph is kept
        model.train()

    report = _loop(10, validate)
    assert [f.rule for f in _leaks(report)] == ["memory-growth"]


# -- must not flag -------------------------------------------------------------------------


def test_a_clean_loop_with_adam_warmup_is_not_a_leak() -> None:
    # Adam creates its two state tensors per parameter in the first step: warm-up, not growth.
    report = _loop(12, lambda step, loss, model, x: None)
    assert _leaks(report) == []


def test_accumulating_loss_item_is_not_a_leak() -> None:
    total = [0.0]

    def accumulate(step, loss, model, x):
        total[0] += loss.item()

    assert _leaks(_loop(20, accumulate)) == []


def test_a_bounded_rolling_window_is_not_a_leak() -> None:
    window: collections.deque[torch.Tensor] = collections.deque(maxlen=2)
    report = _loop(16, lambda step, loss, model, x: window.append(torch.ones(MiB // 4)))
    assert _leaks(report) == []


def test_a_list_cleared_every_epoch_is_not_a_leak() -> None:
    # A sawtooth: four iterations of growth, then the list is emptied.
    per_epoch: list[torch.Tensor] = []

    def log(step, loss, model, x):
        per_epoch.append(torch.ones(MiB // 4))
        if step % 4 == 3:
            per_epoch.clear()

    assert _leaks(_loop(16, log)) == []


def test_moving_the_model_to_its_device_every_iteration_is_not_a_leak() -> None:
    report = _loop(12, lambda step, loss, model, x: model.to("cpu"))
    assert _leaks(report) == []


def test_too_few_iterations_are_not_judged() -> None:
    kept: list[torch.Tensor] = []
    report = _loop(WARMUP + MIN_ITERATIONS - 1,
                   lambda step, loss, model, x: kept.append(torch.ones(MiB // 4)))
    assert _leaks(report) == []


# -- on_leak ----------------------------------------------------------------------------------


def _leaky_block(on_leak: str) -> None:
    kept: list[torch.Tensor] = []
    model = nn.Linear(8, 8)
    with memsentry.track(model, on_leak=on_leak, holders=False) as t:
        for _ in range(10):
            model(torch.randn(4, 8))
            kept.append(torch.ones(MiB // 4))
            t.step()


def test_on_leak_warn_is_the_default_and_names_the_rule() -> None:
    with pytest.warns(memsentry.LeakWarning, match="tensor-accumulation: `kept`") as caught:
        kept: list[torch.Tensor] = []
        model = nn.Linear(8, 8)
        with memsentry.track(model) as t:
            for _ in range(10):
                model(torch.randn(4, 8))
                kept.append(torch.ones(MiB // 4))
                t.step()
    # The warning points at the user's with-block, not at memsentry's code.
    assert {w.filename for w in caught} == {__file__}


def test_on_leak_raise_raises_leak_error_with_the_findings() -> None:
    with pytest.raises(memsentry.LeakError, match="memory-growth") as caught:
        _leaky_block("raise")
    assert [f.rule for f in caught.value.findings] == ["memory-growth"]


def test_on_leak_raise_does_not_hide_the_blocks_own_exception() -> None:
    kept: list[torch.Tensor] = []
    model = nn.Linear(8, 8)
    with pytest.raises(KeyError), warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        with memsentry.track(model, on_leak="raise", holders=False) as t:
            for _ in range(10):
                model(torch.randn(4, 8))
                kept.append(torch.ones(MiB // 4))
                t.step()
            raise KeyError("the user's own failure")


def test_on_leak_ignore_is_silent() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", memsentry.LeakWarning)
        _leaky_block("ignore")


def test_on_leak_rejects_unknown_values() -> None:
    with pytest.raises(ValueError, match="'warn', 'raise', 'ignore'"):
        memsentry.track(on_leak="explode")


def test_analyse_rejects_unknown_rule_ids() -> None:
    report = _loop(3, lambda step, loss, model, x: None)
    with pytest.raises(ValueError, match="memory-growth"):
        analyse(report, rules=["no-such-rule"])
    assert "memory-growth" in memsentry.RULES


def test_findings_in_the_text_report_fit_the_width() -> None:
    kept: list[torch.Tensor] = []
    report = _loop(12, lambda step, loss, model, x: kept.append(torch.ones(MiB // 4)))
    text = report.format(width=100)
    assert "LEAK  memory-growth" in text and "fix:" in text
    assert max(len(line) for line in text.splitlines()) <= 100
