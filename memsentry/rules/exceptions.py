"""``exception-frames``: a kept exception whose traceback keeps its frames' tensors alive."""

from __future__ import annotations

from dataclasses import replace

from memsentry.model import Finding, ReportData, Severity, Subject
from memsentry.rules.registry import rule
from memsentry.rules.series import TRACEBACK, complete_censuses, describe_holder, plural
from memsentry.units import format_bytes

RULE_ID = "exception-frames"


@rule(RULE_ID, severities={Severity.WASTE})
def exception_frames(report: ReportData) -> list[Finding]:
    """An exception stored in a variable, attribute or ``sys.last_value`` (an out-of-memory
    retry that keeps ``error``, a notebook's last error) keeps its traceback, the traceback
    keeps every frame it passed through, and the frames keep their locals: the tensors of the
    failed attempt stay allocated. Seen at the last two censuses."""
    censuses = complete_censuses(report)
    if len(censuses) < 2:
        return []
    earlier = {h.path for h in censuses[-2].holders if h.path[-1:] == (TRACEBACK,) and h.tensors}
    findings = []
    for holder in censuses[-1].holders:
        if not (holder.path[-1:] == (TRACEBACK,) and holder.tensors and holder.path in earlier):
            continue
        owner = replace(holder, path=holder.path[:-1])
        message = (
            f"{describe_holder(owner)} keeps an exception "
            f"whose traceback holds the frames it passed through, and with them "
            f"{plural(holder.tensors, 'tensor')} ({format_bytes(holder.bytes)}) of the failed "
            "call's locals"
        )
        name = owner.path[-1].name
        fix = (
            f"keep what you need from the error, not the error: `str({name})`, or drop its "
            f"frames with `traceback.clear_frames({name}.__traceback__)`; after an "
            "out-of-memory error, retry outside the `except` block"
        )
        findings.append(
            Finding(rule=RULE_ID, severity=Severity.WASTE, message=message, fix=fix,
                    bytes=holder.bytes, objects=holder.tensors,
                    subject=Subject.holder(owner.path),
                    location=holder.where)
        )
    return findings
