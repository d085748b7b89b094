"""The values a tracker produces: frozen records of layers, iterations and findings.

Nothing here measures or prints. A :class:`Report` is a finished, immutable picture that
renderers (text, JSON) and the analysis rules read.
"""

from __future__ import annotations

import enum
import json
import os
from dataclasses import asdict, dataclass, fields
from typing import Any

SCHEMA_VERSION = 1


class Severity(str, enum.Enum):
    """How bad a finding is: LEAK grows without bound, WASTE raises the peak, HINT is advice."""

    LEAK = "leak"
    WASTE = "waste"
    HINT = "hint"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Finding:
    """One verdict of the heuristics engine: what was seen, who holds it, how to fix it."""

    rule: str
    severity: Severity
    message: str
    fix: str
    bytes: int | None = None
    rate: float | None = None
    where: str | None = None


@dataclass(frozen=True)
class LayerStats:
    """Memory figures of one module, per forward call, the largest call seen.

    All sizes are bytes; ``None`` means the figure was not measured (for instance the
    backward figures of a layer whose forward ran without autograd).

    - ``param_bytes``: parameters of the module and its children (shared ones counted once).
    - ``output_bytes``: storage of the tensors the forward returned, each storage once.
    - ``saved_bytes``: activation memory saved for backward by ops run inside the forward,
      excluding parameters and buffers (they are not new memory).
    - ``forward_delta``: allocated after the forward minus allocated before it.
    - ``forward_peak``: highest allocated during the forward minus allocated before it.
    - ``backward_delta`` / ``backward_peak``: the same around the module's backward.
    """

    name: str
    type: str
    depth: int
    calls: int
    param_bytes: int
    output_bytes: int | None
    saved_bytes: int | None
    forward_delta: int | None
    forward_peak: int | None
    backward_delta: int | None = None
    backward_peak: int | None = None
    backward_calls: int = 0
    is_leaf: bool = True


@dataclass(frozen=True)
class IterationStats:
    """One iteration of the loop: from one boundary (optimizer step or ``t.step()``) to the next.

    ``allocated`` and ``reserved`` are read at the closing boundary; ``peak`` is the highest
    allocated seen inside the iteration; ``boundary`` says what closed it: ``"optimizer"``,
    ``"step"`` (``t.step()``) or ``"exit"`` (the end of the ``with`` block, a partial iteration).
    ``data_seconds`` is the time from the iteration's start to its first module call (waiting
    for data, moving it, zeroing gradients); ``batch`` is the first dimension of the first
    tensor given to the outermost module (``None`` when no tensor was given).
    """

    index: int
    allocated: int
    reserved: int | None
    peak: int
    seconds: float
    boundary: str = "step"
    forward_calls: int = 0
    data_seconds: float | None = None
    batch: int | None = None


@dataclass(frozen=True)
class HolderStats:
    """Tensors reachable through one named holder at a census (see :class:`Census`).

    ``name`` is how the user's code spells the holder (``total_loss``, ``self.history['loss']``,
    ``Block.saved``, ``fc.weight.grad``); ``kind`` says what it is: ``"local"``, ``"global"``,
    ``"class attribute"``, ``"model"`` or ``"gradient"``; ``scope`` where it lives (``train() in
    train.py``); ``where`` the ``file:line`` of the statement that fills it, when found.
    ``items`` is the length of the holder when it is a container. ``tensors`` and ``bytes`` count
    the tensors under it (each storage once per census), ``modules`` the ``nn.Module`` objects
    kept under it (their parameters are in ``bytes``); ``graph_tensors`` those carrying a
    ``grad_fn``, ``graph_nodes`` the autograd nodes reachable from them and
    ``graph_saved_bytes`` the tensors those nodes keep for backward.
    """

    name: str
    kind: str
    scope: str | None
    where: str | None
    items: int | None
    tensors: int
    bytes: int
    graph_tensors: int = 0
    graph_nodes: int = 0
    graph_saved_bytes: int = 0
    modules: int = 0


@dataclass(frozen=True)
class HookStats:
    """User hooks registered on one module (or globally, ``module="<global>"``), memsentry's own
    left out. ``hook`` names the newest hook function and ``where`` its definition."""

    module: str
    count: int
    hook: str | None = None
    where: str | None = None


@dataclass(frozen=True)
class GarbageStats:
    """What the census's own garbage collection found: objects kept only by reference cycles.

    ``objects`` and ``tensors`` count the unreachable objects found in the young generation,
    ``bytes`` the storage of those tensors, ``freed`` the allocated memory the collection gave
    back. ``types`` are the most frequent types among them (the cycle's members), most first.
    ``gc_enabled`` is whether the automatic collector was on; ``full_collections`` and
    ``full_freed`` count the automatic full collections since the previous census and the
    memory they freed.
    """

    objects: int
    tensors: int
    bytes: int
    freed: int
    types: tuple[tuple[str, int], ...] = ()
    gc_enabled: bool = True
    full_collections: int = 0
    full_freed: int = 0


@dataclass(frozen=True)
class Census:
    """Who held tensors at one iteration boundary: taken after warm-up and then at growing
    intervals, within a time budget. ``complete`` is false when the budget ran out first."""

    iteration: int
    seconds: float
    complete: bool
    objects: int
    holders: tuple[HolderStats, ...] = ()
    hooks: tuple[HookStats, ...] = ()
    garbage: GarbageStats | None = None


