"""Holders in places issue 42 taught the census to reach (an optimizer's state, a tee's
buffer, context variables, registries of modules, tensors chained through attributes, C
iterators, the atexit registry, heaps), each named with the line that fills it, in both
``track()`` and ``watch()``; and loops whose inputs grow while nothing is kept, which must
never be called a leak. Each leak has a bounded twin that must get no LEAK."""

from __future__ import annotations

import atexit
import bisect
import collections
import contextvars
import heapq
import importlib
import inspect
import itertools
import pathlib
import re
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import memsentry
from memsentry import Severity
from memsentry.census.libraries import packages
from memsentry.census.tees import tee_items

STEPS = 30
MODES = ("track", "watch")
Body = Callable[[int], None]


def _loop(mode: str, body: Body, model: nn.Module | None = None,
          opt: torch.optim.Optimizer | None = None, steps: int = STEPS) -> memsentry.Report:
    """``steps`` training steps of ``model`` (a small MLP when none), each running ``body``
    first, under ``track(model)`` or ``watch()``."""
    torch.manual_seed(0)
    model = model or nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.01)
    tracker = memsentry.track(model, on_leak="ignore") if mode == "track" \
        else memsentry.watch(on_leak="ignore")
    with tracker as t:
        for step in range(steps):
            body(step)
            loss = model(torch.randn(16, 32)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    return t.report()


def _leaks(report: memsentry.Report) -> list[memsentry.Finding]:
    return [f for f in report.findings if f.severity is Severity.LEAK]


def _only_leak(report: memsentry.Report) -> memsentry.Finding:
    leaks = _leaks(report)
    assert len(leaks) == 1, [f"{f.rule}: {f.message}" for f in report.findings]
    return leaks[0]


def _no_leak(report: memsentry.Report) -> None:
    assert not _leaks(report), [f"{f.rule}: {f.message}" for f in _leaks(report)]


def _line(function: object, text: str) -> int:
    lines, first = inspect.getsourcelines(function)  # type: ignore[arg-type]
    return first + next(i for i, line in enumerate(lines) if text in line)


def _at(finding: memsentry.Finding, function: object, text: str) -> None:
    assert finding.location is not None, finding.message
    assert finding.location.file.endswith("test_holders_beyond.py")
    assert finding.location.line == _line(function, text), finding.message


# -- an optimizer's state ----------------------------------------------------------------------
class HistorySGD(torch.optim.Optimizer):
    """SGD that keeps every gradient it applied, per parameter."""

    def __init__(self, params: Iterator[nn.Parameter], keep: int | None = None) -> None:
        super().__init__(params, {"lr": 0.01})
        self.keep = keep

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                st.setdefault("history", collections.deque(maxlen=self.keep)).append(
                    p.grad.clone())
                p.add_(p.grad, alpha=-group["lr"])


class TraceSGD(torch.optim.SGD):
    """SGD that concatenates every gradient onto one tensor per parameter."""

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for p in self.param_groups[0]["params"]:
            state = self.state[p]
            if "trace" not in state:
                state["trace"] = torch.zeros(0)
            state["trace"] = torch.cat([state["trace"], p.grad.flatten()])
        super().step()


@pytest.mark.parametrize("mode", MODES)
def test_a_history_kept_in_an_optimizers_state_is_named_as_the_state(mode: str) -> None:
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    leak = _only_leak(_loop(mode, lambda step: None, model, HistorySGD(model.parameters())))
    assert leak.rule == "tensor-accumulation"
    assert leak.subject.name == "opt.state[p]['history']"
    _at(leak, HistorySGD.step, 'st.setdefault("history"')
    assert "optimizer's per-parameter state" in leak.message
    assert "deque(maxlen=k)" in leak.fix


@pytest.mark.parametrize("mode", MODES)
def test_a_tensor_an_optimizer_grows_in_its_state_is_named(mode: str) -> None:
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    leak = _only_leak(_loop(mode, lambda step: None, model,
                            TraceSGD(model.parameters(), lr=0.01)))
    assert leak.subject.name == "opt.state[p]['trace']"
    _at(leak, TraceSGD.step, 'state["trace"] = torch.cat')


@pytest.mark.parametrize("mode", MODES)
def test_a_bounded_history_and_adams_own_state_are_not_leaks(mode: str) -> None:
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    _no_leak(_loop(mode, lambda step: None, model, HistorySGD(model.parameters(), keep=3)))
    adam = torch.optim.Adam(model.parameters())
    report = _loop(mode, lambda step: None, model, adam)
    _no_leak(report)
    held = {h.name for c in report.censuses for h in c.holders}
    assert "opt.state[p]['exp_avg']" in held  # counted, and flat


# -- a tee's buffer, a C iterator's state ------------------------------------------------------
def _batches() -> Iterator[torch.Tensor]:
    while True:
        yield torch.randn(64, 64)


@pytest.mark.parametrize("mode", MODES)
def test_a_tee_branch_never_read_is_named_and_the_one_read_is_not(mode: str) -> None:
    def run() -> memsentry.Report:
        reader, spare = itertools.tee(_batches())
        report = _loop(mode, lambda step: next(reader))
        del spare
        return report

    leak = _only_leak(run())
    assert leak.subject.name == "spare"
    _at(leak, run, "reader, spare = itertools.tee")
    assert "itertools.tee" in leak.message and "del spare" in leak.fix


@pytest.mark.parametrize("mode", MODES)
def test_tee_branches_read_together_keep_nothing(mode: str) -> None:
    ahead, behind = itertools.tee(_batches())
    next(ahead)
    _no_leak(_loop(mode, lambda step: (next(ahead), next(behind))))


@pytest.mark.parametrize("mode", MODES)
def test_a_cycle_over_an_endless_stream_is_named(mode: str) -> None:
    looped = itertools.cycle(_batches())  # cycle saves every item of its first pass
    leak = _only_leak(_loop(mode, lambda step: next(looped)))
    assert leak.subject.name == "looped"


# -- context variables -------------------------------------------------------------------------
_seen: contextvars.ContextVar[list[torch.Tensor]] = contextvars.ContextVar("seen")
_by_step: contextvars.ContextVar[dict[int, torch.Tensor]] = contextvars.ContextVar("by_step")


def _remember(t: torch.Tensor) -> None:
    _seen.get().append(t)


@pytest.mark.parametrize("mode", MODES)
def test_a_list_in_a_context_variable_is_named_by_its_get(mode: str) -> None:
    context = contextvars.copy_context()

    def run() -> memsentry.Report:
        _seen.set([])
        return _loop(mode, lambda step: _remember(torch.randn(64, 64)))

    leak = _only_leak(context.run(run))
    assert leak.subject.name == "_seen.get()"
    _at(leak, _remember, "_seen.get().append(t)")
    assert "context variable `_seen`" in leak.message and "_seen.set([])" in leak.fix


@pytest.mark.parametrize("mode", MODES)
def test_a_dict_in_a_context_variable_grows_and_a_fresh_list_does_not(mode: str) -> None:
    def keyed() -> memsentry.Report:
        _by_step.set({})
        return _loop(mode, lambda step: _by_step.get().__setitem__(step, torch.randn(64, 64)))

    assert _only_leak(contextvars.copy_context().run(keyed)).subject.name == "_by_step.get()"

    def fresh() -> memsentry.Report:
        return _loop(mode, lambda step: _seen.set([torch.randn(64, 64)]))

    _no_leak(contextvars.copy_context().run(fresh))


_local = threading.local()


def _keep_per_thread(step: int) -> None:
    if not hasattr(_local, "outs"):
        _local.outs = []
    _local.outs.append(torch.randn(64, 64))


@pytest.mark.parametrize("mode", MODES)
def test_a_list_in_a_threading_local_is_named_through_it(mode: str) -> None:
    """``threading.local``: what the running thread set on it is walked as its attributes."""
    try:
        leak = _only_leak(_loop(mode, _keep_per_thread))
    finally:
        del _local.outs
    assert leak.subject.name == "_local.outs"
    _at(leak, _keep_per_thread, "_local.outs.append(")


# -- registries of modules ---------------------------------------------------------------------
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(32, 32)
        self.adapters = nn.ModuleList([nn.Linear(32, 32) for _ in range(3)])
        self.heads = nn.ModuleDict()
        self.scales = nn.ParameterList()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("grow", "name", "noun"), [
    (lambda net, step: net.adapters.append(nn.Linear(32, 32)), "model.adapters", "module"),
    (lambda net, step: net.heads.update({f"h{step}": nn.Linear(32, 32)}), "model.heads", "module"),
    (lambda net, step: net.scales.append(nn.Parameter(torch.ones(64, 64))), "model.scales",
     "parameter"),
], ids=["ModuleList", "ModuleDict", "ParameterList"])
def test_a_registry_of_modules_that_grows_is_named(
        mode: str, grow: Callable[[Net, int], None], name: str, noun: str) -> None:
    net = Net()
    opt = torch.optim.SGD(net.body.parameters(), lr=0.01)
    leak = _only_leak(_loop(mode, lambda step: grow(net, step), net, opt))
    assert leak.subject.name == name
    assert f"gains 1 {noun}/iter" in leak.message, leak.message
    assert "opt.add_param_group" in leak.fix
    # The optimizer trains `model.body` only: the census counts the parameters it never sees.
    assert re.search(r"; \d+ parameters under it are in no optimizer's `param_groups`: no "
                     r"step trains them", leak.message), leak.message


