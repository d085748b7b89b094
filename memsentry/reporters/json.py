"""The report as JSON: the layout :meth:`~memsentry.model.ReportData.to_dict` writes."""

from __future__ import annotations

import json
from typing import IO

from memsentry.model import ReportData


class JsonReporter:
    """The report as a JSON document, indented by ``indent`` spaces (``None``: one line)."""

    name = "json"

    def __init__(self, *, indent: int | None = 2) -> None:
        self.indent = indent

    def text(self, report: ReportData) -> str:
        return json.dumps(report.to_dict(), indent=self.indent)

    def render(self, report: ReportData, out: IO[str]) -> None:
        out.write(self.text(report) + "\n")
