"""``memsentry run``: an unmodified script under tracking, then its report."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import textwrap
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, TextIO

from memsentry.cli.args import add_table_options, at_least, fail
from memsentry.cli.endings import Endings, Exited, Stopped, die_of, signal_name
from memsentry.cli.exits import end_interrupted
from memsentry.cli.files import reason
from memsentry.cli.script import Outcome, Script, print_error
from memsentry.errors import MemsentryError
from memsentry.paths import replace_text, unwritable
from memsentry.settings import OVERHEAD, SETTINGS, WATCH_OVERHEAD, Flag, Setting
from memsentry.units import parse_size

if TYPE_CHECKING:  # torch is imported for `run` only, when it runs
    from memsentry.model import Finding
    from memsentry.report import Report
    from memsentry.tracker import Tracker


def prepare_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="FILE", help="also save the report as JSON to FILE")
    parser.add_argument("--html", metavar="FILE",
                        help="also save the report as one self-contained HTML page to FILE "
                             "(timeline, findings, layer table; needs memsentry[html])")
    parser.add_argument("-o", "--output", metavar="FILE",
                        help="write the text report to FILE instead of standard output")
    for setting in SETTINGS:  # the options of track() that have a flag, as settings says
        if setting.flag is not None:
            _add_flag(parser, setting, setting.flag)
    parser.add_argument("--fit", metavar="SIZE",
                        help="also say the largest batch whose forecast peak fits in SIZE "
                             "(e.g. 80GiB), from the batch sizes the run measured; every "
                             "iteration is then measured, whatever it costs (the forecast "
                             "needs each one's peak and batch size)")
    add_table_options(parser)
    parser.add_argument("-m", dest="module", action="store_true",
                        help="run SCRIPT as a module name, like python -m")
    parser.add_argument("script", help="the script to run (or the module name, with -m)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")


def _add_flag(parser: argparse.ArgumentParser, setting: Setting, flag: Flag) -> None:
    """A track() option's flag: a switch, or a value checked as seconds (``SECONDS``)."""
    text = flag.help.replace("%", "%%")
    if flag.metavar is None:
        parser.add_argument(flag.name, action="store_true", help=text)
    elif flag.metavar == "SECONDS":
        parser.add_argument(flag.name, metavar=flag.metavar, type=_seconds,
                            default=setting.default, help=text)
    elif flag.metavar == "N":
        parser.add_argument(flag.name, metavar=flag.metavar, type=at_least(1),
                            default=setting.default, help=text)
    else:
        parser.add_argument(flag.name, metavar=flag.metavar, help=text)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _module_problem(name: str) -> str | None:
    """What is wrong with ``-m name``: no module of that name, where python -m looks."""
    import importlib.util

    sys.path.insert(0, os.getcwd())  # where python -m looks first
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        found = None
    finally:
        sys.path.pop(0)
    if found is None:
        return f"no module named {name!r} (-m takes a module name, as python -m)"
    return None


def _script_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the script (or module) to run: that there is none of that name."""
    if args.module:
        return _module_problem(args.script)
    if not os.path.isfile(args.script):
        return f"no such script: {args.script!r}"
    return None


def _fit_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with ``--fit SIZE``: not a size, or not a positive one."""
    if args.fit is None:
        return None
    try:
        if parse_size(args.fit) <= 0:
            return f"--fit {args.fit!r}: give a positive size, e.g. 80GiB"
    except ValueError as error:
        return f"--fit: {error}"
    return None


def _html_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with ``--html``: the page needs plotly, which is not installed."""
    if args.html is None:
        return None
    from memsentry.reporters.plotly import INSTALL_HINT, have_plotly

    if not have_plotly():
        return f"--html: the HTML report needs the plotly package: {INSTALL_HINT}"
    return None


def _output_problem(args: argparse.Namespace) -> str | None:
    """The first output file that cannot be written, and why."""
    for option, path in (("-o", args.output), ("--json", args.json), ("--html", args.html),
                         ("--snapshot", args.snapshot)):
        problem = unwritable(path) if path else None
        if problem is not None:
            return f"{option}: {problem}"
    return None


#: The checks :func:`_check` runs, in order: the first problem found is the one said.
_CHECKS: tuple[Callable[[argparse.Namespace], str | None], ...] = (
    _script_problem, _fit_problem, _html_problem, _output_problem)


def _check(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments, before anything runs (each output file is checked
    too, so a long run never ends with its report lost)."""
    for check in _CHECKS:
        problem = check(args)
        if problem is not None:
            return problem
    return None


