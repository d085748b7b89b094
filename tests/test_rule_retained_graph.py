"""``retained-graph`` on reports built by hand: a holder alive across iteration boundaries
whose autograd graph gains nodes at every census while it keeps as many tensors (a loss summed
without ``.item()``, a hidden state never detached, ``.grad`` built with ``create_graph=True``)
is a leak; an attribute that pins one graph of a fixed size is waste; a graph that piles up
because the holder gains tensors is tensor-accumulation's, not this rule's."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from builders import (
    KiB,
    Location,
    MiB,
    censuses,
    check,
    holder,
    holder_states,
    in_function,
    report,
)

from memsentry.model import Census, Finding, HolderKind, HolderStats, Severity, SubjectKind
from memsentry.rules.retained import PINNED_MIN_BYTES
from memsentry.usercode.feeds import Feed, rewritten

RULE = "retained-graph"
AT = [2, 4, 6, 8]
TRAIN = in_function("train")
LINE = Location("train.py", 30, "train")


def _summed_loss(**figures: Any) -> list[HolderStats]:
    """``epoch_loss += loss`` in ``train()``: one 4-byte scalar whose graph gains 10 nodes a
    census (backward freed what the nodes saved)."""
    return holder_states("epoch_loss", tensors=1, bytes=4, graph_tensors=1,
                         graph_nodes=[10, 20, 30, 40], scope=TRAIN, where=LINE, **figures)


def test_a_loss_summed_as_a_tensor_is_a_leak_of_graph_nodes_with_the_item_fix() -> None:
    """Field guide #1: after backward() only the nodes pile up, 5 a step."""
    (finding,) = check(RULE, report(censuses=censuses(AT, _summed_loss(added="loss"))))
    assert (finding.rule, finding.severity) == (RULE, Severity.LEAK)
    assert finding.subject is not None
    assert (finding.subject.kind, finding.subject.name) == (SubjectKind.HOLDER, "epoch_loss")
    assert finding.location == LINE
    assert (finding.bytes, finding.objects, finding.rate, finding.iteration) == (4, 40, None, 8)
    assert finding.message.startswith(
        "`epoch_loss` (a local of train(), train.py:30) keeps the autograd graph of every "
        "iteration: 40 graph nodes at iteration 8, +5 nodes/iter since iteration 2")
    assert "backward() freed their saved tensors, but the nodes themselves pile up" in (
        finding.message)
    assert finding.fix == ("accumulate a number, not the tensor: `epoch_loss += loss.item()` "
                           "(or `loss.detach()`)")


def test_a_hidden_state_never_detached_is_a_leak_of_saved_activations_with_the_detach_fix(
) -> None:
    """Field guide #4: the state ``h`` (64 KiB) carries a graph whose saved tensors gain
    1 MiB a census, two iterations apart."""
    h = holder_states("h", tensors=1, bytes=64 * KiB, graph_tensors=1,
                      graph_nodes=[100, 200, 300, 400],
                      graph_saved_bytes=[MiB, 2 * MiB, 3 * MiB, 4 * MiB], scope=TRAIN)
    (finding,) = check(RULE, report(censuses=censuses(AT, h)))
    assert finding.severity is Severity.LEAK
    assert finding.bytes == 64 * KiB + 4 * MiB
    assert finding.rate == MiB / 2
    assert "holding 4.0 MiB saved for backward (+512 KiB/iter)" in finding.message
    assert "cut the graph at each iteration: `h = h.detach()`" in finding.fix
    assert "truncated BPTT" in finding.fix


def test_a_value_handed_to_a_method_gets_the_fix_at_the_call_that_hands_it() -> None:
    """``losses.update(loss, n)`` stores the tensor in ``losses.sum``: the fix rewrites the
    call, and the finding points at it."""
    call = Location("train.py", 55, "train")
    feed = Feed(where=call, call="losses.update(loss, n)", argument="loss", start=14, end=18)
    meter = holder_states("losses.sum", tensors=1, bytes=4, graph_tensors=1,
                          graph_nodes=[10, 20, 30, 40], where=Location("meter.py", 9, "update"),
                          feed=feed)
    (finding,) = check(RULE, report(censuses=censuses(AT, meter)))
    assert finding.location == call
    assert finding.fix.startswith(
        "pass a number, not the tensor: `losses.update(loss.item(), n)` (train.py:55); "
        "`losses.update(loss, n)` stores `loss` and its graph in `losses.sum`")
    assert "set at meter.py:9 in `update()`, called from train.py:55" in finding.message


