"""A diff of two reports as one self-contained HTML page (``memsentry diff --html``,
``Diff.to_html``): both runs' timelines on one axis, the categories at each peak side by side,
the layers that changed (a sortable table), the findings that appeared and disappeared (each
linked to its iteration on the chart) and the limits' verdict.

Pure formatting of a :class:`~memsentry.model.ReportDiff`; the page carries plotly.js, its
styles, script and data, and makes no request (as the report's page, whose pieces it reuses).
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from typing import Any

from memsentry.model import (
    CategoryChange,
    Finding,
    IterationStats,
    LimitCheck,
    ReportDiff,
    RunSummary,
)
from memsentry.model.diff import LayerChange, format_share
from memsentry.reporters.charts import AT_MOST, iteration_axis, thin, unit_for
from memsentry.reporters.diff import _layer_delta, headline_rows, render_check, run_lines
from memsentry.reporters.html import asset, finding_card, rich_text, script_json
from memsentry.reporters.plotly import plotly_js
from memsentry.units import format_bytes
from memsentry.usercode.text import encodable

_DOM = "memsentry-diff"
_COLOURS = {"old": "#8a94a0", "new": "#1f5fa8", "appeared": "#c0262d", "disappeared": "#3d8b40"}
_CATEGORY_LABELS = {"parameters": "parameters", "gradients": "gradients",
                    "optimizer_state": "optimizer state",
                    "activations": "activations (saved for backward)", "other": "other",
                    "total": "total"}
_LAYER_COLUMNS = (
    # (heading, what it is)
    ("layer", "module path"),
    ("type", "module class"),
    ("saved old", "bytes saved for backward per call (the output where nothing was saved)"),
    ("saved new", "the same in the new run"),
    ("saved Δ", "new minus old"),
    ("fwd peak old", "the most memory its forward added, per call"),
    ("fwd peak new", "the same in the new run"),
    ("fwd peak Δ", "new minus old"),
)


# -- charts ---------------------------------------------------------------------------------
def _run_traces(run: RunSummary, which: str, scale: int, unit: str,
                at_most: int) -> list[dict[str, Any]]:
    shown = thin(run.timeline, at_most)
    xs = [it.index for it in shown]
    colour = _COLOURS[which]
    traces = []
    for figure, dash in (("allocated", "solid"), ("peak", "dot")):
        ys = [getattr(it, figure) / scale for it in shown]
        traces.append({
            "type": "scatter", "mode": "lines", "name": f"{which} {figure}", "x": xs, "y": ys,
            "legendgroup": which, "line": {"color": colour, "width": 2, "dash": dash},
            "hovertemplate": f"{which} {figure} %{{y:.4g}} {unit}<extra>"
                             f"{html.escape(run.label, quote=False)}</extra>",
        })
    return traces


def _on_timeline(findings: Sequence[tuple[int, Finding]],
                 by_index: dict[int, IterationStats]) -> list[tuple[int, Finding, int]]:
    """(card index, finding, iteration) of each finding whose iteration the run recorded."""
    marked = []
    for index, finding in findings:
        if finding.iteration is not None and finding.iteration in by_index:
            marked.append((index, finding, finding.iteration))
    return marked


def _marker_text(finding: Finding) -> str:
    """A marker's hover text: severity, rule and the message's start."""
    text = f"{finding.severity.value.upper()} {finding.rule}: {finding.message[:90]}"
    return html.escape(text, quote=False)


def _finding_markers(findings: Sequence[tuple[int, Finding]], run: RunSummary, which: str,
                     scale: int) -> dict[str, Any] | None:
    """The findings of one side, marked at their iteration on that run's peak line."""
    by_index: dict[int, IterationStats] = {it.index: it for it in run.timeline}
    marked = _on_timeline(findings, by_index)
    if not marked:
        return None
    return {
        "type": "scatter", "mode": "markers", "name": f"finding {which}",
        "x": [at for _, _, at in marked],
        "y": [by_index[at].peak / scale for _, _, at in marked],
        "text": [_marker_text(f) for _, f, _ in marked], "customdata": [i for i, _, _ in marked],
        "marker": {"symbol": "x" if which == "appeared" else "circle-open", "size": 12,
                   "color": _COLOURS[which], "line": {"width": 2, "color": _COLOURS[which]}},
        "hovertemplate": "%{text}<extra>click: show the finding</extra>",
    }