def fit_text(report: Report, size: str, width: int) -> str:
    """What ``--fit SIZE`` adds to the report: the largest batch that fits, and why."""
    try:
        fits = report.max_batch(size)
        biggest = report.forecast(max(fits, 1))
    except ValueError as error:
        return textwrap.fill(f"Batch that fits {size}: {error}", width)
    lines = [f"Batch that fits {size}: {fits:,}", textwrap.fill(str(biggest), width)]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from memsentry.tracker import Tracker  # torch is imported for this command only

    problem = _check(args)
    if problem is not None:
        return fail("run", problem)
    script = _load(args)
    if isinstance(script, int):
        return script
    try:
        tracker = Tracker(device=args.device, exact=args.exact, on_leak="ignore",
                          snapshot=bool(args.snapshot), snapshot_entries=args.snapshot_entries,
                          gather_timeout=args.gather_timeout,
                          alarm=_alarm, report_path=_live_path(args.json), watch=args.watch,
                          overhead=_overhead(args))
    except (MemsentryError, TypeError, ValueError) as exc:
        return fail("run", str(exc))
    return _Run(args, tracker)(script)


def _overhead(args: argparse.Namespace) -> float | None:
    """The tracker's budget: none for ``--fit`` (a light iteration reads no peak inside and no
    batch size, and a forecast from the first iterations alone would miss the batch sizes the
    script ran later), else the default, or watch()'s."""
    if args.fit is not None:
        return None
    return WATCH_OVERHEAD if args.watch else OVERHEAD


def _alarm(text: str, leaks: tuple[Finding, ...]) -> None:
    """A leak proven while the script runs: one line on stderr for each, at once."""
    for line in text.splitlines()[1:]:
        _say(f"memsentry run: LEAK {line.strip()}", sys.stderr)


def _live_path(json_path: str | None) -> str | None:
    """The file the tracker keeps the latest report in while the script runs: ``--json``'s,
    or under torchrun each rank's own (``FILE.rankN.json``), as the end writes them."""
    if json_path is None:
        return None
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        return json_path
    return rank_file(json_path, rank) if world > 1 else json_path


def _load(args: argparse.Namespace) -> Script | int:
    """The script, compiled (or its module found, with ``-m``); else the exit status, after
    saying why as python would (a syntax error as python shows it, status 1)."""
    try:
        if args.module:
            return Script.from_module(args.script, args.args)
        return Script.from_path(args.script, args.args)
    except ImportError as error:  # -m: what python -m says before it runs anything
        return fail("run", str(error))
    except OSError as error:
        return fail("run", f"cannot read {args.script!r} ({reason(error)})")
    except (SyntaxError, ValueError) as error:  # python's own message, status 1
        print_error(error)
        return 1
    except Exception as error:  # -m: the module's parent package failed to import
        print_error(error)
        return 1


