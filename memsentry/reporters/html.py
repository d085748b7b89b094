"""The HTML report: one self-contained file (styles, script, data and plotly.js inside it; no
request leaves the page) with the timeline, the findings linked to it, the per-layer table
(sortable, its module tree collapsible) and the rest of the text report's sections.

:func:`render_html` makes the whole page; :func:`render_fragment` the part a notebook shows
inline (``compact``: findings and timeline first, the tables folded away).
"""

from __future__ import annotations

import html
import importlib.resources
import json
import re
from collections.abc import Sequence
from typing import IO, Any

from memsentry.model import Finding, LayerStats, ReportData
from memsentry.reporters.breakdown import render_breakdown
from memsentry.reporters.charts import AT_MOST, ranks_figure, timeline_figure
from memsentry.reporters.columns import LAYER_COLUMNS
from memsentry.reporters.headline import headline
from memsentry.reporters.oom import render_oom
from memsentry.reporters.plotly import plotly_js
from memsentry.reporters.ranks import rank_line, render_ranks
from memsentry.reporters.text import render_header, render_iterations
from memsentry.units import format_bytes
from memsentry.usercode.text import encodable

_CODE = re.compile(r"`([^`]+)`")
def asset(name: str) -> str:
    return (importlib.resources.files("memsentry.reporters") / "assets" / name).read_text(
        encoding="utf-8")


def rich_text(value: str) -> str:
    """Escaped text with `backticked` spans as code."""
    return _CODE.sub(r"<code>\1</code>", html.escape(value, quote=False))


def script_json(value: Any) -> str:
    """JSON safe inside a ``<script>`` element (no ``</`` can close it early)."""
    return json.dumps(value, separators=(",", ":")).replace("</", "<\\/")


# -- sections -------------------------------------------------------------------------------
def _summary(report: ReportData) -> str:
    lines = render_header(report).splitlines()
    items = "".join(f"<li>{html.escape(line)}</li>" for line in lines)
    return f'<ul class="summary">{items}</ul>'


def _evidence(finding: Finding) -> str:
    parts = []
    if finding.bytes:
        parts.append(format_bytes(finding.bytes))
    if finding.rate:
        parts.append(f"{format_bytes(round(finding.rate), signed=True)}/iter")
    if finding.objects:
        parts.append(f"{finding.objects:,} objects")
    return ", ".join(parts)


def finding_card(dom: str, index: int, finding: Finding) -> str:
    severity = finding.severity.value
    rank = "" if finding.rank is None else f'<span class="rank">rank {finding.rank}</span>'
    rows = []
    if finding.subject is not None:
        rows.append(("about", f"<code>{html.escape(finding.subject.name)}</code> "
                              f"({html.escape(str(finding.subject.kind))})"))
    if finding.location is not None:
        rows.append(("line", f"<code>{html.escape(str(finding.location))}</code>"))
    evidence = _evidence(finding)
    if evidence:
        rows.append(("evidence", html.escape(evidence)))
    facts = "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in rows)
    jump = ""
    if finding.iteration is not None:
        jump = (f'<a href="#{dom}-timeline" class="jump" data-iteration="{finding.iteration}">'
                f"iteration {finding.iteration} on the timeline</a>")
    return (
        f'<div class="finding sev-{severity}" id="{dom}-f{index}">'
        f'<div class="head"><span class="badge">{severity.upper()}</span>'
        f"<code>{html.escape(finding.rule)}</code>{rank}{jump}</div>"
        f'<p class="message">{rich_text(finding.message)}</p><dl>{facts}</dl>'
        f'<p class="fix"><b>fix:</b> {rich_text(finding.fix)}</p></div>'
    )


def _findings(dom: str, report: ReportData) -> str:
    if not report.findings:
        return ('<section><h2>Findings (0)</h2><p class="none">No finding: no leak, waste or '
                "hint was seen in this run.</p></section>")
    cards = "".join(finding_card(dom, i, f) for i, f in enumerate(report.findings))
    return f'<section><h2>Findings ({len(report.findings)})</h2>{cards}</section>'


