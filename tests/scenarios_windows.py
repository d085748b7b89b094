"""Loops whose memory rises and falls on purpose, and leaks that hide behind a reset (issue 10).

Written fresh after the sawtooth rule, to try it on code it was not tuned for: buffers flushed
every N steps, epoch metrics gathered and cleared, gradient accumulation, a running mean, an
EMA copy of the weights, truncated BPTT done right; and the leaks they resemble, over epochs
long enough that later censuses land just after a reset.
"""

from __future__ import annotations

import copy

import torch
from scenarios import LEAK, Scenario, _batch, _setup
from torch import nn

import memsentry

#: Steps per epoch in the long-epoch loops: censuses at iterations 66 and 130 land early in
#: an epoch, after the name was rebound.
LONG_EPOCH = 40


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _batch()
    logits = model(x)
    loss = nn.functional.cross_entropy(logits, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return logits, loss


# -- leaks behind a reset -----------------------------------------------------------------------
def _train_long_epoch(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> float:
    epoch_loss = 0
    for _ in range(steps):
        _logits, loss = _step(model, opt)
        epoch_loss = epoch_loss + loss  # every step's graph, until the next epoch
    return torch.as_tensor(epoch_loss).item() / max(steps, 1)


def loss_summed_over_long_epochs(steps: int) -> memsentry.Report:
    """#32: forty steps an epoch; the later censuses see the sum just after its reset."""
    model, opt = _setup()
    with memsentry.track(model, on_leak="ignore") as t:
        for start in range(0, steps, LONG_EPOCH):
            _train_long_epoch(model, opt, min(LONG_EPOCH, steps - start))
    return t.report()


def detached_features_per_epoch(steps: int) -> memsentry.Report:
    """#3 per epoch: 256 KiB of detached features a step, gathered for an epoch-end metric."""
    model, opt = _setup()
    with memsentry.track(model, on_leak="ignore") as t:
        done = 0
        while done < steps:
            epoch_feats = []
            for _ in range(min(10, steps - done)):
                x, y = _batch(256)
                features = model.encoder(x)
                loss = nn.functional.cross_entropy(model.head(torch.relu(features)), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                epoch_feats.append(features.detach())  # 256 x 64 floats a step
                done += 1
            torch.cat(epoch_feats).norm(dim=1).mean().item()
    return t.report()


# -- memory that rises and falls by design --------------------------------------------------
def loss_buffer_flushed(steps: int) -> memsentry.Report:
    """#28: detached losses buffered and logged every 25 steps, then the buffer is cleared."""
    model, opt = _setup()
    logged = []
    with memsentry.track(model, on_leak="ignore") as t:
        window: list[torch.Tensor] = []
        for _ in range(steps):
            _logits, loss = _step(model, opt)
            window.append(loss.detach())
            if len(window) == 25:
                logged.append(torch.stack(window).mean().item())
                window.clear()
    return t.report()


def epoch_predictions_for_accuracy(steps: int) -> memsentry.Report:
    """Predicted classes gathered over a 20-step epoch for its accuracy, then dropped."""
    model, opt = _setup()
    accuracies = []
    with memsentry.track(model, on_leak="ignore") as t:
        done = 0
        while done < steps:
            preds, targets = [], []
            for _ in range(min(20, steps - done)):
                x, y = _batch()
                logits = model(x)
                loss = nn.functional.cross_entropy(logits, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                preds.append(logits.argmax(1))
                targets.append(y)
                done += 1
            accuracies.append((torch.cat(preds) == torch.cat(targets)).float().mean().item())
    return t.report()


def validation_outputs_under_no_grad(steps: int) -> memsentry.Report:
    """Train five steps, then validate five batches under no_grad keeping their outputs for
    the epoch's metric; the outputs are dropped when the epoch ends."""
    model, opt = _setup()
    scores = []
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(0, steps, 5):
            model.train()
            for _ in range(5):
                _step(model, opt)
            model.eval()
            val_outputs = []
            with torch.no_grad():
                for _ in range(5):
                    val_outputs.append(model(_batch()[0]))
            scores.append(torch.cat(val_outputs).softmax(1).max(1).values.mean().item())
    return t.report()


def running_mean_of_detached_loss(steps: int) -> memsentry.Report:
    """An exponential running mean of the loss, kept as a detached tensor."""
    model, opt = _setup()
    with memsentry.track(model, on_leak="ignore") as t:
        running = torch.zeros(())
        for _ in range(steps):
            _logits, loss = _step(model, opt)
            running = 0.9 * running + 0.1 * loss.detach()
    assert running.grad_fn is None
    return t.report()


def gradient_accumulation(steps: int) -> memsentry.Report:
    """Four micro-batches a step, each loss scaled and backpropagated at once."""
    model, opt = _setup()
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(steps):
            for _ in range(4):
                x, y = _batch(16)
                (nn.functional.cross_entropy(model(x), y) / 4).backward()
            opt.step()
            opt.zero_grad()
    return t.report()


def ema_of_the_weights(steps: int) -> memsentry.Report:
    """An exponential moving average copy of the model, updated under no_grad each step."""
    model, opt = _setup()
    ema = copy.deepcopy(model).requires_grad_(False)
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(steps):
            _step(model, opt)
            with torch.no_grad():
                for kept, live in zip(ema.parameters(), model.parameters(), strict=True):
                    kept.mul_(0.99).add_(live, alpha=0.01)
    return t.report()


def truncated_bptt_detached(steps: int) -> memsentry.Report:
    """An LSTM trained on chunks of a long sequence; the state is detached between chunks."""
    torch.manual_seed(0)
    lstm, head = nn.LSTM(16, 32, batch_first=True), nn.Linear(32, 1)
    model = nn.ModuleDict({"lstm": lstm, "head": head})
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with memsentry.track(model, on_leak="ignore") as t:
        state = (torch.zeros(1, 8, 32), torch.zeros(1, 8, 32))
        for _ in range(steps):
            out, state = lstm(torch.randn(8, 12, 16), state)
            loss = head(out).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            state = (state[0].detach(), state[1].detach())
    return t.report()


WINDOW_SCENARIOS: tuple[Scenario, ...] = (
    Scenario("loss summed per 40-step epoch, five epochs", "#32", "leak", "retained-graph",
             LEAK, "epoch_loss", loss_summed_over_long_epochs, steps=5 * LONG_EPOCH),
    Scenario("detached features per epoch", "#3", "leak", "tensor-accumulation", LEAK,
             "epoch_feats", detached_features_per_epoch, steps=30),
    Scenario("loss buffer flushed every 25 steps", "#28", "not a leak", None, None, None,
             loss_buffer_flushed, steps=120),
    Scenario("epoch predictions for accuracy", "#28", "not a leak", None, None, None,
             epoch_predictions_for_accuracy, steps=60),
    Scenario("validation outputs under no_grad", "-", "not a leak", None, None, None,
             validation_outputs_under_no_grad, steps=30),
    Scenario("running mean of the detached loss", "-", "not a leak", None, None, None,
             running_mean_of_detached_loss, steps=20),
    Scenario("gradient accumulation, 4 micro-batches", "-", "not a leak", None, None, None,
             gradient_accumulation, steps=12),
    Scenario("EMA copy of the weights", "-", "not a leak", None, None, None,
             ema_of_the_weights, steps=12),
    Scenario("truncated BPTT, state detached", "#4", "not a leak", None, None, None,
             truncated_bptt_detached, steps=20),
)