@pytest.mark.parametrize("mode", MODES)
def test_modules_added_to_the_optimizer_as_well_are_said_to_be_trained(mode: str) -> None:
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)

    def grow(step: int) -> None:
        head = nn.Linear(32, 32)
        net.adapters.append(head)
        opt.add_param_group({"params": head.parameters()})

    leak = _only_leak(_loop(mode, grow, net, opt))
    assert leak.subject.name == "model.adapters"
    assert "every parameter under it is in an optimizer's `param_groups`" in leak.message
    assert "no step trains" not in leak.message


@pytest.mark.parametrize("mode", MODES)
def test_a_registry_of_modules_built_once_is_not_a_leak(mode: str) -> None:
    net = Net()
    _no_leak(_loop(mode, lambda step: None, net, torch.optim.SGD(net.parameters(), lr=0.01)))


# -- holders of one name in two scopes ----------------------------------------------------------
_kept: list[torch.Tensor] = []  # a global that keeps a tensor every step


def _keep_globally(step: int) -> None:
    _kept.append(torch.randn(64, 64))


@pytest.mark.parametrize("mode", MODES)
def test_a_global_and_a_local_of_one_name_are_two_holders(mode: str) -> None:
    """A local ``_kept`` of three tensors, replaced in turn, beside the global ``_kept`` that
    grows: the global is named, as a global, at its own line, not the local's."""
    def run() -> memsentry.Report:
        _kept = [torch.zeros(4)] * 3

        def body(step: int) -> None:
            _keep_globally(step)
            _kept[step % 3] = torch.randn(4)  # the local: bounded

        return _loop(mode, body)

    leak = _beside_the_global(run, [])
    assert leak.subject.name == "_kept"
    assert "a global of" in leak.message, leak.message
    _at(leak, _keep_globally, "_kept.append(")


