"""The shared arithmetic of the rules: the iterations after warm-up, and trends across
censuses of the figures of one holder (or one module's hooks)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from memsentry.model import (
    Census,
    HolderKind,
    HolderStats,
    IterationStats,
    ReportData,
    ScopeKind,
    Step,
    StepKind,
    complete,
    spell,
)
from memsentry.model.places import until_subscript
from memsentry.model.timeline import slope

#: Iterations left out at the start: gradient buffers, optimizer state (Adam keeps two
#: tensors per parameter) and allocator pools appear in the first steps.
WARMUP = 2
#: The share of the pace a growth kept until its latest census that the latest step must
#: keep for the growth to go on (a leak grows through the run, not only its first steps).
KEEP_PACE = 0.25
#: Censuses needed before a holder's trend is judged (two steps: three points).
MIN_CENSUSES = 3
#: Steps of the series that must rise.
MIN_RISES = 2

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)


def after_warmup(report: ReportData) -> list[IterationStats]:
    """The iterations a boundary closed, after the warm-up ones."""
    return complete(report.iterations, skip=WARMUP)


@dataclass(frozen=True)
class Trend:
    """A series of one figure across censuses: its values, where they were read and the
    slope per iteration between the first and the last.

    Growth is judged within *windows*: the runs of censuses between two falls. A container
    cleared every epoch grows within each epoch and falls at its start, a sawtooth whose
    teeth grow with the epoch's length; a bounded one (a ``deque(maxlen=k)``, a cache of a few
    shapes) fills and then stays flat.
    """

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

    def windows(self) -> list[tuple[int, int]]:
        """(first, last) positions of each run of censuses between falls."""
        runs, start = [], 0
        for position, (a, b) in enumerate(itertools.pairwise(self.values), start=1):
            if b < a:
                runs.append((start, position - 1))
                start = position
        runs.append((start, len(self.values) - 1))
        return runs

    def _rises_in(self, first: int, last: int) -> int:
        return sum(b > a for a, b in itertools.pairwise(self.values[first:last + 1]))

    def climbs(self, *, at_least: float = 2, teeth: bool = True) -> bool:
        """Growth that goes on: within the latest window the figure rose at two steps or
        more, gained ``at_least``, and still rose at the latest census (a container that
        filled up and stays full does not climb); or, with ``teeth``, an earlier window was a
        whole tooth (see ``teeth``)."""
        if len(self.values) < MIN_CENSUSES:
            return False
        runs = self.windows()
        first, last = runs[-1]
        latest = self.values[first:last + 1]
        if (len(latest) >= MIN_CENSUSES and self._rises_in(first, last) >= MIN_RISES
                and latest[-1] - latest[0] >= at_least and self._keeps_pace(first, last)):
            return True
        return teeth and bool(self.teeth(at_least=at_least, runs=runs))

    def _keeps_pace(self, first: int, last: int) -> bool:
        """Whether the window's latest step still rose, by at least :data:`KEEP_PACE` of what
        the window's pace before it promised over its iterations: a container that fills to
        a size between two censuses (a list kept below 40 entries, the 40th added well
        before the last census) rose at that step by a fraction of its pace."""
        before = self.iterations[last - 1] - self.iterations[first]
        gained = self.values[last] - self.values[last - 1]
        if gained <= 0:
            return False
        if before <= 0:
            return True
        pace = (self.values[last - 1] - self.values[first]) / before
        return gained >= KEEP_PACE * pace * (self.iterations[last] - self.iterations[last - 1])

    def teeth(self, *, at_least: float = 2, runs: list[tuple[int, int]] | None = None
              ) -> list[tuple[int, int]]:
        """The windows, before the latest, in which the figure rose at two steps or more and
        gained ``at_least`` before it fell: what an epoch's reset shows of a leak that grows
        with the epoch. The tooth is the evidence; what follows the fall (a census that lands
        just after the reset sees little) does not veto it. ``runs``: the windows, when the
        caller has them."""
        runs = self.windows() if runs is None else runs
        return [(a, b) for a, b in runs[:-1] if self._rises_in(a, b) >= MIN_RISES
                and self.values[b] - self.values[a] >= at_least]

    @property
    def window_per_iteration(self) -> float:
        """The slope within the window that grew most per iteration."""
        best = 0.0
        for a, b in self.windows():
            span = self.iterations[b] - self.iterations[a]
            if span:
                best = max(best, (self.values[b] - self.values[a]) / span)
        return best


#: A holder whose tensors stay as many but whose bytes rise (one tensor rebuilt larger every
#: step: ``bank = torch.cat([bank, x])``) leaks when, within the latest window, its bytes rose
#: at each of at least ``GROWING_POINTS`` censuses, by ``GROWING_BYTES`` an iteration or more,
#: at a steady pace (no step's rate more than ``GROWING_STEADY`` times another's). Tensors
#: whose size follows the batch (variable sequence lengths) rise and fall at random: five
#: rises in a row at one pace is not what they do.
GROWING_BYTES = 4 * 1024
GROWING_POINTS = 5
GROWING_STEADY = 4.0


def _rising_rates(size: Trend, points: int) -> list[float] | None:
    """The bytes an iteration gained between censuses of the latest window, when they rose at
    each of ``points`` censuses at least, by ``GROWING_BYTES`` an iteration over the window;
    ``None`` otherwise."""
    first, last = size.windows()[-1]
    values, its = size.values[first:last + 1], size.iterations[first:last + 1]
    if len(values) < points or its[-1] == its[0]:
        return None
    rates = [(b - a) / (j - i) for (a, b), (i, j)
             in zip(itertools.pairwise(values), itertools.pairwise(its), strict=True)]
    if min(rates) <= 0 or (values[-1] - values[0]) / (its[-1] - its[0]) < GROWING_BYTES:
        return None
    return rates


def grows_steadily(size: Trend, points: int = GROWING_POINTS) -> bool:
    """Bytes that rose at every census of the latest window, steadily (see ``GROWING_*``),
    over ``points`` censuses at least."""
    rates = _rising_rates(size, points)
    return rates is not None and max(rates) <= GROWING_STEADY * min(rates)


def grows_faster(size: Trend, points: int = GROWING_POINTS) -> bool:
    """Bytes that rose at every census of the latest window, over ``points`` censuses at least,
    at a pace that never fell below ``1 / GROWING_STEADY`` of the one before and ends at least
    where it began: enough for a holder whose line builds it from itself (``bank =
    torch.cat([bank, x])``), which grows faster and faster when what it is fed grows too (a
    bank of ever longer sequences gained 7, 9, 11, 16, 25 and 42 KiB an iteration). A window
    bounded by slicing (``torch.cat([w, out])[-k:]``) rises while it fills, then follows the
    batch: its pace falls."""
    rates = _rising_rates(size, points)
    if rates is None or rates[-1] < rates[0]:
        return False
    return all(b * GROWING_STEADY >= a for a, b in itertools.pairwise(rates))


def growth_rate(trend: Trend) -> float:
    """Per iteration: across all censuses, or within the steepest window of a sawtooth."""
    return trend.window_per_iteration if trend.falls else trend.per_iteration


def sawtooth_note(trend: Trend) -> str:
    """For a series that fell and grew again: where it fell, and what that means."""
    if not trend.falls:
        return ""
    later = trend.windows()[1:]
    at = ", ".join(str(trend.iterations[a]) for a, _b in later)
    again = " and grew again" if any(b > a for a, b in later) else ""
    return (f"; it fell before iteration {at} (emptied or rebound){again}: what it keeps "
            "grows with the time between clears (an epoch's length), and real epochs are "
            "long")


#: The step from an exception to its traceback.
TRACEBACK = Step(StepKind.ATTRIBUTE, "__traceback__")


def held_count(holder: HolderStats) -> float:
    """What a holder keeps, counted: tensors, whole models, NumPy arrays, autograd nodes,
    byte buffers."""
    return holder.held


def base_name(holder: HolderStats) -> str:
    """The holder's name up to its first subscript: ``history`` for ``history[0]``."""
    return spell(until_subscript(holder.path))


