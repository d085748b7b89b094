"""The text report's section on processes: the tracked process and the DataLoader workers
followed while tracking, as the system counts their memory."""

from __future__ import annotations

from tabulate import tabulate

from memsentry.model import ReportData
from memsentry.model.processes import ProcessSample
from memsentry.units import format_bytes


def _size(value: int | None) -> str:
    return "-" if value is None else format_bytes(value)


def _change(first: int | None, last: int | None) -> str:
    if first is None or last is None:
        return "-"
    return format_bytes(last - first, signed=True)


def _row(name: str, samples: tuple[ProcessSample, ...]) -> list[str]:
    first, last = samples[0], samples[-1]
    return [name, _size(last.rss), _size(last.pss), _size(last.private),
            _change(first.private, last.private), f"{last.seconds - first.seconds:.1f} s",
            str(len(samples))]


def render_processes(report: ReportData) -> str | None:
    """A table of the workers' memory (first reading to last), with the process's own row;
    ``None`` when no DataLoader worker was followed."""
    followed = [w for w in report.workers if w.samples]
    if not followed:
        return None
    rows = []
    if report.process:
        rows.append(_row("this process", report.process))
    passes = {w.loader for w in followed if w.epoch > 1}
    for worker in sorted(followed, key=lambda w: (w.loader, w.epoch, w.worker)):
        again = f" pass {worker.epoch}" if worker.loader in passes else ""
        rows.append(_row(f"loader {worker.loader} ({worker.dataset}){again} worker "
                         f"{worker.worker}, pid {worker.pid}", worker.samples))
    table = tabulate(rows, headers=["process", "resident", "proportional", "private",
                                    "private change", "over", "readings"],
                     tablefmt="simple", disable_numparse=True, stralign="right")
    return ("DataLoader workers (memory as the system counts it; private: pages only that "
            "process maps,\nwhich a forked worker copied from this process or made itself)\n"
            + table)