def test_the_number_fix_follows_how_the_line_adds_the_tensor() -> None:
    rewritten = _summed_loss(rewrite="ema = 0.9 * ema + 0.1 * loss.item()")
    unknown = _summed_loss()
    expression = _summed_loss(added="a + b")
    fixes = [check(RULE, report(censuses=censuses(AT, row)))[0].fix
             for row in (rewritten, unknown, expression)]
    assert fixes[0].startswith("accumulate a number, not the tensor: "
                               "`ema = 0.9 * ema + 0.1 * loss.item()`")
    assert "add `x.item()` to `epoch_loss` where it adds a tensor `x`" in fixes[1]
    assert "`epoch_loss += (a + b).item()`" in fixes[2]


def test_a_line_that_already_adds_a_number_or_a_detached_tensor_is_not_quoted() -> None:
    """The line found adds ``loss.item()`` (the tensor is added on another branch): the fix
    says where to look, not ``loss.item().item()``."""
    for added in ("loss.item()", "loss.detach()", "float(loss)"):
        (finding,) = check(RULE, report(censuses=censuses(AT, _summed_loss(added=added))))
        assert finding.fix == ("accumulate a number, not the tensor: add `x.item()` to "
                               "`epoch_loss` where it adds a tensor `x` (or `x.detach()`)")


def test_a_running_average_that_already_folds_in_a_number_is_not_rewritten(
        tmp_path: Path) -> None:
    """Of two lines folding the loss into ``ema``, the one that folds in ``loss.item()`` has
    no tensor to make a number; the other is rewritten."""
    source = tmp_path / "train.py"
    source.write_text("ema = 0.9 * ema + 0.1 * loss.item()\nema = 0.9 * ema + 0.1 * loss\n",
                      encoding="utf-8")
    assert rewritten(str(source), 1, "ema") is None
    assert rewritten(str(source), 2, "ema") == "ema = 0.9 * ema + 0.1 * loss.item()"


def test_an_attribute_that_pins_one_graph_is_waste_not_a_leak() -> None:
    """Field guide #11, single attribute: ``metric.cache`` is replaced each step by a 2 MiB
    tensor with its graph (50 nodes, 6 MiB saved): bounded, but one graph more at the peak."""
    pinned = holder("metric.cache", tensors=1, bytes=2 * MiB, graph_tensors=1,
                    graph_nodes=50, graph_saved_bytes=6 * MiB, scope=TRAIN)
    (finding,) = check(RULE, report(censuses=censuses(AT, pinned)))
    assert (finding.severity, finding.bytes, finding.objects) == (Severity.WASTE, 8 * MiB, 50)
    assert finding.rate is None and finding.iteration == 8
    assert finding.subject is not None and finding.subject.name == "metric.cache"
    assert ("keeps a tensor with its autograd graph across iterations (2.0 MiB of tensors, "
            "50 graph nodes, 6.0 MiB saved for backward): one extra graph is alive when the "
            "next forward starts, raising the peak") in finding.message
    assert finding.fix.startswith("store `.detach()` in `metric.cache`")


def test_a_pinned_graph_is_worth_a_finding_from_its_minimum_size() -> None:
    """A metric caching a 4-byte loss with its graph costs nothing worth changing code for:
    the tensor and what its graph saved must reach ``PINNED_MIN_BYTES``."""
    def pinned(saved: int) -> list[Finding]:
        cache = holder("metric._forward_cache", kind=HolderKind.INSTANCE, tensors=1, bytes=4,
                       graph_tensors=1, graph_nodes=3, graph_saved_bytes=saved)
        return check(RULE, report(censuses=censuses(AT, cache)))

    assert pinned(PINNED_MIN_BYTES - 4 - 1) == []
    assert [f.severity for f in pinned(PINNED_MIN_BYTES - 4)] == [Severity.WASTE]


