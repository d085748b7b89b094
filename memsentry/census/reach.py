"""Reaching a holder a census named again, by its path, to read its length: a few lookups at
a boundary instead of a census.

Only what can be followed with no code of the user's running is followed: a local of a
function running on the stack, a global of a module, or the tracked model, then attributes
kept in an object's ``__dict__`` (or a module's registries), string and number keys of dicts
and indices of lists and tuples. The end must be one of Python's containers whose length is
its own (no ``__len__`` of the user's runs). Anything else is not followed: a census names
it, and its verdict rests on the censuses alone.
"""

from __future__ import annotations

import ast
import collections
import sys
import types
import weakref
from dataclasses import dataclass
from typing import Any

from torch import nn

from memsentry.model import HolderKind, Scope, ScopeKind, Step, StepKind
from memsentry.usercode.frames import one_local
from memsentry.usercode.lines import short_path

#: The containers whose length is read; a subclass counts when it keeps their ``__len__``.
CONTAINERS: tuple[type, ...] = (list, dict, set, frozenset, tuple, collections.deque)
_EXACT = frozenset(CONTAINERS)
#: The frames searched for a function's locals, from the boundary outwards.
DEPTH = 96
#: An nn.Module's registries, searched after its ``__dict__``.
_REGISTRIES = ("_modules", "_parameters", "_buffers")
#: Where a global lives: a module, or the script run as ``__main__``.
_GLOBAL_SCOPES = (ScopeKind.MODULE, ScopeKind.SCRIPT)


@dataclass(frozen=True)
class Reach:
    """How to reach a holder again: its root (``kind``, the ``scope`` it lives in, the
    ``root`` name) and the steps from there, as keys to look up."""

    kind: HolderKind
    scope: Scope | None
    root: str
    steps: tuple[tuple[StepKind, Any], ...]


def reach_of(path: tuple[Step, ...], kind: HolderKind, scope: Scope | None) -> Reach | None:
    """How to reach the holder at ``path`` again; ``None`` when it cannot be followed."""
    if not path or path[0].kind is not StepKind.ROOT or not _rooted(kind, scope):
        return None
    steps = []
    for step in path[1:]:
        key = _key(step)
        if key is None:
            return None
        steps.append((step.kind, key))
    return Reach(kind, scope, path[0].name, tuple(steps))


def _rooted(kind: HolderKind, scope: Scope | None) -> bool:
    """Whether a root of ``kind`` living in ``scope`` can be found again."""
    if kind is HolderKind.MODEL:
        return True
    if kind is HolderKind.LOCAL:
        return scope is not None and scope.kind is ScopeKind.FUNCTION
    if kind is HolderKind.GLOBAL:
        return scope is not None and scope.kind in _GLOBAL_SCOPES
    return False


def _key(step: Step) -> Any:
    """What ``step`` looks up, or ``None`` when it cannot be followed."""
    if step.kind is StepKind.ATTRIBUTE:
        return step.name
    if step.kind is StepKind.INDEX:
        return int(step.name) if step.name.lstrip("-").isdigit() else None
    if step.kind is StepKind.KEY:
        return _literal(step.name)
    return None


def _literal(spelled: str) -> str | int | None:
    """A dict key from its ``repr``: a string or an integer."""
    try:
        value = ast.literal_eval(spelled)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    return value if type(value) in (str, int) else None


