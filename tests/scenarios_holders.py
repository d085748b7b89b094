"""Scenarios of the places issue 25 taught the census to look (functools caches, one tensor
that grows, autograd contexts, NumPy arrays, DLPack capsules, a meter's method, a loss summed
under its own name, a model entered through its own method), each as a training loop written
for this table, with the bounded forms of the same code that must not be called leaks."""

from __future__ import annotations

import functools
from typing import ClassVar

import numpy as np
import torch
from scenarios import HINT, LEAK, WASTE, Classifier, Scenario, _batch, _setup
from torch import nn

import memsentry

__all__ = ["HOLDER_SCENARIOS"]
del HINT  # (re-exported names the table below does not use)


# -- functools caches ------------------------------------------------------------------------
class Augmenter:
    """Random crops cached per (epoch, index): every step is a new key."""

    @functools.cache  # noqa: B019 - the leak under test
    def crops(self, epoch: int, index: int) -> torch.Tensor:
        return torch.randn(64, 32) * (epoch + 1)


def cache_per_step(steps: int) -> memsentry.Report:
    model, opt = _setup()
    augment = Augmenter()
    with memsentry.track(model, on_leak="ignore") as t:
        for index in range(steps):
            x = augment.crops(0, index)
            nn.functional.cross_entropy(model(x), torch.randint(0, 10, (64,))).backward()
            opt.step()
            opt.zero_grad()
    return t.report()


@functools.lru_cache(maxsize=4)
def class_weights(phase: int) -> torch.Tensor:
    return torch.rand(10) + phase


def bounded_cache(steps: int) -> memsentry.Report:
    model, opt = _setup()
    with memsentry.track(model, on_leak="ignore") as t:
        for step in range(steps):
            x, y = _batch()
            loss = nn.functional.cross_entropy(model(x), y, weight=class_weights(step % 7))
            loss.backward()
            opt.step()
            opt.zero_grad()
    return t.report()


# -- one tensor that grows -------------------------------------------------------------------
def _logits_step(model: nn.Module, opt: torch.optim.Optimizer, size: int) -> torch.Tensor:
    """One ordinary training step on a batch of ``size``; returns its logits."""
    x, y = _batch(size)
    logits = model(x)
    nn.functional.cross_entropy(logits, y).backward()
    opt.step()
    opt.zero_grad()
    return logits


def _contrastive(steps: int, window: int | None) -> memsentry.Report:
    """A contrastive loop whose negatives bank gains the batch's embeddings every step; with
    ``window``, it keeps the newest ``window`` rows (MoCo's queue)."""
    model, opt = _setup()
    negatives = torch.empty(0, 10)
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(steps):
            emb = _logits_step(model, opt, 256)
            negatives = torch.cat((negatives, emb.detach()), dim=0)
            if window is not None:
                negatives = negatives[-window:].clone()
    return t.report()


def memory_bank_grows(steps: int) -> memsentry.Report:
    return _contrastive(steps, window=None)


def memory_bank_as_a_queue(steps: int) -> memsentry.Report:
    return _contrastive(steps, window=1024)


# -- autograd contexts kept by the user ------------------------------------------------------
class ClampGrad(torch.autograd.Function):
    """Identity forward, clamped gradient; remembers its contexts for a later inspection."""

    contexts: ClassVar[dict[int, list[object]]] = {}

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)  # type: ignore[attr-defined]
        ClampGrad.contexts.setdefault(len(ClampGrad.contexts) % 3, []).append(ctx)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad.clamp(-1, 1)


def contexts_kept(steps: int) -> memsentry.Report:
    model, opt = _setup()
    ClampGrad.contexts = {}
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(steps):
            x, y = _batch(256)
            out = ClampGrad.apply(model.encoder(x))
            nn.functional.cross_entropy(model.head(out), y).backward()
            opt.step()
            opt.zero_grad()
    report = t.report()
    ClampGrad.contexts = {}
    return report


