"""``memsentry diff``: two reports of the same program compared, and the change held to limits.

Pure functions of two frozen reports. Not a registered rule (a rule judges one report): the
figures are read as the rules read them (the growth rate is ``memory-growth``'s fit, after
its warm-up), and findings are matched by rule and by what they are about, not by their text.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Hashable, Sequence

from memsentry.model import (
    Boundary,
    Finding,
    IterationStats,
    LayerStats,
    Measured,
    ReportData,
    Severity,
    growth_per_iteration,
)
from memsentry.model.diff import (
    Breach,
    Change,
    FindingPair,
    LayerChange,
    LimitCheck,
    Limits,
    Mismatch,
    ReportDiff,
    RunSummary,
    format_rate,
    format_share,
)
from memsentry.rules.series import WARMUP
from memsentry.units import format_bytes

#: New findings of these severities fail ``Limits.fail_on_new_findings``; hints are advice
#: (and those that read timings come and go with the machine's load).
FAILING_SEVERITIES = frozenset({Severity.LEAK, Severity.WASTE})


def _count(iterations: tuple[IterationStats, ...]) -> int:
    """The iterations a boundary closed, from the indices: those thinned out of the timeline
    and those a light run passed with a count only are counted too (the partial iteration at
    the end carries the index after the last complete one)."""
    if not iterations:
        return 0
    last = iterations[-1]
    return last.index if last.boundary == Boundary.EXIT else last.index + 1


def summarise(report: ReportData, label: str) -> RunSummary:
    """What a diff reads of ``report``."""
    return RunSummary(
        label=label, device=report.device, backend=report.backend, measured=report.measured,
        peak_mode=report.peak_mode, torch_version=report.torch_version, peak=report.peak,
        growth=growth_per_iteration(report.iterations, warmup=WARMUP),
        iterations=_count(report.iterations), parts=report.breakdown.peak,
        timeline=tuple(report.iterations),  # drawn whole: the end of a run may hold its peak
    )


def finding_key(finding: Finding) -> Hashable:
    """What identifies a finding across runs: its rule, its rank, and the holder (by its
    path), module, type or device it is about; a finding about nothing named is matched by
    the function of its location (its line moves when code above it changes)."""
    subject = finding.subject
    about: Hashable = None
    if subject is not None:
        about = (subject.kind, subject.path if subject.path is not None else subject.name)
    elif finding.location is not None:
        about = (finding.location.file, finding.location.function)
    return finding.rule, finding.rank, about


def match_findings(
    old: Sequence[Finding], new: Sequence[Finding]
) -> tuple[tuple[Finding, ...], tuple[Finding, ...], tuple[FindingPair, ...]]:
    """(appeared, disappeared, persisted): the new run's findings the old run lacks, the old
    run's the new one lacks, and the pairs both made, in the order of each report."""
    waiting: dict[Hashable, deque[int]] = defaultdict(deque)  # popped from the left: linear
    for index, finding in enumerate(new):
        waiting[finding_key(finding)].append(index)
    disappeared, persisted = [], []
    matched: set[int] = set()
    for finding in old:
        twins = waiting.get(finding_key(finding))
        if twins:
            index = twins.popleft()
            matched.add(index)
            persisted.append(FindingPair(finding, new[index]))
        else:
            disappeared.append(finding)
    appeared = [finding for index, finding in enumerate(new) if index not in matched]
    return tuple(appeared), tuple(disappeared), tuple(persisted)


def _activation(layer: LayerStats | None) -> int | None:
    if layer is None:
        return None
    return layer.saved_bytes if layer.saved_bytes is not None else layer.output_bytes


#: Forward-peak changes below this are noise where a run was measured on the process heap.
HEAP_NOISE = 4096


def _layer_change(name: str, old: LayerStats | None, new: LayerStats | None,
                  noise: int) -> LayerChange:
    shown = new if new is not None else old
    return LayerChange(
        name=name, type=shown.type if shown is not None else "",
        activation=Change(_activation(old), _activation(new)),
        forward_peak=Change(old.forward_peak if old else None, new.forward_peak if new else None),
        in_old=old is not None, in_new=new is not None, noise=noise,
    )


def match_layers(old: Sequence[LayerStats], new: Sequence[LayerStats], *, noise: int = 0
                 ) -> tuple[LayerChange, ...]:
    """The layers of both runs matched by name: the new run's in its order (those the old
    run lacks ``added``), then the old run's the new one lacks (``removed``); forward-peak
    changes under ``noise`` bytes do not count."""
    old_by_name: dict[str, LayerStats] = {}
    for layer in old:
        old_by_name.setdefault(layer.name, layer)
    new_names = {layer.name for layer in new}
    seen: set[str] = set()
    changes = []
    for layer in new:
        if layer.name not in seen:
            seen.add(layer.name)
            changes.append(_layer_change(layer.name, old_by_name.get(layer.name), layer,
                                         noise))
    changes.extend(_layer_change(name, layer, None, noise) for name, layer in old_by_name.items()
                   if name not in new_names)
    return tuple(changes)


