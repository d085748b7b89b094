"""What the reference pages are made of, read from the code: the rules, the command line and
the JSON layout of a saved report.

Nothing here imports Sphinx or docutils: each function returns plain values, which
:mod:`memsentry_docs` turns into tables and sections, and which the tests check against the
code they come from.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import inspect
import re
import types
import typing
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

# -- rules ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RuleEntry:
    """One rule as the rules page shows it."""

    id: str
    severities: tuple[str, ...]  # the severities it may report at, most severe first
    causes: tuple[str, ...]  # those at which it names a cause of memory growth
    fallback: bool  # reports only when no rule named a cause
    devices: str
    summary: str  # one paragraph, reStructuredText
    doc: str  # the check function's whole docstring, reStructuredText


def rule_entries() -> list[RuleEntry]:
    """Every registered rule (``memsentry.RULES``), in the order they run."""
    from memsentry import RULES, Severity

    order = list(Severity)

    def ranked(severities: frozenset[Any]) -> tuple[str, ...]:
        return tuple(str(s.value).upper() for s in sorted(severities, key=order.index))

    entries = []
    for rule in RULES.values():
        entries.append(RuleEntry(
            id=rule.id,
            severities=ranked(rule.severities),
            causes=ranked(rule.causes),
            fallback=rule.fallback,
            devices=", ".join(sorted(d.upper() if d == "cuda" else d for d in rule.devices))
            if rule.devices is not None else "all",
            summary=" ".join(rule.summary.split()),
            doc=inspect.cleandoc(rule.check.__doc__ or rule.summary),
        ))
    return entries


# -- command line ---------------------------------------------------------------------------

#: Width the usage lines are wrapped to, whatever the terminal building the docs.
USAGE_WIDTH = 88


@dataclass(frozen=True)
class CliArgument:
    """One argument of a subcommand."""

    names: tuple[str, ...]  # option strings (``-o``, ``--output``), or the positional's name
    value: str  # what follows an option (its metavar or choices); for a positional, its count
    default: str  # empty when there is none worth showing
    help: str  # with ``%(default)s`` and the like expanded

    @property
    def long_options(self) -> tuple[str, ...]:
        return tuple(name for name in self.names if name.startswith("--"))


@dataclass(frozen=True)
class CliCommand:
    """A subcommand of ``memsentry``."""

    name: str
    prog: str  # ``memsentry run``
    summary: str  # the one line ``memsentry --help`` shows
    description: str
    usage: str
    arguments: tuple[CliArgument, ...]


def _subcommands(parser: argparse.ArgumentParser
                 ) -> Iterator[tuple[str, argparse.ArgumentParser, str]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            summaries = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, sub in action.choices.items():
                yield name, sub, summaries.get(name, "")


def _usage(parser: argparse.ArgumentParser) -> str:
    formatter = argparse.HelpFormatter(parser.prog, width=USAGE_WIDTH)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return formatter.format_help().strip()


def _expand(action: argparse.Action, prog: str) -> str:
    """The action's help with its ``%(name)s`` fields filled in, as argparse prints it."""
    text = action.help or ""
    if "%" not in text:
        return text
    params: dict[str, Any] = {"prog": prog}
    for name, value in vars(action).items():
        if value is argparse.SUPPRESS:
            continue
        params[name] = getattr(value, "__name__", value)
    if params.get("choices") is not None:
        params["choices"] = ", ".join(str(choice) for choice in params["choices"])
    return text % params


def _value(action: argparse.Action) -> str:
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        return "{" + ",".join(str(choice) for choice in action.choices) + "}"
    if not action.option_strings:
        if action.nargs == argparse.REMAINDER:
            return "all that follows"
        return {"?": "optional", "*": "any number", "+": "one or more"}.get(str(action.nargs),
                                                                             "")
    if action.nargs == 0:
        return ""
    metavar = action.metavar or action.dest.upper()
    return metavar if isinstance(metavar, str) else " ".join(metavar)


def _default(action: argparse.Action) -> str:
    default = action.default
    if default is None or default is False or default is argparse.SUPPRESS:
        return ""
    if action.option_strings and action.nargs == 0:
        return ""  # a switch: what its destination holds without it says nothing to users
    if not action.option_strings and default == []:
        return ""
    return str(default)


