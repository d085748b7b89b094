"""Bytes saved for backward: the saved-tensor pack hook of one recorder, and the hooks of
others beside it.

The pack hook attributes the storage of each tensor saved for backward to the module running
at the time (parameters and buffers left out: they are not new memory), and packs a detached
alias with the tensor's version, so that autograd's in-place check, which PyTorch skips under
saved-tensor hooks, is repeated at unpack.

Other code uses saved-tensor hooks too: activation checkpointing (both modes, selective),
``save_on_cpu``, the user's own. The hook on top of the stack takes every tensor saved, so
memsentry never pushes its own above one already there, and reports the calls that ran under
someone else's: their bytes are theirs, not measured (0 under plain checkpointing, which keeps
nothing between forward and backward). Forwards run again inside a backward pass (the
recomputation of checkpointing) are noted, not counted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from memsentry.measure.storage import storage_of
from memsentry.record.budget import SAVED
from memsentry.record.calls import ForwardCall
from memsentry.record.coverage import Coverage
from memsentry.record.layers import LayerRegistry
from memsentry.record.parts import LiveSaved, Parts, Saved
from memsentry.record.sampler import Sampler
from memsentry.record.versions import wording
from memsentry.usercode.location import Location

#: The version a tensor packed inside a compiled region carries: not checked on unpacking.
UNCHECKED = -1


def _no_hooks_known(ignore_is_tracing: bool) -> None:
    return None


#: The saved-tensor hooks on top of this thread's stack, ``(pack, unpack)`` or ``None``. A torch
#: without the function (older than memsentry's tests reach) is taken to have none.
top_hooks: Callable[[bool], tuple[Any, Any] | None] = getattr(
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


#: Whether this torch counts the autograd nodes it makes (a saved output is packed right after
#: its own node was made, an input after the node that saves it).
_sequence_nr: Callable[[], int] | None = getattr(torch._C._autograd, "_get_sequence_nr", None)


def output_node(tensor: torch.Tensor) -> tuple[str, int] | None:
    """For a tensor being packed that is the output of the node saving it: that node's name
    and the output's number; ``None`` for an input or a leaf."""
    node = tensor.grad_fn
    if node is None or _sequence_nr is None or node._sequence_nr() != _sequence_nr() - 1:
        return None
    return node.name(), tensor.output_nr


def _check_node(packed: Saved) -> tuple[str, int] | None:
    """The node torch's message names for a saved tensor changed in place: the node that saved
    an output; for an input or a leaf, its grad_fn now (numbered 0, as torch numbers it)."""
    if packed.node is not None:
        return packed.node
    node = packed.tensor.grad_fn
    return (node.name(), 0) if node is not None else None


def unpack(packed: Saved | tuple[torch.Tensor, int]) -> torch.Tensor:
    """Return the saved tensor, repeating autograd's in-place check (skipped under hooks), with
    torch's own error when it fails."""
    if isinstance(packed, Saved):
        tensor, version = packed.tensor, packed.version
    else:  # packed inside a compiled region
        tensor, version = packed
    if version != UNCHECKED and tensor._version != version:
        words = wording(top_hooks(False) is not None)
        node = _check_node(packed) if isinstance(packed, Saved) else None
        raise RuntimeError(words.message(tensor, node, version))
    return tensor


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


