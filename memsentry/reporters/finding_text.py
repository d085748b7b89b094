"""Findings as text, one layout for every text view: a report's, a snapshot's verdict, a
diff's findings that appeared and went."""

from __future__ import annotations

from collections.abc import Sequence

from memsentry.model import Finding
from memsentry.reporters.wrap import fill


def finding_lines(findings: Sequence[Finding], *, width: int = 100) -> list[str]:
    """Each finding: severity, rank, rule id, where (when its message does not say it) and
    message, then the fix, wrapped to ``width``."""
    lines = []
    for finding in findings:
        shown = finding.where and finding.where not in finding.message
        where = f" [{finding.where}]" if shown else ""
        severity = str(finding.severity).upper()
        rank = "" if finding.rank is None else f"rank {finding.rank}: "
        head = f"  {severity:5} {rank}{finding.rule}{where}: {finding.message}"
        lines.append(fill(head, width, subsequent_indent="        "))
        lines.append(fill(f"        fix: {finding.fix}", width, subsequent_indent=" " * 13))
    return lines


__all__ = ["finding_lines"]
