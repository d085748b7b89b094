"""``hook-accumulation``: module or tensor hooks registered again at every iteration."""

from __future__ import annotations

from memsentry.model import Finding, ReportData, Severity, Subject, SubjectKind
from memsentry.rules.registry import rule
from memsentry.rules.series import complete_censuses, per_iteration, series, trend

RULE_ID = "hook-accumulation"


@rule(RULE_ID, severities={Severity.LEAK}, causes={Severity.LEAK})
def hook_accumulation(report: ReportData) -> list[Finding]:
    """A module's count of user hooks (forward, pre-forward, backward, and its parameters'
    tensor hooks) rises at every census: the loop registers a hook and drops its handle."""
    censuses = complete_censuses(report)
    findings = []
    for module, row in series(censuses, lambda c: c.hooks, lambda h: h.module).items():
        count = trend(censuses, row, lambda h: h.count)
        if not count.climbs():
            continue
        # The newest census that saw the module's hooks: one that removed every handle at
        # an epoch's end lists nothing for it (the tooth before is what is judged).
        last = next(state for state in reversed(row) if state is not None)
        owner = "hooks registered globally" if module is None else f"`{module}`"
        newest = f"`{last.hook}`" if last.hook else "a hook"
        if last.registered:
            newest += f", registered at {last.registered}"
        if last.where:
            newest += f", defined at {last.where}"
        message = (
            f"{owner} gains {per_iteration(count.per_iteration, 'hook')}: {last.count:,} user "
            f"hooks at iteration {count.iterations[-1]}, up from {int(count.values[0])} at "
            f"iteration {count.iterations[0]} (newest: {newest}). Every call runs all of them, "
            "so each step is slower than the last, and whatever they capture stays alive"
        )
        fix = (
            "register the hook once, before the loop; or keep the handle it returns and call "
            "`handle.remove()` when done with it"
        )
        findings.append(
            Finding(rule=RULE_ID, severity=Severity.LEAK, message=message, fix=fix,
                    bytes=None, rate=None, objects=last.count,
                    location=last.registered or last.where,
                    subject=Subject(SubjectKind.MODULE, module or "<global hooks>"),
                    iteration=count.iterations[-1])
        )
    return findings
