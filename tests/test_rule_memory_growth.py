"""``memory-growth`` on reports built by hand: allocated memory that climbs steadily after
warm-up, and still climbs at the end, is a leak with a forecast of when memory runs out; on
the process heap, growth no tensor explains is a hint; resident memory that climbs while the
allocator's count stays flat is a hint; warm-up, sawtooths, filled windows and growth other
threads made are not judged."""

from __future__ import annotations

import math
import statistics
from dataclasses import replace
from typing import Any

from builders import (
    GiB,
    KiB,
    MiB,
    censuses,
    check,
    cost,
    exit_iteration,
    holder,
    holder_states,
    iterations,
    ramp,
    report,
)

from memsentry.model import Finding, IterationStats, Measured, ReportData, Severity, SubjectKind
from memsentry.rules.growth import MIN_ITERATIONS, MIN_TENSOR_SHARE, WARMUP, growth_note
from memsentry.rules.resident import (
    BLOCK_BYTES,
    MAX_EXPLAINED,
    MIN_GROWTH,
    MIN_OBJECTS_SHARE,
    PILE_UP_FIX,
)
from memsentry.rules.series import MIN_RATE, MIN_RECENT_RATE_SHARE, MIN_RISING_SHARE

RULE = "memory-growth"
BASE = 100 * MiB
#: A list ``kept`` of three tensors, as large at every census: the loop holds no more.
KEPT = holder("kept", tensors=3, bytes=12 * KiB)


def _heap(its: tuple[IterationStats, ...], **fields: Any) -> ReportData:
    """A run measured on the process heap (CPU's default backend: glibc's counters)."""
    return report(iterations=its, measured=Measured.HEAP, backend="cpu-mallinfo2",
                  **fields)


def slope_of(allocated: list[int]) -> float:
    """The least-squares bytes per iteration of ``allocated``, read one per iteration."""
    return statistics.linear_regression(range(len(allocated)), allocated).slope


def _leak_of(its: tuple[IterationStats, ...], **fields: Any) -> list[Finding]:
    return check(RULE, report(iterations=its, **fields))


# -- what the rule exists for ----------------------------------------------------------------------
def test_allocated_memory_gaining_a_mib_each_iteration_is_a_leak_with_a_forecast() -> None:
    """Ten iterations, 1 MiB more at each boundary, on a machine with 16 GiB: the growth is
    judged from iteration 2 (after warm-up) to 9."""
    (finding,) = _leak_of(iterations(ramp(BASE, MiB, 10)), total_memory=16 * GiB)
    assert (finding.rule, finding.severity) == (RULE, Severity.LEAK)
    assert (finding.rate, finding.bytes, finding.iteration) == (MiB, 7 * MiB, 9)
    assert finding.subject is not None
    assert (finding.subject.kind, finding.subject.name) == (SubjectKind.DEVICE, "cpu")
    assert finding.message.startswith(
        "allocated memory grows by 1.0 MiB/iter on cpu: +7.0 MiB from iteration 2 to 9, "
        "higher after 100% of the iterations")
    left = (16 * GiB - (BASE + 9 * MiB)) // MiB
    assert f"at this rate the 16 GiB of RAM run out around iteration {9 + left:,}" in (
        finding.message)
    assert "summed without .item()" in finding.fix and "without .detach()" in finding.fix


def test_on_a_gpu_the_forecast_names_the_device() -> None:
    its = iterations(ramp(BASE, MiB, 10))
    (finding,) = check(RULE, report(iterations=its, device="cuda:0", total_memory=80 * GiB))
    assert "on cuda:0" in finding.message and "80 GiB of cuda:0 run out" in finding.message


def test_without_the_device_size_there_is_no_forecast() -> None:
    (finding,) = _leak_of(iterations(ramp(BASE, MiB, 10)))
    assert "run out" not in finding.message


def test_a_leak_on_the_heap_backend_stays_a_leak_when_the_tensors_reached_grow() -> None:
    """The censuses see ``kept`` gain the 1 MiB a step the heap gains."""
    kept = holder_states("kept", tensors=[3, 5, 9, 12], bytes=[2 * MiB, 4 * MiB, 8 * MiB, 11 * MiB])
    found = check(RULE, _heap(iterations(ramp(BASE, MiB, 12)),
                              censuses=censuses([2, 4, 8, 11], kept)))
    assert [f.severity for f in found] == [Severity.LEAK]


