"""A census: who holds tensors, hooks and garbage at an iteration boundary; and the search for
who holds given storages (the pytest plugin's question).

The roots are what the training loop can reach: the locals of the user's frames on the stack,
the globals of the user's modules, the tracked model and the class attributes of the user's
classes. Every holder is named the way the code spells it.
"""

from __future__ import annotations

import inspect
import re
import sys
import time
import types
from collections.abc import Sequence
from typing import Any, NamedTuple

from torch import nn

from memsentry.census.graphs import GraphSize, graph_size
from memsentry.census.hooks import hook_census
from memsentry.census.libraries import add_package_state, code_names
from memsentry.census.registries import add_context_values, add_signal_handlers, exit_callbacks
from memsentry.census.tally import Holder, SourceHint
from memsentry.census.walk import (
    CALLABLES,
    OPAQUE,
    Budget,
    Walk,
    atomic,
    walks_into,
)
from memsentry.model import (
    Census,
    GarbageStats,
    HeldTensor,
    HolderKind,
    HolderStats,
    HookStats,
    Location,
    Scope,
    ScopeKind,
    Step,
    StepKind,
)
from memsentry.usercode.feeds import Feed, added_value, feeding_call, rewritten
from memsentry.usercode.frames import (
    frame_locals,
    is_library_file,
    is_user_class,
    release_locals,
    running_frames,
    source_file,
    user_frames,
    user_modules,
)
from memsentry.usercode.lines import attribute_line, growth_line, short_path
from memsentry.usercode.rebinds import rebound_each_step


class Root(NamedTuple):
    """A root given to :func:`find_holders`: its path, the object, what it is and where it
    lives."""

    path: tuple[Step, ...]
    obj: Any
    kind: HolderKind
    scope: Scope | None


class Namespace(NamedTuple):
    """A module's globals met in a census: the dict, the module's name and its file."""

    globals: dict[str, Any]
    name: str
    path: str | None


#: An object a framework runs (a LightningModule, a callback), the name its own methods spell
#: it by (``self``) and what it is (``LightningModule``): its attributes are named from it.
Named = tuple[str, Any, str]


#: IPython's other names for its output history (``_oh`` is ``Out``, ``_5`` is ``Out[5]``,
#: ``_`` the last result) and its input history: left out so the results are named ``Out[n]``,
#: one container that grows, not one root per cell.
_IPYTHON_ALIASES = re.compile(r"_oh|_\d+|_{1,3}|_i+|_i\d+|_ih|_dh|In")


def _root(name: str) -> tuple[Step, ...]:
    return (Step(StepKind.ROOT, name),)


def _interactive_name() -> str:
    """What to call an IPython shell's namespace: a Jupyter kernel's is the notebook's."""
    return "the notebook" if "ipykernel" in sys.modules else "the IPython session"


def _is_ipython(namespace: dict[str, Any]) -> bool:
    """Whether ``namespace`` is an IPython shell's (it keeps ``In``, ``Out`` and ``_oh``)."""
    return "Out" in namespace and "_oh" in namespace and "In" in namespace


def _hidden_global(name: str, ipython: bool) -> bool:
    """Dunders, and in an IPython shell its other names for its history."""
    return name.startswith("__") or (ipython and _IPYTHON_ALIASES.fullmatch(name) is not None)


def _globals_scope(ipython: bool, module_name: str, path: str | None) -> Scope:
    """Where a module's globals live: an IPython shell's namespace (whichever cell is
    running: not one cell's globals), a script run as ``__main__``, or a module."""
    if ipython:
        return Scope(ScopeKind.SCRIPT, _interactive_name())
    if module_name == "__main__" and path:
        return Scope(ScopeKind.SCRIPT, short_path(path))
    return Scope(ScopeKind.MODULE, module_name)


def _walked_global(value: Any, module_name: str) -> bool:
    """Whether a global is a root: a function or class defined in its module that a walk goes
    into, or a value that may hold tensors (not an atom, not code)."""
    defined_here = isinstance(value, CALLABLES) and walks_into(value) \
        and getattr(value, "__module__", None) == module_name
    return defined_here or (not atomic(value) and not isinstance(value, OPAQUE))


