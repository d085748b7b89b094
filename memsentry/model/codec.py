"""Values to plain data and back: dicts, lists, strings and numbers that ``json`` writes.

Driven by the dataclasses' type hints, so a new field needs no code here: nested values,
enums, tuples and optional fields are rebuilt as their declared types. Unknown keys are
ignored (a file from a newer memsentry still reads).

Reading checks as it rebuilds, so that a value read holds only its declared types: a
``null`` where the field is not optional, a string where a number belongs, a number that is
not finite or not below 2**64, a negative count, size or time (numbers are 0 or more unless
their field carries :data:`SIGNED`), data nested deeper than :data:`MAX_DEPTH`: each raises
:class:`~memsentry.errors.ReportError` naming the field's path
(``Report.iterations[3].allocated``), what it holds and what was expected.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from memsentry.errors import ReportError

T = TypeVar("T")

#: Field metadata (``field(metadata=SIGNED)``): this number may be below zero (a change, a
#: difference). Every other number of a report is a count, a size or a time: 0 or more.
SIGNED: Mapping[str, bool] = types.MappingProxyType({"signed": True})

#: No count, size or time memsentry writes comes near 2**64 (bytes: 16 EiB).
LIMIT = 2**64

#: Levels of lists and objects a value may nest (a report nests 9: its ranks' censuses'
#: holders' paths' steps).
MAX_DEPTH = 32


def to_plain(value: Any) -> Any:
    """``value`` as plain data: dataclasses become dicts, enums their value, tuples lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple | list):
        return [to_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: to_plain(item) for key, item in value.items()}
    return value