def _layout(unit: str, title: str, *, height: int, x_title: str) -> dict[str, Any]:
    return {
        "title": {"text": title, "font": {"size": 14}, "x": 0, "xanchor": "left"},
        "height": height, "margin": {"l": 60, "r": 20, "t": 40, "b": 60},
        "legend": {"orientation": "h", "y": -0.2, "yanchor": "top"},
        "xaxis": {"title": {"text": x_title}, "zeroline": False},
        "yaxis": {"title": {"text": f"memory ({unit})"}, "rangemode": "tozero"},
        "plot_bgcolor": "#ffffff", "paper_bgcolor": "#ffffff",
    }


def _runs(diff: ReportDiff) -> list[tuple[RunSummary, str]]:
    """Each run that closed an iteration, with its side: old first."""
    return [(run, which) for run, which in ((diff.old, "old"), (diff.new, "new")) if run.timeline]


def _largest(runs: Sequence[RunSummary]) -> int:
    """The most memory any of ``runs`` allocated or peaked at, at an iteration."""
    return max(max(it.peak, it.allocated) for run in runs for it in run.timeline)


def _side_markers(diff: ReportDiff, cards: Sequence[tuple[int, Finding, str]],
                  scale: int) -> list[dict[str, Any]]:
    """The findings that appeared, marked on the new run, and those that disappeared, on the
    old one."""
    traces = []
    for which, run in (("appeared", diff.new), ("disappeared", diff.old)):
        side = [(i, f) for i, f, card_side in cards if card_side == which]
        marker = _finding_markers(side, run, which, scale)
        if marker is not None:
            traces.append(marker)
    return traces


def runs_figure(diff: ReportDiff, cards: Sequence[tuple[int, Finding, str]], *,
                at_most: int = AT_MOST) -> dict[str, Any] | None:
    """Both runs' allocated and peak lines on one iteration axis, the findings that appeared
    marked on the new run and those that disappeared on the old one; ``None`` when neither
    run closed an iteration."""
    runs = _runs(diff)
    if not runs:
        return None
    scale, unit = unit_for(_largest([run for run, _ in runs]))
    traces = []
    for run, which in runs:
        traces += _run_traces(run, which, scale, unit, at_most)
    traces += _side_markers(diff, cards, scale)
    title = (f"Both runs on one axis: old {diff.old.iterations:,} iterations, new "
             f"{diff.new.iterations:,}")
    layout = _layout(unit, title, height=400, x_title="iteration")
    layout["xaxis"] = iteration_axis("iteration", [it for run, _ in runs for it in run.timeline])
    layout["hovermode"] = "x"
    return {"data": traces, "layout": layout}


def _category_trace(rows: Sequence[CategoryChange], which: str, scale: int,
                    unit: str) -> dict[str, Any]:
    """One run's bars (``which``: old or new), a bar per category."""
    values = [getattr(c.bytes, which) for c in rows]
    return {
        "type": "bar", "name": which, "x": [_CATEGORY_LABELS.get(c.name, c.name) for c in rows],
        "y": [None if v is None else v / scale for v in values],
        "marker": {"color": _COLOURS[which]},
        "hovertemplate": f"{which} %{{y:.4g}} {unit}<extra>%{{x}}</extra>",
    }


def categories_figure(diff: ReportDiff) -> dict[str, Any] | None:
    """The breakdown at each run's highest peak, old and new bars per category; ``None``
    unless both runs recorded one."""
    rows = [c for c in diff.categories if c.name != "total"]
    if not rows:
        return None
    scale, unit = unit_for(max(max(c.bytes.old or 0, c.bytes.new or 0) for c in rows))
    traces = [_category_trace(rows, which, scale, unit) for which in ("old", "new")]
    layout = _layout(unit, "Memory at each run's highest peak, by category", height=320,
                     x_title="")
    layout["barmode"] = "group"
    return {"data": traces, "layout": layout}