def add_globals(walk: Walk, namespace: dict[str, Any], module_name: str, path: str | None, *,
                classes: bool = False) -> None:
    """A module's globals as roots (and, with ``classes``, its classes' attributes)."""
    ipython = _is_ipython(namespace)
    scope = _globals_scope(ipython, module_name, path)
    files = (path,) if path else ()
    for name, value in list(namespace.items()):
        if _hidden_global(name, ipython):
            continue
        if _walked_global(value, module_name):
            walk.add_root(value, _root(name), HolderKind.GLOBAL, scope, SourceHint(name, files))
        elif classes and isinstance(value, type):
            walk.add_class(value)


def add_log_handlers(walk: Walk) -> None:
    """Handlers of the user's classes on any logger, as roots: one that keeps the records it
    handles (with the tensors passed as their arguments) is held by :mod:`logging`'s registry,
    which no user module reaches."""
    logging = sys.modules.get("logging")
    if logging is None or not _user_handler_made(logging):
        return  # no handler of the user's classes: no logger to look through
    loggers = [("", logging.getLogger())] + [
        (name, logger) for name, logger in list(logging.Logger.manager.loggerDict.items())
        if isinstance(logger, logging.Logger)]
    for name, logger in loggers:
        for index, handler in enumerate(list(logger.handlers)):
            if is_user_class(type(handler)):
                _add_handler(walk, name, index, handler)


def _user_handler_made(logging: types.ModuleType) -> bool:
    """Whether a handler of the user's classes may exist: :mod:`logging` keeps weak
    references to every handler made (when it does not, any may)."""
    made = getattr(logging, "_handlerList", None)
    return not isinstance(made, list) or any(is_user_class(type(ref())) for ref in list(made))


def _add_handler(walk: Walk, logger: str, index: int, handler: Any) -> None:
    """A handler of the user's class, as the root ``logging.getLogger(name).handlers[i]``."""
    source = source_file(type(handler))
    path = (Step(StepKind.ROOT, f"logging.getLogger({logger!r})" if logger
                 else "logging.getLogger()"),
            Step(StepKind.ATTRIBUTE, "handlers"), Step(StepKind.INDEX, str(index)))
    walk.add_root(handler, path, HolderKind.GLOBAL, Scope(ScopeKind.MODULE, "logging"),
                  SourceHint("handlers", (source,) if source else ()))


def _add_frames(walk: Walk, frame: types.FrameType | None,
                namespaces: dict[int, Namespace], named: list[tuple[dict[str, Any], str | None]]
                ) -> None:
    """The locals of the user's function frames as roots; their globals into ``namespaces``,
    the modules and functions among their locals into ``named`` (with the frame's file)."""
    frames = user_frames(frame)
    try:
        for user_frame in frames:
            code = user_frame.f_code
            path = code.co_filename
            if code.co_flags & inspect.CO_OPTIMIZED:
                scope = Scope(ScopeKind.FUNCTION, code.co_name, short_path(path))
                values = frame_locals(user_frame)
                defaults = _defaults_of(code, user_frame.f_globals, values.get("self"))
                for name, value in values.items():
                    if name.isidentifier() and id(value) not in defaults:
                        hint = SourceHint(name, (path,), code.co_firstlineno, user_frame.f_lineno)
                        walk.add_root(value, _root(name), HolderKind.LOCAL, scope, hint)
                named.append((code_names(values), path))
            namespaces.setdefault(
                id(user_frame.f_globals),
                Namespace(user_frame.f_globals, user_frame.f_globals.get("__name__", "?"), path),
            )
    finally:
        for user_frame in frames:
            release_locals(user_frame)
        del frames


def _defaults_of(code: types.CodeType, namespace: dict[str, Any], instance: Any) -> set[int]:
    """Ids of the default argument values of the function running ``code`` (found among the
    module's globals or the instance's class): a local bound to a mutable default is the
    default, named ``train.__defaults__[0]`` through the function, not as a local that would
    be gone after the call."""
    candidates = list(namespace.values())
    if instance is not None:
        candidates += list(vars(type(instance)).values())
    for value in candidates:
        kind = type(value)  # not isinstance: a global's __class__ may be a lazy attribute
        if kind in (staticmethod, classmethod, types.MethodType):
            function = value.__func__
        elif kind is types.FunctionType:
            function = value
        else:
            continue
        if function.__code__ is code:
            defaults = [*(function.__defaults__ or ()),
                        *(function.__kwdefaults__ or {}).values()]
            return {id(d) for d in defaults if not atomic(d)}
    return set()


