"""Whether a file can be written where the user asked for it, checked before anything runs, so
that a long run never ends with its output lost (``memsentry run --json``/``-o``/``--snapshot``,
``track(snapshot=path)``); and writing it so that nothing is lost when the write fails.

:func:`replace_text` writes a whole file to a temporary beside it and moves it in place only
once every byte is on disk: a full disk, a quota or a killed process leaves the previous file
as it was, never half of a new one.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile


def unwritable(path: str | os.PathLike[str]) -> str | None:
    """Why a file cannot be written to ``path``, or ``None`` when it can: a directory, a
    missing folder, a file or a folder that is not writable."""
    name = os.fspath(path)
    target = os.path.abspath(name)
    if os.path.isdir(target):
        return f"{name!r} is a directory; give a file name"
    folder = os.path.dirname(target)
    if os.path.exists(folder) and not os.path.isdir(folder):
        return f"the folder of {name!r} is a file ({folder!r}); give a path in a folder"
    if not os.path.isdir(folder):
        return f"the folder of {name!r} does not exist; create it first"
    if os.path.exists(target) and not os.access(target, os.W_OK):
        return f"{name!r} is not writable"
    if _regular_or_new(target) and not os.access(folder, os.W_OK):
        return (f"cannot write {name!r}: its folder is not writable (the file is written "
                "beside it first); give a path in a writable folder")
    return None


def _regular_or_new(target: str) -> bool:
    """Whether ``target`` is a regular file or nothing yet (not a device or a pipe)."""
    try:
        return stat.S_ISREG(os.stat(target).st_mode)
    except OSError:
        return True


def replace_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` whole or not at all (:func:`replace_bytes`)."""
    replace_bytes(path, text.encode("utf-8"))


def replace_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all: to a temporary file in the same
    folder, flushed to disk, then moved onto ``path`` (:func:`os.replace`). On any failure the
    temporary is removed and the error raised; the file that was at ``path`` is untouched. A
    replaced file keeps its permission bits; a new one gets those ``open()`` would give it.
    A device or a pipe (``/dev/stdout``) is written directly; a symbolic link is followed."""
    target = os.path.realpath(os.fspath(path))
    if not _regular_or_new(target):
        with open(target, "wb") as stream:
            stream.write(data)
        return
    if os.path.exists(target) and not os.access(target, os.W_OK):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
    mode = _mode_for(target)
    handle, temporary = tempfile.mkstemp(prefix=".memsentry-", suffix=".tmp",
                                         dir=os.path.dirname(target))
    try:
        with os.fdopen(handle, "wb") as stream:
            os.chmod(temporary, mode)  # mkstemp makes its files private
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _mode_for(target: str) -> int:
    """The permission bits the file at ``target`` has, or a new one would get."""
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except OSError:
        return 0o666 & ~_umask()


def _umask() -> int:
    """The process's file mode mask: from ``/proc/self/status`` where Linux has it (reading
    it changes nothing), else by setting it and putting it back."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