_SAME_WAY = ("measure both runs the same way (track(exact=True) or `memsentry run --exact` "
             "for both, or for neither)")


def mismatches(old: RunSummary, new: RunSummary) -> tuple[Mismatch, ...]:
    """Where the two runs differ in a way that makes their figures compare badly."""
    found = (differs(old, new) for differs in (_device, _backend, _measured, _peak_mode,
                                                _torch_version, _iterations))
    return tuple(mismatch for mismatch in found if mismatch is not None)


def _device(old: RunSummary, new: RunSummary) -> Mismatch | None:
    if old.device == new.device:
        return None
    return Mismatch("device", old.device, new.device, (
        f"the runs were on different devices (old {old.device}, new {new.device}): the same "
        "program allocates differently on each; compare runs on the same device"))


def _backend(old: RunSummary, new: RunSummary) -> Mismatch | None:
    if old.backend == new.backend:
        return None
    return Mismatch("backend", old.backend, new.backend, (
        f"the runs were measured by different backends (old {old.backend}, counting "
        f"{_counts(old)}; new {new.backend}, counting {_counts(new)}): comparing across "
        f"backends is misleading, their figures count different memory; {_SAME_WAY}"))


def _measured(old: RunSummary, new: RunSummary) -> Mismatch | None:
    """What the figures count, within one backend (across backends, ``_backend`` says it)."""
    if old.backend != new.backend or old.measured == new.measured:
        return None
    return Mismatch("measured", str(old.measured), str(new.measured), (
        f"the runs' figures count different memory (old {_counts(old)}, new "
        f"{_counts(new)}): the changes mix the two; {_SAME_WAY}"))


def _peak_mode(old: RunSummary, new: RunSummary) -> Mismatch | None:
    """How peaks were read, within one backend."""
    if old.peak_mode == new.peak_mode or old.backend != new.backend:
        return None
    return Mismatch("peak_mode", str(old.peak_mode), str(new.peak_mode), (
        f"the runs read peaks differently (old {old.peak_mode}, new {new.peak_mode}): "
        "sampled peaks are lower bounds, exact ones count every allocation, so part of "
        f"the peak's change is the method; {_SAME_WAY}"))


def _torch_version(old: RunSummary, new: RunSummary) -> Mismatch | None:
    if old.torch_version == new.torch_version:
        return None
    return Mismatch("torch_version", old.torch_version, new.torch_version, (
        f"the runs used different torch versions (old {old.torch_version or 'unknown'}, "
        f"new {new.torch_version or 'unknown'}): kernels and the allocator may allocate "
        "differently, so a change may be torch's rather than your code's"))


def _iterations(old: RunSummary, new: RunSummary) -> Mismatch | None:
    """Runs of different lengths (either without iterations: nothing to compare)."""
    if not (old.iterations and new.iterations) or old.iterations == new.iterations:
        return None
    return Mismatch("iterations", str(old.iterations), str(new.iterations), (
        f"the runs recorded different numbers of iterations (old {old.iterations}, new "
        f"{new.iterations}): a leak's peak grows with the length of the run, so compare "
        "the growth rates, or runs of the same length"))


def _counts(run: RunSummary) -> str:
    return "the process heap" if run.measured == Measured.HEAP else "tensor memory"


def diff(old: ReportData, new: ReportData, *, old_label: str = "old",
         new_label: str = "new") -> ReportDiff:
    """What changed from ``old`` to ``new``, two reports of the same program; the labels
    name them in the rendering (their files, say)."""
    before, after = summarise(old, old_label), summarise(new, new_label)
    appeared, disappeared, persisted = match_findings(old.findings, new.findings)
    heap = Measured.HEAP in (old.measured, new.measured)
    return ReportDiff(
        old=before, new=after,
        layers=match_layers(old.layers, new.layers, noise=HEAP_NOISE if heap else 0),
        appeared=appeared, disappeared=disappeared, persisted=persisted,
        mismatches=mismatches(before, after),
    )


#: What holding a change to one limit found: the limit crossed, why it could not be checked,
#: or nothing (kept within it, or not asked for).
Outcome = Breach | str | None

_PEAK_FIX = ("look for what grew in the category and layer tables (larger activations, a new "
             "layer, more optimizer state, a finding that appeared); if the increase is "
             "intended, raise the limit")


