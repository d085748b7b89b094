"""Values to plain data and back: dicts, lists, strings and numbers that ``json`` writes.

Driven by the dataclasses' type hints, so a new field needs no code here: nested values,
enums, tuples and optional fields are rebuilt as their declared types. Unknown keys are
ignored (a file from a newer memsentry still reads).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


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
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def from_plain(kind: Any, data: Any) -> Any:
    """Rebuild a value of type ``kind`` from what :func:`to_plain` made of it."""
    if data is None:
        return None
    origin = typing.get_origin(kind)
    if origin in (types.UnionType, typing.Union):
        arms = [arm for arm in typing.get_args(kind) if arm is not type(None)]
        return from_plain(arms[0], data) if len(arms) == 1 else data
    if origin is tuple:
        args = typing.get_args(kind)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(from_plain(args[0], item) for item in data)
        return tuple(from_plain(arg, item) for arg, item in zip(args, data, strict=False))
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        return build(kind, data)
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return kind(data)
    if kind in _SCALARS and not _fits(kind, data):
        raise ValueError(f"expected {kind.__name__}, got {data!r}")
    return data


#: Scalar field types whose values are checked on the way in (a report edited by hand, or
#: damaged, fails when it is read, not later when a figure is used).
_SCALARS: tuple[type, ...] = (int, float, str, bool)


def _fits(kind: type, data: Any) -> bool:
    if kind is float:
        return isinstance(data, int | float) and not isinstance(data, bool)
    if kind is int:
        return isinstance(data, int) and not isinstance(data, bool)
    return isinstance(data, kind)


def build(cls: type[T], data: dict[str, Any]) -> T:
    """An instance of the dataclass ``cls`` from a dict, each field rebuilt as its type."""
    if not isinstance(data, dict):
        raise ValueError(f"expected an object for {cls.__name__}, got {data!r:.60}")
    hints = _hints(cls)  # type: ignore[arg-type]
    values = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in data:
            try:
                values[f.name] = from_plain(hints[f.name], data[f.name])
            except (TypeError, ValueError) as error:
                raise ValueError(f"{cls.__name__}.{f.name}: {error}") from None
    try:
        return cls(**values)
    except TypeError as error:  # a required field is missing
        raise ValueError(f"{cls.__name__}: {error}") from None


__all__ = ["build", "from_plain", "to_plain"]
