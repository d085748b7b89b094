"""Which module hooks are on: memsentry's forward hooks on the tracked model's modules (or
PyTorch's global module hooks without a model), moved as the budget and the window of measured
layers move.

A module with no hook costs the loop nothing, so the hooks follow what is measured:

- in a sampled iteration, the layers in the coverage window (:mod:`memsentry.record.coverage`)
  and the modules called outermost (the *anchors*: their calls mark iterations) are hooked;
- in a light iteration, only the anchors; in a *lean* one (its end comes from the next call of
  the first outermost module), only that module, whose calls end the iterations (a model
  entered through ``.forward()`` has all its layers as anchors; without a model, the global
  hooks come off and that module alone is hooked);
- in a *bare* light iteration (the loop's iterations end at optimizer steps or ``t.step()``,
  and no census waits for the next iteration's first call), nothing: the boundaries alone
  keep the count;
- while a lean stretch passes boundaries with a count only, nothing either: a counter in
  place of the lean module's hooks counts its calls (:mod:`memsentry.record.counted`).

Hooks are only ever moved at an iteration boundary with no forward running, so no hook is
taken away from a call between its pre and its post hook.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.utils.hooks import RemovableHandle

from memsentry.record.counted import CallCounter
from memsentry.record.coverage import Coverage
from memsentry.record.invisible import disown, own
from memsentry.record.layers import LayerRegistry, fully_sharded

Pre = Callable[[nn.Module, Any], None]
Post = Callable[[nn.Module, Any, Any], None]


class ModuleHooks:
    """The forward hooks of one recorder: ``pre`` and ``post`` on each hooked module (or as
    global hooks), ``scripted_pre`` and ``scripted_post`` as global hooks that let only the
    calls of the model's TorchScript modules through (they take no module hooks)."""

    def __init__(self, coverage: Coverage, registry: LayerRegistry, pre: Pre, post: Post,
                 scripted_pre: Pre, scripted_post: Post) -> None:
        self._coverage = coverage
        self._registry = registry
        self._pre, self._post = pre, post
        self._scripted_hooks = (scripted_pre, scripted_post)
        self.anchors: set[int] = set()  # layers called outermost: hooked unless bare
        self.scripted: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._modules: dict[int, tuple[RemovableHandle, RemovableHandle]] = {}
        self._unhooked: set[int] = set()  # layers of the model whose hooks were taken off
        self._window: set[int] | None = None  # the window the hooks follow (None: all)
        self._global: list[RemovableHandle] = []  # without a model: the global hooks
        self._fixed: list[RemovableHandle] = []  # the TorchScript modules' global hooks
        self._model = False
        self.bare = False
        self._lean: weakref.ref[nn.Module] | None = None  # the one module hooked when lean
        self._lean_handles: tuple[RemovableHandle, RemovableHandle] | None = None
        self.counter = CallCounter()  # counts the lean module's calls in place of its hooks

    # -- putting on and taking off -------------------------------------------------------
    def hook_model(self, model: nn.Module) -> None:
        """Hooks on every module of ``model``; its TorchScript modules get global hooks that
        let only their calls through."""
        self._model = True
        for module in model.modules():
            if isinstance(module, torch.jit.ScriptModule):
                self.scripted.add(module)
                continue
            self._hook(module)
        if len(self.scripted):
            pre, post = self._scripted_hooks
            self._fixed = [register_module_forward_pre_hook(pre),
                           register_module_forward_hook(post, always_call=True)]

    def hook_global(self) -> None:
        """Without a model: every module call of the process goes through the hooks."""
        if not self._global:
            self._global = [register_module_forward_pre_hook(self._pre),
                            register_module_forward_hook(self._post, always_call=True)]

    def _hook(self, module: nn.Module) -> None:
        self._modules[id(module)] = self._handles(module)

    def _handles(self, module: nn.Module) -> tuple[RemovableHandle, RemovableHandle]:
        """Hook one module: before FSDP2's pre-hook, as global hooks are (the all-gather is
        the unit's memory)."""
        return (own(module.register_forward_pre_hook(self._pre, prepend=fully_sharded(module))),
                own(module.register_forward_hook(self._post, always_call=True)))

    def _unhook(self, module: nn.Module, index: int) -> None:
        pre, post = self._modules.pop(id(module))
        disown(pre)
        disown(post)
        self._unhooked.add(index)
        record = self._registry.record_of(module)
        if record is not None:  # its calls from here on go uncounted
            record.uncounted = True

    def handles(self) -> list[RemovableHandle]:
        """memsentry's forward hooks on now (a census leaves them out of the user's)."""
        return [*(h for pair in self._modules.values() for h in pair), *self._global,
                *self._fixed, *(self._lean_handles or ())]

    def remove_all(self) -> None:
        self.counter.take_off()
        for handle in self.handles():
            disown(handle)
        self._modules.clear()
        self._global, self._fixed, self._lean_handles = [], [], None

    # -- counting in place of the lean hooks ------------------------------------------------
    def count_calls(self, module: nn.Module, calls: int, ident: int,
                    due: Callable[[], None]) -> bool:
        """As the lean ``module``'s call ends: its hooks come off and the counter counts its
        next ``calls`` calls from thread ``ident``, then calls ``due()``. False (the hooks
        stay) where ``module`` is not the lean one or cannot take the counter."""
        lean = self._lean() if self._lean is not None else None
        if self.bare or lean is not module:
            return False
        if not self.counter.put_on(module, calls, ident, due):
            return False
        self._follow_anchors()
        return True

    def stop_counting(self) -> int:
        """The counter comes off and the lean module's hooks go back on; the calls it
        counted (0 when it was off)."""
        if not self.counter.on:
            return 0
        calls = self.counter.take_off()
        self._follow_anchors()
        return calls

    # -- following the budget ------------------------------------------------------------
    def follow(self, *, bare: bool, lean: nn.Module | None = None) -> None:
        """At a boundary with no forward running: the hooks follow the window of measured
        layers; ``bare`` takes the anchors' (or the global) hooks off too, until the next
        iteration that is not bare; ``lean`` leaves that one module's alone. Only the modules
        whose side changed are visited."""
        self._follow_kind(bare, lean)
        window = self._coverage.window()
        if window is None and self._window is None:
            return
        changed = changed_layers(window, self._window, self._unhooked, self._coverage.layers,
                                 self.anchors)
        self._window = window
        self._move(changed, window)

    def _follow_kind(self, bare: bool, lean: nn.Module | None) -> None:
        """The anchors' hooks follow the iteration's kind, where it changed: bare, lean (on
        ``lean`` alone) or neither."""
        leaned = self._lean() if self._lean is not None else None
        if bare != self.bare or lean is not leaned:
            self.bare = bare
            self._lean = weakref.ref(lean) if lean is not None and not bare else None
            self._follow_anchors()

    def _move(self, changed: set[int], window: set[int] | None) -> None:
        """The hooks of the ``changed`` layers that still live go on where they are in the
        ``window`` (``None``: every layer), off where not."""
        modules = self._registry.by_index() if changed else {}
        for index in changed:
            module = modules.get(index)
            if module is not None:
                self._put(module, index, window is None or index in window)

    def _put(self, module: nn.Module, index: int, wanted: bool) -> None:
        """Layer ``index``'s hooks on where ``wanted`` (put back where they were taken off: a
        module never hooked, a TorchScript one, stays so), else off."""
        if not wanted:
            if id(module) in self._modules:
                self._unhook(module, index)
        elif id(module) not in self._modules and index in self._unhooked:
            self._unhooked.discard(index)
            self._hook(module)

    def _follow_anchors(self) -> None:
        """The anchors' hooks on, but where bare or counted, or where lean for all but the
        lean one."""
        lean = self._lean() if self._lean is not None else None
        off = self.bare or self.counter.on
        if not self._model:
            self._follow_global(lean, off)
            return
        modules = self._registry.by_index()
        for index in self.anchors:
            module = modules.get(index)
            if module is not None:
                self._put(module, index, not off and (lean is None or module is lean))

    def _follow_global(self, lean: nn.Module | None, off: bool) -> None:
        """Without a model: the global hooks, or when lean that one module's; none when
        ``off``."""
        if self._lean_handles is not None and (off or lean is None):
            for handle in self._lean_handles:
                disown(handle)
            self._lean_handles = None
        if not off and lean is None:
            self.hook_global()
            return
        self._unhook_global()
        if lean is not None and not off and self._lean_handles is None:
            self._lean_handles = self._handles(lean)

    def _unhook_global(self) -> None:
        """The global hooks come off: every module's calls from here on go uncounted (but
        the lean one's, which keeps its own hooks)."""
        if not self._global:
            return
        self._registry.unhooked = True
        for record in self._registry.records.values():
            record.uncounted = True
        for handle in self._global:
            handle.remove()
        self._global = []


def changed_layers(window: set[int] | None, before: set[int] | None, unhooked: set[int],
                   layers: int, anchors: set[int]) -> set[int]:
    """The layers whose hooks change side as the window of measured layers moves from
    ``before`` to ``window`` (``None``: every layer; ``layers`` are known): from all to some,
    every layer may go; from some to all, those ``unhooked`` come back. The anchors follow
    the iteration's kind instead (:meth:`ModuleHooks._follow_anchors`)."""
    if window is None:
        changed = set(unhooked)
    elif before is None:
        changed = set(range(layers))
    else:
        changed = window ^ before
    return changed - anchors
