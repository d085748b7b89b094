"""One tracked training run driven by a framework's callbacks: what the Lightning and Hugging
Face adapters share.

A :class:`TrainingSession` checks its options when the callback is made (before training
starts), starts a :class:`~memsentry.Tracker` on the model the framework runs, takes a report
at the end of each epoch when asked, and at the end saves the report, hands back the scalars
the framework's loggers take, and only then warns or raises about leaks: a report is never
lost to a :class:`~memsentry.LeakError`.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any, cast

from torch import nn

from memsentry.alarm import leak_text, warn_at_user_line
from memsentry.errors import LeakError, LeakWarning, MemsentryError
from memsentry.model import Finding, Severity, growth_per_iteration
from memsentry.paths import unwritable
from memsentry.record import OnLeak
from memsentry.report import Report
from memsentry.reporters import write_report
from memsentry.rules.series import WARMUP
from memsentry.settings import ON_LEAK, SETTINGS, WATCH_OVERHEAD
from memsentry.tracker import Tracker
from memsentry.usercode.frames import is_machinery_frame

#: Keyword arguments of ``track()`` a callback passes on; the rest it sets itself.
TRACK_OPTIONS = frozenset(setting.name for setting in SETTINGS if setting.framework)
#: The scalars logged through the framework's loggers, by name.
SCALARS = ("memsentry/peak_bytes", "memsentry/growth_bytes_per_iter", "memsentry/findings",
           "memsentry/leaks")


def epoch_path(path: str, epoch: int) -> str:
    """``report.json`` -> ``report.epoch3.json``: where epoch ``epoch``'s report goes."""
    stem, suffix = os.path.splitext(path)
    return f"{stem}.epoch{epoch}{suffix}"


def save_report(report: Report, path: str) -> None:
    """Write ``report`` to ``path`` as its suffix says: ``.json``, ``.html`` or text."""
    write_report(report, path)


def scalars(report: Report) -> dict[str, float]:
    """The report's headline as the numbers a logger takes: the peak (bytes), the growth of
    allocated memory per iteration after warm-up (bytes; 0 with too few iterations), the
    findings and the leaks among them."""
    growth = growth_per_iteration(report.iterations, warmup=WARMUP)
    leaks = sum(1 for f in report.findings if f.severity is Severity.LEAK)
    return dict(zip(SCALARS, (float(report.peak or 0), float(growth or 0.0),
                              float(len(report.findings)), float(leaks)), strict=True))


def _user_stacklevel() -> int:
    """The ``stacklevel`` of the innermost frame of the user's code above the caller of
    ``warnings.warn`` (the framework's and memsentry's frames are skipped)."""
    frame, level = sys._getframe(2), 2  # 1: signal_leaks's frame, which calls warn
    while frame.f_back is not None and is_machinery_frame(frame):
        frame, level = frame.f_back, level + 1
    return level


