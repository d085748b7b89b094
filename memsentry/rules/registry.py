"""The rule registry: each rule declares its id and what it may conclude once, next to its code.

A rule is a pure function of a recorded report that returns findings. Its id is part of the
public API (scripts filter on it, the README documents it); its metadata says at which
severities it reports, at which it names a *cause* of memory growth, and whether it only
speaks when no cause was named (``memory-growth``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from memsentry.model import Finding, ReportData, Severity

Check = Callable[[ReportData], list[Finding]]


@dataclass(frozen=True)
class Rule:
    """A registered rule. Calling it runs it on a report.

    ``severities``: what its findings may be. ``causes``: the severities at which a finding
    names what makes memory grow (then ``memory-growth`` stays silent: a leak is reported
    once, under its cause). ``fallback``: reported only when no cause was named.
    ``devices``: the device types it judges (``None``: all). ``summary``: one line for people.
    """

    id: str
    check: Check
    severities: frozenset[Severity]
    causes: frozenset[Severity] = frozenset()
    fallback: bool = False
    devices: frozenset[str] | None = None
    summary: str = field(default="", compare=False)

    def __call__(self, report: ReportData) -> list[Finding]:
        """The rule's findings on ``report``; one without evidence (no bytes and no objects
        above zero) is dropped: a verdict with nothing in it is never shown."""
        findings = self.check(report)
        for finding in findings:
            if finding.rule != self.id or finding.severity not in self.severities:
                raise AssertionError(
                    f"rule {self.id!r} returned a finding of rule {finding.rule!r} at "
                    f"{finding.severity}; it declares {sorted(map(str, self.severities))}"
                )
        return [f for f in findings if has_evidence(f)]


def has_evidence(finding: Finding) -> bool:
    """Bytes or objects above zero."""
    return (finding.bytes or 0) > 0 or (finding.objects or 0) > 0


#: Every rule by its id, in the order they run.
RULES: dict[str, Rule] = {}


def rule(rule_id: str, *, severities: set[Severity], causes: set[Severity] | None = None,
         fallback: bool = False, devices: set[str] | None = None) -> Callable[[Check], Check]:
    """Register the decorated function as the rule ``rule_id`` (ids are unique)."""

    def register(check: Check) -> Check:
        if rule_id in RULES:
            raise ValueError(f"rule id {rule_id!r} is registered twice")
        summary = (check.__doc__ or "").strip().split("\n\n", 1)[0].replace("\n", " ")
        RULES[rule_id] = Rule(
            id=rule_id, check=check, severities=frozenset(severities),
            causes=frozenset(causes or ()), fallback=fallback,
            devices=frozenset(devices) if devices is not None else None, summary=summary,
        )
        return check

    return register


__all__ = ["RULES", "Check", "Rule", "has_evidence", "rule"]
