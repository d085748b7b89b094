"""Module forwards: the stack of running calls, and the bytes each saves for backward.

Forward pre/post hooks sample the backend around each module call and fold the figures into
the module's :class:`~memsentry.record.layers.LayerRecord`. A saved-tensor hook attributes the
storage of each tensor saved for backward to the module running at the time (parameters and
buffers left out: they are not new memory), and packs a detached alias with the tensor's
version, so that autograd's in-place check, which PyTorch skips under saved-tensor hooks, is
repeated at unpack.
"""

from __future__ import annotations

import sys
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils.hooks import RemovableHandle

from memsentry.measure import StorageBackend
from memsentry.measure.storage import storage_of
from memsentry.record.backward import BackwardTimer, tensors_in
from memsentry.record.calls import ForwardCall, in_backward
from memsentry.record.coverage import Coverage
from memsentry.record.failure import FailureWatch
from memsentry.record.layers import (
    LayerRegistry,
    compiled_original,
    fully_sharded,
    storage_bytes,
)
from memsentry.record.parts import LiveSaved, Parts, Saved
from memsentry.record.roots import RootCalls
from memsentry.record.sampler import Sampler
from memsentry.record.threads import Owner
from memsentry.record.timeline import IterationClock


class SavedTensorVersionError(RuntimeError):
    """A tensor saved for backward was modified in place before the backward used it."""


#: The version a tensor packed inside a compiled region carries: not checked on unpacking.
UNCHECKED = -1


def _no_hooks_known(ignore_is_tracing: bool) -> None:
    return None


#: The saved-tensor hooks on top of this thread's stack, ``(pack, unpack)`` or ``None``. A torch
#: without the function (older than memsentry's tests reach) is taken to have none.
_top_hooks: Callable[[bool], tuple[Any, Any] | None] = getattr(
    torch._C._autograd, "_top_saved_tensors_default_hooks", _no_hooks_known)


def hooks_label(pack: Callable[..., Any]) -> str:
    """What the saved-tensor hooks whose pack function is ``pack`` are, in words."""
    module = getattr(pack, "__module__", "") or ""
    if module == "torch.utils.checkpoint":
        return CHECKPOINT
    qualname = getattr(pack, "__qualname__", "") or type(pack).__qualname__
    if qualname.startswith("save_on_cpu."):
        return "torch.autograd.graph.save_on_cpu"
    return f"{module}.{qualname.replace('.<locals>', '')}".lstrip(".")


#: The label of activation checkpointing's hooks (non-reentrant ``torch.utils.checkpoint``).
CHECKPOINT = "activation checkpointing"
#: ... and with a policy of ops whose outputs are kept (``create_selective_checkpoint_contexts``)
SELECTIVE = "selective activation checkpointing"


def _selective() -> bool:
    """Whether selective checkpointing's caching mode is on the dispatch stack: the outputs
    its policy keeps are held by that mode, not given to saved-tensor hooks."""
    return any(type(mode).__name__ == "_CachingTorchDispatchMode"
               and type(mode).__module__ == "torch.utils.checkpoint"
               for mode in _get_current_dispatch_mode_stack())


def unpack(packed: Saved | tuple[torch.Tensor, int]) -> torch.Tensor:
    """Return the saved tensor, repeating autograd's in-place check (skipped under hooks)."""
    if isinstance(packed, Saved):
        tensor, version = packed.tensor, packed.version
    else:  # packed inside a compiled region
        tensor, version = packed
    if version != UNCHECKED and tensor._version != version:
        raise SavedTensorVersionError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: [{tensor.type()} {list(tensor.shape)}] is at version "
            f"{tensor._version}; expected version {version} instead. (PyTorch skips this check "
            "while saved-tensor hooks are active; memsentry repeats it.)"
        )
    return tensor


