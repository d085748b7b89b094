"""The ranks of a process group side by side, in rank 0's combined report."""

from __future__ import annotations

from collections import Counter

from tabulate import tabulate

from memsentry.model import ReportData, Severity
from memsentry.rules.ranks import peak_spread
from memsentry.units import format_bytes


def rank_line(report: ReportData) -> str | None:
    """``rank 1 of 2 on host-a`` for a report of a process group, else ``None``."""
    if report.rank is None or report.world_size is None:
        return None
    return f"rank {report.rank} of {report.world_size}" + (
        f" on {report.host}" if report.host else "")


def _findings(report: ReportData) -> str:
    counts = Counter(f.severity for f in report.findings)
    parts = [f"{counts[s]} {s.value.upper()}" for s in Severity if counts[s]]
    return ", ".join(parts) or "-"


def render_ranks(report: ReportData) -> str | None:
    """The table of ranks, or ``None`` for a report that combines none."""
    if not report.ranks:
        return None
    rows = []
    for each in report.ranks:
        change = None if each.allocated is None else each.allocated - each.baseline
        parts = each.breakdown.peak
        rows.append([str(each.rank), each.host or "-", format_bytes(each.peak),
                     format_bytes(change, signed=True),
                     format_bytes(parts.parameters if parts else None),
                     format_bytes(parts.activations if parts else None), _findings(each)])
    title = f"Ranks ({len(report.ranks)} of {report.world_size} reported"
    spread = peak_spread(report.ranks)
    if spread is not None and spread[0]:
        low, high = spread
        title += (f"; peaks from {format_bytes(low)} to {format_bytes(high)}, the highest "
                  f"{high / low - 1:+.0%} over the lowest")
    headers = ("rank", "host", "peak", "allocated change", "parameters", "activations",
               "findings")  # the two parts at each rank's own peak
    table = tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True)
    return f"{title})\n{table}"


__all__ = ["rank_line", "render_ranks"]
