"""track(): hooks come and go cleanly, nothing is kept alive, nothing computed changes,
iterations are counted right, growth is visible, and misuse gives clear errors."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import weakref
from collections.abc import Callable

import pytest
import torch
import torch.nn.modules.module as module_globals
from conftest import (
    MiB,
    TempAllocator,
    gc_disabled,
    iterations_run,
    make_mlp,
    optimizer_post_hooks,
    train,
)
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils.checkpoint import checkpoint

import memsentry
from memsentry import TrackerStateError, UnsupportedDeviceError
from memsentry.measure.cpu import MALLINFO2_UNAVAILABLE, MallinfoBackend


def _global_hook_sizes() -> tuple[int, ...]:
    return (
        len(module_globals._global_forward_hooks),
        len(module_globals._global_forward_pre_hooks),
        len(module_globals._global_forward_hooks_always_called),
        len(optimizer_post_hooks()),
    )


def _saved_tensor_hooks_active() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


# -- hooks are removed -------------------------------------------------------------------------


@pytest.mark.parametrize("with_model", [True, False], ids=["model", "global"])
@pytest.mark.parametrize("exact", [False, True], ids=["sampled", "exact"])
def test_hooks_are_removed_after_exit(with_model: bool, exact: bool) -> None:
    model = make_mlp()
    before = _global_hook_sizes()
    with memsentry.track(model if with_model else None, exact=exact):
        assert not _saved_tensor_hooks_active()  # pushed around each outermost call only
        train(model, 2)
    for module in model.modules():
        assert not module._forward_hooks
        assert not module._forward_pre_hooks
        assert not module._forward_hooks_always_called
    assert _global_hook_sizes() == before
    assert not _saved_tensor_hooks_active()
    assert _get_current_dispatch_mode() is None


@pytest.mark.parametrize("with_model", [True, False], ids=["model", "global"])
def test_hooks_are_removed_when_the_block_raises(with_model: bool) -> None:
    model = make_mlp()
    before = _global_hook_sizes()
    with pytest.raises(KeyError, match="from the loop"), memsentry.track(
        model if with_model else None, exact=True
    ):
        train(model, 1)
        model(torch.randn(2, 16))
        raise KeyError("from the loop")
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
    assert _global_hook_sizes() == before
    assert not _saved_tensor_hooks_active()
    assert _get_current_dispatch_mode() is None


# -- nothing is kept alive ---------------------------------------------------------------------


@pytest.mark.parametrize("tracked", [False, True], ids=["untracked_control", "tracked"])
@pytest.mark.parametrize("backward", [False, True], ids=["forward_only", "with_backward"])
@pytest.mark.parametrize("with_model", [True, False], ids=["model", "global"])
def test_model_and_parameters_freed_by_refcount_after_tracking(
    tracked: bool, backward: bool, with_model: bool
) -> None:
    # Without an optimizer nothing in a model's life needs the cycle collector; tracking must
    # not change that, even while the tracker (and its report) are still alive.
    with gc_disabled():
        model = make_mlp()
        x = torch.randn(8, 16)
        tracker = memsentry.track(model if with_model else None)
        if tracked:
            tracker.__enter__()
        for _ in range(2):
            out = model(x)
            if backward:
                out.sum().backward()
        if tracked:
            tracker.__exit__(None, None, None)
        model_ref = weakref.ref(model)
        param_refs = [weakref.ref(p) for p in model.parameters()]
        del model, out
        assert model_ref() is None
        assert [ref() is None for ref in param_refs] == [True] * len(param_refs)
        report = tracker.report()
    assert [layer.name for layer in report.layers] == (
        ["Sequential", "0", "1", "2"] if tracked else []
    )


@pytest.mark.parametrize("with_model", [True, False], ids=["model", "global"])
def test_model_and_optimizer_are_not_kept_by_the_tracker(with_model: bool) -> None:
    # torch optimizers hold reference cycles of their own, so collect once, then check.
    model = make_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with memsentry.track(model if with_model else None) as tracker:
        train(model, 3, optimizer=opt)
    refs = [weakref.ref(model), weakref.ref(opt), *(weakref.ref(p) for p in model.parameters())]
    del model, opt
    gc.collect()
    assert [ref() is None for ref in refs] == [True] * len(refs)
    assert len(tracker.report().iterations) == 3  # the tracker itself is still alive


def test_an_output_never_backpropagated_is_freed_by_del() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                          nn.Linear(128, 4))
    storages: list[weakref.ref] = []

    def remember(_module: nn.Module, _args: object, output: torch.Tensor) -> None:
        storages.append(weakref.ref(output.untyped_storage()))

    handles = [layer.register_forward_hook(remember) for layer in model]
    try:
        with gc_disabled(), memsentry.track(model):
            out = model(torch.randn(32, 64)).exp()
            out_ref = weakref.ref(out)
            del out
            assert out_ref() is None
            # Every layer's activation (the ReLUs' outputs are saved for backward by the
            # graph) goes with the output.
            assert [ref() is None for ref in storages] == [True] * len(model)
    finally:
        for handle in handles:
            handle.remove()


# -- nothing computed changes ------------------------------------------------------------------


def _mlp_with_dropout() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(inplace=True), nn.Dropout(0.2),
                         nn.Linear(32, 1))


def _encoder_layer() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True),
        nn.Flatten(),
        nn.Linear(16 * 5, 1),
    )


def _run_training(
    build: Callable[[], nn.Module], optimizer: str, tracking: str | None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model = build()
    if optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    shape = (4, 5, 16) if build is _encoder_layer else (4, 16)
    batches = [(torch.randn(shape, generator=gen), torch.randn(4, 1, generator=gen))
               for _ in range(8)]
    losses = []

    def loop() -> None:
        torch.manual_seed(2)  # dropout masks
        summed = torch.zeros(())
        for x, y in batches:
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
            # A graph kept across iterations, so that the censuses (iterations 2, 3, 4, 6)
            # walk autograd nodes and their saved tensors: that must change nothing either.
            summed = summed + loss

    if tracking is None:
        loop()
    else:
        with memsentry.track(model, exact=tracking == "exact", on_leak="ignore") as t:
            loop()
        # Under the default budget most iterations run light; each still ends one.
        assert iterations_run(t.report()) == len(batches)
        assert [c.iteration for c in t.report().censuses] == [2, 3, 4, 6]
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("tracking", ["sampled", "exact"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("build", [_mlp_with_dropout, _encoder_layer], ids=["mlp", "encoder"])
def test_losses_and_parameters_are_bitwise_identical_under_tracking(
    build: Callable[[], nn.Module], optimizer: str, tracking: str
) -> None:
    ref_losses, ref_params = _run_training(build, optimizer, None)
    losses, params = _run_training(build, optimizer, tracking)
    assert torch.equal(losses, ref_losses)
    assert len(params) == len(ref_params)
    for got, want in zip(params, ref_params, strict=True):
        assert torch.equal(got, want)


def _gradient_penalty_grads(tracked: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    x = torch.randn(4, 8, requires_grad=True)

    def step() -> list[torch.Tensor]:
        for _ in range(2):
            out = model(x)
            (grad_x,) = torch.autograd.grad(out.sum(), x, create_graph=True)
            (out.mean() + grad_x.pow(2).sum()).backward()
        return [p.grad.clone() for p in model.parameters()]

    if not tracked:
        return step()
    with memsentry.track(model):
        return step()


def test_double_backward_with_autograd_grad_works_and_is_unchanged() -> None:
    # A gradient penalty (WGAN-GP, input-gradient regularisers): autograd.grad with respect to
    # a leaf input, through the tracked model, then backward through that gradient.
    want = _gradient_penalty_grads(tracked=False)
    got = _gradient_penalty_grads(tracked=True)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_is_unchanged(use_reentrant: bool) -> None:
    def grads(tracked: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        block = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        head = nn.Linear(8, 1)
        x = torch.randn(4, 8, requires_grad=True)
        tracker = memsentry.track()
        with tracker if tracked else torch.enable_grad():
            for _ in range(2):
                h = checkpoint(block, x, use_reentrant=use_reentrant)
                head(h).sum().backward()
        return [p.grad.clone() for p in (*block.parameters(), *head.parameters(), x)]

    for g, w in zip(grads(True), grads(False), strict=True):
        assert torch.equal(g, w)


def test_inplace_modification_of_a_saved_tensor_still_raises() -> None:
    lin = nn.Linear(8, 8)
    with memsentry.track(lin):
        y = lin(torch.randn(4, 8)).exp()  # exp saves its output
        y.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()


def test_legitimate_inplace_ops_do_not_raise() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 1))
    with memsentry.track(model):
        h = model[0](torch.randn(4, 8))
        h.mul_(2)  # modified before anything saved it
        model[2](model[1](h)).sum().backward()
        model(torch.randn(4, 8)).sum().backward()
    assert model[0].weight.grad is not None


# -- iterations --------------------------------------------------------------------------------


def test_each_optimizer_step_closes_one_iteration(mlp: nn.Sequential) -> None:
    with memsentry.track(mlp, overhead=None) as t:  # the figures of every iteration
        train(mlp, 5)
    its = t.report().iterations
    assert [it.index for it in its] == [0, 1, 2, 3, 4]
    assert {it.boundary for it in its} == {"optimizer"}
    assert [it.forward_calls for it in its] == [4] * 5  # Sequential + 3 children
    for it in its:
        assert it.seconds > 0
        assert it.peak >= it.allocated
        assert it.reserved is not None and it.reserved >= it.allocated


def test_manual_steps_close_iterations(mlp: nn.Sequential) -> None:
    with memsentry.track(mlp) as t, torch.no_grad():
        for _ in range(3):
            mlp(torch.randn(4, 16))
            t.step()
    its = t.report().iterations
    assert [(it.index, it.boundary) for it in its] == [(0, "step"), (1, "step"), (2, "step")]


def test_step_right_after_optimizer_step_does_not_double_count(mlp: nn.Sequential) -> None:
    with memsentry.track(mlp, overhead=None) as t:  # every call counted
        train(mlp, 4, after_step=lambda: t.step())
    its = t.report().iterations
    assert [it.index for it in its] == [0, 1, 2, 3]
    assert [it.forward_calls for it in its] == [4] * 4


def test_step_right_after_optimizer_step_labels_every_iteration_step(mlp: nn.Sequential) -> None:
    # With t.step() in the loop, t.step() marks the iterations (optimizer steps no longer do),
    # and the first iteration, closed by both, is relabelled rather than split.
    with memsentry.track(mlp) as t:
        train(mlp, 3, after_step=lambda: t.step())
    assert [it.boundary for it in t.report().iterations] == ["step", "step", "step"]


def test_a_second_optimizer_does_not_double_count() -> None:
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    disc = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.1)
    bce = nn.BCEWithLogitsLoss()
    with memsentry.track(overhead=None) as t:  # every call counted
        for _ in range(3):
            fake = gen(torch.randn(5, 4))
            d_loss = bce(disc(fake.detach()), torch.zeros(5, 1))
            opt_d.zero_grad()
            d_loss.backward()
            opt_d.step()
            g_loss = bce(disc(fake), torch.ones(5, 1))
            opt_g.zero_grad()
            g_loss.backward()
            opt_g.step()
    report = t.report()
    # The first optimizer to step (the discriminator's) marks the iterations; the other one
    # does not add boundaries. The generator's half of the last iteration runs after the last
    # boundary, so the block ends with a partial "exit" iteration.
    assert [(it.index, it.boundary) for it in report.iterations] == [
        (0, "optimizer"), (1, "optimizer"), (2, "optimizer"), (3, "exit"),
    ]
    # Per loop pass: gen (4 calls), disc twice (8), the loss twice (2); none lost or doubled.
    assert sum(it.forward_calls for it in report.iterations) == 3 * 14
    assert [it.forward_calls for it in report.iterations] == [4 + 4 + 1, 14, 14, 4 + 1]
    # Global hooks: each top-level module is a root named by its class, the loss included;
    # a second root of a class already named is named by the variable that calls it.
    roots = [(layer.name, layer.type) for layer in report.layers if layer.depth == 0]
    assert roots == [("Sequential", "Sequential"), ("disc", "Sequential"),
                     ("BCEWithLogitsLoss", "BCEWithLogitsLoss")]


def test_gradient_accumulation_is_one_iteration_per_optimizer_step(mlp: nn.Sequential) -> None:
    opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
    with memsentry.track(mlp, overhead=None) as t:  # every call counted
        for _ in range(2):
            for _ in range(3):  # three micro-batches per step
                mlp(torch.randn(4, 16)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    report = t.report()
    assert [(it.boundary, it.forward_calls) for it in report.iterations] == [
        ("optimizer", 12), ("optimizer", 12),
    ]
    assert report.layer("0").backward_calls == 6


def test_calls_after_the_last_boundary_give_an_exit_iteration(mlp: nn.Sequential) -> None:
    with memsentry.track(mlp) as t:
        train(mlp, 2)
        with torch.no_grad():
            mlp(torch.randn(2, 16))
    its = t.report().iterations
    assert [(it.index, it.boundary) for it in its] == [(0, "optimizer"), (1, "optimizer"),
                                                       (2, "exit")]
    assert its[-1].forward_calls == 4


def test_no_exit_iteration_without_calls_after_the_last_boundary(mlp: nn.Sequential) -> None:
    with memsentry.track(mlp) as t:
        train(mlp, 2)
    assert [it.boundary for it in t.report().iterations] == ["optimizer", "optimizer"]


def test_max_iterations_thins_the_timeline() -> None:
    # Without a budget: no boundary is passed with a count, each is kept or thinned out.
    with memsentry.track(max_iterations=4, overhead=None) as t:
        for _ in range(20):
            t.step()
    report = t.report()
    kept = [it.index for it in report.iterations]
    assert 2 <= len(kept) <= 4
    assert kept == sorted(set(kept))
    assert kept[0] == 0
    assert report.dropped_iterations > 0
    assert len(kept) + report.dropped_iterations == 20


# -- growth and baseline -----------------------------------------------------------------------


@pytest.mark.parametrize("exact", [False, True], ids=["sampled", "exact"])
def test_growth_of_one_mib_per_iteration_is_visible(exact: bool) -> None:
    model = make_mlp()
    kept: list[torch.Tensor] = []
    n = 6
    # The allocated figure of every iteration, compared pair by pair: no budget.
    with memsentry.track(model, exact=exact, on_leak="ignore", overhead=None) as t:
        for _ in range(n):
            train(model, 1)
            kept.append(torch.ones(MiB // 4))  # 1 MiB that is never freed: a leak
            t.step()
    its = t.report().iterations
    assert len(its) == n
    growth = its[-1].allocated - its[0].allocated
    assert growth >= (n - 1) * MiB - 64 * 1024
    # ... and it rises every iteration, by about 1 MiB.
    for before, after in itertools.pairwise(its):
        assert after.allocated - before.allocated >= MiB - 64 * 1024


@pytest.mark.parametrize("exact", [False, True], ids=["sampled", "exact"])
def test_a_clean_loop_shows_no_growth(exact: bool) -> None:
    model = make_mlp(256, 256, 256)
    with memsentry.track(model, exact=exact) as t:
        train(model, 6, d_in=256, batch=64)
    # The steps' boundaries: the block's end (a row when the last iteration ran without
    # hooks) reads memory after train() let its last activations go.
    its = [it for it in t.report().iterations if it.boundary != "exit"]
    # After the first iteration (optimizer state, .grad buffers) a clean loop is flat; each
    # activation here is 64 KiB, so a kept one would show.
    assert abs(its[-1].allocated - its[1].allocated) < 32 * 1024


def test_a_tensor_created_before_tracking_is_baseline_not_growth() -> None:
    backend = MallinfoBackend()
    before = backend.allocated()
    dataset = torch.randn(4096, 256)  # 4 MiB
    model = make_mlp(256, 64, 1)
    with memsentry.track(model) as t:
        for i in range(3):
            train(model, 1, d_in=256)
            model(dataset[i * 64:(i + 1) * 64]).sum().backward()
    report = t.report()
    assert report.baseline >= before + dataset.nbytes - 256 * 1024
    for it in report.iterations:
        assert it.allocated - report.baseline < MiB
    assert report.allocated is not None and report.allocated - report.baseline < MiB


def test_a_tensor_created_before_tracking_is_not_growth_in_exact_mode() -> None:
    # A data set loaded before the loop and sliced into batches inside it: slices are views
    # of memory that existed before tracking, not new memory.
    torch.manual_seed(0)
    dataset = torch.randn(4096, 256)  # 4 MiB
    model = make_mlp(256, 64, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with memsentry.track(model, exact=True) as t:
        for i in range(3):
            loss = model(dataset[i * 64:(i + 1) * 64]).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = t.report()
    for it in report.iterations:
        assert it.allocated - report.baseline < MiB, it


# -- global hooks ------------------------------------------------------------------------------


def test_global_hooks_name_layers_relative_to_their_root() -> None:
    model = make_mlp()
    loss_fn = nn.MSELoss()
    with memsentry.track() as t:
        for _ in range(2):
            loss = loss_fn(model(torch.randn(4, 16)), torch.zeros(4, 4))
            loss.backward()
            t.step()
    layers = t.report().layers
    assert [(layer.name, layer.type, layer.depth) for layer in layers] == [
        ("Sequential", "Sequential", 0),
        ("0", "Linear", 1),
        ("1", "ReLU", 1),
        ("2", "Linear", 1),
        ("MSELoss", "MSELoss", 0),
    ]
    assert [layer.is_leaf for layer in layers] == [False, True, True, True, True]


def test_global_hooks_name_a_module_called_by_a_non_parent() -> None:
    class Helper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.tools = [nn.Tanh()]  # a plain list: not a registered submodule

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.tools[0](self.lin(x))

    model = Helper()
    with memsentry.track() as t:
        model(torch.randn(2, 4))
    assert [(layer.name, layer.depth) for layer in t.report().layers] == [
        ("Helper", 0), ("lin", 1), ("Helper.<Tanh>", 1),
    ]


# -- reports during and after the block --------------------------------------------------------


def test_report_mid_block_and_after_exit(mlp: nn.Sequential) -> None:
    with memsentry.track(mlp, overhead=None) as t:  # every call counted
        train(mlp, 2)
        middle = t.report()
        train(mlp, 3)
    final = t.report()
    assert len(middle.iterations) == 2
    assert middle.layer("0").calls == 2
    assert len(final.iterations) == 5
    assert final.layer("0").calls == 5
    # The mid-block report is a snapshot: later iterations did not change it.
    assert middle.layer("0").calls == 2 and len(middle.iterations) == 2
    assert final.device == "cpu" and final.backend == "cpu-mallinfo2"
    assert final.torch_version == torch.__version__
    assert final.peak is not None and final.peak >= max(it.allocated for it in final.iterations)
    # Calls after the block are not recorded.
    train(mlp, 2)
    after = t.report()
    assert after.layer("0").calls == 5 and len(after.iterations) == 5


@pytest.mark.skipif(MALLINFO2_UNAVAILABLE is not None, reason="needs glibc mallinfo2")
def test_report_after_exit_is_the_blocks_record(mlp: nn.Sequential) -> None:
    # Once the block is closed, the report describes the block: asking again gives the same
    # report, and its raw allocator counters agree with its allocated figure (both read when
    # the block ended), whatever the process allocated since.
    with memsentry.track(mlp) as t:
        train(mlp, 2)
    first = t.report()
    later_tensor = torch.ones(1 << 20)  # 4 MiB allocated after the block
    second = t.report()
    assert second == first
    stats = second.allocator_stats
    assert stats is not None
    assert stats["uordblks"] + stats["hblkhd"] == second.allocated
    del later_tensor


def test_report_is_frozen(mlp: nn.Sequential) -> None:
    with memsentry.track(mlp) as t:
        train(mlp, 1)
    report = t.report()
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.baseline = 0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.layers[0].calls = 7  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.iterations[0].allocated = 0  # type: ignore[misc]


# -- misuse ------------------------------------------------------------------------------------


def test_entering_a_tracker_twice_raises(mlp: nn.Sequential) -> None:
    tracker = memsentry.track(mlp)
    with tracker:
        with pytest.raises(TrackerStateError, match="already used"), tracker:
            pass
        assert tracker.active
    with pytest.raises(TrackerStateError), tracker:
        pass
    assert not tracker.active


def test_step_outside_the_block_raises(mlp: nn.Sequential) -> None:
    tracker = memsentry.track(mlp)
    with pytest.raises(TrackerStateError, match="outside its with-block"):
        tracker.step()
    with tracker:
        tracker.step()
    with pytest.raises(TrackerStateError, match="outside its with-block"):
        tracker.step()


def test_track_rejects_a_non_module() -> None:
    with pytest.raises(TypeError, match=r"nn\.Module"):
        memsentry.track(123)  # type: ignore[arg-type]


@pytest.mark.parametrize("device", ["tpu", "meta", torch.device("meta"), "not a device"])
def test_track_rejects_devices_it_cannot_measure(device: object) -> None:
    with pytest.raises(UnsupportedDeviceError) as info:
        memsentry.track(device=device)  # type: ignore[arg-type]
    message = str(info.value)
    assert "'cpu'" in message and "'cuda'" in message


def test_track_rejects_a_model_on_the_meta_device() -> None:
    model = nn.Linear(4, 4, device="meta")
    with pytest.raises(UnsupportedDeviceError) as info:
        memsentry.track(model)
    message = str(info.value)
    assert "meta" in message and "'cpu'" in message and "'cuda'" in message


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a CPU-only machine")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", 0, torch.device("cuda")])
def test_track_on_cuda_without_cuda_says_so(device: object) -> None:
    with pytest.raises(UnsupportedDeviceError, match="CUDA is not available"):
        memsentry.track(device=device)  # type: ignore[arg-type]


def test_track_rejects_bad_arguments() -> None:
    with pytest.raises(TypeError, match="exact"):
        memsentry.track(exact="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="saved_tensors"):
        memsentry.track(saved_tensors=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_iterations"):
        memsentry.track(max_iterations=0)
    with pytest.raises(UnsupportedDeviceError, match="negative"):
        memsentry.track(device=-1)
    with pytest.raises(TypeError, match="device"):
        memsentry.track(device=1.5)  # type: ignore[arg-type]


# -- exact mode --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
)
def test_exact_mode_sees_a_temporary_inside_a_layer(device: str) -> None:
    model = nn.Sequential(nn.Linear(16, 16), TempAllocator()).to(device)
    x = torch.randn(8, 16, device=device)
    with memsentry.track(model, exact=True) as t:
        for _ in range(3):
            model(x).sum().backward()
            t.step()
    report = t.report()
    assert report.peak_mode == "exact"
    temp = report.layer("1")
    assert temp.forward_peak is not None and temp.forward_peak >= 4 * MiB
    # What stays is the output (8 x 16 float32); the 4 MiB temporary is gone.
    assert temp.output_bytes == 8 * 16 * 4
    if device == "cpu":
        assert report.backend == "cpu-storages"
        assert temp.forward_delta == temp.output_bytes
    else:  # the caching allocator rounds the output up to one 512-byte block
        assert temp.forward_delta is not None and temp.forward_delta < 64 * 1024
    # The parent saw its child's peak.
    assert report.layer("Sequential").forward_peak >= 4 * MiB
    assert max(it.peak - it.allocated for it in report.iterations) >= 4 * MiB


def test_an_optimizer_subclass_calling_super_step_makes_one_iteration_a_step() -> None:
    # PyTorch runs the step hooks of the subclass's step and of Adam's: one step, not two.
    class ClippedAdam(torch.optim.Adam):
        def step(self, closure=None):  # type: ignore[no-untyped-def]
            torch.nn.utils.clip_grad_norm_(
                [p for group in self.param_groups for p in group["params"]], 1.0)
            return super().step(closure)

    torch.optim.Adam([nn.Parameter(torch.zeros(1))])  # Adam's own step is hooked too
    model = nn.Linear(4, 4)
    optimizer = ClippedAdam(model.parameters())
    with memsentry.track(model, on_leak="ignore", overhead=None) as t:  # every row
        for _ in range(5):
            model(torch.randn(2, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    its = t.report().iterations
    assert [(it.index, it.boundary, it.forward_calls) for it in its] == [
        (i, "optimizer", 1) for i in range(5)]
