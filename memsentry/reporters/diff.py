"""A diff of two reports (``memsentry diff``) as text and as JSON.

Pure formatting of a :class:`~memsentry.model.ReportDiff` (and, when limits were given, of
their :class:`~memsentry.model.LimitCheck`): every figure and change is read from the values.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from tabulate import tabulate

from memsentry.model import CategoryChange, Change, Finding, LimitCheck, ReportDiff, RunSummary
from memsentry.model.codec import to_plain
from memsentry.model.diff import LayerChange, format_rate, format_share
from memsentry.reporters.breakdown import _LABELS
from memsentry.reporters.text import _NARROW, _fit, fit_layer_rows
from memsentry.reporters.wrap import fill
from memsentry.units import format_bytes
from memsentry.usercode.text import printable_values

_LAYER_HEADERS = (
    ("", "", "activation", "", "", "fwd peak", "", ""),
    ("layer", "type", "old", "new", "change", "old", "new", "change"),
)


def _bytes_change(change: Change[int], *, sep: str = " ") -> str:
    """``+1.4 MiB +300%``: the change in bytes, and in share of the old figure."""
    delta = change.delta
    if delta is None:
        return "-"
    text = format_bytes(delta, signed=True)
    if delta and change.relative is not None:
        text += f"{sep}{format_share(change.relative)}"
    return text


def _fill(text: str, width: int, indent: str) -> str:
    """``text`` wrapped to ``width`` (words with hyphens, rule ids, kept whole)."""
    return fill(text, width, subsequent_indent=indent, break_on_hyphens=False)


def _run_line(run: RunSummary) -> str:
    torch = f", torch {run.torch_version}" if run.torch_version else ""
    return f"{run.device} ({run.backend}, peaks {run.peak_mode}{torch})"


def run_lines(diff: ReportDiff) -> list[str]:
    """Where each run was measured: one line when both were measured alike."""
    old, new = diff.old, diff.new
    if _run_line(old) == _run_line(new):
        return [f"both on {_run_line(old)}"]
    return [f"old on {_run_line(old)}", f"new on {_run_line(new)}"]


def headline_rows(diff: ReportDiff) -> list[tuple[str, str]]:
    """(name, text) for the peak, the growth, the iterations and the findings' count."""
    peak = diff.peak
    peak_text = f"{format_bytes(peak.old)} -> {format_bytes(peak.new)}"
    if peak.delta is not None:
        peak_text += f" ({_bytes_change(peak, sep=', ')})" if peak.delta else " (no change)"
    growth = diff.growth
    growth_text = (f"{format_rate(growth.old, signed=True)} -> "
                   f"{format_rate(growth.new, signed=True)}")
    if growth.delta is not None:
        growth_text += (f" ({format_rate(growth.delta, signed=True)})"
                        if round(growth.delta) else " (no change)")
    else:
        growth_text += " (a run has too few iterations for a growth rate)"
    findings = (f"{len(diff.appeared)} appeared, {len(diff.disappeared)} disappeared, "
                f"{len(diff.persisted)} in both")
    rows = [("peak", peak_text), ("growth", growth_text + " after warm-up"),
            ("iterations", f"{diff.iterations.old} -> {diff.iterations.new}"),
            ("findings", findings)]
    return rows


def render_headline(diff: ReportDiff) -> str:
    """Which runs, then peak, growth, iterations and the findings' count, one a line."""
    lines = [f"memsentry diff: {diff.old.label} -> {diff.new.label}", *run_lines(diff)]
    lines += [f"{name:<11}{text}" for name, text in headline_rows(diff)]
    if diff.unchanged:
        lines.append("no change: the same peak, growth, category and layer figures, and "
                     "findings")
    return "\n".join(lines)


def render_categories(categories: Sequence[CategoryChange]) -> str | None:
    """The breakdown at each run's highest peak, side by side; ``None`` without one."""
    if not categories:
        return None
    rows = [[_LABELS.get(c.name, c.name), format_bytes(c.bytes.old), format_bytes(c.bytes.new),
             format_bytes(c.bytes.delta, signed=True),
             format_share(c.bytes.relative) if c.bytes.delta and c.bytes.relative is not None
             else ""] for c in categories]
    table = tabulate(rows, headers=("at the peak", "old", "new", "change", "rel."),
                     tablefmt="simple", colalign=("left",) + ("right",) * 4,
                     disable_numparse=True)
    return "Memory at the highest peak, by category\n" + table


