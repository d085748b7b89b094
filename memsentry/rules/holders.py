"""``tensor-accumulation`` and ``retained-graph``: holders that gain tensors, or whose tensors'
autograd graph grows, from one census to the next."""

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
    spell,
)
from memsentry.model.places import until_subscript
from memsentry.rules.registry import rule
from memsentry.rules.series import (
    Trend,
    describe_holder,
    growth_rate,
    holder_series,
    last_seen,
    latest,
    per_iteration,
    sawtooth_note,
    trend,
)
from memsentry.units import format_bytes

ACCUMULATION = "tensor-accumulation"
RETAINED_GRAPH = "retained-graph"


#: Bytes a step that a container emptied every epoch must gain, when it holds no autograd
#: graph, before its teeth alone make a leak (a flushed buffer of scalars does not).
TOOTH_BYTES = 64 * 1024
#: The step from an exception to its traceback.
TRACEBACK = Step(StepKind.ATTRIBUTE, "__traceback__")
#: Names under which IPython keeps cell results in a notebook's namespace.
_IPYTHON_HISTORY = frozenset({"Out", "_oh", "_", "__", "___"})


def _count(holder: HolderStats) -> float:
    return holder.tensors + holder.modules


def _parent(path: tuple[Step, ...]) -> tuple[Step, ...]:
    """``logger.history`` for ``logger.history['loss']`` (a string key); the path otherwise."""
    return path[:-1] if len(path) > 1 and path[-1].kind == StepKind.KEY else path


def _merge(path: tuple[Step, ...], entries: list[HolderStats | None]) -> HolderStats | None:
    """One holder standing for the keys of a dict that all grow."""
    present = [e for e in entries if e is not None]
    if not present:
        return None
    first = present[0]
    return replace(
        first, path=path, items=None,
        tensors=sum(e.tensors for e in present), bytes=sum(e.bytes for e in present),
        graph_tensors=sum(e.graph_tensors for e in present),
        graph_nodes=sum(e.graph_nodes for e in present),
        graph_saved_bytes=sum(e.graph_saved_bytes for e in present),
        modules=sum(e.modules for e in present),
    )


#: What one graph pinned by an attribute must keep (its tensors and saved activations) to be
#: worth a WASTE finding: a metric that caches a 4-byte loss with its graph (torchmetrics'
#: ``_forward_cache``) costs nothing worth changing code for.
PINNED_MIN_BYTES = 1 << 20


@rule(RETAINED_GRAPH, severities={Severity.LEAK, Severity.WASTE}, causes={Severity.LEAK})
def retained_graph(report: ReportData) -> list[Finding]:
    """A tensor alive across iteration boundaries whose autograd graph grows: a loss or metric
    summed without ``.item()``, a hidden state never detached, or ``.grad`` tensors built with
    ``create_graph=True``. The graph is a leak even when backward freed its saved tensors: its
    nodes pile up."""
    censuses, table = holder_series(report, graphs=True)
    findings = []
    for row in table.values():
        last = latest(row)
        if last is None or not last.graph_tensors:
            continue
        nodes = trend(censuses, row, lambda h: h.graph_nodes)
        count = trend(censuses, row, _count)
        growing = nodes.climbs() and not count.climbs()
        saved = trend(censuses, row, lambda h: h.graph_saved_bytes)
        kept = len(nodes.values) >= 2 and all(h is not None and h.graph_tensors
                                              for h in row[-2:])
        if last.kind == HolderKind.GRADIENT and (growing or kept):
            findings.append(_gradient_finding(last, nodes, saved, growing))
            continue
        if not growing:
            if kept and not count.climbs() and _is_attribute(last) \
                    and last.bytes + last.graph_saved_bytes >= PINNED_MIN_BYTES:
                findings.append(_pinned_graph(last, nodes.iterations[-1]))
            continue
        most = max(range(len(nodes.values)), key=lambda i: (nodes.values[i], i))
        message = (
            f"{describe_holder(last)} keeps the autograd graph of every iteration: "
            f"{int(nodes.values[most]):,} graph nodes at iteration {nodes.iterations[most]}, "
            f"+{growth_rate(nodes):.3g} nodes/iter since iteration {nodes.iterations[0]}"
        )
        if last.graph_saved_bytes:
            message += (
                f", holding {format_bytes(last.graph_saved_bytes)} saved for backward "
                f"(+{format_bytes(round(max(growth_rate(saved), 0)))}/iter)"
            )
        else:
            message += (
                "; backward() freed their saved tensors, but the nodes themselves pile up "
                "in host memory and every backward through them gets slower"
            )
        message += sawtooth_note(nodes)
        if last.tensors and last.bytes <= 8 * last.tensors:  # scalars: a summed metric
            fix = (
                f"accumulate a number, not the tensor: `{_base(last)} += loss.item()` "
                "(or `loss.detach()`)"
            )
        else:  # a state carried into the next iteration
            fix = (
                f"cut the graph at each iteration: `{_base(last)} = "
                f"{_base(last)}.detach()` before it is used again (truncated BPTT), "
                "and drop retain_graph=True once nothing reaches back"
            )
        findings.append(
            Finding(
                rule=RETAINED_GRAPH, severity=Severity.LEAK, message=message, fix=fix,
                bytes=last.bytes + last.graph_saved_bytes, objects=last.graph_nodes,
                rate=growth_rate(saved) if growth_rate(saved) > 0 else None,
                subject=Subject.holder(last.path), location=last.where,
                iteration=nodes.iterations[-1],
            )
        )
    return findings


