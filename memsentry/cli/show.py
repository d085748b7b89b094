"""``memsentry show``: render a saved report again, as text or JSON."""

from __future__ import annotations

import argparse
import sys

from memsentry.cli.args import add_table_options, fail
from memsentry.cli.files import read_report, reason
from memsentry.paths import replace_text, unwritable
from memsentry.reporters import REPORTERS, HtmlReporter, TextReporter, make_reporter
from memsentry.reporters.plotly import INSTALL_HINT, have_plotly


def prepare_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("report", metavar="REPORT.json",
                        help="a report saved by `memsentry run --json` or Report.to_json()")
    parser.add_argument("--format", choices=sorted(REPORTERS), default="text",
                        help="output format (default text)")
    parser.add_argument("-o", "--output", metavar="FILE",
                        help="write to FILE instead of standard output")
    parser.add_argument("--html", metavar="FILE",
                        help="write the report as one self-contained HTML page to FILE instead "
                             "(needs memsentry[html])")
    add_table_options(parser)


def run(args: argparse.Namespace) -> int:
    problem = _outputs_problem(args)
    if problem is not None:
        return fail("show", problem)
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
    try:
        replace_text(args.output, reporter.text(report) + "\n")
    except OSError as error:
        return fail("show", f"-o: could not write {args.output!r} ({reason(error)}); give a "
                            "writable path")
    return 0


def _outputs_problem(args: argparse.Namespace) -> str | None:
    """What stops ``-o`` or ``--html`` from being written, checked before reading."""
    for option, path in (("-o", args.output), ("--html", args.html)):
        problem = unwritable(path) if path else None
        if problem is not None:
            return f"{option}: {problem}"
    return None
