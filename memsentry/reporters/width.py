"""How wide the text reports are by default: what the terminal says, ``COLUMNS`` first."""

from __future__ import annotations

import shutil

#: The width when neither ``COLUMNS`` nor a terminal says one (output to a file or a pipe).
DEFAULT_WIDTH = 100


def terminal_width() -> int:
    """``COLUMNS`` when it is set to a positive number, else the width of the terminal the
    process writes to, else :data:`DEFAULT_WIDTH`."""
    return shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns


__all__ = ["DEFAULT_WIDTH", "terminal_width"]
