"""The ``memsentry`` command: one module per subcommand, each with ``prepare_parser(parser)``
and ``run(args) -> exit code``.

- ``memsentry run script.py [args]``: run a script under tracking and print its report;
- ``memsentry show REPORT.json``: render a saved report again (text or JSON);
- ``memsentry diff OLD.json NEW.json``: compare two saved reports; exit 1 past given limits;
- ``memsentry info``: what this machine offers.
"""

from __future__ import annotations

import argparse
import difflib
import shlex
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

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


class CommandParser(argparse.ArgumentParser):
    """A subcommand's parser: its errors come with its own usage, in words that say what to
    do (``memsentry run`` without a script asks for one)."""

    def error(self, message: str) -> NoReturn:
        if message.startswith("the following arguments are required: script"):
            message = (f"name the script to run: {self.prog} script.py [its arguments] "
                       "(or -m module)")
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memsentry",
        description="Find PyTorch memory leaks and say what holds the memory.",
    )
    parser.add_argument("--version", action="version", version=f"memsentry {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=CommandParser)
    sub.required = True
    for name, (summary, description, prepare, _run) in _COMMANDS.items():
        prepare(sub.add_parser(name, help=summary, description=description))
    return parser


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    for action in parser._subparsers._group_actions if parser._subparsers else ():
        if isinstance(action, argparse._SubParsersAction):
            found: argparse.ArgumentParser = action.choices[command]
            return found
    raise KeyError(command)


def unknown_options(command: argparse.ArgumentParser, extra: list[str], argv: list[str]
                    ) -> str:
    """What to say of options the subcommand does not know: the closest of its own
    (``--jsn``: did you mean ``--json``?), and for ``run``, that the script's options go
    after the script, with the command line put right when the script can be told."""
    options = [word for word in extra if word.startswith("-")]
    hints = []
    for option in options:
        close = _closest(command, option.split("=")[0])
        if close is not None:
            hints.append(f"{option}: did you mean {close}?")
    message = f"unrecognized arguments: {' '.join(extra)}"
    if hints:
        return f"{message} ({'; '.join(hints)})"
    if command.prog.endswith(" run"):
        message += ("; memsentry's options go before the script's name, the script's own "
                    "after it")
        fixed = _script_options_after(command, argv)
        if fixed is not None:
            message += f": memsentry {' '.join(map(shlex.quote, fixed))}"
    return message


def _closest(command: argparse.ArgumentParser, option: str) -> str | None:
    """The long option of ``command`` closest to the mistyped ``option`` (``--jsn``:
    ``--json``), or ``None`` when none is close."""
    known = [name for name in command._option_string_actions if name.startswith("--")]
    close = difflib.get_close_matches(option, known, n=1, cutoff=0.75)
    return close[0] if close else None


def _script_options_after(command: argparse.ArgumentParser, argv: list[str]
                          ) -> list[str] | None:
    """``argv`` with the options before the script that ``run`` does not know
    (``run --steps 5 s.py``) moved after it, with their values (``run s.py --steps 5``);
    ``None`` when no argument names a ``.py`` file."""
    words = argv[argv.index("run") + 1:] if "run" in argv else []
    script = next((i for i, word in enumerate(words) if word.endswith(".py")), None)
    if script is None:
        return None
    before, moved = _sort_options(command._option_string_actions, words[:script])
    return ["run", *before, words[script], *moved, *words[script + 1:]]


def _sort_options(actions: dict[str, argparse.Action], words: list[str]
                  ) -> tuple[list[str], list[str]]:
    """``words`` (what comes before the script) split into the options ``run`` knows and
    those it does not, each option's value kept with it."""
    before: list[str] = []
    moved: list[str] = []
    taking: list[str] | None = None  # where the next word goes: the value of an option
    for word in words:
        if taking is not None and not word.startswith("-"):
            taking.append(word)
            taking = None
            continue
        action = actions.get(word.split("=")[0])
        target = before if action is not None else moved
        target.append(word)
        taking = target if _value_follows(action, word) else None
    return before, moved


def _value_follows(action: argparse.Action | None, word: str) -> bool:
    """Whether the word after the option ``word`` may be its value: the option takes one (or
    is unknown, so may take one) and ``word`` does not carry it after ``=``."""
    takes = action is None or action.nargs != 0
    return takes and "=" not in word


def _before_the_command(parser: argparse.ArgumentParser, words: list[str]) -> str | None:
    """What to say of an option memsentry itself does not know, put before the command's
    name (``memsentry --jsn x.json run s.py``: argparse would take ``x.json`` for the
    command); ``None`` when the words begin otherwise or name no command."""
    option = words[0].split("=")[0] if words else ""
    command = next((word for word in words if word in _COMMANDS), None)
    if not option.startswith("-") or option in parser._option_string_actions or command is None:
        return None
    message = (f"{option} comes before the command: the options of {command} go after its "
               f"name (memsentry {command} [options] ...)")
    close = _closest(_subparser(parser, command), option)
    return f"{message}; did you mean memsentry {command} {close}?" if close else message


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``memsentry`` command; returns the exit code."""
    words = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    misplaced = _before_the_command(parser, words)
    if misplaced is not None:
        parser.error(misplaced)
    args, extra = parser.parse_known_args(words)
    if extra:
        command = _subparser(parser, args.command)
        command.error(unknown_options(command, extra, words))
    return _COMMANDS[args.command][3](args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
