"""The report's first line: what to do, before the tables that explain it.

One line, in words a person reads at a glance at the end of a run: the leaks and wastes found,
each named by the holder or module it is about and its line, the hints counted; or that the
run died of running out of memory; or that nothing was found, with how far memory moved.
"""

from __future__ import annotations

from collections import Counter

from memsentry.model import Finding, OutOfMemory, ReportData, Severity
from memsentry.units import format_bytes

#: Findings named in the headline at most; the others are counted.
NAMED = 3

_ORDER = (Severity.LEAK, Severity.WASTE, Severity.HINT)
_WORDS = {Severity.LEAK: ("leak", "leaks"), Severity.WASTE: ("waste", "wastes"),
          Severity.HINT: ("hint", "hints")}


def _counted(counts: Counter[Severity]) -> str:
    return ", ".join(f"{counts[s]} {_WORDS[s][counts[s] != 1]}" for s in _ORDER if counts[s])


def _named(finding: Finding) -> str:
    """```history` at quick.py:16 (tensor-accumulation)``."""
    subject = finding.subject
    text = f"`{subject.name}`" if subject is not None and subject.name else ""
    if finding.location is not None:
        text += f" at {finding.location}"
    if finding.rank is not None:
        text += f" on rank {finding.rank}"
    return f"{text.strip()} ({finding.rule})" if text else finding.rule


def _oom_part(oom: OutOfMemory | None) -> str | None:
    """That the run died of running out of memory, and where; ``None`` when it did not."""
    if oom is None:
        return None
    if oom.outside:
        return (f"out of memory outside PyTorch's caching allocator in the {oom.where} "
                f"(iteration {oom.iteration}); the post-mortem below says what held memory and "
                "what leaves room")
    return (f"out of memory in the {oom.where} (iteration {oom.iteration}); the post-mortem "
            "below says what held memory and what would have fit")


def _serious_part(serious: list[Finding], counts: Counter[Severity]) -> str:
    """The leaks and wastes counted, the first :data:`NAMED` of them named."""
    named = "; ".join(_named(f) for f in serious[:NAMED])
    more = len(serious) - NAMED
    return f"{_counted(counts)}: {named}" + (f"; and {more} more" if more > 0 else "")


def _findings_part(report: ReportData) -> str | None:
    """The findings in a few words: the leaks and wastes named, else the hints counted, else
    that there was none (unless the run died of running out of memory: ``None``)."""
    counts = Counter(f.severity for f in report.findings)
    serious = [f for f in report.findings if f.severity is not Severity.HINT]
    if serious:
        return _serious_part(serious, counts)
    if counts:
        rules = ", ".join(dict.fromkeys(f.rule for f in report.findings))
        return f"no leak or waste found; {_counted(counts)} ({rules})"
    if report.oom is None:
        return "no finding" + _moved(report)
    return None


def headline(report: ReportData) -> str:
    """The one-line summary the text report starts with."""
    parts = [_oom_part(report.oom), _findings_part(report)]
    return "memsentry: " + "; ".join(part for part in parts if part is not None)


def _moved(report: ReportData) -> str:
    if report.allocated is None:
        return ""
    change = format_bytes(report.allocated - report.baseline, signed=True)
    return f" (allocated {change} since the start)"


__all__ = ["headline"]
