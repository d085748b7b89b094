"""The text report: header, findings, the per-layer table, the timeline and the notes."""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from typing import IO

from tabulate import DataRow, TableFormat, tabulate

from memsentry.model import (
    Boundary,
    Breakdown,
    IterationStats,
    LayerStats,
    PeakMode,
    ReportData,
    complete,
    growth_per_iteration,
)
from memsentry.reporters.breakdown import render_breakdown
from memsentry.reporters.columns import LAYER_COLUMNS
from memsentry.reporters.finding_text import finding_lines
from memsentry.reporters.gpus import device_lines, nvml_line
from memsentry.reporters.headline import headline
from memsentry.reporters.oom import render_oom
from memsentry.reporters.processes import render_processes
from memsentry.reporters.ranks import rank_line, render_ranks
from memsentry.reporters.width import terminal_width
from memsentry.reporters.wrap import fill
from memsentry.units import format_bytes
from memsentry.usercode.text import printable_values

# Two header lines, rendered as the first rows so that columns are only as wide as their cells
# (tabulate widens every real header by two characters); ten columns then fit 100 characters.
_LAYER_HEADERS = tuple(zip(*(column.lines for column in LAYER_COLUMNS), strict=True))
_NARROW = TableFormat(
    lineabove=None,
    linebelowheader=None,
    linebetweenrows=None,
    linebelow=None,
    headerrow=DataRow("", " ", ""),
    datarow=DataRow("", " ", ""),
    padding=0,
    with_header_hide=None,
)
_ITER_HEADERS = ("iter", "allocated", "vs start", "peak", "reserved", "time")
_MIN_NAME = 12


def _fit(text: str, width: int, *, keep_end: bool = True) -> str:
    """Shorten ``text`` to ``width`` characters with an ellipsis (keeping its end by default)."""
    if len(text) <= width:
        return text
    if width <= 1:
        return text[:width]
    return "…" + text[-(width - 1):] if keep_end else text[: width - 1] + "…"


def footprint(layer: LayerStats) -> int:
    """What a layer costs at its worst: the larger of its forward peak and its saved bytes."""
    return max(layer.forward_peak or 0, layer.saved_bytes or 0, layer.backward_peak or 0)


def select_layers(
    layers: Sequence[LayerStats], *, max_depth: int | None, top: int | None
) -> list[LayerStats]:
    """Layers no deeper than ``max_depth``; when more than ``top`` remain, the ``top`` with the
    largest footprint, kept in call order."""
    shown = [layer for layer in layers if max_depth is None or layer.depth <= max_depth]
    if top is not None and len(shown) > top:
        keep = set(map(id, sorted(shown, key=footprint, reverse=True)[:top]))
        shown = [layer for layer in shown if id(layer) in keep]
    return shown


def _layer_row(layer: LayerStats, peak: Breakdown | None) -> list[str]:
    return [column.cell(layer, peak) for column in LAYER_COLUMNS]


def _totals_row(layers: Sequence[LayerStats]) -> list[str]:
    """Sums over leaf layers (containers would count their children twice)."""
    leaves = [layer for layer in layers if layer.is_leaf]

    def total(attr: str) -> str:
        values = [getattr(layer, attr) for layer in leaves if getattr(layer, attr) is not None]
        return format_bytes(sum(values), compact=True) if values else "-"

    row = [total(c.attr) if c.summed and c.attr else "" for c in LAYER_COLUMNS]
    row[0] = "total (leaf layers)"
    return row


def fit_layer_rows(headers: Sequence[Sequence[str]], rows: list[list[str]],
                   width: int) -> list[str]:
    """Fit a layer table to ``width``: every column but the first two keeps its size, the
    type (second) is cut to 12 characters and the name (first) gets what is left; ``rows``
    are cut in place. The rule line under the headers."""
    every = [*headers, *rows]
    widths = [max(len(row[i]) for row in every) for i in range(len(headers[0]))]
    widths[1] = min(widths[1], 12)
    widths[0] = max(_MIN_NAME, min(widths[0], width - sum(widths[1:]) - (len(widths) - 1)))
    for row in rows:
        row[0] = _fit(row[0], widths[0])
        row[1] = _fit(row[1], widths[1], keep_end=False)
    return ["-" * w for w in widths]


