"""A model entered through one of its own methods: ``def act(self, obs): return
self.forward(obs).argmax()`` calls its layers with no module call running, so each layer's
call looks outermost. The user's frames on the stack say whose method called them: the module
that is ``self`` there and holds the layer among its submodules is the one the code called,
and the line outside that module's methods is where the code called it."""

from __future__ import annotations

import types
import weakref

from torch import nn

from memsentry.model import Location
from memsentry.usercode.frames import is_machinery_frame, release_locals
from memsentry.usercode.lines import short_path

#: Whether a module holds another among its submodules, remembered (a model's ``modules()``
#: is walked once per layer called this way, not at every call).
_HOLDS: weakref.WeakKeyDictionary[nn.Module, weakref.WeakKeyDictionary[nn.Module, bool]] = (
    weakref.WeakKeyDictionary())


def _holds(owner: nn.Module, module: nn.Module) -> bool:
    known = _HOLDS.setdefault(owner, weakref.WeakKeyDictionary())
    held = known.get(module)
    if held is None:
        held = known[module] = any(m is module for m in owner.modules())
    return held


def _self_of(frame: types.FrameType) -> object:
    """The ``self`` of a method's frame (its first argument, when so named), else ``None``."""
    code = frame.f_code
    if not code.co_argcount or code.co_varnames[0] != "self":
        return None
    try:
        return frame.f_locals.get("self")
    finally:
        release_locals(frame)


def entered_through(module: nn.Module, frame: types.FrameType | None
                    ) -> tuple[nn.Module | None, Location | None]:
    """For a call of ``module`` with no module call running, from ``frame`` down: the
    outermost module whose own methods called it (``None`` when the user's code called it
    directly), and the line of the user's code that called in (outside that module's
    methods; the innermost user line when every user frame is one of them)."""
    owner: nn.Module | None = None
    first: Location | None = None
    while frame is not None:
        if is_machinery_frame(frame):
            frame = frame.f_back
            continue
        code = frame.f_code
        site = Location(short_path(code.co_filename), frame.f_lineno or 0, code.co_name)
        if first is None:
            first = site
        this = _self_of(frame)
        if isinstance(this, nn.Module) and (this is owner or _holds(this, module)):
            owner = this
            frame = frame.f_back
            continue
        return owner, site
    return owner, first


__all__ = ["entered_through"]
