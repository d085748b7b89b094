"""``memsentry.track()``: hooks that record memory around every layer and iteration.

Forward pre/post hooks sample the backend around each module call; a saved-tensor hook
attributes bytes saved for backward to the module whose forward saved them; gradient hooks on
a module's outputs and inputs bracket its backward; optimizer step hooks (or ``t.step()``)
close iterations. Nothing here keeps a module or a tensor alive, and nothing changes what the
model computes.
"""

from __future__ import annotations

import gc
import sys
import time
import warnings
import weakref
from dataclasses import asdict, dataclass, field, replace
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._pytree import tree_leaves

from memsentry.backends import device_of_module, make_backend, nvml_query, parse_device
from memsentry.backends.base import MemoryBackend
from memsentry.census import garbage_census, take_census, user_site
from memsentry.errors import LeakError, LeakWarning, TrackerStateError
from memsentry.recording import LayerRecord, LayerRegistry, Timeline, storage_bytes
from memsentry.report import Census, IterationStats, Report, Severity, UnusedGraph
from memsentry.rules import analyse

_MAX_PENDING_BACKWARD = 20_000
#: mallinfo2() calls averaging more than this over a window switch to boundary-only sampling.
_SLOW_SAMPLE_IN_RUN = 50e-6
_SAMPLE_WINDOW = 256
_ON_LEAK = ("warn", "raise", "ignore")
#: The first census comes after the warm-up iterations the rules leave out.
_FIRST_CENSUS = 2


def census_due(index: int) -> bool:
    """Censuses at iterations 2, 3, 4 (three points decide a trend within five iterations),
    then 6, 10, 18, 34, ...: doubling gaps, so a long run pays for a handful."""
    if _FIRST_CENSUS <= index <= _FIRST_CENSUS + 2:
        return True
    gap = index - _FIRST_CENSUS
    return gap >= 4 and gap & (gap - 1) == 0


class _RootCall:
    """An outermost module call made with autograd on, until a backward reaches its output."""

    __slots__ = ("eval_mode", "function", "handles", "name", "saved", "used", "where")

    def __init__(self, name: str, eval_mode: bool, saved: int | None) -> None:
        self.name = name
        self.eval_mode = eval_mode
        self.saved = saved
        self.used = False
        self.handles: list[Any] = []
        self.where: str | None = None
        self.function: str | None = None

    def mark_used(self, _grad_outputs: Any) -> None:
        self.used = True

    def fold_into(self, known: UnusedGraph | None) -> UnusedGraph:
        """This unused call added to what is ``known`` of its module's unused calls."""
        saved = self.saved
        if known is not None and known.saved_bytes is not None and saved is not None:
            saved = max(saved, known.saved_bytes)
        return UnusedGraph(
            module=self.name,
            calls=(known.calls if known else 0) + 1,
            eval_calls=(known.eval_calls if known else 0) + self.eval_mode,
            saved_bytes=saved,
            where=known.where if known and known.where else self.where,
            function=known.function if known and known.function else self.function,
        )


@dataclass(eq=False)
class _Frame:
    """One module call whose forward is running."""

    record: LayerRecord
    start: int
    peak: int
    saved: dict[int, int] = field(default_factory=dict)
    saved_bytes: int = 0
    backward: _BackwardCall | None = None


class _BackwardCall:
    """The backward of one module call: opened when the gradient of its output is complete,
    closed when the gradients of its inputs are (or when the backward pass ends)."""

    __slots__ = ("handles", "input_nodes", "peak", "record", "start", "state")

    def __init__(self, record: LayerRecord) -> None:
        self.record = record
        self.state = 0  # 0 waiting, 1 running, 2 done
        self.start = 0
        self.peak = 0
        self.handles: list[Any] = []
        self.input_nodes: set[int] = set()


