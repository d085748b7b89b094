"""The ``memsentry`` command: one module per subcommand, each with ``prepare_parser(parser)``
and ``run(args) -> exit code``.

- ``memsentry run script.py [args]``: run a script under tracking and print its report;
- ``memsentry show REPORT.json``: render a saved report again (text or JSON);
- ``memsentry diff OLD.json NEW.json``: compare two saved reports; exit 1 past given limits;
- ``memsentry info``: what this machine offers.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from memsentry.cli import diff, info, run, show
from memsentry.version import __version__

#: name -> (help, description, prepare_parser, run)
_COMMANDS: dict[str, tuple[str, str, Callable[[argparse.ArgumentParser], None],
                           Callable[[argparse.Namespace], int]]] = {
    "run": (
        "run a Python script under memsentry.track() and print the memory report",
        "Run an unmodified script as __main__ (with its own arguments) while every module "
        "call and optimizer step is tracked, then print the report. The exit code is the "
        "script's. memsentry's options go before the script's name.",
        run.prepare_parser, run.run,
    ),
    "show": (
        "render a saved report (memsentry run --json) again, as text or JSON",
        "Read a report saved by `memsentry run --json FILE` or Report.to_json() and print "
        "it as text (with the table options of `memsentry run`) or JSON.",
        show.prepare_parser, show.run,
    ),
    "diff": (
        "compare two saved reports of the same program; exit 1 past given limits",
        "Compare two reports saved by `memsentry run --json` or Report.to_json(): peak, "
        "growth per iteration, memory by category at the peak, the layers that changed most "
        "and the findings that appeared or disappeared. With limits (--max-peak-increase, "
        "--max-growth-increase, --fail-on-new-findings) the exit code is 1 when the new run "
        "crosses one, so CI can gate memory regressions; 2 on bad input.",
        diff.prepare_parser, diff.run,
    ),
    "info": (
        "show torch, devices, allocator and NVML figures",
        "Show what this machine offers memsentry: torch, the CPU backend, each CUDA device "
        "and NVML's view of it.",
        info.prepare_parser, info.run,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memsentry",
        description="Find PyTorch memory leaks and say what holds the memory.",
    )
    parser.add_argument("--version", action="version", version=f"memsentry {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (summary, description, prepare, _run) in _COMMANDS.items():
        prepare(sub.add_parser(name, help=summary, description=description))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``memsentry`` command; returns the exit code."""
    args = build_parser().parse_args(argv)
    return _COMMANDS[args.command][3](args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
