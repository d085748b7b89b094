"""Naming leaked storages that no Python object holds: a reference cycle inside autograd's
C++ graph keeps them, out of the reach of ``gc.collect()`` and of the holder search. Two
cycles are told: a tensor whose own graph saved a tensor later modified in place, and a leaf
whose ``.grad`` has a graph (``backward(create_graph=True)``) that refers back to the leaf."""

from __future__ import annotations

import gc
from collections.abc import Iterator, Mapping
from dataclasses import replace
from types import FrameType
from typing import Any

import torch

from memsentry.measure.storage import storage_pointer
from pytest_memsentry.results import AUTOGRAD_CYCLE, GRAD_CYCLE, LeakedTensor


def kept_by_autograd(tensors: list[LeakedTensor], unreached: list[int],
                      pointers: list[int]) -> list[LeakedTensor]:
    """Name the leaked storages that no Python object holds but a tensor of autograd's graph:
    an in-place op on a tensor that requires grad (``a += a * y``, a slice assigned into a
    non-leaf) can make a reference cycle inside autograd's C++ graph (tensor -> grad_fn ->
    saved tensor), which ``gc.collect()`` cannot see or free. One scan of the collector's
    objects, only for a test that leaked something the holder search did not reach. Such a
    tensor is alive, has a
    ``grad_fn``, no Python referrer, and its own graph saved a tensor later modified in place;
    a tensor merely saved by a graph that something else keeps stays "not reached"."""
    wanted = {pointers[i]: i for i in unreached}
    cycles, graded = _cycle_storages(wanted)
    out = list(tensors)
    for key in graded - cycles:
        out[wanted[key]] = replace(out[wanted[key]], holder=GRAD_CYCLE)
    for key in cycles:
        out[wanted[key]] = replace(out[wanted[key]], holder=AUTOGRAD_CYCLE, grad_fn=True)
    return out


def _cycle_storages(wanted: Mapping[int, int]) -> tuple[set[int], set[int]]:
    """Of the storages ``wanted``, those a tensor's cycle with its own graph keeps, and those
    the cycle of a leaf with its ``.grad``'s graph keeps. The tensors met are let go before
    this returns."""
    matches, leaves = _tensors_of(wanted)
    graphed = [tensor for tensor in matches if tensor.grad_fn is not None]
    candidates = graphed + leaves
    try:
        alone = _unreferred(candidates, matches, leaves, graphed, candidates)
        cycles = {storage_pointer(tensor) for tensor in graphed
                  if id(tensor) in alone and _modified_in_place(tensor)}
        graded = _grad_cycles([leaf for leaf in leaves if id(leaf) in alone]) & wanted.keys()
    finally:
        for found in (candidates, graphed, matches, leaves):
            found.clear()
    return cycles, graded


def _tensors_of(storages: Mapping[int, int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The tensors the collector tracks whose storage is one of ``storages``, and the leaves
    whose ``.grad`` has a graph."""
    matches, leaves = [], []
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor):
            continue
        if storage_pointer(obj) in storages:
            matches.append(obj)
        if obj.grad_fn is None and obj.requires_grad and _graphed_grad(obj):
            leaves.append(obj)
    return matches, leaves


def _graphed_grad(leaf: torch.Tensor) -> bool:
    try:
        grad = leaf.grad
        return grad is not None and grad.grad_fn is not None
    except Exception:  # a subclass's own attribute handling
        return False


def _grad_cycles(leaves: list[torch.Tensor]) -> set[int]:
    """The storages kept by the cycle between a leaf no Python object refers to and its
    ``.grad``'s graph (``backward(create_graph=True)``): the leaf's, its gradient's and those
    the gradient's graph saved (its first nodes)."""
    kept: set[int] = set()
    for leaf in leaves:
        grad = leaf.grad
        assert grad is not None
        kept |= {storage_pointer(leaf), storage_pointer(grad), *_saved_storages(grad)}
    return kept


def _saved_storages(tensor: torch.Tensor, limit: int = 2_000) -> set[int]:
    """The storages the graph of ``tensor`` (its first ``limit`` nodes) saved for backward,
    and the leaves its AccumulateGrad nodes hold."""
    kept: set[int] = set()
    for node in _nodes(tensor.grad_fn, limit):
        for value in _saved(node):
            kept.add(storage_pointer(value))
    return kept


def _nodes(root: Any, limit: int) -> Iterator[Any]:
    """The autograd nodes of the graph that begins at ``root``, its first ``limit``, each
    once, as a walk meets them."""
    stack: list[Any] = [root]
    seen: set[int] = set()
    while stack and len(seen) < limit:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        stack.extend(child for child, _index in node.next_functions)


def _saved_values(node: Any) -> Iterator[tuple[Any, Exception | None]]:
    """Each tensor the autograd node saved, read: its value, or the error reading it raised
    (freed by a backward, modified in place since)."""
    for name in dir(type(node)):
        if name.startswith("_saved_"):
            try:
                yield getattr(node, name), None
            except Exception as error:
                yield None, error


def _saved(node: Any) -> list[torch.Tensor]:
    """The tensors an autograd node saved (and an AccumulateGrad's leaf), as it can read
    them."""
    values = [getattr(node, "variable", None), *(value for value, _ in _saved_values(node))]
    return [value for value in values if isinstance(value, torch.Tensor)]


def _unreferred(tensors: list[torch.Tensor], *lists: list[torch.Tensor]) -> set[int]:
    """The ids of ``tensors`` no Python object refers to but ``lists`` and frames: one scan
    of the collector's objects for all of them (a scan per tensor took seconds once a suite
    had left a few thousand tensors behind)."""
    wanted = {id(tensor) for tensor in tensors}
    ignored = {id(found) for found in lists}
    referred: set[int] = set()
    for referrer in gc.get_referrers(*tensors):
        if id(referrer) in ignored or isinstance(referrer, FrameType):
            continue
        referred.update(id(value) for value in gc.get_referents(referrer)
                        if id(value) in wanted)
    return wanted - referred


def _modified_in_place(tensor: torch.Tensor, limit: int = 2_000) -> bool:
    """Whether the tensor's own graph (its first ``limit`` nodes) saved a tensor that was
    modified in place afterwards: the mark of the cycle (a tensor saved by a node of its own
    history). Only a test that leaked unreached storages pays for this walk."""
    return any(_saved_modified_in_place(node) for node in _nodes(tensor.grad_fn, limit))


def _saved_modified_in_place(node: Any) -> bool:
    """Whether reading one of the autograd node's saved tensors says it was modified by an
    in-place operation since it was saved."""
    return any(isinstance(error, RuntimeError) and "inplace operation" in str(error)
               for _, error in _saved_values(node))


__all__ = ["kept_by_autograd"]