def test_state_overwritten_each_call_without_a_graph_is_not_reported() -> None:
    """Field guide #30: ``self.last = x.argmax(-1)`` keeps a fixed size and no graph."""
    last = holder("self.last", kind=HolderKind.INSTANCE, tensors=1, bytes=8 * MiB)
    assert check(RULE, report(censuses=censuses(AT, last))) == []


def test_a_graph_seen_only_at_the_last_census_is_not_kept_across_iterations() -> None:
    cache = [None, None, None, holder("metric.cache", tensors=1, bytes=8 * MiB,
                                      graph_tensors=1, graph_nodes=50)]
    assert check(RULE, report(censuses=censuses(AT, cache))) == []


def test_a_local_that_holds_one_graph_of_a_fixed_size_is_left_to_loop_variables() -> None:
    out = holder("out", tensors=1, bytes=8 * MiB, graph_tensors=1, graph_nodes=50,
                 graph_saved_bytes=8 * MiB, scope=TRAIN)
    assert check(RULE, report(censuses=censuses(AT, out))) == []


def test_a_kept_exceptions_frames_are_left_to_exception_frames() -> None:
    traceback = holder("self.error.__traceback__", kind=HolderKind.INSTANCE, tensors=2,
                       bytes=4 * MiB, graph_tensors=2, graph_nodes=50)
    assert check(RULE, report(censuses=censuses(AT, traceback))) == []


def test_graphs_that_pile_up_with_the_tensors_kept_are_tensor_accumulations_not_this_rule(
) -> None:
    """Field guide #2: ``outs.append(model(x))``; the list gains a tensor with each graph."""
    outs = holder_states("outs", tensors=[2, 4, 6, 8], items=[2, 4, 6, 8],
                         bytes=[2 * MiB, 4 * MiB, 6 * MiB, 8 * MiB],
                         graph_tensors=[2, 4, 6, 8], graph_nodes=[20, 40, 60, 80])
    assert check(RULE, report(censuses=censuses(AT, outs))) == []


def test_parameter_gradients_built_with_create_graph_are_a_leak_when_their_graph_grows() -> None:
    """Field guide #5: ``backward(create_graph=True)`` and ``.grad`` never detached."""
    grads = holder_states("fc.weight.grad", kind=HolderKind.GRADIENT, items=4, tensors=4,
                          bytes=4 * MiB, graph_tensors=4, graph_nodes=[40, 80, 120, 160])
    (finding,) = check(RULE, report(censuses=censuses(AT, grads)))
    assert (finding.severity, finding.objects, finding.iteration) == (Severity.LEAK, 160, 8)
    assert finding.message.startswith(
        "`fc.weight.grad` and 3 more parameter .grad tensors carry a grad_fn at the iteration "
        "boundary (160 graph nodes, +20/iter): each backward(create_graph=True) adds to a "
        "graph that is never freed")
    assert "optimizer.zero_grad(set_to_none=True)" in finding.fix


def test_parameter_gradients_that_keep_one_graph_are_waste() -> None:
    grads = holder("fc.weight.grad", kind=HolderKind.GRADIENT, items=4, tensors=4,
                   bytes=4 * MiB, graph_tensors=4, graph_nodes=40)
    (finding,) = check(RULE, report(censuses=censuses(AT, grads)))
    assert finding.severity is Severity.WASTE
    assert "the graph of the last backward stays alive until the gradients are reset" in (
        finding.message)


def test_a_sum_reset_each_epoch_is_still_a_leak_and_the_message_says_it_fell() -> None:
    """Field guide #32: ``epoch_loss`` rebound at the epoch's start; the graph grew for the
    whole epoch before."""
    loss = holder_states("epoch_loss", tensors=1, bytes=4, graph_tensors=1,
                         graph_nodes=[10, 20, 30, 5, 10], scope=TRAIN)
    (finding,) = check(RULE, report(censuses=censuses([2, 3, 4, 6, 10], loss)))
    assert finding.severity is Severity.LEAK
    assert "30 graph nodes at iteration 4" in finding.message
    assert "it fell before iteration 6 (emptied or rebound) and grew again" in finding.message


