"""``exception-frames`` on reports built by hand: an exception kept in a variable whose
traceback's frames hold tensors, at the last two censuses, is waste; a kept exception whose
frames hold no tensor, or one seen only once, is not."""

from __future__ import annotations

from typing import Any

from builders import Location, MiB, censuses, check, holder, in_function, report

from memsentry.model import HolderKind, HolderStats, Severity, SubjectKind

RULE = "exception-frames"
AT = [4, 8]
RETRY = Location("train.py", 48, "train")


def _kept(spelled: str = "error.__traceback__", **figures: Any) -> HolderStats:
    """The traceback of the exception ``error``, a local of ``train()``, its frames keeping
    three tensors (12 MiB) of the failed call."""
    fields: dict[str, Any] = {"tensors": 3, "bytes": 12 * MiB,
                                 "scope": in_function("train"), "where": RETRY, **figures}
    return holder(spelled, **fields)


def test_an_exception_kept_after_an_out_of_memory_retry_is_waste_of_its_frames_tensors() -> None:
    """Field guide #16: ``except torch.OutOfMemoryError as e: error = e`` then a retry."""
    (finding,) = check(RULE, report(censuses=censuses(AT, _kept())))
    assert (finding.rule, finding.severity) == (RULE, Severity.WASTE)
    assert (finding.bytes, finding.objects, finding.location) == (12 * MiB, 3, RETRY)
    assert finding.subject is not None
    assert (finding.subject.kind, finding.subject.name) == (SubjectKind.HOLDER, "error")
    assert finding.message == (
        "`error` (a local of train(), train.py:48) keeps an exception whose traceback holds "
        "the frames it passed through, and with them 3 tensors (12 MiB) of the failed call's "
        "locals")
    assert finding.fix.startswith("keep what you need from the error, not the error: "
                                  "`str(error)`")
    assert "traceback.clear_frames(error.__traceback__)" in finding.fix
    assert "retry outside the `except` block" in finding.fix


def test_a_notebooks_last_error_is_named_through_sys() -> None:
    last = _kept("sys.last_value.__traceback__", kind=HolderKind.GLOBAL, scope=None)
    (finding,) = check(RULE, report(censuses=censuses(AT, last)))
    assert finding.subject is not None and finding.subject.name == "sys.last_value"
    assert "`str(last_value)`" in finding.fix


def test_a_kept_exception_whose_frames_hold_no_tensor_is_not_reported() -> None:
    assert check(RULE, report(censuses=censuses(AT, _kept(tensors=0, bytes=0)))) == []


def test_an_exception_seen_at_the_last_census_only_is_not_reported() -> None:
    """Caught and dropped by the next step: the census before did not see it."""
    assert check(RULE, report(censuses=censuses(AT, [None, _kept()]))) == []


def test_an_exception_gone_by_the_last_census_is_not_reported() -> None:
    assert check(RULE, report(censuses=censuses([2, 4, 8], [_kept(), _kept(), None]))) == []


def test_tensors_held_by_the_variable_itself_are_not_frames() -> None:
    """A local ``error_batch`` holding tensors is not an exception's traceback."""
    batch = holder("error_batch", tensors=3, bytes=12 * MiB)
    assert check(RULE, report(censuses=censuses(AT, batch))) == []


def test_one_census_is_too_few() -> None:
    assert check(RULE, report(censuses=censuses([8], _kept()))) == []


def test_a_census_that_ran_out_of_time_is_left_out() -> None:
    """The census before the last did not finish: one complete census is too few."""
    partial = censuses(AT, _kept(), complete=[False, True])
    assert check(RULE, report(censuses=partial)) == []


def test_a_report_without_censuses_has_no_finding() -> None:
    assert check(RULE, report()) == []
