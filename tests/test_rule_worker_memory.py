"""``worker-memory`` on reports built by hand: DataLoader workers whose private memory grows,
judged against what reading the dataset's Python objects copies into each (copy-on-read):
up to a copy of them it is waste, well past them, or still climbing step by step with nothing
to copy, it is a leak in the workers; small or unexplained growth says nothing."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from builders import (
    Location,
    MiB,
    check,
    dataset_objects,
    report,
    store,
    worker,
)

from memsentry.model import (
    DatasetObjects,
    DatasetStore,
    Finding,
    Severity,
    SubjectKind,
    WorkerMemory,
)
from memsentry.rules.workers import (
    EVENT_TIMES,
    MAX_JUMP,
    MIN_SAMPLES,
    MIN_SHAPE_SAMPLES,
    MIN_TOTAL,
    PAST_BYTES,
    PAST_OBJECTS,
    PAST_OBJECTS_UNSTORED,
    STILL_GROWING,
)

RULE = "worker-memory"
RECORDS = dataset_objects("train_set.records", kind="list of dict", items=300_000,
                          bytes=49 * MiB, dataset="train_set")
CACHE = store("self.cache", Location("dataset.py", 20, "__getitem__"))
#: Front-loaded, as a shuffled read touches most pages early: 40 MiB in all.
COPYING = [0, 20 * MiB, 30 * MiB, 35 * MiB, 38 * MiB, 40 * MiB]


def _found(*workers: WorkerMemory) -> list[Finding]:
    return check(RULE, report(workers=workers))


def _steady(grown: int, samples: int = 8) -> list[int]:
    """Private memory rising by the same step at each of ``samples`` readings to ``grown``."""
    return [grown * i // (samples - 1) for i in range(samples)]


def _pair(private: Sequence[int | None], objects: DatasetObjects | None = None,
          stores: tuple[DatasetStore, ...] = (), **fields: Any) -> list[WorkerMemory]:
    """The two workers of one loader, both reading ``private``."""
    return [worker(private, pid=4000 + n, worker=n, objects=objects, stores=stores,
                   **fields)
            for n in range(2)]


# -- what the rule exists for ----------------------------------------------------------------------
def test_workers_copying_a_list_of_dicts_as_they_read_it_is_copy_on_read_waste() -> None:
    """pytorch/pytorch#13246: each of two workers copies up to 40 MiB of a 49 MiB list of
    dicts by reading it."""
    (finding,) = _found(*_pair(COPYING, RECORDS))
    assert (finding.rule, finding.severity) == (RULE, Severity.WASTE)
    assert (finding.bytes, finding.objects) == (80 * MiB, 2)
    assert finding.subject is not None
    assert (finding.subject.kind, finding.subject.name) == (SubjectKind.HOLDER,
                                                            "train_set.records")
    assert finding.message.startswith(
        "the 2 workers of the DataLoader over `train_set` (ListDataset) each copied up to "
        "40 MiB of this process's memory (80 MiB in all) while reading the dataset: "
        "`train_set.records` is a list of dict (300,000 items, about 49 MiB of Python "
        "objects)")
    assert "(copy-on-read)" in finding.message
    assert finding.fix.startswith("keep `train_set.records` in NumPy arrays or tensors")
    assert "with 2 workers this costs 80 MiB" in finding.fix and "gc.freeze()" in finding.fix


def test_a_cache_filled_in_getitem_past_the_objects_is_a_leak_named_by_its_line() -> None:
    """``self.cache[index] = sample``: each worker grows 60 MiB beside 10 MiB of objects."""
    small = dataset_objects("train_set.records", kind="list of dict", items=1000,
                            bytes=10 * MiB, dataset="train_set")
    private = [0, 10 * MiB, 20 * MiB, 30 * MiB, 40 * MiB, 60 * MiB]
    (finding,) = _found(*_pair(private, small, stores=(CACHE,)))
    assert (finding.severity, finding.bytes, finding.objects) == (Severity.LEAK, 120 * MiB, 2)
    assert finding.location == CACHE.location
    assert finding.subject is not None and finding.subject.name == "self.cache"
    assert ("each grew by up to 60 MiB of private memory in 5 s (120 MiB in all), more than "
            "a copy of the dataset's Python objects explains (`train_set.records`: about "
            "10 MiB a worker at most): the workers keep what they make") in finding.message
    assert ("`__getitem__` adds to `self.cache` (dataset.py:20), which each worker fills in "
            "its own copy of the dataset") in finding.message
    assert finding.fix.startswith("drop what `self.cache` keeps, or bound it")


def test_workers_still_growing_with_nothing_to_copy_are_a_leak() -> None:
    (finding,) = _found(*_pair(_steady(56 * MiB)))
    assert finding.severity is Severity.LEAK
    assert finding.subject is not None and finding.subject.name == "ListDataset"
    assert finding.location is None
    assert ("still growing through the later half of the run, and the dataset keeps no "
            "container of Python objects that reading could copy") in finding.message
    assert "look in the dataset's `__getitem__` and the collate function" in finding.fix


def test_workers_started_again_for_every_pass_get_one_finding_that_counts_the_passes() -> None:
    """Without ``persistent_workers``, each pass over the data starts new workers, which copy
    the pages again."""
    first = _pair(COPYING, RECORDS)
    second = _pair([p * 38 // 40 for p in COPYING], RECORDS, epoch=2)
    (finding,) = _found(*first, *second)
    assert finding.severity is Severity.WASTE and finding.bytes == 80 * MiB
    assert ("the loader started new workers for each of its 2 passes over the data "
            "(persistent_workers=False), and in every pass they copied the pages again (each "
            "worker up to 40 MiB then 38 MiB)") in finding.message


def test_each_loader_is_judged_on_its_own() -> None:
    leaking = [worker(_steady(56 * MiB), pid=5000 + n, worker=n, loader=2, dataset="Val")
               for n in range(2)]
    found = _found(*_pair(COPYING, RECORDS), *leaking)
    assert [(f.severity, f.subject and f.subject.name) for f in found] == [
        (Severity.WASTE, "train_set.records"), (Severity.LEAK, "Val")]


# -- not a leak ------------------------------------------------------------------------------------
def test_one_big_jump_past_the_objects_is_a_full_collections_copy_not_a_leak() -> None:
    """The main process's full garbage collection wrote to every object at once: each worker
    is left the only one mapping 100 MiB of pages, beside 20 MiB of objects. Still the cost
    of reading inherited objects."""
    objects = dataset_objects("train_set.paths", kind="list of tuple", items=300_000,
                              bytes=20 * MiB)
    jump = [0, MiB, 2 * MiB, 98 * MiB, 99 * MiB, 100 * MiB]
    assert [f.severity for f in _found(*_pair(jump, objects))] == [Severity.WASTE]


def test_front_loaded_growth_with_nothing_to_copy_says_nothing() -> None:
    """Pages the main process wrote after the fork are its own cost: no verdict."""
    assert _found(*_pair([0, 40 * MiB, 44 * MiB, 46 * MiB, 47 * MiB, 48 * MiB])) == []


def test_growth_made_of_one_jump_is_not_still_growing() -> None:
    """Steps of 10, 10 and 5 MiB and one of 26 MiB, under ``EVENT_TIMES`` times their median
    and so not an event: more than ``MAX_JUMP`` of the growth in that step is one
    event, not a leak; a step of a MiB less is growth still going on."""
    def jumping(jump: int) -> list[int]:
        steps = [10 * MiB, 10 * MiB, 0, jump, 0, 5 * MiB]
        return list(itertools.accumulate(steps, initial=0))

    at_most = int(MAX_JUMP / (1 - MAX_JUMP) * 25 * MiB)  # the jump's share is MAX_JUMP
    assert at_most + MiB < EVENT_TIMES * 10 * MiB
    assert jumping(at_most)[-1] > MIN_TOTAL
    assert _found(*_pair(jumping(at_most + MiB))) == []
    assert [f.severity for f in _found(*_pair(jumping(at_most)))] == [Severity.LEAK]


def test_an_event_larger_than_the_growth_still_leaves_a_leak_that_climbs() -> None:
    """A CI run's readings (KiB, 2026-11-28): each worker of a caching dataset gained 217 and
    197 MiB in one step at its 26th reading, more than ``MAX_JUMP`` of all it gained, beside
    125 and 142 MiB over its other 32 steps. That step counted as a typical one, what the
    workers gained still climbs through the later half: a leak (the later half's share of
    it, 36%, is 32% when the step counts as nothing)."""
    first = [13144, 29952, 39336, 42720, 48044, 48060, 48060, 48064, 48064, 62548, 74256,
             78808, 82972, 82972, 82972, 82972, 82972, 97544, 109060, 109792, 117556, 117780,
             117780, 117780, 117780, 128724, 346076, 346076, 346076, 347072, 355344, 355344,
             355344, 355344]
    second = [14508, 29556, 38744, 38740, 45688, 45780, 45780, 45780, 45784, 63356, 72060,
              72060, 79016, 79016, 79016, 79016, 79016, 96588, 105300, 105284, 109232,
              112260, 112260, 112260, 112260, 135580, 332492, 341572, 347768, 348480,
              348480, 348480, 348480, 348484]
    workers = [worker([k * 1024 for k in private], pid=4000 + n, worker=n)
               for n, private in enumerate((first, second))]
    (finding,) = _found(*workers)
    assert finding.severity is Severity.LEAK
    assert "still growing through the later half of the run" in finding.message


def test_an_event_with_little_growth_of_its_own_says_nothing() -> None:
    """One step copies 90 MiB into each worker, and the others add a MiB or less: what the
    workers gained by themselves is under ``MIN_TOTAL``, and no verdict is built on the
    event."""
    steps = [MiB // 2, MiB, MiB // 4, 90 * MiB, MiB // 2, 0, MiB // 4]
    private = list(itertools.accumulate(steps, initial=0))
    assert _found(*_pair(private)) == []


def _epochs(per_epoch: int, epochs: int, *, event: int = 0, at: int = 0) -> list[int]:
    """Private memory of a persistent worker that keeps what it makes: four readings that
    gain ``per_epoch / 4`` each, then four that gain nothing (the loader's last batches are
    fetched already), every epoch; ``event`` bytes more in the step to reading ``at``."""
    steps = ([per_epoch // 4] * 4 + [0] * 4) * epochs
    private = list(itertools.accumulate(steps, initial=8 * MiB))
    return [p + (event if n >= at else 0) for n, p in enumerate(private)]


def test_a_leak_still_grows_when_a_full_collection_copied_the_heap_midway() -> None:
    """The worker's first full collection copies all the pages it inherited in one step (90
    MiB beside 32 MiB an epoch, a step between readings at the run's middle, as a worker
    forked from a pytest process that ran other tests did): that step is an event, counted as
    a typical one, and what the worker gained still climbs through the later half."""
    private = _epochs(32 * MiB, 4, event=90 * MiB, at=16)
    (finding,) = _found(*_pair(private))
    assert finding.severity is Severity.LEAK
    assert "still growing through the later half of the run" in finding.message


def test_an_event_is_a_step_past_event_times_the_median_growing_step() -> None:
    """Ten steps of 6 MiB and one more, beside a cache and 49 MiB of records (a leak past
    81 MiB of a worker's own growth): a step of ``EVENT_TIMES`` times 6 MiB is growth and
    makes 84 MiB; a byte more is an event, counted as 6 MiB, and 66 MiB is within the records'
    copy."""
    def with_step(step: int) -> list[Finding]:
        steps = [6 * MiB] * 5 + [step] + [6 * MiB] * 5
        private = list(itertools.accumulate(steps, initial=0))
        return _found(*_pair(private, RECORDS, stores=(CACHE,)))

    assert [f.severity for f in with_step(EVENT_TIMES * 6 * MiB)] == [Severity.LEAK]
    assert [f.severity for f in with_step(EVENT_TIMES * 6 * MiB + 1)] == [Severity.WASTE]


def test_a_full_collections_copy_is_not_a_caches_growth_past_the_objects() -> None:
    """A bounded cache beside 49 MiB of records: the workers copy the records as they read
    them, and one step copies their 60 MiB of inherited heap; without that step they are
    within ``PAST_OBJECTS`` times the records: copy-on-read, not a leak."""
    copying = [0, 20 * MiB, 30 * MiB, 36 * MiB, 40 * MiB, 43 * MiB, 45 * MiB, 47 * MiB,
               48 * MiB, 49 * MiB]
    private = [p + (60 * MiB if n >= 6 else 0) for n, p in enumerate(copying)]
    (finding,) = _found(*_pair(private, RECORDS, stores=(CACHE,)))
    assert finding.severity is Severity.WASTE
    assert finding.bytes == 2 * 109 * MiB  # what the workers hold, the event's step too


def test_a_worker_that_did_not_grow_leaves_its_loader_unjudged() -> None:
    flat = worker([10 * MiB] * 6, pid=4001, worker=1, objects=RECORDS)
    assert _found(worker(COPYING, objects=RECORDS), flat) == []


def test_a_worker_without_private_figures_is_not_judged() -> None:
    """No ``/proc/<pid>/smaps_rollup``: the system does not say."""
    unknown: list[int | None] = [None] * 6
    assert _found(*_pair(unknown, RECORDS)) == []


# -- edges -----------------------------------------------------------------------------------------
def test_growth_counts_from_min_total_for_the_loaders_workers_together() -> None:
    def grown(total: int) -> list[Finding]:
        return _found(worker([0, total // 2, total * 3 // 4, total], objects=RECORDS))

    assert grown(MIN_TOTAL - 1) == []
    assert [f.bytes for f in grown(MIN_TOTAL)] == [MIN_TOTAL]


def test_a_worker_needs_min_samples_readings() -> None:
    too_few = _steady(40 * MiB, samples=MIN_SAMPLES - 1)
    enough = _steady(40 * MiB, samples=MIN_SAMPLES)
    assert _found(*_pair(too_few, RECORDS)) == []
    assert [f.severity for f in _found(*_pair(enough, RECORDS))] == [Severity.WASTE]


def _with_cache(objects_bytes: int, grown: int) -> list[Finding]:
    objects = dataset_objects("train_set.records", kind="list of dict", items=1000,
                              bytes=objects_bytes)
    return _found(*_pair(_steady(grown), objects, stores=(CACHE,)))


def test_with_a_cache_to_blame_a_leak_is_growth_past_past_objects_times_the_objects() -> None:
    """128 MiB of objects: ``PAST_OBJECTS`` times them is more than them and ``PAST_BYTES``."""
    limit = int(PAST_OBJECTS * 128 * MiB)
    assert [f.severity for f in _with_cache(128 * MiB, limit)] == [Severity.WASTE]
    assert [f.severity for f in _with_cache(128 * MiB, limit + 1)] == [Severity.LEAK]


def test_with_a_cache_to_blame_small_objects_need_past_bytes_beyond_them() -> None:
    """10 MiB of objects: ``PAST_BYTES`` beyond them is more than ``PAST_OBJECTS`` times."""
    limit = 10 * MiB + PAST_BYTES
    assert [f.severity for f in _with_cache(10 * MiB, limit)] == [Severity.WASTE]
    assert [f.severity for f in _with_cache(10 * MiB, limit + 1)] == [Severity.LEAK]


def test_without_a_cache_growth_must_pass_past_objects_unstored_times_the_objects() -> None:
    """Objects built among others spread over more pages than their size: 40 MiB of them may
    cost ``PAST_OBJECTS_UNSTORED`` times as much, growing steadily."""
    objects = dataset_objects("train_set.paths", kind="list of tuple", items=300_000,
                              bytes=40 * MiB)
    limit = int(PAST_OBJECTS_UNSTORED * 40 * MiB)
    assert [f.severity for f in _found(*_pair(_steady(limit), objects))] == [Severity.WASTE]
    assert [f.severity for f in _found(*_pair(_steady(limit + 7), objects))] == [Severity.LEAK]


def test_still_growing_means_the_later_half_gained_a_share_of_the_growth() -> None:
    """96 MiB over eight readings, nothing to copy: the later half (from the fifth reading)
    gaining ``STILL_GROWING`` of it or more is a leak still going on; less is growth that has
    slowed."""
    def reaching(middle: int) -> list[int]:
        return [middle * i // 4 for i in range(5)] + [middle + (96 * MiB - middle) * i // 3
                                                      for i in range(1, 4)]

    middle = 96 * MiB - int(STILL_GROWING * 96 * MiB)
    assert [f.severity for f in _found(*_pair(reaching(middle - MiB)))] == [Severity.LEAK]
    assert _found(*_pair(reaching(middle + MiB))) == []


def test_still_growing_is_told_from_min_shape_samples_readings() -> None:
    too_few = _steady(56 * MiB, samples=MIN_SHAPE_SAMPLES - 1)
    enough = _steady(56 * MiB, samples=MIN_SHAPE_SAMPLES)
    assert _found(*_pair(too_few)) == []
    assert [f.severity for f in _found(*_pair(enough))] == [Severity.LEAK]


def test_a_report_without_workers_has_no_finding() -> None:
    assert check(RULE, report()) == []
