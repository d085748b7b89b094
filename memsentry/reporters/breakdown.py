"""The breakdown table: what memory held at the highest iteration peak, by category."""

from __future__ import annotations

from tabulate import tabulate

from memsentry.model import (
    CATEGORIES,
    Breakdown,
    IterationStats,
    LayerStats,
    Measured,
    PinnedMemory,
    ReportData,
)
from memsentry.model.breakdown import outside_allocator
from memsentry.reporters.wrap import fill
from memsentry.units import format_bytes

_LABELS = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "activations": "activations (saved for backward)",
    "other": "other",
}


def layer_share(layer: LayerStats, peak: Breakdown | None) -> str:
    """A layer's saved-for-backward bytes (its largest call) as a share of the peak."""
    if peak is None or not peak.total or layer.saved_bytes is None:
        return "-"
    share = layer.saved_bytes / peak.total
    return f"{share:.0%}" if share >= 0.01 or not layer.saved_bytes else "<1%"


def pinned_line(pinned: PinnedMemory) -> str:
    """The pinned host allocator's figures, in words."""
    blocks = f"{pinned.blocks:,} block{'s' if pinned.blocks != 1 else ''}"
    if pinned.in_use is None:
        in_use = ("the part of it in use not known (torch counted more bytes in use than the "
                  "allocator holds)")
    else:
        in_use = f"{format_bytes(pinned.in_use)} of it in use"
    return (f"Pinned host memory (page-locked RAM, not in the device's figures): "
            f"{format_bytes(pinned.held)} held by PyTorch's pinned allocator in {blocks}, "
            f"{in_use}, at most {format_bytes(pinned.peak)} (each request rounded up to a power "
            "of two; DataLoader(pin_memory=True) holds about prefetch_factor x num_workers "
            "batches)")


def outside_line(report: ReportData) -> str | None:
    """On CUDA, the process's device memory outside PyTorch's caching allocator when tracking
    stopped: NVML's count for the process less what the allocator reserved (``None`` when
    NVML gave no count)."""
    nvml = report.nvml or {}
    used = nvml.get("process_used")
    if not isinstance(used, int) or isinstance(used, bool) or not nvml.get("available"):
        return None
    outside = outside_allocator(used, report.reserved)
    if outside is None:
        return None
    return (f"Outside PyTorch's allocator: {format_bytes(outside)} when tracking stopped: NVML "
            f"counted {format_bytes(used)} for this process on {report.device} and the caching "
            f"allocator reserved {format_bytes(report.reserved)}; the rest is the CUDA context, "
            "cuBLAS and cuDNN handles and workspaces, NCCL buffers and other libraries' "
            "memory, which the table above does not count")


def _share(value: int, total: int) -> str:
    return f"{value / total:.0%}" if total else "-"


def heap_at_start(report: ReportData, peak: Breakdown) -> int:
    """Under the heap backend, the part of ``other`` that is the process's heap in use before
    tracking began and not the parameters (which have their own row): 0 otherwise."""
    if report.measured is not Measured.HEAP:
        return 0
    return max(0, min(peak.other, report.baseline - peak.parameters))


def _apart(report: ReportData) -> list[str]:
    """What the table does not count: memory outside the allocator, pinned host memory."""
    outside = outside_line(report)
    pinned = None if report.pinned is None else pinned_line(report.pinned)
    return [line for line in (outside, pinned) if line is not None]


def _rows(peak: Breakdown, heap: int) -> list[list[str]]:
    """One row per category (the heap in use before tracking apart from ``other``, when
    there is one), then the total."""
    rows = []
    for name in CATEGORIES:
        if name == "other" and heap:
            rows.append(["process heap before tracking (not tensors)", format_bytes(heap),
                         _share(heap, peak.total)])
        value = peak.part(name) - (heap if name == "other" else 0)
        rows.append([_LABELS[name], format_bytes(value), _share(value, peak.total)])
    rows.append(["total", format_bytes(peak.total), ""])
    return rows


def _title(its: IterationStats | None, peak: Breakdown, lower: bool) -> str:
    """The table's title, with the iteration of the peak (``its``) and where the loop was;
    ``lower``: the run's peak was higher than this one (:func:`_lower_note`)."""
    title = "Memory at the highest peak"
    if lower:
        title += " whose parts were read"
    if its is None:
        return title
    return title + f" (iteration {its.index}, {peak.where})"


def _lower_note(report: ReportData, its: IterationStats | None) -> str | None:
    """That the run's peak came in an iteration whose parts were not read (a light one): the
    table is of the highest peak read with its parts (in ``its``), which is lower; ``None``
    otherwise."""
    if its is None or report.peak is None or its.peak >= report.peak:
        return None
    return (f"The run's peak, {format_bytes(report.peak)}, came in an iteration measured "
            "without reading the parts (light, to keep within the budget); this table is of "
            f"the highest peak read with them, {format_bytes(its.peak)}.")


def _total_note(report: ReportData, peak: Breakdown, heap: int) -> str | None:
    """What the total counts beyond the allocated figures: the process heap in use before
    tracking, or the storages made before it; ``None`` when neither."""
    if heap:
        return ("The CPU backend counts the whole process heap (glibc's mallinfo2): of "
                f"the {format_bytes(report.baseline)} in use when tracking began, what the "
                "parameters do not explain is shown apart. track(exact=True) counts tensor "
                "storages only.")
    if report.peak is not None and peak.total > report.peak:
        return (f"The total is above the allocated peak ({format_bytes(report.peak)}): "
                "the parts count storages made before tracking began (the model's "
                "parameters), which the allocated figures, counting what was made while "
                "tracking, leave out.")
    return None


def _excess_note(peak: Breakdown) -> str | None:
    """That the parts add up to more than the peak read; ``None`` when they do not."""
    if not peak.excess:
        return None
    return (f"The four parts add up to {format_bytes(peak.excess)} more than the peak "
            "read: the peak fell between the moments they were read.")


def render_breakdown(report: ReportData, *, width: int = 100) -> str | None:
    """The table, the memory outside the allocator and the pinned host memory; ``None`` when
    no iteration carries a breakdown and there is neither."""
    peak = report.breakdown.peak
    apart = _apart(report)
    if peak is None:
        return "\n".join(fill(line, width) for line in apart) or None
    heap = heap_at_start(report, peak)
    table = tabulate(_rows(peak, heap), tablefmt="plain", colalign=("left", "right", "right"),
                     disable_numparse=True)
    its = next((it for it in report.iterations if it.parts is peak), None)
    lower = _lower_note(report, its)
    notes = [lower, _total_note(report, peak, heap), _excess_note(peak)]
    lines = [_title(its, peak, lower is not None), table,
             "The layers' `of peak` column is each layer's saved bytes over this total.",
             *(note for note in notes if note is not None), *apart]
    return "\n".join(fill(line, width) if "\n" not in line else line
                     for line in lines)


__all__ = ["heap_at_start", "layer_share", "outside_line", "pinned_line", "render_breakdown"]
