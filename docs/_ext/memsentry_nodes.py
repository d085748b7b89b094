"""What the directives of memsentry's documentation share: the digest of the sources, docutils
nodes made from plain values, reStructuredText parsed inside a Markdown page, and the record of
which pages were made from the sources (so that they are read again when those change)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import memsentry_outputs as outputs
import memsentry_reference as reference
from docutils import nodes
from docutils.parsers.rst import Parser as RstParser
from sphinx.environment import BuildEnvironment
from sphinx.util.docutils import LoggingReporter, SphinxDirective, new_document

_DIGEST: str | None = None


def digest() -> str:
    """The hash of the sources the generated content depends on, once per build process."""
    global _DIGEST
    if _DIGEST is None:
        _DIGEST = outputs.source_digest()
    return _DIGEST


def table(headers: Sequence[str], rows: Sequence[Sequence[Sequence[nodes.Node]]],
          widths: Sequence[int], classes: Sequence[str] = ()) -> nodes.table:
    """A table; each cell is a list of nodes (inline nodes are put in a paragraph)."""
    group = nodes.tgroup(cols=len(headers))
    for width in widths:
        group += nodes.colspec(colwidth=width)
    head = nodes.thead()
    head += _row([[nodes.Text(header)] for header in headers])
    body = nodes.tbody()
    for row in rows:
        body += _row(row)
    group += head
    group += body
    result = nodes.table(classes=["memsentry-table", *classes])
    result += group
    return result


def _row(cells: Sequence[Sequence[nodes.Node]]) -> nodes.row:
    row = nodes.row()
    for cell in cells:
        entry = nodes.entry()
        if cell and all(isinstance(node, nodes.Inline | nodes.Text) for node in cell):
            entry += nodes.paragraph("", "", *cell)
        else:
            entry.extend(cell)
        row += entry
    return row


def inline(text: str) -> list[nodes.Node]:
    """Plain text from the code (argparse's help): what it puts in backquotes, and long
    options (``--json``), as code; the rest kept as written (no typographic dashes or
    quotes, which would turn ``--exact`` into an en dash)."""
    verbatim = nodes.inline(support_smartquotes=False)
    verbatim.extend(nodes.literal(piece, piece) if code else nodes.Text(piece)
                    for code, piece in reference.code_spans(text))
    return [verbatim]


def literal(text: str, language: str = "text") -> nodes.literal_block:
    block = nodes.literal_block(text, text)
    block["language"] = language
    return block


def section(directive: SphinxDirective, title: Sequence[nodes.Node], ids: Sequence[str],
            label: str | None = None) -> nodes.section:
    """A section with the given ids; with ``label``, also a label of the standard domain
    (``{ref}`` and ``[text](page.md#id)`` reach it)."""
    result = nodes.section(ids=list(ids))
    heading = nodes.title()
    heading.extend(title)
    result += heading
    if label is not None:
        result["names"].append(label)
        directive.state.document.note_explicit_target(result)
    else:
        for id_ in ids:
            directive.state.document.ids.setdefault(id_, result)
    return result


def parse_rst(directive: SphinxDirective, text: str, source: str) -> list[nodes.Node]:
    """``text`` parsed as reStructuredText (a docstring), whatever the page's own markup;
    problems are reported against ``source``."""
    document = new_document(source, directive.state.document.settings)
    # Sphinx's new_document() shares one reporter that writes to stderr under the first
    # source's name: this one warns through Sphinx (so -W fails the build), under ``source``.
    document.reporter = LoggingReporter(source, document.reporter.report_level,
                                        document.reporter.halt_level)
    RstParser().parse(text, document)
    parsed = list(document.children)
    for node in parsed:
        if isinstance(node, nodes.Element) and node["names"]:
            directive.state.document.note_explicit_target(node, node)
    return parsed


def docstring_source(obj: Any) -> str:
    """Where a docstring's problems are said to be, as autodoc says it."""
    try:
        where = inspect.getsourcefile(obj) or ""
    except TypeError:
        where = ""
    return f"{where}:docstring of {obj.__module__}.{obj.__qualname__}".lstrip(":")


def sources(env: BuildEnvironment) -> dict[str, str]:
    """Page -> the digest of the sources it was made from (kept in the pickled env)."""
    known: dict[str, str] | None = getattr(env, "memsentry_docs_sources", None)
    if known is None:
        known = {}
        setattr(env, "memsentry_docs_sources", known)  # noqa: B010 (not a declared attribute)
    return known


def track(directive: SphinxDirective) -> None:
    """Note that the page is made from the sources as they are now."""
    sources(directive.env)[directive.env.docname] = digest()
