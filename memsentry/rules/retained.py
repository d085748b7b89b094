"""``retained-graph``: a tensor alive across iteration boundaries whose autograd graph grows
(a loss summed without ``.item()``, a state never detached), or that pins one graph more."""

from __future__ import annotations

import ast
from dataclasses import dataclass

from memsentry.model import (
    Census,
    Finding,
    HolderKind,
    HolderStats,
    ReportData,
    Severity,
    StepKind,
    Subject,
)
from memsentry.model.places import until_subscript
from memsentry.rules.registry import rule
from memsentry.rules.series import (
    TRACEBACK,
    Trend,
    base_name,
    describe_holder,
    growth_rate,
    held_count,
    holder_series,
    latest,
    reaches_back,
    sawtooth_note,
    trend,
)
from memsentry.units import format_bytes
from memsentry.usercode.feeds import graph_free

RETAINED_GRAPH = "retained-graph"

#: What one graph pinned by an attribute must keep (its tensors and saved activations) to be
#: worth a WASTE finding: a metric that caches a 4-byte loss with its graph (torchmetrics'
#: ``_forward_cache``) costs nothing worth changing code for.
PINNED_MIN_BYTES = 1 << 20


@rule(RETAINED_GRAPH, severities={Severity.LEAK, Severity.WASTE}, causes={Severity.LEAK})
def retained_graph(report: ReportData) -> list[Finding]:
    """A tensor alive across iteration boundaries whose autograd graph grows: a loss or metric
    summed without ``.item()``, a hidden state never detached, or ``.grad`` tensors built with
    ``create_graph=True``. The graph is a leak even when backward freed its saved tensors: its
    nodes pile up. It must reach back: at some census its oldest node (by autograd's sequence
    numbers) was already alive at the census before; a graph built anew each step that grows
    because its input does (a sequence longer at every step) never does."""
    censuses, table = holder_series(report, graphs=True)
    graphs = [_graph_of(censuses, row) for row in table.values()]
    judged = [_judge(graph) for graph in graphs if graph is not None]
    return [finding for finding in judged if finding is not None]


@dataclass(frozen=True)
class _Graph:
    """What the censuses show of the autograd graph one holder keeps.

    ``nodes`` and ``saved`` are its graph's nodes and saved bytes census by census;
    ``growing``: the nodes climb while what it holds does not, and the graph was already alive
    at an earlier census (one tensor whose graph grows: a loss of this step only, larger
    because its input is longer, is not one);
    ``held_climbs``: what it holds climbs (tensor-accumulation's case); ``kept``: its tensors
    carried a graph at each of the last two censuses."""

    last: HolderStats
    nodes: Trend
    saved: Trend
    growing: bool
    held_climbs: bool
    kept: bool


def _carries_graph(holder: HolderStats | None) -> bool:
    """Whether a census saw the holder keep a graph: tensors with a ``grad_fn``, or nodes."""
    return holder is not None and bool(holder.graph_tensors or holder.nodes)


def _graph_of(censuses: list[Census], row: list[HolderStats | None]) -> _Graph | None:
    """The holder's graph across ``censuses``; ``None`` when its latest entry keeps none."""
    last = latest(row)
    if last is None or not _carries_graph(last):
        return None
    nodes = trend(censuses, row, lambda h: h.graph_nodes)
    held_climbs = trend(censuses, row, held_count).climbs()
    growing = nodes.climbs() and not held_climbs and reaches_back(censuses, row)
    return _Graph(
        last=last, nodes=nodes, saved=trend(censuses, row, lambda h: h.graph_saved_bytes),
        growing=growing, held_climbs=held_climbs,
        kept=len(nodes.values) >= 2 and all(_carries_graph(h) for h in row[-2:]),
    )


def _judge(graph: _Graph) -> Finding | None:
    """The finding a holder's graph makes: a gradient's graph, a graph that grows (LEAK), one
    graph pinned by an attribute (WASTE), or none."""
    last = graph.last
    if last.kind == HolderKind.GRADIENT and (graph.growing or graph.kept):
        return _gradient_finding(last, graph.nodes, graph.saved, graph.growing)
    if graph.growing:
        return _growing_graph(graph)
    if _pins_one_graph(graph):
        return _pinned_graph(last, graph.nodes.iterations[-1])
    return None


def _pins_one_graph(graph: _Graph) -> bool:
    """An attribute that kept a graph at the last two censuses, holding no more than before,
    and whose graph costs ``PINNED_MIN_BYTES`` or more."""
    last = graph.last
    return (graph.kept and not graph.held_climbs and _is_attribute(last)
            and last.bytes + last.graph_saved_bytes >= PINNED_MIN_BYTES)


