"""The field guide's patterns (``../shared/leak-patterns.md``) as real, small training loops.

Each scenario runs a loop under ``memsentry.track`` for a given number of iterations and
returns the report; :data:`SCENARIOS` says what memsentry must conclude: the rule, the
severity and the holder the finding must name, or, for the not-a-leak cases, that no LEAK is
reported. The tests (test_scenarios.py) and the detection benchmark use the same table.
"""

from __future__ import annotations

import collections
import gc
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

import memsentry
from memsentry.rules.growth import WARMUP

#: Iterations each scenario runs by default: the warm-up plus five, the detection promise.
STEPS = WARMUP + 5


class Classifier(nn.Module):
    """A small two-part classifier: named parts make readable holder and module names."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, width))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.encoder(x)))


def _setup(seed: int = 0) -> tuple[Classifier, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Classifier()
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _batch(size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(size, 32), torch.randint(0, 10, (size,))


def _train_step(model: nn.Module, opt: torch.optim.Optimizer) -> torch.Tensor:
    """One ordinary step (for scenarios whose leak is elsewhere); returns the loss."""
    x, y = _batch()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


@contextmanager
def _gc(enabled: bool, threshold: int | None = None) -> Iterator[None]:
    was_enabled, old = gc.isenabled(), gc.get_threshold()
    gc.disable() if not enabled else gc.enable()
    if threshold is not None:
        gc.set_threshold(threshold)
    try:
        yield
    finally:
        gc.set_threshold(*old)
        gc.enable() if was_enabled else gc.disable()
        gc.collect()


# -- leaks ---------------------------------------------------------------------------------------
def loss_summed_as_tensor(steps: int) -> memsentry.Report:
    """#1: ``total_loss += loss`` after backward: only autograd nodes pile up."""
    model, opt = _setup()
    total_loss = torch.zeros(())
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(steps):
            x, y = _batch()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            total_loss += loss
    return t.report()


def loss_summed_without_tracking_a_model(steps: int) -> memsentry.Report:
    """#1 with global module hooks (``track()`` without a model)."""
    model, opt = _setup()
    running = 0.0
    with memsentry.track(on_leak="ignore") as t:
        for _ in range(steps):
            x, y = _batch()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            running = running + loss
    return t.report()


def validation_loss_summed(steps: int) -> memsentry.Report:
    """#1 without backward: an evaluation sum keeps every batch's activations."""
    model, _ = _setup()
    model.eval()
    val_total = torch.zeros(())
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(steps):
            x, y = _batch(256)
            val_total = val_total + nn.functional.cross_entropy(model(x), y)
            t.step()
    return t.report()


def outputs_kept_with_graph(steps: int) -> memsentry.Report:
    """#2: outputs appended for an epoch-end metric, graph and all."""
    model, opt = _setup()
    epoch_outputs = []
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(steps):
            x, y = _batch()
            logits = model(x)
            nn.functional.cross_entropy(logits, y).backward()
            opt.step()
            opt.zero_grad()
            epoch_outputs.append(model(x))  # a second forward, kept with its graph
    return t.report()


