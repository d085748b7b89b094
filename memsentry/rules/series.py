"""Trends across censuses: the shared arithmetic of the rules that name holders."""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from memsentry.report import Census, HolderStats, Report

#: Censuses needed before a holder's trend is judged (two steps: three points).
MIN_CENSUSES = 3
#: Steps of the series that must rise.
MIN_RISES = 2

T = TypeVar("T")


@dataclass(frozen=True)
class Trend:
    """A series of one figure across censuses: its values, where they were read and the
    slope per iteration between the first and the last."""

    iterations: tuple[int, ...]
    values: tuple[float, ...]

    @property
    def rises(self) -> int:
        return sum(b > a for a, b in itertools.pairwise(self.values))

    @property
    def falls(self) -> int:
        return sum(b < a for a, b in itertools.pairwise(self.values))

    @property
    def per_iteration(self) -> float:
        span = self.iterations[-1] - self.iterations[0]
        return (self.values[-1] - self.values[0]) / span if span else 0.0

    def climbs(self, *, at_least: float = 2) -> bool:
        """Rises at two steps or more, never falls, and gains ``at_least`` overall."""
        return (
            len(self.values) >= MIN_CENSUSES
            and self.rises >= MIN_RISES
            and not self.falls
            and self.values[-1] - self.values[0] >= at_least
        )


def complete_censuses(report: Report) -> list[Census]:
    """The censuses that finished within their budget (an interrupted one undercounts)."""
    return [c for c in report.censuses if c.complete]


def series(censuses: Sequence[Census], items: Callable[[Census], Sequence[T]],
           key: Callable[[T], str]) -> dict[str, list[T | None]]:
    """Each name's entry at every census, ``None`` where a census did not see it."""
    names: dict[str, None] = {}
    for census in censuses:
        for item in items(census):
            names.setdefault(key(item), None)
    table: dict[str, list[T | None]] = {}
    for name in names:
        row: list[T | None] = []
        for census in censuses:
            row.append(next((i for i in items(census) if key(i) == name), None))
        table[name] = row
    return table


def holder_series(report: Report) -> tuple[list[Census], dict[str, list[HolderStats | None]]]:
    censuses = complete_censuses(report)
    return censuses, series(censuses, lambda c: c.holders, lambda h: h.name)


def trend(censuses: Sequence[Census], row: Sequence[T | None],
          figure: Callable[[T], float]) -> Trend:
    """The figure's values from the first census that saw the entry on (absent later = 0)."""
    start = next((i for i, entry in enumerate(row) if entry is not None), len(row))
    return Trend(
        tuple(c.iteration for c in censuses[start:]),
        tuple(0.0 if e is None else figure(e) for e in row[start:]),
    )


def per_iteration(value: float, noun: str) -> str:
    """``1 tensor/iter``, ``2.5 tensors/iter``."""
    return f"{value:.3g} {noun if value == 1 else noun + 's'}/iter"


def root_name(name: str) -> str:
    """``model`` for ``model.cache['x']``."""
    return re.split(r"[.\[]", name, maxsplit=1)[0]


def describe_holder(holder: HolderStats) -> str:
    """```name``` with what it is (``a local of train()``, ``held through `logger`, a local of
    train()``, ``a class attribute``) and the line that fills it."""
    function = (holder.scope or "").split(" in ", 1)[0]
    kinds = {
        "local": f"a local of {function}" if function else "a local variable",
        "global": f"a global of {holder.scope}" if holder.scope else "a global",
        "class attribute": "a class attribute, shared by every instance",
        "model": "the tracked model",
        "gradient": holder.scope or "a parameter's .grad",
    }
    kind = kinds.get(holder.kind, holder.kind)
    root = root_name(holder.name)
    if root != holder.name and holder.kind in ("local", "global", "model"):
        kind = f"held through `{root}`, {kind}"
    text = f"`{holder.name}` ({kind}"
    if holder.where:
        text += f", {holder.where}"
    return text + ")"


def plural(count: float, noun: str) -> str:
    """``1 tensor``, ``4 tensors``."""
    return f"{count:,} {noun}" if count == 1 else f"{count:,} {noun}s"
