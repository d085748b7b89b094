"""How ``memsentry run`` ends: as the script would have ended under python, report first.

- SIGTERM and SIGHUP, where the script's process left them at their default (they kill it
  on the spot): a handler stops tracking, writes the report and then dies of the same signal,
  its default restored, so whoever started the process sees what python would have shown.
  The handler does its work where the signal found the script, as the default would have
  killed it there: the script's ``finally`` blocks do not run, as they would not under
  python. Where the signal lands inside memsentry's own recording (a hook, a census), the
  report is made the moment that code returns; inside a write to standard output, the
  signal is delivered again a moment later. So the report is never made from half-updated
  figures or printed into a busy stream; meanwhile the script's own handlers are paused,
  and whatever ends the script then, the process dies of that signal. memsentry's timing of
  a DataLoader fetch is no recording of its own: a signal that finds the script waiting for
  a batch makes the report there, before the script can see the loader's workers, stopped
  by the same signal, gone (python would be dead by then, and say nothing). A handler the
  script installs over memsentry's is the script's business: one that calls memsentry's as
  "the previous handler" finds it does nothing, as the default it replaced could not have
  been called either.
- ``os._exit(status)`` in the script's process: the report first, then the exit. From a
  thread other than the main one, the main thread is asked to stop where it is (as for a
  SIGTERM, through memsentry's handler) and make the report; where it cannot (no handler of
  memsentry's, or no answer in :data:`ANSWER` seconds) the thread makes it.
- While the report is being made (the script ended, or a signal came): a SIGTERM, SIGHUP or
  the first Ctrl-C shortens rank 0's wait for the other ranks' reports and is kept; once the
  report is written, the process dies of it. A second Ctrl-C quits without the report. The
  script's own signal handlers are paused (torch's DataLoader raises from its SIGCHLD
  handler when a worker dies).
- A ``KeyboardInterrupt`` that ended the script: its traceback (without memsentry's frames),
  the report, then the end python gives such a program (:mod:`memsentry.cli.exits`).

A child the script forks (a DataLoader worker, or ``os.fork()``) reports nothing: one that
gets one of these signals dies of it as it would under python; one that calls ``os._exit``
exits at once.
"""

from __future__ import annotations

import enum
import os
import signal
import sys
import threading
import time
import types
from collections.abc import Callable
from typing import Any, NoReturn


def hurry(seconds: float) -> None:
    """Bring rank 0's wait for the other ranks' reports to at most ``seconds`` from now
    (torch, and so the ranks module, is imported only by ``run``, which is running)."""
    from memsentry.record.ranks import hurry as hurry_ranks

    hurry_ranks(seconds)

#: The signals that kill by default and whose report memsentry writes first.
STOPPING = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))
#: Seconds rank 0 still waits for the other ranks' reports once the job is being stopped
#: (torchrun sends SIGTERM to every rank at once, and kills them 30 seconds later).
HURRY = 10.0
#: Seconds a signal waits for the script to leave memsentry's recording code before the
#: report is made wherever the script is.
PATIENCE = 3.0
#: Seconds a thread's ``os._exit`` waits for the main thread to take up the report.
ANSWER = PATIENCE + 2.0
_RETRY = 0.01
#: memsentry's frames that hand the call on to the program's code: its timing of a
#: DataLoader fetch, which waits for the loader's workers (module, function).
_PASSING = (("memsentry.record.batches", "_next_data"),)


class Phase(enum.Enum):
    READY = "ready"
    RUNNING = "running"  # the script runs
    FINISHING = "finishing"  # the report is being made
    DONE = "done"


class Stopped(BaseException):
    """The script was stopped by ``signum`` (what ``Tracker.stop(error=...)`` is told)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal_name(signum)}")
        self.signum = signum


class Exited(BaseException):
    """The script called ``os._exit(status)``."""

    def __init__(self, status: int) -> None:
        super().__init__(f"os._exit({status})")
        self.status = status


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def flush_streams() -> None:
    """Flush standard output and error (best effort: closed, or a broken pipe)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # nothing more to save
            pass


def die_of(signum: int, *, flush: bool = True) -> NoReturn:
    """End this process by ``signum`` at its default disposition (what its parent then sees
    is what python's own death by it shows); 128 + ``signum`` where it cannot."""
    if flush:
        flush_streams()
    try:
        signal.signal(signum, signal.SIG_DFL)
        if hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
    except (ValueError, OSError):  # not the main thread: kill() reaches the process anyway
        pass
    os.kill(os.getpid(), signum)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:  # delivery is asynchronous where another thread takes it
        time.sleep(0.01)
    os._exit(128 + signum)


def _recording(frame: types.FrameType | None) -> types.FrameType | None:
    """The outermost frame of memsentry's recording code (not the command's) that ``frame``
    is in; ``None`` where the program's own code runs, also inside memsentry's timing of a
    DataLoader fetch (:data:`_PASSING`)."""
    found = None
    innermost = frame
    while frame is not None:
        name = frame.f_globals.get("__name__")
        if isinstance(name, str) and name.split(".")[0] == "memsentry" \
                and name.split(".")[:2] != ["memsentry", "cli"]:
            if found is None and frame is not innermost \
                    and (name, frame.f_code.co_name) in _PASSING:
                return None
            found = frame
        frame = frame.f_back
    return found


