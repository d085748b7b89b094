"""Reading a saved report's file as JSON, in bounded time and memory.

Before a byte is read the file must be a regular file (a directory, a device such as
``/dev/zero``, a FIFO or a socket is refused: reading one could block or never end) no larger
than :func:`max_bytes`. The JSON must be UTF-8, hold no more lists, objects and values than a
report of that size holds (so that what it becomes in memory stays within about ten times
the limit), nest no deeper than the JSON reader allows and hold no number of more digits
than Python converts. Each refusal is a :class:`~memsentry.errors.ReportError` that names
the file; a file that is missing or that the system will not open raises ``OSError`` as
``open()`` does.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from typing import Any, BinaryIO

from memsentry.errors import ReportError
from memsentry.units import format_bytes, parse_size

#: The largest report read by default: 256 MiB. A report of 10,000 iterations (the most a
#: timeline keeps) of a small model takes 8.3 MiB; rank 0's report of an 8-process group
#: holds its ranks' too.
MAX_BYTES = 256 * 2**20

#: The environment variable that raises (or lowers) :data:`MAX_BYTES`: a size such as
#: ``1GiB``.
MAX_BYTES_VARIABLE = "MEMSENTRY_MAX_REPORT_SIZE"

#: What a report is, for the messages that refuse something else.
WRITTEN_BY = "a report is a file written by `memsentry run --json` or Report.to_json()"

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
)


def max_bytes() -> int:
    """The largest report file read: :data:`MAX_BYTES`, or the size the environment
    variable :data:`MAX_BYTES_VARIABLE` gives."""
    text = os.environ.get(MAX_BYTES_VARIABLE, "").strip()
    if not text:
        return MAX_BYTES
    try:
        return parse_size(text)
    except ValueError as error:
        raise ReportError(f"{MAX_BYTES_VARIABLE}={text!r} is not a size ({error}); set it "
                          "to a size such as 1GiB, or unset it for the default "
                          f"{format_bytes(MAX_BYTES)}") from None


class NotRegularFile(ValueError):
    """A path names something other than a regular file; ``kind`` says what (``a FIFO
    (named pipe)``)."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


def _not_a_file(mode: int) -> str | None:
    for test, kind in _KINDS:
        if test(mode):
            return kind
    return None if stat.S_ISREG(mode) else "not a regular file"


def _refuse(mode: int) -> None:
    kind = _not_a_file(mode)
    if kind is not None:
        raise NotRegularFile(kind)


def open_regular(name: str) -> tuple[BinaryIO, int]:
    """The regular file at ``name``, open for reading, and its size. What is not a regular
    file raises :class:`NotRegularFile` before ``open()`` could block on it (a FIFO), and
    again if what was opened is not (it was replaced); a missing file raises ``OSError`` as
    ``open()`` does."""
    _refuse(os.stat(name).st_mode)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    handle = os.fdopen(os.open(name, flags), "rb")
    try:
        info = os.fstat(handle.fileno())
        _refuse(info.st_mode)
    except BaseException:
        handle.close()
        raise
    return handle, info.st_size


def _too_large(size: str, limit: int, name: str) -> ReportError:
    return ReportError(
        f"is {size}, larger than the {format_bytes(limit)} memsentry reads (a report of "
        f"10,000 iterations takes about 8 MiB): if it is a report, raise the limit with "
        f"{MAX_BYTES_VARIABLE}=1GiB (or more)", path=name)


def _refuse_crowded(text: str, limit: int, name: str) -> None:
    """Refuse JSON that would take many times its size in memory: more lists and objects
    than one per 32 bytes of the limit, or more values (counted by their commas) than one
    per 8 bytes of it (``[{},{},...]`` of 256 MiB would take 6 GiB). A report has a list
    or object per 40 bytes at the most (the steps of its holders' paths), a comma per 14
    (its breakdowns' figures), so one that fits the size limit fits these."""
    counts = ((text.count("{") + text.count("["), limit // 32, "lists and objects"),
              (text.count(","), limit // 8, "values"))
    for count, most, what in counts:
        if count > most:
            raise ReportError(
                f"holds {count:,} {what}, more than the {most:,} memsentry reads in a file of "
                f"at most {format_bytes(limit)}: if it is a report, raise the limit with "
                f"{MAX_BYTES_VARIABLE}=1GiB (or more)", path=name)


def read_bytes(path: str | os.PathLike[str]) -> bytes:
    """The bytes of the report file at ``path``, checked to be a regular file no larger
    than :func:`max_bytes` before they are read."""
    name = os.fspath(path)
    limit = max_bytes()
    if "\0" in name:
        raise ReportError("not a file name: it holds a NUL character", path=repr(name))
    try:
        handle, size = open_regular(name)
    except NotRegularFile as error:
        raise ReportError(f"is {error.kind}, not a report: {WRITTEN_BY}", path=name) from None
    with handle:
        if size > limit:
            raise _too_large(format_bytes(size), limit, name)
        data = handle.read(limit + 1)  # a file that says it is smaller than it is
    if len(data) > limit:
        raise _too_large(f"over {format_bytes(limit)}", limit, name)
    return data


def read_json(path: str | os.PathLike[str]) -> Any:
    """The JSON value in the file at ``path`` (see the module's doc for what is refused)."""
    name = os.fspath(path)
    data = read_bytes(name)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise ReportError(f"not UTF-8 text (byte {data[error.start]:#04x} at offset "
                          f"{error.start:,}): {WRITTEN_BY}", path=name) from None
    del data
    _refuse_crowded(text, max_bytes(), name)
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ReportError(f"not JSON ({error.msg} at line {error.lineno}, column "
                          f"{error.colno}): {WRITTEN_BY}", path=name) from None
    except RecursionError:
        raise ReportError("not a report: its lists and objects nest deeper than the JSON "
                          f"reader allows (about 1,000 levels; a report nests 9): {WRITTEN_BY}",
                          path=name) from None
    except ValueError:  # a number of more digits than int() converts
        raise ReportError(f"not a report: it holds a number of more than "
                          f"{sys.get_int_max_str_digits():,} digits (a report's numbers are "
                          f"below 2**64): {WRITTEN_BY}", path=name) from None


__all__ = ["MAX_BYTES", "MAX_BYTES_VARIABLE", "WRITTEN_BY", "max_bytes", "read_bytes",
           "read_json"]
