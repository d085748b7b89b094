"""``tensor-accumulation`` on reports built by hand: a holder that gains tensors, arrays,
autograd nodes, buffers or models from one census to the next (or keeps one tensor that grows
steadily) is a leak, named with the fix that fits what it keeps; a bounded window, a buffer of
a few numbers flushed every epoch and tensors whose size follows the batch are not."""

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
    Scope,
    ScopeKind,
    Severity,
    Step,
    StepKind,
    SubjectKind,
)
from memsentry.rules.holders import EXPLAINS, TOOTH_BYTES
from memsentry.rules.series import GROWING_BYTES, GROWING_POINTS, GROWING_STEADY, MIN_CENSUSES

RULE = "tensor-accumulation"
AT = [2, 4, 6, 8]
TRAIN = in_function("train")
LINE = Location("train.py", 30, "train")


def _found(*rows: Row, at: list[int] = AT, **fields: Any) -> list[Finding]:
    return check(RULE, report(censuses=censuses(at, *rows), **fields))


def _only(found: list[Finding]) -> Finding:
    assert len(found) == 1, [f.message for f in found]
    return found[0]


# -- what the rule exists for ----------------------------------------------------------------------
def test_outputs_appended_with_their_graph_are_a_leak_named_with_the_detach_fix() -> None:
    """Field guide #2: ``outs.append(model(x))``, one tensor (1 MiB, 2 MiB saved for
    backward) a step, censuses two steps apart."""
    outs = holder_states("outs", tensors=[2, 4, 6, 8], items=[2, 4, 6, 8],
                         bytes=[2 * MiB, 4 * MiB, 6 * MiB, 8 * MiB], graph_tensors=[2, 4, 6, 8],
                         graph_nodes=[20, 40, 60, 80],
                         graph_saved_bytes=[4 * MiB, 8 * MiB, 12 * MiB, 16 * MiB],
                         scope=TRAIN, where=LINE)
    finding = _only(_found(outs))
    assert (finding.rule, finding.severity) == (RULE, Severity.LEAK)
    assert finding.subject is not None
    assert (finding.subject.kind, finding.subject.name) == (SubjectKind.HOLDER, "outs")
    assert finding.location == LINE and finding.iteration == 8
    assert (finding.bytes, finding.objects, finding.rate) == (24 * MiB, 8, 3 * MiB)
    assert finding.message.startswith(
        "`outs` (a local of train(), train.py:30) gains 1 tensor/iter: 8 (8.0 MiB) at "
        "iteration 8, up from 2 at iteration 2")
    assert ("8 carry an autograd graph (grad_fn), which keeps their batch's graph (80 nodes, "
            "16 MiB saved for backward) alive") in finding.message
    assert finding.fix.startswith("store `.detach()`ed tensors")
    assert "torch.no_grad()" in finding.fix and "deque(maxlen=k)" in finding.fix


def test_detached_tensors_appended_every_step_are_a_leak_with_the_cpu_copy_fix() -> None:
    """Field guide #3: ``feats.append(f.detach())``: no graph, linear growth."""
    feats = holder_states("feats", tensors=[2, 4, 6, 8], items=[2, 4, 6, 8],
                          bytes=[64 * KiB, 128 * KiB, 192 * KiB, 256 * KiB])
    finding = _only(_found(feats))
    assert finding.rate == 32 * KiB
    assert "carry an autograd graph" not in finding.message
    assert finding.fix.startswith("keep less in `feats`: Python numbers (`.item()`, "
                                  "`.tolist()`) or a running aggregate")
    assert "`del feats[:-k]`" in finding.fix
    assert "(`.cpu()`) free a GPU's memory, not the host's" in finding.fix


def test_scalar_losses_kept_with_their_graph_get_the_item_fix() -> None:
    losses = holder_states("losses", tensors=[2, 4, 6, 8], items=[2, 4, 6, 8],
                           bytes=[8, 16, 24, 32], graph_tensors=[2, 4, 6, 8])
    assert _only(_found(losses)).fix.startswith(
        "store Python numbers: `.item()` (a `.detach()`ed scalar still adds a tensor every step)")


