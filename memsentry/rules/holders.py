"""``tensor-accumulation``: holders that gain tensors, arrays, autograd nodes or models from
one census to the next, or keep one tensor that grows (the graphs they keep growing are
:mod:`memsentry.rules.retained`'s)."""

from __future__ import annotations

from dataclasses import replace

from memsentry.model import (
    Census,
    Finding,
    HolderKind,
    HolderStats,
    ReportData,
    Severity,
    Step,
    StepKind,
    Subject,
)
from memsentry.rules.holder_notes import (
    MODULE_CONTAINERS,
    accumulation_fix,
    buffer_kept,
    default_note,
    history_note,
    models_note,
    tensor_kept,
    what_it_keeps,
)
from memsentry.rules.registry import rule
from memsentry.rules.series import (
    MIN_CENSUSES,
    Trend,
    after_warmup,
    base_name,
    describe_holder,
    grows_faster,
    grows_steadily,
    growth_rate,
    held_count,
    holder_series,
    last_seen,
    latest,
    per_iteration,
    sawtooth_note,
    steady_growth,
    trend,
)
from memsentry.units import format_bytes

ACCUMULATION = "tensor-accumulation"


#: Bytes a step that a container emptied every epoch must gain, when it holds no autograd
#: graph, before its teeth alone make a leak (a flushed buffer of scalars does not).
TOOTH_BYTES = 64 * 1024


def _noun(holder: HolderStats) -> str:
    """What the holder mostly keeps: ``tensor``, ``model``, ``NumPy array``, ``autograd
    node``; ``module`` or ``parameter`` for a ``ModuleList``, ``ParameterList``..."""
    kinds = [(holder.tensors, "tensor"), (holder.arrays, "NumPy array"),
             (holder.nodes, "autograd node"), (holder.buffers, "buffer"),
             (holder.modules, "model")]
    if holder.container in MODULE_CONTAINERS:
        return "module" if holder.modules else "parameter"
    if holder.modules and not holder.tensors:
        return "model"
    return max(kinds, key=lambda kind: kind[0])[1]


def _parent(path: tuple[Step, ...]) -> tuple[Step, ...]:
    """``logger.history`` for ``logger.history['loss']`` (a string key); the path otherwise."""
    return path[:-1] if len(path) > 1 and path[-1].kind == StepKind.KEY else path


#: The counts of :class:`HolderStats` that add up when keys of one dict are merged.
_SUMMED = ("tensors", "bytes", "graph_tensors", "graph_nodes", "graph_saved_bytes", "modules",
           "arrays", "nodes", "buffers", "shared_bytes")


def _merge(path: tuple[Step, ...], entries: list[HolderStats | None]) -> HolderStats | None:
    """One holder standing for the keys of a dict that all grow."""
    present = [e for e in entries if e is not None]
    if not present:
        return None
    totals = {name: sum(getattr(e, name) for e in present) for name in _SUMMED}
    return replace(present[0], path=path, items=None, **totals)


@rule(ACCUMULATION, severities={Severity.LEAK}, causes={Severity.LEAK})
def tensor_accumulation(report: ReportData) -> list[Finding]:
    """A list, dict, deque or attribute gains tensors (or whole models) at every census.

    Worse when they carry ``grad_fn``: each keeps its batch's graph and saved activations.
    The string keys of one dict are judged together (:func:`_keyed`). The census reaches an
    optimizer's per-parameter state (``opt.state[p]['history']``), the items a branch of
    ``itertools.tee`` has not read, what C iterators keep, context variables
    (``seen.get()``), registries of modules (an ``nn.ModuleList`` gaining modules) and tensors
    chained through attributes (``out.prev = last``). One tensor that grows is not a leak when
    the loop binds it afresh before filling it (``x = torch.randn(8 + 4 * step, 16)``): it
    follows its input.
    """
    censuses, table = holder_series(report)
    allocated = steady_growth(after_warmup(report))
    keyed: dict[tuple[Step, ...], list[tuple[Step, ...]]] = {}
    findings = []
    for path, row in table.items():
        last = latest(row)
        if last is None or last.bound is not None or last.rebound:
            continue  # a deque(maxlen=k) cannot pass k; a list made anew each step keeps one
        parent = _parent(path)
        if parent != path:
            keyed.setdefault(parent, []).append(path)
        elif _accumulates(censuses, row):
            findings.append(_accumulation(censuses, row, ""))
        else:
            findings += _growing(censuses, row, allocated)
    for parent, paths in keyed.items():
        findings += _keyed(censuses, table, parent, paths, allocated)
    return findings


