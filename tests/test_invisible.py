"""A tracked model goes wherever a training script takes it, as it would without memsentry:
copies (EMA teachers, ``AveragedModel``, the best model so far), pickles and ``torch.save``,
TorchScript, quantization, torch.func inside a forward, and the error of a saved tensor
changed in place, word for word."""

from __future__ import annotations

import copy
import io
import pickle
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

import memsentry
from memsentry.record.versions import FALLBACK, Wording, parse

MODES: dict[str, Callable[[nn.Module], Any]] = {
    "track": lambda model: memsentry.track(model),
    "watch": lambda model: memsentry.watch(model),
    "global": lambda model: memsentry.track(),
}


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def user_hook(module: nn.Module, input: tuple[torch.Tensor], output: torch.Tensor) -> None:
    """A hook of the user's own, which copies and scripts must keep (TorchScript-typed)."""
    return None


def _hook_keys(model: nn.Module) -> dict[str, tuple[list[int], list[int], list[int]]]:
    return {name: (list(m._forward_pre_hooks), list(m._forward_hooks),
                   list(m._forward_hooks_always_called)) for name, m in model.named_modules()}


def _train(model: nn.Module, steps: int, each: Callable[[int], None]) -> torch.Tensor:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    for step in range(steps):
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        each(step)
    return model(x).detach()


@pytest.mark.parametrize("mode", sorted(MODES))
def test_copies_pickles_and_scripts_of_a_tracked_model_carry_none_of_its_hooks(mode: str) -> None:
    model = _model()
    model[0].register_forward_hook(user_hook)
    plain = _hook_keys(model)
    x = torch.randn(3, 8)
    made: dict[str, Any] = {}

    def each(step: int) -> None:
        if step != 2:
            return
        made["deepcopy"] = copy.deepcopy(model)
        made["averaged"] = AveragedModel(model)
        made["pickled"] = pickle.dumps(model)
        buffer = io.BytesIO()
        torch.save(model, buffer)
        made["saved"] = buffer.getvalue()
        made["scripted"] = torch.jit.script(model)
        made["traced"] = torch.jit.trace(model, x)
        made["quantized"] = torch.ao.quantization.quantize_dynamic(model)
        with torch.no_grad():  # the copies compute what the model computes
            made["same"] = {name: torch.equal(made[name](x), model(x))
                            for name in ("deepcopy", "scripted", "traced")}

    with MODES[mode](model):
        _train(model, 4, each)

    copied = made["deepcopy"]
    assert _hook_keys(copied) == plain  # the user's hook only, under its own id
    assert _hook_keys(made["averaged"].module) == plain
    assert b"memsentry" not in made["pickled"] and b"memsentry" not in made["saved"]
    assert _hook_keys(pickle.loads(made["pickled"])) == plain
    loaded = torch.load(io.BytesIO(made["saved"]), weights_only=False)
    assert _hook_keys(loaded) == plain
    quantized = made["quantized"]
    assert [h for m in quantized.modules() for h in m._forward_hooks.values()] == [user_hook]
    assert not any(m._forward_pre_hooks for m in quantized.modules())
    assert made["same"] == {"deepcopy": True, "scripted": True, "traced": True}
    assert torch.equal(loaded(x), copied(x))
    assert _hook_keys(model) == plain  # none of memsentry's left after the run
    assert "__reduce_ex__" not in nn.Module.__dict__


def test_memsentrys_hooks_keep_their_places_through_scripting() -> None:
    model = _model()
    model[0].register_forward_hook(user_hook)
    with memsentry.track(model):
        model(torch.randn(2, 8)).sum().backward()
        before = _hook_keys(model)
        assert before != _hook_keys(_model())  # memsentry's hooks are on
        torch.jit.script(model)
        assert _hook_keys(model) == before


