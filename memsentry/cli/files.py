"""Reading saved reports for the subcommands that take them (``show``, ``diff``), and
writing the files ``memsentry run`` and the notebook magics are asked for."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from memsentry.errors import ReportError
from memsentry.report import Report
from memsentry.usercode.text import printable

if TYPE_CHECKING:
    from memsentry.tracker import Tracker


def read_report(path: str) -> Report | str:
    """The report saved at ``path``, or what is wrong with the file (one line)."""
    try:
        return Report.from_json(path)
    except FileNotFoundError:
        return f"no such file: {path!r}"
    except OSError as exc:
        return f"cannot read {path!r}: {reason(exc)}"
    except ReportError as exc:
        return str(exc)


def html_saved(report: Report, path: str) -> str:
    """Write ``report`` to ``path`` as the HTML page; the line that says where (raises
    ``OSError``, or ``ChartsUnavailable`` without plotly)."""
    report.to_html(path)
    size = os.path.getsize(path) / 2**20
    return (f"HTML report written to {printable(path)} ({size:.1f} MiB; it opens offline in "
            "any browser)")


def snapshot_saved(tracker: Tracker, path: str) -> str:
    """Write ``tracker``'s memory_viz snapshot to ``path``; the line that says where (raises
    what :meth:`Tracker.snapshot` raises)."""
    tracker.snapshot(path)
    size = os.path.getsize(path) / 2**10
    return (f"memory_viz snapshot written to {printable(path)} ({size:,.0f} KiB; open it at "
            "https://pytorch.org/memory_viz)")


def reason(error: BaseException) -> str:
    """Why a file could not be written: the system's words for an OSError."""
    return error.strerror if isinstance(error, OSError) and error.strerror else str(error)


__all__ = ["html_saved", "read_report", "reason", "snapshot_saved"]
