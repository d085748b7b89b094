"""A fix, applied as its text says, clears the finding that gave it, or the text says what
remains and why. Each test runs a small CPU loop with the leak, asserts the finding and the
words of its fix, then runs the same loop with the fix applied as written (each alternative
the text offers) and asserts the finding is gone and no other LEAK came:

- ``tensor-accumulation``: validation outputs kept, with and without their graphs;
- ``retained-graph``: a loss summed as a tensor, a running average of it, an RNN state never
  detached, ``.grad`` built with ``create_graph=True``, a module attribute that pins a graph;
- ``missing-no-grad``: an evaluation pass with autograd on;
- ``hook-accumulation``: a forward hook registered at every step;
- ``reference-cycle``: objects pointing at each other with gc disabled or rarely run, a
  scheduler lambda capturing ``self``, a tensor stored on an ``autograd.Function``'s ctx;
- ``exception-frames``: an out-of-memory retry that keeps the error.

``memory-growth`` is left out: where it is the finding given, its fix is a checklist of
places to look, not a change to apply."""

from __future__ import annotations

import gc
import traceback
import warnings
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import pytest
import torch
from conftest import make_mlp
from torch import nn

import memsentry
from memsentry import Finding, Report, Severity

STEPS = 40
K = 3
#: Steps of the loops below: enough censuses (iterations 2, 3, 4, 6, 10) to see a climb.
SHORT = 12


