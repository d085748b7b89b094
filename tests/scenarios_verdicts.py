"""More loops, each a class of code where an earlier memsentry gave a wrong verdict (issue 10):
leaks that reset every epoch, containers that fill up to a bound and stay there.

Written fresh, not tuned on the rules: each loop is the way people write that code. The
scenario table extends :data:`scenarios.SCENARIOS`; :data:`ALL_SCENARIOS` is both.
"""

from __future__ import annotations

import collections
import collections.abc
from typing import Any

import torch
from scenarios import (
    HINT,
    LEAK,
    SCENARIOS,
    WASTE,
    Classifier,
    Scenario,
    _batch,
    _setup,
)
from scenarios_holders import HOLDER_SCENARIOS
from scenarios_windows import WINDOW_SCENARIOS
from torch import nn

import memsentry

#: Iterations per epoch in the epoch-shaped loops: leaks that reset at each epoch's start.
EPOCH = 10

__all__ = ["ALL_SCENARIOS", "HINT", "LEAK", "VERDICT_SCENARIOS", "WASTE"]


def _epochs(steps: int) -> list[int]:
    """Iterations of each epoch for a run of ``steps`` iterations."""
    return [min(EPOCH, steps - start) for start in range(0, steps, EPOCH)]


# -- leaks that reset every epoch ---------------------------------------------------------------
def train_epoch_summing_the_loss(model: Classifier, opt: torch.optim.Optimizer,
                                 steps: int) -> float:
    total_loss = 0
    for _ in range(steps):
        x, y = _batch()
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        total_loss += loss  # the graph of every step of this epoch stays alive
    return total_loss.item() / steps


def loss_summed_per_epoch(steps: int) -> memsentry.Report:
    """#1 in a ``train()`` called once per epoch: the sum is rebound at each epoch's start."""
    model, opt = _setup()
    with memsentry.track(model, on_leak="ignore") as t:
        for n in _epochs(steps):
            train_epoch_summing_the_loss(model, opt, n)
    return t.report()


def train_epoch_keeping_outputs(model: Classifier, opt: torch.optim.Optimizer,
                                steps: int) -> torch.Tensor:
    epoch_outputs = []
    for _ in range(steps):
        x, y = _batch()
        output = model(x)
        nn.functional.cross_entropy(output, y).backward()
        opt.step()
        opt.zero_grad()
        epoch_outputs.append(output)  # kept with its graph until the epoch ends
    return torch.cat(epoch_outputs).argmax(1)


def outputs_kept_per_epoch(steps: int) -> memsentry.Report:
    """#2 per epoch: outputs gathered for an epoch metric, with their graphs."""
    model, opt = _setup()
    with memsentry.track(model, on_leak="ignore") as t:
        for n in _epochs(steps):
            train_epoch_keeping_outputs(model, opt, n)
    return t.report()


# -- bounded containers -------------------------------------------------------------------------
def deque_filling_slowly(steps: int) -> memsentry.Report:
    """#28: a ``deque(maxlen=12)`` that fills over twelve iterations, then stays full."""
    model, opt = _setup()
    recent: collections.deque[torch.Tensor] = collections.deque(maxlen=12)
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(steps):
            x, y = _batch()
            logits = model(x)
            nn.functional.cross_entropy(logits, y).backward()
            opt.step()
            opt.zero_grad()
            recent.append(logits.detach())
    return t.report()


def list_bounded_by_hand(steps: int) -> memsentry.Report:
    """#28: a list trimmed to its last eight entries by hand (``del history[0]``)."""
    model, opt = _setup()
    history: list[torch.Tensor] = []
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(steps):
            x, y = _batch()
            logits = model(x)
            nn.functional.cross_entropy(logits, y).backward()
            opt.step()
            opt.zero_grad()
            history.append(logits.detach())
            if len(history) > 8:
                del history[0]
    return t.report()


# -- two optimizers --------------------------------------------------------------------------
class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z)


class Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def gan_training(steps: int, **options: Any) -> memsentry.Report:
    """A GAN step as tutorials write it: the discriminator's optimizer steps first, then the
    generator's loss is backpropagated through the fake batch made before that step
    (``options`` go to ``track()``)."""
    torch.manual_seed(0)
    gen, disc = Generator(), Discriminator()
    opt_g = torch.optim.Adam(gen.parameters(), lr=2e-4)
    opt_d = torch.optim.Adam(disc.parameters(), lr=2e-4)
    bce = nn.BCEWithLogitsLoss()
    with memsentry.track(on_leak="ignore", **options) as t:
        for _ in range(steps):
            real = torch.randn(64, 32)
            fake = gen(torch.randn(64, 16))
            opt_d.zero_grad()
            d_loss = bce(disc(real), torch.ones(64, 1)) + bce(disc(fake.detach()),
                                                               torch.zeros(64, 1))
            d_loss.backward()
            opt_d.step()
            opt_g.zero_grad()
            g_loss = bce(disc(fake), torch.ones(64, 1))
            g_loss.backward()
            opt_g.step()
    return t.report()


# -- state cleared right after the optimizer step ----------------------------------------------
class Policy(nn.Module):
    """A REINFORCE policy that keeps its episode's log-probabilities, as PyTorch's example does."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 2))
        self.saved_log_probs: list[torch.Tensor] = []
        self.rewards: list[float] = []

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.net(state), dim=-1)


def finish_episode(policy: Policy, opt: torch.optim.Optimizer) -> None:
    returns = torch.tensor(policy.rewards)
    loss = torch.stack([-lp * r for lp, r in zip(policy.saved_log_probs, returns,
                                                 strict=True)]).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    del policy.rewards[:]  # the episode's state goes right after the step
    del policy.saved_log_probs[:]


def reinforce_episodes(steps: int) -> memsentry.Report:
    """Policy gradient: an episode of 20 actions, then one update; the episode's graph is kept
    on the policy until the update, then cleared."""
    torch.manual_seed(0)
    policy = Policy()
    opt = torch.optim.Adam(policy.parameters(), lr=1e-2)
    with memsentry.track(policy, on_leak="ignore") as t:
        for _ in range(steps):
            for _ in range(20):
                probs = policy(torch.randn(1, 4))
                action = torch.distributions.Categorical(probs).sample()
                policy.saved_log_probs.append(torch.log(probs[0, action]))
                policy.rewards.append(1.0)
            finish_episode(policy, opt)
    return t.report()


# -- loops without a torch.optim optimizer ------------------------------------------------------
def sgd_by_hand(model: nn.Module, lr: float = 0.01) -> None:
    """The update of PyTorch's word-language-model example: no optimizer object."""
    for p in model.parameters():
        if p.grad is not None:
            p.data.add_(p.grad, alpha=-lr)
            p.grad = None


def loss_summed_with_sgd_by_hand(steps: int) -> memsentry.Report:
    """#1 in a loop that updates its weights by hand: iterations come from backward passes."""
    model, _opt = _setup()
    with memsentry.track(model, on_leak="ignore") as t:
        total_loss = 0
        for _ in range(steps):
            x, y = _batch()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            sgd_by_hand(model)
            total_loss += loss
    return t.report()


def hidden_state_with_sgd_by_hand(steps: int) -> memsentry.Report:
    """#4 with a hand-written update: the RNN's hidden state is carried without detach()."""
    torch.manual_seed(0)
    rnn = nn.GRU(16, 32, batch_first=True)
    with memsentry.track(rnn, on_leak="ignore") as t:
        hidden = torch.zeros(1, 8, 32)
        for _ in range(steps):
            out, hidden = rnn(torch.randn(8, 5, 16), hidden)
            out.pow(2).mean().backward(retain_graph=True)
            sgd_by_hand(rnn)
    return t.report()