@functools.cache
def _fields(cls: type) -> tuple[tuple[str, Any, bool, bool], ...]:
    """(name, type, signed, required) of each field of the dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    return tuple(
        (f.name, hints[f.name], bool(f.metadata.get("signed")),
         f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
        for f in dataclasses.fields(cls) if f.init
    )


def _whole(data: int) -> str:
    """A whole number, or how many digits it has when it has more than 24."""
    digits = len(str(abs(data)))
    return str(data) if digits <= 24 else f"a whole number of {digits} digits"


def _text(data: str) -> str:
    """A string quoted, its first 40 characters when it is longer."""
    return repr(data if len(data) <= 40 else data[:40] + "…")


def _counted(count: int, noun: str) -> str:
    """``1 item``, ``2 items``."""
    return f"{count} {noun}{'s' * (count != 1)}"


#: How :func:`found` spells each JSON type, in the order checked (``bool`` before ``int``,
#: which it is a kind of).
_SPELLINGS: tuple[tuple[type, Callable[[Any], str]], ...] = (
    (bool, lambda data: "true" if data else "false"),
    (int, _whole),
    (float, repr),
    (str, _text),
    (list, lambda data: f"a list of {_counted(len(data), 'item')}"),
    (dict, lambda data: f"an object with {_counted(len(data), 'key')}"),
)


def found(data: Any) -> str:
    """What a plain value is, for a message: its JSON spelling, shortened."""
    if data is None:
        return "null"
    for kind, spell in _SPELLINGS:
        if isinstance(data, kind):
            return spell(data)
    return type(data).__name__


#: The names of the generic types whose arguments the messages leave out.
_GENERIC_NAMES: Mapping[Any, str] = types.MappingProxyType({tuple: "a list", dict: "an object"})


def _name(kind: Any) -> str:
    """A type as the messages spell it."""
    origin = typing.get_origin(kind)
    if origin in (types.UnionType, typing.Union):
        return " or ".join("null" if arm is type(None) else _name(arm)
                           for arm in typing.get_args(kind))
    if kind is Any:
        return "plain data"
    if origin in _GENERIC_NAMES:
        return _GENERIC_NAMES[origin]
    return _class_name(kind)


def _class_name(kind: Any) -> str:
    """A class (a dataclass, an enum, a scalar) as the messages spell it."""
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        return f"an object ({kind.__name__})"
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return "one of " + ", ".join(repr(member.value) for member in kind)
    return getattr(kind, "__name__", str(kind))


def _bad(where: str, expected: str, data: Any) -> ReportError:
    return ReportError(f"expected {expected}, got {found(data)}", field=where)


def from_plain(kind: Any, data: Any, where: str = "value", *, signed: bool = False,
               depth: int = 0) -> Any:
    """Rebuild a value of type ``kind`` from what :func:`to_plain` made of it, checking it on
    the way; ``where`` names it in the :class:`~memsentry.errors.ReportError` raised when
    ``data`` is not one."""
    _within_depth(depth, where)
    origin = typing.get_origin(kind)
    if origin in (types.UnionType, typing.Union):
        return _union(kind, data, where, signed, depth)
    if kind is Any:
        return _plain(data, where, depth)
    if data is None:
        raise _bad(where, _name(kind), data)
    if origin is tuple:
        return _tuple(kind, data, where, signed, depth)
    if origin is dict:
        return _dict(kind, data, where, depth)
    return _of_class(kind, data, where, signed, depth)


def _of_class(kind: Any, data: Any, where: str, signed: bool, depth: int) -> Any:
    """A value of a class: a dataclass, an enum, a number, a string or a bool."""
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        return build(kind, data, where, depth=depth)
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return _enum(kind, data, where)
    if kind in (int, float):
        return _number(kind, data, where, signed)
    if kind in (str, bool):
        return _exactly(kind, data, where)
    raise TypeError(f"memsentry's codec cannot read a field of type {kind!r} ({where})")


def _exactly(kind: type, data: Any, where: str) -> Any:
    """``data`` when it is a ``kind`` (a string, a bool)."""
    if not isinstance(data, kind):
        raise _bad(where, kind.__name__, data)
    return data


def _within_depth(depth: int, where: str) -> None:
    if depth > MAX_DEPTH:
        raise ReportError(f"nested deeper than {MAX_DEPTH} levels of lists and objects; a "
                          "report nests 9", field=where)


def _enum(kind: type[enum.Enum], data: Any, where: str) -> enum.Enum:
    try:
        return kind(data)
    except (ValueError, TypeError):
        raise _bad(where, _name(kind), data) from None


def _dict(kind: Any, data: Any, where: str, depth: int) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise _bad(where, "an object", data)
    value_kind = typing.get_args(kind)[1]
    return {key: from_plain(value_kind, item, f"{where}[{key!r}]", depth=depth + 1)
            for key, item in data.items()}


def _union(kind: Any, data: Any, where: str, signed: bool, depth: int) -> Any:
    arms = typing.get_args(kind)
    if data is None and type(None) in arms:
        return None
    real = [arm for arm in arms if arm is not type(None)]
    if len(real) == 1:
        if data is None:
            raise _bad(where, _name(kind), data)
        return from_plain(real[0], data, where, signed=signed, depth=depth)
    for arm in real:
        try:
            return from_plain(arm, data, where, signed=signed, depth=depth)
        except ReportError:
            continue
    raise _bad(where, _name(kind), data)


def _tuple(kind: Any, data: Any, where: str, signed: bool, depth: int) -> tuple[Any, ...]:
    if not isinstance(data, list):
        raise _bad(where, "a list", data)
    args = typing.get_args(kind)
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(from_plain(args[0], item, f"{where}[{i}]", signed=signed, depth=depth + 1)
                     for i, item in enumerate(data))
    if len(data) != len(args):
        raise _bad(where, f"a list of {len(args)} items", data)
    return tuple(from_plain(arg, item, f"{where}[{i}]", signed=signed, depth=depth + 1)
                 for i, (arg, item) in enumerate(zip(args, data, strict=True)))


def _is_number(kind: type, data: Any) -> bool:
    """Whether ``data`` is a JSON number that can be a ``kind``: not a bool, and not a float
    where an int belongs."""
    if isinstance(data, bool) or not isinstance(data, int | float):
        return False
    return not (kind is int and isinstance(data, float))


def _as_float(data: int | float, where: str) -> float:
    """``data`` as a float; a whole number too large for one is refused."""
    try:
        return float(data)
    except OverflowError:  # a whole number of 309 digits or more
        raise _bad(where, "float below 2**64", data) from None


def _out_of_range(kind: type, value: int | float, signed: bool) -> str | None:
    """What a number of ``kind`` is expected to be, when ``value`` is not: finite, 0 or more
    unless ``signed``, below 2**64 in size; ``None`` when it is."""
    name = kind.__name__
    if isinstance(value, float) and not math.isfinite(value):
        return f"a finite {name}"
    if not signed and value < 0:
        return f"{name} of 0 or more"
    if abs(value) >= LIMIT:
        return f"{name} below 2**64"
    return None


def _number(kind: type, data: Any, where: str, signed: bool) -> int | float:
    """An int, or a float (a JSON whole number is one too), finite, below 2**64 in size and,
    unless ``signed``, 0 or more."""
    if not _is_number(kind, data):
        raise _bad(where, kind.__name__, data)
    value = _as_float(data, where) if kind is float else data
    expected = _out_of_range(kind, value, signed)
    if expected is not None:
        raise _bad(where, expected, data)
    return value


def _plain(data: Any, where: str, depth: int) -> Any:
    """Free-form data (``Any``: the allocator's counters, NVML's figures): JSON values, nested
    no deeper than :data:`MAX_DEPTH`, numbers finite and below 2**64 in size."""
    _within_depth(depth, where)
    if isinstance(data, dict):
        return {key: _plain(item, f"{where}[{key!r}]", depth + 1) for key, item in data.items()}
    if isinstance(data, list):
        return [_plain(item, f"{where}[{i}]", depth + 1) for i, item in enumerate(data)]
    if isinstance(data, int | float) and not isinstance(data, bool):
        return _number(type(data), data, where, signed=True)
    return data


def build(cls: type[T], data: Any, where: str | None = None, *, depth: int = 0) -> T:
    """An instance of the dataclass ``cls`` from a dict, each field rebuilt as its type and
    checked (see the module's doc); ``where`` names it in messages (``cls``'s name by
    default). Raises :class:`~memsentry.errors.ReportError`."""
    where = where or cls.__name__
    if not isinstance(data, dict):
        raise _bad(where, f"an object ({cls.__name__})", data)
    values = {}
    for name, kind, signed, required in _fields(cls):  # type: ignore[arg-type]
        if name in data:
            values[name] = from_plain(kind, data[name], f"{where}.{name}", signed=signed,
                                      depth=depth + 1)
        elif required:
            raise ReportError(f"missing; expected {_name(kind)}", field=f"{where}.{name}")
    return cls(**values)


__all__ = ["LIMIT", "MAX_DEPTH", "SIGNED", "build", "found", "from_plain", "to_plain"]