@dataclass(frozen=True)
class UnusedGraph:
    """Forward calls of an outermost module, run with autograd on, whose graph no backward ever
    used. ``saved_bytes`` is the most one call saved for backward (``None`` when not measured),
    ``eval_calls`` how many of the calls ran in ``eval()`` mode, ``where`` the caller's line."""

    module: str
    calls: int
    eval_calls: int
    saved_bytes: int | None
    where: str | None = None
    function: str | None = None


def _census_from_dict(data: dict[str, Any]) -> Census:
    garbage = data.get("garbage")
    if garbage is not None:
        garbage = GarbageStats(**{**garbage, "types": tuple(map(tuple, garbage["types"]))})
    return Census(
        **{
            **data,
            "holders": tuple(HolderStats(**h) for h in data.get("holders", ())),
            "hooks": tuple(HookStats(**h) for h in data.get("hooks", ())),
            "garbage": garbage,
        }
    )


@dataclass(frozen=True)
class Report:
    """Everything one ``track()`` block recorded, frozen.

    ``baseline`` is the allocated memory when tracking began (parameters, buffers and every
    tensor created before are part of it, not growth). ``peak_mode`` says how peaks were
    measured: ``"sampled"`` (at module and saved-tensor boundaries; a lower bound of the true
    peak) or ``"exact"`` (every allocation counted). ``allocator_stats`` is the backend's raw
    counters when the report was made (``torch.cuda.memory_stats()`` on CUDA, glibc's
    ``mallinfo2`` fields on CPU); ``nvml`` is the driver's view of a CUDA device (used, total,
    this process, utilisation) or why it is unavailable. ``censuses`` are the holder searches
    made at iteration boundaries; ``unused_graphs`` the forward calls whose autograd graph no
    backward used.
    """

    device: str
    backend: str
    baseline: int
    layers: tuple[LayerStats, ...] = ()
    iterations: tuple[IterationStats, ...] = ()
    findings: tuple[Finding, ...] = ()
    peak: int | None = None
    allocated: int | None = None
    reserved: int | None = None
    total_memory: int | None = None
    peak_mode: str = "sampled"
    notes: tuple[str, ...] = ()
    dropped_iterations: int = 0
    torch_version: str = ""
    allocator_stats: dict[str, Any] | None = None
    nvml: dict[str, Any] | None = None
    censuses: tuple[Census, ...] = ()
    unused_graphs: tuple[UnusedGraph, ...] = ()

    # -- lookups -------------------------------------------------------------------------
    def layer(self, name: str) -> LayerStats:
        """The :class:`LayerStats` called ``name``; ``KeyError`` lists close names if absent."""
        for stats in self.layers:
            if stats.name == name:
                return stats
        known = ", ".join(repr(s.name) for s in self.layers[:12])
        more = "" if len(self.layers) <= 12 else f" and {len(self.layers) - 12} more"
        raise KeyError(f"no layer named {name!r}; recorded layers: {known or 'none'}{more}")

    # -- serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (plain ints, floats, strings, lists) with a ``schema`` version."""
        data = asdict(self)
        data["schema"] = SCHEMA_VERSION
        for finding in data["findings"]:
            finding["severity"] = str(finding["severity"].value)
        for key in ("layers", "iterations", "findings", "notes", "censuses", "unused_graphs"):
            data[key] = list(data[key])
        return data

    def to_json(self, path: str | os.PathLike[str] | None = None, *, indent: int = 2) -> str:
        """Serialise to JSON; also write it to ``path`` when one is given. Returns the text."""
        text = json.dumps(self.to_dict(), indent=indent)
        if path is not None:
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(text + "\n")
        return text

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Report:
        """Rebuild a report written by :meth:`to_dict` (or read back from :meth:`to_json`)."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["layers"] = tuple(LayerStats(**d) for d in data.get("layers", ()))
        values["iterations"] = tuple(IterationStats(**d) for d in data.get("iterations", ()))
        values["findings"] = tuple(
            Finding(**{**d, "severity": Severity(d["severity"])}) for d in data.get("findings", ())
        )
        values["notes"] = tuple(data.get("notes", ()))
        values["censuses"] = tuple(_census_from_dict(d) for d in data.get("censuses", ()))
        values["unused_graphs"] = tuple(UnusedGraph(**d) for d in data.get("unused_graphs", ()))
        return cls(**values)

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> Report:
        """Read a report saved with :meth:`to_json`."""
        with open(path, encoding="utf-8") as handle:
            return cls.from_dict(json.load(handle))

    # -- text ----------------------------------------------------------------------------
    def format(
        self, *, max_depth: int | None = None, top: int | None = 30, width: int = 100
    ) -> str:
        """The text report: findings, the per-layer table and the iteration summary.

        ``max_depth`` hides layers nested deeper (the root is depth 0), ``top`` keeps the
        layers with the largest activation footprint (in call order), ``width`` is the
        terminal width the table is fitted to. ``None`` turns a limit off.
        """
        from memsentry.render import render_text

        return render_text(self, max_depth=max_depth, top=top, width=width)

    def __str__(self) -> str:
        return self.format()

