"""The heuristics engine: rules are pure functions of a recorded :class:`~memsentry.Report`.

Each rule has a stable id (part of the public API) and returns findings. ``analyse`` runs
them all and orders the findings: leaks first, then waste, then hints; larger first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from memsentry.report import Finding, Report, Severity
from memsentry.rules.growth import memory_growth

Rule = Callable[[Report], list[Finding]]

#: Every rule by its id, in the order they run.
RULES: dict[str, Rule] = {
    "memory-growth": memory_growth,
}

_SEVERITY_ORDER = {Severity.LEAK: 0, Severity.WASTE: 1, Severity.HINT: 2}


def analyse(report: Report, rules: Sequence[str] | None = None) -> tuple[Finding, ...]:
    """Run the rules named in ``rules`` (all by default) on ``report``; most severe first."""
    unknown = [rule for rule in rules or () if rule not in RULES]
    if unknown:
        raise ValueError(f"unknown rule id(s) {unknown}; known rules: {sorted(RULES)}")
    findings = [f for rule_id in (rules or RULES) for f in RULES[rule_id](report)]
    findings.sort(key=lambda f: (_SEVERITY_ORDER[f.severity], -(f.bytes or 0)))
    return tuple(findings)


__all__ = ["RULES", "Rule", "analyse"]