def test_models_kept_per_trial_are_named_as_whole_modules() -> None:
    """Field guide #12: ``results.append((lr, score, model))``, four parameters a model."""
    results = holder_states("results", tensors=[4, 8, 12, 16], modules=[1, 2, 3, 4],
                            items=[1, 2, 3, 4], bytes=[MiB, 2 * MiB, 3 * MiB, 4 * MiB])
    finding = _only(_found(results))
    assert "gains 2.5 tensors/iter: 20 (4.0 MiB)" in finding.message
    assert "; 4 of them are whole nn.Module objects" in finding.message
    assert finding.fix.startswith("keep results, not models")


def test_notebook_output_history_is_named_with_the_ipython_fix() -> None:
    """Field guide #13: a cell ends with a tensor, IPython's ``Out`` keeps it."""
    out = holder_states("Out", kind=HolderKind.GLOBAL, scope=Scope(ScopeKind.SCRIPT, "notebook"),
                        tensors=[1, 2, 3, 4], items=[1, 2, 3, 4],
                        bytes=[MiB, 2 * MiB, 3 * MiB, 4 * MiB])
    finding = _only(_found(out))
    assert "this is IPython's output history" in finding.message
    assert "`%reset -f out`" in finding.fix


def test_a_mutable_default_argument_is_named_with_the_none_default_fix() -> None:
    """Field guide #34: ``def record(x, kept=[])``, reached through the function."""
    kept = holder_states((Step(StepKind.ROOT, "record"),
                          Step(StepKind.ATTRIBUTE, "__defaults__[0]")),
                         kind=HolderKind.GLOBAL, tensors=[1, 2, 3, 4], items=[1, 2, 3, 4],
                         bytes=[MiB, 2 * MiB, 3 * MiB, 4 * MiB])
    finding = _only(_found(kept))
    assert "it is a mutable default argument, made once when the `def` ran" in finding.message
    assert finding.fix.startswith("default the argument to `None`")


def test_an_unbounded_lru_cache_keyed_by_the_step_is_named_with_cache_clear() -> None:
    cache = holder_states("table", kind=HolderKind.GLOBAL, container="lru_cache",
                          tensors=[2, 4, 6, 8], items=[2, 4, 6, 8],
                          bytes=[MiB, 2 * MiB, 3 * MiB, 4 * MiB])
    finding = _only(_found(cache))
    assert ("it is the cache of `table()` (`functools.lru_cache`/`cache`, unbounded), which "
            "keeps the arguments and result of every call with new arguments: 8 entries"
            ) in finding.message
    assert "`table.cache_clear()`" in finding.fix


def test_numpy_arrays_piling_up_are_counted_as_arrays() -> None:
    arrays = holder_states("preds", tensors=0, arrays=[2, 4, 6, 8], items=[2, 4, 6, 8],
                           bytes=[MiB, 2 * MiB, 3 * MiB, 4 * MiB])
    finding = _only(_found(arrays))
    assert "gains 1 NumPy array/iter" in finding.message
    assert "8 are NumPy arrays" in finding.message
    assert "(`np.save`)" in finding.fix


def test_autograd_nodes_kept_by_themselves_are_counted_as_nodes() -> None:
    fns = holder_states("grad_fns", tensors=0, nodes=[2, 4, 6, 8], items=[2, 4, 6, 8],
                        bytes=0, graph_nodes=[20, 40, 60, 80])
    finding = _only(_found(fns))
    assert "gains 1 autograd node/iter" in finding.message
    assert "backward() freed what they saved, the nodes stay in host memory" in finding.message
    assert "not `grad_fn` or `ctx` objects" in finding.fix


def test_a_loggers_history_is_one_finding_across_the_keys_that_grow() -> None:
    """Field guide #10: ``logger.history['loss']`` and ``['acc']`` each gain a tensor a
    census: one finding on the dict, naming its keys."""
    loss = holder_states("logger.history['loss']", tensors=[1, 2, 3, 4], bytes=[4, 8, 12, 16])
    acc = holder_states("logger.history['acc']", tensors=[1, 2, 3, 4], bytes=[4, 8, 12, 16])
    finding = _only(_found(loss, acc))
    assert finding.subject is not None and finding.subject.name == "logger.history"
    assert ("`logger.history` (held through `logger`, a local variable) gains 1 tensor/iter "
            "across its keys ['loss'], ['acc']: 8 (32 B) at iteration 8, up from 2 at "
            "iteration 2") in finding.message


