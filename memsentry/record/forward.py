"""Module forwards: the stack of running calls, and the bytes each saves for backward.

Forward pre/post hooks sample the backend around each module call and fold the figures into
the module's :class:`~memsentry.record.layers.LayerRecord`. A saved-tensor hook attributes the
storage of each tensor saved for backward to the module running at the time (parameters and
buffers left out: they are not new memory), and packs a detached alias with the tensor's
version, so that autograd's in-place check, which PyTorch skips under saved-tensor hooks, is
repeated at unpack.
"""

from __future__ import annotations

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
from torch.utils.hooks import RemovableHandle

from memsentry.record.backward import BackwardTimer, tensors_in
from memsentry.record.calls import ForwardCall
from memsentry.record.layers import LayerRegistry, compiled_original, storage_bytes
from memsentry.record.roots import RootCalls
from memsentry.record.sampler import Sampler
from memsentry.record.timeline import IterationClock


class SavedTensorVersionError(RuntimeError):
    """A tensor saved for backward was modified in place before the backward used it."""


#: The version a tensor packed inside a compiled region carries: not checked on unpacking.
UNCHECKED = -1


def unpack(packed: tuple[torch.Tensor, int]) -> torch.Tensor:
    """Return the saved tensor, repeating autograd's in-place check (skipped under hooks)."""
    tensor, version = packed
    if version != UNCHECKED and tensor._version != version:
        raise SavedTensorVersionError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: [{tensor.type()} {list(tensor.shape)}] is at version "
            f"{tensor._version}; expected version {version} instead. (PyTorch skips this check "
            "while saved-tensor hooks are active; memsentry repeats it.)"
        )
    return tensor


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
                 saved: bool, start_backend: Callable[[nn.Module, Any], None],
                 iteration_start: Callable[[nn.Module], None]) -> None:
        self.active = False
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
        # TorchScript modules of the tracked model: they take no module hooks, so global
        # hooks let their calls (and only theirs) through.
        self.scripted: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self.script_names: set[str] = set()

    def hook_model(self, model: nn.Module) -> list[RemovableHandle]:
        """Forward hooks on every module of ``model``; its TorchScript modules, which take no
        module hooks, get global hooks that let only their calls through."""
        handles = []
        for module in model.modules():
            if isinstance(module, torch.jit.ScriptModule):
                self.scripted.add(module)
                continue
            handles.append(module.register_forward_pre_hook(self.pre_forward))
            handles.append(module.register_forward_hook(self.post_forward, always_call=True))
        if len(self.scripted):
            handles.append(register_module_forward_pre_hook(self.scripted_pre))
            handles.append(register_module_forward_hook(self.scripted_post, always_call=True))
        return handles

    def scripted_pre(self, module: nn.Module, args: Any) -> None:
        if module in self.scripted:
            self.pre_forward(module, args)

    def scripted_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if module in self.scripted:
            self.post_forward(module, args, output)

    def compiled_notes(self) -> list[str]:
        """What the report says of the calls memsentry stepped aside for: inside a torch.func
        transform, TorchScript, torch.compile'd code."""
        aside = (
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
        return [f"{', '.join(f'`{n}`' for n in sorted(names))} {text}"
                for names, text in aside if names]

    def pre_forward(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():  # a constant to Dynamo: nothing below is traced
            return
        if not self.active:
            return
        if self._sampler.backend is None:
            self._start_backend(module, args)
        parent = self.stack[-1].record if self.stack else None
        if parent is None:
            self._iteration_start(module)
        record = self._registry.record_for(module, parent)
        if compiled_original(module) is not None:
            self.compiled.add(record.name)
        elif isinstance(module, torch.jit.ScriptModule):
            self.script_names.add(record.name)
        if parent is None and self._saved:
            self._push_saved_hooks(record.name)
        if parent is not None:
            parent.is_leaf = False
        allocated = self._sampler.sample()
        self._clock.module_called(args, outermost=parent is None)
        call = ForwardCall(record, allocated, allocated)
        self.stack.append(call)
        if self._backward is not None and torch.is_grad_enabled():
            call.backward = self._backward.watch_inputs(record, args)

    def post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        if not self.active or not self.stack:
            return
        allocated = self._sampler.sample()
        call = self.stack.pop()
        record = self._registry.record_for(module, None)
        while call.record is not record and self.stack:  # a child whose post hook never ran
            call = self.stack.pop()
        outputs = tensors_in(output)
        measured = not self._sampler.coarse  # boundary-only sampling: figures would be stale
        record.add_forward(
            delta=allocated - call.start if measured else None,
            peak=call.peak - call.start if measured else None,
            output=storage_bytes(outputs),
            saved=call.saved_bytes if self._saved else None,
        )
        if self.stack:
            parent = self.stack[-1]
            if call.peak > parent.peak:
                parent.peak = call.peak
            for key, size in call.saved.items():
                if key not in parent.saved:
                    parent.saved[key] = size
                    parent.saved_bytes += size
        grad = torch.is_grad_enabled()
        if not self.stack and grad:
            self._roots.watch(record.name, not module.training,
                              call.saved_bytes if self._saved else None, outputs)
        if call.backward is not None and grad and self._backward is not None:
            self._backward.watch_outputs(call.backward, outputs)
        if not self.stack:
            self.pop_saved_hooks()

    def _push_saved_hooks(self, name: str) -> None:
        if self._hooks is not None:
            return
        if torch._C._autograd._saved_tensors_hooks_get_disabled_error_message() is not None:
            self.without_saved.add(name)  # torch.func's grad/vjp: hooks would raise there
            return
        self._hooks = saved_tensors_hooks(self.pack, unpack)
        self._hooks.__enter__()

    def pop_saved_hooks(self) -> None:
        """Take the saved-tensor hooks off the stack (after the outermost call, or at stop)."""
        if self._hooks is not None:
            hooks, self._hooks = self._hooks, None
            hooks.__exit__(None, None, None)

    def pack(self, tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
        if torch.compiler.is_compiling():  # traced into a compiled graph: keep it as it is
            return tensor, UNCHECKED
        if self.active and self._sampler.backend is not None:
            if self._sampler.in_ops:
                self._sampler.sample()
            if self.stack:  # parameters and buffers saved by an op are not new memory
                call = self.stack[-1]
                call.saved_bytes += storage_bytes(
                    [tensor], call.saved, skip=self._registry.static_storages
                )
        # A detached alias: saving the tensor itself would make a saved output reference its
        # own grad_fn (a cycle only the garbage collector frees).
        return tensor.detach(), tensor._version
