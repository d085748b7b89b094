"""``memsentry run``: an unmodified script under tracking, then its report."""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import textwrap
import traceback
from typing import TYPE_CHECKING

from memsentry.cli.args import add_table_options, fail
from memsentry.errors import MemsentryError
from memsentry.units import parse_size

if TYPE_CHECKING:  # torch is imported for `run` only, when it runs
    from memsentry.report import Report
    from memsentry.tracker import Tracker


def prepare_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="FILE", help="also save the report as JSON to FILE")
    parser.add_argument("--html", metavar="FILE",
                        help="also save the report as one self-contained HTML page to FILE "
                             "(timeline, findings, layer table; needs memsentry[html])")
    parser.add_argument("-o", "--output", metavar="FILE",
                        help="write the text report to FILE instead of standard output")
    parser.add_argument("--device",
                        help="device to measure (default: the first module's device)")
    parser.add_argument("--exact", action="store_true",
                        help="exact peaks (CPU: count every storage, ~1.15x slower; CUDA: "
                             "resets the allocator's peak counter)")
    parser.add_argument("--snapshot", metavar="FILE",
                        help="also save the allocation history as the pickle PyTorch's "
                             "memory_viz opens (https://pytorch.org/memory_viz); on CPU it "
                             "implies --exact")
    parser.add_argument("--fit", metavar="SIZE",
                        help="also say the largest batch whose forecast peak fits in SIZE "
                             "(e.g. 80GiB), from the batch sizes the run measured")
    add_table_options(parser)
    parser.add_argument("-m", dest="module", action="store_true",
                        help="run SCRIPT as a module name, like python -m")
    parser.add_argument("script", help="the script to run (or the module name, with -m)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")


def _exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _run_script(args: argparse.Namespace, tracker: Tracker) -> int:
    """Run the script as ``__main__``; its exit code (1 for an uncaught error, shown after
    the tracker stopped: an out-of-memory error then carries memsentry's note)."""
    try:
        if args.module:
            runpy.run_module(args.script, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(args.script, run_name="__main__")
    except SystemExit as exc:
        return _exit_code(exc)
    except KeyboardInterrupt:
        traceback.print_exc()
        return 130
    except Exception:  # the script's own failure: show it, still report
        tracker.stop()  # while handling it: stop() explains an out-of-memory error
        traceback.print_exc()
        return 1
    return 0


def _check(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments, before anything runs (each output file is checked
    too, so a long run never ends with its report lost)."""
    from memsentry.record.paths import unwritable  # with torch: `run` is running

    if args.module:
        import importlib.util

        sys.path.insert(0, os.getcwd())  # where python -m looks first
        try:
            found = importlib.util.find_spec(args.script)
        except (ImportError, ValueError):
            found = None
        finally:
            sys.path.pop(0)
        if found is None:
            return f"no module named {args.script!r} (-m takes a module name, as python -m)"
    elif not os.path.isfile(args.script):
        return f"no such script: {args.script!r}"
    if args.fit is not None:
        try:
            if parse_size(args.fit) <= 0:
                return f"--fit {args.fit!r}: give a positive size, e.g. 80GiB"
        except ValueError as error:
            return f"--fit: {error}"
    if args.html is not None:
        from memsentry.reporters.plotly import INSTALL_HINT, have_plotly

        if not have_plotly():
            return f"--html: the HTML report needs the plotly package: {INSTALL_HINT}"
    for option, path in (("-o", args.output), ("--json", args.json), ("--html", args.html),
                         ("--snapshot", args.snapshot)):
        problem = unwritable(path) if path else None
        if problem is not None:
            return f"{option}: {problem}"
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
    try:
        tracker = Tracker(device=args.device, exact=args.exact, on_leak="ignore",
                          snapshot=bool(args.snapshot))
    except (MemsentryError, TypeError, ValueError) as exc:
        return fail("run", str(exc))
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [args.script, *args.args]
    sys.path.insert(0, os.getcwd() if args.module
                    else os.path.dirname(os.path.abspath(args.script)))
    try:
        with tracker:
            code = _run_script(args, tracker)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    report = tracker.report()
    if report.world_size is not None and report.world_size > 1:
        code = _rank_output(args, tracker, report, code)
    else:
        code = _output(args, report, code)
    return _save_snapshot(args, tracker, report.rank or 0, code) if args.snapshot else code


def _save_snapshot(args: argparse.Namespace, tracker: Tracker, rank: int, code: int) -> int:
    """``--snapshot FILE``: write the memory_viz snapshot (each rank but 0 to its own
    ``FILE.rankN``) and say where; 2 (after saying why) when it cannot."""
    from memsentry.cli.files import reason, snapshot_saved

    path = args.snapshot if rank == 0 else rank_file(args.snapshot, rank)
    try:
        print(f"memsentry: {snapshot_saved(tracker, path)}")
    except (OSError, ValueError, MemsentryError) as error:
        fail("run", f"--snapshot: could not write {path!r} ({reason(error)})")
        return code or 2
    return code


def rank_file(path: str, rank: int) -> str:
    """``r.rank1.json`` for rank 1 of ``--json r.json``."""
    stem, dot, suffix = path.rpartition(".")
    return f"{stem}.rank{rank}.{suffix}" if dot and "/" not in suffix else f"{path}.rank{rank}"


def _rank_output(args: argparse.Namespace, tracker: Tracker, report: Report, code: int) -> int:
    """Under torchrun: rank 0 prints (and saves) the combined report; every rank saves its
    own with ``--json`` (``FILE.rankN.json``); the other ranks print one line."""
    rank = report.rank or 0
    if args.json:
        own = tracker.own_report()
        try:
            own.to_json(rank_file(args.json, rank))
        except OSError as error:
            fail("run", f"--json: could not write {rank_file(args.json, rank)!r} "
                        f"({error.strerror})")
            code = code or 2
    if rank == 0:
        return _output(args, report, code)
    sys.stdout.flush()
    saved = f"; its own is in {rank_file(args.json, rank)}" if args.json else ""
    print(f"memsentry: rank {rank} of {report.world_size} handed its report to rank 0, which "
          f"prints the combined report{saved}")
    return code


def _output(args: argparse.Namespace, report: Report, code: int) -> int:
    text = report.format(max_depth=args.depth, top=args.top, width=args.width)
    if args.fit is not None:
        text += "\n\n" + fit_text(report, args.fit, args.width)
    sys.stdout.flush()
    banner = f"\n{'=' * 30} memsentry report {'=' * 30}\n{text}"
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as handle:
                handle.write(text + "\n")
        except OSError as error:  # it became unwritable while the script ran: keep the text
            print(banner)
            fail("run", f"-o: could not write {args.output!r} ({error.strerror}); the report "
                        "is printed above")
            code = code or 2
    else:
        print(banner)
    if args.json:
        try:
            report.to_json(args.json)
        except OSError as error:
            fail("run", f"--json: could not write {args.json!r} ({error.strerror})")
            code = code or 2
    if args.html:
        code = write_html(report, args.html, "run") or code
    return code


def write_html(report: Report, path: str, command: str) -> int:
    """Save the HTML report to ``path`` and say where; 2 (after saying why) when it cannot."""
    from memsentry.cli.files import html_saved, reason
    from memsentry.reporters.plotly import ChartsUnavailable

    try:
        print(f"memsentry: {html_saved(report, path)}")
    except (OSError, ChartsUnavailable) as error:
        return fail(command, f"--html: could not write {path!r} ({reason(error)})")
    return 0