def detached_features_kept(steps: int) -> memsentry.Report:
    """#3: a growing list of detached tensors: no graph, still a leak."""
    model, opt = _setup()
    features = []
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(steps):
            x, y = _batch()
            hidden = model.encoder(x)
            loss = nn.functional.cross_entropy(model.head(hidden), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            features.append(hidden.detach())
    return t.report()


def rnn_hidden_not_detached(steps: int) -> memsentry.Report:
    """#4: truncated BPTT that never detaches the hidden state."""
    torch.manual_seed(0)
    rnn = nn.GRU(16, 32, batch_first=True)
    opt = torch.optim.SGD(rnn.parameters(), lr=0.01)
    hidden = torch.zeros(1, 8, 32)
    with memsentry.track(rnn, on_leak="ignore") as t:
        for _ in range(steps):  # one long sequence in chunks; t.step() marks each chunk
            chunk = torch.randn(8, 10, 16)
            out, hidden = rnn(chunk, hidden)
            out.pow(2).mean().backward(retain_graph=True)  # reaches back to the first chunk
            t.step()
        opt.step()  # stepping inside would fail: the old graph saved the weights
    return t.report()


def grad_with_create_graph(steps: int) -> memsentry.Report:
    """#5: ``backward(create_graph=True)`` and gradients never reset."""
    model, opt = _setup()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # PyTorch warns of this very cycle
        with memsentry.track(model, on_leak="ignore") as t:
            for _ in range(steps):
                x, y = _batch()
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward(create_graph=True)
                opt.step()
    for p in model.parameters():
        p.grad = None
    return t.report()


class Node:
    """Two of these point at each other: a reference cycle that owns a tensor."""

    def __init__(self, payload: torch.Tensor) -> None:
        self.payload = payload
        self.partner: Node | None = None


def _cycle_loop(steps: int) -> memsentry.Report:
    model, opt = _setup()
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(steps):
            _train_step(model, opt)
            a, b = Node(torch.ones(64 * 1024)), Node(torch.ones(64 * 1024))
            a.partner, b.partner = b, a
            del a, b
    return t.report()


def cycles_with_gc_disabled(steps: int) -> memsentry.Report:
    """#6 with ``gc.disable()`` in the host application: nothing ever frees the cycles."""
    with _gc(enabled=False):
        return _cycle_loop(steps)


def cycles_with_rare_collections(steps: int) -> memsentry.Report:
    """#6 with the collector on but rarely running: memory waits for it (a sawtooth)."""
    with _gc(enabled=True, threshold=1_000_000):
        return _cycle_loop(steps)


class Trial:
    """#7: a scheduler lambda capturing ``self``: each trial object is a cycle."""

    def __init__(self, model: nn.Module) -> None:
        self.lr = 0.01
        self.opt = torch.optim.SGD(model.parameters(), lr=self.lr)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda epoch: self.lr)
        self.scratch = torch.zeros(64 * 1024)


def closures_capturing_self(steps: int) -> memsentry.Report:
    """#7: one Trial per iteration, each kept alive by its own closure until gc runs."""
    model, opt = _setup()
    with _gc(enabled=False), memsentry.track(model, on_leak="ignore") as t:
        for _ in range(steps):
            trial = Trial(model)
            _train_step(model, opt)
            del trial
    return t.report()


