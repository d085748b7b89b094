"""``memsentry.track()``: record memory around every layer and iteration, as a ``with`` block
or between :meth:`Tracker.start` and :meth:`Tracker.stop` (framework callbacks).

The public face of the pipeline: a :class:`~memsentry.record.Recorder` records, the rules
(:func:`~memsentry.rules.analyse`) judge, and the result is a frozen :class:`~memsentry.Report`.
"""

from __future__ import annotations

import enum
import json
import os
import sys
import textwrap
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import replace
from types import TracebackType
from typing import Any

import torch
from torch import nn

from memsentry.alarm import Alarm, LiveAlarm, finding_key, leak_text
from memsentry.errors import LeakError, LeakWarning, TrackerStateError
from memsentry.model import ReportData, Severity
from memsentry.paths import unwritable
from memsentry.record import OnLeak, Options, Recorder
from memsentry.record.ranks import RankInfo, begin_block, gather_limit, rank_info, share
from memsentry.record.snapshot import SnapshotRecording, with_snapshot_options, write_snapshot
from memsentry.report import Report
from memsentry.reporters.oom import oom_note
from memsentry.rules import analysed, remarks
from memsentry.rules.oom import explain_oom
from memsentry.rules.ranks import combine
from memsentry.settings import BY_NAME, OVERHEAD, SNAPSHOT_ENTRIES, WATCH_OVERHEAD, docstring


class _State(enum.Enum):
    NEW = "new"
    ACTIVE = "active"
    STOPPED = "stopped"


def checked_names(names: object) -> list[tuple[str, object, str]]:
    """``track(names=...)`` as given, or an error saying what it takes."""
    if isinstance(names, str | bytes) or not isinstance(names, Sequence | tuple | list):
        raise TypeError(f"track(names=...) takes a sequence of (name, object, role) tuples, "
                        f"e.g. [('self', module, 'LightningModule')]; got {names!r}")
    checked = []
    for entry in names:
        if not (isinstance(entry, tuple) and len(entry) == 3 and isinstance(entry[0], str)
                and entry[0].isidentifier() and isinstance(entry[2], str)):
            raise TypeError(f"track(names=...): each entry is (name, object, role), the name "
                            f"a Python identifier such as 'self'; got {entry!r}")
        try:
            weakref.ref(entry[1])
        except TypeError:
            raise TypeError(f"track(names=...): {type(entry[1]).__name__} objects cannot be "
                            "held weakly, and memsentry never keeps what it watches alive; "
                            "leave this one out") from None
        checked.append(entry)
    return checked


def gathered(own: Report, rank: RankInfo, timeout: float) -> Report | None:
    """Rank 0's combined report once every rank handed its own in (``None`` on the other
    ranks, or where the store broke or a payload was bad: each rank keeps its own)."""
    try:
        found = share(rank, own.to_json(indent=0), timeout)
        if found is None:
            return None
        reports = [own, *(None if text is None else ReportData.from_dict(json.loads(text))
                          for text in found[1:])]
        return Report.from_data(combine(reports, gather_limit(timeout)))
    except Exception:
        return None


def with_oom_note(report: Report, error: BaseException) -> None:
    """An out-of-memory error leaving the block gets memsentry's verdict as a note; its
    type, message and traceback stay as they were."""
    add_note = getattr(error, "add_note", None)  # Python 3.11 and newer
    try:
        if report.oom is not None and add_note is not None:
            add_note(oom_note(report.oom))
    except Exception:
        pass


def saved_snapshot(snapshot: SnapshotRecording, path: str | os.PathLike[str], *,
                   started: bool) -> str:
    """``Tracker.snapshot(path)``: the snapshot written, or an error saying why not."""
    if not snapshot.enabled:
        raise TrackerStateError(
            "Tracker.snapshot() needs the allocation history, which this tracker does not "
            "record; create it with memsentry.track(..., snapshot=True) (or snapshot=path)"
        )
    if not started:
        raise TrackerStateError("Tracker.snapshot() was called before start(); the "
                                "history is recorded between start() and stop()")
    problem = unwritable(path)
    if problem is not None:
        raise ValueError(f"Tracker.snapshot({os.fspath(path)!r}): {problem}")
    data = snapshot.data()
    if data is None:
        why = " ".join(snapshot.notes) or "nothing was recorded."
        raise TrackerStateError(f"Tracker.snapshot(): no snapshot to write: {why}")
    return write_snapshot(data, path)


def checked_alarm(alarm: object) -> Alarm | None:
    """``track(alarm=...)`` as given, or an error saying what it takes."""
    checked: Alarm | None = BY_NAME["alarm"].check(alarm)
    return checked


def checked_report_path(path: object) -> str | None:
    """``track(report_path=...)`` as a str, or an error saying what it takes."""
    checked: str | None = BY_NAME["report_path"].check(path)
    return checked


def _outside(method: str) -> TrackerStateError:
    return TrackerStateError(
        f"Tracker.{method}() was called outside its with-block (or before start() or after "
        "stop()); call it inside `with memsentry.track(...) as t:`"
    )


