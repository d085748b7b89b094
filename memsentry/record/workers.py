"""DataLoader worker processes followed while any tracker runs: each worker of a loader that
fetches through :mod:`memsentry.record.batches`, and the tracked process itself, read on a
schedule as the operating system counts them (:func:`memsentry.measure.processes.read_process`).

Readings are taken in the thread that fetches batches, right after a fetch, at most once per
:data:`MIN_INTERVAL` seconds and never more often than keeps their cost under :data:`SHARE` of
the time between them: no thread of memsentry's runs while the loader forks its workers.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import types
import weakref
from dataclasses import dataclass, field
from typing import Any

from memsentry.census.datasets import dataset_objects
from memsentry.measure.processes import read_process, read_resident
from memsentry.model.processes import DatasetObjects, DatasetStore, ProcessSample, WorkerMemory
from memsentry.usercode.stores import dataset_stores

#: Seconds between two rounds of readings, at least.
MIN_INTERVAL = 1.0
#: The share of the time between rounds a round may cost (a slow read widens the interval).
SHARE = 0.02
#: Readings kept per process; past it every other one is dropped (the first and last stay).
MAX_SAMPLES = 512


@dataclass
class _Process:
    pid: int
    worker: int
    loader: int
    dataset: str
    epoch: int = 1
    objects: DatasetObjects | None = None
    stores: tuple[DatasetStore, ...] = ()
    samples: list[tuple[float, int, int | None, int | None]] = field(default_factory=list)
    ended: bool = False

    def read(self, now: float, *, resident_only: bool = False) -> None:
        memory = read_resident(self.pid) if resident_only else read_process(self.pid)
        if memory is None:
            self.ended = True
            return
        self.samples.append((now, *memory))
        if len(self.samples) > MAX_SAMPLES:
            last = self.samples[-1]
            self.samples = [*self.samples[:-1:2], last]


_lock = threading.Lock()
_loaders: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_workers: dict[int, _Process] = {}
#: Per dataset (by id, with a weak reference where it takes one, to tell a new object that
#: reuses an id): its loader's number and the worker sets started for it so far.
_datasets: dict[int, tuple[Any, int, int]] = {}
_main = _Process(os.getpid(), -1, 0, "")
_due = 0.0  # when the next round of readings is due (time.perf_counter())
_spent = 0.0  # seconds all rounds of readings took (charged to the trackers' budgets)
_counted = 0  # loaders numbered (one per dataset)


def reset() -> None:
    """Forget every process followed before (the first tracker starts)."""
    global _main, _due, _counted
    with _lock:
        _loaders.clear()
        _workers.clear()
        _datasets.clear()
        _main = _Process(os.getpid(), -1, 0, "")
        _due, _counted = 0.0, 0


def starting(iterator: Any) -> None:
    """A loader's iterator is about to fetch a batch: a new one's workers are followed from
    now and read at once, their baseline, before they have read much of the dataset (they
    started when the iterator was made, a moment ago)."""
    if iterator not in _loaders:
        _follow(iterator, sys._getframe(1))  # the fetch's frame: the loop's are outside it
        sample()


def fetched(iterator: Any) -> None:
    """A loader's iterator fetched a batch (:func:`starting` followed it before): a round of
    readings is taken when one is due, and at the epoch's last batch (workers that do not
    persist are shut down before the loop sees the epoch end)."""
    if time.perf_counter() >= _due or _last_batch(iterator):
        sample()


def _last_batch(iterator: Any) -> bool:
    try:
        return int(iterator._num_yielded) >= len(iterator) - 1
    except (TypeError, AttributeError, ValueError):  # an iterable dataset has no length
        return False


def _follow(iterator: Any, frame: types.FrameType) -> None:
    dataset = getattr(iterator, "_dataset", None)
    try:
        objects = dataset_objects(dataset, frame)
    except Exception:  # a dataset whose attributes cannot be read: named by its class only
        objects = None
    stores = tuple(DatasetStore(name, line) for name, line in dataset_stores(dataset))
    with _lock:
        number, epoch = _number(dataset)
        _loaders[iterator] = number
        for index, worker in enumerate(getattr(iterator, "_workers", ()) or ()):
            pid = getattr(worker, "pid", None)
            if isinstance(pid, int) and pid not in _workers:
                _workers[pid] = _Process(pid, index, number, type(dataset).__name__, epoch,
                                         objects, stores)


def _number(dataset: Any) -> tuple[int, int]:
    """(the loader's number, which start of its workers this is): one number per dataset,
    so the workers a loader starts anew each epoch are told as that loader's."""
    global _counted
    key = id(dataset)
    known = _datasets.get(key)
    if known is not None and (known[0] is None or known[0]() is dataset):
        ref, number, starts = known
        _datasets[key] = (ref, number, starts + 1)
        return number, starts + 1
    try:
        ref = weakref.ref(dataset)
    except TypeError:  # no weak reference: the id alone tells it
        ref = None
    _counted += 1
    _datasets[key] = (ref, _counted, 1)
    return _counted, 1


def sample(*, charged: bool = True) -> None:
    """One round of readings: the tracked process and every worker still running.
    ``charged``: its seconds count in :func:`reading_seconds`, which trackers charge to their
    budgets; the readings as tracking begins and ends are not (they are outside the loop's
    iterations, and their real time would reach a policy that runs on a test's fake clock)."""
    global _due, _spent
    began = time.perf_counter()
    with _lock:
        if _main.pid != os.getpid():  # a forked child that tracks on its own
            return
        _main.read(began, resident_only=True)  # the largest process: its rollup is slow
        for process in list(_workers.values()):
            if not process.ended:
                process.read(began)
    spent = time.perf_counter() - began
    _due = began + max(MIN_INTERVAL, spent / SHARE)
    if charged:
        _spent += spent


def reading_seconds() -> float:
    """Seconds every round of readings took so far in this process: a tracker charges what
    it grew by since its last look to its budget (the readings run inside batch fetches,
    within its iterations' time)."""
    return _spent


def _samples(process: _Process, since: float) -> tuple[ProcessSample, ...]:
    return tuple(ProcessSample(at - since, rss, pss, private)
                 for at, rss, pss, private in process.samples if at >= since)


def recorded(since: float) -> tuple[tuple[WorkerMemory, ...], tuple[ProcessSample, ...]]:
    """The workers followed and the tracked process's readings from ``since`` on
    (``time.perf_counter()`` when a tracker started), times counted from then."""
    with _lock:
        workers = tuple(
            WorkerMemory(p.pid, p.worker, p.loader, p.dataset, _samples(p, since), p.objects,
                         p.epoch, p.stores)
            for p in _workers.values() if any(at >= since for at, *_ in p.samples))
        return workers, _samples(_main, since)
