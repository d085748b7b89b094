"""``memsentry diff``: compare two saved reports of the same program; fail past limits.

Exit codes: 0 when the new run keeps within the limits given (or none were given), 1 when it
crosses one (each is named on standard error with the figure seen and the limit), 2 on bad
input (an unreadable limit, a missing file, a file that is not a report).
"""

from __future__ import annotations

import argparse
import os
import sys

from memsentry.cli.args import argument_type, at_least, fail
from memsentry.cli.files import read_report
from memsentry.model import LimitCheck, Limits, ReportDiff
from memsentry.model.diff import parse_growth_increase, parse_increase
from memsentry.paths import replace_text, unwritable
from memsentry.reporters.diff import diff_to_json, render_diff
from memsentry.reporters.diff_html import render_diff_html
from memsentry.reporters.snapshot import render_snapshot_diff, snapshot_diff_to_json
from memsentry.reporters.width import terminal_width
from memsentry.rules.diff import check, diff
from memsentry.snapshots import DEFAULT_LIMIT, SnapshotError, is_pickle, read_snapshot
from memsentry.snapshots.compare import breaches, compare
from memsentry.snapshots.findings import findings
from memsentry.snapshots.judge import judge
from memsentry.units import format_bytes, parse_size
from memsentry.usercode.text import printable


def prepare_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("old", metavar="OLD.json",
                        help="the report to compare against (memsentry run --json), or an "
                             "allocator snapshot (torch.cuda.memory._dump_snapshot())")
    parser.add_argument("new", metavar="NEW.json",
                        help="the report of the run to judge, or its allocator snapshot")
    parser.add_argument("--max-peak-increase", metavar="LIMIT", type=argument_type(parse_increase),
                        help="exit 1 when the peak rises by more than this: a share of the "
                             "old peak (5%%) or a size (64MiB)")
    parser.add_argument("--max-growth-increase", metavar="SIZE",
                        type=argument_type(parse_growth_increase),
                        help="exit 1 when memory growth per iteration rises by more than this "
                             "(1MiB, meaning 1 MiB/iter)")
    parser.add_argument("--fail-on-new-findings", action="store_true",
                        help="exit 1 when the new run has a leak or waste finding the old one "
                             "did not (new hints do not count)")
    parser.add_argument("--json", metavar="FILE",
                        help="also save the diff (and the limits' verdict) as JSON to FILE")
    parser.add_argument("--html", metavar="FILE",
                        help="also write the diff as one self-contained HTML page to FILE: "
                             "both timelines on one axis (needs memsentry[html])")
    parser.add_argument("-o", "--output", metavar="FILE",
                        help="write the text to FILE instead of standard output")
    parser.add_argument("--top", type=at_least(1), default=10,
                        help="layers shown, largest change first (default 10)")
    parser.add_argument("--width", type=at_least(1), default=terminal_width(),
                        help="width the text is fitted to (default: COLUMNS, else the "
                             "terminal's width, else 100)")
    parser.add_argument("--max-snapshot-size", type=argument_type(parse_size),
                        default=DEFAULT_LIMIT, metavar="SIZE",
                        help="the largest allocator snapshot read, when the two files are "
                             f"snapshots (default {format_bytes(DEFAULT_LIMIT)})")


def diff_snapshots(args: argparse.Namespace) -> int:
    """Compare two allocator snapshots; exit 1 past the limits given."""
    if args.max_growth_increase is not None or args.html:
        option = "--max-growth-increase" if args.max_growth_increase is not None else "--html"
        return fail("diff", f"{option} applies to reports; two snapshots are compared by "
                            "--max-peak-increase and --fail-on-new-findings, as text or --json")
    verdicts = []
    for label, path in (("OLD", args.old), ("NEW", args.new)):
        try:
            verdict = judge(read_snapshot(path, limit=args.max_snapshot_size))
        except SnapshotError as error:
            return fail("diff", f"{label}: {error}")
        verdicts.append((verdict, findings(verdict)))
    (old, old_found), (new, new_found) = verdicts
    change = compare(old, old_found, new, new_found, top=args.top)
    share, size = args.max_peak_increase or (None, None)
    crossed = breaches(change, peak_share=share, peak_bytes=size,
                       new_findings=args.fail_on_new_findings)
    text = render_snapshot_diff(change, crossed, width=args.width).rstrip("\n")
    problem = _save_snapshot_diff(args, text, snapshot_diff_to_json(change, crossed))
    if problem is not None:
        return fail("diff", problem)
    sys.stdout.flush()
    for breach in crossed:
        fail("diff", f"limit crossed: {breach}")
    return 1 if crossed else 0


