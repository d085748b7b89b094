"""Holders in every place Python keeps memory (issue 25): functools caches, one tensor that
grows, NumPy arrays, autograd nodes kept by themselves; and fixes written in the user's words.
Each leak has a twin that keeps memory bounded and must get no LEAK."""

from __future__ import annotations

import collections
import functools
import inspect
import logging
import queue

import numpy as np
import pytest
import torch
from torch import nn

import memsentry
from memsentry import Severity

STEPS = 20


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _step(model: nn.Module, opt: torch.optim.Optimizer, batch: int = 32) -> torch.Tensor:
    out = model(torch.randn(batch, 64))
    loss = out.pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return out


def _leaks(report: memsentry.Report) -> dict[str, memsentry.Finding]:
    return {f.rule: f for f in report.findings if f.severity is Severity.LEAK}


def _line(function: object, text: str) -> int:
    lines, first = inspect.getsourcelines(function)  # type: ignore[arg-type]
    return first + next(i for i, line in enumerate(lines) if text in line)


# -- functools caches --------------------------------------------------------------------------
@functools.cache
def features(step: int) -> torch.Tensor:
    return torch.randn(128, 256)  # 128 KiB, kept for every step


@functools.lru_cache(maxsize=4)
def few_features(step: int) -> torch.Tensor:
    return torch.randn(128, 256)


def test_a_cache_keyed_by_the_step_is_named_with_its_def() -> None:
    features.cache_clear()
    model, opt = _model()
    with memsentry.track(model, on_leak="ignore") as t:
        for step in range(STEPS):
            _step(model, opt)
            features(step)
    finding = _leaks(t.report())["tensor-accumulation"]
    assert finding.message.startswith("`features` (a global of ")
    assert "it is the cache of `features()` (`functools.lru_cache`/`cache`, unbounded)" \
        in finding.message
    assert finding.location is not None
    assert finding.location.line == inspect.getsourcelines(features)[1]  # the decorator
    assert "`features.cache_clear()`" in finding.fix
    assert finding.bytes >= 15 * 128 * 256 * 4  # bytes, not only tensors, are counted
    features.cache_clear()


def test_a_bounded_cache_is_not_a_leak() -> None:
    few_features.cache_clear()
    model, opt = _model()
    with memsentry.track(model, on_leak="ignore") as t:
        for step in range(STEPS):
            _step(model, opt)
            few_features(step)
    assert not _leaks(t.report())  # four entries at most: a window


# -- one tensor that grows ---------------------------------------------------------------------
def test_one_tensor_rebuilt_larger_every_step_is_a_leak_named_with_its_rate() -> None:
    model, opt = _model()
    bank = torch.empty(0, 64)
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(STEPS):
            out = _step(model, opt, batch=2048)
            bank = torch.cat([bank, out.detach()])  # 512 KiB more every step
    report = t.report()
    finding = _leaks(report)["tensor-accumulation"]
    assert finding.message.startswith("`bank` (a local of test_one_tensor_rebuilt_larger")
    assert "grows by 512 KiB/iter" in finding.message and "keeps 1 tensor" in finding.message
    assert finding.rate == pytest.approx(512 * 1024, rel=0.01)
    assert "bank = torch.cat([bank, x])[-k:]" in finding.fix
    assert "memory-growth" not in {f.rule for f in report.findings}  # the cause is named
    # The same local is not also told to be deleted sooner (it is the leak).
    assert not any(f.rule == "loop-variables" and "`bank`" in f.message
                   for f in report.findings)


@pytest.mark.parametrize("seed", range(4))
def test_tensors_whose_size_follows_random_batches_are_not_a_leak(seed: int) -> None:
    model, opt = _model()
    sizes = torch.Generator().manual_seed(seed)
    window = torch.empty(0, 64)
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(30):
            batch = int(torch.randint(64, 2048, (1,), generator=sizes))
            out = _step(model, opt, batch=batch)  # its size follows the batch
            window = torch.cat([window, out.detach()])[-4096:]  # bounded: the last rows
    assert not _leaks(t.report())
    del out