# -- heap growth that is not tensors ---------------------------------------------------------------
def test_heap_growth_the_tensors_reached_do_not_explain_is_a_hint() -> None:
    """Field guide #29: the heap gains 1 MiB a step, the tensors the censuses reach stay."""
    (finding,) = check(RULE, _heap(iterations(ramp(BASE, MiB, 12)),
                                   censuses=censuses([2, 4, 8, 11], KEPT)))
    assert finding.severity is Severity.HINT
    assert ("but this counts the whole process heap, and the tensors your code can reach "
            "grew 0 B/iter over 4 censuses: the growth is not tensor memory memsentry can "
            "see") in finding.message
    assert "track(exact=True)" in finding.fix


def test_heap_growth_with_python_objects_piling_up_names_them() -> None:
    """Python's small-object blocks gain 10,000 a step: at 32 bytes each, a third of the
    heap's growth."""
    its = iterations(ramp(BASE, MiB, 12), python_blocks=ramp(1000, 10_000, 12))
    (finding,) = check(RULE, _heap(its, censuses=censuses([2, 4, 8, 11], KEPT)))
    assert finding.severity is Severity.HINT
    assert "Python's small objects grew by 10,000 per iteration" in finding.message
    assert "Python values pile up, not tensors" in finding.message
    assert finding.fix == PILE_UP_FIX


def test_tensors_reached_must_grow_by_a_share_of_the_heaps_growth_to_keep_it_a_leak() -> None:
    """``MIN_TENSOR_SHARE`` of the heap's 1 MiB a step, reached by the censuses: a leak; a
    little less: a hint."""
    def judged(per_iteration: int) -> Severity:
        kept = holder_states("kept", tensors=3, bytes=ramp(MiB, 3 * per_iteration, 4))
        (finding,) = check(RULE, _heap(iterations(ramp(BASE, MiB, 12)),
                                       censuses=censuses([2, 5, 8, 11], kept)))
        return finding.severity

    assert judged(int(MIN_TENSOR_SHARE * MiB)) is Severity.LEAK
    assert judged(int(MIN_TENSOR_SHARE * MiB) - KiB) is Severity.HINT


def test_graphs_piling_up_on_the_heap_keep_it_a_leak() -> None:
    """Autograd nodes live on the heap, outside tensor bytes: the censuses' flat tensors say
    nothing against the growth."""
    loss = holder_states("total", tensors=1, bytes=4, graph_tensors=1,
                         graph_nodes=[10, 20, 40, 55])
    found = check(RULE, _heap(iterations(ramp(BASE, MiB, 12)),
                              censuses=censuses([2, 4, 8, 11], loss)))
    assert [f.severity for f in found] == [Severity.LEAK]


def test_heap_growth_whose_holder_searches_were_put_off_is_a_hint() -> None:
    (finding,) = check(RULE, _heap(iterations(ramp(BASE, MiB, 12)),
                                   cost=cost(iterations=12, sampled=12, censuses_deferred=3)))
    assert finding.severity is Severity.HINT
    assert "were put off to keep memsentry's budget (3 waited), so it is not judged a leak" in (
        finding.message)
    assert "track(overhead=None)" in finding.fix


def test_tensor_storages_counted_exactly_keep_growth_a_leak_whatever_the_censuses_see() -> None:
    found = check(RULE, report(iterations=iterations(ramp(BASE, MiB, 12)),
                               measured=Measured.TENSORS, censuses=censuses([2, 4, 8, 11], KEPT)))
    assert [f.severity for f in found] == [Severity.LEAK]


# -- resident memory -------------------------------------------------------------------------------
def _resident(residents: list[int], allocated: list[int] | None = None,
              **figures: Any) -> list[Finding]:
    allocated = allocated if allocated is not None else [BASE] * len(residents)
    return check(RULE, report(iterations=iterations(allocated, resident=residents,
                                                    **figures)))


def test_resident_memory_climbing_while_the_allocator_is_flat_is_a_hint() -> None:
    (finding,) = _resident(ramp(300 * MiB, 8 * MiB, 12))
    assert (finding.severity, finding.rate, finding.bytes, finding.iteration) == (
        Severity.HINT, 8 * MiB, 72 * MiB, 11)
    assert finding.subject is not None
    assert (finding.subject.kind, finding.subject.name) == (SubjectKind.PROCESS, "resident")
    assert finding.message.startswith(
        "the process's resident memory grows by 8.0 MiB/iter: +72 MiB from iteration 2 to 11, "
        "higher after 100% of the iterations, while the allocator's count of tensors on cpu "
        "changed 0 B/iter: no tensor explains it")
    assert "not in Python's small objects: memory the process maps itself" in finding.message
    assert "MALLOC_ARENA_MAX=2" in finding.fix


