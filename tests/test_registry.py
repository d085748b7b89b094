"""The rule registry: every rule declared once with its metadata, documented in the guide to
findings, and held to what it declares."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import memsentry
from memsentry import RULES, Finding, ReportData, Severity
from memsentry.rules import CAUSES, analyse
from memsentry.rules.registry import rule

GUIDE = (Path(__file__).resolve().parent.parent / "docs" / "guides" / "finding-a-leak.md"
         ).read_text(encoding="utf-8")


def documented_rule_ids() -> list[str]:
    """The ids in the guide's table of rules (`| \\`id\\` | severity |`)."""
    return re.findall(r"^\| `([a-z][a-z-]*)` \| [a-z ,]+ \|", GUIDE, flags=re.MULTILINE)


def test_every_rule_is_documented_and_every_documented_rule_exists() -> None:
    assert sorted(documented_rule_ids()) == sorted(RULES)


def test_rule_ids_are_stable_and_in_their_running_order() -> None:
    assert list(RULES) == [
        "retained-graph", "tensor-accumulation", "hook-accumulation", "reference-cycle",
        "memory-growth", "missing-no-grad", "exception-frames", "allocator-fragmentation",
        "non-pytorch-memory", "input-bound", "loop-variables", "memory-headroom",
        "worker-memory",
    ]


def test_the_metadata_says_which_rules_name_a_cause() -> None:
    assert CAUSES == {"retained-graph", "tensor-accumulation", "hook-accumulation",
                      "reference-cycle"}
    assert RULES["reference-cycle"].causes == {Severity.LEAK, Severity.WASTE}
    assert RULES["retained-graph"].causes == {Severity.LEAK}
    assert [rule_id for rule_id, r in RULES.items() if r.fallback] == ["memory-growth"]
    cuda_only = sorted(rule_id for rule_id, r in RULES.items() if r.devices == {"cuda"})
    assert cuda_only == ["allocator-fragmentation", "memory-headroom", "non-pytorch-memory"]
    assert all(r.summary and r.severities for r in RULES.values())


def test_an_id_cannot_be_registered_twice() -> None:
    with pytest.raises(ValueError, match="'memory-growth' is registered twice"):
        rule("memory-growth", severities={Severity.LEAK})(lambda report: [])


def test_a_rule_is_held_to_what_it_declares(monkeypatch: pytest.MonkeyPatch) -> None:
    report = ReportData(device="cpu", backend="test", baseline=0)
    declared = RULES["input-bound"]

    def stray(_report: ReportData) -> list[Finding]:
        return [Finding(rule="input-bound", severity=Severity.LEAK, message="m", fix="f")]

    monkeypatch.setitem(RULES, "input-bound", type(declared)(
        id=declared.id, check=stray, severities=declared.severities))
    with pytest.raises(AssertionError, match="declares"):
        analyse(report)


def test_analyse_refuses_unknown_rule_ids() -> None:
    report = ReportData(device="cpu", backend="test", baseline=0)
    with pytest.raises(ValueError, match="unknown rule id"):
        memsentry.analyse(report, ["no-such-rule"])