def _layer_delta(layer: LayerChange, change: Change[int]) -> int | None:
    """The change; for a layer in one run only, its figure there (``+`` added, ``-`` gone)."""
    if layer.added:
        return change.new
    if layer.removed and change.old is not None:
        return -change.old
    return change.delta


def _layer_row(layer: LayerChange) -> list[str]:
    name = layer.name + (" (added)" if layer.added else " (removed)" if layer.removed else "")
    cells = [name, layer.type]
    for change in (layer.activation, layer.forward_peak):
        cells += [format_bytes(change.old, compact=True), format_bytes(change.new, compact=True),
                  format_bytes(_layer_delta(layer, change), signed=True, compact=True)]
    return cells


def render_layers(diff: ReportDiff, *, top: int | None = 10, width: int = 100) -> str | None:
    """The layers that changed most, fitted to ``width``; a line when none changed, ``None``
    when neither run recorded a layer."""
    shown = diff.largest_layer_changes(top)
    if not shown:
        return _fill(f"Layers: no layer changed ({len(diff.layers)} in both runs, with the "
                     "same bytes saved for backward and forward peak per call)", width,
                     "  ") if diff.layers else None
    changed = len(diff.largest_layer_changes(None))
    rows = [_layer_row(layer) for layer in shown]
    rule = fit_layer_rows(_LAYER_HEADERS, rows, width)
    of = f"; {len(shown)} of {changed} shown" if changed > len(shown) else ""
    title = fill(
        "Layers that changed most (activation: bytes saved for backward, or the output where "
        f"nothing was saved; fwd peak: the most its forward added; per call{of})",
        width, subsequent_indent="  ")
    table = tabulate([*map(list, _LAYER_HEADERS), rule, *rows], tablefmt=_NARROW,
                     colalign=("left", "left") + ("right",) * 6, disable_numparse=True)
    return f"{title}\n{table}"


def _finding_lines(finding: Finding, width: int) -> str:
    shown = finding.where and finding.where not in finding.message
    where = f" [{finding.where}]" if shown else ""
    rank = "" if finding.rank is None else f"rank {finding.rank}: "
    head = f"  {str(finding.severity).upper():5} {rank}{finding.rule}{where}: {finding.message}"
    return _fill(head, width, "        ")


def _appeared(diff: ReportDiff, width: int) -> str | None:
    """The findings that appeared, each with its fix; ``None`` when none did."""
    if not diff.appeared:
        return None
    lines = [f"Findings that appeared ({len(diff.appeared)})"]
    for finding in diff.appeared:
        lines.append(_finding_lines(finding, width))
        lines.append(_fill(f"        fix: {finding.fix}", width, "             "))
    return "\n".join(lines)


def _disappeared(diff: ReportDiff, width: int) -> str | None:
    """The findings that disappeared; ``None`` when none did."""
    if not diff.disappeared:
        return None
    return "\n".join([f"Findings that disappeared ({len(diff.disappeared)})",
                      *(_finding_lines(f, width) for f in diff.disappeared)])


def _pair_figures(old: Finding, new: Finding) -> list[str]:
    """A finding's bytes and rate in both runs (old -> new), those either run gave."""
    figures = []
    if old.bytes is not None or new.bytes is not None:
        figures.append(f"{format_bytes(old.bytes)} -> {format_bytes(new.bytes)}")
    if old.rate is not None or new.rate is not None:
        figures.append(f"{format_rate(old.rate, signed=True)} -> "
                       f"{format_rate(new.rate, signed=True)}")
    return figures


def _persisted_line(old: Finding, new: Finding, width: int) -> str:
    """One finding of both runs: severity, rule, where, and its figures in both."""
    where = f" [{new.where}]" if new.where else ""
    text = f"  {str(new.severity).upper():5} {new.rule}{where}"
    figures = _pair_figures(old, new)
    if figures:
        text += ": " + ", ".join(figures)
    return _fit(text, width, keep_end=False)


def _persisted(diff: ReportDiff, width: int) -> str | None:
    """The findings in both runs; ``None`` when none is."""
    if not diff.persisted:
        return None
    return "\n".join([f"Findings in both runs ({len(diff.persisted)})",
                      *(_persisted_line(pair.old, pair.new, width) for pair in diff.persisted)])


def render_findings(diff: ReportDiff, *, width: int = 100) -> str | None:
    """The findings that appeared (with their fix) and disappeared, and those in both."""
    parts = [_appeared(diff, width), _disappeared(diff, width), _persisted(diff, width)]
    return "\n\n".join(part for part in parts if part is not None) or None


