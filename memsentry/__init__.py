"""memsentry: find PyTorch memory leaks and say why memory grows, who holds it, how to fix it.

The public names load on first use, so that ``import memsentry.units`` (sizes for the pytest
plugin's options) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Census": "memsentry.report",
    "Finding": "memsentry.report",
    "GarbageStats": "memsentry.report",
    "HolderStats": "memsentry.report",
    "HookStats": "memsentry.report",
    "IterationStats": "memsentry.report",
    "LayerStats": "memsentry.report",
    "Report": "memsentry.report",
    "Severity": "memsentry.report",
    "UnusedGraph": "memsentry.report",
    "LeakError": "memsentry.errors",
    "LeakWarning": "memsentry.errors",
    "MemsentryError": "memsentry.errors",
    "TrackerStateError": "memsentry.errors",
    "UnsupportedDeviceError": "memsentry.errors",
    "RULES": "memsentry.rules",
    "analyse": "memsentry.rules",
    "Tracker": "memsentry.tracker",
    "track": "memsentry.tracker",
    "format_bytes": "memsentry.units",
    "parse_size": "memsentry.units",
}

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

if TYPE_CHECKING:
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


def __getattr__(name: str) -> Any:
    # Not cached in this module's namespace: the name always resolves through sys.modules, so
    # it cannot outlive a reload of its module (pytester restores sys.modules after a run).
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'memsentry' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
