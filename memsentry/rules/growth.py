"""``memory-growth``: allocated memory rising steadily across iterations after warm-up."""

from __future__ import annotations

from memsentry.model import (
    Boundary,
    Finding,
    HolderStats,
    IterationStats,
    Measured,
    ReportData,
    Severity,
    Subject,
    SubjectKind,
    spell,
)
from memsentry.rules.closing import exit_stayed
from memsentry.rules.registry import rule
from memsentry.rules.resident import (
    PILE_UP_FIX,
    python_values,
    resident_climb,
    resident_growth,
)
from memsentry.rules.series import (
    MIN_CENSUSES,
    WARMUP,
    after_warmup,
    complete_censuses,
    holder_series,
    reaches_back,
    steady_growth,
)
from memsentry.rules.threads import other_threads_grew
from memsentry.units import format_bytes

RULE_ID = "memory-growth"

#: Iterations after warm-up needed before growth is judged.
MIN_ITERATIONS = 4
#: On a heap backend, growth of the tensors the censuses reach below this share of the heap's
#: growth means the heap grows for something else.
MIN_TENSOR_SHARE = 0.25


def _reachable_growth(report: ReportData) -> tuple[float, int] | None:
    """(bytes per iteration, censuses) of the tensors and saved activations the censuses
    reached, first to last complete census; ``None`` with fewer than three."""
    censuses = complete_censuses(report)
    if len(censuses) < MIN_CENSUSES:
        return None
    totals = [sum(h.bytes + h.graph_saved_bytes for h in c.holders) for c in censuses]
    nodes = [sum(h.graph_nodes for h in c.holders) for c in censuses]
    span = censuses[-1].iteration - censuses[0].iteration
    if not span or nodes[-1] > nodes[0]:
        return None  # graphs pile up: their nodes live on the heap, outside tensor bytes
    return (totals[-1] - totals[0]) / span, len(censuses)


def _step_local(report: ReportData) -> list[str] | None:
    """The holders that grew from the first complete census to the last, when every one of
    them is rebuilt at every step: a tensor the code binds anew before it fills it
    (``x = torch.randn(8 + 4 * step, 32, 16)``) or a graph that no census saw outlive the one
    before (this step's loss, longer because its input is). Their growth follows the input (a
    longer sequence, a larger batch) and nothing is kept from one step to the next. ``None``
    when none grew, one of them is kept across steps, or fewer than three censuses ran."""
    censuses, table = holder_series(report)
    if len(censuses) < MIN_CENSUSES:
        return None
    grown = []
    for path, row in table.items():
        first, last = row[0], row[-1]
        if first is None or last is None or not _grew(first, last):
            continue
        if not (last.rebound or (last.graph_nodes and not reaches_back(censuses, row))):
            return None
        grown.append(spell(path))
    return grown or None


def _grew(first: HolderStats, last: HolderStats) -> bool:
    """Whether a holder keeps more at the last census than at the first: bytes, saved
    activations or graph nodes."""
    return (last.bytes + last.graph_saved_bytes > first.bytes + first.graph_saved_bytes
            or last.graph_nodes > first.graph_nodes)


def _not_tensors(message: str, its: list[IterationStats], rate: float) -> tuple[str, str]:
    """The heap grows and tensors do not: the message's end and the fix, with Python's
    small objects named when they grow enough to be the source."""
    objects = python_values(its, rate)
    if objects is not None:
        return f"{message}, while {objects}, not tensors", PILE_UP_FIX
    return (f"{message}: the growth is not tensor memory memsentry can see (allocator "
            "bookkeeping, library caches, C objects), or tensors held where no Python "
            "reference leads",
            "if the process keeps growing over a long run, measure tensor storages only with "
            "track(exact=True) (or `memsentry run --exact`): a leak of tensors shows there")


def _judged(report: ReportData) -> tuple[list[Finding], str | None]:
    """The rule's findings, or, for a growth other threads may have made (see
    :mod:`memsentry.rules.threads`), none and the note that says why."""
    complete = after_warmup(report)
    if len(complete) < MIN_ITERATIONS:
        return [], None
    growth = steady_growth(complete)
    if growth is not None and _stayed_to_the_end(report, complete):
        return [], _stayed_note(complete, report.iterations[-1])
    if growth is not None:
        note = other_threads_grew(report, complete, "allocated", growth[0])
        return ([], note) if note else (_allocated_growth(report, complete, growth), None)
    climb = resident_climb(complete)
    note = other_threads_grew(report, climb[0], "resident", climb[1]) if climb else None
    return ([], note) if note else (resident_growth(report, complete), None)


def _stayed_to_the_end(report: ReportData, complete: list[IterationStats]) -> bool:
    """Whether the growth stopped before tracking ended: the partial iteration closed at
    the end, many iterations after the last one recorded, found allocated memory where that
    one left it (:func:`~memsentry.rules.closing.exit_stayed`)."""
    end = report.iterations[-1]
    return end.boundary == Boundary.EXIT and exit_stayed(complete[0], complete[-1], end)