# -- NumPy arrays ------------------------------------------------------------------------------
ARRAYS: list[np.ndarray] = []


def test_numpy_views_of_outputs_kept_in_a_list_are_counted_as_their_tensors_memory() -> None:
    ARRAYS.clear()
    model, opt = _model()
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(STEPS):
            out = _step(model, opt, batch=1024)
            ARRAYS.append(out.detach().numpy())  # shares the output's 256 KiB storage
    finding = _leaks(t.report())["tensor-accumulation"]
    assert finding.message.startswith("`ARRAYS` (a global of ")
    assert "gains 1 NumPy array/iter" in finding.message
    assert finding.bytes >= 15 * 1024 * 64 * 4
    assert finding.location is not None and finding.location.line == _line(
        test_numpy_views_of_outputs_kept_in_a_list_are_counted_as_their_tensors_memory,
        "ARRAYS.append(")
    assert "`np.save`" in finding.fix
    ARRAYS.clear()


def test_a_bounded_deque_of_owned_arrays_is_not_a_leak() -> None:
    model, opt = _model()
    recent: collections.deque[np.ndarray] = collections.deque(maxlen=3)
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(STEPS):
            recent.append(_step(model, opt, batch=1024).detach().numpy().copy())
    assert not _leaks(t.report())


# -- autograd nodes kept by themselves -------------------------------------------------------
class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return 2 * x * grad


def test_custom_function_contexts_kept_in_a_list_count_what_they_saved() -> None:
    model, opt = _model()
    contexts = []
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(STEPS):
            _step(model, opt)
            probe = Square.apply(model[0](torch.randn(256, 64)))  # no backward through it
            contexts.append(probe.grad_fn)  # the ctx: it keeps what forward saved
            del probe
    finding = _leaks(t.report())["tensor-accumulation"]
    assert finding.message.startswith("`contexts` (a local of ")
    assert "gains 1 autograd node/iter" in finding.message
    assert "saved for backward" in finding.message and " 0 B" not in finding.message
    assert finding.bytes >= 15 * 256 * 128 * 4  # each ctx saved a 128 KiB activation
    assert "not `grad_fn` or `ctx` objects" in finding.fix


# -- fixes in the user's words -----------------------------------------------------------------
class AverageMeter:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.val: object = 0
        self.avg: object = 0
        self.sum: object = 0
        self.count = 0

    def update(self, val: object, n: int = 1) -> None:
        self.val = val
        self.sum = self.sum + val * n  # type: ignore[operator]
        self.count += n
        self.avg = self.sum / self.count  # type: ignore[operator]


