"""The object walk of a census: breadth first from named roots, so each tensor is named by its
shortest path; every storage counted once; within a time budget.

A path is typed (:class:`~memsentry.model.Step`): attributes and string keys extend a holder's
path; list indices, set members, non-string keys and a traceback's frame locals belong to the
holder above them (its items, counted together).
"""

from __future__ import annotations

import collections
import gc
import sys
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from memsentry.census.buffers import CAPSULE
from memsentry.census.children import (
    CACHES,
    CALLABLES,
    CONTAINERS,
    SUSPENDED,
    Child,
    atomic,
    cache_size,
    cached,
    captured,
    children,
    only_atoms,
    suspended_locals,
    walks_into,
)
from memsentry.census.tally import Holder, Item, SourceHint, Tally
from memsentry.census.tees import TEE, tee_items
from memsentry.model import HolderKind, Scope, ScopeKind, Step, StepKind
from memsentry.usercode.frames import is_user_class, root_package, source_file

#: The packages whose caches a census leaves alone: memsentry's own.
_OWN_PACKAGES = frozenset({"memsentry", "pytest_memsentry"})

#: Objects never walked into: code, functions, classes, schedulers, autograd nodes. (An
#: optimizer is walked for its state: :func:`~memsentry.census.children.optimizer_children`.)
OPAQUE = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
          types.FrameType, types.CodeType, types.GeneratorType, types.CoroutineType,
          type, property, staticmethod, classmethod,
          torch.optim.lr_scheduler.LRScheduler, torch.autograd.graph.Node)
#: Modules that hold other modules or parameters by position: their length is the holder's.
MODULE_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)
#: Packages whose objects are never walked into: memsentry's own, and the test runner's (a
#: test's ``request`` or ``capsys`` reaches the whole session, every collected test; the
#: test's own values are met through its locals first).
_NOT_WALKED = frozenset({"memsentry", "pytest_memsentry", "_pytest", "pluggy", "xdist",
                         "execnet"})
_MAX_DEPTH = 12
#: Containers longer than this are walked after everything else.
LARGE = 4096
_CHECK_EVERY = 256


#: How many times its budget a walk may last on the wall clock, whatever its CPU time: a
#: walk that waits for the interpreter's lock behind the program's threads still ends.
WALL_CEILING = 20.0


class Budget:
    """The work a walk may do: ``seconds`` of this thread's own CPU time, checked every few
    hundred steps. A machine busy with other processes slows the walk, not its reach: on the
    wall clock, a walk at load 20 stopped after a tenth of the objects it visits on an idle
    machine, and a holder named there went unnamed. The wall clock bounds it at
    :data:`WALL_CEILING` times ``seconds``. ``cpu`` and ``wall`` are the clocks (tests give
    fakes)."""

    def __init__(self, seconds: float, *, cpu: Callable[[], float] = time.thread_time,
                 wall: Callable[[], float] = time.perf_counter) -> None:
        self._cpu, self._wall = cpu, wall
        self.deadline = cpu() + seconds
        self.wall_deadline = wall() + WALL_CEILING * seconds
        self.ticks = 0
        self.exhausted = False

    def spent(self) -> bool:
        self.ticks += 1
        if self.ticks % _CHECK_EVERY == 0 and self._past():
            self.exhausted = True
        return self.exhausted

    def _past(self) -> bool:
        return self._cpu() > self.deadline or self._wall() > self.wall_deadline


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



def _homonym(path: tuple[Step, ...], scope: Scope | None) -> tuple[Step, ...]:
    """The path of a root spelled as one added before it that is another object (a global
    ``buf`` beside a local ``buf`` of the loop's function): the same spelling, told apart by
    its scope, so that the two are two holders, each with its own line."""
    first = path[0]
    return (Step(first.kind, first.name, str(scope) if scope else "?"), *path[1:])