def render_layers(report: ReportData, *, max_depth: int | None, top: int | None, width: int) -> str:
    """The per-layer table, fitted to ``width`` characters."""
    if not report.layers:
        return "Layers: no module forward ran while tracking."
    shown = select_layers(report.layers, max_depth=max_depth, top=top)
    peak = report.breakdown.peak
    rows = [_layer_row(layer, peak) for layer in shown]
    rows.append(_totals_row(report.layers))
    rule = fit_layer_rows(_LAYER_HEADERS, rows, width)
    if rows[-1][0].startswith("…"):  # a narrow table: the totals' label is shortened, not cut
        rows[-1][0] = "total"
    hidden = len(report.layers) - len(shown)
    title = "Layers (bytes per call: the worst call after the first, which carries one-time set-up"
    if report.peak_mode == PeakMode.ITERATIONS:
        title += ("; a peak is a lower bound where the layer did not set its iteration's high "
                  "(samples at hooks)")
    if hidden:
        limits = []
        if max_depth is not None:
            limits.append(f"depth <= {max_depth}")
        if top is not None:
            limits.append(f"top {top} by footprint")
        title += f"; {len(shown)} of {len(report.layers)} shown: {', '.join(limits)}"
    title = fill(title + ")", width, subsequent_indent="  ")
    table = tabulate([*map(list, _LAYER_HEADERS), rule, *rows], tablefmt=_NARROW,
                     colalign=("left", "left") + ("right",) * 9, disable_numparse=True)
    return f"{title}\n{table}"


def _shown_iterations(its: Sequence[IterationStats], rows_at_most: int
                      ) -> list[IterationStats | None]:
    """The iterations the table shows: all of them, or the first third and the last of
    ``rows_at_most`` with ``None`` where the middle is left out."""
    if len(its) <= rows_at_most:
        return list(its)
    head = rows_at_most // 3
    return [*its[:head], None, *its[-(rows_at_most - head):]]


def _elided(it: IterationStats | None, before: IterationStats | None,
            rows: list[list[str]]) -> bool:
    """Whether a ``…`` row goes before ``it``: the table leaves iterations out here
    (``None``), or iterations since ``before`` were not read (passed), unless the row above
    already is one."""
    if it is None:
        return True
    return before is not None and it.index > before.index + 1 and rows[-1][0] != "…"


def _iteration_row(it: IterationStats, report: ReportData, resident: bool) -> list[str]:
    """One iteration's cells: its index, allocated, change since the start, peak, reserved,
    resident (when the table has the column) and time."""
    label = f"{it.index}" + (" (end)" if it.boundary == Boundary.EXIT else "")
    return [label, format_bytes(it.allocated),
            format_bytes(it.allocated - report.baseline, signed=True),
            _peak_cell(it, report), format_bytes(it.reserved),
            *[format_bytes(it.resident)] * resident,
            f"{it.seconds * 1000:.1f} ms"]


def _iteration_rows(report: ReportData, shown: list[IterationStats | None], resident: bool,
                    columns: int) -> list[list[str]]:
    """The table's rows, with a ``…`` row (``columns`` cells) wherever iterations are left
    out."""
    rows: list[list[str]] = []
    before: IterationStats | None = None
    for it in shown:
        if _elided(it, before, rows):
            rows.append(["…"] + [""] * (columns - 1))
        before = it
        if it is not None:
            rows.append(_iteration_row(it, report, resident))
    return rows


def _iterations_title(report: ReportData, its: Sequence[IterationStats], resident: bool) -> str:
    """The table's title: the iterations recorded, those thinned out and passed, and what the
    columns read."""
    missing = sum(b.index - a.index - 1 for a, b in itertools.pairwise(its))
    passed = max(0, missing - report.dropped_iterations)
    clauses = (
        (report.dropped_iterations, f", {report.dropped_iterations} thinned out"),
        (passed, f", {passed} passed with a count only (their boundaries not read, to keep "
                 "to the budget)"),
        (True, "; allocated at each boundary, peak inside"),
        (any(it.reserved is None for it in its),
         "; reserved '-': not read in a light iteration"),
        (resident, "; resident: the whole process, as the system counts it"),
    )
    said = "".join(text for shown, text in clauses if shown)
    return f"Iterations ({len(its)} recorded{said})"


def _iterations_summary(its: Sequence[IterationStats]) -> str | None:
    """The median iteration's time and, past the first iteration, how allocated changes per
    iteration; ``None`` when no iteration is complete."""
    closed = complete(its)
    if not closed:
        return None
    median_s = statistics.median(it.seconds for it in closed)
    summary = f"median iteration {median_s * 1000:.1f} ms"
    slope = growth_per_iteration(its, warmup=1, at_least=3)
    if slope is not None:
        summary += f"; allocated changes by {format_bytes(round(slope), signed=True)}/iter"
        summary += " after the first iteration"
    return summary


def render_iterations(report: ReportData, *, rows_at_most: int = 12, width: int = 100) -> str:
    """The iterations table (at most ``rows_at_most`` rows), its title and summary, fitted to
    ``width``."""
    its = report.iterations
    if not its:
        return fill("Iterations: none ended (iterations end at optimizer.step() or t.step()).",
                    width, subsequent_indent="  ")
    resident = any(it.resident is not None for it in its)
    headers = _ITER_HEADERS[:-1] + ("resident",) * resident + _ITER_HEADERS[-1:]
    rows = _iteration_rows(report, _shown_iterations(its, rows_at_most), resident,
                           len(headers))
    table = tabulate(rows, headers=headers, tablefmt="simple",
                     colalign=("right",) * len(headers), disable_numparse=True)
    lines = [fill(_iterations_title(report, its, resident), width, subsequent_indent="  "),
             table]
    summary = _iterations_summary(its)
    if summary is not None:
        lines.append(fill(summary, width))
    return "\n".join(lines)