def _streams_free() -> bool:
    """False where the signal interrupted a write to standard output or error (printing now
    would fail as a reentrant call)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except RuntimeError:
            return False
        except Exception:  # closed or broken: printing fails anyway, and is caught
            pass
    return True


class Endings:
    """Installed around the script's run in ``memsentry run``'s process; ``report(ending)``
    stops tracking and writes the report when a signal or ``os._exit`` ends the run where
    the script is (the process then ends as the ending says)."""

    def __init__(self, report: Callable[[BaseException], object]) -> None:
        self._report = report
        self.pid = os.getpid()
        self.phase = Phase.READY
        #: A signal that came while the report was being made: the process dies of it after.
        self.pending: int | None = None
        #: The status a thread other than the main one called ``os._exit`` with: the process
        #: exits with it once the report is written.
        self.exiting: int | None = None
        self._installed: dict[int, Any] = {}
        self._real_exit = os._exit
        self._since: float | None = None
        self._interrupts = 0
        self._lock = threading.Lock()  # the phase's moves out of RUNNING
        self._over = threading.Event()  # the report is written
        self._watching: object = None  # the profile function :meth:`_watch` set last

    @property
    def in_child(self) -> bool:
        """Whether this process is a child the script forked (its parent reports)."""
        return os.getpid() != self.pid

    # -- around the run ------------------------------------------------------------------
    def start(self) -> None:
        """The script is about to run."""
        if threading.current_thread() is threading.main_thread():
            for signum in STOPPING:
                if signal.getsignal(signum) is signal.SIG_DFL:
                    self._install(signum, self._on_stop)
        os._exit = self._exit
        self.phase = Phase.RUNNING

    def finishing(self) -> bool:
        """The report is to be made here: signals wait for it (the first Ctrl-C too), and the
        script's own handlers are paused (torch's DataLoader raises from its SIGCHLD handler
        when a worker dies, as one does when a whole process group is stopped). False where
        the script is not running (another thread makes the report)."""
        with self._lock:
            if self.phase is not Phase.RUNNING:
                return False
            self.phase = Phase.FINISHING
        if sys.getprofile() is self._watching is not None:
            sys.setprofile(None)
        self._pause()
        return True

    def _pause(self) -> None:
        """Pause the script's own signal handlers: the process is to end now."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in signal.valid_signals():
            try:
                current = signal.getsignal(signum)
            except (ValueError, OSError):
                continue
            if callable(current) and not self._is_ours(current):
                self._install(signum, self._on_interrupt if signum == signal.SIGINT
                              else self._on_other)

    def end(self) -> int | None:
        """The report is written: put back what was there before (where the script did not
        put its own since); the signal that came meanwhile, which the process dies of."""
        with self._lock:
            self.phase = Phase.DONE
        if os._exit == self._exit:
            os._exit = self._real_exit
        for signum, previous in self._installed.items():
            if self._ours(signum):
                signal.signal(signum, previous)
        self._installed.clear()
        self._over.set()
        return self.pending

    def exit_if_asked(self) -> None:
        """Exit with the status a thread's ``os._exit`` asked for, if one did."""
        if self.exiting is not None and not self.in_child:
            flush_streams()
            self._real_exit(self.exiting)

    def hold(self) -> None:
        """Wait while another thread makes the report (it then ends the process)."""
        self._over.wait()

    def _install(self, signum: int, handler: Callable[[int, types.FrameType | None], None]
                 ) -> None:
        self._installed.setdefault(signum, signal.getsignal(signum))
        signal.signal(signum, handler)

    def _ours(self, signum: int) -> bool:
        return self._is_ours(signal.getsignal(signum))

    def _is_ours(self, handler: object) -> bool:
        return handler in (self._on_stop, self._on_interrupt, self._on_other)

    # -- the handlers ----------------------------------------------------------------------
    def _on_stop(self, signum: int, frame: types.FrameType | None) -> None:
        if self.in_child:  # a forked child: dies as python's default has it
            die_of(signum, flush=False)
        if not _called_by_python(frame):
            return  # a handler of the script calls its predecessor: SIG_DFL was no function
        if self.phase is Phase.FINISHING:
            if self.exiting is None:  # else a thread's os._exit asked: the report is coming
                self._keep(signum)
            return
        if self.phase is not Phase.RUNNING:
            die_of(signum)
        if not self._too_soon(frame, signum):
            self._act(signum)

    def _act(self, signum: int) -> NoReturn:
        """Stop the script where it is: the report, then the end (the exit a thread's
        ``os._exit`` asked for, else death by ``signum``)."""
        status = self.exiting
        if status is None:
            hurry(HURRY)
        if not self.finishing():
            self.hold()  # a thread's os._exit makes the report, then exits
        try:
            self._report(Stopped(signum) if status is None else Exited(status))
        finally:
            if status is None:
                die_of(signum)
            flush_streams()
            self._real_exit(status)

    def _on_interrupt(self, signum: int, frame: types.FrameType | None) -> None:
        if self.in_child:
            die_of(signum, flush=False)
        if not _called_by_python(frame):
            return
        self._interrupts += 1
        if self._interrupts > 1:
            die_of(signum)
        self._keep(signum)
        print("memsentry: writing the report; press Ctrl-C again to quit without it",
              file=sys.stderr, flush=True)

    def _on_other(self, signum: int, frame: types.FrameType | None) -> None:
        """A signal the script handles itself, while the report is being made: left alone
        (the script has ended); one that stops the job still shortens rank 0's wait."""
        if signum in STOPPING:
            hurry(HURRY)

    def _keep(self, signum: int) -> None:
        if self.pending is None:
            self.pending = signum
        hurry(HURRY)

    def _too_soon(self, frame: types.FrameType | None, signum: int) -> bool:
        """Whether to let the script leave memsentry's recording code, or finish a write to
        standard output, first (for :data:`PATIENCE` seconds at most); the script's own
        handlers are paused meanwhile."""
        if self._since is None:
            self._since = time.monotonic()
        if time.monotonic() - self._since > PATIENCE or not hasattr(signal, "pthread_kill"):
            return False
        recording = _recording(frame)
        if recording is None and _streams_free():
            return False
        if self.exiting is None:  # it dies of it, whatever ends the script meanwhile
            self.pending = signum if self.pending is None else self.pending
        self._pause()
        self._again(signum)
        if recording is not None:
            self._watch(recording, signum)
        return True

    def _again(self, signum: int) -> None:
        """Deliver ``signum`` to the main thread again in a moment."""
        main = threading.main_thread().ident

        def deliver() -> None:
            if main is not None and self._ours(signum) and self.phase is Phase.RUNNING:
                signal.pthread_kill(main, signum)

        timer = threading.Timer(_RETRY, deliver)
        timer.daemon = True
        timer.start()

    def _watch(self, recording: types.FrameType, signum: int) -> None:
        """Stop the script the moment ``recording`` returns, through a profile function of
        the main thread (where the script has one of its own, the signal delivered again
        does it)."""
        if sys.getprofile() not in (None, self._watching):
            return

        def watch(frame: types.FrameType, event: str, _arg: object) -> None:
            if self.phase is not Phase.RUNNING:
                sys.setprofile(None)
            elif event == "return" and frame is recording:
                sys.setprofile(None)
                self._act(signum)

        self._watching = watch
        sys.setprofile(watch)

    # -- os._exit ------------------------------------------------------------------------
    def _exit(self, status: int) -> NoReturn:
        """``os._exit`` while the script runs: the report, then the exit."""
        if self.in_child or self.phase is Phase.DONE:
            self._real_exit(status)
        if threading.current_thread() is not threading.main_thread():
            self._exit_from_thread(status)
        elif self.finishing():
            self._report_exit(status)
        self._real_exit(status)

    def _report_exit(self, status: int) -> None:
        try:
            self._report(Exited(status))
        finally:
            flush_streams()  # python's os._exit flushes nothing: best effort

    def _exit_from_thread(self, status: int) -> None:
        """``os._exit`` from a thread other than the main one: the main thread, asked through
        memsentry's handler, makes the report where the script is and exits with ``status``;
        this thread makes it where the main one does not take it up in :data:`ANSWER`
        seconds. Returns once the process is to exit."""
        with self._lock:
            first = self.exiting is None and self.phase is not Phase.DONE
            if first:
                self.exiting = status
            asked = first and self.phase is Phase.RUNNING and _ask_main(self._ours)
        if asked:
            deadline = time.monotonic() + ANSWER
            while self.phase is Phase.RUNNING and time.monotonic() < deadline:
                time.sleep(_RETRY)
        if first and self.finishing():
            self._report_exit(status)
        else:
            self.hold()  # the main thread makes the report: the process exits after it


def _ask_main(ours: Callable[[int], bool]) -> bool:
    """Deliver to the main thread a stopping signal that memsentry handles (``ours``); False
    where there is none."""
    main = threading.main_thread().ident
    if main is None or not hasattr(signal, "pthread_kill"):
        return False
    for signum in STOPPING:
        if ours(signum):
            signal.pthread_kill(main, signum)
            return True
    return False


def _called_by_python(frame: types.FrameType | None) -> bool:
    """Whether the handler calling this was called by python for a signal, not by another
    handler (python calls it from the frame the signal interrupted)."""
    try:
        return sys._getframe(2) is frame
    except ValueError:
        return frame is None


__all__ = ["ANSWER", "HURRY", "STOPPING", "Endings", "Exited", "Phase", "Stopped", "die_of",
           "flush_streams", "signal_name"]
