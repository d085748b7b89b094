"""``memsentry show``: render a saved report again, as text or JSON; or judge an allocator
snapshot (``torch.cuda.memory._dump_snapshot()``, ``track(snapshot=...)``)."""

from __future__ import annotations

import argparse
import os
import sys

from memsentry.cli.args import add_table_options, argument_type, fail
from memsentry.cli.files import read_report, reason
from memsentry.paths import replace_text, unwritable
from memsentry.reporters import REPORTERS, HtmlReporter, TextReporter, make_reporter
from memsentry.reporters.plotly import INSTALL_HINT, have_plotly
from memsentry.reporters.snapshot import render_snapshot, snapshot_to_json
from memsentry.reporters.snapshot_html import render_snapshot_html
from memsentry.snapshots import DEFAULT_LIMIT, SnapshotError, is_pickle, read_snapshot
from memsentry.snapshots.findings import findings
from memsentry.snapshots.judge import judge
from memsentry.units import format_bytes, parse_size
from memsentry.usercode.text import printable


def prepare_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("report", metavar="REPORT.json|SNAPSHOT.pickle",
                        help="a report saved by `memsentry run --json` or Report.to_json(), "
                             "or a snapshot of PyTorch's allocator "
                             "(torch.cuda.memory._dump_snapshot(), track(snapshot=...))")
    parser.add_argument("--format", choices=sorted(REPORTERS), default="text",
                        help="output format (default text)")
    parser.add_argument("-o", "--output", metavar="FILE",
                        help="write to FILE instead of standard output")
    parser.add_argument("--html", metavar="FILE",
                        help="write the report as one self-contained HTML page to FILE instead "
                             "(needs memsentry[html])")
    parser.add_argument("--max-snapshot-size", type=argument_type(parse_size),
                        default=DEFAULT_LIMIT, metavar="SIZE",
                        help="the largest snapshot file read, in bytes or as '4 GiB' "
                             f"(default {format_bytes(DEFAULT_LIMIT)}: a snapshot takes several "
                             "times its size in memory once read)")
    add_table_options(parser)


def run(args: argparse.Namespace) -> int:
    problem = _outputs_problem(args)
    if problem is not None:
        return fail("show", problem)
    if is_pickle(args.report):
        return show_snapshot(args)
    report = read_report(args.report)
    if isinstance(report, str):
        return fail("show", report)
    if args.html:
        from memsentry.cli.run import write_html

        return write_html(report, args.html, "show")
    if args.format == HtmlReporter.name and not have_plotly():
        return fail("show", f"--format html needs the plotly package: {INSTALL_HINT}")
    table = {"max_depth": args.depth, "top": args.top, "width": args.width, "view": args.view}
    reporter = make_reporter(args.format, **(table if args.format == TextReporter.name else {}))
    if not args.output:
        reporter.render(report, sys.stdout)
        return 0
    return _write_output(args.output, reporter.text(report) + "\n")


def show_snapshot(args: argparse.Namespace) -> int:
    """Judge the allocator snapshot at ``args.report`` and print the verdict (text or JSON)."""
    try:
        snapshot = read_snapshot(args.report, limit=args.max_snapshot_size)
    except SnapshotError as error:
        return fail("show", str(error))
    verdict = judge(snapshot)
    found = findings(verdict)
    if args.html:
        return _write_snapshot_page(args.html, render_snapshot_html(verdict, found))
    if args.format == "json":
        text = snapshot_to_json(verdict, found) + "\n"
    elif args.format == HtmlReporter.name:
        text = render_snapshot_html(verdict, found)
    else:
        text = render_snapshot(verdict, found, width=args.width,
                               findings_only=args.view == "findings")
    if not args.output:
        sys.stdout.write(text)
        return 0
    return _write_output(args.output, text)


def _write_output(path: str, text: str, option: str = "-o") -> int:
    """The text to ``path`` (``option`` names the flag that asked); 2, after saying why, when
    it cannot be written."""
    try:
        replace_text(path, text)
    except OSError as error:
        return fail("show", f"{option}: could not write {path!r} ({reason(error)}); give a "
                            "writable path")
    return 0


def _write_snapshot_page(path: str, page: str) -> int:
    written = _write_output(path, page, "--html")
    if written:
        return written
    size = os.path.getsize(path) / 2**10
    print(f"memsentry: the verdict's page written to {printable(path)} ({size:,.0f} KiB; it "
          "opens offline in any browser)", file=sys.stderr)
    return 0


def _outputs_problem(args: argparse.Namespace) -> str | None:
    """What stops ``-o`` or ``--html`` from being written, checked before reading."""
    for option, path in (("-o", args.output), ("--html", args.html)):
        problem = unwritable(path) if path else None
        if problem is not None:
            return f"{option}: {problem}"
    return None
