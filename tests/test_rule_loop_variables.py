"""``loop-variables`` on reports built by hand: the loop's plain tensor locals (``x``, ``out``)
still holding the finished iteration's tensors at two censuses in a row get a hint, with the
share of the peak's rise they could free; locals another holder keeps too, containers,
attributes, graphs and small tensors do not."""

from __future__ import annotations

from typing import Any

from builders import (
    KiB,
    Location,
    MiB,
    Row,
    censuses,
    check,
    holder,
    holder_states,
    in_function,
    iterations,
    ramp,
    report,
)

from memsentry.model import (
    Census,
    Finding,
    HolderKind,
    HolderStats,
    IterationStats,
    Severity,
    SubjectKind,
)
from memsentry.rules.loopvars import MIN_BYTES, MIN_SHARE

RULE = "loop-variables"
AT = [6, 8]
TRAIN = in_function("train")
X_LINE = Location("train.py", 21, "train")
#: Eight iterations whose peak rises 100 MiB above the boundary's 100 MiB.
RISING = iterations([100 * MiB] * 8, peak=200 * MiB)


def _local(name: str, size: int, **figures: Any) -> HolderStats:
    """A local of ``train()`` holding one tensor of ``size`` bytes."""
    fields: dict[str, Any] = {"tensors": 1, "bytes": size, "scope": TRAIN, **figures}
    return holder(name, **fields)


def _found(*rows: Row, at: list[int] = AT,
           its: tuple[IterationStats, ...] = RISING,
           complete: bool | list[bool] = True) -> list[Finding]:
    seen: tuple[Census, ...] = censuses(at, *rows, complete=complete)
    return check(RULE, report(iterations=its, censuses=seen))


def test_locals_holding_the_finished_batch_get_a_hint_with_their_share_of_the_peak() -> None:
    """Field guide #15: ``x`` (16 MiB) and ``out`` (4 MiB) of step i alive while step i+1
    allocates; the peak rises 100 MiB above each boundary."""
    (finding,) = _found(_local("x", 16 * MiB, where=X_LINE), _local("out", 4 * MiB))
    assert (finding.rule, finding.severity) == (RULE, Severity.HINT)
    assert (finding.bytes, finding.objects, finding.location) == (20 * MiB, 2, X_LINE)
    assert finding.subject is not None
    assert (finding.subject.kind, finding.subject.name) == (SubjectKind.HOLDER, "x")
    assert finding.message == (
        "`x` (16 MiB), `out` (4.0 MiB) (locals of train()) keep 20 MiB of the finished "
        "iteration alive until the next one rebinds them, after it has made its own: the peak "
        "rises 100 MiB above each boundary, and 20% of that could be freed first")
    assert finding.fix.startswith("end the step with `del x, out`")


def test_only_what_no_other_holder_keeps_is_counted() -> None:
    """``out`` is also in ``outputs`` (``outputs.append(out)``): deleting it frees nothing.
    ``x`` shares 2 MiB with another local."""
    (finding,) = _found(_local("x", 16 * MiB, shared_bytes=2 * MiB),
                        _local("out", 4 * MiB, shared_bytes=4 * MiB))
    assert finding.bytes == 14 * MiB
    assert "`out`" not in finding.message


def test_without_a_measured_rise_the_message_leaves_the_share_out() -> None:
    (finding,) = _found(_local("x", 16 * MiB), its=())
    assert finding.message.endswith("after it has made its own")


def test_a_local_seen_at_the_last_census_only_is_not_the_previous_iterations() -> None:
    assert _found([None, _local("x", 16 * MiB)]) == []
    assert len(_found([_local("x", 16 * MiB)] * 2)) == 1


def test_holders_that_are_not_plain_tensor_locals_are_left_out() -> None:
    """A container, an attribute, a global, a model, and a graph kept for backward: each is
    another rule's, or kept on purpose."""
    others = [
        _local("batch_list", 16 * MiB, items=4),
        _local("self.x", 16 * MiB),
        _local("x", 16 * MiB, kind=HolderKind.GLOBAL),
        _local("net", 16 * MiB, modules=1),
        _local("loss", 16 * MiB, graph_saved_bytes=16 * MiB),
    ]
    assert len(_found(_local("x", 16 * MiB))) == 1  # the same size as a plain local: a hint
    for other in others:
        assert _found(other) == [], other.name


def test_a_local_that_grows_at_every_census_is_a_leak_not_a_late_rebinding() -> None:
    """``bank = torch.cat([bank, x])``: tensor-accumulation reports it; rebinding it sooner
    would not help."""
    bank = holder_states("bank", tensors=1, bytes=ramp(16 * MiB, 256 * KiB, 5), scope=TRAIN)
    assert _found(bank, at=[2, 4, 6, 8, 10]) == []


def test_locals_count_from_min_bytes() -> None:
    """Without iterations to measure the peak's rise, the size alone decides."""
    assert _found(_local("x", MIN_BYTES - 1), its=()) == []
    assert [f.bytes for f in _found(_local("x", MIN_BYTES), its=())] == [MIN_BYTES]


def test_locals_must_be_min_share_of_the_peaks_rise() -> None:
    """A 100 MiB rise: locals of a tenth of it matter, a little less do not."""
    share = int(MIN_SHARE * 100 * MiB)
    assert _found(_local("x", share - 1)) == []
    assert len(_found(_local("x", share + 1))) == 1


def test_one_census_is_too_few() -> None:
    assert _found(_local("x", 16 * MiB), at=[8]) == []


def test_a_census_that_ran_out_of_time_is_left_out() -> None:
    assert _found(_local("x", 16 * MiB), complete=[False, True]) == []


def test_a_report_without_censuses_has_no_finding() -> None:
    assert check(RULE, report(iterations=RISING)) == []
