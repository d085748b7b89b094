"""Garbage: what only reference cycles keep, found by a collection the census runs itself."""

from __future__ import annotations

import collections
import gc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from memsentry.census.tally import storage_key
from memsentry.model import GarbageStats
from memsentry.usercode.frames import is_user_class

_GENERIC = frozenset({"dict", "list", "tuple", "cell", "function", "method", "set", "Tensor",
                      "Parameter", "frame", "builtin_function_or_method", "weakref",
                      "ReferenceType", "getset_descriptor", "staticmethod"})


@dataclass
class _Found:
    """What a collection found, counted as it is looked through: the tensors and the bytes of
    their storages (each once), how many objects of each type, and which of those types are
    the user's classes."""

    tensors: int = 0
    bytes: int = 0
    storages: set[tuple[str, int]] = field(default_factory=set)
    counts: collections.Counter[str] = field(default_factory=collections.Counter)
    users: set[str] = field(default_factory=set)

    def add(self, obj: Any) -> None:
        # By type, never isinstance(): a weakref.proxy answers isinstance() for its referent,
        # and one whose referent died raises ReferenceError (Lightning keeps such proxies).
        if issubclass(type(obj), torch.Tensor):
            self._add_tensor(obj)
        name = type(obj).__qualname__
        self.counts[name] += 1
        if name not in self.users and is_user_class(type(obj)):
            self.users.add(name)

    def _add_tensor(self, tensor: torch.Tensor) -> None:
        self.tensors += 1
        key = storage_key(tensor)
        if key is None:
            return
        storage, size = key
        if storage not in self.storages:
            self.storages.add(storage)
            self.bytes += size

    def ranked_types(self) -> list[tuple[str, int]]:
        """The types found, most first: the user's own classes (the cycle's likely author),
        then library types, then the generic ones (dicts, lists, tensors...)."""
        ranked = self.counts.most_common()
        named = [(t, n) for t, n in ranked if t in self.users]
        named += [(t, n) for t, n in ranked if t not in self.users and t not in _GENERIC]
        named += [(t, n) for t, n in ranked if t in _GENERIC]
        return named


def _collect_saving(everything: bool) -> list[Any]:
    """Collect the two young generations (all of them when ``everything``) with
    ``gc.DEBUG_SAVEALL``, and take what the collection found out of ``gc.garbage``."""
    flags = gc.get_debug()
    start = len(gc.garbage)
    gc.set_debug(flags | gc.DEBUG_SAVEALL)
    try:
        gc.collect(2 if everything else 1)
    finally:
        gc.set_debug(flags)
    found = gc.garbage[start:]
    del gc.garbage[start:]
    return found


def _seen(found: list[object]) -> _Found:
    """What ``found`` holds, counted."""
    seen = _Found()
    for obj in found:
        seen.add(obj)
    return seen


def garbage_census(sample: Callable[[], int], full_collections: int = 0,
                   full_freed: int = 0, *, everything: bool = False) -> GarbageStats:
    """Collect the two young generations (all of them when ``everything``), keeping what the
    collection finds long enough to name it.

    ``gc.DEBUG_SAVEALL`` parks the unreachable objects in ``gc.garbage`` (finalisers and weakref
    callbacks have run, as in a normal collection) and moves them to the oldest generation.
    After counting, they are released and, when tensors were among them, a full collection
    frees them for real: the costly step, paid only when cycles own tensors (other garbage
    goes at the interpreter's next full collection, as any object it promotes does). A cycle
    still alive at one census is promoted out of the young generations by then, so once
    cycles owning tensors were seen the tracker asks for ``everything``. ``sample`` reads
    allocated memory, to measure what was freed.
    """
    before = sample()
    found = _collect_saving(everything)
    seen = _seen(found)  # in a function: no loop variable keeps the last object alive
    objects = len(found)
    found.clear()
    del found
    if seen.tensors:  # a full collection (0.4 s beside torch's 170,000 objects here) frees them
        gc.collect()
    freed = max(0, before - sample())
    return GarbageStats(
        objects=objects, tensors=seen.tensors, bytes=seen.bytes, freed=freed,
        types=tuple(seen.ranked_types()[:6]), gc_enabled=gc.isenabled(),
        full_collections=full_collections, full_freed=full_freed,
    )