def _beside_the_global(run: Callable[[], memsentry.Report], kept: list[torch.Tensor]
                       ) -> memsentry.Finding:
    """The one LEAK of ``run``, with the global ``_kept`` holding ``kept`` meanwhile."""
    _kept[:] = kept
    try:
        return _only_leak(run())
    finally:
        _kept.clear()


@pytest.mark.parametrize("mode", MODES)
def test_a_local_that_grows_beside_a_global_of_its_name_is_the_one_named(mode: str) -> None:
    def run() -> memsentry.Report:
        _kept: list[torch.Tensor] = []
        return _loop(mode, lambda step: _kept.append(torch.randn(64, 64)))

    leak = _beside_the_global(run, [torch.zeros(4)] * 3)
    assert leak.subject.name == "_kept"
    assert "a local of run()" in leak.message, leak.message
    _at(leak, run, "_kept.append(")


# -- the state of an installed package --------------------------------------------------------
_PACKAGE = """
import collections
_seen = []
REGISTRY = {}
_recent = collections.deque(maxlen=3)
def remember(t):
    _seen.append(t)
def register(key, t):
    REGISTRY[key] = t
def note(t):
    _recent.append(t)
"""


@pytest.fixture
def package(tmp_path: pathlib.Path, request: pytest.FixtureRequest) -> Iterator[Any]:
    """A package installed in a ``site-packages`` folder, imported fresh for the test."""
    name = f"kept_{request.node.name.replace('[', '_').replace(']', '')}"
    folder = tmp_path / "site-packages" / name
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text(_PACKAGE)
    sys.path.insert(0, str(folder.parent))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(folder.parent))
        sys.modules.pop(name, None)


@pytest.mark.parametrize("mode", MODES)
def test_what_an_installed_package_keeps_in_its_globals_is_named_at_the_users_call(
        mode: str, package: Any) -> None:
    def run(lib: Any) -> memsentry.Report:
        return _loop(mode, lambda step: lib.remember(torch.randn(64, 64)))

    leak = _only_leak(run(package))
    assert leak.subject.name == "lib._seen", leak.message
    assert f"a global of the installed package `{package.__name__}`" in leak.message
    _at(leak, run, "lib.remember(")
    assert "`.detach().cpu()` copies" in leak.fix


