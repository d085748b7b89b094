"""Per-layer figures: output, saved and parameter bytes, forward/backward deltas, names, calls."""

from __future__ import annotations

import pytest
import torch
from conftest import Boom, Net, TwiceShared, make_mlp, train
from torch import nn

import memsentry

# nn.Linear(256, 512) on a float32 batch of 64: the output is 64 * 512 * 4 bytes.
OUTPUT_BYTES = 64 * 512 * 4  # 131072
INPUT_BYTES = 64 * 256 * 4  # 65536

# The default CPU backend reads glibc's in-use heap bytes, so a forward that creates one tensor
# shows its storage plus malloc's rounding (64-byte alignment, a 16-byte chunk header) plus the
# C++ objects created with it (TensorImpl, StorageImpl and, with grad, the autograd node, its
# saved variables and memsentry's node hook). Over 30 runs these extras measured 32..240
# bytes; the README promises "under 1 KiB of malloc and autograd bookkeeping", which is also
# far below a second tensor (at least 64 KiB here).
ALLOCATOR_SLACK = 1024


def _linear_report(*, grad: bool, exact: bool) -> memsentry.LayerStats:
    torch.manual_seed(0)
    lin = nn.Linear(256, 512)
    x = torch.randn(64, 256)
    # overhead=None: every call measured (these figures are the measuring's; on a loaded
    # machine the budget may measure only the first call, which also holds oneDNN's one-time
    # buffers: 9.3 MB of them in a fresh process)
    with memsentry.track(lin, exact=exact, overhead=None) as t:
        for _ in range(4):
            if grad:
                y = lin(x)
                y.sum().backward()
            else:
                with torch.no_grad():
                    y = lin(x)
            del y
            t.step()
    return t.report().layer("Linear")


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_linear_output_bytes_and_forward_delta(grad: bool) -> None:
    stats = _linear_report(grad=grad, exact=False)
    assert stats.calls == 4
    assert stats.output_bytes == OUTPUT_BYTES
    assert stats.forward_delta is not None
    assert OUTPUT_BYTES <= stats.forward_delta <= OUTPUT_BYTES + ALLOCATOR_SLACK
    assert stats.forward_peak is not None and stats.forward_peak >= stats.forward_delta


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_linear_forward_delta_is_exact_in_exact_mode(grad: bool) -> None:
    # exact=True counts tensor storages only: the output is the one new storage of the call
    # (the saved input and weight already existed).
    stats = _linear_report(grad=grad, exact=True)
    assert stats.output_bytes == OUTPUT_BYTES
    assert stats.forward_delta == OUTPUT_BYTES
    assert stats.forward_peak == OUTPUT_BYTES


def test_linear_saves_its_input_but_not_its_weight() -> None:
    lin = nn.Linear(256, 512)
    x = torch.randn(64, 256)  # no grad: the weight's gradient needs x, nothing needs W
    with memsentry.track(lin) as t:
        lin(x).sum().backward()
    assert t.report().layer("Linear").saved_bytes == INPUT_BYTES


def test_saved_bytes_relu_output_shared_storage_counted_once_params_excluded() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
    x = torch.randn(64, 256)
    with memsentry.track(model) as t:
        for _ in range(2):
            model(x).sum().backward()
    report = t.report()
    hidden = 64 * 512 * 4
    # Linear 0: its input x (the weight is a parameter, not new memory).
    assert report.layer("0").saved_bytes == INPUT_BYTES
    # ReLU saves its output for its backward.
    assert report.layer("1").saved_bytes == hidden
    # Linear 2: its input (the ReLU's output, the same storage) and not its weight, although
    # its input requires grad and so the weight is saved too.
    assert report.layer("2").saved_bytes == hidden
    # The container sees the ReLU output saved by two children: it counts that storage once.
    assert report.layer("Sequential").saved_bytes == INPUT_BYTES + hidden


def test_param_bytes_sum_of_parameters_shared_counted_once() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 3))
    model[2].weight = model[0].weight  # tie: one 8x8 weight used by two layers
    with memsentry.track(model) as t:
        model(torch.randn(2, 8))
    report = t.report()
    assert report.layer("0").param_bytes == (8 * 8 + 8) * 4
    assert report.layer("1").param_bytes == 0
    assert report.layer("2").param_bytes == (8 * 8 + 8) * 4
    # Root: the tied weight once, three biases, the last weight.
    assert report.layer("Sequential").param_bytes == (8 * 8 + 8 + 8 + 3 * 8 + 3) * 4
    unique = {p.data_ptr(): p.numel() * 4 for p in model.parameters()}
    assert report.layer("Sequential").param_bytes == sum(unique.values())


@pytest.mark.parametrize("hook_model", [True, False], ids=["model", "global hooks"])
def test_a_lazy_module_is_tracked_and_changes_nothing(hook_model: bool) -> None:
    # Its parameters are uninitialized until its first call, and raise ValueError when read.
    def run(tracked: bool) -> tuple[list[float], memsentry.Report | None]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.Linear(8, 1))
        tracker = memsentry.track(model if hook_model else None) if tracked else None
        if tracker is not None:
            tracker.start()
        losses = [model(torch.randn(4, 5)).pow(2).mean().item() for _ in range(3)]
        return losses, tracker.stop() if tracker is not None else None

    losses, report = run(True)
    assert losses == run(False)[0]
    assert report is not None
    assert report.layer("0").calls == 3
    if hook_model:  # its hooks run after LazyLinear's own pre-hook made the parameters
        assert report.layer("0").param_bytes == (5 * 8 + 8) * 4