#: Checked (torch 2.13, gloo, 2 ranks): ``unshard()`` then ``reshard()`` of a unit whose
#: unsharded parameters take 257 KiB moved glibc's count by 257 KiB, the mode's by nothing;
#: in tracked steps, the mode's peak of the unit's forward lacked those 257 KiB, and its count
#: after the steps still held storages FSDP2 had resized to 0.
SHARDED_NOTE = (
    "are FSDP2 units (fully_shard): FSDP2 allocates and frees their unsharded parameters by "
    "resizing storages in place, which no op shows to the dispatch mode that counts CPU "
    "storages here; the mode counts such a storage at the size it had when made (not at all "
    "when made before tracking) for as long as it exists, so the CPU figures can be off by "
    "up to the unsharded parameters' bytes, either way (glibc's counters, the default "
    "without exact=True where glibc has mallinfo2(), see them)."
)


def of_parameter(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a parameter or a view of one (``linear`` saves ``weight.t()``).
    Checked by type, not by storage: FSDP2 allocates its unsharded parameters' storages anew
    at each forward, so they are not where the layers' first calls found them. A plain
    tensor skips ``Parameter``'s instance check, which costs microseconds."""
    if type(tensor) is torch.Tensor:
        base = tensor._base
        return base is not None and type(base) is not torch.Tensor \
            and isinstance(base, nn.Parameter)
    return isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)


def _count_saved(call: ForwardCall, tensor: torch.Tensor, packed: Saved,
                 live: LiveSaved | None, static: set[int]) -> None:
    """A tensor saved inside ``call``: its storage is the call's, and (with ``live``) alive
    until autograd frees ``packed``. Parameters and buffers saved by an op are not new
    memory."""
    found = None if of_parameter(tensor) else storage_of(tensor)
    if found is None or not found[0] or found[0] in static:
        return
    key, size, _storage = found
    if live is not None:
        live.add(key, size, packed)
    if key not in call.saved:
        call.saved[key] = size
        call.saved_bytes += size


def _fold_into(parent: ForwardCall, call: ForwardCall) -> None:
    """A call ended inside ``parent``: its peak and what it saved are the parent's too."""
    if call.peak > parent.peak:
        parent.peak = call.peak
    for key, size in call.saved.items():
        if key not in parent.saved:
            parent.saved[key] = size
            parent.saved_bytes += size


