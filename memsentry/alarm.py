"""The alarm while the run lives: a leak is said as soon as a census confirms it,
and the report file is kept current, so that a run killed after ten hours leaves its latest
report.

After each census the rules run on the recording so far. A LEAK finding not said before is
said, in the loop's thread, once it held while the run went on to eight times as many
iterations (:data:`CONFIRM`, :func:`held_from`): containers bounded at some entries grow like
leaks until they are full, and a warning a longer run would take back is worse than one some
iterations later. The census that would confirm a leak found but not said is taken when due
whatever the budget holds (``LiveAlarm.settles``). A leak is said:

- to the ``alarm`` callback, when one is given (``memsentry run`` writes one line on stderr,
  the framework callbacks their logger); an error it raises is raised in the loop at the
  next iteration boundary (an optimizer step, ``t.step()``, the next forward), and
  ``on_leak`` is left to the end;
- otherwise, with ``on_leak="warn"``, as a :class:`~memsentry.LeakWarning` at the user's line
  that runs the loop (the end's warning then names only leaks found later);
- with ``on_leak="raise"``, as a :class:`~memsentry.LeakError` raised in the loop at the next
  iteration boundary (the end does not raise it again).

The report file (``report_path``) is written whole to a temporary file beside it and moved in
place (:func:`os.replace`), at every new finding (said or not yet) and every
:data:`REWRITE_SECONDS`, so a reader never sees half a file. A write that fails (a full disk)
leaves the last whole report there, is noted in the report and warned once (a
``RuntimeWarning`` at the user's line), and the run goes on.
"""

from __future__ import annotations

import sys
import time
import types
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

from memsentry.errors import LeakError, LeakWarning
from memsentry.model import Finding, ReportData, Severity
from memsentry.paths import replace_text
from memsentry.rules.series import HolderSeries, growing_since, holder_series
from memsentry.usercode.frames import is_machinery_frame
from memsentry.usercode.text import printable

if TYPE_CHECKING:
    from memsentry.record import Recorder
    from memsentry.record.options import OnLeak
    from memsentry.report import Report

#: Seconds between two rewrites of the report file while the run lives.
REWRITE_SECONDS = 120.0
#: A LEAK is said while the run lives once it held from the census of iteration i to one of
#: iteration CONFIRM * i or later (first seen at 4: said at the census of iteration 34, as
#: iteration 35 begins); the report at the end judges every finding as it stands. On the
#: scenario suite's 18 loops that are no leak, 4 made 3 alarms a longer run took back (a
#: buffer flushed every 25 steps, an epoch's predictions, an episode's state); 8 made none.
CONFIRM = 8
#: For a holder, i is the census from which what it keeps has not fallen, when that is
#: earlier than the rule's first finding, but never before iteration SEEN_FROM (the third
#: census: the first that can show a trend). A list that gains an output every 5 steps is
#: seen at 6 and found at 34, once it has risen at two censuses: it held from 6, and is said
#: at the census of 66 rather than of 272. Counted from the first census that saw a holder
#: (iteration 2), the three containers above were said at 18; from 4, none was, on the suite
#: run to 150 iterations.
SEEN_FROM = 4

Alarm = Callable[[str, tuple[Finding, ...]], None]


def leak_text(report: ReportData, leaks: tuple[Finding, ...] | None = None
              ) -> tuple[str, tuple[Finding, ...]] | None:
    """The message of a :class:`~memsentry.LeakWarning` or :class:`~memsentry.LeakError`
    about ``leaks`` (by default ``report``'s), and the leaks; ``None`` when there is none."""
    if leaks is None:
        leaks = tuple(f for f in report.findings if f.severity is Severity.LEAK)
    if not leaks:
        return None
    lines = [f"memsentry found {len(leaks)} leak(s):"]
    # Written to a terminal: control characters of the program's names as visible escapes.
    lines += [f"  {'' if f.rank is None else f'rank {f.rank}: '}{f.rule}: "
              f"{printable(f.message)}. Fix: {printable(f.fix)}" for f in leaks]
    return "\n".join(lines), leaks


