"""Censuses: who holds tensors, hooks and garbage at an iteration boundary.

A census walks what the training loop can reach: the locals of the user's frames on the
stack, the globals of the user's modules, the tracked model and the class attributes of the
user's classes. It names every holder the way the code spells it (``total_loss``,
``self.history['loss']``, ``Block.saved``), counts the tensors and the autograd graph under
it, counts the user's hooks per module and runs the young generation of the garbage collector
to see what only reference cycles kept. The values it returns are frozen; nothing here keeps
an object alive after it returns.

It is not cheap (a walk over objects and graphs), so the tracker takes one after warm-up and
then at doubling intervals, and each has a time budget.
"""

from __future__ import annotations

import collections
import gc
import inspect
import sys
import sysconfig
import time
import types
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memsentry.report import Census, GarbageStats, HolderStats, HookStats
from memsentry.sources import growth_line, short_path

#: Packages whose frames and objects are machinery, not the user's training code.
_MACHINERY = frozenset(
    {"torch", "memsentry", "pytest_memsentry", "_pytest", "pytest", "pluggy", "IPython",
     "ipykernel", "traitlets", "tornado", "asyncio", "runpy", "importlib", "contextlib",
     "functools", "threading", "unittest", "typing", "abc", "collections", "numpy", "xdist",
     "execnet", "coverage", "debugpy", "pydevd"}
)
_STDLIB = tuple(
    {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib")}
)
_ATOMS = (int, float, complex, bool, str, bytes, bytearray, type(None), range, slice,
          type(Ellipsis), torch.dtype, torch.device, torch.Size, memoryview)
_OPAQUE = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
           types.FrameType, types.CodeType, types.GeneratorType, types.CoroutineType,
           type, property, staticmethod, classmethod,
           torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler,
           torch.autograd.graph.Node)
_MODULE_INTERNALS = frozenset(nn.Module().__dict__) | {"_is_full_backward_hook"}
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOK_DICTS = ("_global_forward_hooks", "_global_forward_pre_hooks",
                      "_global_backward_hooks", "_global_backward_pre_hooks")
_MAX_DEPTH = 12
_CHECK_EVERY = 256


def _root_package(name: str | None) -> str:
    return (name or "").partition(".")[0]


def _is_stdlib(path: str | None) -> bool:
    return bool(path) and path.startswith(_STDLIB) and "-packages" not in path  # type: ignore[union-attr]


def is_machinery_frame(frame: types.FrameType) -> bool:
    """Frames of torch, memsentry, pytest, the standard library and notebook shells."""
    if _root_package(frame.f_globals.get("__name__")) in _MACHINERY:
        return True
    filename = frame.f_code.co_filename
    return filename.startswith("<frozen") or _is_stdlib(filename)


def _is_user_class(cls: type) -> bool:
    module = sys.modules.get(cls.__module__)
    if module is None or _root_package(cls.__module__) in _MACHINERY | {"builtins"}:
        return False
    return not _is_stdlib(getattr(module, "__file__", None))


_SOURCE_FILES: weakref.WeakKeyDictionary[type, str | None] = weakref.WeakKeyDictionary()
_MODULE_KINDS: dict[tuple[str, int], bool] = {}


def _source_file(cls: type) -> str | None:
    """Where ``cls`` is defined (cached: ``inspect`` is slow)."""
    try:
        return _SOURCE_FILES[cls]
    except KeyError:
        pass
    except TypeError:  # not weak-referenceable
        return None
    try:
        path = inspect.getsourcefile(cls)
    except (TypeError, OSError):
        path = None
    _SOURCE_FILES[cls] = path
    return path


def user_site() -> tuple[str, str] | None:
    """(``file:line``, function) of the innermost frame of the user's code on the stack, or
    ``None`` when there is none."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None and is_machinery_frame(frame):
        frame = frame.f_back
    if frame is None:
        return None
    return f"{short_path(frame.f_code.co_filename)}:{frame.f_lineno}", frame.f_code.co_name


def user_frames(start: types.FrameType | None) -> list[types.FrameType]:
    """The user's frames on the stack, innermost first."""
    frames = []
    frame = start
    while frame is not None:
        if not is_machinery_frame(frame):
            frames.append(frame)
        frame = frame.f_back
    return frames


def _frame_locals(frame: types.FrameType) -> dict[str, Any]:
    return dict(frame.f_locals)


