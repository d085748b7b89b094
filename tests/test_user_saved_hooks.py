"""Hooks the user sets on single saved tensors (``grad_fn._raw_saved_*.register_hooks``) work
under memsentry as without it: torch allows one pair per saved tensor, so where the user's
code sets them memsentry puts none of its own on, and says so.

This file must stay apart: its own source registers such hooks, so every tracker started from
it leaves saved tensors alone.
"""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import memsentry


def _train(context: Callable[[nn.Module], Any], register: Callable[[torch.Tensor], None],
           model: nn.Module) -> tuple[list[torch.Tensor], int, Any]:
    packed: list[int] = []
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(5, 3, 4, generator=torch.Generator().manual_seed(2))
    with context(model) as tracker:
        for x in data:
            out = model(x)
            register(out)
            packed.append(1)
            out.square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()], len(packed), tracker


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _to_cpu_and_back(out: torch.Tensor) -> None:
    calls = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        calls.append(tensor.shape)
        return tensor.clone()

    out.grad_fn._raw_saved_mat1.register_hooks(pack, lambda tensor: tensor)
    assert calls  # torch packs at registration


@pytest.mark.parametrize("mode", ["track", "watch", "global"])
def test_hooks_on_a_saved_tensor_set_in_the_loop_work_and_are_said(mode: str) -> None:
    contexts = {"track": memsentry.track, "watch": memsentry.watch,
                "global": lambda model: memsentry.track()}
    plain, _, _ = _train(lambda model: nullcontext(), _to_cpu_and_back, _mlp())
    tracked, _, tracker = _train(contexts[mode], _to_cpu_and_back, _mlp())
    assert all(torch.equal(a, b) for a, b in zip(plain, tracked, strict=True))
    notes = " ".join(tracker.report().notes)
    line = next(n for n, text in enumerate(Path(__file__).read_text().splitlines(), 1)
                if ".register_hooks(pack" in text)
    assert f"test_user_saved_hooks.py:{line} sets hooks on single saved tensors" in notes


MODEL_SOURCE = '''
import torch
from torch import nn


class Offloaded(nn.Module):
    """Offloads what its second layer saves, through that tensor's own hooks."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(4, 8), nn.Linear(8, 1)

    def forward(self, x):
        out = self.second(torch.tanh(self.first(x)))
        saved = out.grad_fn._raw_saved_mat1
        saved.register_hooks(lambda t: t.clone(), lambda t: t)
        return out
'''


def test_hooks_on_a_saved_tensor_set_in_the_models_own_file_work(tmp_path: Path) -> None:
    path = tmp_path / "offloaded.py"
    path.write_text(textwrap.dedent(MODEL_SOURCE))
    spec = importlib.util.spec_from_file_location("offloaded_model", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["offloaded_model"] = module
    try:
        spec.loader.exec_module(module)
        torch.manual_seed(0)
        plain, _, _ = _train(lambda model: nullcontext(), lambda out: None, module.Offloaded())
        torch.manual_seed(0)
        tracked, _, tracker = _train(memsentry.track, lambda out: None, module.Offloaded())
    finally:
        del sys.modules["offloaded_model"]
    assert all(torch.equal(a, b) for a, b in zip(plain, tracked, strict=True))
    line = next(n for n, text in enumerate(path.read_text().splitlines(), 1)
                if ".register_hooks(" in text)
    assert any(f"offloaded.py:{line} sets hooks on single saved tensors" in n
               for n in tracker.report().notes)
