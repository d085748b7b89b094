"""Reports built by hand, for testing the rules as the pure functions they are.

Each builder makes a valid frozen record of :mod:`memsentry.model` with defaults for the
fields no rule reads and keyword overrides for every other one. A test states the figures its
verdict depends on: the builders fill in only what a rule does not look at (the census's
duration, a sample's resident size beside the private one), and the few defaults a rule may
read are named in each builder's docstring.

    its = iterations(ramp(100 * MiB, MiB, 10))
    outs = holder_states("outs", tensors=[2, 4, 6, 8], bytes=ramp(2 * MiB, 2 * MiB, 4))
    seen = censuses([2, 4, 6, 8], outs)
    found = check("tensor-accumulation", report(iterations=its, censuses=seen))
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, TypeAlias, TypeVar

from memsentry.model import (
    Boundary,
    Breakdown,
    Census,
    Cost,
    DatasetObjects,
    DatasetStore,
    Finding,
    GarbageStats,
    HolderKind,
    HolderStats,
    HookStats,
    IterationStats,
    Location,
    ProcessSample,
    ReportData,
    Scope,
    ScopeKind,
    Step,
    StepKind,
    UnusedGraph,
    WorkerMemory,
)
from memsentry.rules import RULES

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

T = TypeVar("T")
#: A figure the same at every point, or one value per point.
Each: TypeAlias = T | Sequence[T]


def check(rule_id: str, built: ReportData) -> list[Finding]:
    """The findings of the rule ``rule_id`` on ``built``, as ``analyse`` gets them (a finding
    without evidence dropped, the rule held to the severities it declares)."""
    return RULES[rule_id](built)


def ramp(start: int, step: int, count: int) -> list[int]:
    """``count`` figures from ``start``, each ``step`` above the one before."""
    return [start + i * step for i in range(count)]


def _spread(value: Any, count: int, name: str) -> list[Any]:
    """``value`` at each of ``count`` points: a scalar repeated, or a sequence of that length."""
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        if len(value) != count:
            raise ValueError(f"{name}: {len(value)} values for {count} points")
        return list(value)
    return [value] * count


def _length(figures: dict[str, Any]) -> int:
    """How many points the per-point figures (the sequences among ``figures``) give."""
    lengths = {len(v) for v in figures.values()
               if isinstance(v, Sequence) and not isinstance(v, str | bytes)}
    if len(lengths) > 1:
        raise ValueError(f"per-point figures of different lengths: {sorted(lengths)}")
    if not lengths:
        raise ValueError("give at least one figure as a list, one value per point")
    return lengths.pop()


# -- the loop's iterations -----------------------------------------------------------------
def iterations(allocated: Sequence[int], *, peak: Each[int] | None = None,
               reserved: Each[int | None] = None, seconds: Each[float] = 0.01,
               first: int = 0, boundary: Boundary = Boundary.OPTIMIZER,
               **figures: Any) -> tuple[IterationStats, ...]:
    """One :class:`IterationStats` per figure of ``allocated``, indexed from ``first`` up,
    each closed by ``boundary`` (an optimizer step). ``peak`` defaults to the allocated
    figure itself (a loop whose peak no rule reads); every other field of
    :class:`IterationStats` (``data_seconds``, ``resident``, ``python_blocks``, ``batch``,
    ``parts``, ``peak_exact``, ``sampled``) is given in ``figures``, the same for every
    iteration or one value each."""
    count = len(allocated)
    peaks = list(allocated) if peak is None else _spread(peak, count, "peak")
    columns = {name: _spread(value, count, name) for name, value in figures.items()}
    reserved_each = _spread(reserved, count, "reserved")
    seconds_each = _spread(seconds, count, "seconds")
    return tuple(
        IterationStats(index=first + i, allocated=allocated[i], reserved=reserved_each[i],
                       peak=peaks[i], seconds=seconds_each[i], boundary=boundary,
                       **{name: column[i] for name, column in columns.items()})
        for i in range(count)
    )


def exit_iteration(index: int, allocated: int) -> IterationStats:
    """The partial iteration the end of tracking closes (``Boundary.EXIT``)."""
    return IterationStats(index=index, allocated=allocated, reserved=None, peak=allocated,
                          seconds=0.01, boundary=Boundary.EXIT)


def parts(total: int, *, activations: int, parameters: int = 0, gradients: int = 0,
          optimizer_state: int = 0) -> Breakdown:
    """What memory held at a peak of ``total`` bytes; ``other`` is what the four parts leave."""
    return Breakdown.of(total, parameters=parameters, gradients=gradients,
                        optimizer_state=optimizer_state, activations=activations)


# -- holders, hooks and garbage seen by the censuses ----------------------------------------
_STEP = re.compile(r"\.(?P<attribute>\w+)|\[(?P<index>\d+)\]|\[(?P<key>'[^']*'|\"[^\"]*\")\]")


def path(spelled: str) -> tuple[Step, ...]:
    """The steps of a holder's path spelled as code writes it: ``logger.history['loss']``
    (a root, an attribute, a string key), ``outs[3]`` (an index)."""
    found = re.fullmatch(r"(\w+)((?:" + _STEP.pattern + r")*)", spelled)
    if found is None:
        raise ValueError(f"cannot read the path {spelled!r}")
    steps = [Step(StepKind.ROOT, found.group(1))]
    for step in _STEP.finditer(found.group(2)):
        if step.group("attribute"):
            steps.append(Step(StepKind.ATTRIBUTE, step.group("attribute")))
        elif step.group("index"):
            steps.append(Step(StepKind.INDEX, step.group("index")))
        else:
            steps.append(Step(StepKind.KEY, step.group("key")))
    return tuple(steps)


def in_function(name: str, file: str = "train.py") -> Scope:
    """The scope of a local of the function ``name`` (spelled ``train() in train.py``)."""
    return Scope(ScopeKind.FUNCTION, name, file)


def holder(name: str | Sequence[Step], *, tensors: int = 1, bytes: int = 4 * KiB,
           kind: HolderKind = HolderKind.LOCAL, scope: Scope | None = None,
           where: Location | None = None, items: int | None = None,
           **figures: Any) -> HolderStats:
    """A holder of ``tensors`` tensors of ``bytes`` in all, reached by the path ``name``
    spells (or the steps given), a local variable unless ``kind`` says otherwise; the graph
    figures, ``modules``, ``bound``, ``shared_bytes``, ``arrays``, ``nodes``, ``buffers``,
    ``container``, ``added``, ``rewrite`` and ``feed`` go in ``figures`` (0 or ``None``
    unless given)."""
    steps = path(name) if isinstance(name, str) else tuple(name)
    return HolderStats(path=steps, kind=kind, scope=scope, where=where, items=items,
                       tensors=tensors, bytes=bytes, **figures)


def holder_states(name: str | Sequence[Step], **figures: Any) -> list[HolderStats]:
    """One holder as successive censuses saw it: each figure of :func:`holder` given as a
    list holds one value per census (all lists of one length), a single value holds at
    every census."""
    count = _length(figures)
    columns = {key: _spread(value, count, key) for key, value in figures.items()}
    return [holder(name, **{key: column[i] for key, column in columns.items()})
            for i in range(count)]


def hook_states(module: str | None, counts: Sequence[int], *, hook: str | None = None,
                where: Location | None = None,
                registered: Location | None = None) -> list[HookStats]:
    """The user hooks of ``module`` (``None``: registered globally) as successive censuses
    counted them, the newest being ``hook``, defined at ``where``, registered at
    ``registered``."""
    return [HookStats(module, count, hook, where, registered) for count in counts]


def garbage(*, tensors: int, bytes: int, types: Sequence[tuple[str, int]] = (),
            gc_enabled: bool = True, freed: int = 0, full_freed: int = 0,
            objects: int | None = None) -> GarbageStats:
    """What one census's collection found unreachable: ``tensors`` of ``bytes`` among the
    cycle's members ``types`` (most frequent first); ``objects`` defaults to the sum of the
    types' counts, or to the tensors."""
    counted = sum(count for _, count in types) or tensors
    return GarbageStats(objects=counted if objects is None else objects, tensors=tensors,
                        bytes=bytes, freed=freed, types=tuple(types), gc_enabled=gc_enabled,
                        full_collections=1 if full_freed else 0, full_freed=full_freed)