# -- NumPy arrays and DLPack capsules --------------------------------------------------------
def arrays_per_class(steps: int) -> memsentry.Report:
    """Evaluation-style logging: each step's logits as NumPy views, filed by label."""
    model, opt = _setup()
    by_label: dict[str, list[np.ndarray]] = {"pos": [], "neg": []}
    with memsentry.track(model, on_leak="ignore") as t:
        for step in range(steps):
            logits = _logits_step(model, opt, 512)
            by_label["pos" if step % 2 else "neg"].append(logits.detach().numpy())
    return t.report()


def capsules_for_an_exporter(steps: int) -> memsentry.Report:
    model, opt = _setup()
    outbox = []
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(steps):
            logits = _logits_step(model, opt, 512)
            outbox.append(logits.detach().__dlpack__())  # never handed over
    return t.report()


# -- a meter fed the loss tensor; a loss summed under its own name ----------------------------
class Meter:
    def __init__(self) -> None:
        self.total = 0.0
        self.count = 0

    def add(self, value: torch.Tensor | float, weight: int = 1) -> None:
        self.total += value * weight
        self.count += weight


def meter_fed_tensors(steps: int) -> memsentry.Report:
    model, opt = _setup()
    train_meter = Meter()
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(steps):
            x, y = _batch()
            ce = nn.functional.cross_entropy(model(x), y)
            ce.backward()
            opt.step()
            opt.zero_grad()
            train_meter.add(ce, len(x))
    return t.report()


def generator_loss_summed(steps: int) -> memsentry.Report:
    model, opt = _setup()
    critic = Classifier()
    critic_opt = torch.optim.SGD(critic.parameters(), lr=0.01)
    g_epoch = 0.0
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(steps):
            fake = model(torch.randn(64, 32))
            g_cost = -critic(torch.cat([fake, fake, fake, fake[:, :2]], dim=1)).mean()
            g_cost.backward()
            opt.step()
            opt.zero_grad()
            critic_opt.zero_grad()
            g_epoch += g_cost
    del g_epoch
    return t.report()


# -- a model entered through its own method -----------------------------------------------------
class Agent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64))
        self.policy = nn.Linear(64, 4)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.policy(self.trunk(obs))

    def choose(self, obs: torch.Tensor) -> torch.Tensor:
        return self.forward(obs).argmax(dim=-1)


def agent_acts_with_graphs(steps: int) -> memsentry.Report:
    torch.manual_seed(0)
    agent = Agent()
    opt = torch.optim.Adam(agent.parameters(), lr=1e-3)
    with memsentry.track(agent, on_leak="ignore") as t:
        for _ in range(steps):
            for _ in range(16):  # acting in the environment
                agent.choose(torch.randn(256, 32))
            loss = agent(torch.randn(64, 32)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    return t.report()


HOLDER_SCENARIOS: tuple[Scenario, ...] = (
    Scenario("lru_cache keyed by the step", "#28", "leak", "tensor-accumulation", LEAK,
             "crops", cache_per_step),
    Scenario("lru_cache(maxsize=4) of weights", "#28", "not a leak", None, None, None,
             bounded_cache),
    Scenario("memory bank grown by torch.cat", "#3", "leak", "tensor-accumulation", LEAK,
             "negatives", memory_bank_grows),
    Scenario("memory bank kept as a queue", "#3", "not a leak", None, None, None,
             memory_bank_as_a_queue),
    Scenario("autograd contexts kept", "#9", "leak", "tensor-accumulation", LEAK,
             "contexts", contexts_kept),
    Scenario("NumPy views filed by label", "#3", "leak", "tensor-accumulation", LEAK,
             "by_label", arrays_per_class),
    Scenario("DLPack capsules never consumed", "-", "leak", "tensor-accumulation", LEAK,
             "outbox", capsules_for_an_exporter),
    Scenario("meter fed the loss tensor", "#1", "leak", "retained-graph", LEAK,
             "train_meter", meter_fed_tensors),
    Scenario("generator loss summed", "#1", "leak", "retained-graph", LEAK,
             "g_epoch", generator_loss_summed),
    Scenario("agent acts through its own method", "#14", "waste", "missing-no-grad", WASTE,
             "Agent", agent_acts_with_graphs),
)
