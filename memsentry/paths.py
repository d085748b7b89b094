"""Whether a file can be written where the user asked for it, checked before anything runs, so
that a long run never ends with its output lost (``memsentry run --json``/``-o``/``--snapshot``,
``track(snapshot=path)``)."""

from __future__ import annotations

import os


def unwritable(path: str | os.PathLike[str]) -> str | None:
    """Why a file cannot be written to ``path``, or ``None`` when it can: a directory, a
    missing folder, a file or a folder that is not writable."""
    name = os.fspath(path)
    target = os.path.abspath(name)
    if os.path.isdir(target):
        return f"{name!r} is a directory; give a file name"
    folder = os.path.dirname(target)
    if not os.path.isdir(folder):
        return f"the folder of {name!r} does not exist; create it first"
    if os.path.exists(target) and not os.access(target, os.W_OK):
        return f"{name!r} is not writable"
    if not os.path.exists(target) and not os.access(folder, os.W_OK):
        return f"cannot create {name!r}: its folder is not writable"
    return None
