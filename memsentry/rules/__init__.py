"""Analysing: the heuristics engine. Rules are pure functions of a recorded report.

Each rule is registered with a stable id and its metadata (:mod:`memsentry.rules.registry`),
next to its code. ``analyse`` runs them and orders the findings: leaks first, then waste,
then hints; larger first. A fallback rule (``memory-growth``) is dropped when a rule that
names a cause reports: a leak is reported once, under its cause.

This layer imports only the values (:mod:`memsentry.model`) and the foundation modules.
"""

from __future__ import annotations

from collections.abc import Sequence

# The rule modules register their rules on import, in this order (the order they run in).
# isort: off
from memsentry.rules import retained, holders, hooks, cycles  # noqa: F401
from memsentry.rules import growth, nograd, exceptions  # noqa: F401
from memsentry.rules import device, timing, loopvars, headroom, workers  # noqa: F401
# isort: on
from memsentry.model import Finding, ReportData, Severity
from memsentry.rules.closing import settle
from memsentry.rules.growth import growth_note
from memsentry.rules.registry import RULES, Rule

#: The ids of the rules that name what makes memory grow.
CAUSES = frozenset(rule_id for rule_id, rule in RULES.items() if rule.causes)

_SEVERITY_ORDER = {Severity.LEAK: 0, Severity.WASTE: 1, Severity.HINT: 2}


def _is_cause(finding: Finding) -> bool:
    return finding.severity in RULES[finding.rule].causes


def analyse(report: ReportData, rules: Sequence[str] | None = None) -> tuple[Finding, ...]:
    """Run the rules named in ``rules`` (all by default) on ``report``; most severe first."""
    return analysed(report, rules)[0]


def analysed(report: ReportData, rules: Sequence[str] | None = None
             ) -> tuple[tuple[Finding, ...], tuple[str, ...]]:
    """:func:`analyse`'s findings, and the notes of the leaks the census taken as tracking
    ended shows stopped (:func:`memsentry.rules.closing.settle`: they are not findings)."""
    findings = [f for rule_id in _chosen(rules) for f in RULES[rule_id](report)]
    kept, stopped = settle(report, findings)
    return tuple(sorted(_without_fallbacks(kept, findings), key=_order)), tuple(stopped)


def _chosen(rules: Sequence[str] | None) -> Sequence[str]:
    """The ids of the rules to run: ``rules``, or every rule when none is named; an id that
    names no rule raises ``ValueError``."""
    if not rules:
        return tuple(RULES)
    unknown = [rule_id for rule_id in rules if rule_id not in RULES]
    if unknown:
        raise ValueError(f"unknown rule id(s) {unknown}; known rules: {sorted(RULES)}")
    return rules


def _without_fallbacks(findings: list[Finding], made: Sequence[Finding]) -> list[Finding]:
    """``findings`` less those of the fallback rules, when one of those the rules ``made``
    names a cause of growth: a leak is reported once, under its cause, and growth a cause
    explains as a container that filled and stayed (:func:`settle` dropped it) is none."""
    if not any(_is_cause(f) for f in made):
        return findings
    return [f for f in findings if not RULES[f.rule].fallback]


def _order(finding: Finding) -> tuple[int, int]:
    """Leaks first, then waste, then hints; larger first."""
    return _SEVERITY_ORDER[finding.severity], -(finding.bytes or 0)


def remarks(report: ReportData, findings: Sequence[Finding]) -> tuple[str, ...]:
    """The rules' notes on ``report``, whose findings are ``findings``: a growth left
    unjudged, and why (none when a finding names a cause of growth)."""
    if any(_is_cause(f) for f in findings):
        return ()
    return tuple(filter(None, [growth_note(report)]))


__all__ = ["CAUSES", "RULES", "Rule", "analyse", "analysed", "remarks"]
