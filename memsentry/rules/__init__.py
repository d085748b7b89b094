"""The heuristics engine: rules are pure functions of a recorded :class:`~memsentry.Report`.

Each rule has a stable id (part of the public API) and returns findings. ``analyse`` runs
them all and orders the findings: leaks first, then waste, then hints; larger first. A
``memory-growth`` finding is dropped when a rule that names a cause reports: a leak is
reported once, under its cause.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from memsentry.report import Finding, Report, Severity
from memsentry.rules.cycles import reference_cycle
from memsentry.rules.device import allocator_fragmentation, memory_headroom, non_pytorch_memory
from memsentry.rules.exceptions import exception_frames
from memsentry.rules.growth import memory_growth
from memsentry.rules.holders import retained_graph, tensor_accumulation
from memsentry.rules.hooks import hook_accumulation
from memsentry.rules.loopvars import loop_variables
from memsentry.rules.nograd import missing_no_grad
from memsentry.rules.timing import input_bound

Rule = Callable[[Report], list[Finding]]

#: Every rule by its id, in the order they run.
RULES: dict[str, Rule] = {
    "retained-graph": retained_graph,
    "tensor-accumulation": tensor_accumulation,
    "hook-accumulation": hook_accumulation,
    "reference-cycle": reference_cycle,
    "memory-growth": memory_growth,
    "missing-no-grad": missing_no_grad,
    "exception-frames": exception_frames,
    "allocator-fragmentation": allocator_fragmentation,
    "non-pytorch-memory": non_pytorch_memory,
    "input-bound": input_bound,
    "loop-variables": loop_variables,
    "memory-headroom": memory_headroom,
}

#: Rules that name what makes memory grow: once one of them reports, the growth is theirs.
CAUSES = frozenset({"retained-graph", "tensor-accumulation", "hook-accumulation",
                    "reference-cycle"})

_SEVERITY_ORDER = {Severity.LEAK: 0, Severity.WASTE: 1, Severity.HINT: 2}


def _is_cause(finding: Finding) -> bool:
    """A cause of growth: a LEAK of a cause rule, or reference cycles at any severity (memory
    that waits for the collector rises between its runs)."""
    return finding.rule in CAUSES and (
        finding.severity is Severity.LEAK or finding.rule == "reference-cycle"
    )


def analyse(report: Report, rules: Sequence[str] | None = None) -> tuple[Finding, ...]:
    """Run the rules named in ``rules`` (all by default) on ``report``; most severe first."""
    unknown = [rule for rule in rules or () if rule not in RULES]
    if unknown:
        raise ValueError(f"unknown rule id(s) {unknown}; known rules: {sorted(RULES)}")
    findings = [f for rule_id in (rules or RULES) for f in RULES[rule_id](report)]
    if any(_is_cause(f) for f in findings):
        findings = [f for f in findings if f.rule != "memory-growth"]
    findings.sort(key=lambda f: (_SEVERITY_ORDER[f.severity], -(f.bytes or 0)))
    return tuple(findings)


__all__ = ["CAUSES", "RULES", "Rule", "analyse"]