def test_resident_growth_with_python_objects_piling_up_names_them() -> None:
    (finding,) = _resident(ramp(300 * MiB, 8 * MiB, 12), python_blocks=ramp(0, 100_000, 12))
    assert "Python values pile up" in finding.message and finding.fix == PILE_UP_FIX


def test_python_objects_are_named_from_a_share_of_the_growth() -> None:
    """8 MiB a step of resident growth: blocks of ``BLOCK_BYTES`` making up
    ``MIN_OBJECTS_SHARE`` of it are named as the source, one block fewer a step is not."""
    blocks = int(MIN_OBJECTS_SHARE * 8 * MiB) // BLOCK_BYTES
    residents = ramp(300 * MiB, 8 * MiB, 12)
    (named,) = _resident(residents, python_blocks=ramp(0, blocks, 12))
    (unnamed,) = _resident(residents, python_blocks=ramp(0, blocks - 1, 12))
    assert named.fix == PILE_UP_FIX and unnamed.fix != PILE_UP_FIX


def test_resident_growth_is_judged_from_min_growth() -> None:
    """Eight iterations after warm-up; pages first touched and arenas come in small steps."""
    def climbing(grown: int) -> list[int]:
        return [280 * MiB, 290 * MiB] + [300 * MiB + i * grown // 7 for i in range(8)]

    assert _resident(climbing(MIN_GROWTH - 1)) == []
    assert len(_resident(climbing(MIN_GROWTH))) == 1


def test_resident_growth_the_allocator_explains_is_not_a_separate_hint() -> None:
    """The allocator's count rose in one jump (no steady growth of its own) by
    ``MAX_EXPLAINED`` of the resident growth: it explains it."""
    def jumping(gained: int) -> list[int]:
        return [BASE] * 6 + [BASE + gained] * 6

    explained = int(MAX_EXPLAINED * 8 * MiB) * 9  # 9 iterations from 2 to 11
    residents = ramp(300 * MiB, 8 * MiB, 12)
    assert _resident(residents, jumping(explained)) == []
    assert len(_resident(residents, jumping(explained - 9 * KiB))) == 1


def test_resident_memory_that_levels_off_is_not_judged() -> None:
    residents = [300 * MiB, 320 * MiB] + ramp(330 * MiB, 8 * MiB, 6) + [378 * MiB] * 6
    assert _resident(residents) == []


# -- not a leak ------------------------------------------------------------------------------------
def test_warm_up_growth_is_not_judged() -> None:
    """Field guide #26: gradient buffers and Adam's state appear in the first ``WARMUP``
    iterations, then memory stays."""
    its = iterations([10 * MiB, 60 * MiB][:WARMUP] + [BASE] * 8)
    assert _leak_of(its) == []


def test_a_list_cleared_every_epoch_gives_its_memory_back_and_is_not_a_leak() -> None:
    """Field guide #28: three epochs of a list gaining 3 MiB a step, emptied at each start:
    most steps rise, but less than half of all they gained is still held."""
    sawtooth = [BASE + (i % 4) * 3 * MiB for i in range(12)]
    assert _leak_of(iterations([BASE, BASE, *sawtooth])) == []


def test_a_window_that_filled_up_is_not_a_leak() -> None:
    """Growth early, then a few bytes of noise at each boundary: not still climbing."""
    filled = ramp(BASE, MiB, 7) + [BASE + 6 * MiB + i for i in range(1, 4)]
    assert _leak_of(iterations(filled)) == []


def test_growth_that_slows_to_a_crawl_at_the_end_is_a_window_levelling_off() -> None:
    """1 MiB a step, then 128 KiB a step for the latest third: still rising, but below
    ``MIN_RECENT_RATE_SHARE`` of the overall rate: a cache that has nearly filled. At that
    share of the rate, it still climbs."""
    def slowing(recent_step: int) -> list[int]:
        early = ramp(BASE, MiB, 9)
        return early + ramp(early[-1] + recent_step, recent_step, 3)

    overall = slope_of(slowing(128 * KiB)[WARMUP:])
    assert 128 * KiB < MIN_RECENT_RATE_SHARE * overall
    assert _leak_of(iterations(slowing(128 * KiB))) == []
    assert len(_leak_of(iterations(slowing(512 * KiB)))) == 1


def test_the_partial_iteration_at_the_end_of_tracking_is_left_out() -> None:
    its = (*iterations([BASE] * 8), exit_iteration(8, BASE + 500 * MiB))
    assert _leak_of(its) == []


def test_growth_other_threads_made_is_not_judged_and_a_note_says_why() -> None:
    """Three other threads trained in the process; the heap counts their memory, and what
    this loop holds stayed flat."""
    beside = _heap(iterations(ramp(BASE, MiB, 12)), censuses=censuses([2, 4, 8, 11], KEPT),
                   other_threads=3)
    assert check(RULE, beside) == []
    note = growth_note(beside)
    assert note is not None and note.startswith("memory-growth not judged: the process heap")
    assert "3 other threads ran a training loop in this process" in note


# -- edges -----------------------------------------------------------------------------------------
def test_growth_is_judged_from_min_iterations_after_warm_up() -> None:
    steep = ramp(BASE, 10 * MiB, WARMUP + MIN_ITERATIONS)
    assert _leak_of(iterations(steep[:-1])) == []
    assert len(_leak_of(iterations(steep))) == 1


def test_growth_is_judged_from_min_rate_bytes_an_iteration() -> None:
    assert _leak_of(iterations(ramp(BASE, MIN_RATE - 1, 10))) == []
    assert [f.rate for f in _leak_of(iterations(ramp(BASE, MIN_RATE, 10)))] == [MIN_RATE]


def test_growth_needs_most_iterations_to_end_higher() -> None:
    """Nine iterations after warm-up (eight steps), the first ones flat: ``MIN_RISING_SHARE``
    of the steps rising is growth, one rising step fewer is not."""
    def steps_rising(rising: int) -> list[int]:
        steps = [0] * (8 - rising) + [MiB] * rising
        return [BASE, BASE] + [BASE + sum(steps[:i]) for i in range(9)]

    needed = math.ceil(MIN_RISING_SHARE * 8)
    assert _leak_of(iterations(steps_rising(needed - 1))) == []
    assert len(_leak_of(iterations(steps_rising(needed)))) == 1


def test_an_empty_report_has_no_finding() -> None:
    assert check(RULE, report()) == []


# -- growth that follows the input -----------------------------------------------------------------
def _rebuilt(**figures: Any) -> tuple[Any, ...]:
    """A curriculum's step at censuses 2, 4, 8 and 11: ``x`` bound anew and larger each time,
    ``loss`` whose graph, built since the census before, gains nodes."""
    x = holder_states("x", tensors=1, bytes=[MiB, 2 * MiB, 4 * MiB, 5 * MiB], rebound=True)
    loss = holder_states("loss", tensors=1, bytes=4, graph_tensors=1,
                         graph_nodes=[100, 200, 400, 500], graph_oldest=[10, 300, 700, 1200],
                         graph_newest=[110, 500, 1100, 1700])
    taken = censuses([2, 4, 8, 11], x, loss, **figures)
    newest = [110, 500, 1100, 1700]
    return tuple(replace(c, graph_newest=n) for c, n in zip(taken, newest, strict=True))


def test_heap_growth_from_holders_rebuilt_at_every_step_is_a_hint() -> None:
    """A length curriculum: the heap gains 1 MiB a step and what grew is this step's input
    and graph, both rebuilt; nothing is kept from one step to the next."""
    (finding,) = check(RULE, _heap(iterations(ramp(BASE, MiB, 12)), censuses=_rebuilt()))
    assert finding.severity is Severity.HINT
    assert "the holders that grew (`x`, `loss`) are rebuilt at every step" in finding.message
    assert "nothing to fix if the inputs grow by design" in finding.fix


def test_a_kept_holder_beside_rebuilt_ones_leaves_the_growth_a_leak() -> None:
    kept = holder_states("kept", tensors=[3, 5, 9, 12], bytes=[2 * MiB, 4 * MiB, 8 * MiB,
                                                               11 * MiB])
    taken = tuple(replace(c, holders=(*c.holders, h))
                  for c, h in zip(_rebuilt(), kept, strict=True))
    found = check(RULE, _heap(iterations(ramp(BASE, MiB, 12)), censuses=taken))
    assert [f.severity for f in found] == [Severity.LEAK]