def _is_attribute(holder: HolderStats) -> bool:
    if holder.path and holder.path[-1] == TRACEBACK:
        return False  # a kept exception's frames: the exception-frames rule says it better
    if holder.kind in (HolderKind.CLASS_ATTRIBUTE, HolderKind.MODEL, HolderKind.INSTANCE):
        return True
    return any(step.kind == StepKind.ATTRIBUTE for step in until_subscript(holder.path))


def _pinned_graph(last: HolderStats, iteration: int) -> Finding:
    """An attribute that keeps one graph-carrying tensor across iterations (replaced, not
    appended, each time): bounded, but one extra graph stays alive."""
    message = (
        f"{describe_holder(last)} keeps a tensor with its autograd graph across iterations "
        f"({format_bytes(last.bytes)} of tensors, {last.graph_nodes:,} graph nodes"
    )
    if last.graph_saved_bytes:
        message += f", {format_bytes(last.graph_saved_bytes)} saved for backward"
    message += "): one extra graph is alive when the next forward starts, raising the peak"
    fix = (
        f"store `.detach()` in `{_base(last)}` (or `.item()` for a number), or clear it "
        "once it has been used"
    )
    return Finding(
        rule=RETAINED_GRAPH, severity=Severity.WASTE, message=message, fix=fix,
        bytes=last.bytes + last.graph_saved_bytes, rate=None, objects=last.graph_nodes,
        subject=Subject.holder(last.path), location=last.where, iteration=iteration,
    )


def _base(holder: HolderStats) -> str:
    """The holder's name up to its first subscript: ``history`` for ``history[0]``."""
    return spell(until_subscript(holder.path))


def _gradient_finding(last: HolderStats, nodes: Trend, saved: Trend, growing: bool) -> Finding:
    message = (
        f"`{last.name}` and {last.items - 1 if last.items else 0} more parameter .grad "
        f"tensors carry a grad_fn at the iteration boundary ({last.graph_nodes:,} graph nodes"
    )
    message += (
        f", +{nodes.per_iteration:.3g}/iter): each backward(create_graph=True) adds to a graph "
        "that is never freed" if growing else "): the graph of the last backward stays alive "
        "until the gradients are reset"
    )
    fix = (
        "after a backward(create_graph=True), detach or reset the gradients before the next "
        "step (`optimizer.zero_grad(set_to_none=True)`, or `p.grad = p.grad.detach()`); use "
        "torch.autograd.grad(..., create_graph=True) for higher-order terms instead of .grad"
    )
    return Finding(
        rule=RETAINED_GRAPH, severity=Severity.LEAK if growing else Severity.WASTE,
        message=message, fix=fix, bytes=last.bytes + last.graph_saved_bytes,
        objects=last.graph_nodes,
        rate=saved.per_iteration if saved.per_iteration > 0 else None,
        subject=Subject.holder(last.path), iteration=nodes.iterations[-1],
    )