@pytest.mark.parametrize("mode", MODES)
def test_a_function_imported_from_a_package_leads_to_the_global_it_fills(
        mode: str, package: Any) -> None:
    register = package.register

    def run() -> memsentry.Report:
        return _loop(mode, lambda step: register(step, torch.randn(64, 64)))

    leak = _only_leak(run())
    assert leak.subject.name == "package.REGISTRY", leak.message  # the test names it so
    _at(leak, run, "register(step,")


@pytest.mark.parametrize("mode", MODES)
def test_a_package_that_keeps_the_last_few_is_not_a_leak(mode: str, package: Any) -> None:
    lib = package
    _no_leak(_loop(mode, lambda step: lib.note(torch.randn(64, 64))))


def test_the_packages_looked_at_are_those_the_users_code_names(package: Any) -> None:
    """Installed packages a module names, by itself or through a function imported from it;
    not the standard library nor the machinery (torch, numpy)."""
    import numpy

    named = packages([({"lib": package, "torch": torch, "np": numpy, "heapq": heapq,
                        "record": package.remember, "nothing": 3}, None)])
    assert [(p.module, p.spelled, p.functions) for p in named] == [
        (package, "lib", {"remember": "record"})]


# -- tensors chained through an attribute ------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_tensors_chained_through_an_attribute_are_named_with_the_line_that_links_them(
        mode: str) -> None:
    def run() -> memsentry.Report:
        last = None

        def link(step: int) -> None:
            nonlocal last
            out = torch.randn(64, 64)
            out.prev = last  # type: ignore[attr-defined]
            last = out

        return _loop(mode, link)

    leak = _only_leak(run())
    assert leak.subject.name.endswith("last") or "last" in leak.subject.name
    _at(leak, run, "out.prev = last")
    assert "`.prev`" in leak.message and "x.prev = None" in leak.fix


@pytest.mark.parametrize("mode", MODES)
def test_a_tensor_keeping_only_the_one_before_is_not_a_leak(mode: str) -> None:
    last = [torch.randn(64, 64)]

    def link(step: int) -> None:
        out = torch.randn(64, 64)
        out.prev = last[0]  # type: ignore[attr-defined]
        last[0].prev = None  # type: ignore[attr-defined]
        last[0] = out

    _no_leak(_loop(mode, link))


# -- the atexit registry -----------------------------------------------------------------------
def _save_at_exit(tensor: torch.Tensor) -> None:
    """Stands for a callback that saves a tensor when the program ends."""


@pytest.mark.parametrize("mode", MODES)
def test_callbacks_registered_with_atexit_every_step_are_counted(mode: str) -> None:
    def register(step: int) -> None:
        tensor = torch.randn(64, 64)
        atexit.register(_save_at_exit, tensor)

    try:
        report = _loop(mode, lambda step: register(step))
    finally:
        atexit.unregister(_save_at_exit)
    leak = next(f for f in _leaks(report) if f.rule == "hook-accumulation")
    assert "`atexit` registry gains 1 callback/iter" in leak.message
    _at(leak, test_callbacks_registered_with_atexit_every_step_are_counted,
        "atexit.register(_save_at_exit, tensor)")
    assert "atexit.unregister" in leak.fix


@pytest.mark.parametrize("mode", MODES)
def test_one_callback_registered_with_atexit_is_not_a_leak(mode: str) -> None:
    atexit.register(_save_at_exit, torch.randn(4))
    try:
        _no_leak(_loop(mode, lambda step: None))
    finally:
        atexit.unregister(_save_at_exit)


# -- heaps and sorted lists --------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_a_heap_pushed_every_step_is_named_at_its_push(mode: str) -> None:
    def run() -> memsentry.Report:
        best: list[tuple[float, int, torch.Tensor]] = []
        return _loop(mode, lambda step: heapq.heappush(
            best, (float(step), step, torch.randn(64, 64))))

    leak = _only_leak(run())
    assert leak.subject.name == "best"
    _at(leak, run, "heapq.heappush(")


@pytest.mark.parametrize("mode", MODES)
def test_a_sorted_list_grown_with_insort_is_named_at_its_insort(mode: str) -> None:
    def run() -> memsentry.Report:
        ranked: list[tuple[float, int, torch.Tensor]] = []
        return _loop(mode, lambda step: bisect.insort(
            ranked, (float(-step), step, torch.randn(64, 64))))

    _at(_only_leak(run()), run, "bisect.insort(")