def _release_locals(frame: types.FrameType) -> None:
    """Before Python 3.13 reading ``f_locals`` leaves a snapshot dict on a function frame that
    keeps every local's value alive after the code rebinds it; empty it again. The interpreter
    refreshes it whenever someone reads it (debuggers, ``locals()``); the one visible effect is
    on a dict that the function got from ``locals()`` earlier and still reads without calling
    ``locals()`` again: it is that same dict, and it is empty after a census."""
    if sys.version_info < (3, 13) and frame.f_code.co_flags & inspect.CO_OPTIMIZED:
        snapshot = frame.f_locals
        if snapshot is not frame.f_globals:
            snapshot.clear()


# -- holders ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class HeldTensor:
    """A tensor found by :func:`find_holders`: the path that reaches it, spelled as code would
    (``CACHE['warm'][3]``, ``TestModel.outputs[0]``), and what the tensor is."""

    holder: str
    kind: str
    scope: str | None
    shape: tuple[int, ...]
    dtype: str
    device: str
    bytes: int
    grad_fn: bool

@dataclass(eq=False)
class _Holder:
    name: str
    kind: str
    scope: str | None
    hint: tuple[str, tuple[str, ...], int | None, int | None]  # name, files, function line, line
    items: int | None = None
    tensors: int = 0
    bytes: int = 0
    modules: int = 0
    graph_tensors: int = 0
    roots: list[Any] = field(default_factory=list)


@dataclass(eq=False)
class _Item:
    obj: Any
    holder: str
    kind: str
    scope: str | None
    hint: tuple[str, tuple[str, ...], int | None, int | None]
    depth: int
    frozen: bool


class _Budget:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.perf_counter() + seconds
        self.ticks = 0
        self.exhausted = False

    def spent(self) -> bool:
        self.ticks += 1
        if self.ticks % _CHECK_EVERY == 0 and time.perf_counter() > self.deadline:
            self.exhausted = True
        return self.exhausted


def _atomic(obj: Any) -> bool:
    """Nothing to find inside (numbers, strings, dtypes) or nothing safe to look at (a weak
    proxy whose object is gone raises on any access)."""
    try:
        return isinstance(obj, _ATOMS)
    except Exception:
        return True


def _storage_key(tensor: torch.Tensor) -> tuple[tuple[str, int], int] | None:
    try:
        storage = tensor.untyped_storage()
        return (str(tensor.device), storage.data_ptr()), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _traceback_locals(tb: types.TracebackType, live: set[int]
                      ) -> Iterator[tuple[str, Any, bool]]:
    """The locals of the finished frames a traceback keeps (frames still running are roots of
    their own, and reading theirs here would keep a snapshot alive)."""
    while tb is not None:
        frame = tb.tb_frame
        if id(frame) not in live:
            for name, value in list(frame.f_locals.items()):
                yield f"[{frame.f_code.co_name}(): {name}]", value, True
        tb = tb.tb_next  # type: ignore[assignment]


def _children(obj: Any, live: set[int]) -> Iterator[tuple[str, Any, bool]]:
    """(segment, child, positional) for what ``obj`` holds; positional segments (list indices,
    non-string keys, a traceback's frame locals) belong to the holder above them."""
    if isinstance(obj, types.TracebackType):
        yield from _traceback_locals(obj, live)
        return
    if isinstance(obj, BaseException) and obj.__traceback__ is not None:
        yield ".__traceback__", obj.__traceback__, False
    if isinstance(obj, dict):
        for key, value in list(obj.items()):
            yield f"[{key!r}]", value, not isinstance(key, str)
    elif isinstance(obj, list | tuple | collections.deque):
        for index, value in enumerate(list(obj)):
            yield f"[{index}]", value, True
    elif isinstance(obj, set | frozenset):
        for value in list(obj):
            yield "{…}", value, True
    elif isinstance(obj, nn.Module):
        for name, child in obj._modules.items():
            if child is not None:
                yield f".{name}", child, False
        for name, value in list(vars(obj).items()):
            if name not in _MODULE_INTERNALS:
                yield f".{name}", value, False
    else:
        attributes = getattr(obj, "__dict__", None)
        if isinstance(attributes, dict):
            for name, value in list(attributes.items()):
                yield f".{name}", value, False
        for name in getattr(type(obj), "__slots__", ()):
            if isinstance(name, str) and hasattr(obj, name):
                yield f".{name}", getattr(obj, name), False


