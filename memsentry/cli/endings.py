"""How ``memsentry run`` ends: as the script would have ended under python, report first.

- SIGTERM and SIGHUP, where the script's process left them at their default (they kill it
  on the spot): a handler stops tracking, writes the report and then dies of the same signal,
  its default restored, so whoever started the process sees what python would have shown.
  The handler does its work where the signal found the script, as the default would have
  killed it there: the script's ``finally`` blocks do not run, as they would not under
  python. Where the signal lands inside memsentry's own recording (a hook, a census) or
  inside a write to standard output, the signal is delivered again a moment later, so the
  report is never made from half-updated figures or printed into a busy stream; meanwhile
  the script's own handlers are paused, and whatever ends the script then, the process
  dies of that signal. A handler the script installs over memsentry's is the script's
  business: one that calls memsentry's as "the previous handler" finds it does nothing, as
  the default it replaced could not have been called either.
- ``os._exit(status)`` in the script's process: the report first, then the exit.
- While the report is being made (the script ended, or a signal came): a SIGTERM, SIGHUP or
  the first Ctrl-C shortens rank 0's wait for the other ranks' reports and is kept; once the
  report is written, the process dies of it. A second Ctrl-C quits without the report. The
  script's own signal handlers are paused (torch's DataLoader raises from its SIGCHLD
  handler when a worker dies).
- A ``KeyboardInterrupt`` that ended the script: its traceback (without memsentry's frames),
  the report, then the end python gives such a program (:func:`die_interrupted`): threads
  joined, ``atexit`` functions run, death by SIGINT.

A forked child (a DataLoader worker) that gets one of these signals dies of it as it would
under python, without a report.
"""

from __future__ import annotations

import atexit
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
_RETRY = 0.01


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


def die_of(signum: int, *, flush: bool = True) -> NoReturn:
    """End this process by ``signum`` at its default disposition (what its parent then sees
    is what python's own death by it shows); 128 + ``signum`` where it cannot."""
    if flush:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # closed, or a broken pipe: nothing more to save
                pass
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


def die_interrupted() -> NoReturn:
    """End as python ends a program that an uncaught ``KeyboardInterrupt`` stopped (what it
    does since 3.8, so that a shell knows of the Ctrl-C): wait for the threads that are not
    daemons, run the ``atexit`` functions, then die of SIGINT. memsentry does it itself: with
    torch's compiler imported, a module that its ``atexit`` function imports late resets
    python's note of the interrupt, and python then exits with status 1."""
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    die_of(signal.SIGINT)


def end_by(signum: int) -> NoReturn:
    """Die of ``signum`` as python's process would have: SIGINT after python's exit, the
    others on the spot."""
    if signum == signal.SIGINT:
        die_interrupted()
    die_of(signum)


def _in_recording(frame: types.FrameType | None) -> bool:
    """Whether ``frame`` or a caller of it is memsentry's recording code (not the command's)."""
    while frame is not None:
        name = frame.f_globals.get("__name__")
        if isinstance(name, str) and name.split(".")[0] == "memsentry" \
                and name.split(".")[:2] != ["memsentry", "cli"]:
            return True
        frame = frame.f_back
    return False


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
        self._installed: dict[int, Any] = {}
        self._real_exit = os._exit
        self._since: float | None = None
        self._interrupts = 0

    # -- around the run ------------------------------------------------------------------
    def start(self) -> None:
        """The script is about to run."""
        if threading.current_thread() is threading.main_thread():
            for signum in STOPPING:
                if signal.getsignal(signum) is signal.SIG_DFL:
                    self._install(signum, self._on_stop)
        os._exit = self._exit
        self.phase = Phase.RUNNING

    def finishing(self) -> None:
        """The report is being made: signals wait for it (the first Ctrl-C too), and the
        script's own handlers are paused (torch's DataLoader raises from its SIGCHLD
        handler when a worker dies, as one does when a whole process group is stopped)."""
        self.phase = Phase.FINISHING
        self._pause()

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
        self.phase = Phase.DONE
        if os._exit == self._exit:
            os._exit = self._real_exit
        for signum, previous in self._installed.items():
            if self._ours(signum):
                signal.signal(signum, previous)
        self._installed.clear()
        return self.pending

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
        if os.getpid() != self.pid:  # a forked child: dies as python's default has it
            die_of(signum, flush=False)
        if not _called_by_python(frame):
            return  # a handler of the script calls its predecessor: SIG_DFL was no function
        if self.phase is Phase.FINISHING:
            self._keep(signum)
            return
        if self.phase is not Phase.RUNNING:
            die_of(signum)
        if self._too_soon(frame):  # it dies of it, whatever ends the script meanwhile
            self.pending = signum if self.pending is None else self.pending
            self._pause()
            self._again(signum)
            return
        hurry(HURRY)
        try:
            self.finishing()
            self._report(Stopped(signum))
        finally:
            die_of(signum)

    def _on_interrupt(self, signum: int, frame: types.FrameType | None) -> None:
        if os.getpid() != self.pid:
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

    def _too_soon(self, frame: types.FrameType | None) -> bool:
        """Whether to let the script leave memsentry's recording code, or finish a write to
        standard output, first (for :data:`PATIENCE` seconds at most)."""
        if self._since is None:
            self._since = time.monotonic()
        if time.monotonic() - self._since > PATIENCE or not hasattr(signal, "pthread_kill"):
            return False
        return _in_recording(frame) or not _streams_free()

    def _again(self, signum: int) -> None:
        """Deliver ``signum`` to the main thread again in a moment."""
        main = threading.main_thread().ident

        def deliver() -> None:
            if main is not None and self._ours(signum) and self.phase is Phase.RUNNING:
                signal.pthread_kill(main, signum)

        timer = threading.Timer(_RETRY, deliver)
        timer.daemon = True
        timer.start()

    def _exit(self, status: int) -> NoReturn:
        """``os._exit`` while the script runs: the report, then the exit."""
        if (os.getpid() == self.pid and self.phase is Phase.RUNNING
                and threading.current_thread() is threading.main_thread()):
            try:
                self.finishing()
                self._report(Exited(status))
            finally:
                for stream in (sys.stdout, sys.stderr):
                    try:
                        stream.flush()
                    except Exception:  # python's os._exit flushes nothing: best effort
                        pass
        self._real_exit(status)


def _called_by_python(frame: types.FrameType | None) -> bool:
    """Whether the handler calling this was called by python for a signal, not by another
    handler (python calls it from the frame the signal interrupted)."""
    try:
        return sys._getframe(2) is frame
    except ValueError:
        return frame is None


__all__ = ["HURRY", "STOPPING", "Endings", "Exited", "Phase", "Stopped", "die_interrupted",
           "die_of", "end_by", "signal_name"]