def cli_commands(parser: argparse.ArgumentParser | None = None, only: str | None = None
                 ) -> list[CliCommand]:
    """Each subcommand of ``memsentry`` (or of ``parser``), or just the one named ``only``
    (``KeyError`` when there is no such subcommand)."""
    if parser is None:
        from memsentry.cli import build_parser

        parser = build_parser()
    commands = []
    for name, sub, summary in _subcommands(parser):
        if only is not None and name != only:
            continue
        arguments = tuple(
            CliArgument(
                names=tuple(action.option_strings) or (str(action.metavar or action.dest),),
                value=_value(action), default=_default(action), help=_expand(action, sub.prog),
            )
            for action in sub._actions if action.help is not argparse.SUPPRESS
        )
        commands.append(CliCommand(name=name, prog=sub.prog, summary=summary,
                                   description=sub.description or "", usage=_usage(sub),
                                   arguments=arguments))
    if only is not None and not commands:
        known = ", ".join(name for name, _, _ in _subcommands(parser))
        raise KeyError(f"memsentry has no subcommand {only!r}; it has {known}")
    return commands


# -- the report's JSON ----------------------------------------------------------------------


@dataclass(frozen=True)
class Piece:
    """A piece of a type's description: ``text``, ``code`` (a value, in code type) or
    ``link`` (the name of a dataclass whose table it links to)."""

    kind: str
    text: str


@dataclass(frozen=True)
class SchemaField:
    """One key of a JSON object."""

    name: str
    type: tuple[Piece, ...]
    notes: tuple[str, ...]

    @property
    def type_text(self) -> str:
        return "".join(piece.text for piece in self.type)


@dataclass(frozen=True)
class SchemaObject:
    """The JSON object a dataclass is written as."""

    cls: type
    name: str
    anchor: str
    doc: str  # the first paragraph of the class's docstring, reStructuredText
    fields: tuple[SchemaField, ...]


def anchor(cls: type) -> str:
    """The id of a class's section on the schema page (also its label)."""
    return anchor_of(cls.__name__)


def anchor_of(name: str) -> str:
    """:func:`anchor` of the class called ``name``."""
    return f"schema-{name.lower()}"


_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean"}


def _dataclasses_in(kind: Any) -> Iterator[type]:
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        yield kind
    for argument in typing.get_args(kind):
        yield from _dataclasses_in(argument)


def _joined(kinds: Sequence[Any], between: str) -> list[Piece]:
    pieces: list[Piece] = []
    for i, kind in enumerate(kinds):
        pieces += [Piece("text", between)] * bool(i) + describe(kind)
    return pieces


def _describe_generic(kind: Any) -> list[Piece] | None:
    """Unions, tuples and dicts; ``None`` for anything else."""
    origin = typing.get_origin(kind)
    arguments = typing.get_args(kind)
    if origin in (types.UnionType, typing.Union):
        pieces = _joined([arm for arm in arguments if arm is not type(None)], " or ")
        if type(None) in arguments:
            pieces += [Piece("text", " or "), Piece("code", "null")]
        return pieces
    if origin is tuple and len(arguments) == 2 and arguments[1] is Ellipsis:
        return [Piece("text", "array of "), *describe(arguments[0])]
    if origin is tuple:
        return [Piece("text", f"array of {len(arguments)}: ["), *_joined(arguments, ", "),
                Piece("text", "]")]
    if origin is dict:
        if arguments[1] is Any:
            return [Piece("text", "object (free-form)")]
        return [Piece("text", "object of "), *describe(arguments[1])]
    return None


def describe(kind: Any) -> list[Piece]:
    """A type hint as JSON: ``integer``, ``array of`` X, an object linked to its table, a
    string that is one of an enum's values, ``or null`` when optional."""
    generic = _describe_generic(kind)
    if generic is not None:
        return generic
    if kind is Any:
        return [Piece("text", "any JSON value")]
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        return [Piece("text", "object "), Piece("link", kind.__name__)]
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        values = [Piece("code", str(member.value)) for member in kind]
        pieces = [Piece("text", "string, one of ")]
        for i, value in enumerate(values):
            pieces += [Piece("text", ", ")] * bool(i) + [value]
        return pieces
    if kind in _SCALARS:
        return [Piece("text", _SCALARS[kind])]
    raise TypeError(f"no JSON spelling for the type {kind!r}")


