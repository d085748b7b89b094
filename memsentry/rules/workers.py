"""``worker-memory``: DataLoader workers whose own memory grows.

A forked worker shares its parent's pages until it writes to them, and reading a Python object
writes its reference count: a dataset kept as Python objects (a list of dicts) is copied page
by page into every worker as it is read, up to the objects' size, and the copies stay
(copy-on-read, pytorch/pytorch#13246). Memory that keeps growing past what the dataset's
objects take is the worker's own leak (a cache filled in ``__getitem__``).
"""

from __future__ import annotations

from memsentry.model import Finding, ReportData, Severity, Subject, SubjectKind
from memsentry.model.processes import DatasetObjects, WorkerMemory
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


def _loaders(report: ReportData) -> dict[int, list[WorkerMemory]]:
    loaders: dict[int, list[WorkerMemory]] = {}
    for worker in report.workers:
        if len(worker.samples) >= MIN_SAMPLES and _growth(worker) is not None:
            loaders.setdefault(worker.loader, []).append(worker)
    return loaders


@rule(RULE_ID, severities={Severity.LEAK, Severity.WASTE})
def worker_memory(report: ReportData) -> list[Finding]:
    """Every worker of a loader gained private memory, ``MIN_TOTAL`` together: up to the
    dataset's Python objects it is their copy-on-read (WASTE); well past them, a leak in the
    workers (LEAK)."""
    findings = []
    for number, workers in sorted(_loaders(report).items()):
        growths = [_growth(w) or 0 for w in workers]  # none is None: see _loaders
        if min(growths) <= 0 or sum(growths) < MIN_TOTAL:
            continue
        objects = next((w.objects for w in workers if w.objects is not None), None)
        each = max(growths)
        if objects is not None:
            past = each > max(PAST_OBJECTS * objects.bytes, objects.bytes + PAST_BYTES)
        else:  # nothing a worker could copy on reading: judged by whether it still grows
            shapes = [_still_growing(w) for w in workers]
            if any(shape is None for shape in shapes):
                continue  # too few readings to tell a leak from a copy
            past = all(shapes)
        if past:
            findings.append(_leak(number, workers, growths, objects))
        else:
            findings.append(_copy_on_read(number, workers, growths, objects))
    return findings


def _who(number: int, workers: list[WorkerMemory]) -> str:
    return (f"the {len(workers)} workers of DataLoader {number} (`{workers[0].dataset}`)"
            if len(workers) > 1 else f"the worker of DataLoader {number} "
            f"(`{workers[0].dataset}`)")


def _copy_on_read(number: int, workers: list[WorkerMemory], growths: list[int],
                  objects: DatasetObjects | None) -> Finding:
    total = sum(growths)
    message = (
        f"{_who(number, workers)} each copied up to {format_bytes(max(growths))} of this "
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


def _leak(number: int, workers: list[WorkerMemory], growths: list[int],
          objects: DatasetObjects | None) -> Finding:
    seconds = max(w.samples[-1].seconds - w.samples[0].seconds for w in workers)
    message = (
        f"{_who(number, workers)} each grew by up to {format_bytes(max(growths))} of "
        f"private memory in {seconds:.0f} s ({format_bytes(sum(growths))} in all), "
    )
    if objects is not None:
        message += (f"more than a copy of the dataset's Python objects would take "
                    f"(`{objects.name}`, about {format_bytes(objects.bytes)})")
    else:
        message += ("still growing through the later half of the run, and the dataset keeps "
                    "no container of Python objects that reading could copy")
    message += ": the workers keep what they make"
    fix = (
        "look in the dataset's `__getitem__` and the collate function for what they keep "
        "across calls (a cache dict filled per index, tensors appended to an attribute); "
        "each worker has its own copy of the dataset object, so such a cache grows in "
        "every worker and is never seen by the main process"
    )
    return Finding(rule=RULE_ID, severity=Severity.LEAK, message=message, fix=fix,
                   bytes=sum(growths), objects=len(workers),
                   subject=Subject(SubjectKind.HOLDER, workers[0].dataset))
