"""``hook-accumulation``: module or tensor hooks registered again at every iteration."""

from __future__ import annotations

from memsentry.model import (
    EXIT_REGISTRY,
    Finding,
    HookStats,
    ReportData,
    Severity,
    Subject,
    SubjectKind,
)
from memsentry.rules.registry import rule
from memsentry.rules.series import Trend, complete_censuses, per_iteration, series, trend

RULE_ID = "hook-accumulation"


@rule(RULE_ID, severities={Severity.LEAK}, causes={Severity.LEAK})
def hook_accumulation(report: ReportData) -> list[Finding]:
    """A module's count of user hooks (forward, pre-forward, backward, and its parameters'
    tensor hooks) rises at every census: the loop registers a hook and drops its handle. The
    callbacks registered with :mod:`atexit` are counted the same way: each keeps its
    arguments until the interpreter exits."""
    censuses = complete_censuses(report)
    findings = []
    for module, row in series(censuses, lambda c: c.hooks, lambda h: h.module).items():
        count = trend(censuses, row, lambda h: h.count)
        if not count.climbs():
            continue
        # The newest census that saw the module's hooks: one that removed every handle at
        # an epoch's end lists nothing for it (the tooth before is what is judged).
        last = next(state for state in reversed(row) if state is not None)
        message, fix = _exit_callbacks(last, count) if module == EXIT_REGISTRY \
            else _hooks(last, count)
        findings.append(
            Finding(rule=RULE_ID, severity=Severity.LEAK, message=message, fix=fix,
                    bytes=None, rate=None, objects=last.count,
                    location=last.registered or last.where,
                    subject=Subject(SubjectKind.MODULE, module or "<global hooks>"),
                    iteration=count.iterations[-1])
        )
    return findings


def _hooks(last: HookStats, count: Trend) -> tuple[str, str]:
    """The message and fix for a module's hooks (or the global ones) that pile up."""
    owner = "hooks registered globally" if last.module is None else f"`{last.module}`"
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
    return message, fix


def _exit_callbacks(last: HookStats, count: Trend) -> tuple[str, str]:
    """The message and fix for callbacks registered with :mod:`atexit` at every step."""
    where = f" (registered at {last.registered})" if last.registered else ""
    message = (
        f"the interpreter's `atexit` registry gains "
        f"{per_iteration(count.per_iteration, 'callback')}{where}: {last.count:,} callbacks "
        f"at iteration {count.iterations[-1]}, up from {int(count.values[0])} at iteration "
        f"{count.iterations[0]}. Each keeps its function and the arguments given to "
        "`atexit.register` (tensors too) until the program exits, and all run then"
    )
    fix = (
        "register one callback, once, before the loop, and let it read what must be saved "
        "from one place (the latest value, not every step's); or `atexit.unregister(fn)` "
        "the old one before registering again"
    )
    return message, fix
