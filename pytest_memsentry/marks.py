"""The plugin's markers: one plain function per marker.

The function's signature is the marker's signature and its docstring is the marker's help
(``pytest --markers``), so documentation and behaviour cannot drift. Markers are checked when
the tests are collected: an unknown or positional argument, or a size memsentry cannot read,
stops the run with a ``pytest.UsageError`` naming the test and what the marker accepts.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from memsentry.units import parse_size

#: What a size argument accepts, for messages.
SIZE_FORMS = "bytes (an int) or a string like '512 KiB', '2GB', '1.5 MiB'"


@dataclass(frozen=True)
class Limits:
    """What one test may do: leave ``max_leak`` bytes allocated on each device after it ends,
    and allocate at most ``max_peak`` bytes at once on each device (``None``: no limit)."""

    max_leak: int = 0
    max_peak: int | None = None


def memsentry(*, max_leak: int | str | None = None,
              max_peak: int | str | None = None) -> dict[str, int]:
    """Check this test for memory leaks, also without --memsentry. max_leak: the memory the
    test may leave allocated on a device after it ends (default --memsentry-max-leak, 0);
    max_peak: the most it may allocate at once on a device (default --memsentry-max-peak, no
    limit). Sizes are bytes or strings like '512 KiB', '2GB', '1.5 MiB'."""
    given = {"max_leak": max_leak, "max_peak": max_peak}
    return {name: parse_size(value) for name, value in given.items() if value is not None}


def no_memsentry() -> None:
    """Do not check this test for memory leaks, even with --memsentry."""


MARKERS: dict[str, Callable[..., Any]] = {"memsentry": memsentry, "no_memsentry": no_memsentry}


def _parameters(function: Callable[..., Any]) -> list[str]:
    return [name for name, parameter in inspect.signature(function).parameters.items()
            if parameter.kind is inspect.Parameter.KEYWORD_ONLY]


def marker_help(name: str) -> str:
    """``name(arg=default, ...): docstring``, the line pytest shows in ``--markers``."""
    function = MARKERS[name]
    arguments = ", ".join(
        f"{p.name}={p.default!r}" for p in inspect.signature(function).parameters.values()
    )
    return f"{name}({arguments}): {inspect.cleandoc(function.__doc__ or '')}".replace("\n", " ")


def _accepts(name: str) -> str:
    parameters = _parameters(MARKERS[name])
    if not parameters:
        return f"@pytest.mark.{name} takes no arguments"
    listed = ", ".join(f"{p}=SIZE" for p in parameters)
    return f"@pytest.mark.{name} accepts {listed}, where SIZE is {SIZE_FORMS}"


def _check(nodeid: str, mark: pytest.Mark) -> dict[str, int]:
    """The marker's validated arguments; ``pytest.UsageError`` naming the test otherwise."""
    function = MARKERS[mark.name]
    if mark.args:
        raise pytest.UsageError(
            f"{nodeid}: @pytest.mark.{mark.name} got positional argument(s) "
            f"{', '.join(map(repr, mark.args))}; {_accepts(mark.name)}"
        )
    unknown = sorted(set(mark.kwargs) - set(_parameters(function)))
    if unknown:
        raise pytest.UsageError(
            f"{nodeid}: @pytest.mark.{mark.name} got unknown argument(s) "
            f"{', '.join(unknown)}; {_accepts(mark.name)}"
        )
    try:
        return function(**mark.kwargs) or {}
    except ValueError as error:
        given = ", ".join(f"{k}={v!r}" for k, v in mark.kwargs.items())
        raise pytest.UsageError(
            f"{nodeid}: @pytest.mark.{mark.name}({given}): {error}"
        ) from None


def limits_for(item: pytest.Item, defaults: Limits, *, enabled: bool) -> Limits | None:
    """The limits ``item`` is checked with, or ``None`` when it is not checked.

    The closest of ``memsentry`` / ``no_memsentry`` decides whether the test is checked (a
    test marked ``memsentry`` is checked without ``--memsentry``; ``enabled`` is the flag).
    Limits come from every ``memsentry`` marker, the closest first (a test's own marker over
    its class's and module's), then from the options. Every marker is validated, also on tests
    that end up unchecked.
    """
    checked: bool | None = None
    given: dict[str, int] = {}
    for mark in item.iter_markers():
        if mark.name not in MARKERS:
            continue
        arguments = _check(item.nodeid, mark)
        if checked is None:
            checked = mark.name == "memsentry"
        for name, value in arguments.items():
            given.setdefault(name, value)
    if not (enabled if checked is None else checked):
        return None
    return Limits(
        max_leak=given.get("max_leak", defaults.max_leak),
        max_peak=given.get("max_peak", defaults.max_peak),
    )


__all__ = ["MARKERS", "Limits", "limits_for", "marker_help", "memsentry", "no_memsentry"]