class _Walk:
    """One census walk: breadth first from the roots, so each tensor is named by its shortest
    path; every storage and graph node counted once."""

    def __init__(self, budget: _Budget, static: set[int], skip: set[int],
                 targets: set[int] | None = None) -> None:
        self.budget = budget
        self.targets = targets  # storage pointers to find (with full paths), or None
        self.found: list[HeldTensor] = []
        self.static = static
        self.seen: set[int] = set(skip)
        self.storages: set[tuple[str, int]] = set()
        self.classes: set[type] = set()
        self.holders: dict[str, _Holder] = {}
        self.items: dict[str, int] = {}
        self.queue: collections.deque[_Item] = collections.deque()
        self.visited = 0
        self.live_frames: set[int] = set()

    def add_root(self, obj: Any, name: str, kind: str, scope: str | None,
                 hint: tuple[str, tuple[str, ...], int | None, int | None]) -> None:
        if id(obj) in self.seen or _atomic(obj):
            return
        self.queue.append(_Item(obj, name, kind, scope, hint, 0, False))

    def add_globals(self, namespace: dict[str, Any], module_name: str, path: str | None, *,
                    classes: bool = False) -> None:
        """A module's globals as roots (and, with ``classes``, its classes' attributes)."""
        scope = short_path(path) if module_name == "__main__" and path \
            else f"module {module_name}"
        files = (path,) if path else ()
        for name, value in list(namespace.items()):
            if name.startswith("__"):
                continue
            if not _atomic(value) and not isinstance(value, _OPAQUE):
                self.add_root(value, name, "global", scope, (name, files, None, None))
            elif classes and isinstance(value, type):
                self._add_class(value)

    def _holder(self, item: _Item) -> _Holder:
        holder = self.holders.get(item.holder)
        if holder is None:
            holder = self.holders[item.holder] = _Holder(
                item.holder, item.kind, item.scope, item.hint, self.items.get(item.holder)
            )
        return holder

    def _count_bytes(self, tensor: torch.Tensor, *, parameters: bool = False) -> int:
        """The storage's bytes the first time it is met; parameters and buffers of tracked
        modules count only when ``parameters`` is on (a whole model kept in a container)."""
        key = _storage_key(tensor)
        if key is None:
            return 0
        (device, pointer), size = key
        if (pointer in self.static and not parameters) or (device, pointer) in self.storages:
            return 0
        self.storages.add((device, pointer))
        return size

    def run(self) -> None:
        while self.queue and not self.budget.spent():
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

    def _visit(self, item: _Item, obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            if self.targets is not None:
                self._match(item, obj)
                return
            if isinstance(obj, nn.Parameter):
                return
            holder = self._holder(item)
            holder.tensors += 1
            holder.bytes += self._count_bytes(obj)
            if obj.grad_fn is not None:
                holder.graph_tensors += 1
                holder.roots.append(obj.grad_fn)
            return
        if isinstance(obj, _OPAQUE) or type(obj).__module__.startswith("memsentry"):
            return
        if isinstance(obj, nn.Module) and item.frozen:
            holder = self._holder(item)  # a model kept in a container: count it, whole
            holder.modules += 1
            holder.bytes += sum(self._count_bytes(p, parameters=True) for p in obj.parameters())
            return
        cls = type(obj)
        if not isinstance(obj, dict | list | tuple | set | frozenset | collections.deque):
            if cls.__module__.startswith("torch.") and not isinstance(obj, nn.Module):
                return
            self._add_class(cls)
        elif not item.frozen:
            self.items[item.holder] = len(obj)
            if item.holder in self.holders:
                self.holders[item.holder].items = len(obj)
        if item.depth >= _MAX_DEPTH:
            return
        files = item.hint[1]
        source = _source_file(cls) if cls.__module__ != "builtins" else None
        for segment, child, positional in _children(obj, self.live_frames):
            if id(child) in self.seen or _atomic(child):
                continue
            if (item.frozen or positional) and self.targets is None:
                self.queue.append(
                    _Item(child, item.holder, item.kind, item.scope, item.hint,
                          item.depth + 1, True)
                )
                continue
            if segment.startswith("."):
                hint = (segment[1:], (source, *files) if source else files, None, None)
            else:
                hint = item.hint
            self.queue.append(
                _Item(child, item.holder + segment, item.kind, item.scope, hint,
                      item.depth + 1, False)
            )

    def _match(self, item: _Item, tensor: torch.Tensor) -> None:
        key = _storage_key(tensor)
        if key is None or key[0][1] not in self.targets or key[0] in self.storages:  # type: ignore[operator]
            return
        self.storages.add(key[0])
        self.found.append(
            HeldTensor(
                holder=item.holder, kind=item.kind, scope=item.scope,
                shape=tuple(tensor.shape), dtype=str(tensor.dtype).removeprefix("torch."),
                device=str(tensor.device), bytes=key[1], grad_fn=tensor.grad_fn is not None,
            )
        )

    def _add_class(self, cls: type) -> None:
        for klass in cls.__mro__:
            if klass in self.classes or klass is object:
                continue
            self.classes.add(klass)
            if not _is_user_class(klass):
                continue
            source = _source_file(klass)
            for name, value in list(vars(klass).items()):
                if name.startswith("__") or _atomic(value) or isinstance(value, _OPAQUE):
                    continue
                self.add_root(value, f"{klass.__qualname__}.{name}", "class attribute",
                              f"class {klass.__qualname__}",
                              (name, (source,) if source else (), None, None))


# -- autograd graphs ---------------------------------------------------------------------------
_SAVED_NAMES: dict[type, tuple[str, ...]] = {}


def _saved_names(node_type: type) -> tuple[str, ...]:
    names = _SAVED_NAMES.get(node_type)
    if names is None:
        names = tuple(n for n in dir(node_type) if n.startswith("_saved_"))
        if hasattr(node_type, "saved_tensors"):  # a custom autograd.Function's ctx
            names += ("saved_tensors",)
        _SAVED_NAMES[node_type] = names
    return names


def _saved_tensors(node: Any) -> Iterator[torch.Tensor]:
    for name in _saved_names(type(node)):
        try:
            value = getattr(node, name)
        except Exception:  # freed by backward, or an in-place change since
            continue
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, tuple | list):
            yield from (v for v in value if isinstance(v, torch.Tensor))


