"""Autograd graphs behind held tensors: the nodes reachable from a ``grad_fn``, the bytes
those nodes saved for backward, and how old the graph's nodes are.

Age is read from each node's sequence number (``Node::sequence_nr()`` in
``torch/csrc/autograd/function.h``): a thread-local counter that every node built in forward
takes and increments (``at::sequence_number::get_and_increment()``), so a node built later
has a higher number. ``AccumulateGrad`` (``torch/csrc/autograd/functions/accumulate_grad.cpp``)
and the engine's own nodes take ``UINT64_MAX`` and say nothing of age: they are left out.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import torch

from memsentry.census.walk import Budget, Walk

_SAVED_NAMES: dict[type, tuple[str, ...]] = {}


def _saved_names(node_type: type) -> tuple[str, ...]:
    names = _SAVED_NAMES.get(node_type)
    if names is None:
        names = tuple(n for n in dir(node_type) if n.startswith("_saved_"))
        if hasattr(node_type, "saved_tensors"):  # a custom autograd.Function's ctx
            names += ("saved_tensors",)
        _SAVED_NAMES[node_type] = names
    return names


def saved_tensors(node: Any) -> Iterator[torch.Tensor]:
    """The tensors an autograd node keeps for its backward."""
    for name in _saved_names(type(node)):
        try:
            value = getattr(node, name)
        except Exception:  # freed by backward, or an in-place change since
            continue
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, tuple | list):
            yield from (v for v in value if isinstance(v, torch.Tensor))


#: Sequence numbers from here up are not ages (``UINT64_MAX``: gradient accumulators, the
#: engine's own nodes).
_NO_AGE = 1 << 63


class GraphSize(NamedTuple):
    """What one holder's graph holds: its ``nodes``, the bytes they ``saved`` for backward, and
    the sequence numbers of its ``oldest`` and ``newest`` nodes (``None`` when no node has one:
    an empty graph, or only gradient accumulators), and how many of its nodes were ``kept``
    from before the census before (their numbers at or below its newest; ``None`` when that
    is not known)."""

    nodes: int
    saved: int
    oldest: int | None = None
    newest: int | None = None
    kept: int | None = None


def _age(node: Any) -> int:
    """The node's sequence number, or -1 where it has none that orders it."""
    try:
        number = node._sequence_nr()
    except Exception:  # a node type without one
        return -1
    return number if 0 <= number < _NO_AGE else -1


def graph_size(walk: Walk, grad_fns: Iterable[Any], seen: set[int], budget: Budget,
               since: int | None = None) -> GraphSize:
    """The graph reachable from the nodes ``grad_fns`` that no earlier holder claimed
    (``seen`` is updated); saved storages count once per walk, through ``walk``. Graphs have
    their own ``budget``: a huge graph (an LBFGS closure's, kept for every step) cuts the graph
    figures short, not the holders the walk found."""
    nodes = saved = 0
    ages: list[int] = []
    stack = [r for r in grad_fns if id(r) not in seen]
    while stack and not budget.spent():
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        nodes += 1
        ages.append(_age(node))
        for tensor in saved_tensors(node):
            saved += walk.tally.count_bytes(tensor)
        stack.extend(_inputs(node, seen))
    return _sized(nodes, saved, ages, since)


def _inputs(node: Any, seen: set[int]) -> list[Any]:
    """The nodes ``node`` passes gradients to that no walk has met yet."""
    return [child for child, _index in node.next_functions
            if child is not None and id(child) not in seen]


def _sized(nodes: int, saved: int, ages: list[int], since: int | None) -> GraphSize:
    """The graph's figures, with the span of its nodes' ``ages`` (-1: none) and how many are
    at or below ``since``."""
    ages = [age for age in ages if age >= 0]
    kept = None if since is None else sum(age <= since for age in ages)
    if not ages:
        return GraphSize(nodes, saved, kept=kept)
    return GraphSize(nodes, saved, min(ages), max(ages), kept)
