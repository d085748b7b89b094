"""Naming leaked storages that no Python object holds: a reference cycle inside autograd's
C++ graph keeps them, out of the reach of ``gc.collect()`` and of the holder search."""

from __future__ import annotations

import gc
from dataclasses import replace
from types import FrameType

import torch

from pytest_memsentry.results import AUTOGRAD_CYCLE, LeakedTensor


def kept_by_autograd(tensors: list[LeakedTensor], unreached: list[int],
                      pointers: list[int]) -> list[LeakedTensor]:
    """Name the leaked storages that no Python object holds but a tensor of autograd's graph:
    an in-place op on a tensor that requires grad (``a += a * y``, a slice assigned into a
    non-leaf) can make a reference cycle inside autograd's C++ graph (tensor -> grad_fn ->
    saved tensor), which ``gc.collect()`` cannot see or free. Such a tensor is alive, has a
    ``grad_fn`` and no Python referrer. One scan of the collector's objects, only for a test
    that leaked something the holder search did not reach."""
    wanted = {pointers[i]: i for i in unreached}
    matches: list[torch.Tensor] = []
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and _storage(obj) in wanted:
            matches.append(obj)
    cycles = set()
    for tensor in matches:
        if tensor.grad_fn is not None and not any(
                referrer is not matches and not isinstance(referrer, FrameType)
                for referrer in gc.get_referrers(tensor)):
            cycles.add(_storage(tensor))
    matches.clear()
    out = list(tensors)
    for key in cycles:
        out[wanted[key]] = replace(out[wanted[key]], holder=AUTOGRAD_CYCLE, grad_fn=True)
    return out


def _storage(tensor: torch.Tensor) -> int:
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


__all__ = ["kept_by_autograd"]