def test_a_meter_updated_with_the_loss_tensor_is_fixed_where_update_is_called() -> None:
    model, opt = _model()
    losses = AverageMeter()
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(STEPS):
            loss = model(torch.randn(32, 64)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.update(loss, 32)
    finding = _leaks(t.report())["retained-graph"]
    call = _line(test_a_meter_updated_with_the_loss_tensor_is_fixed_where_update_is_called,
                 "losses.update(loss, 32)")
    assert f"`losses.update(loss.item(), 32)` (tests/test_holders_everywhere.py:{call})" \
        in finding.fix
    assert "`losses.update(loss, 32)` stores `loss` and its graph in `losses." in finding.fix
    assert "+= loss.item()" not in finding.fix


def test_the_fix_names_the_expression_the_line_adds() -> None:
    model, opt = _model()
    epoch_err_d = 0.0
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(STEPS):
            err_d = model(torch.randn(32, 64)).pow(2).mean()
            opt.zero_grad()
            err_d.backward()
            opt.step()
            epoch_err_d = epoch_err_d + err_d * 0.5
    finding = _leaks(t.report())["retained-graph"]
    assert finding.message.startswith("`epoch_err_d` (a local of ")
    assert "`epoch_err_d += (err_d * 0.5).item()`" in finding.fix
    assert "loss" not in finding.fix


def test_a_running_average_is_fixed_as_an_average_not_a_sum() -> None:
    # `+= x.item()` would turn the moving average into a sum: the line itself is rewritten.
    model, opt = _model()
    smoothed = 0.0
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(STEPS):
            batch_loss = model(torch.randn(32, 64)).pow(2).mean()
            opt.zero_grad()
            batch_loss.backward()
            opt.step()
            smoothed = 0.98 * smoothed + 0.02 * batch_loss
    finding = _leaks(t.report())["retained-graph"]
    assert "`smoothed = 0.98 * smoothed + 0.02 * batch_loss.item()`" in finding.fix
    assert "+=" not in finding.fix


def test_a_line_whose_tensor_cannot_be_told_gets_no_invented_name() -> None:
    # Two values besides the holder (`decay` and the loss): no guess at which is the tensor.
    model, opt = _model()
    decay, ema = 0.9, 0.0
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(STEPS):
            objective = model(torch.randn(32, 64)).pow(2).mean()
            opt.zero_grad()
            objective.backward()
            opt.step()
            ema = decay * ema + (1 - decay) * objective
    finding = _leaks(t.report())["retained-graph"]
    assert "add `x.item()` to `ema`" in finding.fix
    assert "loss" not in finding.fix and "+=" not in finding.fix


# -- suspended generators ----------------------------------------------------------------------
def batches(size: int):  # type: ignore[no-untyped-def]
    made = []
    while True:
        x = torch.randn(size, 64)
        made.append(x)  # the generator's frame keeps every batch it made
        yield x


def test_a_suspended_generator_that_keeps_its_batches_is_named() -> None:
    model, opt = _model()
    stream = batches(256)
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(STEPS):
            x = next(stream)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    finding = _leaks(t.report())["tensor-accumulation"]
    assert finding.message.startswith("`stream` (a local of ")
    assert "gains 1 tensor/iter" in finding.message
    stream.close()


# -- logging handlers --------------------------------------------------------------------------
class KeepingHandler(logging.Handler):
    """A handler that keeps every record it handles, with the arguments logged."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_handler_that_keeps_logged_tensors_is_named_through_its_logger() -> None:
    log = logging.getLogger("memsentry-test-train")
    log.addHandler(KeepingHandler())  # only the logger keeps it
    log.setLevel(logging.INFO)
    log.propagate = False
    model, opt = _model()
    try:
        with memsentry.track(model, on_leak="ignore") as t:
            for step in range(STEPS):
                out = _step(model, opt, batch=256)
                log.info("step %d output %s", step, out)  # the record keeps the tensor
                del out
    finally:
        log.handlers.clear()
    finding = _leaks(t.report())["tensor-accumulation"]
    assert finding.message.startswith(
        "`logging.getLogger('memsentry-test-train').handlers[0].records` (held through "
        "`logging.getLogger('memsentry-test-train')`, a global of module logging")
    assert "gains 1 tensor/iter" in finding.message


# -- a standard library container -----------------------------------------------------------
FEATURES: queue.Queue[torch.Tensor] = queue.Queue()


def test_an_unbounded_queue_is_named_at_the_users_put_not_inside_the_library() -> None:
    model, opt = _model()
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(STEPS):
            FEATURES.put(_step(model, opt, batch=256).detach())  # never taken out
    finding = _leaks(t.report())["tensor-accumulation"]
    assert finding.message.startswith("`FEATURES.queue` (held through `FEATURES`, a global of ")
    assert finding.location is not None
    assert finding.location.file == "tests/test_holders_everywhere.py"  # not queue.py
    assert finding.location.line == _line(
        test_an_unbounded_queue_is_named_at_the_users_put_not_inside_the_library,
        "FEATURES.put(")
    while not FEATURES.empty():
        FEATURES.get_nowait()


# -- byte buffers and DLPack capsules -----------------------------------------------------------
def test_dlpack_capsules_kept_for_another_library_count_their_tensors_memory() -> None:
    # A capsule made for a consumer that never takes it keeps the whole output alive in C.
    model, opt = _model()
    handoff: dict[str, list[object]] = {"pending": []}
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(STEPS):
            out = _step(model, opt, batch=1024)
            handoff["pending"].append(torch.utils.dlpack.to_dlpack(out.detach()))
    finding = _leaks(t.report())["tensor-accumulation"]
    assert finding.message.startswith("`handoff['pending']`")
    assert "gains 1 buffer/iter" in finding.message
    assert "DLPack" in finding.message and "DLPack" in finding.fix
    assert finding.bytes >= 15 * 1024 * 64 * 4


def test_consumed_dlpack_capsules_hold_nothing() -> None:
    # `torch.from_dlpack` takes the memory over: the capsule left behind keeps nothing, and
    # the tensors made from it are dropped each step.
    model, opt = _model()
    spent: list[object] = []
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(STEPS):
            capsule = torch.utils.dlpack.to_dlpack(_step(model, opt, batch=1024).detach())
            torch.from_dlpack(capsule).sum()
            spent.append(capsule)
    leaks = _leaks(t.report())
    assert "tensor-accumulation" not in leaks, leaks


class Recorder:
    """Keeps raw snapshots of each batch's activations, as a tracing tool might."""

    def __init__(self) -> None:
        self.snapshots: list[memoryview] = []
        self.raw: list[bytearray] = []

    def views(self, out: torch.Tensor) -> None:
        self.snapshots.append(memoryview(out.detach().numpy().copy()))

    def copies(self, out: torch.Tensor) -> None:
        self.raw.append(bytearray(out.detach().numpy().tobytes()))


@pytest.mark.parametrize(("method", "attribute"), [("views", "snapshots"), ("copies", "raw")])
def test_memoryviews_and_bytearrays_kept_by_an_object_are_counted(method: str,
                                                                  attribute: str) -> None:
    model, opt = _model()
    recorder = Recorder()
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(STEPS):
            getattr(recorder, method)(_step(model, opt, batch=1024))
    finding = _leaks(t.report())["tensor-accumulation"]
    assert finding.message.startswith(f"`recorder.{attribute}`")
    assert finding.bytes >= 15 * 1024 * 64 * 4
    kind = "NumPy array" if method == "views" else "buffer"
    assert f"gains 1 {kind}/iter" in finding.message


def test_one_bytearray_extended_every_step_is_named_as_a_buffer_not_a_tensor() -> None:
    """One buffer, made longer each step (a log of raw bytes): the holder is named with what it
    is. Before, the message said it kept "0 tensors: a tensor made larger every iteration
    (concatenated onto itself, or padded)" and the fix spoke of torch.cat."""
    model, opt = _model()
    raw = bytearray()
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(STEPS):
            raw.extend(_step(model, opt, batch=256).detach().numpy().tobytes())
    finding = _leaks(t.report())["tensor-accumulation"]
    assert finding.message.startswith("`raw` (a local of ")
    assert "while it keeps no tensor but 1 Python buffer (a bytearray" in finding.message
    assert "torch.cat" not in finding.fix and "del raw[:n]" in finding.fix


# -- dicts keyed by strings ----------------------------------------------------------------------
def test_a_dict_given_a_new_string_key_every_step_is_one_leak() -> None:
    model, opt = _model()
    snapshots: dict[str, torch.Tensor] = {}
    with memsentry.track(model, on_leak="ignore") as t:
        for step in range(STEPS):
            snapshots[f"step_{step:04d}"] = _step(model, opt, batch=256).detach()
    (finding,) = [f for f in t.report().findings if f.rule == "tensor-accumulation"]
    assert finding.severity is Severity.LEAK
    assert finding.message.startswith("`snapshots` (a local of ")
    assert "gains 1 tensor/iter across its keys ['step_0" in finding.message
    assert "more" in finding.message  # the keys are listed in part, not all twenty


def test_a_dict_whose_string_keys_are_replaced_every_step_is_not_a_leak() -> None:
    model, opt = _model()
    latest: dict[str, torch.Tensor] = {}
    with memsentry.track(model, on_leak="ignore") as t:
        for step in range(STEPS):
            out = _step(model, opt, batch=256).detach()
            latest["output"] = out
            latest["mean"] = out.mean(0)
            if step % 5 == 0:  # a key that comes later, and stays one tensor
                latest["every_fifth"] = out[:1].clone()
    assert not _leaks(t.report())
