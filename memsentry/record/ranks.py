"""Runs in a ``torch.distributed`` process group: which rank this is, and handing each rank's
report to rank 0 at the end.

Nothing here is a collective. Each rank writes its report, as JSON, to the process group's
own key-value store (the one ``init_process_group`` rendezvoused through) under a key for
this tracked block, and only rank 0 reads: it waits for each other rank's key until one
deadline, so a rank that left the block early, raised or died costs rank 0 the timeout at
most and never hangs a rank. Ranks number their tracked blocks in the same order, so the
n-th block of each rank meets the n-th of the others.
"""

from __future__ import annotations

import datetime
import itertools
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

#: Keys in the process group's store: memsentry/<block>/<rank>.
PREFIX = "memsentry"

_blocks = itertools.count()


@dataclass(frozen=True)
class RankInfo:
    """This process's place in a process group."""

    rank: int
    world_size: int
    host: str


def _dist() -> Any:
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    return dist if dist.is_available() else None


def rank_info() -> RankInfo | None:
    """The rank, world size and host of this process in an initialised process group (or,
    between ``torchrun``'s start and ``init_process_group``, as its environment says);
    ``None`` outside one."""
    dist = _dist()
    host = socket.gethostname()
    if dist is not None and dist.is_initialized():
        remember_store()
        return RankInfo(dist.get_rank(), dist.get_world_size(), host)
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    return RankInfo(rank, world, host)


class _Stores:
    """The process group's store, remembered when first seen: a script may destroy its
    process group before the tracked block ends (``memsentry run`` stops after the script),
    and the store object stays usable while referenced."""

    def __init__(self) -> None:
        self.seen: Any = None

    def current(self) -> Any:
        dist = _dist()
        if dist is not None and dist.is_initialized():
            try:
                self.seen = dist.distributed_c10d._get_default_store()
            except (AttributeError, RuntimeError, ValueError):
                pass
        return self.seen


STORES = _Stores()


def remember_store() -> None:
    """Note the process group's store, if there is one now (cheap: called every iteration)."""
    if STORES.seen is None:
        STORES.current()


def _store() -> Any:
    return STORES.current()


def share(info: RankInfo, payload: str, timeout: float) -> list[str | None] | None:
    """Put this rank's ``payload`` where rank 0 reads it. On rank 0, every rank's payload in
    rank order (``None`` for a rank that did not write within ``timeout`` seconds); on the
    others, ``None``. Also ``None`` where the process group has no store to use."""
    store = _store()
    if store is None:
        return None
    block = next(_blocks)
    key = f"{PREFIX}/{block}/{{}}"
    store.set(key.format(info.rank), payload)
    if info.rank != 0:
        return None
    found: list[str | None] = [payload]
    deadline = time.monotonic() + timeout
    for rank in range(1, info.world_size):
        left = max(0.0, deadline - time.monotonic())
        try:
            store.wait([key.format(rank)], datetime.timedelta(seconds=max(left, 0.001)))
            found.append(store.get(key.format(rank)).decode("utf-8"))
        except (RuntimeError, TimeoutError, ValueError):  # not written in time
            found.append(None)
    for rank in range(info.world_size):  # the store outlives the block: leave it clean
        try:
            store.delete_key(key.format(rank))
        except (RuntimeError, AttributeError, ValueError):
            pass
    return found


__all__ = ["STORES", "RankInfo", "rank_info", "remember_store", "share"]