class Tracker:
    """Track memory per layer and per iteration (``memsentry.track``).

    Use it as a context manager (``with memsentry.track(model) as t:``) or call
    :meth:`start` and :meth:`stop` (from a framework's callbacks); both remove every hook at
    the end and keep nothing alive.

    ``model``: hook this module and its submodules; ``None`` hooks every module called. The
    options follow (from :data:`memsentry.settings.SETTINGS`, where each is spelled once).
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        *,
        device: torch.device | str | int | None = None,
        exact: bool = False,
        saved_tensors: bool = True,
        backward: bool = True,
        max_iterations: int = 10_000,
        on_leak: OnLeak = "warn",
        holders: bool = True,
        holder_budget: float = 0.5,
        overhead: float | None = OVERHEAD,
        gather_timeout: float = 60.0,
        snapshot: bool | str | os.PathLike[str] = False,
        snapshot_entries: int = SNAPSHOT_ENTRIES,
        names: Sequence[tuple[str, object, str]] = (),
        alarm: Alarm | None = None,
        report_path: str | os.PathLike[str] | None = None,
        watch: bool = False,
    ) -> None:
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(
                "track() takes a torch.nn.Module (or nothing, to hook every module), got "
                f"{type(model).__name__}; pass the model itself, e.g. track(model)"
            )
        checked = Options.checked(
            device=device, exact=exact, saved_tensors=saved_tensors, backward=backward,
            max_iterations=max_iterations, on_leak=on_leak, holders=holders,
            holder_budget=holder_budget, overhead=overhead, gather_timeout=gather_timeout,
            snapshot=snapshot, snapshot_entries=snapshot_entries, watch=watch,
        )  # each checked as memsentry.settings.SETTINGS says
        self._options = with_snapshot_options(checked, model)
        self._snapshot = SnapshotRecording(self._options,
                                           exact_implied=self._options.exact != checked.exact)
        self._recorder = Recorder(model, self._options, checked_names(names))
        self._live = LiveAlarm(self._options.on_leak, checked_alarm(alarm),
                               checked_report_path(report_path))
        if self._live.listening:
            self._recorder.listener = self._live.listener(self.own_report, self._recorder)
        self._own: Report | None = None  # the report, once tracking ended
        self._state = _State.NEW
        self._rank: RankInfo | None = None
        self._combined: Report | None = None  # rank 0's, once every rank handed its in

    # -- lifecycle -----------------------------------------------------------------------
    def _with_policy(self, **given: Any) -> Tracker:
        """Before it starts, this tracker on another clock, tuning or judging credit
        (:meth:`memsentry.record.Recorder.with_policy`): the seam tests give fixed facts
        through. Returns the tracker."""
        if self._state is not _State.NEW:
            raise TrackerStateError("a tracker's policy is set before it starts")
        listener = self._recorder.listener
        self._recorder = self._recorder.with_policy(**given)
        if listener is not None:
            self._recorder.listener = self._live.listener(self.own_report, self._recorder)
        return self

    def start(self) -> Tracker:
        """Begin tracking (what ``with`` does on entry); returns the tracker. A tracker tracks
        once: create a new one for each run."""
        if self._state is not _State.NEW:
            raise TrackerStateError(
                "this tracker was already used; create a new one with memsentry.track() "
                "for each run (each with-block, or each start()/stop() pair)"
            )
        self._state = _State.ACTIVE
        begin_block()  # in a process group: tells rank 0 this rank tracks, once it can
        try:
            self._recorder.start()
        except BaseException:
            self._state = _State.STOPPED
            raise
        self._snapshot.start(self._recorder)
        return self

    def stop(self, error: BaseException | None = None) -> Report:
        """End tracking: close the partial iteration, remove every hook, forget the model,
        then act on leaks as ``on_leak`` says. Returns the final report. Calling it again
        returns the same report and does nothing else.

        ``error`` is the exception that ended the run (a framework's ``on_exception``); by
        default, the one being handled when ``stop()`` is called from an ``except`` block.
        An out-of-memory error is explained in ``report.oom`` and gets memsentry's note."""
        if self._state is _State.NEW:
            raise TrackerStateError(
                "Tracker.stop() was called before start(); call start() first, or use "
                "`with memsentry.track(...) as t:`"
            )
        if self._state is _State.ACTIVE:
            self._end(error if error is not None else sys.exc_info()[1])
        return self.report()

    def silence(self) -> None:
        """From now on say no leak while the run goes on and keep no report file current:
        ``memsentry run`` asks it in a child the script forks (its parent says and writes)."""
        self._live.alarm = None
        self._live.report_path = None

    def __enter__(self) -> Tracker:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._state is _State.ACTIVE:
            self._end(exc)

    def _end(self, error: BaseException | None) -> None:
        if error is not None:
            try:
                self._recorder.failed(error)
            except Exception:  # never replace the user's error with memsentry's
                pass
        self._finish(error)
        if error is not None:
            with_oom_note(self.report(), error)

    def _finish(self, error: BaseException | None) -> None:
        self._state = _State.STOPPED
        self._recorder.stop()
        self._snapshot.end(self._recorder.device)
        self._gather()
        self._live.save(self.own_report())  # this rank's file, as the run ended
        unraised, self._recorder.raise_at_boundary = self._recorder.raise_at_boundary, None
        in_loop = self._live.raised_leak and unraised is None  # raised there: not again
        if self._options.on_leak != "ignore" and not in_loop:
            self._signal_leaks(raising=error is not None)

    def _gather(self) -> None:
        """In a process group: hand this rank's report to rank 0, which combines them (no
        collective: see :mod:`memsentry.record.ranks`). Never fails the user's run."""
        self._rank = rank_info() or self._rank
        if self._rank is not None and self._rank.world_size >= 2:
            self._combined = gathered(self.own_report(), self._rank,
                                      self._options.gather_timeout)

    def _signal_leaks(self, *, raising: bool) -> None:
        report = self.report()
        unsaid = tuple(f for f in report.findings if f.severity is Severity.LEAK
                       and finding_key(f) not in self._live.warned)  # warned of mid-run
        found = leak_text(report, unsaid)
        if found is None:
            return
        text, leaks = found
        if self._options.on_leak == "raise" and not raising:
            raise LeakError(text, leaks)
        if self._rank is not None and self._rank.rank != 0 and self._rank.world_size > 1:
            return  # warnings come from rank 0, whose report has every rank's findings
        warnings.warn(LeakWarning(text), stacklevel=5)  # the user's with-block or stop()

    def step(self) -> None:
        """Mark the end of an iteration (for loops without an optimizer, or to choose the point).

        After the first call, optimizer steps no longer mark iterations.
        """
        if self._state is not _State.ACTIVE:
            raise _outside("step")
        self._recorder.step()

    def census(self) -> None:
        """Search for who holds tensors now, besides the censuses of iterations 2, 3, 4, 6,
        10, 18, ...: at an epoch's end, after evaluation, a holder that grows only there
        (outputs an evaluation loop keeps) is seen growing before the schedule gets there.
        Does nothing during warm-up or when a census of the last iteration exists."""
        if self._state is not _State.ACTIVE:
            raise _outside("census")
        self._recorder.census()

    # -- results -------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """True between start and stop (inside the with-block)."""
        return self._state is _State.ACTIVE

    @property
    def device(self) -> torch.device | None:
        """The device measured (``None`` until the first module call picks it)."""
        return self._recorder.device

    def snapshot(self, path: str | os.PathLike[str]) -> str:
        """Write the memory_viz snapshot (a pickle of ``torch.cuda.memory._snapshot()``'s
        format; open it at https://pytorch.org/memory_viz) to ``path`` and return the path:
        the one frozen when tracking ended, or, while tracking, as it stands now. Needs
        ``track(snapshot=...)``."""
        return saved_snapshot(self._snapshot, path, started=self._state is not _State.NEW)

    def report(self) -> Report:
        """A frozen :class:`~memsentry.Report` of what was recorded so far (also mid-run), with
        the rules' findings; on rank 0 of a process group, once tracking ended, every rank's
        combined."""
        return self._combined if self._combined is not None else self.own_report()

    def own_report(self) -> Report:
        """This rank's own report, also on rank 0 of a process group (where :meth:`report`
        combines every rank's). Built once when tracking ended, then the same."""
        if self._own is not None:
            return self._own
        recording: ReportData = self._recorder.recording()
        report = Report.from_data(recording)
        if self._rank is None and self._state is _State.ACTIVE:
            self._rank = rank_info()
        where = self._rank
        findings, stopped = analysed(report)
        taken_back = self._live.taken_back(replace(report, findings=findings))
        notes = (*self._snapshot.notes, *self._live.errors, *remarks(report, findings),
                 *stopped, *taken_back)
        if notes:
            report = replace(report, notes=(*report.notes, *notes))
        report = replace(report, findings=findings, oom=explain_oom(report),
                         rank=where.rank if where else None,
                         world_size=where.world_size if where else None,
                         host=where.host if where else None)
        if self._state is _State.STOPPED:
            self._own = report
        return report


Tracker.__doc__ = f"{Tracker.__doc__}\n{textwrap.indent(docstring(), '    ')}\n"

#: ``memsentry.track(model)`` builds a :class:`Tracker`; the two names are one.
track = Tracker

def watch(model: nn.Module | None = None, **options: Any) -> Tracker:
    """The always-on mode for long training: a :class:`Tracker` (use it as ``track()``'s)
    with ``watch=True`` and ``overhead=0.01`` unless given. It reads the counters at iteration
    boundaries, measures layers only in the iterations its 1% budget can pay for, and takes a
    census when the memory left at boundaries climbs (besides the doubling schedule, as its
    budget allows); a leak is said once a census confirms it (``on_leak``, ``alarm``), and
    ``report_path`` keeps the latest report on disk while the run goes on."""
    options.setdefault("overhead", WATCH_OVERHEAD)
    return Tracker(model, watch=True, **options)
