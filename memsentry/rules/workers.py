"""``worker-memory``: DataLoader workers whose own memory grows.

A forked worker shares its parent's pages until it writes to them, and reading a Python object
writes its reference count: a dataset kept as Python objects (a list of dicts) is copied page
by page into every worker as it is read, up to the objects' size, and the copies stay
(copy-on-read, pytorch/pytorch#13246). Memory that keeps growing past what the dataset's
objects take is the worker's own leak (a cache filled in ``__getitem__``).
"""

from __future__ import annotations

from memsentry.model import Finding, ReportData, Severity, Subject, SubjectKind
from memsentry.model.processes import WorkerMemory
from memsentry.rules.registry import rule
from memsentry.units import format_bytes

RULE_ID = "worker-memory"
#: Readings a worker needs before its growth is judged.
MIN_SAMPLES = 3
#: Private growth of all a loader's workers together below which nothing is said.
MIN_TOTAL = 32 * 1024 * 1024
#: A worker that grew past this multiple of the dataset's Python objects (and this many bytes
#: beyond them) holds more than its copy of them.
PAST_OBJECTS = 1.5
PAST_BYTES = 32 * 1024 * 1024


def _growth(worker: WorkerMemory) -> int | None:
    first, last = worker.samples[0].private, worker.samples[-1].private
    return None if first is None or last is None else last - first


#: A worker still grows when the later half of its readings gained this share of all it
#: gained (copy-on-read is front-loaded: a shuffled read touches most pages early); judged
#: from this many readings at least.
STILL_GROWING = 1 / 3
MIN_SHAPE_SAMPLES = 6


def _still_growing(worker: WorkerMemory) -> bool | None:
    """Whether the worker's private memory kept rising through its later readings; ``None``
    with too few readings to tell."""
    samples = worker.samples
    if len(samples) < MIN_SHAPE_SAMPLES:
        return None
    first, middle, last = samples[0], samples[len(samples) // 2], samples[-1]
    total = (last.private or 0) - (first.private or 0)
    return total > 0 and (last.private or 0) - (middle.private or 0) >= STILL_GROWING * total


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
        return max(growths) > max(PAST_OBJECTS * objects.bytes, objects.bytes + PAST_BYTES)
    # Nothing a worker could copy on reading: judged by whether it still grows.
    shapes = [_still_growing(w) for w in workers]
    if any(shape is None for shape in shapes):
        return None  # too few readings to tell a leak from a copy
    return all(shapes)


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
    over = (f"`{objects.name.rpartition('.')[0]}` ({workers[0].dataset})"
            if objects is not None and "." in objects.name else f"`{workers[0].dataset}`")
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
    growths = [_growth(w) or 0 for w in workers]
    objects = workers[0].objects
    total = sum(growths)
    message = (
        f"{_who(workers)} each copied up to {format_bytes(max(growths))} of this "
        f"process's memory ({format_bytes(total)} in all) while reading the dataset"
    )
    if objects is not None:
        message += (
            f": `{objects.name}` is a {objects.kind} ({objects.items:,} items, about "
            f"{format_bytes(objects.bytes)} of Python objects), and reading a Python object "
            "writes its reference count, so each worker ends up with its own copy of the "
            "pages it read (copy-on-read)"
        )
        where = f"`{objects.name}`"
    else:
        message += (": reading a Python object writes its reference count, so each worker "
                    "copies the pages of the dataset's objects it reads (copy-on-read)")
        where = "the dataset's samples"
    message += _again(copied, starts)
    fix = (
        f"keep {where} in NumPy arrays or tensors, one per field (numbers in a numeric "
        "array, strings in a fixed-width array or as offsets into one bytes buffer), or in "
        "a memory map (`np.memmap`, Arrow), which workers share without copying; with "
        f"{len(workers)} workers this costs {format_bytes(total)}, and fewer workers "
        "cost less"
    )
    return Finding(rule=RULE_ID, severity=Severity.WASTE, message=message, fix=fix,
                   bytes=total, objects=len(workers),
                   subject=Subject(SubjectKind.HOLDER, objects.name if objects else
                                   workers[0].dataset))


def _leak(workers: list[WorkerMemory], leaked: int, starts: int) -> Finding:
    growths = [_growth(w) or 0 for w in workers]
    objects = workers[0].objects
    seconds = max(w.samples[-1].seconds - w.samples[0].seconds for w in workers)
    message = (
        f"{_who(workers)} each grew by up to {format_bytes(max(growths))} of "
        f"private memory in {seconds:.0f} s ({format_bytes(sum(growths))} in all), "
    )
    if objects is not None:
        message += (f"more than a copy of the dataset's Python objects would take "
                    f"(`{objects.name}`, about {format_bytes(objects.bytes)})")
    else:
        message += ("still growing through the later half of the run, and the dataset keeps "
                    "no container of Python objects that reading could copy")
    message += ": the workers keep what they make"
    if starts > 1:
        message += (f"; the loader started new workers for each of {starts} passes over its "
                    f"data, and those of {leaked} grew so")
    fix = (
        "look in the dataset's `__getitem__` and the collate function for what they keep "
        "across calls (a cache dict filled per index, tensors appended to an attribute); "
        "each worker has its own copy of the dataset object, so such a cache grows in "
        "every worker and is never seen by the main process"
    )
    return Finding(rule=RULE_ID, severity=Severity.LEAK, message=message, fix=fix,
                   bytes=sum(growths), objects=len(workers),
                   subject=Subject(SubjectKind.HOLDER, workers[0].dataset))