def test_a_dict_given_a_new_key_each_step_names_the_first_keys_and_counts_the_rest() -> None:
    """``results[f"step{i}"] = out``: a key more at each census."""
    at = [2, 4, 6, 8, 10, 12]
    keys = [[None] * i + [holder(f"results['step{at[i]}']", tensors=1, bytes=MiB)]
            * (len(at) - i) for i in range(len(at))]
    finding = _only(_found(*keys, at=at))
    assert finding.subject is not None and finding.subject.name == "results"
    assert "across its keys ['step4'], ['step6'], ['step8'] and 2 more" in finding.message


def test_one_key_that_grows_beside_steady_ones_is_named_by_itself() -> None:
    train = holder_states("cache['train']", tensors=[1, 2, 3, 4], bytes=[MiB, 2 * MiB, 3 * MiB,
                                                                           4 * MiB])
    val = holder("cache['val']", tensors=1, bytes=MiB)
    finding = _only(_found(train, val))
    assert finding.subject is not None and finding.subject.name == "cache['train']"


def test_one_tensor_concatenated_onto_itself_is_a_leak_with_the_ring_buffer_fix() -> None:
    """``bank = torch.cat([bank, x])``: as many tensors, 64 KiB more each iteration, at five
    censuses."""
    bank = holder_states("bank", tensors=1, bytes=ramp(MiB, 128 * KiB, 5), scope=TRAIN,
                         where=LINE)
    finding = _only(_found(bank, at=[2, 4, 6, 8, 10]))
    assert (finding.severity, finding.rate, finding.bytes) == (
        Severity.LEAK, 64 * KiB, MiB + 512 * KiB)
    assert finding.message.startswith(
        "`bank` (a local of train(), train.py:30) grows by 64 KiB/iter: 1.5 MiB at iteration "
        "10, up from 1.0 MiB at iteration 2, while it keeps 1 tensor: a tensor made larger "
        "every iteration")
    assert "a ring buffer, `bank[i % k] = x`" in finding.fix


def test_a_bytearray_extended_every_step_is_named_as_a_buffer() -> None:
    buffer = holder_states("buf", tensors=0, buffers=1, bytes=ramp(MiB, 128 * KiB, 5))
    finding = _only(_found(buffer, at=[2, 4, 6, 8, 10]))
    assert "no tensor but 1 Python buffer (a bytearray" in finding.message
    assert "`del buf[:n]`" in finding.fix


# -- not a leak ------------------------------------------------------------------------------------
def test_a_deque_with_a_maxlen_is_a_window_not_a_leak() -> None:
    """Field guide #28: ``deque(maxlen=8)`` cannot pass 8, however it fills."""
    window = holder_states("window", bound=8, tensors=[2, 4, 6, 8], items=[2, 4, 6, 8],
                           bytes=[2 * MiB, 4 * MiB, 6 * MiB, 8 * MiB])
    assert _found(window) == []


def test_a_window_that_filled_up_and_stays_full_is_not_a_leak() -> None:
    """Field guide #28: judge the latest censuses, not the first against the last."""
    window = holder_states("recent", tensors=[2, 4, 6, 8, 8, 8], items=[2, 4, 6, 8, 8, 8],
                           bytes=[2 * MiB, 4 * MiB, 6 * MiB, 8 * MiB, 8 * MiB, 8 * MiB])
    assert _found(window, at=[2, 3, 4, 6, 10, 18]) == []


def _flushed(gain_per_iteration: int, graphs: bool = False) -> list[Census]:
    """A list gaining five tensors a step from 10 to 40 (censuses at 2, 4, 6, 8), and
    ``gain_per_iteration`` bytes an iteration, then emptied before the census at 10 (which
    sees the 5 added since)."""
    gained = [0, 2 * gain_per_iteration, 4 * gain_per_iteration, 6 * gain_per_iteration]
    buffer = holder_states("buffer", tensors=[10, 20, 30, 40, 5], items=[10, 20, 30, 40, 5],
                           bytes=[KiB + g for g in gained] + [KiB],
                           graph_tensors=[10, 20, 30, 40, 5] if graphs else 0)
    return list(censuses([2, 4, 6, 8, 10], buffer))