def _within(diff: ReportDiff, check: LimitCheck) -> list[str]:
    """Each limit set, with what was seen."""
    limits, peak = check.limits, diff.peak
    held = []
    if limits.max_peak_increase_share is not None:
        held.append(f"peak increase at most {format_share(limits.max_peak_increase_share)} "
                    f"(seen {format_share(peak.relative)})")
    if limits.max_peak_increase is not None:
        held.append(f"peak increase at most {format_bytes(limits.max_peak_increase)} "
                    f"(seen {format_bytes(peak.delta, signed=True)})")
    if limits.max_growth_increase is not None:
        held.append(f"growth increase at most {format_rate(limits.max_growth_increase)} "
                    f"(seen {format_rate(diff.growth.delta, signed=True)})")
    if limits.fail_on_new_findings:
        held.append(f"no new leak or waste finding (seen {len(diff.appeared)} new finding(s) "
                    "of any severity)")
    return held


def render_check(diff: ReportDiff, check: LimitCheck, *, width: int = 100) -> str | None:
    """The limits crossed, each with the figure seen, the limit and the fix; or that the
    diff keeps within them. ``None`` when no limit was set."""
    if not check.limits.any:
        return None
    lines = []
    if check.breaches:
        lines.append(f"Limits crossed ({len(check.breaches)})")
        for breach in check.breaches:
            lines.append(_fill(f"  --{breach.limit}: {breach.message}", width, "    "))
            lines.append(_fill(f"    fix: {breach.fix}", width, "         "))
    else:
        lines.append(_fill("Within limits: " + "; ".join(_within(diff, check)), width, "  "))
    for reason in check.unchecked:
        lines.append(_fill(f"not checked: {reason}", width, "  "))
    return "\n".join(lines)


def render_diff(diff: ReportDiff, *, check: LimitCheck | None = None, top: int | None = 10,
                width: int = 100) -> str:
    """The whole diff as text: headline, warnings, categories, the ``top`` layers that
    changed most, findings, and the limits when ``check`` is given. The runs' strings
    (labels, layer and holder names, messages) are written
    :func:`~memsentry.usercode.text.printable`."""
    diff, check = printable_values(diff), printable_values(check)
    sections: list[str | None] = [render_headline(diff)]
    if diff.mismatches:
        sections.append("\n".join(_fill(f"warning: {m.message}", width, "         ")
                                  for m in diff.mismatches))
    sections += [render_categories(diff.categories), render_layers(diff, top=top, width=width),
                 render_findings(diff, width=width)]
    if check is not None:
        sections.append(render_check(diff, check, width=width))
    return "\n\n".join(section for section in sections if section)


def _change(change: Change[int] | Change[float]) -> dict[str, Any]:
    return {"old": change.old, "new": change.new, "delta": change.delta,
            "relative": change.relative}


def _run(run: RunSummary) -> dict[str, Any]:
    """A run's summary without its timeline (the reports keep that)."""
    plain = to_plain(run)
    plain.pop("timeline", None)
    return plain


def diff_to_dict(diff: ReportDiff, *, check: LimitCheck | None = None) -> dict[str, Any]:
    """The diff as plain data: each figure with ``old``, ``new``, ``delta`` and
    ``relative``; the findings whole; the limits and breaches when ``check`` is given."""
    data: dict[str, Any] = {
        "kind": "memsentry-diff",
        "old": _run(diff.old),
        "new": _run(diff.new),
        "peak": _change(diff.peak),
        "growth": _change(diff.growth),
        "iterations": _change(diff.iterations),
        "categories": {c.name: _change(c.bytes) for c in diff.categories},
        "layers": [{"name": layer.name, "type": layer.type, "added": layer.added,
                    "removed": layer.removed, "activation": _change(layer.activation),
                    "forward_peak": _change(layer.forward_peak)} for layer in diff.layers],
        "findings": {
            "appeared": to_plain(diff.appeared),
            "disappeared": to_plain(diff.disappeared),
            "persisted": to_plain(diff.persisted),
        },
        "warnings": to_plain(diff.mismatches),
        "unchanged": diff.unchanged,
    }
    if check is not None:
        data["limits"] = to_plain(check.limits)
        data["breaches"] = to_plain(check.breaches)
        data["unchecked"] = list(check.unchecked)
        data["passed"] = check.passed
    return data


def diff_to_json(diff: ReportDiff, *, check: LimitCheck | None = None, indent: int = 2) -> str:
    """:func:`diff_to_dict` as JSON text."""
    return json.dumps(diff_to_dict(diff, check=check), indent=indent)


__all__ = ["diff_to_dict", "diff_to_json", "headline_rows", "render_check", "render_diff",
           "render_headline", "run_lines"]
