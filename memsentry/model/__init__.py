"""The values memsentry produces: frozen dataclasses with typed fields, and the enums they use.

Nothing here measures, records or prints. The recording layer builds these values, the rules
read them, the reporters format them. Every value round-trips through a plain dict
(:mod:`memsentry.model.codec`).
"""

from memsentry.model.breakdown import CATEGORIES, Breakdown, Breakdowns
from memsentry.model.cost import Cost, PartCost
from memsentry.model.devices import DeviceMemory
from memsentry.model.diff import (
    Breach,
    CategoryChange,
    Change,
    FindingPair,
    LayerChange,
    LimitCheck,
    Limits,
    Mismatch,
    ReportDiff,
    RunSummary,
)
from memsentry.model.findings import Finding, Location, Subject
from memsentry.model.forecast import Forecast, ForecastPoint
from memsentry.model.holders import (
    EXIT_REGISTRY,
    Census,
    GarbageStats,
    HeldTensor,
    HolderLength,
    HolderStats,
    HookStats,
    Scope,
    Step,
    UnusedGraph,
    spell,
)
from memsentry.model.kinds import (
    Boundary,
    FixKind,
    ForecastMethod,
    HolderKind,
    Measured,
    PeakMode,
    Phase,
    ScopeKind,
    Severity,
    StepKind,
    SubjectKind,
)
from memsentry.model.oom import LayerBytes, OomFix, OomSource, OutOfMemory
from memsentry.model.processes import (
    DatasetObjects,
    DatasetStore,
    PinnedMemory,
    ProcessSample,
    WorkerMemory,
)
from memsentry.model.report import SCHEMA_VERSION, ReportData
from memsentry.model.timeline import IterationStats, LayerStats, complete, growth_per_iteration

__all__ = [
    "CATEGORIES",
    "EXIT_REGISTRY",
    "SCHEMA_VERSION",
    "Boundary",
    "Breach",
    "Breakdown",
    "Breakdowns",
    "CategoryChange",
    "Census",
    "Change",
    "Cost",
    "DatasetObjects",
    "DatasetStore",
    "DeviceMemory",
    "Finding",
    "FindingPair",
    "FixKind",
    "Forecast",
    "ForecastMethod",
    "ForecastPoint",
    "GarbageStats",
    "HeldTensor",
    "HolderKind",
    "HolderLength",
    "HolderStats",
    "HookStats",
    "IterationStats",
    "LayerBytes",
    "LayerChange",
    "LayerStats",
    "LimitCheck",
    "Limits",
    "Location",
    "Measured",
    "Mismatch",
    "OomFix",
    "OomSource",
    "OutOfMemory",
    "PartCost",
    "PeakMode",
    "Phase",
    "PinnedMemory",
    "ProcessSample",
    "ReportData",
    "ReportDiff",
    "RunSummary",
    "Scope",
    "ScopeKind",
    "Severity",
    "Step",
    "StepKind",
    "Subject",
    "SubjectKind",
    "UnusedGraph",
    "WorkerMemory",
    "complete",
    "growth_per_iteration",
    "spell",
]
