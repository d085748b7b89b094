"""A judged allocator snapshot as one self-contained HTML page (``memsentry show snap.pickle
--html FILE``): the verdict in its title, the findings, and each device's figures and tables.
No script and no request: the timeline of a snapshot is memory_viz's to draw."""

from __future__ import annotations

import html

from memsentry.model import Finding
from memsentry.reporters.html import rich_text
from memsentry.reporters.snapshot import NO_FINDINGS
from memsentry.snapshots.judge import TOP_SITES, DeviceVerdict, SiteMemory, SnapshotVerdict
from memsentry.units import format_bytes
from memsentry.usercode.text import printable

_STYLE = """
body { font: 15px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 72em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
.leak { color: #b00020; } .waste { color: #8a5a00; } .hint { color: #345; }
.finding { margin: .8em 0; padding: .5em .8em; border-left: 4px solid #ccc; }
.finding.leak { border-color: #b00020; } .finding.waste { border-color: #d08c00; }
table { border-collapse: collapse; margin: .5em 0 1em; }
td, th { padding: .2em .8em; border-bottom: 1px solid #eee; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
code { background: #f4f4f4; padding: 0 .2em; }
.note { color: #666; }
"""


def title(verdict: SnapshotVerdict, findings: tuple[Finding, ...]) -> str:
    """``memsentry: 1 LEAK, 1 WASTE in snap.pickle``, or that it found nothing."""
    counts: dict[str, int] = {}
    for finding in findings:
        name = finding.severity.value.upper()
        counts[name] = counts.get(name, 0) + 1
    said = ", ".join(f"{count} {name}" for name, count in counts.items()) or "no finding"
    return f"memsentry: {said} in {printable(verdict.path)}"


def render_snapshot_html(verdict: SnapshotVerdict, findings: tuple[Finding, ...]) -> str:
    head = title(verdict, findings)
    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
             f"<title>{html.escape(head)}</title><style>{_STYLE}</style></head><body>",
             f"<h1>{html.escape(head)}</h1>",
             f"<p class='note'>An allocator snapshot of {format_bytes(verdict.file_bytes)}, "
             "judged by memsentry. Its timeline opens at "
             "<a href='https://pytorch.org/memory_viz'>pytorch.org/memory_viz</a>.</p>",
             "<h2>Findings</h2>", _findings(findings)]
    parts += [_device(device) for device in verdict.devices]
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _findings(findings: tuple[Finding, ...]) -> str:
    if not findings:
        return f"<p>{rich_text(NO_FINDINGS)}</p>"
    items = []
    for finding in findings:
        kind = finding.severity.value
        items.append(
            f"<div class='finding {kind}'><b class='{kind}'>{kind.upper()}</b> "
            f"<code>{html.escape(finding.rule)}</code>: {rich_text(printable(finding.message))}"
            f"<br>fix: {rich_text(printable(finding.fix))}</div>")
    return "\n".join(items)


def _device(device: DeviceVerdict) -> str:
    beat = (f"{device.iterations} iterations read from {device.rhythm}"
            if device.iterations is not None else "no iterations read from it")
    rows = [("trace entries", f"{device.entries:,} ({beat})"),
            ("allocated when the trace began", format_bytes(device.before)),
            ("peak", format_bytes(device.peak)), ("at the end", format_bytes(device.end))]
    if device.name != "cpu":
        cache = device.cache
        rows += [("reserved when the snapshot was taken",
                  f"{format_bytes(cache.reserved)} in {cache.segments:,} segments, "
                  f"{format_bytes(cache.allocated)} in use"),
                 ("largest free cached piece", format_bytes(cache.largest_free))]
    facts = "".join(f"<tr><th>{html.escape(name)}</th><td>{html.escape(value)}</td></tr>"
                    for name, value in rows)
    parts = [f"<h2>{html.escape(device.name)}</h2>", f"<table>{facts}</table>"]
    if device.phases_known:
        phases = "".join(f"<tr><td>{html.escape(part.value)}</td>"
                         f"<td class='num'>{format_bytes(size)}</td></tr>"
                         for part, size in device.parts_at_peak)
        parts.append("<h3>At the peak, by phase</h3><p class='note'>Read from torch's frames "
                     f"in each block's stack.</p><table>{phases}</table>")
    parts.append(_sites("At the peak, by your line", device.sites_at_peak))
    parts.append(_sites("At the end, by your line", device.sites_at_end))
    return "\n".join(parts)


def _sites(heading: str, sites: tuple[SiteMemory, ...]) -> str:
    rows = "".join(
        f"<tr><td class='num'>{format_bytes(site.bytes)}</td><td class='num'>{site.blocks:,}"
        f"</td><td><code>{html.escape(printable(site.site or '(no frame of your code)'))}"
        f"</code></td></tr>" for site in sites[:TOP_SITES])
    header = "<tr><th>bytes</th><th>blocks</th><th>line</th></tr>"
    return f"<h3>{html.escape(heading)}</h3><table>{header}{rows}</table>"


__all__ = ["render_snapshot_html", "title"]