def test_a_buffer_of_numbers_flushed_every_epoch_is_bounded() -> None:
    """A few detached scalars flushed every N steps gain less than ``TOOTH_BYTES`` a step:
    the tooth alone is not a leak; from ``TOOTH_BYTES`` a step it grows with the epoch."""
    assert check(RULE, report(censuses=_flushed(TOOTH_BYTES - 1))) == []
    found = check(RULE, report(censuses=_flushed(TOOTH_BYTES)))
    assert [f.severity for f in found] == [Severity.LEAK]
    assert "it fell before iteration 10 (emptied or rebound)" in found[0].message


def test_outputs_with_graphs_kept_for_an_epoch_then_cleared_are_a_leak_however_small() -> None:
    """Field guide #2, the sawtooth form: each tooth kept graphs."""
    found = check(RULE, report(censuses=_flushed(1, graphs=True)))
    assert [f.severity for f in found] == [Severity.LEAK]


def test_tensors_whose_size_follows_the_batch_are_not_a_leak() -> None:
    """Variable sequence lengths: one tensor's bytes rise and fall at random."""
    batch = holder_states("x", tensors=1,
                          bytes=[3 * MiB, 5 * MiB, 2 * MiB, 6 * MiB, 4 * MiB, 7 * MiB])
    assert _found(batch, at=[2, 4, 6, 8, 10, 12]) == []


def test_the_models_own_tensors_are_not_a_leak() -> None:
    model = holder("model", kind=HolderKind.MODEL, tensors=8, bytes=40 * MiB, modules=1)
    assert _found(model) == []


def test_gradients_that_grow_are_left_to_retained_graph() -> None:
    grads = holder_states("fc.weight.grad", kind=HolderKind.GRADIENT, tensors=4, items=4,
                          bytes=ramp(MiB, 128 * KiB, 5))
    assert _found(grads, at=[2, 4, 6, 8, 10]) == []


# -- edges -----------------------------------------------------------------------------------------
def test_a_growing_tensor_leaks_from_growing_bytes_an_iteration() -> None:
    """Eight iterations between first and last census: ``GROWING_BYTES`` an iteration is a
    leak, a byte less is not."""
    def bank(per_iteration: int) -> list[Finding]:
        row = holder_states("bank", tensors=1, bytes=ramp(MiB, 2 * per_iteration, 5))
        return _found(row, at=[2, 4, 6, 8, 10])

    assert bank(GROWING_BYTES - 1) == []
    assert [f.rate for f in bank(GROWING_BYTES)] == [GROWING_BYTES]


def test_a_growing_tensor_needs_growing_points_censuses() -> None:
    at = [2 * (i + 1) for i in range(GROWING_POINTS)]
    bank = holder_states("bank", tensors=1, bytes=ramp(MiB, 256 * KiB, GROWING_POINTS))
    assert _found(bank[1:], at=at[1:]) == []
    assert len(_found(bank, at=at)) == 1


def test_a_growing_tensor_must_grow_at_a_steady_pace() -> None:
    """Steps of 64 KiB and up to ``GROWING_STEADY`` times that: steady; a step past it is what
    a batch-sized tensor does."""
    def bank(largest_step: float) -> list[Finding]:
        steps = [64 * KiB, int(largest_step), 64 * KiB, 64 * KiB]
        sizes = [MiB + sum(steps[:i]) for i in range(5)]
        return _found(holder_states("bank", tensors=1, bytes=sizes), at=[2, 4, 6, 8, 10])

    assert len(bank(GROWING_STEADY * 64 * KiB)) == 1
    assert bank(GROWING_STEADY * 64 * KiB + 1) == []


def test_three_censuses_name_a_growing_tensor_when_allocated_memory_grows_at_its_pace() -> None:
    """Fewer than ``GROWING_POINTS`` censuses, but the allocated counter climbs 1 MiB an
    iteration and the tensor 1 MiB too: within ``EXPLAINS`` of each other, it is the cause."""
    at = [4, 6, 8][:MIN_CENSUSES]
    bank = holder_states("bank", tensors=1, bytes=[4 * MiB, 6 * MiB, 8 * MiB])
    steady = iterations(ramp(100 * MiB, MiB, 10))
    (finding,) = _found(bank, at=at, iterations=steady)
    assert finding.rate == MiB
    assert _found(bank, at=at) == []  # no allocated growth to corroborate it