class Walk:
    """One census walk over everything reachable from the roots added to it.

    With ``targets`` (storage pointers) it looks for those storages only and records each as a
    :class:`HeldTensor` with its full path; without, it counts tensors per holder. What it
    counts is in its :class:`Tally`.
    """

    def __init__(self, budget: Budget, static: set[int], skip: set[int],
                 targets: set[int] | None = None, live_frames: set[int] | None = None) -> None:
        self.budget = budget
        self.tally = Tally(static, targets)
        self.seen: set[int] = set(skip)
        self.root_order: dict[tuple[Step, ...], int] = {}  # roots in the order they were added
        self.root_objects: dict[tuple[Step, ...], int] = {}  # the object first added at a path
        self.classes: set[type] = set()
        self.queue: collections.deque[Item] = collections.deque()
        self.large: collections.deque[Item] = collections.deque()  # walked after the rest
        self.visited = 0
        self.live_frames = live_frames or set()

    def add_root(self, obj: Any, path: tuple[Step, ...], kind: HolderKind,
                 scope: Scope | None, hint: SourceHint) -> None:
        if id(obj) in self.seen or atomic(obj):
            return
        if self.root_objects.setdefault(path, id(obj)) != id(obj):
            path = _homonym(path, scope)
        self.root_order.setdefault(path, len(self.root_order))
        self.queue.append(Item(obj, path, kind, scope, hint, 0, False))

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

    def run(self) -> None:
        """Visit what is queued, breadth first; the children of large containers come after
        everything else, so that one container of millions of items cannot use up the
        budget before the rest was seen."""
        while not self.budget.spent():
            if not self.queue:
                if not self.large:
                    return
                item = self.large.popleft()
                self._enqueue_children(item, item.obj, type(item.obj))
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

    def declared(self, holder: Holder) -> int:
        """The position of the holder's root among the roots (a variable's place in its
        frame or module: state set up before a loop comes before the loop's own locals)."""
        for length in (1, 2):
            order = self.root_order.get(holder.path[:length])
            if order is not None:
                return order
        return len(self.root_order)

    def _visit_cache(self, item: Item, cache: Any) -> None:
        """A ``functools`` cache: its entries belong to the cached function's holder, whose
        line is the function's ``def``. memsentry's own caches (the user's parsed source,
        thousands of nodes a file) keep none of the user's memory and are not walked."""
        wrapped = getattr(cache, "__wrapped__", None)
        if root_package(getattr(wrapped, "__module__", None)) in _OWN_PACKAGES:
            return
        if not item.frozen:
            self.tally.container(item.path, *cache_size(cache), "lru_cache")
            code = getattr(wrapped, "__code__", None)
            if code is not None:
                item.hint = SourceHint(item.hint.name, (code.co_filename,),
                                       fallback_line=code.co_firstlineno)
        if item.depth < _MAX_DEPTH:
            self._enqueue_children(item, cache, type(cache), cached(cache))

    def _visit_memory(self, item: Item, obj: Any) -> bool:
        """Tensors, NumPy arrays, autograd nodes, functools caches, byte buffers and
        suspended generators, each in its own way; whether ``obj`` was one of them."""
        if isinstance(obj, torch.Tensor):
            self._visit_tensor(item, obj)
            return True
        numpy = sys.modules.get("numpy")
        if numpy is not None and isinstance(obj, numpy.ndarray) and not obj.dtype.hasobject:
            self.tally.array(item, obj)
            return True
        if isinstance(obj, torch.autograd.graph.Node):
            self.tally.node(item, obj)
            return True
        if isinstance(obj, CACHES):
            self._visit_cache(item, obj)
            return True
        if isinstance(obj, bytearray | memoryview | CAPSULE):
            self.tally.buffer(item, obj)
            return True
        if isinstance(obj, SUSPENDED):
            if item.depth < _MAX_DEPTH:
                self._enqueue_children(item, obj, type(obj),
                                       suspended_locals(obj, self.live_frames))
            return True
        return False

    def _visit_tensor(self, item: Item, tensor: torch.Tensor) -> None:
        """A tensor, counted; a plain one's attributes walked (a subclass's are its own)."""
        self.tally.tensor(item, tensor)
        if type(tensor) is torch.Tensor:
            self._enqueue_tensor_attributes(item, tensor)

    def _enqueue_tensor_attributes(self, item: Item, tensor: torch.Tensor) -> None:
        """Values set on a plain tensor as attributes (``out.prev = last``) belong to the
        tensor's holder, at its depth: a chain of tensors each keeping the one before is
        followed to its end, and the holder notes the attribute that chains them. The
        garbage collector lists a tensor's ``__dict__`` only when one was made, so a tensor
        without attributes is not given one."""
        for ref in gc.get_referents(tensor):
            if type(ref) is not dict:
                continue
            for name, value in list(ref.items()):
                if id(value) in self.seen or atomic(value):
                    continue
                if isinstance(value, torch.Tensor) and self.tally.targets is None:
                    self.tally.chained(item, name)
                self.queue.append(Item(value, item.path, item.kind, item.scope, item.hint,
                                       item.depth, True))

    def _visit(self, item: Item, obj: Any) -> None:
        if self._visit_memory(item, obj):
            return
        if isinstance(obj, CALLABLES) and walks_into(obj):
            if item.depth < _MAX_DEPTH:
                self._enqueue_children(item, obj, type(obj), captured(obj))
            return
        if _never_walked(obj):
            return
        if isinstance(obj, nn.Module) and item.frozen:
            self.tally.model(item, obj)  # a model kept in a container: count it, whole
        elif isinstance(obj, CONTAINERS):
            self._visit_container(item, obj)
        elif isinstance(obj, TEE):
            self._visit_tee(item, obj)
        else:
            self._visit_object(item, obj)

    def _visit_object(self, item: Item, obj: Any) -> None:
        """An object (a module, an optimizer, the user's own): its attributes; a registry of
        modules also counted by its length. Torch's other objects keep nothing of the
        user's."""
        if not isinstance(obj, torch.optim.Optimizer) and _torch_internal(obj):
            return
        if isinstance(obj, MODULE_CONTAINERS) and not item.frozen:
            self.tally.module_container(item, obj)
        elif isinstance(obj, torch.optim.Optimizer):
            self.tally.optimizer(obj)
        self._visit_instance(item, obj)

    def _visit_container(self, item: Item, obj: Any) -> None:
        """A list, dict, set, deque...: its length is the holder's; a long one's items are
        walked after everything else (:meth:`run`)."""
        if not item.frozen:
            bound = obj.maxlen if isinstance(obj, collections.deque) else None
            self.tally.container(item.path, len(obj), bound, type(obj).__name__)
        if item.depth >= _MAX_DEPTH or only_atoms(obj):
            return
        if len(obj) > LARGE:
            self.large.append(item)
        else:
            self._enqueue_children(item, obj, type(obj))

    def _visit_tee(self, item: Item, obj: Any) -> None:
        """A branch of ``itertools.tee``: the items it has not read yet are its holder's
        (the tee keeps them until every branch has read them)."""
        waiting = tee_items(obj)
        if not item.frozen:
            self.tally.container(item.path, len(waiting), None, "tee")
        if item.depth < _MAX_DEPTH:
            self._enqueue_children(item, obj, type(obj),
                                   ((StepKind.INDEX, i, v, True) for i, v in enumerate(waiting)))

    def _visit_instance(self, item: Item, obj: Any) -> None:
        """Any other object: its class's attributes become roots, its own are walked."""
        cls = type(obj)
        self.add_class(cls)
        if item.depth < _MAX_DEPTH and not only_atoms(obj):
            self._enqueue_children(item, obj, cls)

    def _enqueue_children(self, item: Item, obj: Any, cls: type,
                          held: Iterator[Child] | None = None) -> None:
        attribute_files = _attribute_files(cls, item.hint.files)
        depth = item.depth + 1
        budget = self.budget
        for kind, raw, child, positional in held or children(obj, self.live_frames):
            if budget.spent():  # one container of millions of items keeps to the budget too
                return
            if id(child) in self.seen or atomic(child):
                continue
            if (item.frozen or positional) and self.tally.targets is None:
                self.queue.append(Item(child, item.path, item.kind, item.scope, item.hint,
                                       depth, True))
                continue
            hint = item.hint
            if kind == StepKind.ATTRIBUTE:
                hint = SourceHint(raw, attribute_files)
            self.queue.append(Item(child, (*item.path, make_step(kind, raw)), item.kind,
                                   item.scope, hint, depth, False))


def _attribute_files(cls: type, files: tuple[str, ...]) -> tuple[str, ...]:
    """Where to look for the line that fills an attribute of a ``cls`` instance: the file of
    its class (a method of it), then ``files``, those of the instance's holder."""
    source = source_file(cls) if cls.__module__ != "builtins" else None
    return (source, *files) if source else files


def _never_walked(obj: Any) -> bool:
    """Code, classes, optimizers, autograd nodes, and the objects of the packages whose
    objects are never walked into (:data:`_NOT_WALKED`)."""
    return isinstance(obj, OPAQUE) or root_package(type(obj).__module__) in _NOT_WALKED


def _torch_internal(obj: Any) -> bool:
    """One of torch's own objects that is not a module (a device, a dtype, a generator):
    nothing of the user's is kept under it."""
    return type(obj).__module__.startswith("torch.") and not isinstance(obj, nn.Module)
