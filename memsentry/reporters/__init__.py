"""Reporting: pure formatting of a finished report, one reporter per format.

The top of the pipeline (measure -> record -> analyse -> report): reporters import only the
values (:mod:`memsentry.model`) and the foundation modules.
"""

from __future__ import annotations

import os
from typing import Any

from memsentry.model import ReportData
from memsentry.paths import replace_text
from memsentry.reporters.base import Reporter
from memsentry.reporters.html import HtmlReporter
from memsentry.reporters.json import JsonReporter
from memsentry.reporters.text import TextReporter

#: Every reporter by its format name.
REPORTERS: dict[str, type[TextReporter] | type[JsonReporter] | type[HtmlReporter]] = {
    TextReporter.name: TextReporter,
    JsonReporter.name: JsonReporter,
    HtmlReporter.name: HtmlReporter,
}


def make_reporter(name: str, **options: Any) -> Reporter:
    """The reporter of format ``name`` with its ``options``; an unknown name raises
    ``ValueError`` listing the formats."""
    cls = REPORTERS.get(name)
    if cls is None:
        raise ValueError(f"unknown report format {name!r}: use one of {', '.join(REPORTERS)}")
    reporter: Reporter = cls(**options)
    return reporter


#: The format a file's suffix asks for; any other suffix is text.
SUFFIXES = {".json": JsonReporter.name, ".html": HtmlReporter.name, ".htm": HtmlReporter.name}


def format_of(path: str | os.PathLike[str]) -> str:
    """The format a report file's name asks for: ``.json``, ``.html`` (``.htm``), else text."""
    return SUFFIXES.get(os.path.splitext(os.fspath(path))[1].lower(), TextReporter.name)


def write_report(report: ReportData, path: str | os.PathLike[str], *, format: str | None = None,
                 **options: Any) -> None:
    """Write ``report`` to ``path`` in ``format`` (by default the one its suffix asks for),
    through the registry's reporter; ``options`` go to a text reporter (``top``, ``width``,
    ``view``, ...)."""
    name = format or format_of(path)
    reporter = make_reporter(name, **(options if name == TextReporter.name else {}))
    replace_text(path, reporter.text(report) + "\n")


__all__ = ["REPORTERS", "SUFFIXES", "HtmlReporter", "JsonReporter", "Reporter", "TextReporter",
           "format_of", "make_reporter", "write_report"]