def complete_censuses(report: ReportData, *, graphs: bool = False) -> list[Census]:
    """The censuses that finished within their budget (an interrupted one undercounts); with
    ``graphs``, also those whose autograd graphs were walked whole. Not the one taken as
    tracking ended: the rules judge growth on the censuses of the schedule, whose spacing
    their figures assume, and that one only says whether growth went on to the end
    (:mod:`memsentry.rules.closing`)."""
    return [c for c in report.censuses
            if c.complete and (c.graphs_complete or not graphs) and not c.closing]


def series(censuses: Sequence[Census], items: Callable[[Census], Sequence[T]],
           key: Callable[[T], K]) -> dict[K, list[T | None]]:
    """Each key's entry at every census, ``None`` where a census did not see it."""
    table: dict[K, list[T | None]] = {}
    for position, census in enumerate(censuses):
        for item in items(census):
            row = table.setdefault(key(item), [None] * len(censuses))
            if row[position] is None:
                row[position] = item
    return table


#: The complete censuses, and each holder's entry (by path) at every one of them.
HolderSeries = tuple[list[Census], dict[tuple[Step, ...], list[HolderStats | None]]]


def holder_series(report: ReportData, *, graphs: bool = False) -> HolderSeries:
    """The complete censuses (``graphs``: with their graphs walked whole), and each holder's
    entry (by path) at every one of them."""
    censuses = complete_censuses(report, graphs=graphs)
    return censuses, series(censuses, lambda c: c.holders, lambda h: h.path)


