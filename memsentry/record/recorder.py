"""The recorder: wires the hooks, the sampler, the clock and the censuses of one tracking run,
and freezes what they recorded into a :class:`~memsentry.model.ReportData` (no findings: the
rules run a layer above).

Nothing here keeps a module or a tensor alive, and nothing changes what the model computes.
"""

from __future__ import annotations

import sys
import threading
import time
import types
import weakref
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from typing import Any

import torch
from torch import nn
from torch.optim import optimizer as optimizer_module

import memsentry.record.policy as policy
from memsentry.measure import (
    MemoryBackend,
    device_of_module,
    make_backend,
    nvml_query,
    parse_device,
    read_pinned,
    resident_peak,
)
from memsentry.measure.gpus import read_devices
from memsentry.model import Boundary, DeviceMemory, OutOfMemory, ReportData
from memsentry.record.backward import BackwardTimer, tensors_in
from memsentry.record.boundary import Boundaries
from memsentry.record.budget import Budget, budget_notes
from memsentry.record.calls import BackwardCall, ForwardCall
from memsentry.record.clock import Clock
from memsentry.record.coverage import Coverage, coverage_notes
from memsentry.record.failure import explain
from memsentry.record.forward import ForwardRecorder
from memsentry.record.growth import GrowthEvidence
from memsentry.record.layers import LayerRegistry
from memsentry.record.options import Options
from memsentry.record.outermost import OutermostCalls
from memsentry.record.parts import Parts
from memsentry.record.passes import PlainPasses
from memsentry.record.policy import Tuning
from memsentry.record.sampler import Sampler
from memsentry.record.schedule import CensusSchedule
from memsentry.record.signals import Action, Signals
from memsentry.record.threads import Owner, forget_steps, listen_to_steps, step_hook_ids
from memsentry.record.timeline import IterationClock, Timeline

Counters = tuple[dict[str, Any] | None, dict[str, Any] | None, tuple[DeviceMemory, ...]]
_get_ident = threading.get_ident  # bound once: read at every optimizer step


def read_counters(backend: MemoryBackend) -> Counters:
    """The backend's raw counters and, on CUDA, NVML's view of the device (found by its UUID,
    CUDA never started for it) and every CUDA device the program holds memory on."""
    nvml, devices = None, tuple[DeviceMemory, ...]()
    if backend.device.type == "cuda":
        nvml = asdict(nvml_query(backend.device.index or 0, initialise=False))
        devices = read_devices()
    return backend.stats(), nvml, devices


def first_device(values: Any) -> torch.device:
    """The device of the first tensor in ``values`` (the CPU without one)."""
    tensors = tensors_in(values)
    return parse_device(tensors[0].device) if tensors else torch.device("cpu")


def nothing_measured(device: torch.device | None) -> ReportData:
    """The recording of a tracker that never picked a device: no module ran, no pass ended."""
    return ReportData(
        device=str(device) if device is not None else "unknown", backend="none", baseline=0,
        notes=("No module ran and no iteration ended while tracking: nothing measured.",),
        torch_version=torch.__version__,
    )


_STEP_WRAPPER = optimizer_module.__file__


def nested_step(optimizer: torch.optim.Optimizer, frames: int = 12) -> bool:
    """Whether this step of ``optimizer`` runs inside another step of it: a subclass whose
    ``step`` calls ``super().step()`` runs PyTorch's step hooks once for each (one step)."""
    if not _steps_nest(type(optimizer)):
        return False
    frame: types.FrameType | None = sys._getframe(2)
    seen = 0
    while frame is not None and frames:
        code = frame.f_code
        if code.co_name == "wrapper" and code.co_filename == _STEP_WRAPPER \
                and frame.f_locals.get("self") is optimizer:
            seen += 1
            if seen > 1:
                return True
        frame, frames = frame.f_back, frames - 1
    return False


#: The last optimizer class asked about and its answer: a loop steps one class at every step,
#: and a weak-keyed table would make a weak reference at each (a class, never a model).
_last_kind: tuple[type | None, bool] = (None, False)


def _steps_nest(kind: type) -> bool:
    """Whether a step of optimizer class ``kind`` may run inside another: more than one class
    of its MRO defines ``step`` (a step that calls ``super().step()``)."""
    global _last_kind
    known, nests = _last_kind
    if known is not kind:
        nests = sum("step" in vars(klass) for klass in kind.__mro__
                    if klass is not torch.optim.Optimizer) > 1
        _last_kind = (kind, nests)
    return nests


def _with_processes(clock: IterationClock, data: ReportData) -> ReportData:
    """``data`` with the DataLoader workers followed and the process's own readings."""
    workers, process = clock.processes()
    return replace(data, workers=workers, process=process, resident_peak=resident_peak(),
                   pinned=read_pinned())