#: The share of the census budget the autograd graphs behind the holders may take, after the
#: holder walk: a cut graph leaves the holders' own figures whole (``graphs_complete``).
GRAPH_SHARE = 0.5


def _add_instance(walk: Walk, name: str, obj: Any, role: str) -> None:
    """An object a framework runs, as the root its own methods spell (``self``)."""
    cls = type(obj)
    source = source_file(cls)
    walk.add_root(obj, _root(name), HolderKind.INSTANCE,
                  Scope(ScopeKind.CLASS, f"{role} {cls.__name__}", short_path(source)
                        if source else None),
                  SourceHint(name, (source,) if source else ()))


def _add_scopes(walk: Walk, frame: types.FrameType | None) -> list[str]:
    """The locals of the user's frames, an interactive session's uncaught error, then the
    globals of those frames' modules and of every other user module, then the values of the
    running context's variables and the user's signal handlers. Returns the files of those
    modules, the frames' first."""
    namespaces: dict[int, Namespace] = {}
    named: list[tuple[dict[str, Any], str | None]] = []
    _add_frames(walk, frame, namespaces, named)
    # The packages looked at are those the running code names (its frames and their
    # modules), not every module's: a test suite's other modules import hypothesis, radon...
    named += [(n.globals, n.path) for n in namespaces.values()]
    modules = user_modules()
    for module in modules:
        namespaces.setdefault(id(vars(module)), Namespace(
            vars(module), module.__name__, getattr(module, "__file__", None)))
    last_error = getattr(sys, "last_value", None)  # an interactive session's uncaught error
    if last_error is not None:
        walk.add_root(last_error, (Step(StepKind.ROOT, "sys"), Step(StepKind.ATTRIBUTE,
                      "last_value")), HolderKind.GLOBAL, Scope(ScopeKind.MODULE, "sys"),
                      SourceHint("last_value"))
    for namespace in namespaces.values():
        add_globals(walk, namespace.globals, namespace.name, namespace.path, classes=True)
    add_package_state(walk, named)
    add_context_values(walk, modules)
    add_signal_handlers(walk)
    return [namespace.path for namespace in namespaces.values() if namespace.path]


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
    named: Sequence[Named] = (),
    since: int | None = None,
) -> Census:
    """Name the holders of every tensor reachable from the ``named`` objects, the user's
    frames (innermost first), their modules' globals, the model and the user's classes, within
    ``budget`` seconds. ``since``: the newest autograd sequence number the census before saw
    (each holder counts the nodes of its graph that were alive then)."""
    started = time.perf_counter()
    walk = Walk(Budget(budget), static, skip, live_frames=running_frames(frame))
    for name, obj, role in named:  # first: where both reach a tensor, the user's spelling wins
        _add_instance(walk, name, obj, role)
    files = _add_scopes(walk, frame)
    add_log_handlers(walk)
    if model is not None and all(obj is not model for _, obj, _ in named):
        name = type(model).__name__
        walk.add_root(model, _root(name), HolderKind.MODEL, None, SourceHint(name))
    for _name, called in modules:
        walk.add_class(type(called))
    walk.run()
    graphs = Budget(budget * GRAPH_SHARE)
    holders = _freeze_holders(walk, graphs, since)
    holders += _gradient_holders(walk, modules, graphs, since)
    newest = [h.graph_newest for h in holders if h.graph_newest is not None]
    return Census(
        iteration=iteration,
        seconds=time.perf_counter() - started,
        complete=not walk.budget.exhausted,
        graphs_complete=not graphs.exhausted,
        objects=walk.visited,
        holders=tuple(holders),
        hooks=_hooks(modules, own_hooks, files),
        garbage=garbage,
        graph_newest=max(newest, default=None),
    )