def _graph(walk: _Walk, roots: Iterable[Any], seen: set[int]) -> tuple[int, int]:
    """(nodes, saved bytes) reachable from ``roots`` that no earlier holder claimed."""
    nodes = saved = 0
    stack = [r for r in roots if id(r) not in seen]
    while stack and not walk.budget.spent():
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        nodes += 1
        for tensor in _saved_tensors(node):
            saved += walk._count_bytes(tensor)
        for child, _index in node.next_functions:
            if child is not None and id(child) not in seen:
                stack.append(child)
    return nodes, saved


# -- hooks -------------------------------------------------------------------------------------
def _describe_hook(hook: Any) -> tuple[str | None, str | None]:
    while hasattr(hook, "func") and not hasattr(hook, "__code__"):  # functools.partial
        hook = hook.func
    hook = getattr(hook, "__func__", hook)
    code = getattr(hook, "__code__", None)
    if code is None:
        return type(hook).__name__, None
    return code.co_name, f"{short_path(code.co_filename)}:{code.co_firstlineno}"


def _count_hooks(name: str, dicts: Iterable[dict[int, Any] | None], own: set[int],
                 out: list[HookStats]) -> None:
    count, newest = 0, None
    for hooks in dicts:
        for key, hook in (hooks or {}).items():
            if key not in own:
                count += 1
                newest = hook
    if count:
        hook_name, where = _describe_hook(newest)
        out.append(HookStats(name, count, hook_name, where))


def hook_census(modules: Iterable[tuple[str, nn.Module]], own: set[int]) -> tuple[HookStats, ...]:
    """User hooks per module (module hooks and its parameters' tensor hooks) and global ones."""
    from torch.nn.modules import module as module_globals

    found: list[HookStats] = []
    for name, module in modules:
        dicts: list[Any] = [getattr(module, attr, None) for attr in _HOOK_DICTS]
        for param in module._parameters.values():
            if param is not None:
                dicts.append(param._backward_hooks)
                dicts.append(getattr(param, "_post_accumulate_grad_hooks", None))
        _count_hooks(name, dicts, own, found)
    _count_hooks("<global>", [getattr(module_globals, a, None) for a in _GLOBAL_HOOK_DICTS],
                 own, found)
    return tuple(found)


# -- garbage ------------------------------------------------------------------------------------
_GENERIC = frozenset({"dict", "list", "tuple", "cell", "function", "method", "set", "Tensor",
                      "Parameter", "frame", "builtin_function_or_method", "weakref",
                      "ReferenceType", "getset_descriptor", "staticmethod"})


