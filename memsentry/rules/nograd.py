"""``missing-no-grad``: forward passes whose autograd graph no backward used."""

from __future__ import annotations

from memsentry.model import Finding, ReportData, Severity, Subject, SubjectKind
from memsentry.rules.registry import rule
from memsentry.units import format_bytes

RULE_ID = "missing-no-grad"


@rule(RULE_ID, severities={Severity.WASTE})
def missing_no_grad(report: ReportData) -> list[Finding]:
    """An outermost module ran with autograd on and no backward reached its output by the end
    of the iteration: evaluation or inference without ``torch.no_grad()``. Everything its ops
    saved for backward was kept for nothing, raising the peak (``eval()`` does not turn
    autograd off)."""
    findings = []
    cost = report.cost
    partial = cost is not None and cost.sampled < cost.iterations
    for unused in report.unused_graphs:
        if unused.saved_bytes == 0:
            continue  # nothing saved, nothing wasted
        caller, where = "", unused.where
        if where is not None and where.function and where.function != "<module>":
            caller = f" from {where.function}() at {where}"
        elif where is not None:
            caller = f" at {where}"
        mode = (
            f"{unused.eval_calls:,} of them in eval() mode" if unused.eval_calls
            else "in train() mode"
        )
        least = "at least " if partial or unused.unwatched else ""
        message = (
            f"`{unused.module}` ran {least}{unused.calls:,} forward passes with autograd "
            f"on{caller} ({mode}) whose graphs no backward used"
        )
        if partial and not unused.unwatched:
            assert cost is not None
            message += (
                f" (memsentry followed every module call in {cost.sampled:,} of "
                f"{cost.iterations:,} iterations, to keep to its budget, and not all calls in "
                "the others)"
            )
        if unused.unwatched:
            message += (
                f" (memsentry watched only some of its calls, to keep to its budget: "
                f"{unused.unwatched:,} more were not judged)"
            )
        if unused.saved_bytes is not None:
            message += (
                f"; each kept up to {format_bytes(unused.saved_bytes)} saved for backward "
                "for nothing, on top of the peak"
            )
        fix = (
            "run evaluation and inference under `with torch.no_grad():` (or "
            "`torch.inference_mode()`); `model.eval()` only switches dropout and batch norm, "
            "it leaves autograd on"
        )
        findings.append(
            Finding(rule=RULE_ID, severity=Severity.WASTE, message=message, fix=fix,
                    bytes=unused.saved_bytes, objects=unused.calls, location=unused.where,
                    subject=Subject(SubjectKind.MODULE, unused.module))
        )
    return findings
