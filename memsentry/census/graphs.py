"""Autograd graphs behind held tensors: the nodes reachable from a ``grad_fn`` and the bytes
those nodes saved for backward."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

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


def graph_size(walk: Walk, grad_fns: Iterable[Any], seen: set[int], budget: Budget
               ) -> tuple[int, int]:
    """(nodes, saved bytes) reachable from the nodes ``grad_fns`` that no earlier holder
    claimed (``seen`` is updated); saved storages count once per walk, through ``walk``.
    Graphs have their own ``budget``: a huge graph (an LBFGS closure's, kept for every step)
    cuts the graph figures short, not the holders the walk found."""
    nodes = saved = 0
    stack = [r for r in grad_fns if id(r) not in seen]
    while stack and not budget.spent():
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        nodes += 1
        for tensor in saved_tensors(node):
            saved += walk.tally.count_bytes(tensor)
        for child, _index in node.next_functions:
            if child is not None and id(child) not in seen:
                stack.append(child)
    return nodes, saved
