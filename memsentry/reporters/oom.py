"""The out-of-memory post-mortem: a section of the text report, and the three-line note
added to the user's exception."""

from __future__ import annotations

from memsentry.model import CATEGORIES, OutOfMemory
from memsentry.reporters.wrap import fill
from memsentry.units import format_bytes
from memsentry.usercode.text import printable_values

_NAMES = {"optimizer_state": "optimizer state"}


def _held(oom: OutOfMemory) -> str:
    parts = oom.breakdown
    split = ", ".join(f"{_NAMES.get(name, name)} {format_bytes(parts.part(name))}"
                      for name in CATEGORIES)
    of = f" of {format_bytes(oom.capacity)}" if oom.capacity else ""
    return f"{format_bytes(parts.total)} in use{of} ({split})"


def _asked(oom: OutOfMemory) -> str:
    if oom.requested_bytes is None:
        return ""
    return f" asking for {format_bytes(oom.requested_bytes)}"


def oom_note(oom: OutOfMemory) -> str:
    """Three lines: where and what memory held; the largest activations and the first fix;
    where the rest is."""
    oom = printable_values(oom)
    first = (f"memsentry: out of memory in the {oom.where} (iteration {oom.iteration})"
             f"{_asked(oom)}, {_held(oom)}.")
    second = []
    if oom.largest:
        second.append("largest activations: " + ", ".join(
            f"`{entry.layer}` {format_bytes(entry.bytes)}" for entry in oom.largest))
    if oom.fixes:
        second.append(f"fix: {oom.fixes[0].text}")
    lines = [first, "; ".join(second) or "no activations were measured before the failure.",
             "memsentry's report has the breakdown and every fix: tracker.report().oom, or the "
             "report `memsentry run` printed."]
    return "\n".join(lines)


def render_oom(oom: OutOfMemory, *, width: int = 100) -> str:
    """The post-mortem section of the text report."""
    oom = printable_values(oom)
    lines = [fill(
        f"Out of memory: {oom.error} in the {oom.where} (iteration {oom.iteration}"
        + (f", batch {oom.batch}" if oom.batch else "") + f"){_asked(oom)}", width)]
    lines.append(fill(f"  held then: {_held(oom)}", width, subsequent_indent="    "))
    if oom.device_free is not None:
        lines.append(f"  the allocator's observer: {format_bytes(oom.device_free)} free on the "
                     "device when it gave up")
    if oom.message:
        lines.append(fill(f"  error: {oom.message}", width, subsequent_indent="    "))
    if oom.largest:
        lines.append("  largest activations: " + ", ".join(
            f"`{entry.layer}` {format_bytes(entry.bytes)}" for entry in oom.largest))
    for fix in oom.fixes:
        lines.append(fill(f"  fix ({fix.kind}): {fix.text}", width, subsequent_indent="    "))
    return "\n".join(lines)


__all__ = ["oom_note", "render_oom"]