def _save_snapshot_diff(args: argparse.Namespace, text: str, data: str) -> str | None:
    problem = _print_or_write(args, text)
    if problem is not None:
        return problem
    return _write(args.json, data, "--json") if args.json else None


def _print_or_write(args: argparse.Namespace, text: str) -> str | None:
    """The text, to ``-o`` or standard output; what went wrong, if anything."""
    if args.output:
        return _write(args.output, text, "-o")
    print(text)
    return None


def _limits(args: argparse.Namespace) -> Limits:
    share, size = args.max_peak_increase or (None, None)
    return Limits(max_peak_increase=size, max_peak_increase_share=share,
                  max_growth_increase=args.max_growth_increase,
                  fail_on_new_findings=args.fail_on_new_findings)


def _write(path: str, text: str, option: str) -> str | None:
    try:
        replace_text(path, text + "\n")
    except OSError as error:
        return f"{option}: could not write {path!r} ({error.strerror})"
    return None


def _outputs_problem(args: argparse.Namespace) -> str | None:
    """What stops the outputs asked for from being written, checked before reading."""
    for option, path in (("-o", args.output), ("--json", args.json), ("--html", args.html)):
        problem = unwritable(path) if path else None
        if problem is not None:
            return f"{option}: {problem}"
    if args.html:
        from memsentry.reporters.plotly import INSTALL_HINT, have_plotly

        if not have_plotly():
            return f"--html: the HTML page needs the plotly package: {INSTALL_HINT}"
    return None


def _save(args: argparse.Namespace, change: ReportDiff, verdict: LimitCheck, text: str) -> \
        str | None:
    """Write the text (to ``-o`` or standard output), the JSON and the page asked for; what
    went wrong, if anything."""
    problem = _print_or_write(args, text)
    if problem is not None:
        return problem
    if args.json:
        problem = _write(args.json, diff_to_json(change, check=verdict), "--json")
        if problem is not None:
            return problem
    if args.html:
        page = render_diff_html(change, check=verdict if verdict.limits.any else None,
                                top=max(args.top, 25))
        problem = _write(args.html, page, "--html")
        if problem is not None:
            return problem
        size = os.path.getsize(args.html) / 2**20
        print(f"memsentry diff: HTML page written to {printable(args.html)} ({size:.1f} MiB; "
              "it opens offline in any browser)", file=sys.stderr)
    return None


def run(args: argparse.Namespace) -> int:
    problem = _outputs_problem(args)
    if problem is not None:
        return fail("diff", problem)
    pickles = is_pickle(args.old), is_pickle(args.new)
    if any(pickles):
        return diff_snapshots(args) if all(pickles) else fail(
            "diff", "one file is an allocator snapshot and the other a report: compare a "
                    "snapshot with a snapshot, or a report with a report")
    old = read_report(args.old)
    if isinstance(old, str):
        return fail("diff", f"OLD.json: {old}")
    new = read_report(args.new)
    if isinstance(new, str):
        return fail("diff", f"NEW.json: {new}")
    limits = _limits(args)
    change = diff(old, new, old_label=args.old, new_label=args.new)
    verdict = check(change, limits)
    text = render_diff(change, check=verdict if limits.any else None, top=args.top,
                       width=args.width)
    problem = _save(args, change, verdict, text)
    if problem is not None:
        return fail("diff", problem)
    sys.stdout.flush()
    for breach in verdict.breaches:
        fail("diff", f"limit crossed: --{breach.limit}: {breach.message}")
    return 1 if verdict.breaches else 0