def _chart(dom: str, name: str, title: str, has: bool) -> str:
    if not has:
        return ""
    return (f'<section><h2>{title}</h2><div class="chart" id="{dom}-{name}" '
            f'data-chart="{name}"></div></section>')


def _parents(layers: Sequence[LayerStats]) -> list[int | None]:
    """Each layer's parent row (the nearest earlier layer one level up), by call order."""
    parents: list[int | None] = []
    stack: list[int] = []
    for i, layer in enumerate(layers):
        while stack and layers[stack[-1]].depth >= layer.depth:
            stack.pop()
        parents.append(stack[-1] if stack else None)
        stack.append(i)
    return parents


def _layer_cells(layer: LayerStats, report: ReportData, tops: dict[str, int]) -> str:
    peak = report.breakdown.peak
    cells = []
    for column in LAYER_COLUMNS[2:]:
        attr = column.attr
        if attr is None:  # the share of the peak
            share = column.cell(layer, peak)
            order = (layer.saved_bytes or 0) if share != "-" else -1
            cells.append(f'<td data-v="{order}">{share}</td>')
            continue
        value = getattr(layer, attr)
        shown = column.cell(layer, peak)
        drawn = ""
        if column.bar and value and tops.get(attr):
            width = max(1, round(100 * max(value, 0) / tops[attr]))
            drawn = f'<span class="bar" style="width:{width}%"></span>'
        sort = -1e30 if value is None else value
        cells.append(f'<td data-v="{sort}">{drawn}<span class="v">{html.escape(shown)}</span>'
                     '</td>')
    return "".join(cells)


def _tops(layers: Sequence[LayerStats]) -> dict[str, int]:
    """The largest value of each column drawn as a bar, which the bars are scaled to."""
    return {c.attr: max((getattr(x, c.attr) or 0 for x in layers), default=0)
            for c in LAYER_COLUMNS if c.bar and c.attr}


def _layers_head() -> str:
    """The table's headings, each with what its column is as a tooltip."""
    return "".join(
        f'<th title="{html.escape(c.about)}" data-col="{i}">{html.escape(c.heading)}</th>'
        for i, c in enumerate(LAYER_COLUMNS))


def _layer_row(index: int, layer: LayerStats, parent: int | None, has_children: bool,
               cells: str) -> str:
    """One layer's row: its fold button (a module with children) or leaf mark, indented by
    depth, its name and type, then ``cells``."""
    toggle = ('<button class="fold" aria-label="fold">▾</button>' if has_children
              else '<span class="leaf"></span>')
    parent_of = "" if parent is None else f' data-parent="{parent}"'
    return (f'<tr data-row="{index}" data-depth="{layer.depth}"{parent_of}>'
            f'<td data-v="{index}" style="padding-left:{0.3 + layer.depth * 1.1:.1f}em">'
            f"{toggle}<code>{html.escape(layer.name)}</code></td>"
            f'<td data-v="{html.escape(layer.type)}">{html.escape(layer.type)}</td>'
            f"{cells}</tr>")


def _layers(report: ReportData) -> str:
    """The layer table: a row per layer in call order, foldable by module, sortable by
    column; a line when no module forward ran."""
    if not report.layers:
        return "<p class='none'>No module forward ran while tracking.</p>"
    layers = report.layers
    parents = _parents(layers)
    has_children = {p for p in parents if p is not None}
    tops = _tops(layers)
    rows = [_layer_row(i, layer, parents[i], i in has_children,
                       _layer_cells(layer, report, tops))
            for i, layer in enumerate(layers)]
    return (f'<table class="layers"><thead><tr>{_layers_head()}</tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table>'
            '<p class="hint">Click a heading to sort (click "layer" again for the module tree); '
            "▾ folds a module's children. Bytes are per call: the worst call after the first.</p>")


