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


class LeakWarning(UserWarning):
    """Warned at the end of ``track(..., on_leak="warn")`` (the default) for LEAK findings."""
