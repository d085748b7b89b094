"""``memsentry.Report``: a run's frozen record with its findings, and its text rendering.

The values live in :mod:`memsentry.model` (the bottom of the pipeline); this class adds what
users print (``str(report)``, :meth:`Report.format`) through the text reporter, from above.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, fields

from memsentry.model import Forecast, ReportData
from memsentry.paths import replace_text
from memsentry.reporters.html import render_fragment, render_html
from memsentry.reporters.plotly import ChartsUnavailable, have_plotly
from memsentry.reporters.text import TextReporter
from memsentry.rules.forecast import forecast, max_batch


@dataclass(frozen=True)
class Report(ReportData):
    """Everything one ``track()`` run recorded, and the findings the rules made of it, frozen.

    See :class:`~memsentry.model.ReportData` for the fields. ``str(report)`` is the text
    report; :meth:`to_json` and :meth:`from_json` save and read it back.
    """

    @classmethod
    def from_data(cls, data: ReportData) -> Report:
        """The same values as a :class:`Report`."""
        return cls(**{f.name: getattr(data, f.name) for f in fields(data)})

    def format(
        self, *, max_depth: int | None = None, top: int | None = 30, width: int | None = None,
        view: str = "full",
    ) -> str:
        """The text report: a one-line headline and the findings first, then the tables that
        explain them (the header, the per-layer table, the iterations, the breakdown).

        ``max_depth`` hides layers nested deeper (the root is depth 0), ``top`` keeps the
        layers with the largest activation footprint (in call order), ``width`` is the
        width the text is fitted to (by default ``COLUMNS``, else the terminal's, else 100).
        ``None`` turns a limit off. ``view="findings"``
        shows the headline and the findings alone.
        """
        return TextReporter(max_depth=max_depth, top=top, width=width, view=view).text(self)

    def forecast(self, batch: int) -> Forecast:
        """The peak predicted at batch size ``batch`` (bytes, on the iterations table's
        scale), with what it rests on: fitted to the peaks of two or more batch sizes the run
        measured, or from the activations per sample at one. ``str()`` of it explains it."""
        return forecast(self, batch)

    def max_batch(self, memory: int | str) -> int:
        """The largest batch size whose forecast peak fits in ``memory`` (bytes, or a size
        such as ``"80 GiB"``); 0 when not even the part that does not scale fits."""
        return max_batch(self, memory)

    def to_html(self, path: str | os.PathLike[str] | None = None) -> str:
        """The HTML report: one self-contained page (charts, tables and data inside; it opens
        offline) with the timeline, the findings linked to it, the sortable layer table and
        one line per rank. Also writes it to ``path`` when one is given. Needs the plotly
        package (``pip install 'memsentry[html]'``); without it raises
        :class:`~memsentry.reporters.plotly.ChartsUnavailable` saying so."""
        page = render_html(self)
        if path is not None:
            replace_text(path, page + "\n")
        return page

    def _repr_html_(self) -> str:
        """Jupyter's inline display: findings and timeline first, the tables folded. The first
        report a kernel shows carries plotly.js; later ones use it from the page."""
        dom = f"memsentry-{os.getpid()}-{next(_DISPLAYS)}"
        global _PLOTLY_SENT
        with_plotly = not _PLOTLY_SENT and have_plotly()
        try:
            fragment = render_fragment(self, dom=dom, compact=True, with_plotly=with_plotly)
        except ChartsUnavailable:
            with_plotly = False
            fragment = render_fragment(self, dom=dom, compact=True, with_plotly=False)
        _PLOTLY_SENT = _PLOTLY_SENT or with_plotly
        return fragment

    def __str__(self) -> str:
        return self.format()


_DISPLAYS = itertools.count(1)
_PLOTLY_SENT = False


__all__ = ["Report"]