class ForwardRecorder:
    """The forward hooks and the saved-tensor pack hook of one recorder.

    ``start_backend(module, args)`` is called at the first module call when no backend was
    started yet (the device is then chosen from that call); ``iteration_start(module)`` before
    every outermost call (it may close an iteration, or take a pending census). ``saved``
    says whether bytes saved for backward are attributed; ``backward`` whether each layer's
    backward is timed.
    """

    def __init__(self, *, registry: LayerRegistry, sampler: Sampler, clock: IterationClock,
                 stack: list[ForwardCall], backward: BackwardTimer | None, roots: RootCalls,
                 saved: bool, coverage: Coverage, parts: Parts,
                 start_backend: Callable[[nn.Module, Any], None],
                 iteration_start: Callable[[nn.Module], None], owner: Owner) -> None:
        self.active = False
        self._owner = owner
        self.other_threads = 0  # calls of the model from threads other than the loop's
        self._parts = parts
        self.failures = FailureWatch()
        self.coverage = coverage
        self.anchors: set[int] = set()  # layers called outermost: always hooked
        self._module_hooks: dict[int, tuple[RemovableHandle, RemovableHandle]] = {}
        self._unhooked: set[int] = set()  # layers of the model whose hooks the window took
        self._window: set[int] | None = None  # the window the hooks follow (None: all)
        self.stack = stack
        self._registry = registry
        self._sampler = sampler
        self._clock = clock
        self._backward = backward
        self._roots = roots
        self._saved = saved
        self._start_backend = start_backend
        self._iteration_start = iteration_start
        self.compiled: set[str] = set()  # layers that ran as torch.compile'd graphs
        # The saved-tensor hooks are pushed around each outermost call only, so that code
        # between calls (a torch.func transform) never finds them on the stack; inside a
        # region that disables them, the call is measured without them.
        self._hooks: saved_tensors_hooks | None = None
        self.without_saved: set[str] = set()  # outermost calls run where hooks are disabled
        # Calls that ran under saved-tensor hooks of someone else's (activation checkpointing,
        # save_on_cpu, the user's own): layer name -> what the hooks are. memsentry never puts
        # its own hooks above theirs, which would take the tensors meant for them.
        self.foreign_hooks: dict[str, str] = {}
        self.recomputed: set[str] = set()  # layers called again inside a backward pass
        # TorchScript modules of the tracked model: they take no module hooks, so global
        # hooks let their calls (and only theirs) through.
        self.scripted: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self.script_names: set[str] = set()

    def hook_model(self, model: nn.Module) -> list[RemovableHandle]:
        """Forward hooks on every module of ``model``; its TorchScript modules, which take no
        module hooks, get global hooks that let only their calls through. The module hooks
        are kept apart (:meth:`module_handles`): :meth:`follow_window` moves them."""
        handles = []
        for module in model.modules():
            if isinstance(module, torch.jit.ScriptModule):
                self.scripted.add(module)
                continue
            self._hook(module)
        if len(self.scripted):
            handles.append(register_module_forward_pre_hook(self.scripted_pre))
            handles.append(register_module_forward_hook(self.scripted_post, always_call=True))
        return handles

    def _hook(self, module: nn.Module) -> None:
        # Before FSDP2's pre-hook, as global hooks are: the all-gather is the unit's memory.
        self._module_hooks[id(module)] = (
            module.register_forward_pre_hook(self.pre_forward, prepend=fully_sharded(module)),
            module.register_forward_hook(self.post_forward, always_call=True),
        )

    def module_handles(self) -> list[RemovableHandle]:
        """The hooks on the model's modules now."""
        return [handle for pair in self._module_hooks.values() for handle in pair]

    def unhook_modules(self) -> None:
        for pre, post in self._module_hooks.values():
            pre.remove()
            post.remove()
        self._module_hooks.clear()

    def follow_window(self) -> None:
        """After the window moved: the model's modules outside it lose their hooks (a module
        with no hook costs the loop nothing), those inside it get theirs back. Modules called
        outermost keep theirs: they mark iterations. A module never called keeps its hooks.
        Only the modules whose side of the window changed are visited."""
        window = self.coverage.window()
        if window is None and self._window is None:
            return
        if window is None:
            changed = set(self._unhooked)
        elif self._window is None:
            changed = set(range(self.coverage.layers))
        else:
            changed = window ^ self._window
        self._window = window
        modules = self._registry.by_index() if changed else {}
        for index in changed:
            module = modules.get(index)
            if module is None or index in self.anchors:
                continue
            hooked = id(module) in self._module_hooks
            if window is None or index in window:
                if not hooked and index in self._unhooked:
                    self._unhooked.discard(index)
                    self._hook(module)
            elif hooked:
                pre, post = self._module_hooks.pop(id(module))
                pre.remove()
                post.remove()
                self._unhooked.add(index)

    def scripted_pre(self, module: nn.Module, args: Any) -> None:
        if module in self.scripted:
            self.pre_forward(module, args)

    def scripted_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if module in self.scripted:
            self.post_forward(module, args, output)

    def compiled_notes(self) -> list[str]:
        """What the report says of the calls memsentry stepped aside for: inside a torch.func
        transform, TorchScript, torch.compile'd code; and of FSDP2 units when CPU storages are
        counted, which misses FSDP2's resizes."""
        counting = isinstance(self._sampler.backend, StorageBackend)
        aside = (
            (self._registry.sharded if counting else set(), SHARDED_NOTE),
            (self.without_saved, "ran inside a torch.func transform (grad, vjp, jacrev), where "
             "saved-tensor hooks are not allowed: the bytes they saved for backward there are "
             "not measured (the rest of the call is)."),
            (self.script_names, "ran as TorchScript: memsentry measured each call as a whole "
             "(memory at its boundaries, iterations, holders); the modules inside it take no "
             "hooks and are not measured one by one."),
            (self.compiled, "ran as torch.compile'd code: memsentry measured each call as a "
             "whole (memory at its boundaries, what it saved for backward, iterations, "
             "holders) but steps aside inside it, so the layers inside it are not measured one "
             "by one (run it uncompiled to see them)."),
        )
        notes = [f"{', '.join(f'`{n}`' for n in sorted(names))} {text}"
                 for names, text in aside if names]
        return notes + self._hooks_notes()

    def _hooks_notes(self) -> list[str]:
        """What the report says of the calls that ran under other saved-tensor hooks, and of
        the forwards recomputed inside backward passes."""
        by_label: dict[str, list[str]] = {}
        for name, label in self.foreign_hooks.items():
            by_label.setdefault(label, []).append(name)
        notes = []
        for label, names in sorted(by_label.items()):
            listed = ", ".join(f"`{n}`" for n in sorted(names)[:8])
            if len(names) > 8:
                listed += f" and {len(names) - 8} more"
            if label == CHECKPOINT:
                notes.append(
                    f"{listed} ran under activation checkpointing: between forward and "
                    "backward they keep nothing for backward (their `saved` is 0); what they "
                    "save is recomputed during the backward pass, in the backward figures.")
            elif label == SELECTIVE:
                notes.append(
                    f"{listed} ran under selective activation checkpointing: the outputs its "
                    "policy keeps are held by checkpointing, out of memsentry's sight (their "
                    "`saved` column is empty); the rest is recomputed during the backward "
                    "pass, in the backward figures.")
            else:
                notes.append(
                    f"{listed} ran under saved-tensor hooks of their own (`{label}`): what they "
                    "saved for backward went to those hooks, as without memsentry, and is not "
                    "measured (their `saved` column is empty); memory at their boundaries is.")
        if self.other_threads:
            notes.append(
                f"{self.other_threads:,} module calls of the tracked model came from threads "
                "other than the loop's and were not measured (each thread's loop can have its "
                "own tracker).")
        if self.recomputed:
            listed = ", ".join(f"`{n}`" for n in sorted(self.recomputed)[:8])
            notes.append(
                f"{listed} ran again inside backward passes (the recomputation of activation "
                "checkpointing): those calls are not counted as forward calls; their memory is "
                "in the backward figures of the layers around them.")
        return notes

    def _aside(self, module: nn.Module) -> bool:
        """Whether a module call is none of memsentry's business: while Dynamo traces (a
        constant to it: nothing below is traced), while torch.jit.trace records every op, when
        not tracking, and inside a backward pass (checkpointing recomputes a forward there)."""
        if torch.compiler.is_compiling() or torch._C._get_tracing_state() is not None \
                or not self.active:
            return True
        if in_backward():
            self._recomputed(module)
            return True
        return not self._owner.mine() and not self._adopted()

    def _adopted(self) -> bool:
        """A call from a thread not the loop's: a tracker given a model follows the thread
        that calls it first; later calls from other threads are another loop's (counted)."""
        if self._owner.adoptable and not self.stack and not self._clock.calls \
                and not self._clock.index:
            self._owner.adopt()
            return True
        self.other_threads += 1
        return False

    def pre_forward(self, module: nn.Module, args: Any) -> None:
        if self._aside(module):
            return
        if self._sampler.backend is None:
            self._start_backend(module, args)
        stack = self.stack
        parent = stack[-1].record if stack else None
        if parent is None:
            self._iteration_start(module)
        record = self._registry.record_for(module, parent)
        coverage = self.coverage
        coverage.calls += 1
        measured = coverage.measures(record.index)
        if not measured and parent is not None:  # counted only; nothing goes on the stack
            record.calls += 1
            self._clock.calls += 1
            return
        started = time.perf_counter()
        if compiled_original(module) is not None:
            self.compiled.add(record.name)
        elif isinstance(module, torch.jit.ScriptModule):
            self.script_names.add(record.name)
        if parent is None:
            self.anchors.add(record.index)
        else:
            parent.is_leaf = False
        pushed = measured and self._saved and self._push_saved_hooks(record.name)
        foreign = self._foreign_hooks(record.name) if measured and self._saved else None
        allocated = self._sampler.sample() if measured else self._sampler.last
        self._clock.module_called(args, outermost=parent is None)
        call = ForwardCall(record, allocated, allocated, measured=measured, pushed=pushed,
                           hooks=foreign)
        stack.append(call)
        if measured and self._backward is not None and torch.is_grad_enabled():
            call.backward = self._backward.watch_inputs(record, args)
        if measured:
            coverage.count(started)

    def post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling() or torch._C._get_tracing_state() is not None:
            return
        stack = self.stack
        if not self.active or not stack or in_backward() or not self._owner.mine():
            return
        record = self._registry.record_for(module, None)
        if stack[-1].record is not record and all(c.record is not record for c in stack):
            return  # a call that was only counted
        started = time.perf_counter()
        # Read before the call leaves the stack: the reading raises its peak.
        allocated = self._sampler.sample() if stack[-1].measured else 0
        error = sys.exc_info()[1]  # PyTorch runs this hook while an error propagates
        if error is not None:
            self.failures.check(error, record.name, self._sampler)
        call = stack.pop()
        while call.record is not record and stack:  # a child whose post hook never ran
            call = stack.pop()
        measured = call.measured
        outputs = tensors_in(output)
        if measured:
            record.add_forward(
                delta=allocated - call.start, peak=call.peak - call.start,
                output=storage_bytes(outputs), saved=self._saved_of(call),
            )
        else:
            record.calls += 1
        if stack and measured:
            _fold_into(stack[-1], call)
        grad = torch.is_grad_enabled()
        if not stack and grad:
            self._roots.watch(record.name, not module.training,
                              call.saved_bytes if self._saved and measured else None, outputs)
        if call.backward is not None and grad and self._backward is not None:
            self._backward.watch_outputs(call.backward, outputs)
        if call.pushed or not stack:
            self.pop_saved_hooks()
        if measured:
            self.coverage.count(started)

    def _saved_of(self, call: ForwardCall) -> int | None:
        """The bytes ``call`` saved for backward, as a layer's figure: ``None`` when they went
        to someone else's hooks, 0 under checkpointing (kept nothing)."""
        if not self._saved or call.hooks not in (None, CHECKPOINT):
            return None
        return call.saved_bytes

    def _recomputed(self, module: nn.Module) -> None:
        record = self._registry.record_of(module)
        if record is not None:
            self.recomputed.add(record.name)

    def _foreign_hooks(self, name: str) -> str | None:
        """What the saved-tensor hooks on top of the stack are, when they are not ours."""
        top = _top_hooks(False)
        if top is None or top[0] == self.pack:
            return None
        label = hooks_label(top[0])
        if label == CHECKPOINT and _selective():
            label = SELECTIVE
        if name not in self.foreign_hooks:
            self.foreign_hooks[name] = label
        return label

    def _push_saved_hooks(self, name: str) -> bool:
        """Put the saved-tensor hooks on the stack for a measured call; whether it did. Never
        above hooks already there (checkpointing's, save_on_cpu's, the user's): the tensors
        saved are theirs to keep, and pushed above them memsentry would take them."""
        if self._hooks is not None:
            return False
        if torch._C._autograd._saved_tensors_hooks_get_disabled_error_message() is not None:
            self.without_saved.add(name)  # torch.func's grad/vjp: hooks would raise there
            return False
        if _top_hooks(False) is not None:
            return False
        self._hooks = saved_tensors_hooks(self.pack, unpack)
        self._hooks.__enter__()
        return True

    def pop_saved_hooks(self) -> None:
        """Take the saved-tensor hooks off the stack (after the outermost call, or at stop)."""
        if self._hooks is not None:
            hooks, self._hooks = self._hooks, None
            hooks.__exit__(None, None, None)

    def pack(self, tensor: torch.Tensor) -> Saved | tuple[torch.Tensor, int]:
        if torch.compiler.is_compiling() or torch._C._get_tracing_state() is not None:
            return tensor, UNCHECKED  # traced into a compiled graph: kept as it is
        # A detached alias: saving the tensor itself would make a saved output reference its
        # own grad_fn (a cycle only the garbage collector frees).
        packed = Saved(tensor.detach(), tensor._version)
        if self.active and self._sampler.backend is not None and self.stack:
            started = time.perf_counter()
            call = self.stack[-1]
            _count_saved(call, tensor, packed, self._parts.live if self._parts.due else None,
                         self._registry.static_storages)
            if call.measured and self._sampler.in_ops:
                self._sampler.sample_at_pack()
            self.coverage.count(started)
        return packed