def _highest(nodes: Trend) -> int:
    """The position of the census that saw the most nodes (the latest among equals)."""
    return max(range(len(nodes.values)), key=lambda i: (nodes.values[i], i))


def _positive(rate: float) -> float | None:
    return rate if rate > 0 else None


def _growing_graph(graph: _Graph) -> Finding:
    """The LEAK of a holder whose graph gains nodes at every iteration."""
    last, nodes, saved = graph.last, graph.nodes, graph.saved
    most = _highest(nodes)
    message = (
        f"{describe_holder(last)} keeps the autograd graph of every iteration: "
        f"{int(nodes.values[most]):,} graph nodes at iteration {nodes.iterations[most]}, "
        f"+{growth_rate(nodes):.3g} nodes/iter since iteration {nodes.iterations[0]}"
    )
    message += _saved_note(last, saved) + sawtooth_note(nodes)
    return Finding(
        rule=RETAINED_GRAPH, severity=Severity.LEAK, message=message, fix=_growing_fix(last),
        bytes=last.bytes + last.graph_saved_bytes, objects=int(nodes.values[most]),
        rate=_positive(growth_rate(saved)), subject=Subject.holder(last.path),
        location=last.feed.where if last.feed is not None else last.where,
        iteration=nodes.iterations[most],  # the census the message quotes
    )


def _saved_note(last: HolderStats, saved: Trend) -> str:
    """What the growing graph keeps saved for backward, or that backward freed it."""
    if last.graph_saved_bytes:
        return (
            f", holding {format_bytes(last.graph_saved_bytes)} saved for backward "
            f"(+{format_bytes(round(max(growth_rate(saved), 0)))}/iter)"
        )
    return (
        "; backward() freed their saved tensors, but the nodes themselves pile up "
        "in host memory and every backward through them gets slower"
    )


def _growing_fix(last: HolderStats) -> str:
    """Accumulate numbers where the holder keeps scalars (a summed metric); else cut the
    graph of a state carried into the next iteration."""
    if last.tensors and last.bytes <= 8 * last.tensors:
        return _number_fix(last)
    return (
        f"cut the graph at each iteration: `{base_name(last)} = "
        f"{base_name(last)}.detach()` before it is used again (truncated BPTT), "
        "and drop retain_graph=True once nothing reaches back"
    )


def _parsed(expression: str) -> ast.expr | None:
    try:
        return ast.parse(expression, mode="eval").body
    except SyntaxError:
        return None


def _item(expression: str) -> str:
    """``expression.item()``, parenthesised unless it is a name, attribute, call or
    subscript."""
    plain = isinstance(_parsed(expression), ast.Name | ast.Attribute | ast.Call | ast.Subscript)
    return f"{expression}.item()" if plain else f"({expression}).item()"


def _number_fix(last: HolderStats) -> str:
    """Accumulate numbers, in the user's words: the call that hands the tensor to the
    holder's method (``losses.update(loss.item(), n)``), else the line's own expression
    (``epoch_errD += errD.item()``)."""
    feed = last.feed
    if feed is not None:
        return (
            f"pass a number, not the tensor: `{feed.with_argument(_item(feed.argument))}` "
            f"({feed.where}); `{feed.call}` stores `{feed.argument}` and its graph in "
            f"`{last.name}`"
        )
    if last.rewrite is not None:
        return (f"accumulate a number, not the tensor: `{last.rewrite}` (or `.detach()` the "
                "tensor)")
    added = last.added
    if added is None or _adds_no_graph(added):
        # No line found, or the one found already adds a number (`total += loss.item()`
        # beside a `total += loss` on another branch): not the line to quote.
        return (f"accumulate a number, not the tensor: add `x.item()` to `{base_name(last)}` "
                "where it adds a tensor `x` (or `x.detach()`)")
    return (
        f"accumulate a number, not the tensor: `{base_name(last)} += {_item(added)}` "
        f"(or `{added}.detach()`)"
    )


def _adds_no_graph(expression: str) -> bool:
    """Whether ``expression`` is already a number or a detached tensor (``loss.item()``), or
    cannot be read."""
    node = _parsed(expression)
    return node is None or graph_free(node)


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
        f"store `.detach()` in `{base_name(last)}` (or `.item()` for a number), or clear it "
        "once it has been used"
    )
    return Finding(
        rule=RETAINED_GRAPH, severity=Severity.WASTE, message=message, fix=fix,
        bytes=last.bytes + last.graph_saved_bytes, rate=None, objects=last.graph_nodes,
        subject=Subject.holder(last.path), location=last.where, iteration=iteration,
    )


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
