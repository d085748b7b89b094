"""Exceptions raised by memsentry. Every message says what was wrong and what to do."""

from __future__ import annotations


class MemsentryError(Exception):
    """Base class of the errors memsentry raises on purpose."""


class UnsupportedDeviceError(MemsentryError, ValueError):
    """The model or the ``device=`` argument names a device memsentry cannot measure."""


class TrackerStateError(MemsentryError, RuntimeError):
    """A tracker was used out of order (entered twice, stepped after exit, ...)."""


class LeakError(MemsentryError, RuntimeError):
    """Raised at the end of ``track(..., on_leak="raise")`` when a LEAK finding was made.

    ``findings`` holds the LEAK findings.
    """

    def __init__(self, message: str, findings: tuple = ()) -> None:
        super().__init__(message)
        self.findings = findings


class ReportError(MemsentryError, ValueError):
    """A saved report could not be read: the file is not a regular file, is larger than
    memsentry reads, is not UTF-8 JSON, is nested too deep, or a field holds something other
    than its declared type (a ``null``, a string, a number out of range).

    ``path`` is the file (``None`` for ``Report.from_dict``), ``field`` the path of the
    field that is wrong (``Report.iterations[3].allocated``; ``None`` when the file as a
    whole is), ``problem`` what was found and what was expected. ``str()`` of it is the three
    joined, one line.
    """

    def __init__(self, problem: str, *, path: str | None = None,
                 field: str | None = None) -> None:
        self.problem, self.path, self.field = problem, path, field
        super().__init__(": ".join(part for part in (path, field, problem) if part))

    def within(self, path: str) -> ReportError:
        """The same error, said of the file at ``path``."""
        return ReportError(self.problem, path=path, field=self.field)


class LeakWarning(UserWarning):
    """Warned at the end of ``track(..., on_leak="warn")`` (the default) for LEAK findings."""
