"""memsentry around torch.compile, torch.func and worker threads (issue 11): the run gives the
same results as untracked, bit for bit, under every form of track() and every compile backend,
and the report says what it could not measure."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

import memsentry

BACKENDS = ["eager", "aot_eager", "inductor"]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _train(track: Callable[[nn.Module, nn.Module], memsentry.Tracker | None],
           backend: str) -> tuple[list[float], torch.Tensor, memsentry.Report | None]:
    """Five SGD steps through torch.compile(fullgraph=True); the losses, the final weight and
    the report (``track`` gets the model and its compiled form)."""
    torch._dynamo.reset()
    model = _model()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    losses = []
    tracker = track(model, compiled)
    if tracker is not None:
        tracker.start()
    for _ in range(5):
        loss = compiled(torch.randn(8, 16, generator=generator)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    report = tracker.stop() if tracker is not None else None
    return losses, model[0].weight.detach().clone(), report


FORMS: dict[str, Callable[[nn.Module, nn.Module], memsentry.Tracker | None]] = {
    "the compiled model": lambda model, compiled: memsentry.track(compiled, on_leak="ignore"),
    "global hooks": lambda model, compiled: memsentry.track(on_leak="ignore"),
    "the model, compiled form called": lambda model, compiled: memsentry.track(
        model, on_leak="ignore"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", list(FORMS))
def test_tracking_a_compiled_model_changes_nothing_and_says_what_it_missed(
        form: str, backend: str) -> None:
    plain_losses, plain_weight, _ = _train(lambda model, compiled: None, backend)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no recompilation warning over memsentry's state
        # torch's own notice that global module hooks also fire for the OptimizedModule
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there "
                                "are global hooks")
        losses, weight, report = _train(FORMS[form], backend)
    assert losses == plain_losses
    assert torch.equal(weight, plain_weight)
    assert report is not None
    assert len(report.iterations) >= 4
    if form == "the compiled model":
        assert [layer.name for layer in report.layers] == ["Sequential (compiled)"]
        assert any("ran as torch.compile'd code" in note for note in report.notes)
    if form == "global hooks":
        assert "Sequential (compiled)" in {layer.name for layer in report.layers}
    assert not [f for f in report.findings if f.severity is memsentry.Severity.LEAK]


def test_a_leak_around_a_compiled_model_is_still_found() -> None:
    torch._dynamo.reset()
    model = _model()
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    total = 0
    with memsentry.track(compiled, on_leak="ignore") as t:
        for _ in range(8):
            loss = compiled(torch.randn(8, 16)).pow(2).mean()
            opt.zero_grad()
            loss.backward(retain_graph=True)
            opt.step()
            total = total + loss  # every step's graph
    (finding,) = [f for f in t.report().findings if f.severity is memsentry.Severity.LEAK]
    assert finding.rule == "retained-graph" and "`total`" in finding.message


# -- torch.func ---------------------------------------------------------------------------------
def _functional_steps(tracked: bool) -> tuple[list[torch.Tensor], memsentry.Report | None]:
    """Four steps of per-sample gradients (vmap over grad) and a full-batch grad, weights
    updated functionally; the weights after the last step."""
    from torch.func import functional_call, grad, vmap

    model = _model()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (functional_call(model, p, (x,)) - y).pow(2).mean()

    generator = torch.Generator().manual_seed(2)
    tracker = memsentry.track(model, on_leak="ignore") if tracked else None
    if tracker is not None:
        tracker.start()
    for _ in range(4):
        x, y = torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator)
        full = grad(loss_fn)(params, x, y)
        per_sample = vmap(grad(loss_fn), in_dims=(None, 0, 0))(params, x.unsqueeze(1),
                                                               y.unsqueeze(1))
        params = {k: params[k] - 0.1 * full[k] - 0.01 * per_sample[k].mean(0) for k in params}
    return list(params.values()), tracker.stop() if tracker is not None else None


def test_torch_func_transforms_run_under_track_with_the_same_results() -> None:
    plain, _ = _functional_steps(tracked=False)
    tracked, report = _functional_steps(tracked=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, tracked, strict=True))
    assert report is not None
    assert any("ran inside a torch.func transform" in note for note in report.notes)
    assert not [f for f in report.findings if f.severity is memsentry.Severity.LEAK]


# -- threads ----------------------------------------------------------------------------------
def test_a_loop_trained_in_a_worker_thread_is_measured_there() -> None:
    import threading

    def run(tracked: bool) -> tuple[torch.Tensor, memsentry.Report | None]:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def loop() -> None:
            generator = torch.Generator().manual_seed(3)
            for _ in range(6):
                loss = model(torch.randn(8, 16, generator=generator)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()

        tracker = memsentry.track(model, on_leak="ignore") if tracked else None
        if tracker is not None:
            tracker.start()
        worker = threading.Thread(target=loop)
        worker.start()
        worker.join()
        report = tracker.stop() if tracker is not None else None
        return model[0].weight.detach().clone(), report

    plain, _ = run(tracked=False)
    weight, report = run(tracked=True)
    assert torch.equal(weight, plain)
    assert report is not None and len(report.iterations) >= 5
    assert report.layer("0").saved_bytes == 8 * 16 * 4  # the first Linear saves its input


# -- TorchScript --------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["traced", "scripted"])
@pytest.mark.parametrize("with_model", [True, False], ids=["model", "global"])
def test_torchscript_modules_are_tracked_as_a_whole(how: str, with_model: bool) -> None:
    def run(tracked: bool) -> tuple[torch.Tensor, memsentry.Report | None]:
        model = _model()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            script = torch.jit.trace(model, torch.zeros(8, 16)) if how == "traced" \
                else torch.jit.script(model)
        opt = torch.optim.SGD(script.parameters(), lr=0.1)
        generator = torch.Generator().manual_seed(4)
        tracker = memsentry.track(script if with_model else None, on_leak="ignore") \
            if tracked else None
        if tracker is not None:
            tracker.start()
        for _ in range(5):
            loss = script(torch.randn(8, 16, generator=generator)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        report = tracker.stop() if tracker is not None else None
        return next(script.parameters()).detach().clone(), report

    plain, _ = run(tracked=False)
    weight, report = run(tracked=True)
    assert torch.equal(weight, plain)
    assert report is not None and len(report.iterations) >= 4
    assert [layer.name for layer in report.layers] == [f"Sequential ({how})"]
    assert any("ran as TorchScript" in note for note in report.notes)


def test_tracing_under_exact_counting_gives_the_plain_trace() -> None:
    """The TorchScript tracer does not see ops a dispatch mode ran: memsentry's counting
    mode steps aside while torch.jit.trace runs, and counts the traced module's calls."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(36, 2))
    x = torch.randn(2, 3, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        plain = torch.jit.trace(model, x)
        with memsentry.track(exact=True, on_leak="ignore") as tracker:
            traced = torch.jit.trace(model, x)
            outputs = [traced(x) for _ in range(3)]
    def graph(module: torch.jit.ScriptModule) -> str:  # a second trace's classes are renamed
        return re.sub(r"___torch_mangle_\d+\.", "", str(module.inlined_graph))

    assert graph(traced) == graph(plain)
    assert all(torch.equal(out, plain(x)) for out in outputs)
    assert tracker.report().peak_mode == "exact"
    # The tracer's entry points are torch's own again once counting ended.
    from torch.jit import _trace
    assert not hasattr(_trace._trace_impl, "__memsentry_original__")


def test_a_number_torchscript_hands_over_for_a_tensor_is_given_back_as_one() -> None:
    """TorchScript's executor passes some numbers it keeps as tensors to a Python mode as
    Python numbers; the op refuses them before running. The counter gives them back."""
    from memsentry.measure.storage import StorageCounter

    with StorageCounter() as counter:
        assert counter.dispatch(torch.ops.aten.equal.default, (84, 84), {}) is True
        assert counter.dispatch(torch.ops.aten.equal.default, (84, 85), {}) is False
        with pytest.raises(RuntimeError, match="Expected a value of type 'Tensor'"):
            torch.ops.aten.equal.default(84, 84)  # what the op says without the counter