def garbage_census(sample: Callable[[], int], full_collections: int = 0,
                   full_freed: int = 0, *, everything: bool = False) -> GarbageStats:
    """Collect the two young generations (all of them when ``everything``), keeping what the
    collection finds long enough to name it.

    ``gc.DEBUG_SAVEALL`` parks the unreachable objects in ``gc.garbage`` (finalisers and weakref
    callbacks have run, as in a normal collection) and moves them to the oldest generation.
    After counting, they are released and, when there were any, a full collection frees them
    for real: the costly step, paid only when cycles exist. A cycle still alive at one census
    is promoted out of the young generations by then, so once cycles owning tensors were
    seen the tracker asks for ``everything``. ``sample`` reads allocated memory, to measure
    what was freed.
    """
    before = sample()
    flags = gc.get_debug()
    start = len(gc.garbage)
    gc.set_debug(flags | gc.DEBUG_SAVEALL)
    try:
        gc.collect(2 if everything else 1)
    finally:
        gc.set_debug(flags)
    found = gc.garbage[start:]
    del gc.garbage[start:]
    counts: collections.Counter[str] = collections.Counter()
    users: set[str] = set()
    tensors = size = 0
    storages: set[tuple[str, int]] = set()
    for obj in found:
        if isinstance(obj, torch.Tensor):
            tensors += 1
            key = _storage_key(obj)
            if key is not None and key[0] not in storages:
                storages.add(key[0])
                size += key[1]
        name = type(obj).__qualname__
        counts[name] += 1
        if name not in users and _is_user_class(type(obj)):
            users.add(name)
    objects = len(found)
    found.clear()
    del found
    if objects:
        gc.collect()
    freed = max(0, before - sample())
    # The user's own classes first (the cycle's likely author), then library types.
    ranked = counts.most_common()
    named = [(t, n) for t, n in ranked if t in users]
    named += [(t, n) for t, n in ranked if t not in users and t not in _GENERIC]
    named += [(t, n) for t, n in ranked if t in _GENERIC]
    return GarbageStats(
        objects=objects, tensors=tensors, bytes=size, freed=freed, types=tuple(named[:6]),
        gc_enabled=gc.isenabled(), full_collections=full_collections, full_freed=full_freed,
    )


# -- the census --------------------------------------------------------------------------------
def _where(hint: tuple[str, tuple[str, ...], int | None, int | None]) -> str | None:
    name, files, function_line, fallback = hint
    for path in files:
        line = growth_line(path, name, function_line=function_line)
        if line is not None:
            return f"{short_path(path)}:{line}"
    if files and fallback is not None:
        return f"{short_path(files[0])}:{fallback}"
    return None


def _user_modules() -> list[types.ModuleType]:
    """Modules of the user's own code: not the standard library, not installed packages."""
    modules = []
    for name, module in list(sys.modules.items()):
        key = (name, id(module))
        user = _MODULE_KINDS.get(key)
        if user is None:
            path = getattr(module, "__file__", None)
            user = _MODULE_KINDS[key] = bool(
                isinstance(path, str) and _root_package(name) not in _MACHINERY
                and not _is_stdlib(path) and "-packages" not in path
            )
        if user:
            modules.append(module)
    return modules


