"""The HTML report's charts as plotly figure specifications (plain dicts, drawn by plotly.js
in the page): the iteration timeline and the ranks of a process group.

Long timelines are thinned on the way in: at most ``at_most`` iterations are drawn, chosen
per bucket of neighbours so that each bucket keeps its highest peak and its lowest and
highest allocated figure (a leak's climb, a sawtooth's teeth and every peak stay visible).
Censuses and findings are marked at their own iteration whatever was thinned. Hover texts
are escaped: plotly reads tags in them.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import Any

from memsentry.model import (
    CATEGORIES,
    Boundary,
    Census,
    Finding,
    IterationStats,
    ReportData,
)
from memsentry.units import format_bytes

#: Iterations drawn at most; a 10,000-iteration timeline is thinned to this many points.
AT_MOST = 1500

_UNITS = ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"), (1, "B"))
_COLOURS = {
    "allocated": "#1f5fa8", "peak": "#d0612a", "reserved": "#7d8791",
    "parameters": "#9fb7d6", "gradients": "#b5d6a7", "optimizer_state": "#e8d18c",
    "activations": "#e9a27c", "other": "#d4d4d8",
    "leak": "#c0262d", "waste": "#d9822b", "hint": "#3c7dbf", "census": "#6b4fa0",
}
_LABELS = {"parameters": "parameters", "gradients": "gradients",
           "optimizer_state": "optimizer state", "activations": "activations",
           "other": "other"}
_CLOSED_BY = {Boundary.OPTIMIZER: "optimizer.step()", Boundary.STEP: "t.step()",
              Boundary.EXIT: "the end of tracking (partial)"}


def unit_for(largest: float) -> tuple[int, str]:
    """The binary unit the axis is drawn in: the largest that keeps ``largest`` at 1 or more."""
    for scale, label in _UNITS:
        if largest >= scale:
            return scale, label
    return 1, "B"


#: Up to this many iterations, the axis has a tick at each (plotly would put some halfway).
WHOLE_TICKS = 12


def iteration_axis(title: str, iterations: Sequence[IterationStats]) -> dict[str, Any]:
    """The x axis of a timeline: whole iterations only."""
    axis: dict[str, Any] = {"title": {"text": title}, "zeroline": False}
    if iterations and max(it.index for it in iterations) <= WHOLE_TICKS:
        axis["dtick"] = 1
    return axis


def thin(iterations: Sequence[IterationStats], at_most: int = AT_MOST) -> list[IterationStats]:
    """At most about ``at_most`` of ``iterations``, in order, keeping per bucket of neighbours
    the one with the highest peak and those with the lowest and highest allocated figure."""
    if len(iterations) <= at_most:
        return list(iterations)
    size = math.ceil(len(iterations) * 3 / max(at_most, 3))
    kept: list[IterationStats] = []
    for start in range(0, len(iterations), size):
        bucket = iterations[start:start + size]
        chosen = {id(max(bucket, key=lambda it: it.peak)),
                  id(min(bucket, key=lambda it: it.allocated)),
                  id(max(bucket, key=lambda it: it.allocated))}
        kept.extend(it for it in bucket if id(it) in chosen)
    return kept


def _point_text(it: IterationStats) -> str:
    text = f"iteration {it.index}, closed by {_CLOSED_BY.get(it.boundary, str(it.boundary))}"
    text += f", {it.seconds * 1000:.1f} ms"
    if it.batch is not None:
        text += f", batch {it.batch}"
    if not it.peak_exact:
        text += ", peak a lower bound (sampled, not counted)"
    return text


def _line(name: str, xs: list[int], ys: list[float | None], text: list[str], unit: str,
          *, dash: str = "solid", mode: str = "lines") -> dict[str, Any]:
    return {
        "type": "scatter", "mode": mode, "name": name, "x": xs, "y": ys, "text": text,
        "line": {"color": _COLOURS[name], "width": 2, "dash": dash},
        "hovertemplate": f"{name} %{{y:.4g}} {unit}<extra>%{{text}}</extra>",
    }


def _stacked(shown: list[IterationStats], scale: int, unit: str) -> list[dict[str, Any]]:
    """One filled trace per category of the breakdown at each iteration's peak, stacked: only
    the iterations whose peak was broken down (plotly stacks a gap as zero, so an iteration
    without one would draw a fall to nothing)."""
    broken_down = [(it.index, it.parts) for it in shown if it.parts is not None]
    xs = [index for index, _parts in broken_down]
    traces = []
    for name in CATEGORIES:
        ys = [parts.part(name) / scale for _index, parts in broken_down]
        traces.append({
            "type": "scatter", "mode": "lines", "name": _LABELS[name], "x": xs, "y": ys,
            "stackgroup": "peak", "legendgroup": "breakdown", "xaxis": "x", "yaxis": "y2",
            "line": {"width": 0.5, "color": _COLOURS[name]}, "fillcolor": _COLOURS[name],
            "hovertemplate": f"{_LABELS[name]} %{{y:.4g}} {unit}<extra>at the peak</extra>",
        })
    return traces


def _census_text(census: Census) -> str:
    top = sorted(census.holders, key=lambda h: h.bytes, reverse=True)[:3]
    held = "; ".join(f"{h.name} {format_bytes(h.bytes)}" for h in top) or "no holder"
    carried = "" if census.carried is None else f" (that of {census.carried}, carried)"
    return html.escape(f"census at iteration {census.iteration}{carried}: {held}",
                       quote=False)


def _census_trace(report: ReportData, by_index: dict[int, IterationStats],
                  scale: int) -> dict[str, Any] | None:
    """The censuses taken at a recorded iteration, on the allocated line; ``None`` when
    none was."""
    censuses = [c for c in report.censuses if c.iteration in by_index]
    if not censuses:
        return None
    return {
        "type": "scatter", "mode": "markers", "name": "census",
        "x": [c.iteration for c in censuses],
        "y": [by_index[c.iteration].allocated / scale for c in censuses],
        "text": [_census_text(c) for c in censuses],
        "marker": {"symbol": "diamond-open", "size": 9, "color": _COLOURS["census"]},
        "hovertemplate": "%{text}<extra></extra>",
    }


def _marked(findings: Sequence[Finding], severity: str, by_index: dict[int, IterationStats]
            ) -> list[tuple[int, int, Finding]]:
    """(index, iteration, finding) of each finding of ``severity`` whose iteration was
    recorded."""
    marked = []
    for index, finding in enumerate(findings):
        at = finding.iteration
        if finding.severity.value == severity and at is not None and at in by_index:
            marked.append((index, at, finding))
    return marked


def _finding_trace(report: ReportData, severity: str, by_index: dict[int, IterationStats],
                   scale: int) -> dict[str, Any] | None:
    """The findings of one severity, each on the peak line at its iteration; ``None`` when
    none is at a recorded iteration."""
    marked = _marked(report.findings, severity, by_index)
    if not marked:
        return None
    return {
        "type": "scatter", "mode": "markers", "name": f"{severity.upper()} finding",
        "x": [at for _, at, _ in marked],
        "y": [by_index[at].peak / scale for _, at, _ in marked],
        "text": [_finding_text(f) for _, _, f in marked],
        "customdata": [i for i, _, _ in marked],
        "marker": {"symbol": "x", "size": 12, "color": _COLOURS[severity],
                   "line": {"width": 1, "color": "#ffffff"}},
        "hovertemplate": "%{text}<extra>click: show the finding</extra>",
    }


def _markers(report: ReportData, by_index: dict[int, IterationStats], scale: int,
             unit: str) -> list[dict[str, Any]]:
    """Censuses, and each finding at the iteration its evidence was read in."""
    traces = [_census_trace(report, by_index, scale),
              *(_finding_trace(report, severity, by_index, scale)
                for severity in ("leak", "waste", "hint"))]
    return [trace for trace in traces if trace is not None]


def _finding_text(finding: Finding) -> str:
    where = f" [{finding.where}]" if finding.where else ""
    message = finding.message if len(finding.message) <= 90 else finding.message[:89] + "…"
    text = f"{finding.severity.value.upper()} {finding.rule}{where}: {message}"
    return html.escape(text, quote=False)  # plotly reads tags in hover text


def _layout(unit: str, title: str, height: int = 380) -> dict[str, Any]:
    return {
        "title": {"text": title, "font": {"size": 14}, "x": 0, "xanchor": "left"},
        "height": height, "margin": {"l": 60, "r": 20, "t": 40, "b": 60},
        "hovermode": "x",
        "legend": {"orientation": "h", "y": -0.2, "yanchor": "top", "traceorder": "normal"},
        "xaxis": {"title": {"text": "iteration"}, "zeroline": False},
        "yaxis": {"title": {"text": f"memory ({unit})"}, "rangemode": "tozero"},
        "plot_bgcolor": "#ffffff", "paper_bgcolor": "#ffffff",
    }


def _lines(shown: list[IterationStats], scale: int, unit: str) -> list[dict[str, Any]]:
    """The allocated and peak lines, and the reserved line where any iteration read it."""
    xs = [it.index for it in shown]
    text = [_point_text(it) for it in shown]
    lines = [_line("allocated", xs, [it.allocated / scale for it in shown], text, unit,
                   mode="lines+markers" if len(shown) <= 60 else "lines"),
             _line("peak", xs, [it.peak / scale for it in shown], text, unit, dash="dot")]
    if any(it.reserved is not None for it in shown):
        lines.append(_line("reserved", xs, [None if it.reserved is None else it.reserved / scale
                                            for it in shown], text, unit, dash="dash"))
    return lines


def _timeline_traces(report: ReportData, shown: list[IterationStats], scale: int, unit: str,
                     stacked: bool) -> list[dict[str, Any]]:
    """The timeline's traces: the breakdown stacked (when ``stacked``), the allocated, peak
    and reserved lines, then the censuses and findings marked."""
    traces = _stacked(shown, scale, unit) if stacked else []
    traces += _lines(shown, scale, unit)
    traces += _markers(report, {it.index: it for it in report.iterations}, scale, unit)
    return traces


def _timeline_title(iterations: Sequence[IterationStats], shown: list[IterationStats]) -> str:
    """The timeline's title: the iterations, and how many are drawn when it was thinned."""
    title = f"Timeline: {len(iterations):,} iterations"
    if len(shown) < len(iterations):
        title += f" ({len(shown):,} drawn: the highest peak and the allocated range per bucket)"
    return title