Row = list[HolderStats | None]


def _accumulates(censuses: list[Census], row: Row) -> bool:
    count = trend(censuses, row, held_count)
    return count.climbs(teeth=False) or _material_tooth(censuses, row, count)


def _growing(censuses: list[Census], row: Row, allocated: tuple[float, float] | None
             ) -> list[Finding]:
    """One tensor whose bytes climb (a bank concatenated onto itself), as its own finding; not
    one the code binds anew every step before it is filled (``x = torch.randn(n, 16)``): it
    grows with its input (a longer sequence, a larger batch) and keeps nothing of the step
    before. One the line builds from itself grows at any pace: fed ever longer inputs, a bank
    grows faster and faster."""
    last = latest(row)
    if last is None or last.kind == HolderKind.GRADIENT or last.rebound:
        return []
    size = trend(censuses, row, lambda h: h.bytes)
    feeds_itself = last.rebound is False and grows_faster(size)
    if feeds_itself or grows_steadily(size) or _explains_growth(size, allocated):
        return [_growing_tensor(row, size)]
    return []


def _keyed(censuses: list[Census], table: dict[tuple[Step, ...], Row],
           parent: tuple[Step, ...], paths: list[tuple[Step, ...]],
           allocated: tuple[float, float] | None) -> list[Finding]:
    """The string keys of one dict, together: a key added at every step
    (``results[f"step{i}"] = out``) or several keys that each grow (a logger's history) make
    one finding, naming the keys that gained; a key whose one tensor grows, its own."""
    merged = _merged_row(len(censuses), table, parent, paths)
    if not _accumulates(censuses, merged):
        return [finding for p in paths for finding in _growing(censuses, table[p], allocated)]
    gained = [p for p in paths if _gained(table[p])] or paths
    if len(gained) == 1:
        return [_accumulation(censuses, table[gained[0]], "")]
    row = merged if len(gained) == len(paths) else \
        _merged_row(len(censuses), table, parent, gained)
    return [_accumulation(censuses, row, _key_list(gained))]


def _merged_row(censuses: int, table: dict[tuple[Step, ...], Row], parent: tuple[Step, ...],
                paths: list[tuple[Step, ...]]) -> Row:
    """The keys ``paths`` of the dict at ``parent`` as one holder, at each of ``censuses``."""
    return [_merge(parent, [table[p][i] for p in paths]) for i in range(censuses)]


def _gained(row: Row) -> bool:
    """A key still there at the last census that appeared after the first, or holds more."""
    first, last = row[0], row[-1]
    return last is not None and (first is None or held_count(last) > held_count(first))


def _key_list(paths: list[tuple[Step, ...]], shown: int = 4) -> str:
    keys = [p[-1].spelled() for p in paths]  # in the order they appeared
    if len(keys) <= shown:
        return ", ".join(keys)
    return f"{', '.join(keys[:shown - 1])} and {len(keys) - shown + 1:,} more"


#: A holder whose bytes rose at every census (three at least) is named as the cause of the
#: allocated memory's steady growth when its own rate is within this factor of that growth's.
EXPLAINS = 2.0


def _explains_growth(size: Trend, allocated: tuple[float, float] | None) -> bool:
    """The holder's bytes rose at every census, steadily, at the pace the allocated memory
    grows (``memory-growth``'s judgement): before five censuses make its own case, the
    allocated counter corroborates it."""
    if allocated is None or not grows_steadily(size, points=MIN_CENSUSES):
        return False
    first, last = size.windows()[-1]
    span = size.iterations[last] - size.iterations[first]
    rate = (size.values[last] - size.values[first]) / span
    return allocated[0] / EXPLAINS <= rate <= allocated[0] * EXPLAINS


