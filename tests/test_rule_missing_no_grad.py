"""``missing-no-grad`` on reports built by hand: forward calls of an outermost module whose
graph no backward used (evaluation without ``torch.no_grad()``) are waste, the bytes they
saved for backward kept for nothing; calls that saved nothing are not."""

from __future__ import annotations

from typing import Any

from builders import Location, MiB, check, cost, report, unused_graph

from memsentry.model import Finding, Severity, SubjectKind, UnusedGraph

RULE = "missing-no-grad"
EVALUATE = Location("train.py", 70, "evaluate")


def _found(*unused: UnusedGraph, **fields: Any) -> list[Finding]:
    return check(RULE, report(unused_graphs=unused, **fields))


def test_evaluation_without_no_grad_is_waste_of_what_each_call_saved() -> None:
    """Field guide #14: ``model.eval(); out = model(x)`` in ``evaluate()``, five calls each
    saving 12 MiB for a backward that never comes."""
    (finding,) = _found(unused_graph("Net", calls=5, eval_calls=5, saved_bytes=12 * MiB,
                                     where=EVALUATE))
    assert (finding.rule, finding.severity) == (RULE, Severity.WASTE)
    assert (finding.bytes, finding.objects, finding.location) == (12 * MiB, 5, EVALUATE)
    assert finding.subject is not None
    assert (finding.subject.kind, finding.subject.name) == (SubjectKind.MODULE, "Net")
    assert finding.message == (
        "`Net` ran 5 forward passes with autograd on from evaluate() at train.py:70 (5 of them "
        "in eval() mode) whose graphs no backward used; each kept up to 12 MiB saved for "
        "backward for nothing, on top of the peak")
    assert "`with torch.no_grad():`" in finding.fix
    assert "`model.eval()` only switches dropout and batch norm" in finding.fix


def test_one_call_in_train_mode_is_told_in_the_singular() -> None:
    (finding,) = _found(unused_graph("Net", calls=1, saved_bytes=MiB,
                                     where=Location("infer.py", 3, "<module>")))
    assert finding.message.startswith(
        "`Net` ran 1 forward pass with autograd on at infer.py:3 (in train() mode) whose "
        "graph no backward used")


def test_calls_of_one_module_from_several_notebook_cells_are_one_finding() -> None:
    """A model looked at cell after cell: the cells are its sites, the first is the line."""
    cells = [unused_graph("Net", calls=2, saved_bytes=size, where=Location(f"In[{n}]", 1))
             for n, size in ((3, MiB), (4, 4 * MiB), (5, 2 * MiB), (6, MiB), (7, MiB))]
    (finding,) = _found(*cells)
    assert (finding.objects, finding.bytes) == (10, 4 * MiB)
    assert finding.location == Location("In[3]", 1)
    assert "ran 10 forward passes with autograd on in 5 notebook cells (In[3]:1, In[4]:1, " \
           "In[5]:1, In[6]:1, …)" in finding.message


def test_a_run_measured_in_part_says_the_count_is_a_lower_bound() -> None:
    (finding,) = _found(unused_graph("Net", calls=5, saved_bytes=MiB, where=EVALUATE),
                        cost=cost(iterations=100, sampled=20))
    assert "ran at least 5 forward passes" in finding.message
    assert "followed every module call in 20 of 100 iterations" in finding.message


def test_calls_left_unwatched_are_counted_as_not_judged() -> None:
    (finding,) = _found(unused_graph("Net", calls=5, saved_bytes=MiB, where=EVALUATE,
                                     unwatched=7))
    assert "ran at least 5 forward passes" in finding.message
    assert "7 more were not judged" in finding.message


def test_calls_whose_saved_bytes_were_not_measured_are_reported_by_their_count() -> None:
    (finding,) = _found(unused_graph("Net", calls=3, saved_bytes=None, where=EVALUATE))
    assert (finding.bytes, finding.objects) == (None, 3)
    assert "saved for backward for nothing" not in finding.message


def test_calls_that_saved_nothing_for_backward_waste_nothing() -> None:
    """A module of ops that save no tensor (a lookup, an elementwise add) run with autograd
    on: nothing was kept, no finding."""
    assert _found(unused_graph("Embedding", calls=50, saved_bytes=0, where=EVALUATE)) == []


def test_each_call_site_is_its_own_finding() -> None:
    found = _found(unused_graph("Net", calls=5, saved_bytes=MiB, where=EVALUATE),
                   unused_graph("Net", calls=2, saved_bytes=MiB,
                                where=Location("train.py", 90, "probe")))
    assert [f.location for f in found] == [EVALUATE, Location("train.py", 90, "probe")]


def test_a_report_where_every_graph_was_used_has_no_finding() -> None:
    assert check(RULE, report()) == []
