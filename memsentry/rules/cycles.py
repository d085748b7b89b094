"""``reference-cycle``: tensors kept only by garbage reference cycles."""

from __future__ import annotations

from collections.abc import Sequence

from memsentry.model import (
    Census,
    Finding,
    GarbageStats,
    ReportData,
    Severity,
    Subject,
    SubjectKind,
)
from memsentry.rules.registry import rule
from memsentry.rules.series import plural
from memsentry.units import format_bytes

RULE_ID = "reference-cycle"
#: Censuses at which cycles holding tensors must be found (one could be a coincidence).
MIN_SIGHTINGS = 2


def _types(garbage: GarbageStats) -> str:
    return ", ".join(f"{name} ({count})" for name, count in garbage.types[:4]) or "unknown"


def _fix(garbage: GarbageStats) -> str:
    names = [name for name, _count in garbage.types]
    if any(name.endswith("Backward") for name in names):
        function = next(name for name in names if name.endswith("Backward"))[: -len("Backward")]
        return (
            f"in `{function}.forward`, keep tensors for backward with "
            "`ctx.save_for_backward(...)`, not as attributes of ctx (`ctx.y = y` makes the "
            "output and its ctx point at each other)"
        )
    advice = (
        "break the cycle: give back-references as `weakref.ref`, do not capture `self` in "
        "lambdas or hooks handed to objects it owns (LambdaLR, register_*_hook), and drop "
        "references to tensors when an object is done"
    )
    if not garbage.gc_enabled and not _collected(garbage):
        advice += (
            "; with gc disabled, call `gc.collect()` every few iterations: each call frees "
            "the cycles made since the one before, so they no longer pile up, but memory "
            "still rises between calls (waste, not a leak) until the cycle is broken"
        )
    return advice


def _collected(garbage: GarbageStats) -> bool:
    """With the collector disabled, full collections freed memory since the census before:
    the program's own `gc.collect()` calls (or a library's), which free the cycles made
    since the call before."""
    return not garbage.gc_enabled and garbage.full_collections > 0 and garbage.full_freed > 0


@rule(RULE_ID, severities={Severity.LEAK, Severity.WASTE},
      causes={Severity.LEAK, Severity.WASTE})
def reference_cycle(report: ReportData) -> list[Finding]:
    """Tensors found among the unreachable objects of the censuses' young-generation
    collections: reference cycles own them, and only the garbage collector frees them. A leak
    with the collector disabled (nothing ever frees them), waste with it on (they wait for
    the collection of their generation), or disabled while `gc.collect()` calls still freed
    memory since the census before (they wait for the next call). Full collections that
    freed memory count as evidence, once tensors were seen in a cycle."""
    sightings = [c for c in report.censuses if _saw_tensors(c)]
    if len(sightings) < MIN_SIGHTINGS:
        return []
    garbage = [c.garbage for c in sightings if c.garbage is not None]
    last, iteration = garbage[-1], sightings[-1].iteration
    message = (
        f"reference cycles owned {plural(last.tensors, 'tensor')} ({format_bytes(last.bytes)}) at "
        f"iteration {iteration}, found at {len(sightings)} of "
        f"{len(report.censuses)} censuses; only the garbage collector frees them. The "
        f"unreachable objects are {_types(last)}"
    )
    freed_before = any(g.full_freed for g in garbage[:-1])
    message += (_full_collections_note(garbage, last.gc_enabled)
                + _collector_note(last, freed_before))
    largest = max(garbage, key=lambda g: g.bytes)
    return [
        Finding(rule=RULE_ID, severity=_severity(last), message=message, fix=_fix(last),
                bytes=max(largest.bytes, last.freed),
                rate=last.bytes / _span(report.censuses, iteration), objects=last.tensors,
                subject=_subject(last), iteration=iteration)
    ]


def _saw_tensors(census: Census) -> bool:
    """Whether the census's collection found tensors among the unreachable objects."""
    return census.garbage is not None and bool(census.garbage.tensors)


def _span(censuses: Sequence[Census], iteration: int) -> int:
    """The iterations since the census before the one at ``iteration`` (since the start for
    the first census), one at least."""
    earlier = [c.iteration for c in censuses]
    index = earlier.index(iteration)
    span = earlier[index] - earlier[index - 1] if index else earlier[index] + 1
    return max(span, 1)


def _full_collections_note(garbage: Sequence[GarbageStats], enabled: bool) -> str:
    """What full collections freed meanwhile (nothing said when nothing): the collector's
    own, or, with it disabled, the program's `gc.collect()` calls."""
    full_freed = sum(g.full_freed for g in garbage)
    if not full_freed:
        return ""
    if not enabled:
        return f"; `gc.collect()` calls freed {format_bytes(full_freed)} meanwhile"
    return f"; automatic full collections freed {format_bytes(full_freed)} meanwhile"


def _severity(last: GarbageStats) -> Severity:
    """WASTE while something frees the cycles, late (the collector, or `gc.collect()` calls
    with it disabled); LEAK when nothing does."""
    return Severity.WASTE if last.gc_enabled or _collected(last) else Severity.LEAK


def _collector_note(last: GarbageStats, freed_before: bool) -> str:
    """How the cycles get freed: by the collector, by `gc.collect()` calls (with the
    collector disabled), or not at all; ``freed_before``: full collections freed memory at
    an earlier sighting."""
    if last.gc_enabled:
        return ": memory rises until the collector runs, then drops (a sawtooth)"
    if _collected(last):
        return (": the garbage collector is disabled, so only those calls free them: "
                "memory rises until the next one, then drops (a sawtooth)")
    if freed_before:
        return (": the garbage collector is disabled, and no `gc.collect()` call freed them "
                "since the census before, so nothing frees them now")
    return ": the garbage collector is disabled, so nothing frees them"


def _subject(last: GarbageStats) -> Subject | None:
    """The type the unreachable objects are mostly of."""
    return Subject(SubjectKind.TYPE, last.types[0][0]) if last.types else None
