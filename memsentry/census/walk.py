"""The object walk of a census: breadth first from named roots, so each tensor is named by its
shortest path; every storage counted once; within a time budget.

A path is typed (:class:`~memsentry.model.Step`): attributes and string keys extend a holder's
path; list indices, set members, non-string keys and a traceback's frame locals belong to the
holder above them (its items, counted together).
"""

from __future__ import annotations

import collections
import sys
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from memsentry.census.children import (
    CACHES,
    CALLABLES,
    CONTAINERS,
    SUSPENDED,
    Child,
    array_memory,
    atomic,
    cache_size,
    cached,
    captured,
    children,
    only_atoms,
    suspended_locals,
    walks_into,
)
from memsentry.census.ledger import StorageLedger
from memsentry.measure.storage import storage_of
from memsentry.model import HeldTensor, HolderKind, Scope, ScopeKind, Step, StepKind
from memsentry.usercode.frames import is_user_class, root_package, source_file

#: Objects never walked into: code, functions, classes, optimizers, autograd nodes.
OPAQUE = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
          types.FrameType, types.CodeType, types.GeneratorType, types.CoroutineType,
          type, property, staticmethod, classmethod,
          torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler,
          torch.autograd.graph.Node)
#: Packages whose objects are never walked into: memsentry's own, and the test runner's (a
#: test's ``request`` or ``capsys`` reaches the whole session, every collected test; the
#: test's own values are met through its locals first).
_NOT_WALKED = frozenset({"memsentry", "pytest_memsentry", "_pytest", "pluggy", "xdist",
                         "execnet"})
_MAX_DEPTH = 12
#: Containers longer than this are walked after everything else.
LARGE = 4096
_CHECK_EVERY = 256


class SourceHint(NamedTuple):
    """Where to look for the line that fills a holder: the ``name`` it is spelled by, the
    ``files`` to search, the first line of the function to search in (``None``: the whole
    file) and a line to fall back on. (A tuple: one is made per attribute walked.)"""

    name: str
    files: tuple[str, ...] = ()
    function_line: int | None = None
    fallback_line: int | None = None


@dataclass(eq=False)
class Holder:
    """A holder's running counts during one walk."""

    path: tuple[Step, ...]
    kind: HolderKind
    scope: Scope | None
    hint: SourceHint
    items: int | None = None
    bound: int | None = None
    tensors: int = 0
    bytes: int = 0
    modules: int = 0
    graph_tensors: int = 0
    shared_bytes: int = 0
    arrays: int = 0
    nodes: int = 0
    container: str | None = None
    roots: list[Any] = field(default_factory=list)


class _Item:
    """One object waiting in the walk's queue, with the holder it belongs to."""

    __slots__ = ("depth", "frozen", "hint", "kind", "obj", "path", "scope")

    def __init__(self, obj: Any, path: tuple[Step, ...], kind: HolderKind, scope: Scope | None,
                 hint: SourceHint, depth: int, frozen: bool) -> None:
        self.obj, self.path, self.kind, self.scope = obj, path, kind, scope
        self.hint, self.depth, self.frozen = hint, depth, frozen