def _stayed_note(complete: list[IterationStats], end: IterationStats) -> str:
    first, last = complete[0], complete[-1]
    return (
        f"Allocated memory grew by {format_bytes(last.allocated - first.allocated)} from "
        f"iteration {first.index} to {last.index}, the last one recorded, and stood at "
        f"{format_bytes(end.allocated)} as tracking ended (iteration {end.index}): it filled "
        "to a size and stayed, which is no leak, so no finding is made of it."
    )


@rule(RULE_ID, severities={Severity.LEAK, Severity.HINT}, fallback=True)
def memory_growth(report: ReportData) -> list[Finding]:
    """Allocated memory climbs steadily after warm-up, at identical iteration boundaries, and
    is still climbing at the end.

    Reports the rate, the growth so far and, when the device size is known, a forecast of the
    iteration at which the device (or RAM, on CPU) runs out. Where the figures are the process
    heap (CPU's default backend) and the censuses saw the tensors the loop can reach stay
    flat, the growth is not tensor memory: a hint, not a leak. When the allocator's count is
    flat but the process's resident memory climbs, a hint says so and what the readings tell
    of its source (:mod:`memsentry.rules.resident`). When every holder that grew between the
    censuses is rebuilt at each step (a tensor bound afresh, a graph built since the census
    before), the growth follows the input (a length curriculum): a hint. When other threads
    ran loops in the
    process and what this loop holds stayed flat, the growth is not judged
    (:func:`growth_note` says so).
    """
    return _judged(report)[0]


def growth_note(report: ReportData) -> str | None:
    """Why a growth of figures that count the whole process was not judged: other threads
    ran loops, and nothing this loop holds grew; ``None`` otherwise."""
    return _judged(report)[1]


def _allocated_growth(report: ReportData, complete: list[IterationStats],
                      growth: tuple[float, float]) -> list[Finding]:
    """The finding for allocated memory that climbs at ``growth`` (rate, share rising)."""
    rate, rising = growth
    first, last = complete[0], complete[-1]
    grown = last.allocated - first.allocated
    where = "RAM" if report.device == "cpu" else report.device
    message = (
        f"allocated memory grows by {format_bytes(round(rate))}/iter on {report.device}: "
        f"+{format_bytes(grown)} from iteration {first.index} to {last.index}, "
        f"higher after {rising:.0%} of the iterations"
    )
    if report.total_memory:
        left = report.total_memory - last.allocated
        iterations_left = int(left / rate)
        message += (
            f"; at this rate the {format_bytes(report.total_memory)} of {where} run out "
            f"around iteration {last.index + iterations_left:,}"
        )
    fix = (
        "something keeps tensors from every iteration alive: look for losses or metrics "
        "summed without .item(), outputs appended to lists or dicts, tensors stored on "
        "modules or loggers, and state carried across iterations without .detach()"
    )
    hint = _not_a_leak(report, complete, rate, message)
    severity = Severity.LEAK if hint is None else Severity.HINT
    if hint is not None:
        message, fix = hint
    return [
        Finding(
            rule=RULE_ID,
            severity=severity,
            message=message,
            fix=fix,
            bytes=grown,
            rate=rate,
            subject=Subject(SubjectKind.DEVICE, report.device),
            iteration=last.index,
        )
    ]


def _not_a_leak(report: ReportData, complete: list[IterationStats], rate: float,
                message: str) -> tuple[str, str] | None:
    """(the message, the fix) of a growth that is not judged a leak, else ``None``: on the
    process heap, the holder searches were put off; every holder that grew is rebuilt at
    each step; or the tensors the censuses reached grew far less than the heap."""
    heap = report.measured == Measured.HEAP
    reached = _reachable_growth(report) if heap else None
    put_off = report.cost.censuses_deferred if report.cost is not None else 0
    if reached is None and put_off and heap:
        # The censuses that would say whether tensors grow were put off by the cost budget:
        # heap growth alone (allocator bookkeeping, caches) is no proof of a leak.
        return (
            f"{message}; this counts the whole process heap, and the holder searches that "
            f"would show whether tensors grow were put off to keep memsentry's budget "
            f"({put_off} waited), so it is not judged a leak",
            "run longer (the searches come as the budget allows), or with "
            "track(overhead=None) to take each when due, or measure tensor storages only "
            "with track(exact=True) (`memsentry run --exact`)",
        )
    rebuilt = _step_local(report)
    if rebuilt is not None:
        names = ", ".join(f"`{name}`" for name in rebuilt[:4])
        return (
            f"{message}; the holders that grew ({names}) are rebuilt at every step: their "
            "size follows the input (a longer sequence, a larger batch) and nothing is kept "
            "from one step to the next, so it is not judged a leak",
            "nothing to fix if the inputs grow by design (a length curriculum, a growing "
            "batch); if they should not, check how batches are built",
        )
    if reached is not None and reached[0] < MIN_TENSOR_SHARE * rate:
        message += (
            f"; but this counts the whole process heap, and the tensors your code can reach "
            f"grew {format_bytes(round(max(reached[0], 0)), signed=True)}/iter over "
            f"{reached[1]} censuses"
        )
        return _not_tensors(message, complete, rate)
    return None


__all__ = ["MIN_ITERATIONS", "RULE_ID", "WARMUP", "growth_note", "memory_growth"]