def last_seen(row: Sequence[object | None]) -> int | None:
    """The position of the latest census that saw the holder (a census that lands just after
    an epoch's reset may not), or ``None``."""
    return next((i for i in range(len(row) - 1, -1, -1) if row[i] is not None), None)


def latest(row: Sequence[T | None]) -> T | None:
    """The holder's entry at the latest census that saw it."""
    position = last_seen(row)
    return None if position is None else row[position]


def trend(censuses: Sequence[Census], row: Sequence[T | None],
          figure: Callable[[T], float]) -> Trend:
    """The figure's values from the first census that saw the entry on (absent later = 0)."""
    start = next((i for i, entry in enumerate(row) if entry is not None), len(row))
    return Trend(
        tuple(c.iteration for c in censuses[start:]),
        tuple(0.0 if e is None else figure(e) for e in row[start:]),
    )


def growing_since(censuses: Sequence[Census], row: Sequence[HolderStats | None]) -> int | None:
    """The iteration of the first census of the holder's latest window (see :class:`Trend`):
    what it keeps has not fallen at any census since. ``None`` when no census saw it.
    ``censuses`` and ``row`` as :func:`holder_series` gives them."""
    kept = trend(censuses, row, held_count)
    if not kept.values:
        return None
    first, _last = kept.windows()[-1]
    return kept.iterations[first]


def reaches_back(censuses: Sequence[Census], row: Sequence[HolderStats | None]) -> bool:
    """Whether the holder's graph grows with what outlived a census: the nodes it kept from
    before the census before (``graph_kept``) climb, as a sum carried from step to step
    keeps every earlier step's graph. A graph built anew every step (a loss whose input grows
    longer) keeps none; one that holds an old graph of a fixed size beside this step's (two
    variables of one name) keeps as many. Where only the ages were read, at some census the
    oldest node is at or below the newest node the census before saw (see
    ``memsentry.census.graphs``); where neither was (a report of an older memsentry, or
    built by hand), it is taken to."""
    if any(h is not None and h.graph_kept is not None for h in row):
        return trend(censuses, row, lambda h: h.graph_kept or 0).climbs()
    return _oldest_reaches_back(censuses, row)


def _oldest_reaches_back(censuses: Sequence[Census], row: Sequence[HolderStats | None]
                         ) -> bool:
    """:func:`reaches_back` from the ages alone (the oldest node against the newest the
    census before saw); ``True`` where no census read them."""
    read = False
    for position in range(1, len(row)):
        holder, census = row[position], censuses[position]
        before = censuses[position - 1].graph_newest
        if holder is None or census.carried is not None or holder.graph_oldest is None \
                or before is None:
            continue  # a carried census repeats the one before: it proves nothing
        read = True
        if holder.graph_oldest <= before:
            return True
    return not read


def per_iteration(value: float, noun: str) -> str:
    """``1 tensor/iter``, ``2.5 tensors/iter``."""
    return f"{value:.3g} {noun if value == 1 else noun + 's'}/iter"


def function_of(holder: HolderStats) -> str | None:
    """The function whose local the holder is, spelled ``train()``."""
    scope = holder.scope
    return f"{scope.name}()" if scope is not None and scope.kind == ScopeKind.FUNCTION else None


def describe_holder(holder: HolderStats) -> str:
    """```name``` with what it is (``a local of train()``, ``held through `logger`, a local of
    train()``, ``a class attribute``) and the line that fills it."""
    return f"`{holder.name}` ({_what_holder(holder)}{_filled_at(holder)})"


#: Holder kinds reached through another object when their path is longer than the root.
_REACHED = (HolderKind.LOCAL, HolderKind.GLOBAL, HolderKind.MODEL)


def _what_holder(holder: HolderStats) -> str:
    """What the holder is, and the root it is held through when that is not itself."""
    kind = _holder_kind(holder)
    if holder.kind == HolderKind.PACKAGE:
        package = holder.scope.name if holder.scope else holder.root
        return f"a global of the installed package `{package}`"
    if len(holder.path) > 1 and holder.kind in _REACHED:
        return f"held through `{holder.root}`, {kind}"
    return kind


def _holder_kind(holder: HolderStats) -> str:
    """``a local of train()``, ``a class attribute, shared by every instance``, ..."""
    function = function_of(holder)
    kinds = {
        HolderKind.LOCAL: f"a local of {function}" if function else "a local variable",
        HolderKind.GLOBAL: f"a global of {holder.scope}" if holder.scope else "a global",
        HolderKind.CLASS_ATTRIBUTE: "a class attribute, shared by every instance",
        HolderKind.MODEL: "the tracked model",
        HolderKind.INSTANCE: f"an attribute of `{holder.root}`, the {holder.scope.name}"
        if holder.scope else f"an attribute of `{holder.root}`",
        HolderKind.GRADIENT: f"{holder.items} parameter .grad tensors" if holder.items
        else "a parameter's .grad",
    }
    return kinds.get(holder.kind, str(holder.kind))