def inference_without_no_grad(steps: int) -> memsentry.Report:
    """#14 in an inference script: no backward at all; iterations are the model's calls."""
    model, _opt = _setup()
    model.eval()
    predictions = []
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(steps):
            x, _y = _batch()
            predictions.append(model(x).argmax(1).tolist())
    assert len(predictions) == steps
    return t.report()


VERDICT_SCENARIOS: tuple[Scenario, ...] = (
    Scenario("loss summed per epoch, first epoch", "#1", "leak", "retained-graph", LEAK,
             "total_loss", loss_summed_per_epoch),
    Scenario("loss summed per epoch, three epochs", "#1", "leak", "retained-graph", LEAK,
             "total_loss", loss_summed_per_epoch, steps=3 * EPOCH),
    Scenario("outputs kept per epoch, three epochs", "#2", "leak", "tensor-accumulation",
             LEAK, "epoch_outputs", outputs_kept_per_epoch, steps=3 * EPOCH),
    Scenario("deque(maxlen=12) filling up", "#28", "not a leak", None, None, None,
             deque_filling_slowly, steps=20),
    Scenario("list trimmed by hand to 8", "#28", "not a leak", None, None, None,
             list_bounded_by_hand, steps=20),
    Scenario("GAN, discriminator stepped first", "-", "not a leak", None, None, None,
             gan_training),
    Scenario("episode state cleared after the step", "-", "not a leak", None, None, None,
             reinforce_episodes, steps=12),
    Scenario("loss summed, SGD by hand", "#1", "leak", "retained-graph", LEAK, "total_loss",
             loss_summed_with_sgd_by_hand),
    Scenario("hidden state, SGD by hand", "#4", "leak", "retained-graph", LEAK, "hidden",
             hidden_state_with_sgd_by_hand),
    Scenario("inference without no_grad", "#14", "waste", "missing-no-grad", WASTE,
             "Classifier", inference_without_no_grad),
)

ALL_SCENARIOS: tuple[Scenario, ...] = SCENARIOS + VERDICT_SCENARIOS + WINDOW_SCENARIOS


# -- holders Python keeps inside functions ------------------------------------------------------
def record_output(output: torch.Tensor, history: list[torch.Tensor] = []) -> int:  # noqa: B006
    history.append(output)  # the default list is created once and kept by the function
    return len(history)


def mutable_default_argument(steps: int) -> memsentry.Report:
    """A leak held by a function's mutable default argument."""
    model, opt = _setup()
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(steps):
            x, y = _batch()
            output = model(x)
            nn.functional.cross_entropy(output, y).backward()
            opt.step()
            opt.zero_grad()
            record_output(output)
    report = t.report()
    record_output.__defaults__[0].clear()  # type: ignore[index]  # the next scenario's turn
    return report


def make_logger() -> collections.abc.Callable[[torch.Tensor], None]:
    seen: list[torch.Tensor] = []

    def log(value: torch.Tensor) -> None:
        seen.append(value)  # the closure's list keeps every value

    return log


log_step = make_logger()


def closure_keeps_tensors(steps: int) -> memsentry.Report:
    """A leak held in a closure cell of a module-level function."""
    global log_step
    log_step = make_logger()  # a fresh closure for each run
    model, opt = _setup()
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(steps):
            x, y = _batch()
            logits = model(x)
            nn.functional.cross_entropy(logits, y).backward()
            opt.step()
            opt.zero_grad()
            log_step(logits.detach())
    report = t.report()
    log_step = make_logger()  # what this run kept goes
    return report


VERDICT_SCENARIOS += (
    Scenario("mutable default argument", "#2", "leak", "tensor-accumulation", LEAK,
             "record_output.__defaults__[0]", mutable_default_argument),
    Scenario("closure keeps tensors", "#3", "leak", "tensor-accumulation", LEAK,
             "log_step.__closure__[0].cell_contents", closure_keeps_tensors),
)
ALL_SCENARIOS = SCENARIOS + VERDICT_SCENARIOS + WINDOW_SCENARIOS + HOLDER_SCENARIOS
