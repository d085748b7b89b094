"""memsentry: find PyTorch memory leaks and say why memory grows, who holds it, how to fix it.

The public names load on first use, so that ``import memsentry.units`` (sizes for the pytest
plugin's options) does not import torch. ``%load_ext memsentry`` loads the notebook magics
(:mod:`memsentry.integrations.notebook`); importing memsentry never imports IPython.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from memsentry.version import __version__

_EXPORTS = {
    "Boundary": "memsentry.model",
    "Breakdown": "memsentry.model",
    "Breakdowns": "memsentry.model",
    "Census": "memsentry.model",
    "FixKind": "memsentry.model",
    "Forecast": "memsentry.model",
    "ForecastMethod": "memsentry.model",
    "ForecastPoint": "memsentry.model",
    "LayerBytes": "memsentry.model",
    "OomFix": "memsentry.model",
    "OomSource": "memsentry.model",
    "OutOfMemory": "memsentry.model",
    "Finding": "memsentry.model",
    "GarbageStats": "memsentry.model",
    "HolderKind": "memsentry.model",
    "HolderLength": "memsentry.model",
    "HolderStats": "memsentry.model",
    "HookStats": "memsentry.model",
    "IterationStats": "memsentry.model",
    "LayerStats": "memsentry.model",
    "Location": "memsentry.model",
    "Measured": "memsentry.model",
    "PeakMode": "memsentry.model",
    "Phase": "memsentry.model",
    "ReportData": "memsentry.model",
    "Scope": "memsentry.model",
    "ScopeKind": "memsentry.model",
    "Severity": "memsentry.model",
    "Step": "memsentry.model",
    "StepKind": "memsentry.model",
    "Subject": "memsentry.model",
    "SubjectKind": "memsentry.model",
    "UnusedGraph": "memsentry.model",
    "DatasetObjects": "memsentry.model",
    "DatasetStore": "memsentry.model",
    "DeviceMemory": "memsentry.model",
    "PinnedMemory": "memsentry.model",
    "ProcessSample": "memsentry.model",
    "WorkerMemory": "memsentry.model",
    "Breach": "memsentry.model",
    "Change": "memsentry.model",
    "LayerChange": "memsentry.model",
    "LimitCheck": "memsentry.model",
    "Limits": "memsentry.model",
    "ReportDiff": "memsentry.model",
    "Report": "memsentry.report",
    "Diff": "memsentry.compare",
    "diff": "memsentry.compare",
    "LeakError": "memsentry.errors",
    "LeakWarning": "memsentry.errors",
    "MemsentryError": "memsentry.errors",
    "ReportError": "memsentry.errors",
    "TrackerStateError": "memsentry.errors",
    "UnsupportedDeviceError": "memsentry.errors",
    "RULES": "memsentry.rules",
    "analyse": "memsentry.rules",
    "REPORTERS": "memsentry.reporters",
    "Tracker": "memsentry.tracker",
    "track": "memsentry.tracker",
    "watch": "memsentry.tracker",
    "Cost": "memsentry.model",
    "PartCost": "memsentry.model",
    "format_bytes": "memsentry.units",
    "parse_size": "memsentry.units",
}

__all__ = [
    "REPORTERS",
    "RULES",
    "Boundary",
    "Breach",
    "Breakdown",
    "Breakdowns",
    "Census",
    "Change",
    "Cost",
    "DatasetObjects",
    "DatasetStore",
    "DeviceMemory",
    "Diff",
    "Finding",
    "FixKind",
    "Forecast",
    "ForecastMethod",
    "ForecastPoint",
    "GarbageStats",
    "HolderKind",
    "HolderLength",
    "HolderStats",
    "HookStats",
    "IterationStats",
    "LayerBytes",
    "LayerChange",
    "LayerStats",
    "LeakError",
    "LeakWarning",
    "LimitCheck",
    "Limits",
    "Location",
    "Measured",
    "MemsentryError",
    "OomFix",
    "OomSource",
    "OutOfMemory",
    "PartCost",
    "PeakMode",
    "Phase",
    "PinnedMemory",
    "ProcessSample",
    "Report",
    "ReportData",
    "ReportDiff",
    "ReportError",
    "Scope",
    "ScopeKind",
    "Severity",
    "Step",
    "StepKind",
    "Subject",
    "SubjectKind",
    "Tracker",
    "TrackerStateError",
    "UnsupportedDeviceError",
    "UnusedGraph",
    "WorkerMemory",
    "__version__",
    "analyse",
    "diff",
    "format_bytes",
    "parse_size",
    "track",
    "watch",
]

if TYPE_CHECKING:
    from memsentry.compare import Diff, diff
    from memsentry.errors import (
        LeakError,
        LeakWarning,
        MemsentryError,
        ReportError,
        TrackerStateError,
        UnsupportedDeviceError,
    )
    from memsentry.model import (
        Boundary,
        Breach,
        Breakdown,
        Breakdowns,
        Census,
        Change,
        Cost,
        DatasetObjects,
        DatasetStore,
        DeviceMemory,
        Finding,
        FixKind,
        Forecast,
        ForecastMethod,
        ForecastPoint,
        GarbageStats,
        HolderKind,
        HolderLength,
        HolderStats,
        HookStats,
        IterationStats,
        LayerBytes,
        LayerChange,
        LayerStats,
        LimitCheck,
        Limits,
        Location,
        Measured,
        OomFix,
        OomSource,
        OutOfMemory,
        PartCost,
        PeakMode,
        Phase,
        PinnedMemory,
        ProcessSample,
        ReportData,
        ReportDiff,
        Scope,
        ScopeKind,
        Severity,
        Step,
        StepKind,
        Subject,
        SubjectKind,
        UnusedGraph,
        WorkerMemory,
    )
    from memsentry.report import Report
    from memsentry.reporters import REPORTERS
    from memsentry.rules import RULES, analyse
    from memsentry.tracker import Tracker, track, watch
    from memsentry.units import format_bytes, parse_size


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext memsentry``: the ``%%memsentry``, ``%memsentry start|stop`` and
    ``%memsentry_report`` magics in this IPython shell or Jupyter kernel."""
    from memsentry.integrations.notebook import load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext memsentry``: stop tracking across cells and remove the magics."""
    from memsentry.integrations.notebook import unload

    unload(ipython)


def __getattr__(name: str) -> Any:
    # Not cached in this module's namespace: the name always resolves through sys.modules, so
    # it cannot outlive a reload of its module (pytester restores sys.modules after a run).
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'memsentry' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