def log_activation(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
    output.detach().abs().mean()


def hooks_registered_every_step(steps: int) -> memsentry.Report:
    """#8: a forward hook registered inside the loop, its handle dropped."""
    model, opt = _setup()
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(steps):
            model.head.register_forward_hook(log_activation)
            _train_step(model, opt)
    return t.report()


class ScaleOnCtx(torch.autograd.Function):
    """#9: the output stored as an attribute of ctx instead of ``save_for_backward``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        ctx.y = y
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2


def ctx_attribute_cycle(steps: int) -> memsentry.Report:
    """#9: each call's output and ctx point at each other; with gc off they stay."""
    model, opt = _setup()
    with _gc(enabled=False), memsentry.track(model, on_leak="ignore") as t:
        for _ in range(steps):
            x, y = _batch()
            logits = ScaleOnCtx.apply(model(x))
            nn.functional.cross_entropy(logits, y).backward()
            opt.step()
            opt.zero_grad()
            del logits
    return t.report()


class MetricLogger:
    """A stand-in for a third-party logger that keeps whatever it is given."""

    def __init__(self) -> None:
        self.history: dict[str, list[object]] = collections.defaultdict(list)

    def log(self, values: dict[str, object]) -> None:
        for key, value in values.items():
            self.history[key].append(value)


def tensors_given_to_a_logger(steps: int) -> memsentry.Report:
    """#10: ``logger.log({"loss": loss})`` with the tensor, not ``loss.item()``."""
    model, opt = _setup()
    logger = MetricLogger()
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(steps):
            x, y = _batch()
            logits = model(x)
            loss = nn.functional.cross_entropy(logits, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            logger.log({"loss": loss, "logits": logits})
    return t.report()


class CachingBlock(nn.Module):
    """#11: activations appended to a class attribute in forward."""

    cache: ClassVar[list[torch.Tensor]] = []

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        CachingBlock.cache.append(y)
        return y


def class_attribute_cache(steps: int) -> memsentry.Report:
    """#11, list form: grows every forward."""
    torch.manual_seed(0)
    model = CachingBlock()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    try:
        with memsentry.track(model, on_leak="ignore") as t:
            for _ in range(steps):
                _train_step(model, opt)
        return t.report()
    finally:
        CachingBlock.cache.clear()


class LastOutput(nn.Module):
    """#11, single attribute: ``self.last = h`` pins one graph and its 2 MiB of features."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(32, 8192)
        self.head = nn.Linear(8192, 10)
        self.last: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.hidden(x)
        self.last = h
        return self.head(h)


def module_attribute_pins_a_graph(steps: int) -> memsentry.Report:
    torch.manual_seed(0)
    model = LastOutput()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(steps):
            _train_step(model, opt)
    return t.report()


def models_kept_per_trial(steps: int) -> memsentry.Report:
    """#12: a hyperparameter search that keeps every trained model in its results."""
    torch.manual_seed(0)
    results = []
    with memsentry.track(on_leak="ignore") as t:
        for trial in range(steps // 2):
            model = Classifier()
            opt = torch.optim.SGD(model.parameters(), lr=0.01 * (trial + 1))
            for _ in range(2):
                x, y = _batch()
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
            results.append((opt.param_groups[0]["lr"], loss.item(), model))
            del model, opt
    return t.report()


#: What IPython's output history is in a notebook's namespace: cell number -> result.
Out: dict[int, object] = {}


def notebook_output_history(steps: int) -> memsentry.Report:
    """#13 (simulated: the history IPython keeps, without IPython): every cell ends with a
    tensor, which the shell stores in ``Out[n]``."""
    model, opt = _setup()
    try:
        with memsentry.track(model, on_leak="ignore") as t:
            for cell in range(steps):
                _train_step(model, opt)
                Out[cell] = model(torch.randn(64, 32))  # the value the cell displays
        return t.report()
    finally:
        Out.clear()


# -- waste ---------------------------------------------------------------------------------------
def evaluate(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """An evaluation pass that forgot torch.no_grad()."""
    model.eval()
    correct = 0
    for x, y in batches:
        correct += int((model(x).argmax(-1) == y).sum())
    model.train()
    return correct


def eval_without_no_grad(steps: int) -> memsentry.Report:
    """#14: ``model.eval()`` without ``torch.no_grad()``."""
    model, opt = _setup()
    val = [_batch(256) for _ in range(2)]
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(steps):
            _train_step(model, opt)
            evaluate(model, val)
    return t.report()


def attempt(model: Classifier, x: torch.Tensor) -> torch.Tensor:
    """A forward that runs out of memory halfway (simulated)."""
    hidden = model.encoder(x)
    raise RuntimeError(f"out of memory (simulated) after {hidden.numel()} activations")


def exception_kept(steps: int) -> memsentry.Report:
    """#16: an out-of-memory retry that keeps the error, its traceback and its frames."""
    model, opt = _setup()
    last_error = None
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(steps):
            try:
                attempt(model, torch.randn(512, 32))
            except RuntimeError as error:
                last_error = error  # the traceback keeps attempt()'s frame and `hidden`
            _train_step(model, opt)
    assert last_error is not None
    return t.report()


def big_batches_outlive_the_step(steps: int) -> memsentry.Report:
    """#15: the batch and its outputs of step i are alive while step i+1 loads and runs."""
    model, opt = _setup()
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(steps):
            inputs, labels = _batch(16384)  # 2 MiB of inputs
            logits = model(inputs)
            loss = nn.functional.cross_entropy(logits, labels)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return t.report()


# -- not leaks -----------------------------------------------------------------------------------
def clean_loop_with_adam(steps: int) -> memsentry.Report:
    """#26: Adam creates its state in the first step; locals live to the next iteration."""
    torch.manual_seed(0)
    model = Classifier()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(steps):
            x, y = _batch()
            loss = nn.functional.cross_entropy(model(x), y)  # x, y, loss live on: normal
            loss.backward()
            opt.step()
            opt.zero_grad()
    return t.report()


def model_to_device_every_step(steps: int) -> memsentry.Report:
    """#27: ``model.to(device)`` in the loop is a no-op after the first call."""
    model, opt = _setup()
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(steps):
            model.to("cpu")
            _train_step(model, opt)
    return t.report()


def rolling_window(steps: int) -> memsentry.Report:
    """#28: ``deque(maxlen=k)`` of detached outputs."""
    model, opt = _setup()
    recent = collections.deque(maxlen=3)
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(steps):
            x, y = _batch()
            logits = model(x)
            nn.functional.cross_entropy(logits, y).backward()
            opt.step()
            opt.zero_grad()
            recent.append(logits.detach())
    return t.report()


def cache_keyed_by_shape(steps: int) -> memsentry.Report:
    """#28: a cache of masks keyed by sequence length, three lengths in turn."""
    model, opt = _setup()
    masks: dict[int, torch.Tensor] = {}
    with memsentry.track(model, on_leak="ignore") as t:
        for step in range(steps):
            length = (16, 32, 64)[step % 3]
            if length not in masks:
                masks[length] = torch.ones(length, 32)
            x, y = _batch(length)
            nn.functional.cross_entropy(model(x * masks[length]), y).backward()
            opt.step()
            opt.zero_grad()
    return t.report()


def float_list_cleared_every_epoch(steps: int) -> memsentry.Report:
    """#28: a list of Python floats, cleared every epoch of three iterations."""
    model, opt = _setup()
    epoch_losses: list[float] = []
    with memsentry.track(model, on_leak="ignore") as t:
        for step in range(steps):
            loss = _train_step(model, opt)
            epoch_losses.append(loss.item())
            if step % 3 == 2:
                epoch_losses.clear()
    return t.report()


def loss_item_summed(steps: int) -> memsentry.Report:
    """The fix of #1: ``total += loss.item()``."""
    model, opt = _setup()
    total = 0.0
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(steps):
            total += _train_step(model, opt).item()
    return t.report()


class RunningMean:
    """A metric in the style of torchmetrics' ``MeanMetric``: it keeps the last value it was
    given, graph and all, in ``_forward_cache`` (replaced at each call)."""

    def __init__(self) -> None:
        self.total, self.count = 0.0, 0
        self._forward_cache: torch.Tensor | None = None

    def __call__(self, value: torch.Tensor) -> torch.Tensor:
        self._forward_cache = value.clone()
        self.total, self.count = self.total + value.item(), self.count + 1
        return self._forward_cache


def metric_caches_its_last_loss(steps: int) -> memsentry.Report:
    """#30: a metric object that keeps one scalar loss with its graph: a few bytes and nodes,
    replaced every step, nothing to change code for."""
    model, opt = _setup()
    train_loss = RunningMean()
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(steps):
            train_loss(_train_step(model, opt))
    return t.report()


# -- time ----------------------------------------------------------------------------------------
class SlowImages(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Samples decoded and augmented in the training process: 3 ms each."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(0.003)
        return torch.randn(32), torch.tensor(index % 10)


def input_bound_loop(steps: int) -> memsentry.Report:
    """A loop that waits about 50 ms for each batch of 16 from a DataLoader without workers
    and computes for about 1 ms (one thread: on a busy machine, idle OpenMP threads would turn
    a 1 ms step into 100)."""
    model, opt = _setup()
    loader = torch.utils.data.DataLoader(SlowImages(16 * steps), batch_size=16)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with memsentry.track(model, on_leak="ignore") as t:
            for x, y in loader:
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
    finally:
        torch.set_num_threads(threads)
    return t.report()


# -- the table -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Scenario:
    """One pattern: what memsentry must report (``rule`` ``None``: no LEAK at all)."""

    name: str
    guide: str
    kind: str  # "leak", "waste", "hint" or "not a leak"
    rule: str | None
    severity: memsentry.Severity | None
    holder: str | None
    run: Callable[[int], memsentry.Report]
    steps: int = STEPS


LEAK, WASTE, HINT = memsentry.Severity.LEAK, memsentry.Severity.WASTE, memsentry.Severity.HINT

SCENARIOS: tuple[Scenario, ...] = (
    Scenario("loss summed as a tensor", "#1", "leak", "retained-graph", LEAK, "total_loss",
             loss_summed_as_tensor),
    Scenario("loss summed, global hooks", "#1", "leak", "retained-graph", LEAK, "running",
             loss_summed_without_tracking_a_model),
    Scenario("validation loss summed", "#1", "leak", "retained-graph", LEAK, "val_total",
             validation_loss_summed),
    Scenario("outputs kept with their graph", "#2", "leak", "tensor-accumulation", LEAK,
             "epoch_outputs", outputs_kept_with_graph),
    Scenario("detached features kept", "#3", "leak", "tensor-accumulation", LEAK, "features",
             detached_features_kept),
    Scenario("RNN hidden state not detached", "#4", "leak", "retained-graph", LEAK, "hidden",
             rnn_hidden_not_detached),
    Scenario(".grad with create_graph=True", "#5", "leak", "retained-graph", LEAK,
             "weight.grad", grad_with_create_graph),
    Scenario("reference cycles, gc disabled", "#6", "leak", "reference-cycle", LEAK, "Node",
             cycles_with_gc_disabled),
    Scenario("reference cycles, rare collections", "#6", "waste", "reference-cycle", WASTE,
             "Node", cycles_with_rare_collections),
    Scenario("closure capturing self", "#7", "leak", "reference-cycle", LEAK, "Trial",
             closures_capturing_self),
    Scenario("hook registered every step", "#8", "leak", "hook-accumulation", LEAK,
             "log_activation", hooks_registered_every_step),
    Scenario("tensor stored on autograd ctx", "#9", "leak", "reference-cycle", LEAK,
             "ScaleOnCtx", ctx_attribute_cycle),
    Scenario("tensors given to a logger", "#10", "leak", "tensor-accumulation", LEAK,
             "logger.history", tensors_given_to_a_logger),
    Scenario("class attribute cache", "#11", "leak", "tensor-accumulation", LEAK,
             "CachingBlock.cache", class_attribute_cache),
    Scenario("module attribute pins a graph", "#11", "waste", "retained-graph", WASTE,
             "model.last", module_attribute_pins_a_graph),
    Scenario("models kept per trial", "#12", "leak", "tensor-accumulation", LEAK, "results",
             models_kept_per_trial, steps=16),
    Scenario("notebook output history (simulated)", "#13", "leak", "tensor-accumulation",
             LEAK, "IPython's output history", notebook_output_history),
    Scenario("eval without no_grad", "#14", "waste", "missing-no-grad", WASTE, "evaluate",
             eval_without_no_grad),
    Scenario("exception kept with its frames", "#16", "waste", "exception-frames", WASTE,
             "last_error", exception_kept),
    Scenario("loop variables outlive the step", "#15", "hint", "loop-variables", HINT,
             "`inputs`", big_batches_outlive_the_step),
    Scenario("input-bound loop", "-", "hint", "input-bound", HINT, None, input_bound_loop),
    Scenario("clean loop with Adam warm-up", "#26", "not a leak", None, None, None,
             clean_loop_with_adam),
    Scenario("model.to(device) every step", "#27", "not a leak", None, None, None,
             model_to_device_every_step),
    Scenario("deque(maxlen=3) window", "#28", "not a leak", None, None, None, rolling_window),
    Scenario("cache keyed by three shapes", "#28", "not a leak", None, None, None,
             cache_keyed_by_shape, steps=12),
    Scenario("float list cleared every epoch", "#28", "not a leak", None, None, None,
             float_list_cleared_every_epoch, steps=12),
    Scenario("loss.item() summed", "#1 fixed", "not a leak", None, None, None,
             loss_item_summed),
    Scenario("metric caches its last loss", "#30", "not a leak", None, None, None,
             metric_caches_its_last_loss),
)
