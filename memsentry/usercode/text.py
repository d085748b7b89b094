"""Text that comes from the watched program (module and variable names, holder paths, file
paths, exception messages), made safe to print.

A name may hold anything: ``model.add_module("\\x1b]0;title\\x07\\x1b[2J", layer)`` is
allowed, and printed as it is it would retitle and clear the terminal. The text reporters
print such strings through :func:`printable`, which writes the characters that would act
on a terminal (or hide the text around them) as visible escapes: ``\\x1b``, ``\\u202e``.
The values themselves are not changed: the JSON report keeps them as they were.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import re
import typing
from typing import Any, TypeVar

T = TypeVar("T")

#: C0 controls (newline and tab included: inside a name they are not layout), DEL, C1
#: controls, the bidirectional marks, embeddings, overrides and isolates (which reorder the
#: text around them), the line and paragraph separators, and lone surrogates (which no
#: terminal encoding can write).
UNSAFE = re.compile(
    "[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069"
    "\ud800-\udfff]"
)


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str) -> str:
    """``text`` with every character :data:`UNSAFE` matches written as an escape (``\\x1b``,
    ``\\u202e``); the same string when there is none."""
    return UNSAFE.sub(_escape, text) if UNSAFE.search(text) else text


_SURROGATE = re.compile("[\ud800-\udfff]")


def encodable(text: str) -> str:
    """``text`` with its lone surrogates (an undecodable byte of a file name, kept by
    ``surrogateescape``) written as escapes (``\\udcff``), so that it encodes as UTF-8: for
    outputs, such as HTML, that keep every other character as it is."""
    return _SURROGATE.sub(_escape, text) if _SURROGATE.search(text) else text


def printable_values(value: T) -> T:
    """``value`` with every string inside it made :func:`printable`: the fields of
    dataclasses (rebuilt with :func:`dataclasses.replace`), the items of tuples and lists,
    the keys and values of dicts. The same object, not a copy, where no string changed."""
    result: T = _printable(value)
    return result


@functools.cache
def _text_fields(cls: type) -> tuple[str, ...]:
    """The fields of the dataclass ``cls`` whose declared type may hold a string: a report
    of 10,000 iterations is walked through one field of each (its breakdown's layer)."""
    try:
        hints = typing.get_type_hints(cls)
    except (NameError, TypeError):  # a hint that does not resolve: every field may
        hints = {}
    return tuple(f.name for f in dataclasses.fields(cls)
                 if f.init and _may_hold_text(hints.get(f.name, Any), set()))


def _may_hold_text(kind: Any, seen: set[Any]) -> bool:
    if _holds_no_text(kind):
        return False
    args = typing.get_args(kind)
    if args:
        return any(_may_hold_text(arg, seen) for arg in args if arg is not Ellipsis)
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        return _fields_may_hold_text(kind, seen)
    return True  # str, Any, and anything not known to hold none


def _holds_no_text(kind: Any) -> bool:
    """Numbers, booleans, ``None`` and enums (whose values are memsentry's)."""
    return kind in (int, float, bool, type(None)) or (
        isinstance(kind, type) and issubclass(kind, enum.Enum))


def _fields_may_hold_text(kind: type, seen: set[Any]) -> bool:
    """Whether a field of the dataclass ``kind`` may hold a string (``seen``: the dataclasses
    already asked about, above it)."""
    if kind in seen:  # a value nested in its own kind (a report's ranks)
        return False
    seen.add(kind)
    return any(_may_hold_text(hint, seen) for hint in typing.get_type_hints(kind).values())


def _printable(value: Any) -> Any:
    kind = type(value)
    if kind is str:
        return printable(value)
    if kind in (int, float, bool) or value is None:
        return value
    if kind is tuple or kind is list:
        return _printable_items(value)
    if kind is dict:
        return _printable_dict(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _printable_fields(value)
    return value  # enums (their values are memsentry's), and anything else as it is


def _printable_items(value: list[Any] | tuple[Any, ...]) -> Any:
    """A tuple or list with its items made printable: the same object when none changed."""
    items = [_printable(item) for item in value]
    changed = any(new is not old for new, old in zip(items, value, strict=True))
    return type(value)(items) if changed else value


def _printable_dict(value: dict[Any, Any]) -> dict[Any, Any]:
    """A dict with its keys and values made printable: the same object when none changed."""
    pairs = [(_printable(key), _printable(item)) for key, item in value.items()]
    changed = any(new_key is not key or new is not item
                  for (new_key, new), (key, item) in zip(pairs, value.items(), strict=True))
    return dict(pairs) if changed else value


def _printable_fields(value: Any) -> Any:
    """A dataclass with its text fields made printable (rebuilt with
    :func:`dataclasses.replace`): the same object when none changed."""
    changes = {}
    kind: type = type(value)
    for name in _text_fields(kind):
        old = getattr(value, name)
        new = _printable(old)
        if new is not old:
            changes[name] = new
    return dataclasses.replace(value, **changes) if changes else value


__all__ = ["UNSAFE", "encodable", "printable", "printable_values"]