class SavedTensors:
    """The pack hook of one recorder, pushed around outermost calls, and what it could not
    see: calls where hooks were disabled (torch.func), calls under others' hooks (layer name
    -> what the hooks are), layers recomputed inside backward passes."""

    def __init__(self, *, sampler: Sampler, stack: list[ForwardCall], parts: Parts,
                 registry: LayerRegistry, coverage: Coverage) -> None:
        self.active = False
        self._sampler = sampler
        self._stack = stack
        self._parts = parts
        self._registry = registry
        self._coverage = coverage
        self._hooks: saved_tensors_hooks | None = None
        self.without_saved: set[str] = set()
        self.foreign: dict[str, str] = {}
        self.recomputed: set[str] = set()
        self.user_hooks: Location | None = None  # the user's hooks on single saved tensors

    def recomputing(self, module: nn.Module) -> None:
        """``module`` is called inside a backward pass: checkpointing recomputes it."""
        record = self._registry.record_of(module)
        if record is not None:
            self.recomputed.add(record.name)

    def saved_of(self, call: ForwardCall) -> int | None:
        """The bytes ``call`` saved for backward, as a layer's figure: ``None`` when they went
        to someone else's hooks, 0 under checkpointing (kept nothing)."""
        if call.hooks not in (None, CHECKPOINT):
            return None
        return call.saved_bytes

    def foreign_hooks(self, name: str) -> str | None:
        """What the saved-tensor hooks on top of the stack are, when they are not ours."""
        top = top_hooks(False)
        if top is None or top[0] == self.pack:
            return None
        label = hooks_label(top[0])
        if label == CHECKPOINT and _selective():
            label = SELECTIVE
        if name not in self.foreign:
            self.foreign[name] = label
        return label

    def push(self, name: str) -> bool:
        """Put the saved-tensor hooks on the stack for a measured call; whether it did. Never
        above hooks already there (checkpointing's, save_on_cpu's, the user's): the tensors
        saved are theirs to keep, and pushed above them memsentry would take them."""
        if self._hooks is not None:
            return False
        if torch._C._autograd._saved_tensors_hooks_get_disabled_error_message() is not None:
            self.without_saved.add(name)  # torch.func's grad/vjp: hooks would raise there
            return False
        if top_hooks(False) is not None:
            return False
        self._hooks = saved_tensors_hooks(self.pack, unpack)
        self._hooks.__enter__()
        return True

    def step_aside(self) -> None:
        """torch is about to disable saved-tensor hooks inside a measured call (a torch.func
        transform in a forward) and refuses to while any are on the stack: memsentry's come
        off for the rest of the call, which the report says."""
        if self._hooks is None:
            return
        hooks, self._hooks = self._hooks, None
        hooks.__exit__(None, None, None)
        if self._stack:
            self.without_saved.add(self._stack[-1].record.name)

    def pop(self) -> None:
        """Take the saved-tensor hooks off the stack (after the outermost call, or at stop)."""
        if self._hooks is not None:
            hooks, self._hooks = self._hooks, None
            top = top_hooks(False)
            if top is None or top[0] == self.pack:  # never another's: theirs to take off
                hooks.__exit__(None, None, None)

    def _refused_notes(self) -> list[str]:
        """What the report says where memsentry's hooks could not be on: the user's hooks on
        single saved tensors, and torch.func transforms."""
        notes = []
        if self.user_hooks is not None:
            notes.append(
                f"{self.user_hooks} sets hooks on single saved tensors (`_raw_saved_*."
                "register_hooks`), which torch allows once per tensor: memsentry put no "
                "saved-tensor hooks of its own on, so what the layers saved for backward is "
                "not measured (their `saved` column is empty); the rest is.")
        if self.without_saved:
            notes.append(
                f"{', '.join(f'`{n}`' for n in sorted(self.without_saved))} ran inside a "
                "torch.func transform (grad, vjp, jacrev), where saved-tensor hooks are not "
                "allowed: the bytes they saved for backward there are not measured (the rest "
                "of the call is).")
        return notes

    def notes(self) -> list[str]:
        """What the report says of the calls that ran under other saved-tensor hooks, and of
        the forwards recomputed inside backward passes (after the notes of calls where hooks
        were disabled)."""
        by_label: dict[str, list[str]] = {}
        for name, label in self.foreign.items():
            by_label.setdefault(label, []).append(name)
        notes = self._refused_notes()
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
        if self.recomputed:
            listed = ", ".join(f"`{n}`" for n in sorted(self.recomputed)[:8])
            if len(self.recomputed) > 8:
                listed += f" and {len(self.recomputed) - 8} more"
            notes.append(
                f"{listed} ran again inside backward passes (the recomputation of activation "
                "checkpointing): those calls are not counted as forward calls; their memory is "
                "in the backward figures of the layers around them.")
        return notes

    def pack(self, tensor: torch.Tensor) -> Saved | tuple[torch.Tensor, int]:
        if torch.compiler.is_compiling() or torch._C._get_tracing_state() is not None:
            return tensor, UNCHECKED  # traced into a compiled graph: kept as it is
        # An output as a detached alias: saving the tensor itself would make a saved output
        # reference its own grad_fn (a cycle only the garbage collector frees).
        node = output_node(tensor)
        packed = Saved(tensor.detach(), tensor._version, node) if node is not None \
            else Saved(tensor, tensor._version)
        if self.active and self._sampler.backend is not None and self._stack:
            started = self._coverage.clock()
            call = self._stack[-1]
            _count_saved(call, tensor, packed, self._parts.live if self._parts.due else None,
                         self._registry.static_storages)
            if call.measured and self._sampler.in_ops:
                self._sampler.sample_at_pack()
            self._coverage.count(started, SAVED)
        return packed