def _loop(*, detach: bool, no_grad: bool, trim: bool) -> tuple[Report, list[torch.Tensor]]:
    """An MLP trained 40 steps; every second step a validation batch's outputs are kept in
    ``val_outputs`` (with their graphs unless ``detach`` or ``no_grad``; the last ``K`` only
    with ``trim``)."""
    torch.manual_seed(0)
    model = make_mlp(16, 64, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    val_outputs: list[torch.Tensor] = []
    with memsentry.track(model, on_leak="ignore") as tracker:
        for step in range(STEPS):
            loss = nn.functional.mse_loss(model(torch.randn(32, 16)), torch.zeros(32, 4))
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % 2 == 0:
                if no_grad:
                    with torch.no_grad():
                        out = model(torch.randn(64, 16))
                else:
                    out = model(torch.randn(64, 16))
                val_outputs.append(out.detach() if detach else out)
                if trim:
                    del val_outputs[:-K]
    return tracker.report(), val_outputs[-1:]


def _about_outputs(report: Report) -> list[memsentry.Finding]:
    return [f for f in report.findings if f.severity is Severity.LEAK
            and f.subject is not None and f.subject.name == "val_outputs"]


def test_the_graph_fix_says_the_list_still_grows_and_trimming_it_clears_the_leak() -> None:
    report, _ = _loop(detach=False, no_grad=False, trim=False)
    (leak,) = _about_outputs(report)
    assert leak.rule == "tensor-accumulation"
    assert "run evaluation under `torch.no_grad()`: that frees their graphs" in leak.fix
    assert "`val_outputs` still gains a tensor each time" in leak.fix
    assert "`del val_outputs[:-k]`" in leak.fix

    # Its first half, applied: the graphs go, the list still grows, as the text said.
    report, _ = _loop(detach=True, no_grad=True, trim=False)
    (still,) = _about_outputs(report)
    assert still.rule == "tensor-accumulation"
    assert "carry an autograd graph" not in still.message
    assert "`del val_outputs[:-k]`" in still.fix

    # All of it, applied: no finding about the list, and its last item still slices.
    report, last = _loop(detach=True, no_grad=True, trim=True)
    assert _about_outputs(report) == []
    assert not any(f.severity is Severity.LEAK for f in report.findings), report.findings
    assert len(last) == 1 and last[0].shape == (64, 4)


# -- helpers shared by the loops below ------------------------------------------------------


class _Classifier(nn.Module):
    """Two named parts, so that findings name ``encoder`` and ``head``."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(16, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.encoder(x)))


def _setup() -> tuple[_Classifier, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = _Classifier()
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _loss(model: nn.Module) -> torch.Tensor:
    return nn.functional.mse_loss(model(torch.randn(32, 16)), torch.zeros(32, 4))


def _train_step(model: nn.Module, opt: torch.optim.Optimizer) -> torch.Tensor:
    loss = _loss(model)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


def _only(report: Report, rule: str) -> Finding:
    """The one finding of ``rule`` in the report."""
    (finding,) = [f for f in report.findings if f.rule == rule]
    return finding


def _cleared(report: Report, rule: str) -> None:
    """The report has no finding of ``rule`` and no LEAK of any rule."""
    assert [f for f in report.findings if f.rule == rule] == [], report.findings
    assert not [f for f in report.findings if f.severity is Severity.LEAK], report.findings


def _subject(finding: Finding) -> str | None:
    return finding.subject.name if finding.subject is not None else None


# -- retained-graph -------------------------------------------------------------------------


def _summed_loss(add: str) -> Report:
    """The training loss summed into ``total_loss`` at every step: as the tensor
    (``add="tensor"``), as a number (``"item"``) or detached (``"detach"``)."""
    model, opt = _setup()
    total_loss = torch.zeros(())
    with memsentry.track(model, on_leak="ignore") as tracker:
        for _ in range(SHORT):
            loss = _train_step(model, opt)
            if add == "tensor":
                total_loss += loss
            elif add == "item":
                total_loss += loss.item()
            else:
                total_loss += loss.detach()
    return tracker.report()


def test_summing_loss_item_or_a_detached_loss_clears_the_retained_graph() -> None:
    leak = _only(_summed_loss("tensor"), "retained-graph")
    assert (leak.severity, _subject(leak)) == (Severity.LEAK, "total_loss")
    assert leak.fix == ("accumulate a number, not the tensor: `total_loss += loss.item()` "
                        "(or `loss.detach()`)")

    # `total_loss += loss.item()`, as the text writes it.
    _cleared(_summed_loss("item"), "retained-graph")
    # Its alternative: `total_loss += loss.detach()`.
    _cleared(_summed_loss("detach"), "retained-graph")


def _summed_loss_number_first(item: bool) -> Report:
    """:func:`_summed_loss` with the line that adds a number written before the one that
    adds the tensor."""
    model, opt = _setup()
    total_loss = torch.zeros(())
    with memsentry.track(model, on_leak="ignore") as tracker:
        for _ in range(SHORT):
            loss = _train_step(model, opt)
            if item:
                total_loss += loss.item()
            else:
                total_loss += loss
    return tracker.report()


def test_a_line_that_already_adds_a_number_is_not_quoted_as_the_fix() -> None:
    # The first line that adds to `total_loss` adds `loss.item()`: quoting it would give
    # `loss.item().item()`, which fails on a float. The text says where to look instead.
    leak = _only(_summed_loss_number_first(item=False), "retained-graph")
    assert (leak.severity, _subject(leak)) == (Severity.LEAK, "total_loss")
    assert ".item().item()" not in leak.fix
    assert leak.fix == ("accumulate a number, not the tensor: add `x.item()` to `total_loss` "
                        "where it adds a tensor `x` (or `x.detach()`)")

    # `x.item()` added where the loop added the tensor `loss`.
    _cleared(_summed_loss_number_first(item=True), "retained-graph")


def _running_average(kept: str) -> Report:
    """An exponential moving average of the loss, folded in as the tensor
    (``kept="tensor"``), as a number (``"item"``) or detached (``"detach"``)."""
    model, opt = _setup()
    loss_ema = torch.zeros(())
    with memsentry.track(model, on_leak="ignore") as tracker:
        for _ in range(SHORT):
            loss = _train_step(model, opt)
            if kept == "tensor":
                loss_ema = 0.9 * loss_ema + 0.1 * loss
            elif kept == "item":
                loss_ema = 0.9 * loss_ema + 0.1 * loss.item()
            else:
                loss_ema = 0.9 * loss_ema + 0.1 * loss.detach()
    return tracker.report()


def test_a_running_average_rewritten_with_item_clears_the_retained_graph() -> None:
    leak = _only(_running_average("tensor"), "retained-graph")
    assert (leak.severity, _subject(leak)) == (Severity.LEAK, "loss_ema")
    assert leak.fix == ("accumulate a number, not the tensor: "
                        "`loss_ema = 0.9 * loss_ema + 0.1 * loss.item()` "
                        "(or `.detach()` the tensor)")

    # The line as the text rewrites it.
    _cleared(_running_average("item"), "retained-graph")
    # Its alternative: `0.1 * loss.detach()`.
    _cleared(_running_average("detach"), "retained-graph")


def _rnn_chunks(detach: bool) -> Report:
    """Truncated backpropagation through a GRU, one chunk a step; without ``detach`` the
    hidden state carries every chunk's graph and backward retains it."""
    torch.manual_seed(0)
    rnn = nn.GRU(8, 16, batch_first=True)
    hidden = torch.zeros(1, 4, 16)
    with memsentry.track(rnn, on_leak="ignore") as tracker:
        for _ in range(SHORT):
            if detach:
                hidden = hidden.detach()
            out, hidden = rnn(torch.randn(4, 5, 8), hidden)
            out.pow(2).mean().backward(retain_graph=not detach)
            tracker.step()
    return tracker.report()


def test_detaching_the_hidden_state_clears_the_retained_graph() -> None:
    leak = _only(_rnn_chunks(detach=False), "retained-graph")
    assert (leak.severity, _subject(leak)) == (Severity.LEAK, "hidden")
    assert "cut the graph at each iteration: `hidden = hidden.detach()` before it is used " \
        "again (truncated BPTT)" in leak.fix
    assert "drop retain_graph=True once nothing reaches back" in leak.fix

    # `hidden = hidden.detach()` before the next chunk, and backward without retain_graph.
    _cleared(_rnn_chunks(detach=True), "retained-graph")


def _second_order(grads: str) -> Report:
    """Gradients built with ``create_graph=True`` and never reset (``grads="kept"``), reset
    after each step (``"zero_grad"``), detached (``"detach"``), or a gradient penalty taken
    with ``torch.autograd.grad`` instead (``"autograd.grad"``)."""
    model, opt = _setup()
    params = list(model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns of the .grad cycle
        with memsentry.track(model, on_leak="ignore") as tracker:
            for _ in range(SHORT):
                loss = _loss(model)
                if grads == "autograd.grad":
                    first = torch.autograd.grad(loss, params, create_graph=True)
                    (loss + 0.01 * sum(g.pow(2).sum() for g in first)).backward()
                else:
                    loss.backward(create_graph=True)
                opt.step()
                if grads == "zero_grad":
                    opt.zero_grad(set_to_none=True)
                elif grads == "detach":
                    for p in params:
                        p.grad = p.grad.detach()
    for p in params:
        p.grad = None  # break the cycle .grad -> graph -> parameter
    return tracker.report()


def test_resetting_or_detaching_create_graph_gradients_clears_the_retained_graph() -> None:
    leak = _only(_second_order("kept"), "retained-graph")
    assert (leak.severity, _subject(leak)) == (Severity.LEAK, "encoder.weight.grad")
    assert "detach or reset the gradients before the next step" in leak.fix
    assert "`optimizer.zero_grad(set_to_none=True)`" in leak.fix
    assert "`p.grad = p.grad.detach()`" in leak.fix
    assert "use torch.autograd.grad(..., create_graph=True) for higher-order terms instead " \
        "of .grad" in leak.fix

    # Each of the three, applied.
    _cleared(_second_order("zero_grad"), "retained-graph")
    _cleared(_second_order("detach"), "retained-graph")
    _cleared(_second_order("autograd.grad"), "retained-graph")


class _KeepsLast(nn.Module):
    """Keeps its 1 MiB hidden activation in ``self.last`` (with its graph, unless
    ``detach``)."""

    def __init__(self, detach: bool) -> None:
        super().__init__()
        self.hidden = nn.Linear(16, 8192)
        self.head = nn.Linear(8192, 4)
        self.detach = detach
        self.last: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.hidden(x)
        self.last = h.detach() if self.detach else h
        return self.head(h)


def _pinned(*, detach: bool, clear: bool) -> Report:
    torch.manual_seed(0)
    model = _KeepsLast(detach)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with memsentry.track(model, on_leak="ignore") as tracker:
        for _ in range(SHORT):
            _train_step(model, opt)
            if clear:
                model.last = None
    return tracker.report()


def test_storing_a_detached_tensor_or_clearing_the_attribute_clears_the_pinned_graph() -> None:
    waste = _only(_pinned(detach=False, clear=False), "retained-graph")
    assert (waste.severity, _subject(waste)) == (Severity.WASTE, "model.last")
    assert waste.fix == ("store `.detach()` in `model.last` (or `.item()` for a number), "
                         "or clear it once it has been used")

    # `self.last = h.detach()`.
    _cleared(_pinned(detach=True, clear=False), "retained-graph")
    # `model.last = None` once the step has used it.
    _cleared(_pinned(detach=False, clear=True), "retained-graph")


# -- missing-no-grad ------------------------------------------------------------------------


def _guard(mode: str) -> AbstractContextManager[Any]:
    if mode == "no_grad":
        return torch.no_grad()
    if mode == "inference_mode":
        return torch.inference_mode()
    return nullcontext()


def _evaluate(model: nn.Module, batches: list[torch.Tensor], mode: str) -> int:
    """An evaluation pass in eval() mode, under ``_guard(mode)``."""
    model.eval()
    found = 0
    with _guard(mode):
        for x in batches:
            found += int(model(x).argmax(-1).eq(0).sum())
    model.train()
    return found


def _evaluated_every_step(mode: str) -> Report:
    model, opt = _setup()
    batches = [torch.randn(256, 16) for _ in range(2)]
    with memsentry.track(model, on_leak="ignore") as tracker:
        for _ in range(SHORT):
            _train_step(model, opt)
            _evaluate(model, batches, mode)
    return tracker.report()


def test_evaluating_under_no_grad_or_inference_mode_clears_missing_no_grad() -> None:
    waste = _only(_evaluated_every_step("none"), "missing-no-grad")
    assert (waste.severity, _subject(waste)) == (Severity.WASTE, "_Classifier")
    assert "from _evaluate()" in waste.message
    assert waste.fix.startswith("run evaluation and inference under `with torch.no_grad():` "
                                "(or `torch.inference_mode()`)")
    assert "`model.eval()` only switches dropout and batch norm, it leaves autograd on" \
        in waste.fix

    # `with torch.no_grad():`, then its alternative `torch.inference_mode()`.
    _cleared(_evaluated_every_step("no_grad"), "missing-no-grad")
    _cleared(_evaluated_every_step("inference_mode"), "missing-no-grad")


# -- hook-accumulation ----------------------------------------------------------------------


def _log_activation(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
    output.detach().abs().mean()


def _hooked(register: str) -> Report:
    """A forward hook on ``head`` registered at every step and its handle dropped
    (``register="every step"``), registered once before the loop (``"once"``), or removed
    through its handle after the step (``"removed"``)."""
    model, opt = _setup()
    with memsentry.track(model, on_leak="ignore") as tracker:
        if register == "once":
            model.head.register_forward_hook(_log_activation)
        for _ in range(SHORT):
            if register != "once":
                handle = model.head.register_forward_hook(_log_activation)
            _train_step(model, opt)
            if register == "removed":
                handle.remove()
    return tracker.report()


def test_registering_the_hook_once_or_removing_it_clears_hook_accumulation() -> None:
    leak = _only(_hooked("every step"), "hook-accumulation")
    assert (leak.severity, _subject(leak)) == (Severity.LEAK, "head")
    assert "(newest: `_log_activation`" in leak.message
    assert leak.fix == ("register the hook once, before the loop; or keep the handle it "
                        "returns and call `handle.remove()` when done with it")

    # Registered once, before the loop; then every step's removed through its handle.
    _cleared(_hooked("once"), "hook-accumulation")
    _cleared(_hooked("removed"), "hook-accumulation")


# -- reference-cycle ------------------------------------------------------------------------


class _Node:
    """Two of these pointing at each other make a cycle that owns their payloads."""

    def __init__(self, payload: torch.Tensor | None) -> None:
        self.payload = payload
        self.partner: _Node | weakref.ref[_Node] | None = None


@contextmanager
def _collector(enabled: bool) -> Iterator[None]:
    """The garbage collector off, or on but rarely run (a threshold of a million)."""
    was_enabled, threshold = gc.isenabled(), gc.get_threshold()
    gc.collect()
    if enabled:
        gc.enable()
        gc.set_threshold(1_000_000)
    else:
        gc.disable()
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        if was_enabled:
            gc.enable()
        else:
            gc.disable()
        gc.collect()


def _cycles(*, gc_on: bool, links: str = "strong", drop: bool = False,
            collect_every: int | None = None) -> Report:
    """Two 256 KiB tensors a step, each on a ``_Node`` pointing at the other (``links``
    "strong" or "weak"); with ``drop`` the nodes let go of their tensors when done; with
    ``collect_every`` the loop calls ``gc.collect()`` every that many steps."""
    model, opt = _setup()
    with _collector(gc_on), memsentry.track(model, on_leak="ignore") as tracker:
        for step in range(SHORT):
            _train_step(model, opt)
            a, b = _Node(torch.ones(64 * 1024)), _Node(torch.ones(64 * 1024))
            if links == "weak":
                a.partner, b.partner = weakref.ref(b), weakref.ref(a)
            else:
                a.partner, b.partner = b, a
            if drop:
                a.payload = b.payload = None
            del a, b
            if collect_every is not None and step % collect_every == collect_every - 1:
                gc.collect()
    return tracker.report()


@pytest.fixture(scope="module")
def cycle_leak() -> Finding:
    """The finding of the cycles with the garbage collector disabled."""
    return _only(_cycles(gc_on=False), "reference-cycle")


def test_weak_back_references_or_dropped_tensors_clear_the_reference_cycle_leak(
        cycle_leak: Finding) -> None:
    assert (cycle_leak.severity, _subject(cycle_leak)) == (Severity.LEAK, "_Node")
    assert "the garbage collector is disabled, so nothing frees them" in cycle_leak.message
    assert cycle_leak.fix.startswith("break the cycle: give back-references as `weakref.ref`")
    assert "drop references to tensors when an object is done" in cycle_leak.fix

    # `b.partner = weakref.ref(a)`: no cycle.
    _cleared(_cycles(gc_on=False, links="weak"), "reference-cycle")
    # The cycle stays, but it owns no tensor once the nodes let go of them.
    _cleared(_cycles(gc_on=False, drop=True), "reference-cycle")


def test_gc_collect_with_gc_disabled_leaves_the_waste_its_fix_says(
        cycle_leak: Finding) -> None:
    assert "; with gc disabled, call `gc.collect()` every few iterations: each call frees " \
        "the cycles made since the one before" in cycle_leak.fix
    assert "memory still rises between calls (waste, not a leak) until the cycle is broken" \
        in cycle_leak.fix

    # `gc.collect()` every two steps: no leak; the waste the text said is what remains.
    report = _cycles(gc_on=False, collect_every=2)
    waste = _only(report, "reference-cycle")
    assert (waste.severity, _subject(waste)) == (Severity.WASTE, "_Node")
    assert "the garbage collector is disabled, so only those calls free them: memory rises " \
        "until the next one, then drops (a sawtooth)" in waste.message
    assert "`gc.collect()` calls freed" in waste.message
    assert "gc.collect()" not in waste.fix  # done: breaking the cycle is what is left
    assert waste.fix.startswith("break the cycle: give back-references as `weakref.ref`")
    assert not [f for f in report.findings if f.severity is Severity.LEAK], report.findings


def test_weak_back_references_or_dropped_tensors_clear_the_waste_of_rare_collections() -> None:
    waste = _only(_cycles(gc_on=True), "reference-cycle")
    assert (waste.severity, _subject(waste)) == (Severity.WASTE, "_Node")
    assert "memory rises until the collector runs, then drops (a sawtooth)" in waste.message
    assert waste.fix.startswith("break the cycle: give back-references as `weakref.ref`")
    assert "drop references to tensors when an object is done" in waste.fix
    assert "gc.collect()" not in waste.fix  # the collector runs

    _cleared(_cycles(gc_on=True, links="weak"), "reference-cycle")
    _cleared(_cycles(gc_on=True, drop=True), "reference-cycle")


class _Trial:
    """A trial whose scheduler's lambda reads the learning rate through ``self``
    (``capture``), or through a local."""

    def __init__(self, model: nn.Module, capture: bool) -> None:
        self.lr = 0.01
        self.opt = torch.optim.SGD(model.parameters(), lr=self.lr)
        if capture:
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda _: self.lr)
        else:
            lr = self.lr
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda _: lr)
        self.scratch = torch.zeros(64 * 1024)


def _trials(capture: bool) -> Report:
    model, opt = _setup()
    with _collector(False), memsentry.track(model, on_leak="ignore") as tracker:
        for _ in range(SHORT):
            trial = _Trial(model, capture)
            _train_step(model, opt)
            del trial
    return tracker.report()


def test_a_scheduler_lambda_without_self_clears_the_reference_cycle() -> None:
    leak = _only(_trials(capture=True), "reference-cycle")
    assert (leak.severity, _subject(leak)) == (Severity.LEAK, "_Trial")
    assert "do not capture `self` in lambdas or hooks handed to objects it owns (LambdaLR, " \
        "register_*_hook)" in leak.fix

    # The lambda reads a local copy of the rate, not `self`.
    _cleared(_trials(capture=False), "reference-cycle")


class _Double(torch.autograd.Function):
    """``2 * x``, keeping its output for backward on ctx (``on_ctx``) or saved properly."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, on_ctx: bool) -> torch.Tensor:
        y = x * 2
        if on_ctx:
            ctx.y = y
        else:
            ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * 2, None


def _doubled(on_ctx: bool) -> Report:
    model, opt = _setup()
    with _collector(False), memsentry.track(model, on_leak="ignore") as tracker:
        for _ in range(SHORT):
            out = _Double.apply(model(torch.randn(32, 16)), on_ctx)
            loss = nn.functional.mse_loss(out, torch.zeros(32, 4))
            opt.zero_grad()
            loss.backward()
            opt.step()
            del out, loss
    return tracker.report()


def test_save_for_backward_instead_of_a_ctx_attribute_clears_the_reference_cycle() -> None:
    leak = _only(_doubled(on_ctx=True), "reference-cycle")
    assert (leak.severity, _subject(leak)) == (Severity.LEAK, "_DoubleBackward")
    assert leak.fix.startswith("in `_Double.forward`, keep tensors for backward with "
                               "`ctx.save_for_backward(...)`, not as attributes of ctx")

    # `ctx.save_for_backward(y)` instead of `ctx.y = y`.
    _cleared(_doubled(on_ctx=False), "reference-cycle")


# -- exception-frames -----------------------------------------------------------------------


def _attempt(model: _Classifier, x: torch.Tensor) -> torch.Tensor:
    """A forward that runs out of memory halfway (simulated)."""
    hidden = model.encoder(x)
    raise RuntimeError(f"out of memory (simulated) after {hidden.numel()} activations")


def _retries(keep: str) -> Report:
    """An attempt that fails at every step, its error kept in ``last_error`` as it is
    (``keep="error"``), as its message (``"str"``), or with its frames cleared
    (``"cleared"``)."""
    model, opt = _setup()
    last_error: RuntimeError | str | None = None
    with memsentry.track(model, on_leak="ignore") as tracker:
        for _ in range(SHORT):
            try:
                _attempt(model, torch.randn(512, 16))
            except RuntimeError as e:
                if keep == "str":
                    last_error = str(e)
                else:
                    last_error = e
                    if keep == "cleared":
                        traceback.clear_frames(last_error.__traceback__)
            _train_step(model, opt)
    assert last_error is not None
    return tracker.report()


def test_keeping_the_message_or_clearing_the_frames_clears_exception_frames() -> None:
    waste = _only(_retries("error"), "exception-frames")
    assert (waste.severity, _subject(waste)) == (Severity.WASTE, "last_error")
    assert waste.fix.startswith("keep what you need from the error, not the error: "
                                "`str(last_error)`, or drop its frames with "
                                "`traceback.clear_frames(last_error.__traceback__)`")

    # `last_error = str(e)`, then the error kept with its frames cleared.
    _cleared(_retries("str"), "exception-frames")
    _cleared(_retries("cleared"), "exception-frames")
