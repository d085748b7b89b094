"""Shared models and fixtures of the memsentry test suite (small models, CPU unless marked cuda)."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import pytest
import torch
import torch.nn.modules.module as module_globals
import torch.optim.optimizer as optimizer_globals
from torch import nn

if TYPE_CHECKING:
    from memsentry.model import ReportData

KiB = 1024
MiB = 1024 * 1024

# The global registries memsentry.track() adds hooks to; every test must leave them as it found
# them (see the autouse fixture below).
GLOBAL_HOOK_DICTS: dict[str, dict] = {
    "_global_forward_hooks": module_globals._global_forward_hooks,
    "_global_forward_pre_hooks": module_globals._global_forward_pre_hooks,
    "_global_forward_hooks_always_called": module_globals._global_forward_hooks_always_called,
    "_global_optimizer_post_hooks": optimizer_globals._global_optimizer_post_hooks,
    "_global_optimizer_pre_hooks": optimizer_globals._global_optimizer_pre_hooks,
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` need a CUDA GPU; skip them (with the reason) where there is none."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:  # not item.keywords: ids say "cuda" too
            item.add_marker(skip)


def iterations_run(report: ReportData) -> int:
    """The iterations a loop ended, from its report's timeline: the index of the block's end
    when it has a row (its partial iteration is no iteration), else the last index plus one.
    Under a budget the rows have gaps (boundaries passed with a count only), so their number
    is not the count."""
    rows = report.iterations
    if not rows:
        return 0
    last = rows[-1]
    return int(last.index) if last.boundary == "exit" else int(last.index) + 1


def optimizer_post_hooks() -> list[int]:
    """The ids of torch's global optimizer step hooks, less memsentry's idle one (see below)."""
    from memsentry.record.threads import step_hook_ids

    idle = step_hook_ids()
    return [key for key in optimizer_globals._global_optimizer_post_hooks if key not in idle]


def _hook_counts() -> dict[str, int]:
    """The size of each global registry, less memsentry's one optimizer step hook of the
    process: it stays registered, calling nobody, when a tracker stops while other live
    threads were seen stepping (removing it could break a step they are taking), and goes at
    a later stop."""
    from memsentry.record.threads import step_hook_ids

    idle = step_hook_ids()
    return {name: len([key for key in hooks if not (key in idle and "optimizer" in name)])
            for name, hooks in GLOBAL_HOOK_DICTS.items()}


@pytest.fixture(autouse=True)
def _no_hooks_left_behind() -> Iterator[None]:
    """Every test, passing or failing, must leave torch's global hook registries unchanged."""
    before = _hook_counts()
    yield
    after = _hook_counts()
    assert after == before, "a test left global module/optimizer hooks registered"


@pytest.fixture(autouse=True)
def _text_width(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reports fitted to 100 columns, whatever terminal or ``COLUMNS`` runs the suite (the
    text reports' default width follows them)."""
    monkeypatch.setenv("COLUMNS", "100")


@contextmanager
def gc_disabled() -> Iterator[None]:
    """Run a block with the cyclic garbage collector off (after one collection), so what the
    block frees is freed by reference counting alone."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


# -- models ----------------------------------------------------------------------------------


def make_mlp(d_in: int = 16, hidden: int = 32, d_out: int = 4, *, seed: int = 0) -> nn.Sequential:
    """Linear -> ReLU -> Linear, seeded."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, d_out))


class Net(nn.Module):
    """A nested model whose call order differs from its registration order, with a submodule
    that is never called."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16, 4)
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.unused = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


class TwiceShared(nn.Module):
    """Calls the same block twice per forward (weight sharing)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.block = nn.Linear(width, width)
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(torch.relu(self.block(x))))


class TempAllocator(nn.Module):
    """Allocates a 4 MiB temporary inside its forward and frees it before returning."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tmp = torch.ones(1 << 20, device=x.device)  # 2**20 float32 = 4 MiB
        return x + tmp.sum()


class Boom(nn.Module):
    """Doubles its input, but raises ValueError for a batch of exactly three rows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 3:
            raise ValueError("boom")
        return x * 2


def make_deep(blocks: int = 25, width: int = 16, *, seed: int = 0) -> nn.Sequential:
    """``blocks`` x Sequential(Linear, ReLU, Linear): 1 + 4 * blocks modules (101 by default)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        *[
            nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
            for _ in range(blocks)
        ]
    )


def train(
    model: nn.Module,
    steps: int,
    *,
    d_in: int = 16,
    batch: int = 8,
    optimizer: torch.optim.Optimizer | None = None,
    after_step: Callable[[], None] | None = None,
) -> list[float]:
    """A plain SGD training loop on random data; returns the losses."""
    opt = optimizer or torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    for _ in range(steps):
        x = torch.randn(batch, d_in)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if after_step is not None:
            after_step()
        losses.append(loss.item())
    return losses


@pytest.fixture
def mlp() -> nn.Sequential:
    return make_mlp()


@pytest.fixture
def net() -> Net:
    torch.manual_seed(0)
    return Net()


def table_rows(text: str) -> list[list[str]]:
    """The layer table's rows of a text report (between the dashed rule and the totals row),
    split on spaces."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("-----"))
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("total (leaf layers)"):
            return rows
        rows.append(line.split())
    raise AssertionError("no totals row in the layer table")