class _Run:
    """One run of ``memsentry run``: the script as ``__main__`` under tracking, the report,
    and the end python would have given the process (see :mod:`memsentry.cli.endings`)."""

    def __init__(self, args: argparse.Namespace, tracker: Tracker) -> None:
        self.args, self.tracker = args, tracker
        self.endings = Endings(self._stopped)
        self.kept: str | None = None  # this rank's own --json file, saved before the handoff
        self.unsaved = False  # whether saving it failed (status 2 for a script that ended well)
        #: The names in sys.modules as the script began, and as it ended.
        self.modules: tuple[set[str], set[str]] = (set(), set())

    def __call__(self, script: Script) -> int:
        from memsentry.record.ranks import HANDOFF  # with torch: `run` is running

        outcome, code = Outcome(1), 1
        HANDOFF.keep = self._keep if self.args.json else None
        os.register_at_fork(after_in_child=_silencer(self.tracker))  # its parent reports
        with script.installed():
            try:
                self.tracker.start()
                self.endings.start()
                started = set(sys.modules)
                outcome = script.run()
                self.modules = (started, set(sys.modules))
                code = self._ended(outcome)
            finally:
                HANDOFF.keep = None
                pending = self.endings.end()
        self.endings.exit_if_asked()  # a thread's os._exit, during the report
        if pending == signal.SIGINT or (pending is None
                                        and type(outcome.error) is KeyboardInterrupt):
            end_interrupted(*self.modules, script.module)  # python decides, as for its own
        if pending is not None:
            die_of(pending)
        return code

    def _ended(self, outcome: Outcome) -> int:
        """The script ended: the report, and the exit status. A child the script forked
        that ends here ends as under python, without a report: its parent makes it."""
        if self.endings.in_child:
            if outcome.error is not None and not isinstance(outcome.error, SystemExit):
                print_error(outcome.error)
            return outcome.status
        if not self.endings.finishing():
            self.endings.hold()  # a thread's os._exit makes the report, then exits
        return self._finish(outcome)

    def _stopped(self, ending: BaseException) -> None:
        """A signal or ``os._exit`` ends the script where it is: the report now."""
        if isinstance(ending, Stopped):
            _say(f"memsentry run: the script was stopped by {signal_name(ending.signum)}; its "
                 "report up to here follows", sys.stderr)
        self._finish(Outcome(ending.status if isinstance(ending, Exited) else 1, ending))

    def _finish(self, outcome: Outcome) -> int:
        """Stop tracking, show how the script ended as python would, then the report (none
        when the script exited before any module ran: its own ``--help``, a bad argument)."""
        error = outcome.error
        if error is None or isinstance(error, SystemExit):
            self.tracker.stop(None)
            if isinstance(error, SystemExit) and _parsing(error) \
                    and _nothing_ran(self.tracker.report()):
                _say(f"memsentry run: the script exited (status {outcome.status}) before any "
                     "module ran; there is no report", sys.stderr)
                return outcome.status
        else:  # stop() while knowing the error explains an out-of-memory error
            self.tracker.stop(error)
            if not isinstance(error, Stopped | Exited):
                print_error(error)
        return self._output(outcome.status)

    def _keep(self, rank: int, payload: str) -> None:
        """Save this rank's own report (``FILE.rankN.json``) before rank 0 waits for the
        others: a job stopped while it waits still leaves every rank's file."""
        path = rank_file(self.args.json, rank)
        try:
            replace_text(path, json.dumps(json.loads(payload), indent=2) + "\n")
        except OSError as error:
            self.unsaved = True
            fail("run", f"--json: could not write {path!r} ({error.strerror})")
        else:
            self.kept = path

    def _output(self, code: int) -> int:
        report = self.tracker.report()
        if report.world_size is not None and report.world_size > 1:
            code = self._rank_output(report, code)
        else:
            code = _output(self.args, report, code)
        if self.args.snapshot:
            code = _save_snapshot(self.args, self.tracker, report.rank or 0, code)
        return code

    def _rank_output(self, report: Report, code: int) -> int:
        """Under torchrun: rank 0 prints (and saves) the combined report; every rank saves
        its own with ``--json`` (``FILE.rankN.json``); the other ranks print one line."""
        rank = report.rank or 0
        if self.args.json and self.kept is None and not self.unsaved:
            self._keep(rank, self.tracker.own_report().to_json(indent=0))
        if self.unsaved:
            code = code or 2
        if rank == 0:
            return _output(self.args, report, code)
        saved = f"; its own is in {self.kept}" if self.kept else ""
        _say(f"memsentry: rank {rank} of {report.world_size} handed its report to rank 0, "
             f"which prints the combined report{saved}")
        return code


