"""Two reports of the same program side by side: what changed in the peak, the growth rate, the
layers, the categories at the peak and the findings; and the limits a change is held to.

Values only: :func:`memsentry.rules.diff.diff` makes a :class:`ReportDiff` of two reports and
:func:`memsentry.rules.diff.check` holds it to :class:`Limits`; the reporters format them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Generic, TypeVar

from memsentry.model.breakdown import CATEGORIES, Breakdown
from memsentry.model.findings import Finding
from memsentry.model.kinds import Measured, PeakMode
from memsentry.model.timeline import IterationStats
from memsentry.units import format_bytes, parse_size

N = TypeVar("N", int, float)


@dataclass(frozen=True)
class Change(Generic[N]):
    """A figure in the old run and in the new one; ``None`` where a run lacks it."""

    old: N | None
    new: N | None

    @property
    def delta(self) -> N | None:
        """``new - old``; ``None`` when either is absent."""
        if self.old is None or self.new is None:
            return None
        return self.new - self.old

    @property
    def relative(self) -> float | None:
        """``delta`` over the old value (``0.05``: 5% more); ``None`` when either is absent
        or the old value is 0 and the new one is not."""
        delta = self.delta
        if delta is None or self.old is None:
            return None
        if self.old == 0:
            return 0.0 if delta == 0 else None
        return delta / abs(self.old)

    @property
    def changed(self) -> bool:
        return self.old != self.new


@dataclass(frozen=True)
class RunSummary:
    """What a diff reads of one report. ``label`` names it (its file, or ``old``/``new``);
    ``growth`` is allocated bytes per iteration after warm-up, fitted as the
    ``memory-growth`` rule fits it (``None`` with fewer than two complete iterations after
    warm-up); ``iterations`` counts the iterations a boundary closed (thinned-out ones
    included); ``parts`` is the breakdown at the highest iteration peak, when recorded;
    ``timeline`` holds every iteration, the partial one at the end of tracking included
    (where the run's peak may be), for drawing the two runs on one axis."""

    label: str
    device: str
    backend: str
    measured: Measured
    peak_mode: PeakMode
    torch_version: str
    peak: int | None
    growth: float | None
    iterations: int
    parts: Breakdown | None = None
    timeline: tuple[IterationStats, ...] = ()


@dataclass(frozen=True)
class LayerChange:
    """One layer in the two runs, matched by name. ``activation`` is its bytes saved for
    backward (its output bytes where nothing was measured as saved), ``forward_peak`` the
    highest memory its forward added, both of its largest call. A layer in one run only is
    ``added`` (new run only) or ``removed`` (old run only); its figures in the other are
    ``None``. Forward-peak changes smaller than ``noise`` bytes are not changes (runs
    measured on the process heap read a few KiB of the heap's own bookkeeping into them)."""

    name: str
    type: str
    activation: Change[int]
    forward_peak: Change[int]
    in_old: bool = True
    in_new: bool = True
    noise: int = 0

    @property
    def added(self) -> bool:
        return self.in_new and not self.in_old

    @property
    def removed(self) -> bool:
        return self.in_old and not self.in_new

    @property
    def size(self) -> int:
        """How much the layer changed, in bytes: the larger of its activation and forward
        peak changes (for a layer in one run only, its figures there)."""
        sizes = []
        for change, noise in ((self.activation, 0), (self.forward_peak, self.noise)):
            if self.added or self.removed:
                sizes.append(abs((change.new if self.added else change.old) or 0))
            else:
                size = abs(change.delta or 0)
                sizes.append(size if size >= noise else 0)
        return max(sizes)


@dataclass(frozen=True)
class CategoryChange:
    """One category of the breakdown at the peak (``parameters`` ... ``other``, or
    ``total``) in the two runs."""

    name: str
    bytes: Change[int]


@dataclass(frozen=True)
class FindingPair:
    """A finding both runs made (same rule, same holder or subject): as each run saw it."""

    old: Finding
    new: Finding


@dataclass(frozen=True)
class Mismatch:
    """Something the two runs differ in that makes their figures compare badly (device,
    backend, what was measured, how peaks were read, torch, the number of iterations);
    ``message`` says why and what to do."""

    field: str
    old: str
    new: str
    message: str


@dataclass(frozen=True)
class ReportDiff:
    """Two reports of the same program compared: ``old`` and ``new`` summarise each run,
    ``layers`` matches their layers by name (the new run's order, then the removed ones),
    ``appeared``/``disappeared``/``persisted`` match their findings by rule and by the holder,
    module, type or device they are about (not by message text), and ``mismatches`` say where
    the comparison itself is doubtful. ``peak``, ``growth``, ``iterations`` and
    ``categories`` are the figures as :class:`Change` values (``delta``, ``relative``)."""

    old: RunSummary
    new: RunSummary
    layers: tuple[LayerChange, ...] = ()
    appeared: tuple[Finding, ...] = ()
    disappeared: tuple[Finding, ...] = ()
    persisted: tuple[FindingPair, ...] = ()
    mismatches: tuple[Mismatch, ...] = ()

    @property
    def peak(self) -> Change[int]:
        """The highest allocated memory, bytes."""
        return Change(self.old.peak, self.new.peak)

    @property
    def growth(self) -> Change[float]:
        """Allocated bytes per iteration after warm-up."""
        return Change(self.old.growth, self.new.growth)

    @property
    def iterations(self) -> Change[int]:
        return Change(self.old.iterations, self.new.iterations)

    @property
    def peak_change(self) -> tuple[int | None, float | None]:
        """(bytes, share of the old peak) the peak changed by; ``None`` where unknown."""
        return self.peak.delta, self.peak.relative

    @property
    def growth_change(self) -> float | None:
        """Bytes per iteration the growth rate changed by; ``None`` where unknown."""
        return self.growth.delta

    @property
    def categories(self) -> tuple[CategoryChange, ...]:
        """Each category at the highest peak, and the total; empty unless both runs
        recorded a breakdown."""
        old, new = self.old.parts, self.new.parts
        if old is None or new is None:
            return ()
        rows = [CategoryChange(name, Change(old.part(name), new.part(name)))
                for name in CATEGORIES]
        rows.append(CategoryChange("total", Change(old.total, new.total)))
        return tuple(rows)

    @property
    def added_layers(self) -> tuple[LayerChange, ...]:
        return tuple(layer for layer in self.layers if layer.added)

    @property
    def removed_layers(self) -> tuple[LayerChange, ...]:
        return tuple(layer for layer in self.layers if layer.removed)

    def largest_layer_changes(self, top: int | None = 10) -> tuple[LayerChange, ...]:
        """The layers that changed (added and removed ones included), largest change first;
        the first ``top`` of them (all with ``None``)."""
        changed = [layer for layer in self.layers if layer.size > 0
                   or layer.added or layer.removed]
        changed.sort(key=lambda layer: layer.size, reverse=True)
        return tuple(changed if top is None else changed[:top])

    @property
    def warnings(self) -> tuple[str, ...]:
        """The mismatches' messages."""
        return tuple(m.message for m in self.mismatches)

    @property
    def unchanged(self) -> bool:
        """Nothing changed: the same peak, growth, iterations, layer figures, categories and
        findings (persisting findings may differ in their figures)."""
        return not (self._figures_changed() or self._layers_changed()
                    or self.appeared or self.disappeared)

    def _figures_changed(self) -> bool:
        """The peak, the growth, the iterations or a category at the highest peak changed."""
        return (self.peak.changed or self.growth.changed or self.iterations.changed
                or any(c.bytes.changed for c in self.categories))

    def _layers_changed(self) -> bool:
        """A layer's figures changed, or a layer was added or removed."""
        return any(layer.size or layer.added or layer.removed for layer in self.layers)


@dataclass(frozen=True)
class Limits:
    """How much worse the new run may be before a diff fails (``None``: not checked).

    ``max_peak_increase`` is bytes the peak may rise by, ``max_peak_increase_share`` a share
    of the old peak (``0.05``: 5%); ``max_growth_increase`` is bytes per iteration the growth
    rate may rise by; ``fail_on_new_findings`` fails on a leak or waste finding the old run
    did not have (new hints, which are advice, do not fail). :meth:`parse` reads the
    command's spellings (``"5%"``, ``"64MiB"``).
    """

    max_peak_increase: int | None = None
    max_peak_increase_share: float | None = None
    max_growth_increase: float | None = None
    fail_on_new_findings: bool = False

    def __post_init__(self) -> None:
        for name in ("max_peak_increase", "max_peak_increase_share", "max_growth_increase"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or value < 0):
                raise ValueError(f"Limits.{name} must be a number of at least 0, got {value!r}")

    @classmethod
    def parse(cls, *, max_peak_increase: str | None = None,
              max_growth_increase: str | None = None,
              fail_on_new_findings: bool = False) -> Limits:
        """Limits from text: a peak increase as a percentage (``"5%"``) or a size
        (``"64MiB"``), a growth increase as a size per iteration (``"1MiB"``)."""
        share = size = growth = None
        if max_peak_increase is not None:
            share, size = parse_increase(max_peak_increase)
        if max_growth_increase is not None:
            growth = parse_growth_increase(max_growth_increase)
        return cls(max_peak_increase=size, max_peak_increase_share=share,
                   max_growth_increase=growth, fail_on_new_findings=fail_on_new_findings)

    @property
    def any(self) -> bool:
        """Whether any limit is set."""
        return (self.max_peak_increase is not None or self.max_peak_increase_share is not None
                or self.max_growth_increase is not None or self.fail_on_new_findings)


def parse_increase(text: str) -> tuple[float | None, int | None]:
    """``"5%"`` as ``(0.05, None)``, ``"64MiB"`` as ``(None, 67108864)``; ``ValueError``
    naming the text and the accepted forms otherwise."""
    stripped = text.strip()
    if stripped.endswith("%"):
        try:
            percent = float(stripped[:-1])
        except ValueError:
            percent = math.nan
        if not 0 <= percent < math.inf:
            raise ValueError(f"cannot read {text!r} as a peak increase: give a percentage of "
                             "at least 0 (e.g. '5%') or a size (e.g. '64MiB')")
        return percent / 100, None
    try:
        return None, parse_size(stripped)
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a peak increase: give a percentage (e.g. "
                         "'5%') or a size in bytes or with one of B, KB, MB, GB, KiB, MiB, GiB "
                         "(e.g. '64MiB')") from None


def parse_growth_increase(text: str) -> int:
    """A growth increase in bytes per iteration: ``"1MiB"`` or ``"1MiB/iter"``."""
    stripped = text.strip()
    if stripped.lower().endswith("/iter"):
        stripped = stripped[: -len("/iter")]
    try:
        return parse_size(stripped)
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a growth increase: give a size per "
                         "iteration in bytes or with one of B, KB, MB, GB, KiB, MiB, GiB "
                         "(e.g. '1MiB' or '1MiB/iter')") from None


