"""``memsentry show``: render a saved report again, as text or JSON."""

from __future__ import annotations

import argparse
import json
import sys

from memsentry.cli.args import add_table_options, fail
from memsentry.report import Report
from memsentry.reporters import REPORTERS, HtmlReporter, JsonReporter, Reporter, TextReporter
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


def _read(path: str) -> Report | str:
    """The report saved at ``path``, or what is wrong with the file."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except FileNotFoundError:
        return f"no such file: {path!r}"
    except (OSError, UnicodeDecodeError) as exc:
        return f"cannot read {path!r}: {exc}"
    except json.JSONDecodeError as exc:
        return (f"{path!r} is not JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); "
                "give a file written by `memsentry run --json` or Report.to_json()")
    try:
        return Report.from_dict(data)
    except (ValueError, TypeError, KeyError) as exc:
        return f"{path!r}: {exc}"


def run(args: argparse.Namespace) -> int:
    report = _read(args.report)
    if isinstance(report, str):
        return fail("show", report)
    if args.html:
        from memsentry.cli.run import write_html

        return write_html(report, args.html, "show")
    reporter: Reporter
    if args.format == JsonReporter.name:
        reporter = JsonReporter()
    elif args.format == HtmlReporter.name:
        if not have_plotly():
            return fail("show", f"--format html needs the plotly package: {INSTALL_HINT}")
        reporter = HtmlReporter()
    else:
        reporter = TextReporter(max_depth=args.depth, top=args.top, width=args.width)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            reporter.render(report, handle)
    else:
        reporter.render(report, sys.stdout)
    return 0