def _silencer(tracker: Tracker) -> Callable[[], None]:
    """What a child forked from this process calls: ``tracker`` (while it lives) says no
    leak and writes no file there."""
    alive = weakref.ref(tracker)

    def silence() -> None:
        found = alive()
        if found is not None:
            found.silence()

    return silence


#: Argument parsers whose exit (``--help``, a bad option) ends a script before it starts.
_PARSERS = ("argparse.py", "optparse.py", "/click/", "/typer/", "/absl/flags/", "/fire/")


def _parsing(error: SystemExit) -> bool:
    """Whether ``error`` was raised by an argument parser (the script's ``--help``)."""
    trace = error.__traceback__
    while trace is not None:
        name = trace.tb_frame.f_code.co_filename.replace("\\", "/")
        if name.endswith(_PARSERS[:2]) or any(part in name for part in _PARSERS[2:]):
            return True
        trace = trace.tb_next
    return False


def _nothing_ran(report: Report) -> bool:
    """Whether tracking saw no module call and no optimizer step."""
    return not report.layers and not any(it.forward_calls for it in report.iterations) \
        and not any(it.boundary == "optimizer" for it in report.iterations)


def _save_snapshot(args: argparse.Namespace, tracker: Tracker, rank: int, code: int) -> int:
    """``--snapshot FILE``: write the memory_viz snapshot (each rank but 0 to its own
    ``FILE.rankN``) and say where; 2 (after saying why) when it cannot."""
    from memsentry.cli.files import snapshot_saved

    path = args.snapshot if rank == 0 else rank_file(args.snapshot, rank)
    try:
        print(f"memsentry: {snapshot_saved(tracker, path)}", file=sys.stderr)
    except (OSError, ValueError, MemsentryError) as error:
        fail("run", f"--snapshot: could not write {path!r} ({reason(error)})")
        return code or 2
    return code


def rank_file(path: str, rank: int) -> str:
    """``r.rank1.json`` for rank 1 of ``--json r.json``."""
    stem, dot, suffix = path.rpartition(".")
    return f"{stem}.rank{rank}.{suffix}" if dot and "/" not in suffix else f"{path}.rank{rank}"


def _output(args: argparse.Namespace, report: Report, code: int) -> int:
    """Save and print the report. The JSON file comes first: a standard output that is
    closed, or held up by a reader that does not read, loses only the printed text."""
    if args.json:
        try:
            report.to_json(args.json)
        except OSError as error:
            fail("run", f"--json: could not write {args.json!r} ({error.strerror})")
            code = code or 2
    text = report.format(max_depth=args.depth, top=args.top, width=args.width,
                         view=args.view)
    if args.fit is not None:
        text += "\n\n" + fit_text(report, args.fit, args.width)
    banner = f"\n{'=' * 30} memsentry report {'=' * 30}\n{text}"
    if args.output:
        try:
            replace_text(args.output, text + "\n")
        except OSError as error:  # it became unwritable while the script ran: keep the text
            _say(banner)
            fail("run", f"-o: could not write {args.output!r} ({error.strerror}); the report "
                        "is printed above")
            code = code or 2
    else:
        _say(banner)
    if args.html:
        code = write_html(report, args.html, "run") or code
    return code


def _say(text: str, stream: TextIO | None = None) -> None:
    """Print ``text`` after what the script printed (on standard output by default); where
    the stream is closed (a pipe whose reader left) or busy (a signal came in the middle of
    a write), nothing."""
    try:
        sys.stdout.flush()
        print(text, file=stream or sys.stdout, flush=True)
    except (OSError, RuntimeError, ValueError):
        pass


def write_html(report: Report, path: str, command: str) -> int:
    """Save the HTML report to ``path`` and say where, on standard error (standard output
    carries reports only); 2 (after saying why) when it cannot."""
    from memsentry.cli.files import html_saved
    from memsentry.reporters.plotly import ChartsUnavailable

    try:
        print(f"memsentry: {html_saved(report, path)}", file=sys.stderr)
    except (OSError, ChartsUnavailable) as error:
        return fail(command, f"--html: could not write {path!r} ({reason(error)})")
    return 0
