"""``tensor-accumulation`` and ``retained-graph``: holders that gain tensors, or whose tensors'
autograd graph grows, from one census to the next."""

from __future__ import annotations

from memsentry.report import Finding, HolderStats, Report, Severity
from memsentry.rules.series import describe_holder, holder_series, per_iteration, trend
from memsentry.units import format_bytes

ACCUMULATION = "tensor-accumulation"
RETAINED_GRAPH = "retained-graph"


def _count(holder: HolderStats) -> float:
    return holder.tensors + holder.modules


def tensor_accumulation(report: Report) -> list[Finding]:
    """A list, dict, deque or attribute gains tensors (or whole models) at every census.

    Worse when they carry ``grad_fn``: each keeps its batch's graph and saved activations.
    """
    censuses, table = holder_series(report)
    findings = []
    for row in table.values():
        count = trend(censuses, row, _count)
        if not count.climbs():
            continue
        last = row[-1]
        assert last is not None
        first_seen = next(h for h in row if h is not None)
        size = trend(censuses, row, lambda h: h.bytes + h.graph_saved_bytes)
        what = "models" if last.modules and not last.tensors else "tensors"
        message = (
            f"{describe_holder(last)} gains {per_iteration(count.per_iteration, what[:-1])}: "
            f"{int(_count(last)):,} ({format_bytes(last.bytes)}) at iteration "
            f"{count.iterations[-1]}, up from {int(_count(first_seen)):,} at iteration "
            f"{count.iterations[0]}"
        )
        if last.modules:
            message += f"; {last.modules} of them are whole nn.Module objects"
        if last.graph_tensors:
            message += (
                f"; {last.graph_tensors:,} carry an autograd graph (grad_fn), which keeps "
                "their batch's graph"
            )
            if last.graph_saved_bytes:
                message += f" and {format_bytes(last.graph_saved_bytes)} saved for backward"
            message += " alive"
        if last.modules:
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
        findings.append(
            Finding(
                rule=ACCUMULATION, severity=Severity.LEAK, message=message, fix=fix,
                bytes=last.bytes + last.graph_saved_bytes,
                rate=max(size.per_iteration, 0.0), where=last.where or last.name,
            )
        )
    return findings


def retained_graph(report: Report) -> list[Finding]:
    """A tensor alive across iteration boundaries whose autograd graph grows: a loss or metric
    summed without ``.item()``, a hidden state never detached, or ``.grad`` tensors built with
    ``create_graph=True``. The graph is a leak even when backward freed its saved tensors: its
    nodes pile up."""
    censuses, table = holder_series(report)
    findings = []
    for row in table.values():
        last = row[-1]
        if last is None or not last.graph_tensors:
            continue
        nodes = trend(censuses, row, lambda h: h.graph_nodes)
        count = trend(censuses, row, _count)
        growing = nodes.climbs() and not count.climbs()
        saved = trend(censuses, row, lambda h: h.graph_saved_bytes)
        kept = len(nodes.values) >= 2 and all(h is not None and h.graph_tensors for h in row[-2:])
        if last.kind == "gradient" and (growing or kept):
            findings.append(_gradient_finding(last, nodes, saved, growing))
            continue
        if not growing:
            if kept and not count.climbs() and _is_attribute(last):
                findings.append(_pinned_graph(last))
            continue
        message = (
            f"{describe_holder(last)} keeps the autograd graph of every iteration: "
            f"{last.graph_nodes:,} graph nodes at iteration {nodes.iterations[-1]}, "
            f"+{nodes.per_iteration:.3g} nodes/iter since iteration {nodes.iterations[0]}"
        )
        if last.graph_saved_bytes:
            message += (
                f", holding {format_bytes(last.graph_saved_bytes)} saved for backward "
                f"(+{format_bytes(round(max(saved.per_iteration, 0)))}/iter)"
            )
        else:
            message += (
                "; backward() freed their saved tensors, but the nodes themselves pile up "
                "in host memory and every backward through them gets slower"
            )
        fix = (
            f"accumulate a number, not the tensor: `{_base(last.name)} += loss.item()` (or "
            "`loss.detach()`); a state carried into the next iteration (an RNN's hidden "
            "state) must be `.detach()`ed at each step"
        )
        findings.append(
            Finding(
                rule=RETAINED_GRAPH, severity=Severity.LEAK, message=message, fix=fix,
                bytes=last.bytes + last.graph_saved_bytes,
                rate=saved.per_iteration if saved.per_iteration > 0 else None,
                where=last.where or last.name,
            )
        )
    return findings


def _is_attribute(holder: HolderStats) -> bool:
    return holder.kind in ("class attribute", "model") or "." in holder.name.split("[", 1)[0]


def _pinned_graph(last: HolderStats) -> Finding:
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
        f"store `.detach()` in `{_base(last.name)}` (or `.item()` for a number), or clear it "
        "once it has been used"
    )
    return Finding(
        rule=RETAINED_GRAPH, severity=Severity.WASTE, message=message, fix=fix,
        bytes=last.bytes + last.graph_saved_bytes, rate=None, where=last.where or last.name,
    )


def _base(name: str) -> str:
    return name.split("[", 1)[0]


def _gradient_finding(last: HolderStats, nodes, saved, growing: bool) -> Finding:
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
        rate=saved.per_iteration if saved.per_iteration > 0 else None, where=last.name,
    )