def _hooks(modules: list[tuple[str, nn.Module]], own: set[int], files: list[str]
           ) -> tuple[HookStats, ...]:
    """The user's hooks per module and globally, and the callbacks registered with
    :mod:`atexit` (the line that registers them searched in ``files``)."""
    hooks = hook_census(modules, own)
    exits = exit_callbacks(files)
    return hooks if exits is None else (*hooks, exits)


def find_holders(pointers: set[int], roots: list[Root], *, budget: float = 1.0
                 ) -> tuple[list[HeldTensor], bool]:
    """Who holds the tensors whose storage starts at one of ``pointers``.

    Walks ``roots`` first, then the globals of the user's modules and their classes'
    attributes, breadth first, so each tensor gets its shortest path. Returns the tensors found
    (each storage once) and whether the walk finished within ``budget`` seconds. Nothing found
    is kept alive.
    """
    walk = Walk(Budget(budget), set(), set(), targets=set(pointers),
                live_frames=running_frames(sys._getframe()))
    for root in roots:
        walk.add_root(root.obj, root.path, root.kind, root.scope,
                      SourceHint(root.path[-1].name if root.path else ""))
    for module in user_modules():
        add_globals(walk, vars(module), module.__name__, getattr(module, "__file__", None),
                    classes=True)
    walk.run()
    return walk.tally.found, not walk.budget.exhausted


class FilledAt(NamedTuple):
    """The line that fills a holder (``where``) and the full path of its file (``source``);
    both ``None`` when no line was found."""

    where: Location | None
    source: str | None


_NOWHERE = FilledAt(None, None)


def _where(holder: Holder) -> FilledAt:
    """The line of the user's code that fills the holder, with the full path of its file (for
    tensors chained through an attribute, the line that sets it: ``out.prev = last``); for
    an attribute a library's class fills (``queue.Queue``'s ``queue``), the line that grows
    its root (``q.put(x)``); for a global of an installed package, see :func:`_package_line`;
    else the fallback line (where its frame stood)."""
    hint = holder.hint
    user = [path for path in hint.files if not is_library_file(path)]
    found = _package_line(holder, user) if holder.kind == HolderKind.PACKAGE \
        else _user_line(holder, user)
    if found is None and hint.files and hint.fallback_line is not None:
        found = FilledAt(Location(short_path(hint.files[0]), hint.fallback_line), hint.files[0])
    return found or _NOWHERE


def _user_line(holder: Holder, user: list[str]) -> FilledAt | None:
    """The line of the user's ``user`` files that fills the holder, chains its tensors or,
    for an attribute a library's class fills, grows its root."""
    hint = holder.hint
    found = _chained_line(holder, user) or _growth_in(user, hint.name, hint.function_line)
    if found is None and _filled_by_library(holder, user):
        found = _growth_in(user[-1:], holder.path[0].name, None)
    return found


def _package_line(holder: Holder, user: list[str]) -> FilledAt | None:
    """For a global of an installed package (``lib._seen``), the user's line that fills it
    itself (``lib._seen.append(x)``); else none here, and the hint's fallback is the call of
    the package's function that fills it."""
    for path in user:
        line = attribute_line(path, holder.path[0].name, holder.hint.name)
        if line is not None:
            return FilledAt(Location(short_path(path), line), path)
    return None


def _chained_line(holder: Holder, user: list[str]) -> FilledAt | None:
    """For tensors chained through an attribute, the line that sets it (``out.prev =
    last``)."""
    return _growth_in(user, holder.chained, None) if holder.chained else None


def _growth_in(files: list[str], name: str, function_line: int | None) -> FilledAt | None:
    """The line that grows ``name`` in the first of ``files`` that has one."""
    for path in files:
        line = growth_line(path, name, function_line=function_line)
        if line is not None:
            return FilledAt(Location(short_path(path), line), path)
    return None


def _filled_by_library(holder: Holder, user: list[str]) -> bool:
    """Whether the holder is an attribute that a library's class fills: its path goes below
    its root, and some of its hint's files (not all: ``user``) are the library's."""
    return len(holder.path) > 1 and 0 < len(user) < len(holder.hint.files)


