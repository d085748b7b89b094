"""Rank 0's combined report: every rank's figures side by side and every rank's findings,
each marked with its rank. A pure function of the ranks' reports."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from memsentry.model import Finding, ReportData, Severity

_ORDER = {Severity.LEAK: 0, Severity.WASTE: 1, Severity.HINT: 2}


def combine(reports: Sequence[ReportData | None], timeout: float) -> ReportData:
    """Rank 0's report (``reports[0]``) with ``ranks`` (the reports that arrived, in rank
    order) and the findings of every rank, most severe and largest first; a note names the
    ranks whose report did not arrive within ``timeout`` seconds."""
    own = reports[0]
    assert own is not None
    arrived = tuple(r for r in reports if r is not None)
    missing = [rank for rank, report in enumerate(reports) if report is None]
    return replace(own, findings=_ranked_findings(reports), ranks=arrived,
                   notes=(*own.notes, *_missing_notes(missing, timeout)))


def _ranked_findings(reports: Sequence[ReportData | None]) -> tuple[Finding, ...]:
    """Every rank's findings, each marked with its rank, in the order of :func:`_order`."""
    findings = [replace(f, rank=rank) for rank, report in enumerate(reports)
                if report is not None for f in report.findings]
    return tuple(sorted(findings, key=_order))


def _order(finding: Finding) -> tuple[int, int, int]:
    """Most severe first, then largest, then lowest rank."""
    return _ORDER[finding.severity], -(finding.bytes or 0), finding.rank or 0


def _missing_notes(missing: list[int], timeout: float) -> tuple[str, ...]:
    """The note naming the ranks whose report did not arrive (none when all did)."""
    if not missing:
        return ()
    names = ", ".join(map(str, missing))
    return (
        f"rank{'s' if len(missing) > 1 else ''} {names} did not hand in a report within "
        f"{timeout:g} s of rank 0's end of tracking (it does not track this block, failed, "
        "left the block, or is still running): its figures and findings are missing here; "
        "each rank's own report is still what its tracker.report() returns",
    )


def peak_spread(reports: Sequence[ReportData]) -> tuple[int, int] | None:
    """The lowest and highest peak across ranks, ``None`` without two peaks."""
    peaks = [r.peak for r in reports if r.peak is not None]
    if len(peaks) < 2:
        return None
    return min(peaks), max(peaks)


__all__ = ["combine", "peak_spread"]