class Recorder:
    """Records memory per layer and per iteration between :meth:`start` and :meth:`stop`."""

    def __init__(self, model: nn.Module | None, options: Options,
                 named: Sequence[tuple[str, Any, str]] = (), *,
                 clock: Clock = time.perf_counter, tuning: Tuning | None = None,
                 credit: float | None = None) -> None:
        self.options = options
        tuning = tuning if tuning is not None else policy.DEFAULT
        self._given = (clock, tuning, credit)
        # Objects a framework runs, by the name their methods spell them (held weakly).
        self._named = [(name, weakref.ref(obj), role) for name, obj, role in named]
        self.device = options.device
        if self.device is None and model is not None:
            self.device = device_of_module(model)
        self._model_ref = weakref.ref(model) if model is not None else None
        self._registry = LayerRegistry()
        self._timeline = Timeline(capacity=options.max_iterations)
        self._clock = IterationClock(clock)
        self._stack: list[ForwardCall] = []
        running: dict[int, BackwardCall] = {}
        self._parts = Parts(model)
        self._owner = Owner(adoptable=model is not None)
        self._sampler = Sampler(self._stack, running, self._parts, clock)
        self._budget = Budget(options.overhead, credit=credit, tuning=tuning, clock=clock)
        self._coverage = Coverage(options.overhead, self._budget, clock)
        self._backward = (BackwardTimer(self._sampler, running, self._clock, self._coverage)
                          if options.backward else None)
        self._outermost = OutermostCalls(self._clock, self._backward_ended)
        self._plain = PlainPasses(self._plain_backward)
        self._signals = Signals()
        self._censuses = CensusSchedule(self._sampler, self._registry, options.holder_budget,
                                        self._owner, self._budget)
        self._forward = ForwardRecorder(
            registry=self._registry, sampler=self._sampler, clock=self._clock,
            stack=self._stack, backward=self._backward, outermost=self._outermost,
            saved=options.saved_tensors, coverage=self._coverage, parts=self._parts,
            start_backend=self._start_lazily, iteration_start=self._outermost_call,
            owner=self._owner)
        self._boundaries = Boundaries(
            sampler=self._sampler, parts=self._parts, coverage=self._coverage,
            budget=self._budget, clock=self._clock, timeline=self._timeline,
            censuses=self._censuses, backward=self._backward, outermost=self._outermost,
            forward=self._forward, registry=self._registry, holders=options.holders,
            census_roots=self._census_roots, signals=self._signals)
        if options.watch:
            self._boundaries.growth = GrowthEvidence()
        self.active = False
        # Called after each census with "census", after each closed iteration with
        # "boundary" (the tracker's alarm); an error to raise in the loop at the next
        # boundary (an optimizer step, t.step(), an outermost forward's start).
        self.listener: Callable[[str], None] | None = None
        self.raise_at_boundary: BaseException | None = None
        # The id of the loop's optimizer while its steps end the iterations and do not nest:
        # its steps in a run of boundaries passed with a count take the short way.
        self._stepping = 0
        self._censuses.on_taken = self._census_taken
        self.unclocked = self._boundaries.unclocked  # the alarm's work: not the loop's time
        self._final: tuple[int, int | None, Counters] | None = None
        self._oom: OutOfMemory | None = None

    def with_policy(self, *, clock: Clock | None = None, tuning: Tuning | None = None,
                    credit: float | None = None) -> Recorder:
        """This recorder, not started yet, built again on another clock, tuning or judging
        credit (``credit``: untracked seconds to credit; ``None``: as the process ran). The
        seam through which tests give the policy fixed facts."""
        given_clock, given_tuning, given_credit = self._given
        model = self._model_ref() if self._model_ref is not None else None
        named = [(name, obj, role) for name, ref, role in self._named
                 if (obj := ref()) is not None]
        return Recorder(model, self.options, named,
                        clock=clock if clock is not None else given_clock,
                        tuning=tuning if tuning is not None else given_tuning,
                        credit=credit if credit is not None else given_credit)

    # -- start and stop --------------------------------------------------------------------
    def start(self) -> None:
        """Install the hooks; on failure, remove what was installed and raise."""
        self._owner.claim()
        self._budget.open()
        self._set_active(True)
        self._clock.started = self._clock.now()
        try:
            # A torch built without CUDA measures the CPU now; on a CUDA build the device
            # is picked at the first module call, never by asking the driver here: torch.
            # cuda.is_available() registers torch's fork handler (torch/csrc/cuda/Module.cpp,
            # THCPModule_getDeviceCount_wrap), after which a forked child cannot use CUDA.
            if self.device is None and not torch.backends.cuda.is_built():
                self.device = torch.device("cpu")
            if self.device is not None:
                self._start_backend(self.device)
            self._install_hooks()
        except BaseException:
            self._teardown()
            raise

    def _install_hooks(self) -> None:
        model = self._model_ref() if self._model_ref is not None else None
        if model is not None:
            self._registry.name_tree(model)
        self._forward.put_on(model, sys._getframe(1))
        listen_to_steps(self._optimizer_stepped)
        self._plain.install()
        self._clock.time_batches()

    def stop(self) -> None:
        """Close the partial iteration, remove every hook and forget every module."""
        if not self.active:
            return
        try:
            if self._sampler.backend is not None:
                before = self._clock.index
                self._boundaries.end()
                self._closing_census(partial=self._clock.index > before)
            self._censuses.pending = None
        finally:
            self._teardown()

    def _closing_census(self, *, partial: bool) -> None:
        """As tracking ends: a census when a holder still grew at the last one and the run
        went on since (:meth:`CensusSchedule.take_closing`). Where the loop's functions have
        returned their locals are gone: the rules take what it does not see as unknown. It
        is filed under the last iteration a boundary closed, not the ``partial`` one the end
        closed: a census filed under iteration i sees what i + 1 iterations left, and this
        one sees every iteration's."""
        if self.options.holders:
            last = self._clock.index - (2 if partial else 1)
            self._censuses.take_closing(max(last, 0), **self._census_roots())

    def _set_active(self, active: bool) -> None:
        for part in (self, self._forward, self._forward.saved, self._censuses, self._backward):
            if part is not None:
                part.active = active

    def _teardown(self) -> None:
        self._owner.release()
        forget_steps(self._optimizer_stepped)
        self._clock.stop_timing_batches()
        self._plain.remove()
        self._forward.take_off()
        self._censuses.unwatch_collections()
        self._outermost.settle(everything=True)
        self._forward.saved.pop()
        backend = self._sampler.backend
        if backend is not None:
            if self.active:
                self._final = (backend.allocated(), backend.reserved(), read_counters(backend))
            backend.stop()
        self._set_active(False)
        self._budget.close()
        self._stack.clear()
        if self._backward is not None:
            self._backward.close()
        self._registry.clear_modules()
        self._signals.forget_modules()
        self._model_ref, self._named = None, []

    def _start_backend(self, device: torch.device) -> None:
        self.device = device
        self._parts.read_all()
        self._sampler.start(make_backend(device, exact=self.options.exact))
        self._sampler.at_peak = self._sampler.moment()
        self._boundaries.overall_peak = self._sampler.baseline

    def _start_lazily(self, module: nn.Module, args: Any) -> None:
        """Tracking without a device on a CUDA machine: pick the device at the first module
        call, so memsentry never initialises CUDA in a script that does not use it."""
        self._start_backend(device_of_module(module) or first_device(args))

    # -- iterations ------------------------------------------------------------------------
    def _optimizer_stepped(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._boundaries.skip and id(optimizer) == self._stepping and self.active \
                and self.raise_at_boundary is None and _get_ident() == self._owner.ident:
            self._boundaries.pass_step()  # the short way: at every step of a light stretch
            return
        self._stepped_long_way(optimizer)

    def _stepped_long_way(self, optimizer: torch.optim.Optimizer) -> None:
        """A step of ``optimizer`` that may end an iteration: the loop's optimizer's steps
        take the short way from here while their boundaries are passed with a count."""
        self._stepping = 0
        if not self.active or not self._owner.mine() or nested_step(optimizer):
            return  # another thread's optimizer is another loop's
        self._parts.add_optimizer(optimizer)
        if self._signals.primary(optimizer):  # not a second one (GAN, multi-task)
            self._signal(Boundary.OPTIMIZER)
            if self._signals.signal is Boundary.OPTIMIZER and not _steps_nest(type(optimizer)):
                self._stepping = id(optimizer)

    def _backward_ended(self) -> None:
        if self.active:
            self._signals.engine_pass_ended()
            self._signal(Boundary.BACKWARD)

    def _plain_backward(self, tensors: Any) -> None:
        """A backward pass ended: stale calls leave the stack; without modules, an iteration.
        In a run of steps passed with a count (no hook on, the optimizer's steps end the
        iterations), it is nothing: the short way."""
        if self._stepping and self._boundaries.skip:
            return
        if not self.active or not self._owner.mine():
            return
        self._forward.settle_stack()
        if self._signals.wrapped_pass_ends_iteration(
                bare=self._forward.hooks.bare, reached=self._outermost.pass_seen(),
                thinned=self._outermost.thinned):
            if self._sampler.backend is None:  # no module ran to pick the device
                self._start_backend(first_device(tensors))
            self._signal(Boundary.BACKWARD)

    def _outermost_call(self, module: nn.Module) -> None:
        """Before an outermost module call: the next call of the first outermost module
        begins an iteration (for loops with no stronger signal); a census pending since the
        last boundary is taken, its time moved out of the iteration's data wait."""
        if self._signals.repeats_first_call(module):
            self._signal(Boundary.FORWARD)
        self._parts.begin(self._coverage, module, self._registry.record_of(module),
                          first=not self._clock.calls)  # the first: after zero_grad()
        self._clock.started += self._boundaries.census_at_call()
        self._raise_pending()

    def settles_at(self, iteration: int | None) -> None:
        """The alarm found a leak it has not said yet, which a census at ``iteration`` or
        later would confirm (``None``: none): the first due then is taken whatever the
        budget holds."""
        self._censuses.settles = iteration

    def _census_taken(self) -> None:
        if self.listener is not None:
            self.listener("census")

    def _raise_pending(self) -> None:
        """Raise the error the alarm left for this boundary (``on_leak="raise"``)."""
        error = self.raise_at_boundary
        if error is not None and self._owner.mine():
            self.raise_at_boundary = None
            raise error

    def census(self) -> None:
        """A census now, as of the last boundary; its time is not the iteration's."""
        if self.active and self.options.holders and self._sampler.backend is not None:
            self._forward.stop_counting()  # the calls counted so far are iterations
            roots = self._census_roots()
            self._clock.started += self._censuses.take_now(self._clock.index - 1, **roots)

    def step(self) -> None:
        """Close an iteration here; from the first call on, weaker signals no longer do."""
        if self._sampler.backend is None:
            self._start_backend(self.device or torch.device("cpu"))
        self._signal(Boundary.STEP)

    def _signal(self, event: Boundary) -> None:
        if event is Boundary.STEP:
            self._stepping = 0  # t.step() becomes the signal: steps go the long way
        if self._sampler.backend is None:
            return
        if not self._boundaries.passes(event, self._signals.signal):
            action = self._signals.decide(event, calls_since=self._clock.calls)
            if action is not Action.IGNORE:
                self._boundaries.close(event, merge=action is Action.MERGE)
                if self.listener is not None:
                    self.listener("boundary")
        if event in (Boundary.OPTIMIZER, Boundary.STEP):
            self._raise_pending()

    def _census_roots(self) -> dict[str, Any]:
        """What a census needs from the recorder: the model, memsentry's hooks, itself."""
        model = self._model_ref() if self._model_ref is not None else None
        handles = self._forward.hooks.handles()
        own = {handle.id for handle in handles if hasattr(handle, "id")} | step_hook_ids()
        named = [(name, obj, role) for name, ref, role in self._named
                 if (obj := ref()) is not None]
        return {"model": model, "own_hooks": own, "skip": {id(self)}, "named": named}

    def failed(self, error: BaseException) -> None:
        """The block ends with ``error``: an out-of-memory error is explained in the report;
        the graphs of the iteration it broke off are not judged unused."""
        self._outermost.abandon()
        self._oom = explain(error, self._forward.failures, self._sampler, self._clock,
                            self._registry.name_of)

    # -- results ---------------------------------------------------------------------------
    def recording(self) -> ReportData:
        """What was recorded so far (also while recording), frozen, without findings."""
        backend = self._sampler.backend
        if backend is None:
            return nothing_measured(self.device)
        if self.active or self._final is None:
            allocated = self._sampler.sample()
            reserved, counters = backend.reserved(), read_counters(backend)
        else:  # read at the end of recording
            allocated, reserved, counters = self._final
        cost = self._budget.cost()
        notes = (*backend.notes, *self._sampler.notes, *self._censuses.errors,
                 *filter(None, [self._signals.note()]), *coverage_notes(self._coverage,
                 self._registry), *budget_notes(cost, self._budget.tuning),
                 *self._censuses.budget_notes(), *self._forward.compiled_notes())
        return _with_processes(self._clock, ReportData(
            device=str(backend.device), backend=backend.name, baseline=self._sampler.baseline,
            layers=self._registry.freeze(), iterations=tuple(self._timeline.items),
            peak=max(self._boundaries.overall_peak, self._sampler.peak), allocated=allocated,
            reserved=reserved, total_memory=backend.total_memory(),
            peak_mode=backend.peak_mode, measured=backend.measured, notes=notes,
            dropped_iterations=self._timeline.dropped, torch_version=torch.__version__,
            allocator_stats=counters[0], nvml=counters[1], devices=counters[2],
            censuses=tuple(self._censuses.censuses), unused_graphs=self._outermost.unused(),
            oom=self._oom, cost=cost, other_threads=self._owner.others(),
            lengths=self._censuses.lengths.freeze(),
        ))