def finding_key(finding: Finding) -> tuple[str, str]:
    """What makes a finding the same one later in the run (its figures change as it grows)."""
    subject = finding.subject
    return finding.rule, "" if subject is None else repr(subject)


def held_from(series: HolderSeries, finding: Finding, found: int) -> int:
    """The iteration from which ``finding`` held, for :data:`CONFIRM`: the census at which
    the rule ``found`` it, or for a holder the one from which what it keeps has not fallen
    (:func:`~memsentry.rules.series.growing_since`, on the report's ``series``), if
    earlier, but not before :data:`SEEN_FROM`."""
    subject = finding.subject
    censuses, table = series
    row = None if subject is None or subject.path is None else table.get(subject.path)
    since = None if row is None else growing_since(censuses, row)
    return found if since is None else min(found, max(SEEN_FROM, since))


def _subject(finding: Finding) -> str:
    return "the loop" if finding.subject is None else f"`{finding.subject.name}`"


def warn_at_user_line(text: str, category: type[Warning] = LeakWarning) -> None:
    """A warning (by default a :class:`~memsentry.LeakWarning`) located at the innermost line
    of the user's code."""
    frame = _user_frame()
    if frame is None:
        warnings.warn(category(text), stacklevel=2)
        return
    warnings.warn_explicit(category(text), category, frame.f_code.co_filename,
                           frame.f_lineno or 0, module=frame.f_globals.get("__name__"),
                           registry=frame.f_globals.setdefault("__warningregistry__", {}))


def _user_frame() -> types.FrameType | None:
    frame: types.FrameType | None = sys._getframe(2)
    while frame is not None and is_machinery_frame(frame):
        frame = frame.f_back
    return frame


def write_atomically(report: Report, path: str) -> None:
    """``report`` as JSON to ``path``, whole or not at all (a failure leaves the file that
    was there as it was: :func:`~memsentry.paths.replace_text`)."""
    replace_text(path, report.to_json())


