"""The field guide's patterns, run for real on CPU: each leak and waste reported with its rule,
severity and holder within the warm-up plus five iterations; no LEAK for the normal cases."""

from __future__ import annotations

import pytest
from scenarios import STEPS, Scenario
from scenarios_verdicts import ALL_SCENARIOS as SCENARIOS
from test_registry import documented_rule_ids

import memsentry
from memsentry.rules.growth import WARMUP

LEAK = memsentry.Severity.LEAK


def _ids(scenario: Scenario) -> str:
    return f"{scenario.guide} {scenario.name}"


def _matching(report: memsentry.Report, scenario: Scenario) -> list[memsentry.Finding]:
    return [
        f for f in report.findings
        if f.rule == scenario.rule and f.severity is scenario.severity
        and (scenario.holder is None or scenario.holder in f.message)
    ]


def test_the_default_run_is_the_detection_promise() -> None:
    assert STEPS == WARMUP + 5


@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if s.rule], ids=_ids)
def test_pattern_is_reported_with_its_rule_severity_and_holder(scenario: Scenario) -> None:
    report = scenario.run(scenario.steps)
    found = _matching(report, scenario)
    assert found, (
        f"expected {scenario.rule} ({scenario.severity}) naming {scenario.holder!r}; got:\n"
        + "\n".join(f"{f.rule} {f.severity}: {f.message}" for f in report.findings)
    )
    finding = found[0]
    assert finding.fix
    # Every finding names what it is about, and every rule id is registered and documented.
    assert all(f.subject is not None for f in report.findings)
    assert {f.rule for f in report.findings} <= set(memsentry.RULES) & set(documented_rule_ids())
    # A growth whose cause is named is reported once, under the cause.
    if scenario.severity is LEAK:
        assert "memory-growth" not in [f.rule for f in report.findings]
    # Every LEAK in a leak scenario is about this pattern: no stray verdicts.
    assert all(f.rule == scenario.rule for f in report.findings if f.severity is LEAK)


@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if not s.rule], ids=_ids)
def test_normal_loop_is_not_called_a_leak(scenario: Scenario) -> None:
    report = scenario.run(scenario.steps)
    assert [f for f in report.findings if f.severity is not memsentry.Severity.HINT] == []
    assert len(report.censuses) >= 3  # the holder search ran and still found nothing


def test_findings_name_the_line_that_fills_the_holder() -> None:
    import scenarios

    report = scenarios.loss_summed_as_tensor(STEPS)
    (finding,) = report.findings
    lines = open(scenarios.__file__, encoding="utf-8").read().splitlines()
    line = lines.index("            total_loss += loss") + 1
    assert finding.where is not None and finding.where.endswith(f"scenarios.py:{line}")
    assert "`total_loss` (a local of loss_summed_as_tensor()" in finding.message
    assert "total_loss += loss.item()" in finding.fix


def test_a_leak_is_not_judged_before_three_censuses() -> None:
    import scenarios

    # Censuses judge iterations 2 and 3 (each taken as the next iteration begins; the one due
    # at the last boundary, 4, would see the loop after it ended and is not taken).
    report = scenarios.detached_features_kept(WARMUP + 3)
    assert len(report.censuses) == 2
    assert [f for f in report.findings if f.severity is LEAK] == []


@pytest.mark.cuda
def test_cuda_outputs_kept_with_their_graph_and_headroom() -> None:
    import scenarios

    torch = pytest.importorskip("torch")
    model = scenarios.Classifier().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kept_outputs = []
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(STEPS):
            x = torch.randn(256, 32, device="cuda")
            y = torch.randint(0, 10, (256,), device="cuda")
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            kept_outputs.append(model(x))
    report = t.report()
    rules = {f.rule: f for f in report.findings}
    assert rules["tensor-accumulation"].severity is LEAK
    assert "`kept_outputs`" in rules["tensor-accumulation"].message
    assert rules["tensor-accumulation"].bytes >= 4 * 256 * 10 * 4  # logits on the device
    assert rules["missing-no-grad"].severity is memsentry.Severity.WASTE
    # A tiny model on a large GPU: the headroom hint estimates a far larger batch.
    assert "memory-headroom" in rules and "batch 256" in rules["memory-headroom"].message


def test_a_hook_registered_every_step_is_located_where_it_is_registered() -> None:
    import scenarios

    report = scenarios.hooks_registered_every_step(STEPS)
    (finding,) = report.findings
    lines = open(scenarios.__file__, encoding="utf-8").read().splitlines()
    registered = lines.index("            model.head.register_forward_hook(log_activation)") + 1
    defined = lines.index("def log_activation(module: nn.Module, args: tuple, output: "
                          "torch.Tensor) -> None:") + 1
    assert finding.location is not None and finding.location.line == registered
    message = " ".join(finding.message.split())
    assert f"scenarios.py:{registered}, defined at " in message
    assert f"scenarios.py:{defined})" in message