@pytest.mark.parametrize("mode", MODES)
def test_a_bounded_top_k_is_not_a_leak(mode: str) -> None:
    best: list[tuple[float, int, torch.Tensor]] = []

    def keep(step: int) -> None:
        item = (float(step % 7), step, torch.randn(64, 64))
        if len(best) < 8:
            heapq.heappush(best, item)
        else:
            heapq.heappushpop(best, item)

    _no_leak(_loop(mode, keep, steps=60))


# -- inputs that grow while nothing is kept ----------------------------------------------------
class Recurrent(nn.Module):
    def __init__(self, cell: type[nn.RNNBase]) -> None:
        super().__init__()
        self.rnn = cell(16, 32)
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out[-1])


def _curriculum(mode: str, model: nn.Module, batch: Callable[[int], torch.Tensor],
                steps: int = 40) -> memsentry.Report:
    """Steps on inputs that ``batch`` makes larger as the run goes on; nothing is kept."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tracker = memsentry.track(model, on_leak="ignore") if mode == "track" \
        else memsentry.watch(on_leak="ignore")
    with tracker as t:
        for step in range(steps):
            x = batch(step)
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    return t.report()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cell", [nn.GRU, nn.LSTM])
def test_sequences_longer_at_every_step_are_not_a_leak(mode: str, cell: type[nn.RNNBase]
                                                        ) -> None:
    torch.manual_seed(0)
    report = _curriculum(mode, Recurrent(cell), lambda step: torch.randn(8 + 3 * step, 4, 16),
                         steps=30)
    _no_leak(report)


@pytest.mark.parametrize("mode", MODES)
def test_a_batch_larger_at_every_step_is_not_a_leak(mode: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 1))
    _no_leak(_curriculum(mode, model, lambda step: torch.randn(16 + 8 * step, 64)))


@pytest.mark.parametrize("mode", MODES)
def test_images_larger_at_every_step_are_not_a_leak(mode: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(8, 1))
    _no_leak(_curriculum(mode, model, lambda step: torch.randn(4, 3, 16 + 2 * step,
                                                               16 + 2 * step)))


@pytest.mark.parametrize("mode", MODES)
def test_a_bank_concatenated_onto_itself_is_still_a_leak(mode: str) -> None:
    bank = torch.zeros(0, 64)

    def grow(step: int) -> None:
        nonlocal bank
        bank = torch.cat([bank, torch.randn(32, 64)])

    leak = _only_leak(_loop(mode, grow))
    assert leak.rule == "tensor-accumulation" and leak.subject.name == "bank"


@pytest.mark.parametrize("mode", MODES)
def test_a_bank_fed_ever_longer_inputs_is_still_a_leak(mode: str) -> None:
    """The bank grows by more at every step (4 rows more each time): its bytes rise faster
    and faster, not at one pace, and the line feeds the bank from itself."""
    bank = torch.zeros(0, 64)

    def grow(step: int) -> None:
        nonlocal bank
        bank = torch.cat([bank, torch.randn(1 + 4 * step, 64)])

    leak = _only_leak(_loop(mode, grow))
    assert leak.rule == "tensor-accumulation" and leak.subject.name == "bank"
    _at(leak, grow, "bank = torch.cat(")


@pytest.mark.parametrize("mode", MODES)
def test_a_loss_summed_with_its_graph_over_longer_sequences_is_still_a_leak(mode: str) -> None:
    torch.manual_seed(0)
    model = Recurrent(nn.LSTM)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tracker = memsentry.track(model, on_leak="ignore") if mode == "track" \
        else memsentry.watch(on_leak="ignore")
    total = torch.zeros(())
    with tracker as t:
        for step in range(STEPS):
            loss = model(torch.randn(8 + 2 * step, 4, 16)).pow(2).mean()
            loss.backward(retain_graph=True)
            total = total + loss
            opt.step()
            opt.zero_grad()
    leak = next(f for f in _leaks(t.report()) if f.rule == "retained-graph")
    assert leak.subject.name == "total"


def test_a_tee_branch_is_given_what_it_has_not_read_across_blocks() -> None:
    """CPython's tee keeps 57 items a block; a branch 130 items behind spans three."""
    ahead, behind = itertools.tee(iter(range(200)))
    for _ in range(130):
        next(ahead)
    assert tee_items(ahead) == []
    assert tee_items(behind) == list(range(130))
    next(behind)
    assert tee_items(behind) == list(range(1, 130))
