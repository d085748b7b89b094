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
    if oom.segment:
        return f" asking the driver for a {format_bytes(oom.requested_bytes)} segment"
    return f" asking for {format_bytes(oom.requested_bytes)}"


#: Below this share of the device, a limit is a memory fraction's cap rather than the
#: device's memory read twice (the message rounds it to 0.01 GiB).
_CAPPED = 0.99


def _limit(oom: OutOfMemory) -> str:
    """``the 40 GiB torch.cuda.set_per_process_memory_fraction allows of the device's
    80 GiB``, or ``the device's 80 GiB``."""
    limit, total = oom.limit or 0, oom.device_total
    if total and limit < _CAPPED * total:
        return (f"the {format_bytes(limit)} torch.cuda.set_per_process_memory_fraction "
                f"allows of the device's {format_bytes(total)}")
    return f"the device's {format_bytes(limit)}"


def _ceiling(oom: OutOfMemory) -> str | None:
    """Where the allocator's ceiling came from, where it is known (CUDA)."""
    if oom.limit is None or oom.capacity is None:
        return None
    reserved, free = oom.reserved, oom.device_free
    if reserved is None or free is None or oom.capacity >= oom.limit:
        return f"  ceiling: {format_bytes(oom.capacity)}, {_limit(oom)}"
    return (f"  ceiling: {format_bytes(oom.capacity)}, what the allocator could still get: "
            f"the {format_bytes(reserved)} it reserved plus {format_bytes(free)} free on the "
            f"device, below {_limit(oom)}; the rest was held outside PyTorch's allocator (the "
            "CUDA context, other libraries, other processes)")


_SEGMENT = ("  the size is the segment the caching allocator asked the driver for: 2 MiB for "
            "a request up to 1 MiB, 20 MiB for one up to 10 MiB, larger ones rounded up to "
            "2 MiB; the tensor itself asked for that much or less")


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
    ceiling = _ceiling(oom)
    if ceiling is not None:
        lines.append(fill(ceiling, width, subsequent_indent="    "))
    if oom.device_free is not None:
        lines.append(f"  the allocator: {format_bytes(oom.device_free)} free on the device "
                     "when it gave up")
    if oom.segment and oom.requested_bytes is not None:
        lines.append(fill(_SEGMENT, width, subsequent_indent="    "))
    if oom.message:
        lines.append(fill(f"  error: {oom.message}", width, subsequent_indent="    "))
    if oom.largest:
        lines.append("  largest activations: " + ", ".join(
            f"`{entry.layer}` {format_bytes(entry.bytes)}" for entry in oom.largest))
    for fix in oom.fixes:
        lines.append(fill(f"  fix ({fix.kind}): {fix.text}", width, subsequent_indent="    "))
    return "\n".join(lines)


__all__ = ["oom_note", "render_oom"]
