"""Runs in a ``torch.distributed`` process group: which rank this is, and handing each rank's
report to rank 0 at the end.

Nothing here is a collective. Each rank says in the process group's own key-value store (the
one ``init_process_group`` rendezvoused through) that it tracks the block, as soon as there
is a store, and writes its report there, as JSON, at the end; only rank 0 reads. It waits for
the reports of the ranks that said they track the block until one deadline, so a rank that
left the block early, raised or died costs rank 0 the timeout at most and never hangs a rank,
and a rank that tracks nothing (tracking on rank 0 only) costs it a grace of 2 seconds. Ranks
number their tracked blocks in the same order, so the n-th block of each rank meets the n-th
of the others.

Rank 0 looks for the reports every 50 ms and sleeps in between, so that a signal handler
runs while it waits (python runs none during a blocking wait on the store); a handler that
learns the job is being stopped calls :func:`hurry`, which brings the deadline closer: rank 0
then combines the reports that came and names the ranks whose did not.
"""

from __future__ import annotations

import datetime
import itertools
import os
import socket
import time
from collections.abc import Callable
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
        return RankInfo(dist.get_rank(), dist.get_world_size(), host)
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    return RankInfo(rank, world, host)


class _Handoff:
    """The process group's store, remembered when first seen (a script may destroy its process
    group before the tracked block ends, and the store object stays usable while referenced),
    and the tracked block running: its number, and whether this rank told the store that it
    tracks it (rank 0 waits only for ranks that did)."""

    def __init__(self) -> None:
        self.store: Any = None
        self.block: int | None = None
        self.announced = False
        #: The monotonic time by which a hurried wait ends (:func:`hurry`), and the seconds
        #: the last wait allowed.
        self.hurried: float | None = None
        self.allowed: float | None = None
        #: Called with this rank and its report (JSON) before the report is handed over and
        #: rank 0 waits for the others: ``memsentry run`` saves each rank's own there first.
        self.keep: Callable[[int, str], None] | None = None

    def current(self) -> Any:
        dist = _dist()
        if dist is not None and dist.is_initialized():
            try:
                self.store = dist.distributed_c10d._get_default_store()
            except (AttributeError, RuntimeError, ValueError):
                pass
        return self.store

    def begin(self) -> None:
        """A tracked block begins."""
        self.block, self.announced = next(_blocks), False
        self.hurried = self.allowed = None
        self.announce()

    def announce(self) -> None:
        """Tell the store this rank tracks the running block, once the store exists."""
        if self.announced or self.block is None:
            return
        store = self.store if self.store is not None else self.current()
        info = rank_info()
        if store is None or info is None:
            return
        try:
            store.set(_key(self.block, info.rank, "tracking"), "1")
            self.announced = True
        except (RuntimeError, ValueError):
            pass


def _key(block: int, rank: int, what: str) -> str:
    return f"{PREFIX}/{block}/{rank}/{what}"


HANDOFF = _Handoff()
#: Seconds rank 0 gives a rank that has not said it tracks the block to say so.
GRACE = 2.0
#: Seconds between two looks in the store for a rank's report: python runs signal
#: handlers meanwhile.
POLL = 0.05


def begin_block() -> None:
    """A tracked block begins (``Tracker.start``)."""
    HANDOFF.begin()


def remember_store() -> None:
    """Note the process group's store, and say this rank tracks the block, if there is a
    process group now (cheap: called every iteration)."""
    if not HANDOFF.announced and HANDOFF.block is not None:
        dist = _dist()
        if dist is not None and dist.is_initialized():  # the store exists only then
            HANDOFF.current()
            HANDOFF.announce()


def hurry(seconds: float) -> None:
    """End rank 0's wait for the other ranks' reports (the one running, or the next) within
    ``seconds`` from now: the job is being stopped (a signal handler calls it)."""
    until = time.monotonic() + seconds
    HANDOFF.hurried = until if HANDOFF.hurried is None else min(HANDOFF.hurried, until)


