"""``input-bound`` on reports built by hand: a loop whose median wait for the DataLoader's next
batch exceeds the median time of the rest of its iterations gets a hint; a loop that computes
longer than it waits, waits of a few milliseconds, slow first batches and loops that read data
some other way do not."""

from __future__ import annotations

from dataclasses import replace

from builders import MiB, check, exit_iteration, iterations, report

from memsentry.model import Finding, IterationStats, Severity, SubjectKind
from memsentry.rules.series import WARMUP
from memsentry.rules.timing import MIN_ITERATIONS, MIN_WAIT

RULE = "input-bound"


def _loop(seconds: float | list[float], data_seconds: float | list[float] | None,
          count: int = 8) -> tuple[IterationStats, ...]:
    """``count`` iterations taking ``seconds`` each, ``data_seconds`` of it waiting for the
    DataLoader (``None``: the loop fetched no batch from one)."""
    return iterations([100 * MiB] * count, seconds=seconds, data_seconds=data_seconds)


def _found(its: tuple[IterationStats, ...]) -> list[Finding]:
    return check(RULE, report(iterations=its))


def test_a_loop_that_waits_longer_for_data_than_it_computes_gets_the_num_workers_hint() -> None:
    """40 ms iterations, 30 of them waiting for the batch."""
    (finding,) = _found(_loop(0.04, 0.03))
    assert (finding.rule, finding.severity) == (RULE, Severity.HINT)
    assert (finding.objects, finding.bytes) == (8 - WARMUP, None)
    assert finding.subject is not None
    assert (finding.subject.kind, finding.subject.name) == (SubjectKind.LOOP,
                                                            "the training loop")
    assert finding.message.startswith(
        "the loop waits 30.0 ms per iteration for the DataLoader's next batch")
    assert ("against 10.0 ms for the rest of the iteration (medians of 6 iterations): the "
            "model idles 75% of the time") in finding.message
    assert "num_workers=N" in finding.fix and "pin_memory=True" in finding.fix


def test_a_loop_that_computes_longer_than_it_waits_is_not_input_bound() -> None:
    assert _found(_loop(0.04, 0.01)) == []


def test_a_wait_as_long_as_the_compute_is_not_input_bound() -> None:
    assert _found(_loop(0.04, 0.02)) == []
    assert len(_found(_loop(0.04, 0.021))) == 1


def test_waits_of_a_few_milliseconds_are_python_overhead() -> None:
    """From ``MIN_WAIT`` a wait is a data problem, even beside a tiny compute."""
    assert _found(_loop(MIN_WAIT, MIN_WAIT - 0.001)) == []
    assert len(_found(_loop(MIN_WAIT + 0.001, MIN_WAIT))) == 1


def test_slow_first_batches_while_workers_start_are_warm_up() -> None:
    waits = [2.0] * WARMUP + [0.001] * 6
    assert _found(_loop([w + 0.01 for w in waits], waits)) == []


def test_one_slow_batch_among_many_does_not_move_the_median() -> None:
    waits = [0.001] * 7 + [5.0]
    assert _found(_loop([w + 0.01 for w in waits], waits)) == []


def test_a_loop_that_reads_data_some_other_way_is_not_judged() -> None:
    """Batches not fetched from a DataLoader: the wait cannot be told from the loop's own
    work."""
    assert _found(_loop(0.04, None)) == []


def test_min_iterations_after_warm_up_are_needed() -> None:
    assert _found(_loop(0.04, 0.03, count=WARMUP + MIN_ITERATIONS - 1)) == []
    assert len(_found(_loop(0.04, 0.03, count=WARMUP + MIN_ITERATIONS))) == 1


def test_only_iterations_that_fetched_a_batch_count() -> None:
    """Eight iterations, the first five without a batch from a DataLoader: of the three that
    had one, one remains after warm-up."""
    waits: list[float | None] = [None] * 5 + [0.03] * 3
    its = iterations([100 * MiB] * 8, seconds=0.04, data_seconds=waits)
    assert _found(its) == []


def test_the_partial_iteration_at_the_end_of_tracking_is_left_out() -> None:
    """One full iteration too few after warm-up, and the partial one that waited too: it
    does not make up the count."""
    partial = replace(exit_iteration(WARMUP + MIN_ITERATIONS - 1, 100 * MiB), seconds=0.04,
                      data_seconds=0.03)
    its = (*_loop(0.04, 0.03, count=WARMUP + MIN_ITERATIONS - 1), partial)
    assert _found(its) == []


def test_an_empty_report_has_no_finding() -> None:
    assert check(RULE, report()) == []