def test_a_pickled_tracked_model_loads_where_memsentry_is_not_installed(tmp_path: Any) -> None:
    model = _model()
    with memsentry.track(model):
        model(torch.randn(2, 8)).sum().backward()
        path = tmp_path / "model.pt"
        torch.save(model, path)
    code = ("import sys, torch; sys.modules['memsentry'] = None; "
            f"m = torch.load({str(path)!r}, weights_only=False); print(m(torch.ones(1, 8)).shape)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "torch.Size([1, 2])" in done.stdout


class Pinn(nn.Module):
    """A physics-informed net: the derivative of the net's output by its input, taken with
    torch.func inside the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        def u(point: torch.Tensor) -> torch.Tensor:
            return self.net(point.unsqueeze(0)).squeeze()

        du = torch.vmap(torch.func.grad(u))(x.squeeze(-1))
        return self.net(x), du


def _train_pinn(context: Callable[[nn.Module], AbstractContextManager[Any]]) -> tuple[
        list[torch.Tensor], Any]:
    torch.manual_seed(0)
    model = Pinn()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = torch.randn(6, 16, 1, generator=torch.Generator().manual_seed(3))
    with context(model) as tracker:
        for x in data:
            y, du = model(x)
            ((y - x).square().mean() + (du - 1).square().mean()).backward()
            optimizer.step()
            optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()], tracker


@pytest.mark.parametrize("mode", ["track", "watch"])
def test_torch_func_inside_a_forward_runs_as_without_memsentry_and_is_said(mode: str) -> None:
    plain, _ = _train_pinn(lambda model: nullcontext())
    tracked, tracker = _train_pinn(MODES[mode])
    assert all(torch.equal(a, b) for a, b in zip(plain, tracked, strict=True))
    notes = " ".join(tracker.report().notes)
    assert "torch.func transform" in notes and "`Pinn`" in notes


# -- a saved tensor changed in place: torch's error, word for word ----------------------------
def _output_changed() -> None:
    x = torch.randn(2, 3, requires_grad=True)
    out = nn.Sigmoid()(x)
    out.mul_(2)
    out.sum().backward()


class Apply(nn.Module):
    """A module whose forward is ``fn``: the tensors its ops save go through the hooks."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


def _input_changed() -> None:
    x = torch.randn(2, 3, requires_grad=True)
    y = x * 1
    z = Apply(torch.mul)(y, torch.randn(2, 3, requires_grad=True))
    y.add_(1)
    z.sum().backward()


def _leaf_changed() -> None:
    x = torch.randn(2, 3)
    out = nn.Linear(3, 3)(x)
    x.add_(1)
    out.sum().backward()


class Doubler(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        out = x * 2
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (out,) = ctx.saved_tensors
        return grad * 2 + out * 0


class Custom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Doubler.apply(x)


def _custom_changed() -> None:
    out = Custom()(torch.randn(3, requires_grad=True))
    out.mul_(2)
    out.sum().backward()


def _second_output_changed() -> None:
    x = torch.randn(4, 4, requires_grad=True)
    values, vectors = Apply(torch.linalg.eigh)(x @ x.T)
    vectors.mul_(2)
    (values.sum() + vectors.sum()).backward()


def _under_anomaly_mode() -> None:
    with torch.autograd.set_detect_anomaly(True), pytest.warns(UserWarning):
        _output_changed()


CASES = [_output_changed, _input_changed, _leaf_changed, _custom_changed,
         _second_output_changed, _under_anomaly_mode]


def _error(case: Callable[[], None]) -> BaseException:
    with pytest.raises(BaseException) as caught:
        case()
    return caught.value


@pytest.fixture
def tracking_everything() -> Iterator[None]:
    with memsentry.track(overhead=None):
        yield


@pytest.mark.parametrize("case", CASES, ids=[c.__name__.strip("_") for c in CASES])
def test_a_saved_tensor_changed_in_place_raises_torchs_own_error(case: Callable[[], None]) -> None:
    plain = _error(case)
    with memsentry.track(overhead=None):
        tracked = _error(case)
    assert type(tracked) is type(plain) is RuntimeError
    assert str(tracked) == str(plain)


def test_the_wording_is_read_from_each_releases_message() -> None:
    opening = FALLBACK[False].opening
    new = parse(f"{opening}[torch.FloatTensor [2, 3]], which is output 0 of Sigmoid, is at "
                "version 1; expected version 0 instead. Hint: X(True, check_nan=False).")
    old = parse(f"{opening}[torch.FloatTensor [2, 3]], which is output 0 of SigmoidBackward0, "
                "is at version 1; expected version 0 instead. Hint: X(True).")
    assert new == Wording(opening, True, " Hint: X(True, check_nan=False).")
    assert old == Wording(opening, False, " Hint: X(True).")
    assert new.node("LinalgEighBackward0") == "LinalgEigh" and new.node("DoublerBackward") \
        == "Doubler"
    assert parse("something else entirely") is None
