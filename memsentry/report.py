"""``memsentry.Report``: a run's frozen record with its findings, and its text rendering.

The values live in :mod:`memsentry.model` (the bottom of the pipeline); this class adds what
users print (``str(report)``, :meth:`Report.format`) through the text reporter, from above.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from memsentry.model import ReportData
from memsentry.reporters.text import TextReporter


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
        self, *, max_depth: int | None = None, top: int | None = 30, width: int = 100
    ) -> str:
        """The text report: findings, the per-layer table and the iteration summary.

        ``max_depth`` hides layers nested deeper (the root is depth 0), ``top`` keeps the
        layers with the largest activation footprint (in call order), ``width`` is the
        terminal width the table is fitted to. ``None`` turns a limit off.
        """
        return TextReporter(max_depth=max_depth, top=top, width=width).text(self)

    def __str__(self) -> str:
        return self.format()


__all__ = ["Report"]
