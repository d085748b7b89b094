"""``memsentry.diff(old, new)``: two reports of the same program compared, as a value whose
``str()`` is the text ``memsentry diff`` prints.

The values live in :mod:`memsentry.model` (:class:`~memsentry.model.ReportDiff`), the
comparison in :mod:`memsentry.rules.diff` and the rendering in :mod:`memsentry.reporters.diff`;
this module wires them, as :mod:`memsentry.report` does for one report.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, TypeAlias

from memsentry.model import Breach, LimitCheck, Limits, ReportData, ReportDiff
from memsentry.paths import replace_text
from memsentry.reporters.diff import diff_to_dict, diff_to_json, render_diff
from memsentry.reporters.diff_html import render_diff_html
from memsentry.reporters.width import terminal_width
from memsentry.rules.diff import check as check_limits
from memsentry.rules.diff import diff as compare

#: What :func:`diff` compares: a report, or the path of one saved with ``to_json``.
ReportLike: TypeAlias = ReportData | str | os.PathLike[str]


@dataclass(frozen=True)
class Diff(ReportDiff):
    """Two reports compared (see :class:`~memsentry.model.ReportDiff` for the fields);
    ``str(diff)`` is the text report of the change."""

    def format(self, *, limits: Limits | None = None, top: int | None = 10,
               width: int | None = None) -> str:
        """The text: peak and growth (old -> new, with the change), the categories at the
        peak, the ``top`` layers that changed most, the findings that appeared and
        disappeared, and, with ``limits``, the limits crossed. Fitted to ``width`` (by default
        ``COLUMNS``, else the terminal's, else 100)."""
        check = None if limits is None else self.check(limits)
        return render_diff(self, check=check, top=top,
                           width=terminal_width() if width is None else width)

    def check(self, limits: Limits) -> LimitCheck:
        """This diff held to ``limits``: the breaches and the limits that could not be
        checked."""
        return check_limits(self, limits)

    def breaches(self, limits: Limits) -> tuple[Breach, ...]:
        """The limits this diff crosses, each with the figure seen, the limit and the fix."""
        return self.check(limits).breaches

    def to_dict(self, *, limits: Limits | None = None) -> dict[str, Any]:
        """Plain data: each figure with old, new, delta and relative; with ``limits``, the
        breaches too."""
        return diff_to_dict(self, check=None if limits is None else self.check(limits))

    def to_json(self, path: str | os.PathLike[str] | None = None, *,
                limits: Limits | None = None) -> str:
        """:meth:`to_dict` as JSON; also written to ``path`` when one is given."""
        text = diff_to_json(self, check=None if limits is None else self.check(limits))
        if path is not None:
            replace_text(path, text + "\n")
        return text

    def to_html(self, path: str | os.PathLike[str] | None = None, *,
                limits: Limits | None = None, top: int | None = 25) -> str:
        """The diff as one self-contained HTML page (both timelines on one axis, the
        categories, the ``top`` layers that changed most, the findings, the limits' verdict
        with ``limits``); also written to ``path`` when one is given. Needs plotly
        (``pip install 'memsentry[html]'``)."""
        check = None if limits is None else self.check(limits)
        page = render_diff_html(self, check=check, top=top)
        if path is not None:
            replace_text(path, page + "\n")
        return page

    def __str__(self) -> str:
        return self.format()


def _load(value: ReportLike, what: str) -> tuple[ReportData, str]:
    if isinstance(value, ReportData):
        return value, what
    if isinstance(value, str | os.PathLike):
        return ReportData.from_json(value), os.fspath(value)
    raise TypeError(f"diff: {what} must be a Report (or ReportData) or the path of a JSON "
                    f"report, got {type(value).__name__}")


def diff(old: ReportLike, new: ReportLike) -> Diff:
    """What changed from ``old`` to ``new``, two runs of the same program: each a
    :class:`~memsentry.Report` (or ``ReportData``) or the path of a report saved with
    ``to_json()`` / ``memsentry run --json``. A missing file raises ``OSError``, a file that
    is not a report :class:`~memsentry.errors.ReportError` (a ``ValueError``) naming it and
    what is wrong. ``str()`` of the result is the text."""
    old_report, old_label = _load(old, "old")
    new_report, new_label = _load(new, "new")
    data = compare(old_report, new_report, old_label=old_label, new_label=new_label)
    return Diff(**{f.name: getattr(data, f.name) for f in fields(data)})


__all__ = ["Diff", "ReportLike", "diff"]
