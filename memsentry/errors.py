"""Exceptions raised by memsentry. Every message says what was wrong and what to do."""

from __future__ import annotations


class MemsentryError(Exception):
    """Base class of the errors memsentry raises on purpose."""


class UnsupportedDeviceError(MemsentryError, ValueError):
    """The model or the ``device=`` argument names a device memsentry cannot measure."""


class TrackerStateError(MemsentryError, RuntimeError):
    """A tracker was used out of order (entered twice, stepped after exit, ...)."""