Row = HolderStats | Sequence[HolderStats | None]


def censuses(at: Sequence[int], *holders: Row,
             hooks: Sequence[Sequence[HookStats | None]] = (),
             garbage: Sequence[GarbageStats | None] | None = None,
             complete: Each[bool] = True, graphs_complete: Each[bool] = True
             ) -> tuple[Census, ...]:
    """Censuses at the iterations ``at``. Each row of ``holders`` (and of ``hooks``) is one
    holder as those censuses saw it, ``None`` where one did not; a single holder stands the
    same at every census. ``garbage`` is each census's collection (``None``: none ran);
    ``complete`` and ``graphs_complete`` say whether each census finished within its budget,
    and walked the graphs whole (all did unless given)."""
    count = len(at)
    rows = [_spread(row, count, "holders") if not isinstance(row, HolderStats)
            else [row] * count for row in holders]
    hook_rows = [_spread(row, count, "hooks") for row in hooks]
    garbage_each = _spread(garbage, count, "garbage") if garbage is not None else [None] * count
    complete_each = _spread(complete, count, "complete")
    graphs_each = _spread(graphs_complete, count, "graphs_complete")
    return tuple(
        Census(iteration=iteration, seconds=0.01, complete=complete_each[i], objects=1000,
               holders=tuple(row[i] for row in rows if row[i] is not None),
               hooks=tuple(row[i] for row in hook_rows if row[i] is not None),
               garbage=garbage_each[i], graphs_complete=graphs_each[i])
        for i, iteration in enumerate(at)
    )