def render_findings(report: ReportData, *, width: int = 100) -> str:
    """Each finding: severity, rule id and message, then the fix, wrapped to ``width``."""
    lines = [f"Findings ({len(report.findings)})", *finding_lines(report.findings, width=width)]
    return "\n".join(lines)


def _peak_cell(it: IterationStats, report: ReportData) -> str:
    """An iteration's peak; ``>=`` before it where a run that counts peaks could not count
    this one (a light iteration, one the budget passed): a lower bound."""
    bound = not it.peak_exact and report.peak_mode != PeakMode.SAMPLED
    return (">= " if bound else "") + format_bytes(it.peak)


def render_header(report: ReportData, *, width: int = 100) -> str:
    where = rank_line(report)
    parts = [f"memsentry: {report.device} ({report.backend}, peaks {report.peak_mode})"
             + (f", {where}" if where else "")]
    figures = [f"at start {format_bytes(report.baseline)}"]
    if report.allocated is not None:
        change = format_bytes(report.allocated - report.baseline, signed=True)
        figures.append(f"now {format_bytes(report.allocated)} ({change})")
    if report.peak is not None:
        figures.append(f"peak {format_bytes(report.peak)}")
    if report.total_memory:
        figures.append(f"of {format_bytes(report.total_memory)}")
    parts.append("allocated " + ", ".join(figures))
    process = _process_line(report)
    if process is not None:
        parts.append(process)
    if report.nvml is not None:
        parts.append(nvml_line(report.nvml))
    lines = [fill(part, width, subsequent_indent="  ") for part in parts]
    lines += [fill(line, width, subsequent_indent="    ") for line in device_lines(report)]
    return "\n".join(lines)


def _process_line(report: ReportData) -> str | None:
    """The process's resident memory, as the system counts it, beside the allocator's."""
    if not report.process:
        return None
    first, last = report.process[0], report.process[-1]
    line = (f"process resident at start {format_bytes(first.rss)}, now "
            f"{format_bytes(last.rss)} ({format_bytes(last.rss - first.rss, signed=True)})")
    if report.resident_peak is not None:  # read before the last reading: never below it
        line += f", highest ever {format_bytes(max(report.resident_peak, last.rss))}"
    return line


#: What the text report shows: everything (the findings first, then the tables that explain
#: them), or the headline and the findings alone.
VIEWS = ("full", "findings")


def _checked_view(view: str) -> str:
    if view not in VIEWS:
        raise ValueError(f"unknown view {view!r}: use one of {', '.join(map(repr, VIEWS))}")
    return view


def render_text(report: ReportData, *, max_depth: int | None = None, top: int | None = 30,
                width: int = 100, view: str = "full") -> str:
    """The text report: a one-line headline, the out-of-memory post-mortem and the findings,
    then (``view="full"``) the header, the ranks, the layers, the iterations, the breakdown,
    the processes and the notes. The watched program's strings (module, holder and file
    names, messages) are written :func:`~memsentry.usercode.text.printable`: a control
    character is an escape."""
    _checked_view(view)
    report = printable_values(report)
    sections = [fill(headline(report), width, subsequent_indent="  ")]
    if report.oom is not None:
        sections.append(render_oom(report.oom, width=width))
    if report.findings:
        sections.append(render_findings(report, width=width))
    if view == "findings":
        return "\n\n".join(sections)
    sections.append(render_header(report, width=width))
    ranks = render_ranks(report)
    if ranks is not None:
        sections.append(ranks)
    sections.append(render_layers(report, max_depth=max_depth, top=top, width=width))
    sections.append(render_iterations(report, width=width))
    breakdown = render_breakdown(report, width=width)
    if breakdown is not None:
        sections.append(breakdown)
    processes = render_processes(report)
    if processes is not None:
        sections.append(processes)
    if report.notes:
        sections.append("\n".join(
            fill(f"note: {note}", width, subsequent_indent="      ")
            for note in report.notes
        ))
    return "\n\n".join(sections)


class TextReporter:
    """The report as text for a terminal: ``max_depth`` hides deeper layers, ``top`` keeps the
    layers with the largest footprint, ``width`` is the width the tables are fitted to,
    ``view`` is ``"full"`` or ``"findings"`` (the headline and the findings alone). The width
    is by default ``COLUMNS``, else the terminal's, else 100."""

    name = "text"

    def __init__(self, *, max_depth: int | None = None, top: int | None = 30,
                 width: int | None = None, view: str = "full") -> None:
        self.max_depth, self.top = max_depth, top
        self.width = terminal_width() if width is None else width
        self.view = _checked_view(view)  # refused when made, not when the report is printed

    def text(self, report: ReportData) -> str:
        return render_text(report, max_depth=self.max_depth, top=self.top, width=self.width,
                           view=self.view)

    def render(self, report: ReportData, out: IO[str]) -> None:
        out.write(self.text(report) + "\n")