class TrainingSession:
    """A run tracked from a framework's start-of-training hook to its end-of-training hook."""

    def __init__(self, *, on_leak: object, report_path: object, per_epoch: object,
                 print_report: object, options: dict[str, Any], who: str,
                 say: Callable[[str], None] | None = None) -> None:
        self.who = who
        self.say = say  # the framework's logger: a leak established while training runs
        if on_leak not in ON_LEAK:
            raise ValueError(f"{who}(on_leak={on_leak!r}): use one of "
                             f"{', '.join(map(repr, ON_LEAK))}")
        self.on_leak = cast(OnLeak, on_leak)
        unknown = sorted(set(options) - TRACK_OPTIONS)
        if unknown:
            raise TypeError(f"{who}() got unknown option(s) {', '.join(unknown)}; it takes "
                            f"on_leak, report_path, per_epoch, print_report and these of "
                            f"memsentry.track(): {', '.join(sorted(TRACK_OPTIONS))}")
        Tracker(**options)  # checks the options now, not after the first epoch
        self.options = options
        self.report_path = self._checked_path(report_path)
        self.per_epoch = bool(per_epoch)
        self.print_report = bool(print_report)
        self.tracker: Tracker | None = None
        self.report: Report | None = None
        self.epoch_reports: list[Report] = []

    def _checked_path(self, path: object) -> str | None:
        if path is None:
            return None
        if not isinstance(path, str | os.PathLike):
            raise TypeError(f"{self.who}(report_path=...) is the file the report is saved to "
                            f"(.json, .html or text), a str or os.PathLike; got {path!r}")
        text = os.fspath(path)
        assert isinstance(text, str)
        problem = unwritable(text)
        if problem is not None:
            raise ValueError(f"{self.who}(report_path={text!r}): {problem}")
        return text

    @property
    def active(self) -> bool:
        return self.tracker is not None and self.tracker.active

    def start(self, model: nn.Module | None, names: Sequence[tuple[str, object, str]]) -> None:
        """Track ``model`` (its attributes, and the ``names`` objects', named as their own
        methods spell them); a session already running goes on."""
        if self.active:
            return
        self.report = None
        self.epoch_reports = []
        live = self.report_path if self.report_path is not None \
            and self.report_path.lower().endswith(".json") else None
        options = dict(self.options)
        if options.get("watch"):  # the always-on mode: 1% of the loop unless told
            options.setdefault("overhead", WATCH_OVERHEAD)
        self.tracker = Tracker(model, on_leak="ignore", names=names, alarm=self._alarm,
                               report_path=live, **options)
        self.tracker.start()

    def _alarm(self, text: str, leaks: tuple[Finding, ...]) -> None:
        """A leak established while training runs: said on the framework's logger (or as a
        warning at the user's line); with ``on_leak="raise"``, raised in the training loop at
        its next optimizer step, which ends ``fit``/``train`` with the report saved."""
        if self.on_leak == "ignore":
            return
        if self.say is not None:
            for line in text.splitlines()[1:]:
                self.say(f"memsentry: LEAK {line.strip()}")
        elif self.on_leak == "warn":
            warn_at_user_line(text)
        if self.on_leak == "raise":
            raise LeakError(text, leaks)

    def census(self) -> None:
        """A census now (an epoch's end, after evaluation): a holder that grows only at epoch
        ends is seen growing in short runs, not only once the doubling schedule reaches it."""
        if self.tracker is not None and self.tracker.active:
            self.tracker.census()

    def epoch_end(self, epoch: int, *, census: bool = True) -> Report | None:
        """The end of an epoch: a census (with ``census``); with ``per_epoch``, the report
        so far, saved beside the final one, else ``None``."""
        if census:
            self.census()
        if not self.per_epoch or not self.active:
            return None
        assert self.tracker is not None
        report = self.tracker.report()
        self.epoch_reports.append(report)
        if self.report_path is not None and report.rank in (None, 0):
            self._save(report, epoch_path(self.report_path, epoch))
        return report

    def finish(self, error: BaseException | None = None) -> Report | None:
        """Stop tracking and save the report (rank 0's combines every rank's); ``None`` when
        nothing was tracked. Leaks are signalled by :meth:`signal_leaks`, after the caller
        has logged the report."""
        if self.tracker is None or not self.tracker.active:
            return self.report
        if error is None:
            self.census()  # what the last epochs' evaluations kept, before the report
        self.report = self.tracker.stop(error)
        self.tracker = None
        if self.report_path is not None and self.report.rank in (None, 0):
            self._save(self.report, self.report_path)
        return self.report

    def _save(self, report: Report, path: str) -> None:
        """Save, and where that fails after all, say so without ending the user's run."""
        try:
            save_report(report, path)
        except (OSError, MemsentryError) as error:
            reason = error.strerror if isinstance(error, OSError) else str(error)
            warnings.warn(f"{self.who}: the memsentry report could not be written to {path!r} "
                          f"({reason}); it is still in the callback's `report`",
                          RuntimeWarning, stacklevel=4)

    def signal_leaks(self, report: Report) -> None:
        """Warn or raise about the report's leaks as ``on_leak`` says (rank 0 only); a
        warning points at the user's line that started training (``trainer.fit(...)``)."""
        if self.on_leak == "ignore" or report.rank not in (None, 0):
            return
        found = leak_text(report)
        if found is None:
            return
        text, leaks = found
        if self.on_leak == "raise":
            raise LeakError(text, leaks)
        warnings.warn(LeakWarning(text), stacklevel=_user_stacklevel())


__all__ = ["SCALARS", "TRACK_OPTIONS", "TrainingSession", "epoch_path", "save_report",
           "scalars"]