# -- the rest of a report --------------------------------------------------------------------
def unused_graph(module: str, *, calls: int, saved_bytes: int | None, eval_calls: int = 0,
                 where: Location | None = None, unwatched: int = 0) -> UnusedGraph:
    """Forward calls of ``module`` whose graph no backward used, each saving up to
    ``saved_bytes`` for backward."""
    return UnusedGraph(module=module, calls=calls, eval_calls=eval_calls,
                       saved_bytes=saved_bytes, where=where, unwatched=unwatched)


def cost(*, iterations: int, sampled: int, censuses_deferred: int = 0) -> Cost:
    """memsentry's cost of a run of ``iterations``, of which ``sampled`` were measured layer
    by layer, with ``censuses_deferred`` holder searches put off by the budget."""
    return Cost(budget=0.05, loop_seconds=10.0, iterations=iterations, sampled=sampled,
                censuses_deferred=censuses_deferred)


#: The resident memory a worker shares with its parent, beside its private pages.
_SHARED_RSS = 200 * MiB


def worker(private: Sequence[int | None], *, every: float = 1.0, pid: int = 4000,
           worker: int = 0, loader: int = 1, dataset: str = "ListDataset",
           objects: DatasetObjects | None = None, epoch: int = 1,
           stores: Sequence[DatasetStore] = ()) -> WorkerMemory:
    """A DataLoader worker whose private memory read ``private`` (``None``: the system did
    not say) at readings ``every`` seconds apart."""
    samples = tuple(ProcessSample(seconds=i * every, rss=_SHARED_RSS + (bytes_ or 0),
                                  private=bytes_) for i, bytes_ in enumerate(private))
    return WorkerMemory(pid=pid, worker=worker, loader=loader, dataset=dataset,
                        samples=samples, objects=objects, epoch=epoch, stores=tuple(stores))


def dataset_objects(name: str, *, kind: str, items: int, bytes: int,
                    dataset: str = "") -> DatasetObjects:
    """The largest container of Python objects a dataset keeps (``train_set.records``)."""
    return DatasetObjects(name=name, kind=kind, items=items, bytes=bytes, dataset=dataset)


def store(name: str, location: Location) -> DatasetStore:
    """An attribute a dataset's ``__getitem__`` adds to, first at ``location``."""
    return DatasetStore(name=name, location=location)


def report(*, iterations: Sequence[IterationStats] = (), censuses: Sequence[Census] = (),
           device: str = "cpu", backend: str | None = None, baseline: int = 0,
           **fields: Any) -> ReportData:
    """A report of a run on ``device``. ``backend`` defaults to torch's native caching
    allocator on a CUDA device (``cuda-caching-allocator``) and to ``test`` elsewhere; every
    other field of :class:`ReportData` is given in ``fields`` (the model's defaults
    otherwise: sampled peaks, tensors measured, no device size)."""
    if backend is None:
        backend = "cuda-caching-allocator" if device.startswith("cuda") else "test"
    return ReportData(device=device, backend=backend, baseline=baseline,
                      iterations=tuple(iterations), censuses=tuple(censuses), **fields)


__all__ = ["GiB", "KiB", "Location", "MiB", "Row", "censuses", "check", "cost", "dataset_objects",
           "exit_iteration", "garbage", "holder", "holder_states", "hook_states", "in_function",
           "iterations", "parts", "path", "ramp", "report", "store", "unused_graph", "worker"]
