"""``hook-accumulation`` on reports built by hand: a module whose user hooks are counted higher
at every census (a hook registered inside the loop, its handle dropped) is a leak; hooks
registered once, or a count that filled up and stays, are not."""

from __future__ import annotations

from builders import Location, censuses, check, hook_states, report

from memsentry.model import Severity, SubjectKind
from memsentry.rules.series import MIN_CENSUSES

RULE = "hook-accumulation"
AT = [2, 4, 6, 8]
LOG_HOOK = Location("train.py", 12, "log_activation")
REGISTERED = Location("train.py", 40)


def test_a_hook_registered_at_every_step_is_a_leak_named_by_its_module_and_line() -> None:
    """Two hooks a census apart, the newest one's definition and registering line known: the
    finding names the module, the rate, the hook and the line to change."""
    hooks = hook_states("encoder.fc", [2, 4, 6, 8], hook="log_activation", where=LOG_HOOK,
                        registered=REGISTERED)
    (finding,) = check(RULE, report(censuses=censuses(AT, hooks=[hooks])))
    assert (finding.rule, finding.severity) == (RULE, Severity.LEAK)
    assert finding.subject is not None
    assert (finding.subject.kind, finding.subject.name) == (SubjectKind.MODULE, "encoder.fc")
    assert finding.objects == 8 and finding.iteration == 8
    assert finding.location == REGISTERED
    assert ("`encoder.fc` gains 1 hook/iter: 8 user hooks at iteration 8, up from 2 at "
            "iteration 2") in finding.message
    assert ("(newest: `log_activation`, registered at train.py:40, defined at train.py:12)"
            in finding.message)
    assert "each step is slower than the last" in finding.message
    assert "register the hook once, before the loop" in finding.fix
    assert "handle.remove()" in finding.fix


def test_without_the_registering_line_the_finding_points_at_the_hooks_definition() -> None:
    hooks = hook_states("encoder.fc", [1, 2, 3, 4], hook="log_activation", where=LOG_HOOK)
    (finding,) = check(RULE, report(censuses=censuses(AT, hooks=[hooks])))
    assert finding.location == LOG_HOOK
    assert "(newest: `log_activation`, defined at train.py:12)" in finding.message


def test_hooks_registered_globally_are_named_as_such() -> None:
    hooks = hook_states(None, [1, 2, 3, 4])
    (finding,) = check(RULE, report(censuses=censuses(AT, hooks=[hooks])))
    assert finding.subject is not None and finding.subject.name == "<global hooks>"
    assert finding.message.startswith("hooks registered globally gains 0.5 hook")
    assert "(newest: a hook)" in finding.message


def test_only_the_module_whose_hooks_climb_is_named() -> None:
    steady = hook_states("decoder", [3, 3, 3, 3], hook="probe")
    climbing = hook_states("encoder", [1, 2, 3, 4], hook="probe")
    found = check(RULE, report(censuses=censuses(AT, hooks=[steady, climbing])))
    assert [f.subject.name for f in found if f.subject] == ["encoder"]


def test_hooks_registered_once_before_the_loop_are_not_a_leak() -> None:
    hooks = hook_states("encoder", [4, 4, 4, 4], hook="probe", registered=REGISTERED)
    assert check(RULE, report(censuses=censuses(AT, hooks=[hooks]))) == []


def test_hooks_that_were_added_for_a_while_and_then_stay_are_not_a_leak() -> None:
    """A hook registered per layer during the first steps (lazy set-up), then no more: the
    latest censuses see a flat count."""
    hooks = hook_states("encoder", [1, 2, 3, 3, 3, 3], hook="probe")
    assert check(RULE, report(censuses=censuses([2, 3, 4, 6, 10, 18], hooks=[hooks]))) == []


def test_hooks_removed_and_registered_again_each_step_are_not_a_leak() -> None:
    """A count that goes up and down around a level (a handle removed at the end of the
    step) is noise, not a climb."""
    hooks = hook_states("encoder", [1, 2, 1, 2, 1, 2], hook="probe")
    assert check(RULE, report(censuses=censuses([2, 3, 4, 6, 10, 18], hooks=[hooks]))) == []


def test_a_count_that_climbs_within_each_epoch_and_falls_at_its_start_is_a_leak() -> None:
    """Hooks piled up for an epoch, most removed at its end, piling up again: the tooth is
    the evidence (field guide #32: a leak that hides behind a reset)."""
    hooks = hook_states("encoder", [1, 2, 3, 5, 1, 2], hook="probe")
    (finding,) = check(RULE, report(censuses=censuses([2, 3, 4, 6, 10, 18], hooks=[hooks])))
    assert finding.severity is Severity.LEAK


def test_hooks_all_removed_at_the_end_of_an_epoch_leave_the_tooth_judged_as_a_leak() -> None:
    """As in the test above, but the epoch's end removed every hook of the module, so the
    last census does not list it at all."""
    hooks = [*hook_states("encoder", [1, 2, 3, 5], hook="probe"), None]
    (finding,) = check(RULE, report(censuses=censuses([2, 3, 4, 6, 10], hooks=[hooks])))
    assert (finding.severity, finding.subject and finding.subject.name) == (
        Severity.LEAK, "encoder")


def test_a_climb_needs_three_censuses() -> None:
    """Two censuses are one step: no trend to judge, however steep; the third makes one."""
    steep = hook_states("encoder", [1, 50, 100], hook="probe")
    enough = censuses([2, 4, 6][:MIN_CENSUSES], hooks=[steep[:MIN_CENSUSES]])
    too_few = censuses([2, 4], hooks=[steep[:MIN_CENSUSES - 1]])
    assert check(RULE, report(censuses=too_few)) == []
    assert [f.severity for f in check(RULE, report(censuses=enough))] == [Severity.LEAK]


def test_a_count_that_stopped_rising_at_the_last_census_is_not_judged_a_climb() -> None:
    still = hook_states("encoder", [1, 2, 3, 4], hook="probe")
    stopped = hook_states("encoder", [1, 2, 3, 3], hook="probe")
    assert check(RULE, report(censuses=censuses(AT, hooks=[still])))
    assert check(RULE, report(censuses=censuses(AT, hooks=[stopped]))) == []


def test_censuses_that_ran_out_of_time_are_left_out() -> None:
    """Four censuses whose counts climb, the first two interrupted by their time budget (an
    interrupted census undercounts): the two complete ones are too few to judge."""
    hooks = hook_states("encoder", [1, 2, 3, 4], hook="probe")
    partial = censuses(AT, hooks=[hooks], complete=[False, False, True, True])
    assert check(RULE, report(censuses=censuses(AT, hooks=[hooks])))
    assert check(RULE, report(censuses=partial)) == []


def test_a_report_without_censuses_has_no_finding() -> None:
    assert check(RULE, report()) == []