def test_allocated_growth_far_from_the_tensors_pace_does_not_name_it() -> None:
    at = [4, 6, 8]
    bank = holder_states("bank", tensors=1, bytes=[4 * MiB, 6 * MiB, 8 * MiB])
    within = iterations(ramp(100 * MiB, int(EXPLAINS * MiB), 10))
    beyond = iterations(ramp(100 * MiB, int(EXPLAINS * MiB) + 4 * KiB, 10))
    assert len(_found(bank, at=at, iterations=within)) == 1
    assert _found(bank, at=at, iterations=beyond) == []


def test_two_censuses_are_too_few_to_judge() -> None:
    outs = holder_states("outs", tensors=[2, 40], items=[2, 40], bytes=[2 * MiB, 40 * MiB])
    assert _found(outs, at=[2, 4]) == []


def test_censuses_that_ran_out_of_time_are_left_out() -> None:
    outs = holder_states("outs", tensors=[2, 4, 6, 8], items=[2, 4, 6, 8],
                         bytes=[2 * MiB, 4 * MiB, 6 * MiB, 8 * MiB])
    assert len(_found(outs)) == 1
    partial = censuses(AT, outs, complete=[True, False, False, True])
    assert check(RULE, report(censuses=partial)) == []


def test_a_report_without_censuses_has_no_finding() -> None:
    assert check(RULE, report(iterations=iterations(ramp(100 * MiB, MiB, 10)))) == []


def test_a_tensor_bound_anew_every_step_grows_with_its_input_and_is_not_a_leak() -> None:
    """``x = torch.randn(8 + 4 * step, 32, 16)`` (a length curriculum): one tensor, larger at
    every census at a steady pace, but the code binds it afresh before it is filled; the same
    figures from ``bank = torch.cat([bank, x])`` are a leak."""
    def row(rebound: bool | None) -> list[HolderStats]:
        return holder_states("x", tensors=1, bytes=ramp(MiB, 128 * KiB, 5), scope=TRAIN,
                             where=LINE, rebound=rebound)

    assert _found(row(True), at=[2, 4, 6, 8, 10]) == []
    assert len(_found(row(False), at=[2, 4, 6, 8, 10])) == 1
    assert len(_found(row(None), at=[2, 4, 6, 8, 10])) == 1  # no line read: judged as before


def test_a_tensor_built_from_itself_may_grow_faster_and_faster() -> None:
    """``bank = torch.cat([bank, out])`` where ``out`` is longer at every step: the bank
    gains more at each census (7, 9, 11, 16, 25 and 43 KiB an iteration, a GRU's outputs over a
    length curriculum), more than ``GROWING_STEADY`` times apart. Built from itself on the
    line that fills it, it is a leak; with no line read, rates that far apart are not called
    one."""
    sizes = [12288, 19456, 28160, 50176, 112640, 311296, 1003520]
    at = [2, 3, 4, 6, 10, 18, 34]

    def row(rebound: bool | None) -> list[HolderStats]:
        return holder_states("bank", tensors=1, bytes=sizes, scope=TRAIN, where=LINE,
                             rebound=rebound)

    (finding,) = _found(row(False), at=at)
    assert finding.severity is Severity.LEAK
    assert "while it keeps 1 tensor" in finding.message
    assert _found(row(None), at=at) == []
    assert _found(row(True), at=at) == []
    # A window bounded by slicing (`torch.cat([window, out])[-k:]`) rises while it fills, then
    # follows the batch: its pace falls (400, 350, then 25 KiB an iteration), no leak.
    window = holder_states("window", tensors=1, scope=TRAIN, where=LINE, rebound=False,
                           bytes=[300 * KiB, 700 * KiB, 1050 * KiB, 1100 * KiB, 1150 * KiB,
                                  1300 * KiB])
    assert _found(window, at=at[:-1]) == []


def test_a_list_made_anew_each_step_is_not_judged_by_its_length() -> None:
    """``outs = []`` at the top of the step, then one output a time step: longer sequences
    make it longer at every census; it keeps nothing of the step before."""
    outs = holder_states("outs", tensors=[8, 12, 16, 20, 24], bytes=ramp(MiB, 128 * KiB, 5))
    assert len(_found(outs, at=[2, 4, 6, 8, 10])) == 1
    rebuilt = holder_states("outs", tensors=[8, 12, 16, 20, 24],
                            bytes=ramp(MiB, 128 * KiB, 5), rebound=True)
    assert _found(rebuilt, at=[2, 4, 6, 8, 10]) == []