def take_census(
    iteration: int,
    *,
    frame: types.FrameType | None,
    model: nn.Module | None,
    modules: list[tuple[str, nn.Module]],
    static: set[int],
    own_hooks: set[int],
    skip: set[int],
    budget: float,
    garbage: GarbageStats | None,
) -> Census:
    """Name the holders of every tensor reachable from the user's frames (innermost first),
    their modules' globals, the model and the user's classes, within ``budget`` seconds."""
    started = time.perf_counter()
    walk = _Walk(_Budget(budget), static, skip)
    frames = user_frames(frame)
    walk.live_frames = _running_frames(frame)
    namespaces: dict[int, tuple[dict[str, Any], str, str | None]] = {}
    try:
        for user_frame in frames:
            code = user_frame.f_code
            path = code.co_filename
            is_function = bool(code.co_flags & inspect.CO_OPTIMIZED)
            if is_function:
                scope = f"{code.co_name}() in {short_path(path)}"
                for name, value in _frame_locals(user_frame).items():
                    if name.isidentifier():
                        walk.add_root(value, name, "local", scope,
                                      (name, (path,), code.co_firstlineno, user_frame.f_lineno))
            namespaces.setdefault(
                id(user_frame.f_globals),
                (user_frame.f_globals, user_frame.f_globals.get("__name__", "?"), path),
            )
    finally:
        for user_frame in frames:
            _release_locals(user_frame)
        del frames
    for module in _user_modules():
        namespaces.setdefault(id(vars(module)), (vars(module), module.__name__, module.__file__))
    last_error = getattr(sys, "last_value", None)  # an interactive session's uncaught error
    if last_error is not None:
        walk.add_root(last_error, "sys.last_value", "global", "module sys",
                      ("last_value", (), None, None))
    for namespace, module_name, path in namespaces.values():
        walk.add_globals(namespace, module_name, path)
    if model is not None:
        walk.add_root(model, type(model).__name__, "model", None,
                      (type(model).__name__, (), None, None))
    for _name, module in modules:
        walk._add_class(type(module))
    walk.run()
    holders = _freeze_holders(walk)
    holders += _gradient_holders(walk, modules)
    return Census(
        iteration=iteration,
        seconds=time.perf_counter() - started,
        complete=not walk.budget.exhausted,
        objects=walk.visited,
        holders=tuple(holders),
        hooks=hook_census(modules, own_hooks),
        garbage=garbage,
    )


def find_holders(
    pointers: set[int],
    roots: list[tuple[str, Any, str, str | None]],
    *,
    budget: float = 1.0,
) -> tuple[list[HeldTensor], bool]:
    """Who holds the tensors whose storage starts at one of ``pointers``.

    Walks ``roots`` (name, object, kind, scope) first, then the globals of the user's modules
    and their classes' attributes, breadth first, so each tensor gets its shortest path.
    Returns the tensors found (each storage once) and whether the walk finished within
    ``budget`` seconds. Nothing found is kept alive.
    """
    walk = _Walk(_Budget(budget), set(), set(), targets=set(pointers))
    walk.live_frames = _running_frames(sys._getframe())
    for name, obj, kind, scope in roots:
        walk.add_root(obj, name, kind, scope, (name, (), None, None))
    for module in _user_modules():
        walk.add_globals(vars(module), module.__name__, module.__file__, classes=True)
    walk.run()
    return walk.found, not walk.budget.exhausted


def _running_frames(frame: types.FrameType | None) -> set[int]:
    running = set()
    while frame is not None:
        running.add(id(frame))
        frame = frame.f_back
    return running


def _freeze_holders(walk: _Walk) -> list[HolderStats]:
    frozen = []
    nodes_seen: set[int] = set()
    for holder in walk.holders.values():
        nodes, saved = _graph(walk, holder.roots, nodes_seen) if holder.roots else (0, 0)
        holder.roots.clear()
        frozen.append(
            HolderStats(
                name=holder.name, kind=holder.kind, scope=holder.scope,
                where=_where(holder.hint), items=holder.items, tensors=holder.tensors,
                bytes=holder.bytes, graph_tensors=holder.graph_tensors, graph_nodes=nodes,
                graph_saved_bytes=saved, modules=holder.modules,
            )
        )
    return frozen


def _gradient_holders(walk: _Walk, modules: list[tuple[str, nn.Module]]) -> list[HolderStats]:
    """Parameters whose ``.grad`` carries a ``grad_fn`` (``backward(create_graph=True)``): one
    holder for all of them, named after the first."""
    names, roots, size = [], [], 0
    for module_name, module in modules:
        for param_name, param in module._parameters.items():
            grad = None if param is None else param.grad
            if grad is not None and grad.grad_fn is not None:
                names.append(f"{module_name}.{param_name}.grad" if module_name
                             else f"{param_name}.grad")
                roots.append(grad.grad_fn)
                size += walk._count_bytes(grad)
    if not names:
        return []
    nodes, saved = _graph(walk, roots, set())
    roots.clear()
    return [
        HolderStats(
            name=names[0], kind="gradient", scope=f"{len(names)} parameter .grad tensors",
            where=None, items=len(names), tensors=len(names), bytes=size,
            graph_tensors=len(names), graph_nodes=nodes, graph_saved_bytes=saved,
        )
    ]


__all__ = ["HeldTensor", "find_holders", "garbage_census", "hook_census", "is_machinery_frame",
           "take_census", "user_frames", "user_site"]
