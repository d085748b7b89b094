"""Where torch reads memsentry's hooks on behalf of the user's code, memsentry takes them out of
what it reads, so that the user's code sees what it would see without memsentry.

- **Copies and pickles.** ``copy.deepcopy(model)`` (an EMA teacher, ``AveragedModel``, the best
  model so far), ``pickle`` and ``torch.save(model)`` reduce each module with
  ``__reduce_ex__``, whose state holds the module's hook dictionaries. memsentry's forward
  hooks there are bound methods of its recorder: a copy would try to copy the recorder, and a
  pickle would name memsentry, so that the file could not be loaded without it. While any
  module hook of memsentry's is on, ``nn.Module.__reduce_ex__`` gives the state it would give
  without them: the same reduction, with memsentry's entries left out of the hook
  dictionaries (torch/nn/modules/module.py: ``__getstate__`` is a copy of ``__dict__``, where
  ``_forward_pre_hooks``, ``_forward_hooks`` and ``_forward_hooks_always_called`` are keyed by
  the hook handle's id).
- **TorchScript.** ``torch.jit.script`` and ``torch.jit.trace`` compile every forward hook of
  every module (torch/jit/_recursive.py: ``get_hook_stubs`` and ``infer_concrete_type_builder``
  read ``_forward_hooks`` and ``_forward_pre_hooks``). Inside
  ``torch.jit._recursive.create_script_module``, the entry of both, memsentry's hooks are out
  of the dictionaries, and back in their places once it returns.
- **torch.func inside a forward.** ``torch.func.grad``, ``vjp``, ``jacrev`` and ``hessian``
  disable saved-tensor hooks on entry and refuse to when any are on the stack
  (torch/_functorch/vmap.py: ``doesnt_support_saved_tensors_hooks``; torch/autograd/graph.py:
  ``disable_saved_tensors_hooks`` calls ``torch._C._autograd._saved_tensors_hooks_disable``).
  When memsentry's pack hook is the one on top, it steps aside for the rest of the call (and
  the report says so) before torch disables the hooks.

Each is put in place by the first recorder that starts and taken out by the last that stops;
what was there before is put back as it was.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from memsentry.record.saved import SavedTensors, top_hooks

#: The hook dictionaries of a module (torch/nn/modules/module.py), keyed by handle id.
HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_forward_hooks_always_called",
              "_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs")

_ours: set[int] = set()  # the handle ids of memsentry's module hooks on now
_lock = threading.Lock()
_users = 0
_before: dict[str, Any] = {}  # what each replaced attribute was before (absent: inherited)
_ABSENT = object()


def own(handle: RemovableHandle) -> RemovableHandle:
    """``handle`` is one of memsentry's module hooks: left out of copies and scripts."""
    _ours.add(handle.id)
    return handle


def disown(handle: RemovableHandle) -> None:
    """Take off one of memsentry's hooks."""
    _ours.discard(handle.id)
    handle.remove()


# -- copies and pickles ----------------------------------------------------------------------
def without_ours(state: dict[str, Any]) -> dict[str, Any]:
    """A module's state as it would be without memsentry's hooks: ``state`` itself when it
    holds none of them, else a new dictionary (the module's own is never touched)."""
    ours = _ours
    if not ours:
        return state
    changed = {}
    for name in HOOK_DICTS:
        hooks = state.get(name)
        if isinstance(hooks, dict) and any(key in ours for key in hooks):
            changed[name] = type(hooks)((k, v) for k, v in hooks.items() if k not in ours)
    return {**state, **changed} if changed else state


def _reduce_ex(self: nn.Module, protocol: int) -> Any:
    before = _before.get("__reduce_ex__", _ABSENT)
    reduce = object.__reduce_ex__ if before is _ABSENT else before
    reduced = reduce(self, protocol)
    if not _ours or not isinstance(reduced, tuple) or len(reduced) < 3 \
            or not isinstance(reduced[2], dict):
        return reduced
    state = without_ours(reduced[2])
    return reduced if state is reduced[2] else (*reduced[:2], state, *reduced[3:])


