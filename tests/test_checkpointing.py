"""memsentry beside every other user of saved-tensor hooks: activation checkpointing in both
modes, selective checkpointing, ``checkpoint_wrapper``, ``save_on_cpu`` and the user's own
``saved_tensors_hooks``, inside and around tracked modules. The run is bit for bit what it is
untracked, nothing raises that did not, and the report says what checkpointed layers keep and
where memsentry stepped aside."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from conftest import iterations_run
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import memsentry

Wrap = Callable[[Callable[..., torch.Tensor], torch.Tensor], torch.Tensor]


def _plain(fn: Callable[..., torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return fn(x)


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keep matrix products, recompute the rest (a common selective policy)."""
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class _Counting(torch.autograd.graph.saved_tensors_hooks):
    """The user's own hooks: counts what is saved, returns it unchanged."""

    def __init__(self) -> None:
        self.packed = 0

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            self.packed += 1
            return tensor

        super().__init__(pack, lambda tensor: tensor)


_USER_HOOKS: list[_Counting] = []


def _own_hooks(fn: Callable[..., torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    hooks = _Counting()
    _USER_HOOKS.append(hooks)
    with hooks:
        return fn(x)


def _on_cpu(fn: Callable[..., torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    with torch.autograd.graph.save_on_cpu():
        return fn(x)


#: How the block's inner layers are run inside the model's forward.
INNER: dict[str, Wrap] = {
    "non-reentrant checkpoint": functools.partial(checkpoint, use_reentrant=False),
    "reentrant checkpoint": functools.partial(checkpoint, use_reentrant=True),
    "selective checkpoint": lambda fn, x: checkpoint(
        fn, x, use_reentrant=False,
        context_fn=functools.partial(create_selective_checkpoint_contexts, _policy)),
    "save_on_cpu inside": _on_cpu,
    "own hooks inside": _own_hooks,
}


class Net(nn.Module):
    def __init__(self, inner: Wrap) -> None:
        super().__init__()
        self.stem = nn.Linear(32, 64)
        self.block = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Dropout(0.1),
                                   nn.Linear(64, 64))
        self.head = nn.Linear(64, 1)
        self._inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        return self.head(self._inner(self.block, h))


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


#: What surrounds each call of the model.
OUTER: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {
    "nothing around": _nothing,
    "save_on_cpu around": torch.autograd.graph.save_on_cpu,
}

#: How the model is tracked (the options given to ``_run`` go to ``track``).
TRACK: dict[str, Callable[..., memsentry.Tracker | None]] = {
    "untracked": lambda model, **options: None,
    "track(model)": lambda model, **options: memsentry.track(model, on_leak="ignore",
                                                             **options),
    "track()": lambda model, **options: memsentry.track(on_leak="ignore", **options),
    "track(model, exact=True)": lambda model, **options: memsentry.track(
        model, exact=True, on_leak="ignore", **options),
}


def _run(inner: str, outer: str, how: str, steps: int = 4, **options: Any
         ) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], memsentry.Report | None]:
    torch.manual_seed(0)
    model = Net(INNER[inner])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    tracker = TRACK[how](model, **options)
    losses = []
    if tracker is not None:
        tracker.start()
    try:
        for _ in range(steps):
            x = torch.randn(16, 32, generator=data)
            with OUTER[outer]():
                loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach().clone())
    finally:
        report = tracker.stop() if tracker is not None else None
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, report


@pytest.mark.parametrize("how", [h for h in TRACK if h != "untracked"])
@pytest.mark.parametrize("outer", list(OUTER))
@pytest.mark.parametrize("inner", list(INNER))
def test_saved_tensor_hooks_of_others_run_as_without_memsentry(inner: str, outer: str,
                                                                how: str) -> None:
    plain_losses, plain_state, _ = _run(inner, outer, "untracked")
    losses, state, report = _run(inner, outer, how)
    assert report is not None
    for plain, tracked in zip(plain_losses, losses, strict=True):
        assert torch.equal(plain, tracked)
    for name, value in plain_state.items():
        assert torch.equal(value, state[name]), name
    assert iterations_run(report) == 4  # recomputations and nested backwards are no steps


def _layers(report: memsentry.Report) -> dict[str, memsentry.LayerStats]:
    return {layer.name: layer for layer in report.layers}


def test_checkpointed_layers_keep_nothing_and_the_report_says_they_are_recomputed() -> None:
    _, _, plain = _run("own hooks inside", "nothing around", "track(model)")
    # the layers' figures and calls of every step: no budget
    _, _, ckpt = _run("non-reentrant checkpoint", "nothing around", "track(model)",
                      overhead=None)
    assert plain is not None and ckpt is not None
    layers = _layers(ckpt)
    # The block keeps nothing between forward and backward; the stem and head are measured.
    assert layers["block"].saved_bytes == 0
    assert layers["block.0"].saved_bytes == 0
    assert (layers["head"].saved_bytes or 0) > 0
    assert layers["block"].calls == 4  # the recomputations are not counted as calls
    notes = " ".join(ckpt.notes)
    assert "ran under activation checkpointing" in notes
    assert "ran again inside backward passes" in notes


def test_selective_checkpointing_is_told_apart_from_plain_checkpointing() -> None:
    _, _, report = _run("selective checkpoint", "nothing around", "track(model)")
    assert report is not None
    assert _layers(report)["block.0"].saved_bytes is None  # the policy keeps its mm outputs
    assert any("ran under selective activation checkpointing" in n for n in report.notes)


def test_layers_under_the_users_own_hooks_are_not_measured_and_their_hooks_see_everything(
        ) -> None:
    _USER_HOOKS.clear()
    _run("own hooks inside", "nothing around", "untracked")
    untracked = sum(h.packed for h in _USER_HOOKS)
    _USER_HOOKS.clear()
    _, _, report = _run("own hooks inside", "nothing around", "track(model)")
    assert report is not None
    assert sum(h.packed for h in _USER_HOOKS) == untracked > 0  # nothing was taken from them
    layers = _layers(report)
    assert layers["block.0"].saved_bytes is None  # not measured, not "0"
    assert (layers["stem"].saved_bytes or 0) > 0
    assert any("_Counting" in note and "not measured" in note for note in report.notes)


def test_save_on_cpu_around_the_model_is_named_in_the_report() -> None:
    _, _, report = _run("non-reentrant checkpoint", "save_on_cpu around", "track(model)")
    assert report is not None
    assert any("torch.autograd.graph.save_on_cpu" in note for note in report.notes)
    assert _layers(report)["Net"].saved_bytes is None


def test_checkpoint_wrapper_runs_as_untracked() -> None:
    wrappers = pytest.importorskip("torch.distributed.algorithms._checkpoint.checkpoint_wrapper")

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                              nn.Linear(32, 1))
        model[2] = wrappers.checkpoint_wrapper(model[2])  # non-reentrant by default
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    def train(tracked: bool) -> list[torch.Tensor]:
        model, opt = build()
        context = (memsentry.track(model, on_leak="ignore") if tracked
                   else contextlib.nullcontext())
        out = []
        with context:
            for step in range(3):
                x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
                loss = model(x).sum()
                loss.backward()
                opt.step()
                opt.zero_grad()
                out.append(loss.detach())
        return out + [p.detach() for p in model.parameters()]

    for plain, tracked in zip(train(False), train(True), strict=True):
        assert torch.equal(plain, tracked)
