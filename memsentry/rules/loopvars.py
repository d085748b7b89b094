"""``loop-variables``: the previous iteration's tensors still alive when the next one starts."""

from __future__ import annotations

import itertools
import statistics

from memsentry.model import Finding, HolderKind, HolderStats, ReportData, Severity, Subject
from memsentry.rules.registry import rule
from memsentry.rules.series import (
    after_warmup,
    complete_censuses,
    function_of,
    grows_steadily,
    holder_series,
    trend,
)
from memsentry.units import format_bytes

RULE_ID = "loop-variables"
#: Bytes below which holding on to a batch does not matter.
MIN_BYTES = 1 << 20
#: Share of the iteration's rise from boundary to peak that the kept locals must reach.
MIN_SHARE = 0.1


def _plain_locals(holders: tuple[HolderStats, ...]) -> dict[str, HolderStats]:
    """Locals that are tensors themselves (not containers, not graphs kept on purpose)."""
    return {
        h.name: h for h in holders
        if h.kind == HolderKind.LOCAL and len(h.path) == 1 and h.items is None
        and h.tensors and not h.modules and not h.graph_saved_bytes
    }


@rule(RULE_ID, severities={Severity.HINT})
def loop_variables(report: ReportData) -> list[Finding]:
    """At two censuses in a row the loop's locals (``x``, ``out``, ``loss``) hold tensors of
    the iteration just finished; they stay allocated until the next iteration rebinds them,
    after it has made its own: the peak carries one batch more than it needs."""
    censuses = complete_censuses(report)
    if len(censuses) < 2:
        return []
    before, last = _plain_locals(censuses[-2].holders), _plain_locals(censuses[-1].holders)
    # A local whose tensors another holder keeps too (`outputs.append(out)`) frees nothing
    # when deleted: it is left out, and so are locals whose storage another local counted.
    # A local that grows at every census (`bank = torch.cat([bank, x])`) is a leak, which
    # tensor-accumulation reports; rebinding it earlier would not help.
    _, table = holder_series(report)
    kept = [last[name] for name in last
            if name in before and last[name].bytes > last[name].shared_bytes
            and not grows_steadily(trend(censuses, table[last[name].path],
                                         lambda h: h.bytes))]
    size = sum(h.bytes - h.shared_bytes for h in kept)
    its = [it for it in after_warmup(report) if it.sampled]  # peaks read inside iterations
    rises = [b.peak - a.allocated for a, b in itertools.pairwise(its)]
    rise = statistics.median(rises) if rises else 0
    if size < MIN_BYTES or size < MIN_SHARE * rise:
        return []
    kept.sort(key=lambda h: h.bytes, reverse=True)
    names = ", ".join(f"`{h.name}` ({format_bytes(h.bytes)})" for h in kept[:4])
    scope = function_of(kept[0])
    message = (
        f"{names} (locals of {scope or 'the loop'}) keep {format_bytes(size)} of the finished "
        "iteration alive until the next one rebinds them, after it has made its own"
    )
    if 0 < size <= rise:
        message += (
            f": the peak rises {format_bytes(round(rise))} above each boundary, and "
            f"{size / rise:.0%} of that could be freed first"
        )
    fix = (
        f"end the step with `del {', '.join(h.name for h in kept[:4])}` (or move the step "
        "into a function, whose locals die when it returns)"
    )
    return [Finding(rule=RULE_ID, severity=Severity.HINT, message=message, fix=fix,
                    bytes=size, objects=sum(h.tensors for h in kept),
                    subject=Subject.holder(kept[0].path), location=kept[0].where)]
