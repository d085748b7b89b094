"""``memsentry show``: render a saved report again, as text or JSON."""

from __future__ import annotations

import argparse
import sys

from memsentry.cli.args import add_table_options, fail
from memsentry.cli.files import read_report
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
    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            reporter.render(report, handle)
    else:
        reporter.render(report, sys.stdout)
    return 0