def _stack_below(layout: dict[str, Any], unit: str) -> None:
    """Make room in ``layout`` for the breakdown's stacked parts: below the lines, on the same
    iterations."""
    layout["height"] = 560
    layout["yaxis"]["domain"] = [0.45, 1]
    layout["yaxis2"] = {"domain": [0, 0.38], "anchor": "x", "rangemode": "tozero",
                        "title": {"text": f"at each peak ({unit})"}}
    layout["xaxis"]["anchor"] = "y2"


def _mark_oom(layout: dict[str, Any], iteration: int) -> None:
    """Mark in ``layout`` the iteration that ran out of memory: a line across and a label."""
    layout["shapes"] = [{"type": "line", "xref": "x", "yref": "paper", "y0": 0, "y1": 1,
                         "x0": iteration, "x1": iteration,
                         "line": {"color": _COLOURS["leak"], "width": 2}}]
    layout["annotations"] = [{"x": iteration, "y": 1, "yref": "paper",
                              "text": "out of memory", "showarrow": False,
                              "font": {"color": _COLOURS["leak"]}, "yanchor": "bottom"}]


def timeline_figure(report: ReportData, *, at_most: int = AT_MOST) -> dict[str, Any] | None:
    """The iteration timeline: allocated at each boundary, the peak inside, reserved, the
    breakdown at each peak stacked, censuses and findings marked; ``None`` with no
    iteration."""
    if not report.iterations:
        return None
    shown = thin(report.iterations, at_most)
    largest = max(max(it.peak, it.allocated, it.reserved or 0) for it in report.iterations)
    scale, unit = unit_for(largest)
    stacked = any(it.parts for it in shown)
    traces = _timeline_traces(report, shown, scale, unit, stacked)
    layout = _layout(unit, _timeline_title(report.iterations, shown))
    layout["xaxis"] = iteration_axis("iteration", report.iterations)
    if stacked:
        _stack_below(layout, unit)
    if report.oom is not None:
        _mark_oom(layout, report.oom.iteration)
    return {"data": traces, "layout": layout}


def ranks_figure(report: ReportData, *, at_most: int = AT_MOST) -> dict[str, Any] | None:
    """One allocated line per rank of a combined report; ``None`` when it combines none."""
    ranked = [each for each in report.ranks if each.iterations]
    if not ranked:
        return None
    largest = max(it.peak for each in ranked for it in each.iterations)
    scale, unit = unit_for(largest)
    traces = []
    for each in ranked:
        shown = thin(each.iterations, max(at_most // len(ranked), 100))
        traces.append({
            "type": "scatter", "mode": "lines", "name": f"rank {each.rank}",
            "x": [it.index for it in shown], "y": [it.allocated / scale for it in shown],
            "hovertemplate": f"rank {each.rank}: %{{y:.4g}} {unit}<extra></extra>",
        })
    return {"data": traces, "layout": _layout(unit, "Allocated per rank", height=320)}


__all__ = ["AT_MOST", "ranks_figure", "thin", "timeline_figure", "unit_for"]