@dataclass(frozen=True)
class Breach:
    """A limit the new run crossed: ``limit`` names it (as the command's option), ``observed``
    is the figure seen and ``allowed`` the limit (bytes, bytes per iteration, a share of the
    old peak, or a number of findings), ``message`` says both and ``fix`` what to do."""

    limit: str
    observed: float
    allowed: float
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.message}; fix: {self.fix}"


@dataclass(frozen=True)
class LimitCheck:
    """A diff held to :class:`Limits`: the ``breaches``, and the limits that could not be
    checked (``unchecked``: a figure one run lacks), each with why."""

    limits: Limits
    breaches: tuple[Breach, ...] = ()
    unchecked: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return not self.breaches


def format_share(share: float | None, *, signed: bool = True) -> str:
    """``0.053`` as ``+5.3%``, ``0.05`` as ``+5%`` (one decimal under 10%, whole percents
    above); ``-`` for None."""
    if share is None:
        return "-"
    percent = share * 100
    text = f"{abs(percent):.1f}" if abs(percent) < 10 else f"{abs(percent):,.0f}"
    text = text.removesuffix(".0") + "%"
    if text == "0%":
        return text
    return ("-" if percent < 0 else "+" if signed else "") + text


def format_rate(rate: float | None, *, signed: bool = False) -> str:
    """Bytes per iteration for people: ``+163 KiB/iter``; ``-`` for None."""
    if rate is None:
        return "-"
    return f"{format_bytes(round(rate), signed=signed)}/iter"


__all__ = [
    "Breach",
    "CategoryChange",
    "Change",
    "FindingPair",
    "LayerChange",
    "LimitCheck",
    "Limits",
    "Mismatch",
    "ReportDiff",
    "RunSummary",
    "format_rate",
    "format_share",
    "parse_growth_increase",
    "parse_increase",
]