# -- sections -------------------------------------------------------------------------------
def _headline(diff: ReportDiff) -> str:
    items = [*run_lines(diff), *(f"{name} {text}" for name, text in headline_rows(diff))]
    lis = "".join(f"<li>{html.escape(item)}</li>" for item in items)
    return (f"<h1>memsentry diff: <code>{html.escape(diff.old.label)}</code> → "
            f"<code>{html.escape(diff.new.label)}</code></h1><ul class='summary'>{lis}</ul>")


def _verdict(diff: ReportDiff, check: LimitCheck | None) -> str:
    if check is None or not check.limits.any:
        return ""
    text = render_check(diff, check, width=10_000) or ""
    kind = "crossed" if check.breaches else "within"
    lines = "".join(f"<li>{rich_text(line.strip())}</li>" for line in text.splitlines()[1:]) \
        if check.breaches else ""
    head = text.splitlines()[0] if text else ""
    return (f"<section class='verdict {kind}'><p><b>{html.escape(head)}</b></p>"
            f"<ul>{lines}</ul></section>")


def _warnings(diff: ReportDiff) -> str:
    if not diff.mismatches:
        return ""
    items = "".join(f"<li>{rich_text(m.message)}</li>" for m in diff.mismatches)
    return f"<section class='warnings'><h2>Warnings</h2><ul>{items}</ul></section>"


def _categories_table(diff: ReportDiff) -> str:
    if not diff.categories:
        return ""
    rows = []
    for c in diff.categories:
        change = c.bytes
        share = format_share(change.relative) if change.delta and change.relative is not None \
            else ""
        rows.append(f"<tr><td>{html.escape(_CATEGORY_LABELS.get(c.name, c.name))}</td>"
                    f"<td>{format_bytes(change.old)}</td><td>{format_bytes(change.new)}</td>"
                    f"<td>{format_bytes(change.delta, signed=True)}</td><td>{share}</td></tr>")
    return ("<table class='plain'><thead><tr><th>at the peak</th><th>old</th><th>new</th>"
            f"<th>change</th><th>rel.</th></tr></thead><tbody>{''.join(rows)}</tbody></table>")


def _layer_row(index: int, layer: LayerChange, top: int) -> str:
    state = " (added)" if layer.added else " (removed)" if layer.removed else ""
    cells = [f'<td data-v="{html.escape(layer.name)}"><code>{html.escape(layer.name)}</code>'
             f"{state}</td>", f'<td data-v="{html.escape(layer.type)}">'
                              f"{html.escape(layer.type)}</td>"]
    for change in (layer.activation, layer.forward_peak):
        delta = _layer_delta(layer, change)
        for value, signed in ((change.old, False), (change.new, False), (delta, True)):
            sort = -1e30 if value is None else value
            bar = ""
            if signed and value and top:
                width = max(1, round(100 * abs(value) / top))
                colour = "up" if value > 0 else "down"
                bar = f'<span class="bar {colour}" style="width:{width}%"></span>'
            shown = format_bytes(value, signed=signed, compact=True)
            cells.append(f'<td data-v="{sort}">{bar}<span class="v">{shown}</span></td>')
    return f'<tr data-row="{index}">{"".join(cells)}</tr>'


def _layers(diff: ReportDiff, top: int | None) -> str:
    changed = diff.largest_layer_changes(top)
    if not diff.layers:
        return ""
    if not changed:
        return (f"<section><h2>Layers</h2><p class='none'>No layer changed: the "
                f"{len(diff.layers)} layers of both runs save the same bytes for backward and "
                "add the same forward peak per call.</p></section>")
    largest = max(abs(_layer_delta(layer, change) or 0) for layer in changed
                  for change in (layer.activation, layer.forward_peak))
    head = "".join(f'<th title="{html.escape(about)}" data-col="{i}">{html.escape(h)}</th>'
                   for i, (h, about) in enumerate(_LAYER_COLUMNS))
    rows = "".join(_layer_row(i, layer, largest) for i, layer in enumerate(changed))
    total = len(diff.largest_layer_changes(None))
    of = f" ({len(changed)} of {total} shown)" if total > len(changed) else ""
    return (f"<section><h2>Layers that changed most{of}</h2>"
            f'<table class="layers"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>'
            "<p class='hint'>Click a heading to sort. Bytes are per call: the worst call after "
            "the first.</p></section>")