@rule(ACCUMULATION, severities={Severity.LEAK}, causes={Severity.LEAK})
def tensor_accumulation(report: ReportData) -> list[Finding]:
    """A list, dict, deque or attribute gains tensors (or whole models) at every census.

    Worse when they carry ``grad_fn``: each keeps its batch's graph and saved activations.
    Several keys of one dict that all grow (a logger's history) make one finding.
    """
    censuses, table = holder_series(report)
    groups: dict[tuple[Step, ...], list[tuple[Step, ...]]] = {}
    for path, row in table.items():
        last = latest(row)
        if last is None or last.bound is not None:
            continue  # a deque(maxlen=k) cannot pass k: a window, not a leak
        count = trend(censuses, row, _count)
        if count.climbs(teeth=False) or _material_tooth(censuses, row, count):
            groups.setdefault(_parent(path), []).append(path)
    findings = []
    for parent, paths in groups.items():
        if len(paths) == 1:
            row, keys = table[paths[0]], ""
        else:
            row = [_merge(parent, [table[p][i] for p in paths]) for i in range(len(censuses))]
            keys = ", ".join(sorted(p[-1].spelled() for p in paths))
        findings.append(_accumulation(censuses, row, keys))
    return findings


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
    count = trend(censuses, row, _count)
    last = latest(row)
    assert last is not None
    first_seen = next(h for h in row if h is not None)
    size = trend(censuses, row, lambda h: h.bytes + h.graph_saved_bytes)
    what = "model" if last.modules and not last.tensors else "tensor"
    message = (
        f"{describe_holder(last)} gains {per_iteration(growth_rate(count), what)}"
        f"{' across its keys ' + keys if keys else ''}: "
        f"{int(_count(last)):,} ({format_bytes(last.bytes)}) at iteration "
        f"{count.iterations[-1]}, up from {int(_count(first_seen)):,} at iteration "
        f"{count.iterations[0]}{sawtooth_note(count)}"
    )
    if last.modules:
        message += f"; {last.modules} of them are whole nn.Module objects"
    if last.graph_tensors:
        seen_at = last_seen(row)
        least = "" if seen_at is None or censuses[seen_at].graphs_complete else "at least "
        message += (
            f"; {last.graph_tensors:,} carry an autograd graph (grad_fn), which keeps "
            f"their batch's graph ({least}{last.graph_nodes:,} nodes"
        )
        if last.graph_saved_bytes:
            message += f", {format_bytes(last.graph_saved_bytes)} saved for backward"
        message += ") alive"
    default = next((step.name for step in last.path if step.name.startswith("__defaults__[")
                    or step.name.startswith("__kwdefaults__[")), None)
    if default is not None:
        message += (
            "; it is a mutable default argument, made once when the `def` ran and shared by "
            "every call, so it keeps what each call adds"
        )
    ipython = last.root in _IPYTHON_HISTORY
    if ipython:
        message += (
            "; this is IPython's output history, which keeps the result of every cell that "
            "ends with an expression (`del` and `torch.cuda.empty_cache()` do not free it)"
        )
    if ipython:
        fix = (
            "end such cells with `;` (or assign the result), drop kept results with "
            "`%reset -f out`, or turn the cache off (`%config InteractiveShell.cache_size = 0`)"
        )
    elif default is not None:
        fix = (
            "default the argument to `None` and make the container inside the function "
            "(`def f(..., kept=None)`, then `if kept is None: kept = []`), or pass it "
            "explicitly; store `.detach()`ed tensors or `.item()` numbers in it"
        )
    elif last.modules:
        fix = (
            "keep results, not models: store the score and, for the best model only, a "
            "CPU copy of state_dict(); `del` the model and optimizer after each trial"
        )
    elif last.graph_tensors:
        fix = (
            "store `.detach()`ed tensors (or `.item()` for scalars), and run evaluation "
            "under `torch.no_grad()`; clear the container each epoch or bound it with "
            "`collections.deque(maxlen=k)`"
        )
    else:
        fix = (
            "store Python numbers (`.item()`, `.tolist()`) or CPU copies (`.cpu()`), "
            "aggregate as you go, and clear the container each epoch or bound it with "
            "`collections.deque(maxlen=k)`"
        )
    return Finding(
        rule=ACCUMULATION, severity=Severity.LEAK, message=message, fix=fix,
        bytes=last.bytes + last.graph_saved_bytes, objects=int(_count(last)),
        rate=max(growth_rate(size), 0.0), subject=Subject.holder(last.path),
        location=last.where, iteration=count.iterations[-1],
    )