class Follower:
    """Reads the length of the container ``reach`` leads to, again and again: the function's
    code object (for a local) or the module (for a global) is remembered once found, so a
    reading is a few lookups. The tracked ``model`` and the module are held weakly."""

    def __init__(self, reach: Reach, model: nn.Module | None) -> None:
        self.reach = reach
        self._model = weakref.ref(model) if model is not None \
            and reach.kind is HolderKind.MODEL else None
        self._code: types.CodeType | None = None
        self._module: weakref.ref[types.ModuleType] | None = None
        self._hops: dict[types.CodeType, int] = {}  # by the boundary's code: the depth
        roots = {HolderKind.MODEL: self._model_root, HolderKind.GLOBAL: self._global}
        self._root = roots.get(reach.kind, self._local)

    def length(self, frame: types.FrameType | None) -> int | None:
        """The container's length, from ``frame`` (the boundary's); ``None`` when it is not
        there or not a container."""
        found, obj = self._root(frame)
        for kind, key in self.reach.steps:
            if not found:
                return None
            found, obj = _step(obj, kind, key)
        if not found or not _container(obj):
            return None
        return len(obj)

    def _model_root(self, frame: types.FrameType | None) -> tuple[bool, Any]:
        model = self._model() if self._model is not None else None
        return model is not None, model

    def _global(self, frame: types.FrameType | None) -> tuple[bool, Any]:
        return _lookup(self._namespace(), self.reach.root)

    def _namespace(self) -> dict[str, Any] | None:
        module = self._module() if self._module is not None else None
        if module is None:
            assert self.reach.scope is not None
            module = _module(self.reach.scope)
            if module is None:
                return None
            self._module = weakref.ref(module)
        namespace = getattr(module, "__dict__", None)
        return namespace if isinstance(namespace, dict) else None

    def _local(self, frame: types.FrameType | None) -> tuple[bool, Any]:
        """The root local of the innermost running frame of the scope's function. Where the
        boundary's ``frame`` was met before, the function's frame is asked for by its depth
        from here (Python makes a frame object for each frame a walk passes: microseconds
        at every boundary)."""
        if frame is None:
            return False, None
        key = frame.f_code
        hops = self._hops.get(key)
        if hops is not None:
            try:
                target = sys._getframe(hops)
            except ValueError:  # the stack is shallower than it was
                target = None
            if target is not None and target.f_code is self._code:
                return one_local(target, self.reach.root)
        return self._walk(key)

    def _walk(self, key: types.CodeType) -> tuple[bool, Any]:
        """The walk up the stack from here: the depth found is kept for ``key``."""
        scope = self.reach.scope
        assert scope is not None
        frame: types.FrameType | None = sys._getframe(1)  # _local's: its depth 0
        for hops in range(DEPTH):
            if frame is None:
                break
            code = frame.f_code
            if code is self._code or (self._code is None and _runs(code, scope)):
                self._code, self._hops[key] = code, hops
                return one_local(frame, self.reach.root)
            frame = frame.f_back
        return False, None


def _runs(code: types.CodeType, scope: Scope) -> bool:
    return code.co_name == scope.name and short_path(code.co_filename) == scope.file


def _container(obj: Any) -> bool:
    cls = type(obj)
    return cls in _EXACT or any(
        issubclass(cls, base) and getattr(cls, "__len__", None) is vars(base)["__len__"]
        for base in CONTAINERS)


def _module(scope: Scope) -> types.ModuleType | None:
    """The module ``scope`` names, or ``__main__`` run from its file."""
    if scope.kind is ScopeKind.MODULE:
        module = sys.modules.get(scope.name)
    else:
        module = sys.modules.get("__main__")
        path = getattr(module, "__file__", None)
        if not isinstance(path, str) or short_path(path) != scope.name:
            return None
    return module if isinstance(module, types.ModuleType) else None


def _step(obj: Any, kind: StepKind, key: Any) -> tuple[bool, Any]:
    if kind is StepKind.ATTRIBUTE:
        return _attribute(obj, key)
    if kind is StepKind.KEY and isinstance(obj, dict):
        return _lookup(obj, key)
    if kind is StepKind.INDEX and isinstance(obj, list | tuple) and -len(obj) <= key < len(obj):
        return True, obj[key]
    return False, None


def _attribute(obj: Any, name: str) -> tuple[bool, Any]:
    """An attribute kept in ``obj``'s ``__dict__``, or a module's registries: no property or
    ``__getattr__`` of the user's runs."""
    found, value = _lookup(getattr(obj, "__dict__", None), name)
    if found or not isinstance(obj, nn.Module):
        return found, value
    for registry in _REGISTRIES:
        found, value = _lookup(obj.__dict__.get(registry), name)
        if found:
            return found, value
    return False, None


def _lookup(mapping: Any, key: Any) -> tuple[bool, Any]:
    """``mapping[key]`` for a plain dict (a key of a type whose hash is Python's own)."""
    if not isinstance(mapping, dict):
        return False, None
    try:
        return dict.__contains__(mapping, key), dict.get(mapping, key)
    except Exception:  # a key of the user's type whose __eq__ fails
        return False, None
