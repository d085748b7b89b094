"""Garbage: what only reference cycles keep, found by a collection the census runs itself."""

from __future__ import annotations

import collections
import gc
from collections.abc import Callable

import torch

from memsentry.census.tally import storage_key
from memsentry.model import GarbageStats
from memsentry.usercode.frames import is_user_class

_GENERIC = frozenset({"dict", "list", "tuple", "cell", "function", "method", "set", "Tensor",
                      "Parameter", "frame", "builtin_function_or_method", "weakref",
                      "ReferenceType", "getset_descriptor", "staticmethod"})


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
    flags = gc.get_debug()
    start = len(gc.garbage)
    gc.set_debug(flags | gc.DEBUG_SAVEALL)
    try:
        gc.collect(2 if everything else 1)
    finally:
        gc.set_debug(flags)
    found = gc.garbage[start:]
    del gc.garbage[start:]
    counts: collections.Counter[str] = collections.Counter()
    users: set[str] = set()
    tensors = size = 0
    storages: set[tuple[str, int]] = set()
    for obj in found:
        # By type, never isinstance(): a weakref.proxy answers isinstance() for its referent,
        # and one whose referent died raises ReferenceError (Lightning keeps such proxies).
        if issubclass(type(obj), torch.Tensor):
            tensors += 1
            key = storage_key(obj)
            if key is not None and key[0] not in storages:
                storages.add(key[0])
                size += key[1]
        name = type(obj).__qualname__
        counts[name] += 1
        if name not in users and is_user_class(type(obj)):
            users.add(name)
    objects = len(found)
    found.clear()
    del found
    if tensors:  # a full collection (0.4 s beside torch's 170,000 objects here) frees them
        gc.collect()
    freed = max(0, before - sample())
    # The user's own classes first (the cycle's likely author), then library types.
    ranked = counts.most_common()
    named = [(t, n) for t, n in ranked if t in users]
    named += [(t, n) for t, n in ranked if t not in users and t not in _GENERIC]
    named += [(t, n) for t, n in ranked if t in _GENERIC]
    return GarbageStats(
        objects=objects, tensors=tensors, bytes=size, freed=freed, types=tuple(named[:6]),
        gc_enabled=gc.isenabled(), full_collections=full_collections, full_freed=full_freed,
    )