def finding_cards(diff: ReportDiff) -> list[tuple[int, Finding, str]]:
    """(card number, finding, side) for every finding shown: the appeared ones (new run),
    the disappeared ones (old run), then those in both (as the new run saw them)."""
    cards: list[tuple[int, Finding, str]] = []
    for side, findings in (("appeared", diff.appeared), ("disappeared", diff.disappeared),
                           ("both", tuple(pair.new for pair in diff.persisted))):
        cards += [(len(cards) + i, f, side) for i, f in enumerate(findings)]
    return cards


def _findings(cards: Sequence[tuple[int, Finding, str]]) -> str:
    titles = {"appeared": "Findings that appeared (new run)",
              "disappeared": "Findings that disappeared (old run)",
              "both": "Findings in both runs (as the new run saw them)"}
    sections = []
    for side, title in titles.items():
        mine = [(i, f) for i, f, s in cards if s == side]
        if mine:
            body = "".join(finding_card(_DOM, i, f) for i, f in mine)
            sections.append(f"<section class='{side}'><h2>{title} ({len(mine)})</h2>{body}"
                            "</section>")
    if not sections:
        return "<section><h2>Findings</h2><p class='none'>Neither run made a finding.</p></section>"
    return "".join(sections)


_EXTRA_CSS = """
.memsentry .verdict { border-radius: 4px; padding: 6px 12px; margin: 12px 0; }
.memsentry .verdict.crossed { background: #fbe9ea; border: 1px solid #c0262d; }
.memsentry .verdict.within { background: #eef7ee; border: 1px solid #3d8b40; }
.memsentry .verdict p, .memsentry .verdict ul { margin: 4px 0; }
.memsentry .warnings { background: #fff7e6; border: 1px solid #e8b04a; border-radius: 4px;
  padding: 0 12px 6px; }
.memsentry table.plain { border-collapse: collapse; font-size: 13px; }
.memsentry table.plain th, .memsentry table.plain td { padding: 2px 10px; text-align: right;
  border-bottom: 1px solid #f0f1f3; }
.memsentry table.plain th:first-child, .memsentry table.plain td:first-child { text-align: left; }
.memsentry td .bar.up { background: #f3b6b9; }
.memsentry td .bar.down { background: #b9dfba; }
.memsentry section.disappeared .finding { opacity: .8; }
"""


def render_diff_html(diff: ReportDiff, *, check: LimitCheck | None = None, top: int | None = 25,
                     at_most: int = AT_MOST) -> str:
    """The whole diff as one self-contained page (plotly.js inside; needs ``memsentry[html]``)."""
    cards = finding_cards(diff)
    figures = {"timeline": runs_figure(diff, cards, at_most=at_most),
               "categories": categories_figure(diff)}
    timeline = ('<section><h2>Timeline</h2><div class="chart" id="memsentry-diff-timeline" '
                'data-chart="timeline"></div></section>') if figures["timeline"] else (
        "<section><h2>Timeline</h2><p class='none'>Neither run closed an iteration.</p>"
        "</section>")
    categories = ""
    if figures["categories"] is not None:
        categories = ('<section><h2>Memory at the highest peak, by category</h2>'
                      '<div class="chart" id="memsentry-diff-categories" '
                      f'data-chart="categories"></div>{_categories_table(diff)}</section>')
    body = [_headline(diff), _verdict(diff, check), _warnings(diff), _findings(cards), timeline,
            categories, _layers(diff, top)]
    data = {"figures": {k: v for k, v in figures.items() if v is not None}}
    title = f"memsentry diff: {diff.old.label} → {diff.new.label}"
    return encodable(
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<title>{html.escape(title)}</title></head><body>"
        f'<div class="memsentry" id="{_DOM}"><style>{asset("report.css")}{_EXTRA_CSS}</style>'
        f'{"".join(body)}</div>'
        f"<script>{plotly_js()}</script>"
        f'<script type="application/json" id="{_DOM}-data">{script_json(data)}</script>'
        f"<script>{asset('report.js')}\nmemsentryRender({json.dumps(_DOM)});</script>"
        "</body></html>"
    )


__all__ = ["categories_figure", "finding_cards", "render_diff_html", "runs_figure"]