def _peak_rose(change: ReportDiff) -> str:
    """How the peak rose, for the peak limits' messages."""
    peak = change.peak
    delta, share = peak.delta, peak.relative
    assert delta is not None
    by = "" if share is None else f" ({format_share(share)})"
    return (f"the peak rose by {format_bytes(delta, signed=True)}{by}, "
            f"from {format_bytes(peak.old)} to {format_bytes(peak.new)}")


def _peak_missing(change: ReportDiff, limits: Limits) -> Outcome:
    """A peak limit that cannot be checked: a report has no peak."""
    if limits.max_peak_increase is None and limits.max_peak_increase_share is None:
        return None
    peak = change.peak
    if peak.delta is not None:
        return None
    missing = "old" if peak.old is None else "new"
    return f"peak increase: the {missing} report has no peak"


def _peak_share(change: ReportDiff, limits: Limits) -> Outcome:
    """``max_peak_increase_share``: the peak's rise as a share of the old peak."""
    allowed = limits.max_peak_increase_share
    if allowed is None or change.peak.delta is None:
        return None
    share = change.peak.relative
    if share is None:
        return (f"peak increase of at most {format_share(allowed)}: the old peak is 0, so "
                "the new one has no share of it")
    if share > allowed:
        return Breach(
            "max-peak-increase", observed=share, allowed=allowed, fix=_PEAK_FIX,
            message=f"{_peak_rose(change)}: over the limit of {format_share(allowed)}")
    return None


def _peak_bytes(change: ReportDiff, limits: Limits) -> Outcome:
    """``max_peak_increase``: the peak's rise in bytes."""
    allowed, delta = limits.max_peak_increase, change.peak.delta
    if allowed is None or delta is None:
        return None
    if delta > allowed:
        return Breach(
            "max-peak-increase", observed=delta, allowed=allowed, fix=_PEAK_FIX,
            message=f"{_peak_rose(change)}: over the limit of "
                    f"{format_bytes(allowed, signed=True)}")
    return None


def _growth_increase(change: ReportDiff, limits: Limits) -> Outcome:
    """``max_growth_increase``: the rise of the growth rate, bytes per iteration."""
    allowed = limits.max_growth_increase
    if allowed is None:
        return None
    growth = change.growth
    delta = growth.delta
    if delta is None:
        lacking = "old" if growth.old is None else "new"
        return (f"growth increase: the {lacking} report has fewer than {WARMUP + 2} complete "
                "iterations, too few for a growth rate")
    if delta > allowed:
        return Breach(
            "max-growth-increase", observed=delta, allowed=allowed,
            message=(f"memory growth rose by {format_rate(delta, signed=True)}, from "
                     f"{format_rate(growth.old, signed=True)} to "
                     f"{format_rate(growth.new, signed=True)}: over the limit of "
                     f"{format_rate(allowed, signed=True)}"),
            fix=("the new run keeps memory from every iteration: a leak; its findings "
                 "(`memsentry show NEW.json`) name the holder and the line"))
    return None


def _named(finding: Finding) -> str:
    """A finding's rule, with where it is when known: ``tensor-accumulation (train.py:12)``."""
    return f"{finding.rule}" + (f" ({finding.where})" if finding.where else "")


def _new_findings(change: ReportDiff, limits: Limits) -> Outcome:
    """``fail_on_new_findings``: leak or waste findings the old run did not have."""
    if not limits.fail_on_new_findings:
        return None
    new = [f for f in change.appeared if f.severity in FAILING_SEVERITIES]
    if not new:
        return None
    return Breach(
        "fail-on-new-findings", observed=len(new), allowed=0,
        message=(f"{len(new)} leak or waste finding(s) the old run did not have: "
                 f"{', '.join(_named(f) for f in new)}; the limit is 0"),
        fix="apply each new finding's fix (the diff's text lists them) before merging")


def check(change: ReportDiff, limits: Limits) -> LimitCheck:
    """``change`` held to ``limits``: the limits crossed, with the figure seen, the limit and
    the fix, and those that could not be checked (a figure one run lacks)."""
    outcomes = [held(change, limits) for held in (_peak_missing, _peak_share, _peak_bytes,
                                                  _growth_increase, _new_findings)]
    return LimitCheck(limits=limits,
                      breaches=tuple(o for o in outcomes if isinstance(o, Breach)),
                      unchecked=tuple(o for o in outcomes if isinstance(o, str)))


def breaches(change: ReportDiff, limits: Limits) -> tuple[Breach, ...]:
    """The limits ``change`` crosses (empty when it keeps within them)."""
    return check(change, limits).breaches


__all__ = [
    "FAILING_SEVERITIES",
    "breaches",
    "check",
    "diff",
    "finding_key",
    "match_findings",
    "match_layers",
    "mismatches",
    "summarise",
]
