"""Argument types and helpers shared by the subcommands."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TypeVar

from memsentry.reporters.width import terminal_width
from memsentry.usercode.text import printable

T = TypeVar("T")


def argument_type(parse: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse type from a parser whose ``ValueError`` names the value and the forms."""

    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return convert


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number no smaller than ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(
                f"expected a number of at least {minimum}, got {value}"
            )
        return value

    return parse


def add_table_options(parser: argparse.ArgumentParser) -> None:
    """``--top``, ``--depth``, ``--width`` and ``--findings-only``: how the text report is
    shaped."""
    parser.add_argument("--top", type=at_least(1), default=30,
                        help="layers shown in the table, largest footprint first (default 30)")
    parser.add_argument("--depth", type=at_least(0), default=None,
                        help="hide layers nested deeper than this (the root is depth 0)")
    parser.add_argument("--width", type=at_least(1), default=terminal_width(),
                        help="width the text is fitted to (default: COLUMNS, else the "
                             "terminal's width, else 100)")
    parser.add_argument("--findings-only", dest="view", action="store_const", const="findings",
                        default="full",
                        help="print the headline and the findings (and an out-of-memory "
                             "post-mortem) without the tables that explain them")


def fail(command: str, message: str, code: int = 2) -> int:
    """Say what went wrong on standard error, in one line (the paths and names it echoes
    written :func:`~memsentry.usercode.text.printable`); return the exit code."""
    print(f"memsentry {command}: {printable(message)}", file=sys.stderr)
    return code
