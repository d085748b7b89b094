"""Sphinx configuration of memsentry's documentation (MyST pages, alabaster theme).

Build: ``python -m sphinx -W --keep-going -b html docs docs/_build/html``. The local
extension ``docs/_ext/memsentry_docs.py`` makes the reference pages from the code and runs
the commands the pages show; ``MEMSENTRY_DOCS_FRESH=1`` runs them again even when nothing
changed.
"""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path[:0] = [str(ROOT), str(DOCS / "_ext")]

from memsentry.version import __version__  # noqa: E402

project = "memsentry"
author = "the memsentry developers"
copyright = "the memsentry developers"
version = __version__
release = __version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "memsentry_docs",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_ext", "Thumbs.db", ".DS_Store"]

myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence", "deflist"]

autodoc_member_order = "bysource"
autodoc_typehints = "description"

html_theme = "alabaster"
html_title = "memsentry"
html_theme_options = {
    "description": "Find PyTorch memory leaks",
    "fixed_sidebar": True,
    # The outputs the pages show are 100 columns wide (COLUMNS=100): room for them.
    "page_width": "1240px",
    "sidebar_width": "220px",
    "body_max_width": "1000px",
}
html_static_path: list[str] = []
