"""``reference-cycle``: tensors kept only by garbage reference cycles."""

from __future__ import annotations

from memsentry.model import Finding, GarbageStats, ReportData, Severity, Subject, SubjectKind
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
    if not garbage.gc_enabled:
        advice += "; with gc disabled, call `gc.collect()` every few iterations"
    return advice


@rule(RULE_ID, severities={Severity.LEAK, Severity.WASTE},
      causes={Severity.LEAK, Severity.WASTE})
def reference_cycle(report: ReportData) -> list[Finding]:
    """Tensors found among the unreachable objects of the censuses' young-generation
    collections: reference cycles own them, and only the garbage collector frees them. A leak
    with the collector disabled (nothing ever frees them), waste with it on (they wait for
    the collection of their generation). Automatic full collections that freed memory count
    as evidence, once tensors were seen in a cycle."""
    sightings = [c for c in report.censuses if c.garbage is not None and c.garbage.tensors]
    if len(sightings) < MIN_SIGHTINGS:
        return []
    last = sightings[-1].garbage
    assert last is not None
    largest = max((c.garbage for c in sightings if c.garbage), key=lambda g: g.bytes)
    earlier = [c.iteration for c in report.censuses]
    index = earlier.index(sightings[-1].iteration)
    span = earlier[index] - earlier[index - 1] if index else earlier[index] + 1
    per_iteration = last.bytes / max(span, 1)
    full_freed = sum(c.garbage.full_freed for c in sightings if c.garbage)
    message = (
        f"reference cycles owned {plural(last.tensors, 'tensor')} ({format_bytes(last.bytes)}) at "
        f"iteration {sightings[-1].iteration}, found at {len(sightings)} of "
        f"{len(report.censuses)} censuses; only the garbage collector frees them. The "
        f"unreachable objects are {_types(last)}"
    )
    if full_freed:
        message += f"; automatic full collections freed {format_bytes(full_freed)} meanwhile"
    if last.gc_enabled:
        message += ": memory rises until the collector runs, then drops (a sawtooth)"
        severity = Severity.WASTE
    else:
        message += ": the garbage collector is disabled, so nothing frees them"
        severity = Severity.LEAK
    return [
        Finding(rule=RULE_ID, severity=severity, message=message, fix=_fix(last),
                bytes=max(largest.bytes, last.freed), rate=per_iteration, objects=last.tensors,
                subject=Subject(SubjectKind.TYPE, last.types[0][0]) if last.types else None,
                iteration=sightings[-1].iteration)
    ]
