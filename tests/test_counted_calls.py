"""An inference loop (no optimizer: each call of the model ends an iteration) under a budget:
between the boundaries memsentry reads, the model's calls are counted with no hook on it, so
they take the short path they take untracked, and the count, the outputs and what can be
done with the model stay as without memsentry."""

from __future__ import annotations

import copy
import io
import pickle
import threading

import pytest
import torch
from conftest import iterations_run
from torch import nn

import memsentry
from memsentry.record.counted import ATTRIBUTE, CallCounter, countable


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()


def _infer(model: nn.Module, x: torch.Tensor, calls: int,
           each: object = None) -> list[torch.Tensor]:
    outputs = []
    for _ in range(calls):
        with torch.no_grad():
            outputs.append(model(x))
        if callable(each):
            each()
    return outputs


def _hooked(model: nn.Module) -> bool:
    return bool(model._forward_pre_hooks)


@pytest.mark.parametrize("given", [True, False], ids=["model given", "no model"])
def test_an_inference_loop_passes_its_boundaries_with_no_hook(given: bool) -> None:
    """Most calls run with neither a hook nor memsentry's code in them; every call is still
    an iteration, the model's layer counts every call, and the outputs are bitwise those of
    the loop untracked. Without a model, the global hooks are off in light iterations and the
    model is counted the same way."""
    model, x = _model(), torch.randn(8, 16)
    plain = _infer(model, x, 600)
    seen: list[tuple[bool, bool]] = []
    with memsentry.track(model if given else None, overhead=1e-6, on_leak="ignore") as t:
        outputs = _infer(model, x, 600,
                         lambda: seen.append((_hooked(model), ATTRIBUTE in vars(model))))
    report = t.report()
    assert all(torch.equal(a, b) for a, b in zip(plain, outputs, strict=True))
    assert iterations_run(report) == 599  # the 600th call began the partial iteration
    counted = sum(1 for hooked, counter in seen if counter and not hooked)
    assert counted > 500, seen[:40]
    assert not any(hooked and counter for hooked, counter in seen)
    assert report.cost is not None and report.cost.part("module hooks").events < 60
    outermost = next(layer for layer in report.layers if layer.name == "Sequential")
    assert outermost.calls == 600
    assert ATTRIBUTE not in vars(model) and not _hooked(model)


@pytest.mark.parametrize("calls", [37, 64, 101, 250])
def test_a_block_that_ends_among_counted_calls_keeps_every_iteration(calls: int) -> None:
    model, x = _model(), torch.randn(2, 16)
    with memsentry.track(model, overhead=1e-6, on_leak="ignore") as t:
        _infer(model, x, calls)
    assert iterations_run(t.report()) == calls - 1
    assert ATTRIBUTE not in vars(model)


def test_a_counted_model_copies_pickles_saves_and_scripts_as_without_memsentry() -> None:
    """What an EMA, a checkpoint or an export does to the model mid-loop: the copies carry no
    counter, give the same outputs, and their calls are not the loop's."""
    model, x = _model(), torch.randn(4, 16)
    made: dict[str, nn.Module] = {}

    def copy_all() -> None:
        if made or ATTRIBUTE not in vars(model):
            return
        made["deepcopy"] = copy.deepcopy(model)
        made["pickle"] = pickle.loads(pickle.dumps(model))
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        made["save"] = torch.load(buffer, weights_only=False)
        made["script"] = torch.jit.script(model)

    with memsentry.track(model, overhead=1e-6, on_leak="ignore") as t:
        _infer(model, x, 300, copy_all)
        assert made, "the counter was never on"
        for name, copied in made.items():
            assert ATTRIBUTE not in vars(copied), name
            with torch.no_grad():
                assert torch.equal(copied(x), model(x)), name
    # The loop's 300 calls and the model's 4 beside the copies (the last began the partial
    # iteration); the copies' calls are not counted.
    assert iterations_run(t.report()) == 300 + len(made) - 1


def test_calls_from_another_thread_are_not_the_loops_iterations() -> None:
    model, x = _model(), torch.randn(4, 16)
    other: list[int] = []

    def serve() -> None:
        if ATTRIBUTE in vars(model) and not other:
            thread = threading.Thread(target=lambda: other.extend(
                len(_infer(model, x, 25)) for _ in range(1)))
            thread.start()
            thread.join()

    with memsentry.track(model, overhead=1e-6, on_leak="ignore") as t:
        _infer(model, x, 300, serve)
    assert other == [25]
    assert iterations_run(t.report()) == 299


def test_an_inference_loop_with_autograd_on_keeps_its_hook() -> None:
    """A model called with autograd on (an evaluation that forgot ``no_grad``) keeps the hook
    that watches whether its graphs are used: no counter."""
    model, x = _model(), torch.randn(4, 16)
    seen: list[bool] = []
    with memsentry.track(model, overhead=1e-6, on_leak="ignore") as t:
        for _ in range(200):
            model(x)
            seen.append(ATTRIBUTE in vars(model))
    assert not any(seen)
    assert iterations_run(t.report()) == 199


def test_a_compiled_or_scripted_module_is_not_counted_in_place_of_its_hooks() -> None:
    compiled = _model()
    setattr(compiled, ATTRIBUTE, compiled._call_impl)  # what Module.compile() sets
    assert not countable(compiled)
    assert not countable(torch.jit.script(_model()))
    assert countable(_model())
    assert not CallCounter().put_on(compiled, 5, threading.get_ident(), lambda: None)


def test_the_counter_calls_back_once_as_the_last_counted_call_ends() -> None:
    model, x = _model(), torch.randn(2, 16)
    counter = CallCounter()
    done: list[int] = []
    assert counter.put_on(model, 3, threading.get_ident(),
                          lambda: done.append(counter.take_off()))
    _infer(model, x, 2)
    assert done == [] and counter.counted == 2
    _infer(model, x, 1)
    assert done == [3] and not counter.on and ATTRIBUTE not in vars(model)
    _infer(model, x, 2)
    assert done == [3]


def test_an_error_in_a_counted_call_is_the_users_and_the_counter_comes_off() -> None:
    model = _model()
    counter = CallCounter()
    done: list[int] = []
    assert counter.put_on(model, 1, threading.get_ident(),
                          lambda: done.append(counter.take_off()))
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"):
        model(torch.randn(2, 3))
    assert done == [1] and ATTRIBUTE not in vars(model)
