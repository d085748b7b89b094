"""``worker-memory``: DataLoader workers whose own memory grows.

A forked worker shares its parent's pages until it writes to them, and reading a Python object
writes its reference count: a dataset kept as Python objects (a list of dicts) is copied page
by page into every worker as it is read, up to the objects' size, and the copies stay
(copy-on-read, pytorch/pytorch#13246). Memory that keeps growing past what the dataset's
objects take is the worker's own leak (a cache filled in ``__getitem__``).
"""

from __future__ import annotations

import itertools
import statistics

from memsentry.model import Finding, ReportData, Severity, Subject, SubjectKind
from memsentry.model.processes import DatasetObjects, DatasetStore, WorkerMemory
from memsentry.rules.registry import rule
from memsentry.units import format_bytes

RULE_ID = "worker-memory"
#: Readings a worker needs before its growth is judged.
MIN_SAMPLES = 3
#: Private growth of all a loader's workers together below which nothing is said.
MIN_TOTAL = 32 * 1024 * 1024
#: A worker that grew past this multiple of the dataset's Python objects (and this many bytes
#: beyond them) holds more than its copy of them, when its ``__getitem__`` adds to an
#: attribute of the dataset (a cache to blame); past ``PAST_OBJECTS_UNSTORED`` times when it
#: adds to none: a copy takes whole pages, and objects built among others (strings formatted
#: in a loop) spread over twice their size of pages (a list of 300,000 path tuples: about
#: 49 MiB of objects, 96 MiB copied by each worker).
PAST_OBJECTS = 1.5
PAST_OBJECTS_UNSTORED = 3.0
PAST_BYTES = 32 * 1024 * 1024


def _growth(worker: WorkerMemory) -> int | None:
    first, last = worker.samples[0].private, worker.samples[-1].private
    return None if first is None or last is None else last - first


#: A worker still grows when the later half of its readings gained this share of all it
#: gained by itself (copy-on-read is front-loaded: a shuffled read touches most pages early),
#: and no step between two readings made more than ``MAX_JUMP`` of that: a jump is one event,
#: such as a full collection of the main process's garbage collector, whose writes to every
#: object leave each worker the only one mapping the old pages; judged from this many
#: readings at least. What it gained by itself counts a step that is an event as a typical
#: one (see ``EVENT_TIMES``), however large the event: a worker of a caching dataset gained
#: 217 MiB in one step beside 125 MiB over its other 32 (a CI run, 2026-11-28).
STILL_GROWING = 1 / 3
MAX_JUMP = 0.5
MIN_SHAPE_SAMPLES = 6
#: A step more than this many times the median of a worker's growing steps (three at least)
#: is one event and not the worker's own growth: the worker's first full collection writes to
#: every object it inherited and copies all their pages at once (70 to 90 MiB in one step
#: between readings that each gained 2 to 15 MiB, in a worker forked from a pytest process
#: that had run other tests). Its own growth, which the verdicts weigh, counts that step as
#: a typical one, the median of its growing steps: the worker went on growing through it.
EVENT_TIMES = 4


def _steps(worker: WorkerMemory) -> list[int]:
    """What the worker's private memory gained from each reading to the next."""
    private = [s.private or 0 for s in worker.samples]
    return [b - a for a, b in itertools.pairwise(private)]


def _typical(steps: list[int]) -> int | None:
    """The median of a worker's growing steps, ``None`` when too few readings tell one."""
    growing = [s for s in steps if s > 0]
    if len(steps) + 1 < MIN_SHAPE_SAMPLES or len(growing) < 3:
        return None
    return int(statistics.median(growing))


def _own_steps(steps: list[int]) -> list[int]:
    """A worker's ``steps``, the largest counted as a typical step when it is an event (see
    ``EVENT_TIMES``)."""
    typical = _typical(steps)
    if typical is None:
        return list(steps)
    largest = max(range(len(steps)), key=steps.__getitem__)
    if steps[largest] <= EVENT_TIMES * typical:
        return list(steps)
    return [typical if i == largest else step for i, step in enumerate(steps)]


def _own_growth(worker: WorkerMemory) -> int:
    """What the worker gained from its first reading to its last (both read: see
    :func:`_loaders`), an event's step counted as a typical one."""
    return sum(_own_steps(_steps(worker)))


