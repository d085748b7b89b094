"""``input-bound``: the loop waits for data longer than it computes."""

from __future__ import annotations

import statistics

from memsentry.model import Finding, ReportData, Severity, Subject, SubjectKind, complete
from memsentry.rules.registry import rule
from memsentry.rules.series import WARMUP

RULE_ID = "input-bound"
#: Iterations after warm-up needed to judge.
MIN_ITERATIONS = 4
#: Waits shorter than this are Python overhead, not a data problem.
MIN_WAIT = 0.005


@rule(RULE_ID, severities={Severity.HINT})
def input_bound(report: ReportData) -> list[Finding]:
    """The median time an iteration spends fetching its batch from a ``DataLoader`` exceeds
    the median time of the rest of it (forward, backward, step and the loop's own code).
    Loops that read data some other way are not judged: their wait cannot be told apart from
    their own work."""
    timed = [it for it in report.iterations if it.data_seconds is not None]
    its = complete(timed, skip=WARMUP)
    if len(its) < MIN_ITERATIONS:
        return []
    wait = statistics.median(it.data_seconds or 0.0 for it in its)
    compute = statistics.median(it.seconds - (it.data_seconds or 0.0) for it in its)
    if wait < MIN_WAIT or wait <= compute:
        return []
    share = wait / (wait + compute)
    message = (
        f"the loop waits {wait * 1e3:.1f} ms per iteration for the DataLoader's next batch "
        f"(loading and collating it, or waiting for its workers) against "
        f"{compute * 1e3:.1f} ms for the rest of the iteration (medians of {len(its)} "
        f"iterations): the model idles {share:.0%} of the time"
    )
    fix = (
        "load in parallel: DataLoader(..., num_workers=N, pin_memory=True, "
        "persistent_workers=True, prefetch_factor=2), copy with .to(device, non_blocking=True), "
        "and move per-sample work (decoding, augmentation) out of the training process"
    )
    return [Finding(rule=RULE_ID, severity=Severity.HINT, message=message, fix=fix,
                    objects=len(its),
                    subject=Subject(SubjectKind.LOOP, "the training loop"))]