class LiveAlarm:
    """The findings said while the run lives, and the report file kept current."""

    def __init__(self, on_leak: OnLeak, alarm: Alarm | None, report_path: str | None) -> None:
        self.on_leak = on_leak
        self.alarm = alarm
        self.report_path = report_path
        # leak -> the iteration of the census it was said at, and the finding said
        self.said: dict[tuple[str, str], tuple[int, Finding]] = {}
        self.errors: list[str] = []  # why the report file could not be written
        self._written = time.monotonic()
        self._raised: BaseException | None = None  # the error left for a boundary
        self.warned: set[tuple[str, str]] = set()  # leaks the mid-run warning said
        self._since: dict[tuple[str, str], int] = {}  # leak -> the census it was first seen at
        self._in_file: set[tuple[str, str]] = set()  # the findings the report file has
        # The iteration from which a census would confirm a leak found but not said yet
        self.settles: int | None = None

    @property
    def raised_leak(self) -> bool:
        """Whether a LeakError was left for the loop (``on_leak="raise"``): the end does not
        raise it again."""
        return isinstance(self._raised, LeakError)

    @property
    def listening(self) -> bool:
        """Whether anything happens at a census (else the rules need not run)."""
        return (self.alarm is not None or self.on_leak != "ignore"
                or self.report_path is not None)

    def census_taken(self, report: Report) -> BaseException | None:
        """A census was taken and ``report`` judged what was recorded so far: say the leaks
        confirmed since (:func:`confirmed`); returns the error to raise at the next boundary,
        if any."""
        new = self._confirmed(report)
        self._keep_file(report)
        if not new:
            return None
        now = report.censuses[-1].iteration if report.censuses else 0
        self.said.update((finding_key(f), (now, f)) for f in new)
        found = leak_text(report, new)
        assert found is not None
        try:
            self._say(found[0], new)
        except BaseException as error:  # the callback's (or an error filter's): the loop's
            self._raised = error
        return self._raised

    def taken_back(self, report: ReportData) -> list[str]:
        """Notes for the leaks said while the run went on that the report at the end, judged
        on every census, no longer finds: a container that filled to a size and then stayed
        grows like a leak until it is full."""
        keys = {finding_key(f) for f in report.findings}
        last = report.censuses[-1].iteration if report.censuses else 0
        return [
            f"The leak said at iteration {at} ({finding.rule}: "
            f"{_subject(finding)}) did not hold to the end: judged on every holder search, the "
            f"last at iteration {last}, it is no leak, and this report has no finding for it."
            for key, (at, finding) in self.said.items() if key not in keys
        ]

    def _keep_file(self, report: Report) -> None:
        """Rewrite the report file when it lacks a finding of ``report``, or is due."""
        keys = {finding_key(f) for f in report.findings}
        if keys - self._in_file or self.rewrite_due():  # a finding the file lacks
            self._in_file = keys
            self.save(report)

    def _say(self, text: str, new: tuple[Finding, ...]) -> None:
        """Say the ``new`` leaks: through the alarm when there is one (it decides; on_leak is
        for the end), else as on_leak asks: a warning at the user's line, or a LeakError
        left for the next boundary."""
        if self.alarm is not None:
            self.alarm(text, new)
        elif self.on_leak == "warn":
            self.warned.update(finding_key(f) for f in new)
            warn_at_user_line(text)
        elif self.on_leak == "raise":
            self._raised = LeakError(text, new)

    def listener(self, build: Callable[[], Report], recorder: Recorder) -> Callable[[str], None]:
        """What the recorder calls after a census (``"census"``) and after each closed
        iteration (``"boundary"``): the rules judge the recording so far (``build()``), the
        alarm says what is new, and the report file is kept current."""

        def heard(event: str) -> None:
            if event != "census" and not self.rewrite_due():
                return
            started = time.perf_counter()
            try:
                report = build()
            except Exception:  # judging never breaks the user's loop; the end says it all
                return
            if event == "census":
                recorder.raise_at_boundary = self.census_taken(report)
                recorder.settles_at(self.settles)
            else:
                self.save(report)
                recorder.unclocked(started)

        return heard

    def _confirmed(self, report: Report) -> tuple[Finding, ...]:
        """The LEAK findings not said yet that held from a census to one taken at least
        :data:`CONFIRM` times as many iterations into the run: a list bounded at 8 entries,
        or a deque of 12, grows like a leak until it is full, and is seen full by then."""
        now = report.censuses[-1].iteration if report.censuses else 0
        leaks = [f for f in report.findings if f.severity is Severity.LEAK]
        self._forget_all_but({finding_key(f) for f in leaks})
        found, waiting = [], []
        series: HolderSeries = holder_series(report) if leaks else ([], {})  # once for all
        for finding in leaks:
            key = finding_key(finding)
            if key in self.said:
                continue
            since = held_from(series, finding, self._since.setdefault(key, max(now, 1)))
            if now >= CONFIRM * since:
                found.append(finding)
            else:
                waiting.append(CONFIRM * since)
        self.settles = min(waiting, default=None)
        return tuple(found)

    def _forget_all_but(self, keys: set[tuple[str, str]]) -> None:
        """A leak no longer judged one starts again if it comes back."""
        for key in list(self._since):
            if key not in keys:
                del self._since[key]

    def rewrite_due(self) -> bool:
        return self.report_path is not None \
            and time.monotonic() - self._written >= REWRITE_SECONDS

    def save(self, report: Report) -> None:
        """Rewrite the report file (when there is one); a failure is noted, never raised."""
        if self.report_path is None:
            return
        self._written = time.monotonic()
        try:
            write_atomically(report, self.report_path)
        except OSError as error:
            self._failed(self.report_path, error)

    def _failed(self, path: str, error: OSError) -> None:
        """Note in the report why its file could not be written; the first time, also warn
        at the user's line (a ``RuntimeWarning``), once for the whole run."""
        reason = error.strerror or str(error)
        note = f"The report could not be written to {path!r} while the run went on ({reason})."
        if note in self.errors:
            return
        if not self.errors:
            warn_at_user_line(f"memsentry: report_path {path!r} could not be written ({reason}); "
                              "it keeps the last report written whole and the run goes on; "
                              "free space there or give report_path a writable place",
                              RuntimeWarning)
        self.errors.append(note)