# -- TorchScript ------------------------------------------------------------------------------
@contextmanager
def hooks_hidden(root: nn.Module) -> Iterator[None]:
    """memsentry's hooks out of the dictionaries of every module under ``root``, then back in
    the order they were."""
    modules = root.modules() if isinstance(root, nn.Module) and _ours else ()
    hidden = [taken for module in modules for taken in _take_ours(module)]
    try:
        yield
    finally:
        for hooks, order, taken in hidden:
            _put_back(hooks, order, taken)


def _take_ours(module: nn.Module) -> list[tuple[dict[Any, Any], list[Any], dict[Any, Any]]]:
    """memsentry's hooks taken out of ``module``'s dictionaries: each dictionary, the order of
    its keys before, and what was taken."""
    taken = []
    for name in HOOK_DICTS:
        hooks = module.__dict__.get(name)
        if isinstance(hooks, dict) and any(key in _ours for key in hooks):
            order = list(hooks)
            taken.append((hooks, order, {key: hooks.pop(key) for key in order if key in _ours}))
    return taken


def _put_back(hooks: dict[Any, Any], order: list[Any], taken: dict[Any, Any]) -> None:
    """Put ``taken`` back into ``hooks`` where ``order`` had it (hooks added meanwhile last)."""
    merged = {**hooks, **taken}
    hooks.clear()
    for key in order:
        if key in merged:
            hooks[key] = merged.pop(key)
    hooks.update(merged)


def _script(nn_module: Any, *args: Any, **kwargs: Any) -> Any:
    with hooks_hidden(nn_module):
        return _before["create_script_module"](nn_module, *args, **kwargs)


# -- torch.func ---------------------------------------------------------------------------------
def _disable(message: str, *args: Any, **kwargs: Any) -> Any:
    """torch disables saved-tensor hooks; by default it fails when any are on the stack, so
    memsentry's step aside first (the compiled regions' call, which does not fail, is let be)."""
    fails = bool(args[0]) if args else bool(kwargs.get("fail_if_non_empty", True))
    if fails:
        top = top_hooks(False)
        owner = getattr(top[0], "__self__", None) if top is not None else None
        if isinstance(owner, SavedTensors):
            owner.step_aside()
    return _before["_saved_tensors_hooks_disable"](message, *args, **kwargs)


# -- putting in place ---------------------------------------------------------------------------
def _targets() -> list[tuple[Any, str, Callable[..., Any]]]:
    targets: list[tuple[Any, str, Callable[..., Any]]] = [(nn.Module, "__reduce_ex__", _reduce_ex)]
    recursive = getattr(torch.jit, "_recursive", None)
    if recursive is not None and hasattr(recursive, "create_script_module"):
        targets.append((recursive, "create_script_module", _script))
    if hasattr(torch._C._autograd, "_saved_tensors_hooks_disable"):
        targets.append((torch._C._autograd, "_saved_tensors_hooks_disable", _disable))
    return targets


def install() -> None:
    """Put the replacements in place (the first recorder to start)."""
    global _users
    with _lock:
        _users += 1
        if _users > 1:
            return
        for owner, name, replacement in _targets():
            _before[name] = owner.__dict__.get(name, _ABSENT) if isinstance(owner, type) \
                else getattr(owner, name)
            setattr(owner, name, replacement)


def uninstall() -> None:
    """Put back what was there (the last recorder to stop)."""
    global _users
    with _lock:
        _users -= 1
        if _users > 0:
            return
        _users = 0
        for owner, name, replacement in _targets():
            if getattr(owner, name, None) is not replacement:
                continue  # replaced again since: not ours to undo
            before = _before.pop(name, _ABSENT)
            if before is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, before)