def _filled_at(holder: HolderStats) -> str:
    """The line that fills the holder: ``, train.py:12``; for one filled inside a method of
    its class, where it is set and the line that called the method."""
    if holder.feed is not None and holder.where:
        function = f" in `{holder.where.function}()`" if holder.where.function else ""
        return f"; set at {holder.where}{function}, called from {holder.feed.where}"
    if holder.where:
        return f", {holder.where}"
    return ""


def plural(count: float, noun: str) -> str:
    """``1 tensor``, ``4 tensors``."""
    return f"{count:,} {noun}" if count == 1 else f"{count:,} {noun}s"


#: How allocated memory must grow to be steady (:func:`steady_growth`).
#: Share of consecutive iterations that must end higher than the one before.
MIN_RISING_SHARE = 0.75
#: Below this rate growth is noise of the measurement (malloc bookkeeping on CPU).
MIN_RATE = 1024
#: Share of all the rises that must still be held at the end: a leak keeps what it gains,
#: a list cleared every epoch (a sawtooth) gives it back.
MIN_RETAINED_SHARE = 0.5
#: The latest iterations (this share of them, two at least: on a short series three would
#: be most of it) must still grow at this share of the overall rate: a window that filled up
#: and stays full has stopped growing (L-BFGS's history, full after 5 of 6 steps, grew by
#: 0.5 MiB at the last step after 10 MiB at each of the steps before).
RECENT_SHARE = 1 / 3
MIN_RECENT_RATE_SHARE = 0.25


def steady_growth(its: list[IterationStats]) -> tuple[float, float] | None:
    """(bytes per iteration, share of rising steps) when the allocated memory of ``its`` grows
    steadily (the ``memory-growth`` judgement), else None (also with fewer than four)."""
    return steady_climb([(it.index, it.allocated) for it in its])


def steady_climb(points: Sequence[tuple[int, int]]) -> tuple[float, float] | None:
    """(bytes per iteration, share of rising steps) when the figures of ``points``
    (iteration, bytes), in order, grow steadily, else None (also with fewer than four): most
    steps rise, the figure keeps what it gained, and the latest steps still rise."""
    if len(points) < 4:
        return None
    steps = [b - a for (_, a), (_, b) in itertools.pairwise(points)]
    rising = sum(step > 0 for step in steps) / len(steps)
    rate = slope(points)
    if rate is None or rising < MIN_RISING_SHARE or rate < MIN_RATE:
        return None
    if _gave_back(points, steps):
        return None  # memory given back: a sawtooth or a bounded cache, not a climb
    if _stopped(points, rate):
        return None  # it grew, then stopped: a window or cache that filled up
    return rate, rising


def _gave_back(points: Sequence[tuple[int, int]], steps: Sequence[int]) -> bool:
    """Whether the figure ends holding less than ``MIN_RETAINED_SHARE`` of all its rises."""
    gained = sum(step for step in steps if step > 0)
    return points[-1][1] - points[0][1] < MIN_RETAINED_SHARE * gained


def _stopped(points: Sequence[tuple[int, int]], rate: float) -> bool:
    """Whether the latest points (``RECENT_SHARE`` of them, two at least) no longer grow at
    ``MIN_RECENT_RATE_SHARE`` of ``rate`` (nor at ``MIN_RATE``)."""
    recent = slope(points[-max(2, round(len(points) * RECENT_SHARE)):])
    return recent is None or recent < max(MIN_RATE, MIN_RECENT_RATE_SHARE * rate)


@dataclass(frozen=True)
class Held:
    """What a subject kept at one census: items (tensors, models, arrays, nodes, buffers;
    hooks for a module), bytes (its own and what its graphs save for backward), autograd
    nodes, and of the items, the tensors."""

    iteration: int
    items: float
    bytes: float
    nodes: float
    tensors: float = 0.0


def holders_under(census: Census, path: tuple[Step, ...]) -> list[HolderStats]:
    """The holder at ``path`` and those under it (a dict's keys) that ``census`` saw."""
    return [h for h in census.holders if h.path[:len(path)] == path]


def held_by(iteration: int, holders: Sequence[HolderStats]) -> Held:
    """What ``holders``, judged as one, kept at the census of ``iteration``."""
    return Held(iteration, float(sum(h.held for h in holders)),
                float(sum(h.bytes + h.graph_saved_bytes for h in holders)),
                float(sum(h.graph_nodes for h in holders)),
                float(sum(h.tensors for h in holders)))