def _grad_nodes(tensors: list[torch.Tensor]) -> list[Any]:
    """The distinct autograd nodes that produced ``tensors`` (leaves have none)."""
    nodes: dict[int, Any] = {}
    for tensor in tensors:
        node = tensor.grad_fn
        if node is not None and tensor.requires_grad:
            nodes.setdefault(id(node), node)
    return list(nodes.values())


def _tensors(values: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(values) if isinstance(t, torch.Tensor)]


def _batch_size(args: Any) -> int | None:
    for value in args if isinstance(args, tuple) else (args,):
        if isinstance(value, torch.Tensor):
            return int(value.shape[0]) if value.dim() else None
    return None


class _SavedTensorVersionError(RuntimeError):
    pass


def _unpack(packed: tuple[torch.Tensor, int]) -> torch.Tensor:
    """Return the saved tensor, repeating autograd's in-place check (skipped under hooks)."""
    tensor, version = packed
    if tensor._version != version:
        raise _SavedTensorVersionError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: [{tensor.type()} {list(tensor.shape)}] is at version "
            f"{tensor._version}; expected version {version} instead. (PyTorch skips this check "
            "while saved-tensor hooks are active; memsentry repeats it.)"
        )
    return tensor


class Tracker:
    """Track memory per layer and per iteration inside a ``with`` block (``memsentry.track``).

    ``model``: hook this module and its submodules; ``None`` hooks every module called.
    ``device``: the device to measure; by default the model's (its first parameter), or,
    without a model, CUDA's when the first module call is on CUDA, else the CPU.
    ``exact``: on CPU, count every tensor storage through a dispatch mode (true peaks inside
    ops, about 1.15x step time); on CUDA, reset the allocator's peak counter at every hook
    (true per-layer peaks; ``torch.cuda.max_memory_allocated()`` then reads from memsentry's
    last sample). ``saved_tensors``: attribute bytes saved for backward to layers (turn off
    for code that refuses saved-tensor hooks, such as some ``torch.compile`` graphs).
    ``backward``: measure each layer's backward. ``max_iterations``: timeline entries kept
    before older ones are thinned out. ``on_leak``: what happens at the end of the block when
    a LEAK finding was made: ``"warn"`` (a :class:`~memsentry.LeakWarning`), ``"raise"`` (a
    :class:`~memsentry.LeakError`, unless the block is already raising) or ``"ignore"``.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        *,
        device: torch.device | str | int | None = None,
        exact: bool = False,
        saved_tensors: bool = True,
        backward: bool = True,
        max_iterations: int = 10_000,
        on_leak: str = "warn",
        holders: bool = True,
        holder_budget: float = 0.5,
    ) -> None:
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(
                "track() takes a torch.nn.Module (or nothing, to hook every module), got "
                f"{type(model).__name__}; pass the model itself, e.g. track(model)"
            )
        for flag_name, flag in (("exact", exact), ("saved_tensors", saved_tensors),
                                ("backward", backward), ("holders", holders)):
            if not isinstance(flag, bool):
                raise TypeError(f"track({flag_name}=...) takes True or False, got {flag!r}")
        if isinstance(max_iterations, bool) or not isinstance(max_iterations, int) \
                or max_iterations < 2:
            raise ValueError(
                f"track(max_iterations=...) must be an int of at least 2, got {max_iterations!r}"
            )
        if isinstance(holder_budget, bool) or not isinstance(holder_budget, int | float) \
                or not holder_budget > 0:
            raise ValueError(
                "track(holder_budget=...) is the seconds one holder search may take, a number "
                f"above 0 (default 0.5), got {holder_budget!r}"
            )
        if on_leak not in _ON_LEAK:
            raise ValueError(
                f"track(on_leak={on_leak!r}): use one of {', '.join(map(repr, _ON_LEAK))}"
            )
        self._on_leak = on_leak
        self._device: torch.device | None = parse_device(device) if device is not None else None
        if self._device is None and model is not None:
            self._device = device_of_module(model)
        self._model_ref = weakref.ref(model) if model is not None else None
        self._exact = exact
        self._saved_tensors = saved_tensors
        self._backward = backward
        self._registry = LayerRegistry()
        self._timeline = Timeline(capacity=max_iterations)
        self._backend: MemoryBackend | None = None
        self._handles: list[Any] = []
        self._saved_hooks: saved_tensors_hooks | None = None
        self._stack: list[_Frame] = []
        self._backward_open: dict[int, _BackwardCall] = {}
        self._backward_pending: list[_BackwardCall] = []
        self._end_of_backward_queued = False
        self._primary_optimizer: weakref.ref[torch.optim.Optimizer] | None = None
        self._manual_steps = False
        self._state = "new"
        self._baseline = 0
        self._overall_peak = 0
        self._last_allocated = 0
        self._last_reserved: int | None = None
        self._last_counters: tuple[dict[str, Any] | None, dict[str, Any] | None] = (None, None)
        self._iter_index = 0
        self._iter_start = 0.0
        self._iter_peak = 0
        self._iter_calls = 0
        self._last_boundary = ""
        self._sample_in_ops = False
        self._holders = holders
        self._holder_budget = float(holder_budget)
        self._censuses: list[Census] = []
        self._own = 0  # allocated memory the censuses added (their records) or freed (gc)
        self._coarse = False  # sample at iteration boundaries only (mallinfo2 became slow)
        self._samples = 0  # mallinfo2 calls in the current window, and their time
        self._sample_time = 0.0
        self._coarse_note: str | None = None
        self._cycles_seen = False  # then every census collects all generations
        self._census_errors: list[str] = []
        self._gc_full = [0, 0, 0]  # collections, bytes freed, allocated at the start of one
        self._root_calls: list[_RootCall] = []
        self._unused: dict[str, UnusedGraph] = {}
        self._iter_data: float | None = None
        self._iter_batch: int | None = None

    # -- lifecycle -----------------------------------------------------------------------
    def __enter__(self) -> Tracker:
        if self._state != "new":
            raise TrackerStateError(
                "this tracker was already used; create a new one with memsentry.track() "
                "for each with-block"
            )
        self._state = "active"
        self._iter_start = time.perf_counter()
        try:
            if self._device is None and not torch.cuda.is_available():
                self._device = torch.device("cpu")
            if self._device is not None:
                self._start_backend(self._device)
            model = self._model_ref() if self._model_ref is not None else None
            if model is not None:
                self._registry.name_tree(model)
                for module in model.modules():
                    self._handles.append(module.register_forward_pre_hook(self._pre_forward))
                    self._handles.append(
                        module.register_forward_hook(self._post_forward, always_call=True)
                    )
            else:
                self._handles.append(register_module_forward_pre_hook(self._pre_forward))
                self._handles.append(
                    register_module_forward_hook(self._post_forward, always_call=True)
                )
            self._handles.append(register_optimizer_step_post_hook(self._optimizer_stepped))
            if self._holders:
                gc.callbacks.append(self._gc_event)
            if self._saved_tensors:
                self._saved_hooks = saved_tensors_hooks(self._pack, _unpack)
                self._saved_hooks.__enter__()
        except BaseException:
            self._teardown()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._state != "active":
            return
        try:
            if self._backend is not None and (self._iter_calls or not self._timeline.items):
                self._close_iteration("exit")
        finally:
            self._teardown()
        if self._on_leak != "ignore":
            self._signal_leaks(raising=exc_type is not None)

    def _signal_leaks(self, *, raising: bool) -> None:
        leaks = tuple(f for f in self.report().findings if f.severity is Severity.LEAK)
        if not leaks:
            return
        lines = [f"memsentry found {len(leaks)} leak(s):"]
        lines += [f"  {f.rule}: {f.message}. Fix: {f.fix}" for f in leaks]
        text = "\n".join(lines)
        if self._on_leak == "raise" and not raising:
            raise LeakError(text, leaks)
        warnings.warn(LeakWarning(text), stacklevel=3)

    def _teardown(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._gc_event in gc.callbacks:
            gc.callbacks.remove(self._gc_event)
        self._settle_root_calls()
        if self._saved_hooks is not None:
            self._saved_hooks.__exit__(None, None, None)
            self._saved_hooks = None
        if self._backend is not None:
            if self._state == "active":
                self._last_allocated = self._backend.allocated()
                self._last_reserved = self._backend.reserved()
                self._last_counters = self._counters(self._backend)
            self._backend.stop()
        self._stack.clear()
        self._drop_backward_hooks(keep_running=False)
        self._backward_open.clear()
        self._registry.clear_modules()
        self._primary_optimizer = None
        self._model_ref = None
        self._state = "closed"

    def _start_backend(self, device: torch.device) -> None:
        self._device = device
        self._backend = make_backend(device, exact=self._exact)
        self._backend.start()
        self._sample_in_ops = self._backend.name == "cpu-mallinfo2"
        self._baseline = self._backend.allocated()
        self._overall_peak = self._iter_peak = self._last_allocated = self._baseline

    def _start_lazily(self, module: nn.Module, args: Any) -> None:
        """Track-without-device on a CUDA machine: pick the device at the first module call,
        so memsentry never initialises CUDA in a script that does not use it."""
        device = device_of_module(module)
        if device is None:
            tensors = _tensors(args)
            device = parse_device(tensors[0].device) if tensors else torch.device("cpu")
        self._start_backend(device)

    # -- sampling ------------------------------------------------------------------------
    def _sample(self, *, boundary: bool = False) -> int:
        if self._coarse and not boundary:
            return self._last_allocated
        if self._sample_in_ops:  # mallinfo2: watch its cost, which grows with fragmentation
            started = time.perf_counter()
            allocated, peak = self._backend.sample()  # type: ignore[union-attr]
            self._sample_time += time.perf_counter() - started
            self._samples += 1
            if self._samples == _SAMPLE_WINDOW:  # the mean of a window, not one preempted call
                if self._sample_time / _SAMPLE_WINDOW > _SLOW_SAMPLE_IN_RUN:
                    self._go_coarse()
                self._samples, self._sample_time = 0, 0.0
        else:
            allocated, peak = self._backend.sample()  # type: ignore[union-attr]
        if self._own:  # what the censuses kept or freed is not the program's memory
            allocated -= self._own
            peak = None if peak is None else peak - self._own
        high = allocated if peak is None or peak < allocated else peak
        if high > self._iter_peak:
            self._iter_peak = high
        if self._stack:
            top = self._stack[-1]
            if high > top.peak:
                top.peak = high
        for frame in self._backward_open.values():
            if high > frame.peak:
                frame.peak = high
        self._last_allocated = allocated
        return allocated

    def _go_coarse(self) -> None:
        """mallinfo2() became slow (the heap fragmented while the loop ran): from now on sample
        only at iteration boundaries, so that tracking cannot slow training down."""
        self._coarse = True
        self._sample_in_ops = False
        self._coarse_note = (
            f"From iteration {self._iter_index} glibc mallinfo2() took "
            f"{self._sample_time / _SAMPLE_WINDOW * 1e6:.0f} us a call on average (a "
            "fragmented heap), so memsentry "
            "sampled only at iteration boundaries: later layer figures are not measured. "
            "track(exact=True) counts tensor storages at a constant cost instead."
        )

    # -- forward -------------------------------------------------------------------------
    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        if self._state != "active":
            return
        if self._backend is None:
            self._start_lazily(module, args)
        parent = self._stack[-1].record if self._stack else None
        record = self._registry.record_for(module, parent)
        if parent is not None:
            parent.is_leaf = False
        allocated = self._sample()
        if not self._iter_calls:
            self._iter_data = time.perf_counter() - self._iter_start
        if parent is None and self._iter_batch is None:
            self._iter_batch = _batch_size(args)
        frame = _Frame(record, allocated, allocated)
        self._stack.append(frame)
        self._iter_calls += 1
        if self._backward and torch.is_grad_enabled():
            call = frame.backward = _BackwardCall(record)
            self._backward_pending.append(call)
            if len(self._backward_pending) > _MAX_PENDING_BACKWARD:  # no iteration boundaries
                self._drop_backward_hooks()
            # Inputs' nodes run once this module's backward has delivered their gradients.
            for node in _grad_nodes(_tensors(args)):
                call.input_nodes.add(id(node))
                call.handles.append(node.register_prehook(self._closer(call)))

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._state != "active" or not self._stack:
            return
        allocated = self._sample()
        frame = self._stack.pop()
        record = self._registry.record_for(module, None)
        while frame.record is not record and self._stack:  # a child whose post hook never ran
            frame = self._stack.pop()
        outputs = _tensors(output)
        record.add_forward(
            delta=allocated - frame.start,
            peak=frame.peak - frame.start,
            output=storage_bytes(outputs),
            saved=frame.saved_bytes if self._saved_tensors else None,
        )
        if self._stack:
            parent = self._stack[-1]
            if frame.peak > parent.peak:
                parent.peak = frame.peak
            for key, size in frame.saved.items():
                if key not in parent.saved:
                    parent.saved[key] = size
                    parent.saved_bytes += size
        if not self._stack and torch.is_grad_enabled():
            self._watch_root_call(module, record.name, frame, outputs)
        call = frame.backward
        if call is not None and torch.is_grad_enabled():
            # Outputs' nodes run once the gradient of the module's output is complete. An output
            # made by an input's node (nn.Identity, a pass-through) means no backward work here.
            for node in _grad_nodes(outputs):
                if id(node) not in call.input_nodes:
                    call.handles.append(node.register_prehook(self._opener(call)))

    def _watch_root_call(self, module: nn.Module, name: str, frame: _Frame,
                         outputs: list[torch.Tensor]) -> None:
        """Watch an outermost call's output nodes: a forward whose graph no backward reaches
        by the end of the iteration wasted what it saved (``missing-no-grad``)."""
        nodes = _grad_nodes(outputs)
        if not nodes:
            return
        call = _RootCall(name, not module.training,
                         frame.saved_bytes if self._saved_tensors else None)
        call.handles = [node.register_prehook(call.mark_used) for node in nodes]
        call.where, call.function = user_site() or (None, None)
        self._root_calls.append(call)

    def _settle_root_calls(self) -> None:
        for call in self._root_calls:
            for handle in call.handles:
                handle.remove()
            if call.used:
                continue
            self._unused[call.name] = call.fold_into(self._unused.get(call.name))
        self._root_calls.clear()

    # -- saved tensors -------------------------------------------------------------------
    def _pack(self, tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
        if self._state == "active" and self._backend is not None:
            if self._sample_in_ops:
                self._sample()
            if self._stack:  # parameters and buffers saved by an op are not new memory
                frame = self._stack[-1]
                frame.saved_bytes += storage_bytes(
                    [tensor], frame.saved, skip=self._registry.static_storages
                )
        # A detached alias: saving the tensor itself would make a saved output reference its
        # own grad_fn (a cycle only the garbage collector frees).
        return tensor.detach(), tensor._version

    # -- backward ------------------------------------------------------------------------
    # Node pre-hooks rather than tensor or multi-grad hooks: they cost the least inside the
    # autograd engine (measured 1.010x against 1.03x a step on a Transformer encoder).
    def _opener(self, call: _BackwardCall):
        def open_backward(_grad_outputs: Any) -> None:
            if call.state or self._state != "active":
                return
            allocated = self._sample()
            call.state, call.start, call.peak = 1, allocated, allocated
            self._backward_open[id(call)] = call
            if not self._end_of_backward_queued:
                self._end_of_backward_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

        return open_backward

    def _closer(self, call: _BackwardCall):
        def close_backward(_grad_outputs: Any) -> None:
            if call.state != 1 or self._state != "active":
                return
            self._finish_backward(call, self._sample())
            del self._backward_open[id(call)]

        return close_backward

    def _finish_backward(self, call: _BackwardCall, allocated: int) -> None:
        call.state = 2
        call.record.add_backward(allocated - call.start, call.peak - call.start)

    def _end_backward(self) -> None:
        """End of a backward pass: close the calls whose inputs needed no gradient."""
        self._end_of_backward_queued = False
        if self._state != "active":
            return
        allocated = self._sample()
        for call in self._backward_open.values():
            self._finish_backward(call, allocated)
        self._backward_open.clear()

    def _drop_backward_hooks(self, *, keep_running: bool = True) -> None:
        """Remove the hooks of past calls, so that a graph node the user keeps across
        iterations does not gather one more memsentry hook per iteration. Calls whose
        backward is running keep theirs unless ``keep_running`` is off (at exit)."""
        kept = []
        for call in self._backward_pending:
            if keep_running and call.state == 1:
                kept.append(call)
                continue
            for handle in call.handles:
                handle.remove()
        self._backward_pending = kept

    # -- iterations ----------------------------------------------------------------------
    def _optimizer_stepped(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._state != "active" or self._manual_steps:
            return
        if self._primary_optimizer is None or self._primary_optimizer() is None:
            self._primary_optimizer = weakref.ref(optimizer)
        elif self._primary_optimizer() is not optimizer:
            return  # a second optimizer (GAN, multi-task) steps inside the same iteration
        if self._backend is not None:
            self._close_iteration("optimizer")

    def step(self) -> None:
        """Mark the end of an iteration (for loops without an optimizer, or to choose the point).

        After the first call, optimizer steps no longer mark iterations.
        """
        if self._state != "active":
            raise TrackerStateError(
                "Tracker.step() was called outside its with-block; call it inside "
                "`with memsentry.track(...) as t:`"
            )
        first_manual = not self._manual_steps
        self._manual_steps = True
        if self._backend is None:
            self._start_backend(self._device or torch.device("cpu"))
        if first_manual and self._last_boundary == "optimizer" and self._iter_calls == 0:
            # The optimizer already closed this iteration just before; relabel, do not split.
            self._timeline.relabel_last("step")
            self._last_boundary = "step"
            return
        self._close_iteration("step")

    def _close_iteration(self, boundary: str) -> None:
        now = time.perf_counter()
        allocated = self._sample(boundary=True)
        self._timeline.add(
            IterationStats(
                index=self._iter_index,
                allocated=allocated,
                reserved=self._backend.reserved(),  # type: ignore[union-attr]
                peak=self._iter_peak,
                seconds=now - self._iter_start,
                boundary=boundary,
                forward_calls=self._iter_calls,
                data_seconds=self._iter_data,
                batch=self._iter_batch,
            )
        )
        self._overall_peak = max(self._overall_peak, self._iter_peak)
        self._drop_backward_hooks()
        self._settle_root_calls()
        if self._holders and boundary != "exit" and census_due(self._iter_index):
            self._take_census()
            now = time.perf_counter()  # the census's own time is not the loop's
            allocated = self._sample(boundary=True)
        self._iter_index += 1
        self._iter_start = now
        self._iter_peak = allocated
        self._iter_calls = 0
        self._iter_data = self._iter_batch = None
        self._last_boundary = boundary

    # -- censuses ------------------------------------------------------------------------
    def _gc_event(self, phase: str, info: dict[str, Any]) -> None:
        """Measure what the interpreter's automatic full collections free (cycles' memory)."""
        if info.get("generation") != 2 or self._backend is None or self._state != "active":
            return
        if phase == "start":
            self._gc_full[2] = self._backend.allocated()
        else:
            self._gc_full[0] += 1
            self._gc_full[1] += max(0, self._gc_full[2] - self._backend.allocated())

    def _take_census(self) -> None:
        backend = self._backend
        assert backend is not None
        collections, freed, _ = self._gc_full
        self._gc_full = [0, 0, 0]
        model = self._model_ref() if self._model_ref is not None else None
        own = {handle.id for handle in self._handles if hasattr(handle, "id")}
        before = backend.allocated()
        try:
            garbage = garbage_census(backend.allocated, collections, freed,
                                     everything=self._cycles_seen)
            self._cycles_seen = self._cycles_seen or garbage.tensors > 0
            census = take_census(
                self._iter_index,
                frame=sys._getframe(1),
                model=model,
                modules=self._registry.modules(),
                static=self._registry.static_storages,
                own_hooks=own,
                skip={id(self)},
                budget=self._holder_budget,
                garbage=garbage,
            )
        except Exception as exc:  # the user's loop must go on whatever the search meets
            self._census_errors.append(
                f"The holder search at iteration {self._iter_index} failed "
                f"({type(exc).__name__}: {exc}); please report this to memsentry."
            )
            return
        self._censuses.append(census)
        self._own += backend.allocated() - before

    # -- results -------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """True inside the with-block."""
        return self._state == "active"

    @property
    def device(self) -> torch.device | None:
        """The device measured (``None`` until the first module call picks it)."""
        return self._device

    @staticmethod
    def _counters(backend: MemoryBackend) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """The backend's raw counters and, on CUDA, NVML's view of the device."""
        nvml = None
        if backend.device.type == "cuda":
            nvml = asdict(nvml_query(backend.device.index or 0))
        return backend.stats(), nvml

    def report(self) -> Report:
        """A frozen :class:`~memsentry.Report` of what was recorded so far (also mid-block)."""
        backend = self._backend
        if backend is None:
            return Report(
                device=str(self._device) if self._device is not None else "unknown",
                backend="none",
                baseline=0,
                notes=("No module ran and no iteration ended while tracking: nothing measured.",),
                torch_version=torch.__version__,
            )
        if self._state == "active":
            allocated = self._sample(boundary=True)
            reserved = backend.reserved()
            allocator_stats, nvml = self._counters(backend)
        else:  # the block's own record, read at exit
            allocated, reserved = self._last_allocated, self._last_reserved
            allocator_stats, nvml = self._last_counters
        report = Report(
            device=str(backend.device),
            backend=backend.name,
            baseline=self._baseline,
            layers=self._registry.freeze(),
            iterations=tuple(self._timeline.items),
            findings=(),
            peak=max(self._overall_peak, self._iter_peak),
            allocated=allocated,
            reserved=reserved,
            total_memory=backend.total_memory(),
            peak_mode=backend.peak_mode,
            notes=tuple(backend.notes),
            dropped_iterations=self._timeline.dropped,
            torch_version=torch.__version__,
            allocator_stats=allocator_stats,
            nvml=nvml,
            censuses=tuple(self._censuses),
            unused_graphs=self._unused_graphs(),
        )
        notes = [*self._census_errors, *([self._coarse_note] if self._coarse_note else [])] + [
            f"The holder search at iteration {c.iteration} stopped at its "
            f"{self._holder_budget:g} s budget after {c.objects:,} objects; holders beyond "
            "them were not examined (raise track(holder_budget=...))."
            for c in self._censuses if not c.complete
        ]
        if notes:
            report = replace(report, notes=report.notes + tuple(notes))
        return replace(report, findings=analyse(report))

    def _unused_graphs(self) -> tuple[UnusedGraph, ...]:
        """Settled unused graphs plus those of the running iteration that are still unused."""
        unused = dict(self._unused)
        for call in self._root_calls:
            if not call.used and call.name not in unused:
                unused[call.name] = call.fold_into(None)
        return tuple(unused.values())


#: ``memsentry.track(model)`` builds a :class:`Tracker`; the two names are one.
track = Tracker
