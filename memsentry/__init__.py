"""memsentry: find PyTorch memory leaks and say why memory grows, who holds it, how to fix it."""

from memsentry.errors import (
    LeakError,
    LeakWarning,
    MemsentryError,
    TrackerStateError,
    UnsupportedDeviceError,
)
from memsentry.report import (
    Census,
    Finding,
    GarbageStats,
    HolderStats,
    HookStats,
    IterationStats,
    LayerStats,
    Report,
    Severity,
    UnusedGraph,
)
from memsentry.rules import RULES, analyse
from memsentry.tracker import Tracker, track
from memsentry.units import format_bytes, parse_size

__version__ = "0.1.0"

__all__ = [
    "RULES",
    "Census",
    "Finding",
    "GarbageStats",
    "HolderStats",
    "HookStats",
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
    "UnusedGraph",
    "__version__",
    "analyse",
    "format_bytes",
    "parse_size",
    "track",
]
