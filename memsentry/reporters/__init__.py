"""Reporting: pure formatting of a finished report, one reporter per format.

The top of the pipeline (measure -> record -> analyse -> report): reporters import only the
values (:mod:`memsentry.model`) and the foundation modules.
"""

from __future__ import annotations

from typing import Any

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


__all__ = ["REPORTERS", "HtmlReporter", "JsonReporter", "Reporter", "TextReporter", "make_reporter"]
