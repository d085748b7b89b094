"""A judged allocator snapshot (``memsentry show snap.pickle``) as text and as JSON: pure
formatting of a :class:`~memsentry.snapshots.judge.SnapshotVerdict` and its findings."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from memsentry.model import Finding
from memsentry.model.codec import to_plain
from memsentry.reporters.finding_text import finding_lines
from memsentry.reporters.wrap import fill
from memsentry.rules.series import plural
from memsentry.snapshots.compare import SnapshotDiff
from memsentry.snapshots.frames import Part
from memsentry.snapshots.judge import TOP_SITES, DeviceVerdict, SiteMemory, SnapshotVerdict
from memsentry.units import format_bytes
from memsentry.usercode.text import printable

#: The version of the JSON layout below.
SCHEMA = 1

NO_FINDINGS = (
    "No findings: no line's blocks piled up once per iteration, no out-of-memory error is in "
    "the trace, and the cache was not cut up. A snapshot holds tensor storages only: an "
    "autograd graph kept without its saved tensors (`total += loss` after backward), Python "
    "objects and hooks are not in it (track() and `memsentry run` see those).")


def render_snapshot(verdict: SnapshotVerdict, findings: tuple[Finding, ...], *,
                    width: int = 100, findings_only: bool = False) -> str:
    """The verdict as text: the findings, then for each device its figures and what held
    memory at the peak and at the end."""
    lines = [f"memsentry: allocator snapshot {printable(verdict.path)} "
             f"({format_bytes(verdict.file_bytes)})", ""]
    lines += _findings(findings, width)
    if not findings_only:
        for device in verdict.devices:
            lines += ["", *_device(device, width)]
    return "\n".join(lines).rstrip() + "\n"


def _findings(findings: tuple[Finding, ...], width: int) -> list[str]:
    if not findings:
        return [NO_FINDINGS]
    # What a foreign file names (its paths) is shown with its control characters escaped.
    shown = [replace(f, message=printable(f.message), fix=printable(f.fix)) for f in findings]
    return [f"Findings ({len(findings)})", *finding_lines(shown, width=width)]


def _device(device: DeviceVerdict, width: int) -> list[str]:
    beat = (f"{device.iterations} iterations read from {device.rhythm}"
            if device.iterations is not None else
            "no iterations read from it (no optimizer step nor backward in its stacks)")
    cache = device.cache
    said = [
        f"{device.name}: {device.entries:,} trace entries; {beat}" + _window(device),
        f"  allocated: {format_bytes(device.before)} when the trace began, peak "
        f"{format_bytes(device.peak)}, {format_bytes(device.end)} at the end",
        f"  cached when the snapshot was taken: {format_bytes(cache.reserved)} reserved in "
        f"{plural(cache.segments, 'segment')}, {format_bytes(cache.allocated)} of it in use, "
        f"the largest free piece {format_bytes(cache.largest_free)}",
        "  at the peak, by phase: " + _phases(device),
    ]
    if device.name == "cpu":  # each CPU storage is its own malloc: no cache to describe
        del said[2]
    lines = [fill(printable(line), width, subsequent_indent="    ") for line in said]
    lines += _sites("at the peak, by your line", device.sites_at_peak, width,
                    device.phases_known)
    lines += _sites("at the end, by your line", device.sites_at_end, width, device.phases_known)
    return lines


def _window(device: DeviceVerdict) -> str:
    """What the trace leaves out: the entries memsentry's bound dropped, or (torch's, which
    does not say) the memory allocated before its first entry."""
    if device.dropped:
        return (f"; the {device.dropped:,} oldest were dropped (raise --snapshot-entries or "
                "track(snapshot_entries=...) to keep them)")
    if device.dropped is None and device.before:
        return (f"; {format_bytes(device.before)} was allocated before its first entry: it "
                "holds the newest entries only (raise max_entries of "
                "torch.cuda.memory._record_memory_history)")
    return ""


def _phases(device: DeviceVerdict) -> str:
    """The parts at the peak, or why there are none to say."""
    if not device.phases_known:
        return ("not told (a record of CPU storages written by an older memsentry keeps your "
                "own frames only)")
    if all(part is Part.OTHER for part, _size in device.parts_at_peak):
        return "not told (no frame of torch's in the stacks of what was alive)"
    return ", ".join(f"{part.value} {format_bytes(size)}"
                     for part, size in device.parts_at_peak) + " (read from torch's frames)"


def _sites(title: str, sites: tuple[SiteMemory, ...], width: int, phases: bool = True
           ) -> list[str]:
    if not sites:
        return [f"  {title}: nothing alive"]
    lines = [f"  {title}:"]
    for site in sites[:TOP_SITES]:
        where = site.site or "(no frame of your code)"
        text = f"    {format_bytes(site.bytes):>9} in {plural(site.blocks, 'block')}  {where}"
        if phases:
            text += f"  [{site.part.name.lower()}]"
        lines.append(fill(printable(text), width, subsequent_indent="        "))
    return lines


def render_snapshot_diff(change: SnapshotDiff, crossed: tuple[str, ...] = (), *,
                         width: int = 100) -> str:
    """Two snapshots compared: each device's peak and end, the lines whose bytes at the end
    changed most, the findings that appeared and went, and the limits crossed."""
    lines = [f"memsentry diff: allocator snapshots {printable(change.old_path)} -> "
             f"{printable(change.new_path)}"]
    for device in change.devices:
        lines += ["", f"{device.name}: peak {_pair(device.old_peak, device.new_peak)}, "
                      f"at the end {_pair(device.old_end, device.new_end)}"]
        if device.sites:
            lines.append("  what your lines held at the end (among each record's largest):")
        for site in device.sites:
            text = (f"    {format_bytes(site.delta, signed=True):>9}  "
                    f"{site.site or '(no frame of your code)'}  ({format_bytes(site.old)} -> "
                    f"{format_bytes(site.new)})")
            lines.append(fill(printable(text), width, subsequent_indent="        "))
    for title, found in (("Appeared", change.appeared), ("Gone", change.disappeared)):
        if found:
            lines += ["", f"{title} ({len(found)})", *_findings(found, width)[1:]]
    if crossed:
        lines += ["", "Limits crossed:"] + [f"  {text}" for text in crossed]
    return "\n".join(lines) + "\n"


def _pair(old: int | None, new: int | None) -> str:
    if old is None or new is None:
        return f"{format_bytes(old)} -> {format_bytes(new)}"
    return f"{format_bytes(old)} -> {format_bytes(new)} ({format_bytes(new - old, signed=True)})"


def snapshot_diff_to_json(change: SnapshotDiff, crossed: tuple[str, ...] = ()) -> str:
    return json.dumps({"schema": SCHEMA, "kind": "allocator-snapshot-diff",
                       "limits_crossed": list(crossed), **to_plain(change)}, indent=2)


def snapshot_to_dict(verdict: SnapshotVerdict, findings: tuple[Finding, ...]) -> dict[str, Any]:
    """The verdict and findings as plain data (the layout of :data:`SCHEMA`)."""
    return {"schema": SCHEMA, "kind": "allocator-snapshot", "findings": to_plain(findings),
            **to_plain(verdict)}


def snapshot_to_json(verdict: SnapshotVerdict, findings: tuple[Finding, ...]) -> str:
    return json.dumps(snapshot_to_dict(verdict, findings), indent=2)


__all__ = ["SCHEMA", "render_snapshot", "render_snapshot_diff", "snapshot_diff_to_json",
           "snapshot_to_dict", "snapshot_to_json"]