def gather_limit(timeout: float) -> float:
    """The seconds rank 0's last wait allowed: ``timeout``, or less where it was hurried."""
    return timeout if HANDOFF.allowed is None else min(timeout, HANDOFF.allowed)


def _until(deadline: float) -> float:
    return deadline if HANDOFF.hurried is None else min(deadline, HANDOFF.hurried)


def _arrived(store: Any, key: str, deadline: float) -> bool:
    """Whether ``key`` is in the store by the monotonic time ``deadline`` (or a hurried
    one), looked for every :data:`POLL` seconds."""
    while True:
        pause = max(min(_until(deadline) - time.monotonic(), POLL), 0.0)
        if _present(store, key, pause):
            return True
        if _until(deadline) - time.monotonic() <= 0:
            return False


def _present(store: Any, key: str, pause: float) -> bool:
    """Whether ``key`` is in the store, taking ``pause`` seconds when it is not: a check,
    then a sleep (which a signal interrupts; a store's timed-out wait would also log a
    warning each time), or, for a store without ``check``, a wait that long."""
    try:
        found = bool(store.check([key]))
    except (AttributeError, RuntimeError, ValueError):
        started = time.monotonic()
        try:
            store.wait([key], datetime.timedelta(seconds=max(pause, 0.001)))
            return True
        except (RuntimeError, TimeoutError, ValueError):  # not written in time, or broken
            time.sleep(max(pause - (time.monotonic() - started), 0.0))
            return False
    if not found:
        time.sleep(pause)
    return found


def share(info: RankInfo, payload: str, timeout: float) -> list[str | None] | None:
    """Put this rank's ``payload`` where rank 0 reads it. On rank 0, every rank's payload in
    rank order (``None`` for a rank that did not write within ``timeout`` seconds, or that
    does not track this block: one that has not said so within :data:`GRACE` seconds); on
    the others, ``None``. Also ``None`` where the process group has no store to use."""
    remember_store()
    store, block = HANDOFF.store, HANDOFF.block
    HANDOFF.block = None
    if store is None or block is None:
        return None
    _keep(info.rank, payload)
    store.set(_key(block, info.rank, "report"), payload)
    if info.rank != 0:
        return None
    found = _gather(store, block, info.world_size, payload, timeout)
    _clean(store, block, info.world_size)  # the store outlives the block: leave it clean
    return found


def _keep(rank: int, payload: str) -> None:
    """Hand this rank's report to the keeper, if there is one (:attr:`_Handoff.keep`)."""
    if HANDOFF.keep is not None:
        try:
            HANDOFF.keep(rank, payload)
        except Exception:  # saving it is the keeper's business: the handoff goes on
            pass


def _gather(store: Any, block: int, world_size: int, payload: str, timeout: float
            ) -> list[str | None]:
    """On rank 0: its own ``payload`` and the other ranks' reports, each read where its rank
    said it tracks the block and the report came by the deadline (``None`` where not); notes
    the seconds a hurried wait allowed."""
    found: list[str | None] = [payload]
    started = time.monotonic()
    deadline = started + timeout
    for rank in range(1, world_size):
        tracking = _arrived(store, _key(block, rank, "tracking"),
                            min(time.monotonic() + GRACE, deadline))
        report = _key(block, rank, "report")
        found.append(store.get(report).decode("utf-8")
                     if tracking and _arrived(store, report, deadline) else None)
    if HANDOFF.hurried is not None:
        HANDOFF.allowed = round(max(_until(deadline) - started, 0.0), 1)
    return found


def _clean(store: Any, block: int, world_size: int) -> None:
    """Delete every rank's keys of ``block`` from the store, where it lets memsentry."""
    for rank in range(world_size):
        for what in ("tracking", "report"):
            try:
                store.delete_key(_key(block, rank, what))
            except (RuntimeError, AttributeError, ValueError):
                pass


__all__ = ["GRACE", "HANDOFF", "POLL", "RankInfo", "begin_block", "gather_limit", "hurry",
           "rank_info", "remember_store", "share"]
