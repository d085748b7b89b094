"""What every reporter is: a class with a ``name`` that turns a finished report into text.

Reporters are pure formatting: they read a frozen :class:`~memsentry.model.ReportData` and
never touch a tracker. Adding a format is adding a class to :data:`REPORTERS`.
"""

from __future__ import annotations

from typing import IO, Protocol, runtime_checkable

from memsentry.model import ReportData


@runtime_checkable
class Reporter(Protocol):
    """One output format. ``text`` returns the whole rendering; ``render`` writes it to ``out``
    (ending with a newline)."""

    name: str

    def text(self, report: ReportData) -> str: ...

    def render(self, report: ReportData, out: IO[str]) -> None: ...