def test_module_called_twice_per_forward_counts_two_calls_per_iteration() -> None:
    torch.manual_seed(0)
    model = TwiceShared()
    with memsentry.track(model) as t:
        train(model, 3, d_in=8)
    report = t.report()
    assert report.layer("TwiceShared").calls == 3
    assert report.layer("block").calls == 6
    assert report.layer("out").calls == 3
    # Module calls per iteration: the root, the shared block twice, the head.
    assert [it.forward_calls for it in report.iterations] == [4, 4, 4]


def test_names_order_depth_and_leaves_follow_the_model(net: Net) -> None:
    with memsentry.track(net) as t:
        net(torch.randn(2, 8)).sum().backward()
    layers = t.report().layers
    # First-call order (head is registered first but runs last); the never-called submodule
    # is absent; the root is named by its class.
    assert [layer.name for layer in layers] == ["Net", "encoder", "encoder.0", "encoder.1", "head"]
    named = {name or "Net": module for name, module in net.named_modules()}
    for layer in layers:
        module = named[layer.name]
        assert layer.type == type(module).__name__
        assert layer.depth == (0 if layer.name == "Net" else layer.name.count(".") + 1)
        assert layer.is_leaf == (len(list(module.children())) == 0)
        assert layer.calls == 1


def test_no_grad_saves_nothing_and_measures_no_backward(mlp: nn.Sequential) -> None:
    with memsentry.track(mlp) as t, torch.no_grad():
        for _ in range(3):
            mlp(torch.randn(8, 16))
    layers = t.report().layers
    assert len(layers) == 4
    for layer in layers:
        assert layer.saved_bytes == 0
        assert layer.backward_delta is None
        assert layer.backward_peak is None
        assert layer.backward_calls == 0


def test_backward_is_measured_for_every_layer_of_a_training_loop() -> None:
    model = make_mlp()
    with memsentry.track(model, overhead=None) as t:  # every call measured
        train(model, 3)
    layers = t.report().layers
    assert [layer.name for layer in layers] == ["Sequential", "0", "1", "2"]
    for layer in layers:
        # Including layer "0", whose input (the data batch) does not require grad.
        assert layer.backward_calls == 3, layer.name
        assert layer.backward_delta is not None, layer.name
        assert layer.backward_peak is not None, layer.name
        assert layer.backward_peak >= 0


def test_backward_peak_sees_the_weight_gradient_in_exact_mode() -> None:
    # The first backward of a Linear creates its weight's .grad: 512 * 256 * 4 bytes.
    lin = nn.Linear(256, 512)
    with memsentry.track(lin, exact=True) as t:
        lin(torch.randn(64, 256)).sum().backward()
    stats = t.report().layer("Linear")
    assert stats.backward_peak is not None
    assert stats.backward_peak >= 512 * 256 * 4


def test_saved_tensors_false_leaves_saved_bytes_unmeasured(mlp: nn.Sequential) -> None:
    # saved_tensors=False turns the saved-tensor hook off: the figure is "not measured" (None,
    # shown as "-"), not a measured zero.
    with memsentry.track(mlp, saved_tensors=False) as t:
        train(mlp, 2)
    for layer in t.report().layers:
        assert layer.saved_bytes is None, layer.name


def test_backward_false_leaves_backward_unmeasured(mlp: nn.Sequential) -> None:
    with memsentry.track(mlp, backward=False) as t:
        train(mlp, 2)
    for layer in t.report().layers:
        assert layer.backward_calls == 0
        assert layer.backward_delta is None and layer.backward_peak is None


def test_forward_raising_in_a_child_keeps_the_call_stack_right() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Boom(), nn.Linear(4, 4))
    other = nn.Linear(4, 2)
    with memsentry.track() as t:
        with pytest.raises(ValueError, match="boom"):
            model(torch.randn(3, 4))
        for _ in range(2):
            model(torch.randn(2, 4))
        other(torch.randn(2, 4))  # top level: a root of its own, not a child of the failed call
    report = t.report()
    assert [(layer.name, layer.depth) for layer in report.layers] == [
        ("Sequential", 0), ("0", 1), ("1", 1), ("2", 1), ("Linear", 0),
    ]
    assert report.layer("Sequential").calls == 3
    assert report.layer("1").calls == 3
    assert report.layer("2").calls == 2  # never reached by the failing call
    assert report.layer("2").output_bytes == 2 * 4 * 4
    assert report.layer("Linear").calls == 1
    assert report.layer("Linear").output_bytes == 2 * 2 * 4


def test_a_pass_through_module_has_no_backward_window() -> None:
    # nn.Identity returns its input: no autograd work of its own, so no backward figures,
    # while the layers around it keep theirs.
    model = nn.Sequential(nn.Linear(8, 8), nn.Identity(), nn.Linear(8, 8))
    x = torch.randn(4, 8)
    with memsentry.track(model, overhead=None) as t:  # every call measured
        for _ in range(3):
            model(x).sum().backward()
            t.step()
    report = t.report()
    assert report.layer("1").backward_calls == 0
    assert report.layer("1").backward_delta is None
    assert report.layer("2").backward_calls == 3
    assert report.layer("0").backward_calls == 3