def _growing_tensor(row: list[HolderStats | None], size: Trend) -> Finding:
    """A holder that keeps as many tensors, ever larger: one tensor rebuilt with what each
    step adds."""
    last = latest(row)
    assert last is not None
    first, end = size.windows()[-1]
    rate = (size.values[end] - size.values[first]) / (size.iterations[end]
                                                        - size.iterations[first])
    base = base_name(last)
    kept, fix = buffer_kept(last, base) if _only_buffers(last) else tensor_kept(last, base)
    message = (
        f"{describe_holder(last)} grows by {format_bytes(round(rate))}/iter: "
        f"{format_bytes(last.bytes)} at iteration {size.iterations[end]}, up from "
        f"{format_bytes(round(size.values[first]))} at iteration {size.iterations[first]}, "
        f"while it keeps {kept}"
    )
    return Finding(
        rule=ACCUMULATION, severity=Severity.LEAK, message=message, fix=fix,
        bytes=last.bytes, objects=last.tensors, rate=rate, subject=Subject.holder(last.path),
        location=last.where, iteration=size.iterations[end],
    )


def _only_buffers(last: HolderStats) -> bool:
    """Whether what grows is Python buffers (a bytearray, a memoryview, a DLPack capsule),
    no tensor among them."""
    return last.tensors == 0 and last.buffers > 0


def _material_tooth(censuses: list[Census], row: list[HolderStats | None],
                    count: Trend) -> bool:
    """A container that filled for several censuses and was then emptied: a leak that grows
    with the epoch when what it gained carries autograd graphs or gains ``TOOTH_BYTES`` a
    step; a buffer of a few detached numbers flushed every N steps is bounded."""
    teeth = count.teeth()
    if not teeth:
        return False
    graphs = trend(censuses, row, lambda h: h.graph_tensors).values
    size = trend(censuses, row, lambda h: h.bytes + h.graph_saved_bytes)
    for a, b in teeth:
        span = size.iterations[b] - size.iterations[a]
        if graphs[b] > graphs[a] or (span and (size.values[b] - size.values[a]) / span
                                     >= TOOTH_BYTES):
            return True
    return False


def _accumulation(censuses: list[Census], row: list[HolderStats | None], keys: str) -> Finding:
    """The LEAK of a holder that gains what it keeps at every census (``keys``: the keys of
    a dict judged together, named in the message)."""
    count = trend(censuses, row, held_count)
    last = latest(row)
    assert last is not None
    size = trend(censuses, row, lambda h: h.bytes + h.graph_saved_bytes)
    what = _noun(last)
    default = _default_argument(last)
    message = _gains(row, count, what, keys)
    message += models_note(last)
    message += what_it_keeps(last, _graphs_complete(censuses, row))
    message += default_note(default) + history_note(last)
    fix = accumulation_fix(last, what, default=default is not None)
    return Finding(
        rule=ACCUMULATION, severity=Severity.LEAK, message=message, fix=fix,
        bytes=last.bytes + last.graph_saved_bytes, objects=int(held_count(last)),
        rate=max(growth_rate(size), 0.0), subject=Subject.holder(last.path),
        location=last.where, iteration=count.iterations[-1],
    )


def _gains(row: Row, count: Trend, what: str, keys: str) -> str:
    """The accumulation message's opening: the holder, what it gains an iteration, and how
    much it held first and last."""
    last = latest(row)
    assert last is not None
    first_seen = next(h for h in row if h is not None)
    across = f" across its keys {keys}" if keys else ""
    held = f" ({format_bytes(last.bytes)})" if last.bytes else ""
    return (
        f"{describe_holder(last)} gains {per_iteration(growth_rate(count), what)}{across}: "
        f"{int(held_count(last)):,}{held} at iteration "
        f"{count.iterations[-1]}, up from {int(held_count(first_seen)):,} at iteration "
        f"{count.iterations[0]}{sawtooth_note(count)}"
    )


def _graphs_complete(censuses: list[Census], row: Row) -> bool:
    """Whether the latest census that saw the holder walked its autograd graphs whole."""
    seen_at = last_seen(row)
    return seen_at is None or censuses[seen_at].graphs_complete


def _default_argument(last: HolderStats) -> str | None:
    """The step by which a function's default argument leads to the holder, if one does."""
    return next((step.name for step in last.path
                 if step.name.startswith(("__defaults__[", "__kwdefaults__["))), None)