def _first_paragraph(cls: type) -> str:
    doc = inspect.cleandoc(cls.__doc__ or "")
    if doc.startswith(f"{cls.__name__}("):  # the signature dataclasses make up
        return ""
    return doc.split("\n\n", 1)[0]


def _fields(cls: type) -> list[SchemaField]:
    from memsentry.model.codec import SIGNED

    hints = typing.get_type_hints(cls)
    rows = []
    for field in dataclasses.fields(cls):
        notes = []
        required = (field.default is dataclasses.MISSING
                    and field.default_factory is dataclasses.MISSING)
        if required:
            notes.append("required")
        if SIGNED.items() <= field.metadata.items():
            notes.append("may be negative")
        if not field.init:
            notes.append("not read back")
        rows.append(SchemaField(field.name, tuple(describe(hints[field.name])), tuple(notes)))
    return rows


def _extra_keys(root: type) -> list[tuple[SchemaField, Any]]:
    """The keys ``to_dict`` writes besides the root's fields, with their types: ``schema``
    and the values derived from the fields (properties)."""
    from memsentry.model.report import SCHEMA_VERSION

    written = root(device="cpu", backend="cpu", baseline=0).to_dict()
    names = {field.name for field in dataclasses.fields(root)}
    keys: list[tuple[SchemaField, Any]] = [(SchemaField(
        "schema", (Piece("text", "integer"),),
        (f"the version of this layout: {SCHEMA_VERSION} (1, memsentry 0.1.0's, is read "
         "and upgraded); top level only",)), int)]
    for key in written:
        if key in names or key == "schema":
            continue
        hint = typing.get_type_hints(getattr(root, key).fget)["return"]
        keys.append((SchemaField(key, tuple(describe(hint)),
                                 ("derived from the other fields when written, ignored when "
                                  "read; top level only",)), hint))
    return keys


def schema_objects(root: type | None = None) -> list[SchemaObject]:
    """The root of a saved report (``ReportData``, what ``Report.to_dict()`` writes) and
    every dataclass it nests, root first, then in the order they are met."""
    if root is None:
        from memsentry.model import ReportData

        root = ReportData
    extras = _extra_keys(root)
    order: list[type] = [root]
    objects = []
    for cls in order:  # grows as classes are met
        rows = _fields(cls)
        hints = typing.get_type_hints(cls)
        kinds = [hints[field.name] for field in dataclasses.fields(cls)]
        if cls is root:
            rows = [extras[0][0], *rows, *(row for row, _ in extras[1:])]
            kinds += [hint for _, hint in extras[1:]]
        for kind in kinds:
            for found in _dataclasses_in(kind):
                if found not in order:
                    order.append(found)
        objects.append(SchemaObject(cls, cls.__name__, anchor(cls), _first_paragraph(cls),
                                    tuple(rows)))
    return objects


# -- text -----------------------------------------------------------------------------------

_CODE = re.compile(r"`([^`\n]+)`|(?<![\w-])(--[a-z][\w-]*)")


def code_spans(text: str) -> list[tuple[bool, str]]:
    """``text`` cut into (is code, piece): what a help string puts in backquotes is code,
    and so is a long option (``--json``)."""
    pieces: list[tuple[bool, str]] = []
    last = 0
    for match in _CODE.finditer(text):
        if match.start() > last:
            pieces.append((False, text[last:match.start()]))
        pieces.append((True, match.group(1) or match.group(2)))
        last = match.end()
    if last < len(text):
        pieces.append((False, text[last:]))
    return pieces


__all__ = [
    "USAGE_WIDTH",
    "CliArgument",
    "CliCommand",
    "Piece",
    "RuleEntry",
    "SchemaField",
    "SchemaObject",
    "anchor",
    "anchor_of",
    "cli_commands",
    "code_spans",
    "describe",
    "rule_entries",
    "schema_objects",
]