class Budget:
    """Seconds a walk may take, checked every few hundred steps."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.perf_counter() + seconds
        self.ticks = 0
        self.exhausted = False

    def spent(self) -> bool:
        self.ticks += 1
        if self.ticks % _CHECK_EVERY == 0 and time.perf_counter() > self.deadline:
            self.exhausted = True
        return self.exhausted



def storage_key(tensor: torch.Tensor) -> tuple[tuple[str, int], int] | None:
    """((device, storage pointer), storage bytes), or ``None`` for storage-less tensors (a
    DTensor: its local shard's; a storage FSDP resized to 0 bytes: ((device, 0), 0))."""
    found = storage_of(tensor)
    return None if found is None else ((str(tensor.device), found[0]), found[1])


_STEPS: dict[tuple[StepKind, str], Step] = {}
_MAX_CACHED_STEPS = 50_000


def make_step(kind: StepKind, raw: Any) -> Step:
    """The typed step of a child (attribute steps, the most frequent, are cached)."""
    if kind == StepKind.FRAME_LOCAL:
        function, name = raw
        return Step(kind, name, function)
    name = raw if kind == StepKind.ATTRIBUTE else repr(raw) if kind == StepKind.KEY \
        else "" if kind in (StepKind.MEMBER, StepKind.CACHED) else str(raw)
    step = _STEPS.get((kind, name))
    if step is None:
        if len(_STEPS) >= _MAX_CACHED_STEPS:
            _STEPS.clear()
        step = _STEPS[kind, name] = Step(kind, name)
    return step



class Walk:
    """One census walk over everything reachable from the roots added to it.

    With ``targets`` (storage pointers) it looks for those storages only and records each as a
    :class:`HeldTensor` with its full path; without, it counts tensors per holder.
    """

    def __init__(self, budget: Budget, static: set[int], skip: set[int],
                 targets: set[int] | None = None, live_frames: set[int] | None = None) -> None:
        self.budget = budget
        self.targets = targets
        self.found: list[HeldTensor] = []
        self.ledger = StorageLedger(static)
        self.seen: set[int] = set(skip)
        self.root_order: dict[tuple[Step, ...], int] = {}  # roots in the order they were added
        self.classes: set[type] = set()
        self.holders: dict[tuple[Step, ...], Holder] = {}
        #: Each container holder's length, bound and kind (``list``, ``deque``, ``lru_cache``).
        self.items: dict[tuple[Step, ...], tuple[int, int | None, str]] = {}
        self.queue: collections.deque[_Item] = collections.deque()
        self.large: collections.deque[tuple[_Item, Any, type]] = collections.deque()
        self.visited = 0
        self.live_frames = live_frames or set()

    def add_root(self, obj: Any, path: tuple[Step, ...], kind: HolderKind,
                 scope: Scope | None, hint: SourceHint) -> None:
        if id(obj) in self.seen or atomic(obj):
            return
        self.root_order.setdefault(path, len(self.root_order))
        self.queue.append(_Item(obj, path, kind, scope, hint, 0, False))

    def add_class(self, cls: type) -> None:
        """The attributes of ``cls`` and its user-defined bases, as roots."""
        for klass in cls.__mro__:
            if klass in self.classes or klass is object:
                continue
            self.classes.add(klass)
            if not is_user_class(klass):
                continue
            source = source_file(klass)
            scope = Scope(ScopeKind.CLASS, klass.__qualname__)
            for name, value in list(vars(klass).items()):
                if name.startswith("__") or atomic(value) or isinstance(value, OPAQUE):
                    continue
                path = (Step(StepKind.ROOT, klass.__qualname__), Step(StepKind.ATTRIBUTE, name))
                self.add_root(value, path, HolderKind.CLASS_ATTRIBUTE, scope,
                              SourceHint(name, (source,) if source else ()))

    def count_bytes(self, tensor: torch.Tensor, *, parameters: bool = False,
                    holder: Holder | None = None) -> int:
        """The storage's bytes the first time it is met (see :class:`StorageLedger`)."""
        key = storage_key(tensor)
        if key is None:
            return 0
        return self.ledger.count(key[0], key[1], holder, parameters=parameters)

    def run(self) -> None:
        """Visit what is queued, breadth first; the children of large containers come after
        everything else, so that one container of millions of items cannot use up the
        budget before the rest was seen."""
        while not self.budget.spent():
            if not self.queue:
                if not self.large:
                    return
                item, obj, cls = self.large.popleft()
                self._enqueue_children(item, obj, cls)
                continue
            item = self.queue.popleft()
            obj = item.obj
            if id(obj) in self.seen:
                continue
            self.seen.add(id(obj))
            self.visited += 1
            try:
                self._visit(item, obj)
            except Exception:  # a proxy to a dead object, a property that raises: skip it
                continue

    def _holder(self, item: _Item) -> Holder:
        holder = self.holders.get(item.path)
        if holder is None:
            items, bound, container = self.items.get(item.path, (None, None, None))
            holder = self.holders[item.path] = Holder(
                item.path, item.kind, item.scope, item.hint, items, bound, container=container
            )
        return holder

    def declared(self, holder: Holder) -> int:
        """The position of the holder's root among the roots (a variable's place in its
        frame or module: state set up before a loop comes before the loop's own locals)."""
        for length in (1, 2):
            order = self.root_order.get(holder.path[:length])
            if order is not None:
                return order
        return len(self.root_order)

    def _visit_tensor(self, item: _Item, tensor: torch.Tensor) -> None:
        if self.targets is not None:
            self._match(item, tensor)
        elif not isinstance(tensor, nn.Parameter):
            holder = self._holder(item)
            holder.tensors += 1
            holder.bytes += self.count_bytes(tensor, holder=holder)
            if tensor.grad_fn is not None:
                holder.graph_tensors += 1
                holder.roots.append(tensor.grad_fn)

    def _visit_array(self, item: _Item, array: Any) -> None:
        """A NumPy array: the tensor it views (``tensor.numpy()``) is counted as that tensor's
        storage; memory it owns is counted by its address, so that a tensor made from it
        (``torch.from_numpy``) is not counted twice."""
        tensor, address, size = array_memory(array)
        if self.targets is not None:
            if tensor is not None:
                self._match(item, tensor)
            return
        holder = self._holder(item)
        holder.arrays += 1
        if tensor is not None:
            holder.bytes += self.count_bytes(tensor, holder=holder)
        elif address:
            holder.bytes += self.ledger.count(("cpu", address), size, holder)

    def _visit_node(self, item: _Item, node: Any) -> None:
        """An autograd node kept by itself (a ``grad_fn``, a custom Function's ``ctx``): its
        graph and the tensors it saved for backward are counted with the holder's graphs."""
        if self.targets is None:
            holder = self._holder(item)
            holder.nodes += 1
            holder.roots.append(node)

    def _visit_cache(self, item: _Item, cache: Any) -> None:
        """A ``functools`` cache: its entries belong to the cached function's holder, whose
        line is the function's ``def``."""
        if not item.frozen:
            self.items[item.path] = (*cache_size(cache), "lru_cache")
            code = getattr(getattr(cache, "__wrapped__", None), "__code__", None)
            if code is not None:
                item.hint = SourceHint(item.hint.name, (code.co_filename,),
                                       fallback_line=code.co_firstlineno)
        if item.depth < _MAX_DEPTH:
            self._enqueue_children(item, cache, type(cache), cached(cache))

    def _visit_memory(self, item: _Item, obj: Any) -> bool:
        """Tensors, NumPy arrays, autograd nodes, functools caches and suspended generators,
        each in its own way; whether ``obj`` was one of them."""
        if isinstance(obj, torch.Tensor):
            self._visit_tensor(item, obj)
            return True
        numpy = sys.modules.get("numpy")
        if numpy is not None and isinstance(obj, numpy.ndarray) and not obj.dtype.hasobject:
            self._visit_array(item, obj)
            return True
        if isinstance(obj, torch.autograd.graph.Node):
            self._visit_node(item, obj)
            return True
        if isinstance(obj, CACHES):
            self._visit_cache(item, obj)
            return True
        if isinstance(obj, SUSPENDED):
            if item.depth < _MAX_DEPTH:
                self._enqueue_children(item, obj, type(obj),
                                       suspended_locals(obj, self.live_frames))
            return True
        return False

    def _visit(self, item: _Item, obj: Any) -> None:
        if self._visit_memory(item, obj):
            return
        if isinstance(obj, CALLABLES) and walks_into(obj):
            if item.depth < _MAX_DEPTH:
                self._enqueue_children(item, obj, type(obj), captured(obj))
            return
        if isinstance(obj, OPAQUE) or root_package(type(obj).__module__) in _NOT_WALKED:
            return
        if isinstance(obj, nn.Module) and item.frozen:
            holder = self._holder(item)  # a model kept in a container: count it, whole
            holder.modules += 1
            holder.bytes += sum(self.count_bytes(p, parameters=True) for p in obj.parameters())
            return
        cls = type(obj)
        if not isinstance(obj, CONTAINERS):
            if cls.__module__.startswith("torch.") and not isinstance(obj, nn.Module):
                return
            self.add_class(cls)
        elif not item.frozen:
            bound = obj.maxlen if isinstance(obj, collections.deque) else None
            self.items[item.path] = (len(obj), bound, type(obj).__name__)
            if item.path in self.holders:
                self.holders[item.path].items = len(obj)
                self.holders[item.path].bound = bound
        if item.depth < _MAX_DEPTH and not only_atoms(obj):
            if isinstance(obj, CONTAINERS) and len(obj) > LARGE:
                self.large.append((item, obj, cls))
            else:
                self._enqueue_children(item, obj, cls)

    def _enqueue_children(self, item: _Item, obj: Any, cls: type,
                          held: Iterator[Child] | None = None) -> None:
        files = item.hint.files
        source = source_file(cls) if cls.__module__ != "builtins" else None
        depth = item.depth + 1
        budget = self.budget
        for kind, raw, child, positional in held or children(obj, self.live_frames):
            if budget.spent():  # one container of millions of items keeps to the budget too
                return
            if id(child) in self.seen or atomic(child):
                continue
            if (item.frozen or positional) and self.targets is None:
                self.queue.append(_Item(child, item.path, item.kind, item.scope, item.hint,
                                        depth, True))
                continue
            hint = item.hint
            if kind == StepKind.ATTRIBUTE:
                hint = SourceHint(raw, (source, *files) if source else files)
            self.queue.append(_Item(child, (*item.path, make_step(kind, raw)), item.kind,
                                    item.scope, hint, depth, False))

    def _match(self, item: _Item, tensor: torch.Tensor) -> None:
        key = storage_key(tensor)
        assert self.targets is not None
        if key is None or key[0][1] not in self.targets or not self.ledger.claim(key[0]):
            return
        self.found.append(
            HeldTensor(
                path=item.path, kind=item.kind, scope=item.scope,
                shape=tuple(tensor.shape), dtype=str(tensor.dtype).removeprefix("torch."),
                device=str(tensor.device), bytes=key[1], grad_fn=tensor.grad_fn is not None,
                storage=key[0][1],
            )
        )