def test_nodes_that_rose_at_one_step_only_are_not_a_climb() -> None:
    jump = _summed_loss()
    once = holder_states("epoch_loss", tensors=1, bytes=4, graph_tensors=1,
                         graph_nodes=[10, 10, 10, 40], scope=TRAIN)
    assert check(RULE, report(censuses=censuses(AT, jump)))
    assert check(RULE, report(censuses=censuses(AT, once))) == []


def test_two_censuses_are_too_few_to_see_a_graph_grow() -> None:
    assert check(RULE, report(censuses=censuses(AT[:2], _summed_loss()[:2]))) == []


def test_censuses_whose_graphs_were_too_large_to_walk_are_left_out() -> None:
    """Their node counts are lower bounds: with them left out two censuses remain."""
    partial = censuses(AT, _summed_loss(), graphs_complete=[True, True, False, False])
    assert check(RULE, report(censuses=partial)) == []


def test_a_report_without_censuses_has_no_finding() -> None:
    assert check(RULE, report()) == []


def _aged(taken: tuple[Census, ...], newest: list[int | None]) -> tuple[Census, ...]:
    """``taken`` with the newest autograd sequence number each census saw."""
    return tuple(replace(census, graph_newest=n) for census, n in zip(taken, newest,
                                                                     strict=True))


def test_a_graph_built_anew_every_step_is_not_a_retained_graph() -> None:
    """A GRU's loss over sequences 4 steps longer each time: its graph gains nodes from one
    census to the next, but each census's graph began after the one before had read its
    newest node (sequence numbers 100, 300...: built since); a summed loss keeps node 0."""
    def found(oldest: list[int]) -> list[Finding]:
        loss = holder_states("loss", tensors=1, bytes=4, graph_tensors=1,
                             graph_nodes=[10, 20, 30, 40], graph_oldest=oldest,
                             graph_newest=[o + 50 for o in oldest], scope=TRAIN, where=LINE)
        newest = [o + 50 for o in oldest]
        return check(RULE, report(censuses=_aged(censuses(AT, loss), newest)))

    assert found([100, 300, 600, 1000]) == []
    assert [f.severity for f in found([0, 0, 0, 0])] == [Severity.LEAK]
    assert [f.severity for f in found([100, 120, 600, 1000])] == [Severity.LEAK]  # once


def test_a_carried_census_does_not_prove_a_graph_reaches_back() -> None:
    """A carried census repeats the one before, graph and all: equal numbers prove nothing."""
    loss = holder_states("loss", tensors=1, bytes=4, graph_tensors=1,
                         graph_nodes=[10, 20, 20, 40], graph_oldest=[100, 300, 300, 1000],
                         graph_newest=[150, 350, 350, 1050], scope=TRAIN, where=LINE)
    taken = list(_aged(censuses(AT, loss), [150, 350, 350, 1050]))
    taken[2] = replace(taken[2], carried=AT[1])
    assert check(RULE, report(censuses=tuple(taken))) == []


def test_a_graph_must_keep_more_of_what_outlived_the_census_before() -> None:
    """A local and a global of one name (`output` in `train()` and the script's demo call)
    are one holder: its oldest node is the demo's, at every census, while the nodes it keeps
    from before the census before stay as many (the demo's 20). A summed loss keeps more of
    them at every census."""
    def found(kept: list[int]) -> list[Finding]:
        output = holder_states("output", tensors=1, bytes=4, graph_tensors=1,
                               graph_nodes=[40, 60, 80, 100], graph_oldest=3,
                               graph_newest=[150, 350, 550, 750], graph_kept=kept,
                               scope=TRAIN, where=LINE)
        return check(RULE, report(censuses=_aged(censuses(AT, output), [150, 350, 550, 750])))

    assert found([0, 20, 20, 20]) == []
    assert [f.severity for f in found([0, 40, 60, 80])] == [Severity.LEAK]
