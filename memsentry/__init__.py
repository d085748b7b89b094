"""memsentry: find PyTorch memory leaks and say why memory grows, who holds it, how to fix it."""

from memsentry.errors import (
    LeakError,
    LeakWarning,
    MemsentryError,
    TrackerStateError,
    UnsupportedDeviceError,
)
from memsentry.report import Finding, IterationStats, LayerStats, Report, Severity
from memsentry.rules import RULES, analyse
from memsentry.tracker import Tracker, track
from memsentry.units import format_bytes, parse_size

__version__ = "0.1.0"

__all__ = [
    "RULES",
    "Finding",
    "IterationStats",
    "LayerStats",
    "LeakError",
    "LeakWarning",
    "MemsentryError",
    "Report",
    "Severity",
    "Tracker",
    "TrackerStateError",
    "UnsupportedDeviceError",
    "__version__",
    "analyse",
    "format_bytes",
    "parse_size",
    "track",
]
