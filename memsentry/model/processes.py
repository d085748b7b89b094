"""Processes as the operating system counts their memory: the tracked process itself and the
DataLoader worker processes started while tracking."""

from __future__ import annotations

from dataclasses import dataclass

from memsentry.model.places import Location


@dataclass(frozen=True)
class ProcessSample:
    """One reading of a process's memory, ``seconds`` after tracking began. ``rss`` is its
    resident memory; ``pss`` its proportional share (each shared page divided among the
    processes that map it) and ``private`` the pages only it maps, clean or dirty (for a
    forked worker: what it copied from its parent, or made itself); both ``None`` where the
    system does not say (no ``/proc/<pid>/smaps_rollup``)."""

    seconds: float
    rss: int
    pss: int | None = None
    private: int | None = None


@dataclass(frozen=True)
class DatasetObjects:
    """The largest container of Python objects a loader's dataset keeps: ``name`` spells it as
    the code does (``train_set.records``), ``kind`` is its type and what it holds (``list of
    dict``), ``items`` its length and ``bytes`` the Python objects' size, estimated from a
    sample of its items (what a worker copies by reading them all); ``dataset`` spells the
    dataset itself (``train_set``)."""

    name: str
    kind: str
    items: int
    bytes: int
    dataset: str = ""


@dataclass(frozen=True)
class DatasetStore:
    """An attribute of a dataset that its ``__getitem__`` adds to (``self.cache[index] =
    sample``): ``name`` as the code spells it (``self.cache``) and ``location`` the first line
    that adds to it. Each worker fills its own copy of the dataset, unseen by the main
    process."""

    name: str
    location: Location


@dataclass(frozen=True)
class WorkerMemory:
    """A DataLoader worker process followed while tracking: its ``pid``, its ``worker`` id in
    its loader, ``loader`` the number of its loader (1 for the first one memsentry saw fetch a
    batch; the loaders over one dataset object count as one), ``dataset`` the dataset's class
    name, and its ``samples`` in time order (the last one taken when it ended or when tracking
    stopped); ``objects`` the dataset's largest container of Python objects, when it has
    one; ``epoch`` which start of the loader's workers it belongs to (a loader without
    ``persistent_workers`` starts new ones for each pass over its data: 2 is the second
    pass's); ``stores`` the attributes its dataset's ``__getitem__`` adds to."""

    pid: int
    worker: int
    loader: int
    dataset: str
    samples: tuple[ProcessSample, ...] = ()
    objects: DatasetObjects | None = None
    epoch: int = 1
    stores: tuple[DatasetStore, ...] = ()


@dataclass(frozen=True)
class PinnedMemory:
    """Page-locked host memory held by PyTorch's pinned-memory allocator (batches a
    ``DataLoader(pin_memory=True)`` pinned, ``tensor.pin_memory()``, copies to the host with
    ``non_blocking=True``), read when tracking stopped: ``held`` the bytes of the blocks it owns,
    handed out or cached for reuse; ``in_use`` those handed out (``None`` where torch's count
    of them cannot be right: torch 2.11 on an H100 counted 1.3 MiB in use of 128 KiB held after
    20 batches copied with ``non_blocking=True``, the blocks given back after a copy's event
    never subtracted); ``peak`` the most it held; ``blocks`` how many blocks it holds. Each
    request is rounded up to a power of two, and these are the rounded sizes. The system cannot
    swap these pages out; they count in the process's resident memory, not in the device's."""

    held: int
    in_use: int | None
    peak: int
    blocks: int