def _still_growing(worker: WorkerMemory) -> bool | None:
    """Whether the worker's private memory kept rising, step by step, through its later
    readings; ``None`` with too few readings to tell."""
    if len(worker.samples) < MIN_SHAPE_SAMPLES:
        return None
    own = _own_steps(_steps(worker))
    gained = sum(own)
    if gained <= 0 or max(own) > MAX_JUMP * gained:
        return False
    return sum(own[len(worker.samples) // 2:]) >= STILL_GROWING * gained


def _loaders(report: ReportData) -> dict[int, dict[int, list[WorkerMemory]]]:
    """The workers with readings enough to judge, by loader and by start of its workers."""
    loaders: dict[int, dict[int, list[WorkerMemory]]] = {}
    for worker in report.workers:
        if len(worker.samples) >= MIN_SAMPLES and _growth(worker) is not None:
            loaders.setdefault(worker.loader, {}).setdefault(worker.epoch, []).append(worker)
    return loaders


def _judge(workers: list[WorkerMemory]) -> bool | None:
    """Whether one start of a loader's workers leaked (``True``) or copied what they read
    (``False``); ``None`` when they did not grow enough, or too few readings tell which."""
    growths = [_growth(w) or 0 for w in workers]  # none is None: see _loaders
    if min(growths) <= 0 or sum(growths) < MIN_TOTAL:
        return None
    objects = next((w.objects for w in workers if w.objects is not None), None)
    if objects is not None:
        return _past_objects(workers, objects)
    return _grows_by_itself(workers)


def _grows_by_itself(workers: list[WorkerMemory]) -> bool | None:
    """With nothing a worker could copy on reading: a leak when the workers' own growth (an
    event counted as a typical step) passes ``MIN_TOTAL`` and grows step by step, and no
    verdict otherwise (pages the main process wrote after the fork are its own cost)."""
    if sum(_own_growth(w) for w in workers) < MIN_TOTAL:
        return None
    return True if all(_still_growing(w) for w in workers) else None


def _past_objects(workers: list[WorkerMemory], objects: DatasetObjects) -> bool:
    """Whether the workers grew past what copying the dataset's Python objects explains (the
    most grown of them, by its own growth): ``PAST_OBJECTS`` times them when ``__getitem__``
    adds to an attribute of the dataset (a cache to blame), else ``PAST_OBJECTS_UNSTORED``
    times them and still growing step by step."""
    most = max(_own_growth(w) for w in workers)
    stored = bool(workers[0].stores)
    times = PAST_OBJECTS if stored else PAST_OBJECTS_UNSTORED
    past = most > max(times * objects.bytes, objects.bytes + PAST_BYTES)
    if not past or stored:
        return past
    # Past the objects with no cache to blame: a leak only when it grows step by step. A
    # worker's own full collection writes to every object it inherited and copies the
    # pages of the whole heap at once (183 MiB a worker beside 49 MiB of path tuples, on a
    # loaded machine): that is still what reading the inherited objects cost.
    return all(_still_growing(w) for w in workers)


def _total(workers: list[WorkerMemory]) -> int:
    return sum(_growth(w) or 0 for w in workers)


@rule(RULE_ID, severities={Severity.LEAK, Severity.WASTE})
def worker_memory(report: ReportData) -> list[Finding]:
    """Every worker of a loader gained private memory, ``MIN_TOTAL`` together: up to the
    dataset's Python objects it is their copy-on-read (WASTE); well past them, a leak in the
    workers (LEAK). A loader that starts new workers for each pass over its data gets one
    finding, on its worst start, saying how many of its starts did the same."""
    findings = []
    for starts in (s for _, s in sorted(_loaders(report).items())):
        judged = {epoch: _judge(workers) for epoch, workers in starts.items()}
        leaked = [starts[e] for e, verdict in judged.items() if verdict]
        copied = [starts[e] for e, verdict in judged.items() if verdict is False]
        if leaked:
            findings.append(_leak(max(leaked, key=_total), len(leaked), len(starts)))
        elif copied:
            findings.append(_copy_on_read(max(copied, key=_total), copied, len(starts)))
    return findings


def _who(workers: list[WorkerMemory]) -> str:
    objects = workers[0].objects
    over = (f"`{objects.dataset}` ({workers[0].dataset})"
            if objects is not None and objects.dataset else f"`{workers[0].dataset}`")
    count = f"the {len(workers)} workers" if len(workers) > 1 else "the worker"
    return f"{count} of the DataLoader over {over}"


def _again(copied: list[list[WorkerMemory]], starts: int) -> str:
    """What the other starts of the loader's workers did, when it started them more than
    once (once per pass over its data, without ``persistent_workers``)."""
    if starts < 2:
        return ""
    each = " then ".join(format_bytes(max(_growth(w) or 0 for w in ws)) for ws in copied)
    passes = "every pass" if len(copied) == starts else f"{len(copied)} of them"
    return (f"; the loader started new workers for each of its {starts} passes over the "
            f"data (persistent_workers=False), and in {passes} they copied the pages again "
            f"(each worker up to {each})")


def _copy_on_read(workers: list[WorkerMemory], copied: list[list[WorkerMemory]],
                  starts: int) -> Finding:
    """The WASTE of a start of workers that copied the dataset's Python objects (judged only
    where the dataset keeps some: see :func:`_judge`)."""
    growths = [_growth(w) or 0 for w in workers]
    objects = workers[0].objects
    assert objects is not None
    total = sum(growths)
    message = (
        f"{_who(workers)} each copied up to {format_bytes(max(growths))} of this "
        f"process's memory ({format_bytes(total)} in all) while reading the dataset: "
        f"`{objects.name}` is a {objects.kind} ({objects.items:,} items, about "
        f"{format_bytes(objects.bytes)} of Python objects), and reading a Python object "
        "writes its reference count, so each worker ends up with its own copy of the pages "
        "it read (copy-on-read)"
    )
    message += _again(copied, starts)
    fix = (
        f"keep `{objects.name}` in NumPy arrays or tensors, one per field (numbers in a "
        "numeric array, strings in a fixed-width array or as offsets into one bytes buffer), "
        "or in a memory map (`np.memmap`, Arrow), which workers share without copying; with "
        f"{len(workers)} workers this costs {format_bytes(total)}, and fewer workers cost "
        "less; gc.freeze() just before the loader starts its workers also keeps this "
        "process's garbage collector from unsharing the pages"
    )
    return Finding(rule=RULE_ID, severity=Severity.WASTE, message=message, fix=fix,
                   bytes=total, objects=len(workers),
                   subject=Subject(SubjectKind.HOLDER, objects.name))


def _leak(workers: list[WorkerMemory], leaked: int, starts: int) -> Finding:
    """The LEAK of a start of workers that keep what they make (``leaked`` of the loader's
    ``starts`` starts did the same)."""
    growths = [_growth(w) or 0 for w in workers]
    seconds = max(w.samples[-1].seconds - w.samples[0].seconds for w in workers)
    stores = workers[0].stores
    message = (
        f"{_who(workers)} each grew by up to {format_bytes(max(growths))} of "
        f"private memory in {seconds:.0f} s ({format_bytes(sum(growths))} in all), "
    )
    message += _beyond(workers[0].objects) + ": the workers keep what they make"
    message += _stores_note(stores) + _passes_note(leaked, starts)
    return Finding(rule=RULE_ID, severity=Severity.LEAK, message=message,
                   fix=_leak_fix(stores), bytes=sum(growths), objects=len(workers),
                   subject=Subject(SubjectKind.HOLDER, stores[0].name if stores
                                   else workers[0].dataset),
                   location=stores[0].location if stores else None)


def _beyond(objects: DatasetObjects | None) -> str:
    """Why the growth is more than copy-on-read."""
    if objects is not None:
        return (f"more than a copy of the dataset's Python objects explains "
                f"(`{objects.name}`: about {format_bytes(objects.bytes)} a worker at most)")
    return ("still growing through the later half of the run, and the dataset keeps "
            "no container of Python objects that reading could copy")


def _stores_note(stores: tuple[DatasetStore, ...]) -> str:
    """The attributes of the dataset that ``__getitem__`` adds to, when it adds to some."""
    if not stores:
        return ""
    named = ", ".join(f"`{s.name}` ({s.location})" for s in stores[:3])
    return (f"; `{stores[0].location.function}` adds to {named}, which each worker "
            "fills in its own copy of the dataset")


def _passes_note(leaked: int, starts: int) -> str:
    """How many of the loader's starts of workers grew so, when it started them more than
    once."""
    if starts <= 1:
        return ""
    return (f"; the loader started new workers for each of {starts} passes over its "
            f"data, and those of {leaked} grew so")


def _leak_fix(stores: tuple[DatasetStore, ...]) -> str:
    if stores:
        return (f"drop what `{stores[0].name}` keeps, or bound it (functools.lru_cache("
                "maxsize=...) on a loading function, a dict emptied past a size); to cache "
                "every sample, fill the cache in the main process before the workers start, "
                "as arrays, so that they share it")
    return (
        "look in the dataset's `__getitem__` and the collate function for what they keep "
        "across calls (a cache dict filled per index, tensors appended to an attribute); "
        "each worker has its own copy of the dataset object, so such a cache grows in "
        "every worker and is never seen by the main process"
    )