def pre_section(title: str, text: str | None) -> str:
    if not text:
        return ""
    return f"<section><h2>{title}</h2><pre>{html.escape(text)}</pre></section>"


def _notes(report: ReportData) -> str:
    if not report.notes:
        return ""
    items = "".join(f"<li>{rich_text(note)}</li>" for note in report.notes)
    return f"<section><h2>Notes</h2><ul class='notes'>{items}</ul></section>"


def _folded(title: str, body: str, *, open_: bool) -> str:
    return (f"<details{' open' if open_ else ''}><summary>{title}</summary>{body}</details>")


def page_title(report: ReportData) -> str:
    """The verdict first, as the text report's headline says it, then the device (and the
    ranks): what a browser's tab and the page's heading show."""
    where = rank_line(report)
    return f"{headline(report)} ({report.device}" + (f", {where}" if where else "") + ")"


def render_fragment(report: ReportData, *, dom: str = "memsentry", compact: bool = False,
                    with_plotly: bool = True, at_most: int = AT_MOST) -> str:
    """The report as an HTML fragment (a ``div`` and its scripts) under the element id
    ``dom``; ``with_plotly`` embeds plotly.js (leave it out only where the page has it)."""
    figures = {"timeline": timeline_figure(report, at_most=at_most),
               "ranks": ranks_figure(report, at_most=at_most)}
    title = page_title(report)
    oom = None if report.oom is None else render_oom(report.oom, width=100)
    timeline = _chart(dom, "timeline", "Timeline", figures["timeline"] is not None) or (
        "<section><h2>Timeline</h2><p class='none'>No iteration ended (iterations end at "
        "optimizer.step() or t.step()).</p></section>")
    tables = [
        _folded(f"Layers ({len(report.layers)})", _layers(report), open_=not compact),
        pre_section("Memory at the highest peak", render_breakdown(report)),
        pre_section("Iterations", render_iterations(report)),
        _chart(dom, "ranks", "Ranks", figures["ranks"] is not None),
        pre_section("Ranks table", render_ranks(report)),
        _notes(report),
    ]
    heading, summary = f"<h1>{html.escape(title)}</h1>", _summary(report)
    failure, findings = pre_section("Out of memory", oom), _findings(dom, report)
    if compact:  # what a notebook user looks for first; the tables folded away
        body = [heading, failure, findings, timeline, summary,
                _folded("Tables and notes", "".join(tables), open_=False)]
    else:
        body = [heading, summary, failure, findings, timeline, *tables]
    data = {"figures": {k: v for k, v in figures.items() if v is not None}}
    scripts = [f"<script>{plotly_js()}</script>"] if with_plotly else []
    scripts.append(f'<script type="application/json" id="{dom}-data">'
                   f"{script_json(data)}</script>")
    scripts.append(f"<script>{asset('report.js')}\nmemsentryRender({json.dumps(dom)});</script>")
    return encodable(f'<div class="memsentry" id="{dom}"><style>{asset("report.css")}</style>'
                     f'{"".join(body)}</div>{"".join(scripts)}')


def render_html(report: ReportData, *, at_most: int = AT_MOST) -> str:
    """The whole page, one self-contained document."""
    title = page_title(report)
    return ("<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
            "<meta name='viewport' content='width=device-width, initial-scale=1'>"
            f"<title>{html.escape(encodable(title))}</title></head><body>"
            f"{render_fragment(report, at_most=at_most)}</body></html>")


class HtmlReporter:
    """The report as one self-contained HTML page (needs plotly: ``memsentry[html]``)."""

    name = "html"

    def __init__(self, *, at_most: int = AT_MOST) -> None:
        self.at_most = at_most

    def text(self, report: ReportData) -> str:
        return render_html(report, at_most=self.at_most)

    def render(self, report: ReportData, out: IO[str]) -> None:
        out.write(self.text(report) + "\n")


__all__ = ["HtmlReporter", "asset", "finding_card", "pre_section", "render_fragment", "render_html",
           "rich_text", "script_json"]
