"""Counting a module's calls with no hook on it, for a light stretch of a loop whose iterations
end at its model's next call (evaluation, serving, acting: no optimizer).

Any forward hook sends a module's calls down the long path of ``Module._call_impl`` (the hook
lists, the backward-hook checks): on a small model under ``no_grad`` that path and the hook's
own Python cost 10% to 20% of the forward, far past a 1% budget, when all memsentry needs
between two boundaries it reads is how many calls there were. So for those stretches the
module's hooks come off and a counter takes their place, where PyTorch leaves room for one:

- ``Module._wrapped_call_impl`` (torch/nn/modules/module.py) calls the instance's
  ``_compiled_call_impl`` when one is set (``Module.compile()`` sets it) and ``_call_impl``
  otherwise; the counter is a function there that counts and calls ``_call_impl``, so the
  call takes the short path it takes untracked (no hook: ``forward`` at once).
- ``Module.__getstate__`` drops ``_compiled_call_impl``, so a deep copy, a pickle or
  ``torch.save`` of the model never carries the counter; ``torch.jit.script`` leaves a
  function attribute it cannot compile unused.
- A module already compiled (its own ``_compiled_call_impl``), or a TorchScript one, is not
  counted this way: it keeps its hook.

Calls made while Dynamo traces, under ``torch.jit.trace``, inside a backward pass, or from
another thread are not the loop's and are not counted, as the hooks leave them out. A module
that ever ran as a compiled graph keeps its hook: Dynamo guards on the function it finds there,
and putting the counter on and off would make it compile again.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memsentry.record.calls import graph_task

# Read once: the counter runs at every call of the model. Dynamo folds
# ``is_dynamo_compiling()`` to True where it traces, so it never traces past the first test.
_dynamo_compiling = torch.compiler.is_dynamo_compiling
_tracing = torch._C._get_tracing_state
_get_ident = threading.get_ident
ATTRIBUTE = "_compiled_call_impl"


class CallCounter:
    """Counts the calls of one module at a time in place of its hooks; calls ``due()`` as
    the call that makes ``calls`` ends (the counter is then off)."""

    def __init__(self) -> None:
        self.counted = 0
        self.on = False  # read at every boundary: an attribute, not a property
        self._module: weakref.ref[nn.Module] | None = None
        self._counter_id = 0  # the id of the function set on the module (never kept alive)

    @property
    def module(self) -> nn.Module | None:
        """The module counted now, while it lives."""
        return self._module() if self._module is not None else None

    def put_on(self, module: nn.Module, calls: int, ident: int,
               due: Callable[[], None]) -> bool:
        """Count ``module``'s calls from thread ``ident``; after the ``calls``-th, ``due()``
        is called. False (nothing done) where the module cannot take the counter."""
        if calls < 1 or self.on or not countable(module):
            return False
        impl = module._call_impl  # a bound method: the module and its counter hold each other
        state = self

        def counted(*args: Any, **kwargs: Any) -> Any:
            if _dynamo_compiling() or _get_ident() != ident or _tracing() is not None \
                    or graph_task() != -1:
                return impl(*args, **kwargs)
            state.counted += 1
            if state.counted < calls:
                return impl(*args, **kwargs)
            try:
                return impl(*args, **kwargs)
            finally:
                _safely(due)

        self.counted = 0
        setattr(module, ATTRIBUTE, counted)
        self._module = weakref.ref(module)
        self._counter_id = id(counted)
        self.on = True
        return True

    def take_off(self) -> int:
        """The counter comes off the module (where it is still there); the calls it
        counted."""
        module = self._module() if self._module is not None else None
        self._module = None
        self.on = False
        if module is not None and id(module.__dict__.get(ATTRIBUTE)) == self._counter_id:
            del module.__dict__[ATTRIBUTE]
        counted, self.counted = self.counted, 0
        return counted


def _safely(due: Callable[[], None]) -> None:
    """Call ``due`` as a call ends, even as its error propagates: whatever it meets stays
    memsentry's, never becomes the user's exception (the counter is off either way)."""
    try:
        due()
    except Exception:  # pragma: no cover - memsentry's own failure; the loop goes on
        pass


def countable(module: nn.Module) -> bool:
    """Whether the counter can stand in for ``module``'s hooks: a Python module called
    through ``Module.__call__`` (not ``torch.compile``'s wrapper, which has its own), not
    compiled with ``Module.compile()``, not TorchScript."""
    if isinstance(module, torch.jit.ScriptModule):
        return False
    if type(module).__call__ is not nn.Module.__call__:
        return False
    return getattr(module, ATTRIBUTE, None) is None