def _feed(holder: Holder, where: Location | None, source: str | None) -> Feed | None:
    """For ``x.attr`` filled inside a method of ``x``'s class (at ``where``, in ``source``),
    the call of that method in the code that holds ``x`` (the last of the hint's files: the
    root's)."""
    hint = holder.hint
    if where is None or len(holder.path) < 2 or holder.path[1].kind != StepKind.ATTRIBUTE \
            or len(hint.files) < 2:
        return None
    return feeding_call(source, where.line, hint.files[-1], holder.path[0].name)


def _step_line(holder: Holder, source: str | None) -> int | None:
    """Where the holder's frame stood at the census (the loop's ``optimizer.step()``), when
    the line that fills it is in that frame's file."""
    hint = holder.hint
    return hint.fallback_line if source and hint.files and hint.files[0] == source else None


def _freeze(holder: Holder, graph: GraphSize, untrained: int | None) -> HolderStats:
    filled = _where(holder)
    where, source = filled.where, filled.source
    line = where.line if where else None
    added = added_value(source, line, holder.hint.name)
    rewrite = rewritten(source, line, holder.hint.name) if added is None else None
    return HolderStats(
        path=holder.path, kind=holder.kind, scope=holder.scope, where=where,
        added=added, rewrite=rewrite, feed=_feed(holder, where, source),
        rebound=rebound_each_step(source, line, holder.hint.name, _step_line(holder, source)),
        items=holder.items, tensors=holder.tensors, bytes=holder.bytes,
        graph_tensors=holder.graph_tensors, graph_nodes=graph.nodes,
        graph_saved_bytes=graph.saved, graph_oldest=graph.oldest, graph_newest=graph.newest,
        graph_kept=graph.kept,
        modules=holder.modules, bound=holder.bound, shared_bytes=holder.shared_bytes,
        arrays=holder.arrays, nodes=holder.nodes, buffers=holder.buffers,
        container=holder.container, chained=holder.chained, untrained=untrained,
    )


def _freeze_holders(walk: Walk, budget: Budget, since: int | None) -> list[HolderStats]:
    """Each holder with the autograd graph it reaches. A graph two holders reach (a state
    carried into the next iteration and an output of the same call) is credited to the holder
    declared first: the state set up before the loop, not the loop's own output."""
    graphs: dict[int, GraphSize] = {}
    nodes_seen: set[int] = set()
    for holder in sorted(walk.tally.holders.values(), key=walk.declared):
        graphs[id(holder)] = graph_size(walk, holder.grad_fns, nodes_seen, budget, since) \
            if holder.grad_fns else GraphSize(0, 0)
        holder.grad_fns.clear()
    return [_freeze(holder, graphs[id(holder)], walk.tally.untrained(holder))
            for holder in walk.tally.holders.values()]


def _gradient_holders(walk: Walk, modules: list[tuple[str, nn.Module]], budget: Budget,
                      since: int | None) -> list[HolderStats]:
    """Parameters whose ``.grad`` carries a ``grad_fn`` (``backward(create_graph=True)``): one
    holder for all of them, named after the first; ``items`` counts them."""
    paths: list[tuple[Step, ...]] = []
    grad_fns, size = [], 0
    for module_name, module in modules:
        for param_name, param in module._parameters.items():
            grad = None if param is None else param.grad
            if grad is not None and grad.grad_fn is not None:
                steps = [*module_name.split("."), param_name] if module_name else [param_name]
                paths.append((Step(StepKind.ROOT, steps[0]),
                              *(Step(StepKind.ATTRIBUTE, s) for s in [*steps[1:], "grad"])))
                grad_fns.append(grad.grad_fn)
                size += walk.tally.count_bytes(grad)
    if not paths:
        return []
    graph = graph_size(walk, grad_fns, set(), budget, since)
    grad_fns.clear()
    return [
        HolderStats(
            path=paths[0], kind=HolderKind.GRADIENT, scope=None, where=None, items=len(paths),
            tensors=len(paths), bytes=size, graph_tensors=len(paths), graph_nodes=graph.nodes,
            graph_saved_bytes=graph.saved, graph_oldest=graph.oldest,
            graph_newest=graph.newest, graph_kept=graph.kept,
        )
    ]
