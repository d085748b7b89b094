"""Places the interpreter keeps the user's objects where no module's globals lead: the values
of context variables, signal handlers and the callbacks registered with :mod:`atexit`.

A ``ContextVar``'s value lives in the running context (``contextvars.copy_context()`` lists
it), named here as the code reads it: ``seen.get()`` through the global that holds the
variable. A signal handler is named ``signal.getsignal(signal.SIGTERM)``. What
:func:`atexit.register` keeps cannot be read from Python (CPython keeps the callbacks in the
interpreter's state; only their number is exposed, ``atexit._ncallbacks()``), so they are
counted, like hooks, with the line that registers them.
"""

from __future__ import annotations

import ast
import contextvars
import functools
import signal
import types
from collections.abc import Iterable
from typing import Any

from memsentry.census.children import atomic, walks_into
from memsentry.census.hooks import exit_count
from memsentry.census.tally import SourceHint
from memsentry.census.walk import OPAQUE, Walk
from memsentry.model import (
    EXIT_REGISTRY,
    HolderKind,
    HookStats,
    Location,
    Scope,
    ScopeKind,
    Step,
    StepKind,
)
from memsentry.usercode.lines import mtime, nodes, short_path


def _global_names(modules: Iterable[types.ModuleType], wanted: set[int]
                  ) -> dict[int, tuple[str, str, str | None]]:
    """For the objects whose ids are ``wanted``: the global that names each in the user's
    modules, (its name, the module's name, the module's file)."""
    found: dict[int, tuple[str, str, str | None]] = {}
    for module in modules:
        for name, value in list(vars(module).items()):
            if id(value) in wanted and id(value) not in found:
                found[id(value)] = (name, module.__name__, getattr(module, "__file__", None))
    return found


def add_context_values(walk: Walk, modules: Iterable[types.ModuleType]) -> None:
    """The values the running context gives its ``ContextVar`` objects, as roots named
    ``var.get()`` by the global that holds the variable (``ContextVar('name').get()`` when no
    user module names it)."""
    values = [(var, value) for var, value in contextvars.copy_context().items()
              if not atomic(value) and not isinstance(value, OPAQUE)]
    if not values:
        return
    names = _global_names(modules, {id(var) for var, _ in values})
    for var, value in values:
        named = names.get(id(var))
        if named is None:
            path = (Step(StepKind.ROOT, f"ContextVar({var.name!r}).get()"),)
            walk.add_root(value, path, HolderKind.GLOBAL, Scope(ScopeKind.MODULE, "contextvars"),
                          SourceHint(var.name))
            continue
        name, module, file = named
        walk.add_root(value, (Step(StepKind.ROOT, f"{name}.get()"),), HolderKind.GLOBAL,
                      Scope(ScopeKind.MODULE, module), SourceHint(name, (file,) if file else ()))


def add_signal_handlers(walk: Walk) -> None:
    """The user's signal handlers (and what they captured), as roots named
    ``signal.getsignal(signal.SIGTERM)``."""
    for number in signal.valid_signals():
        try:
            handler = signal.getsignal(number)
        except (ValueError, OSError):
            continue
        if handler is None or not callable(handler) or not walks_into(handler):
            continue
        name = _signal_name(number)
        walk.add_root(handler, (Step(StepKind.ROOT, f"signal.getsignal({name})"),),
                      HolderKind.GLOBAL, Scope(ScopeKind.MODULE, "signal"), SourceHint("signal"))


def _signal_name(number: int) -> str:
    try:
        return f"signal.{signal.Signals(number).name}"
    except ValueError:
        return str(number)


def exit_callbacks(files: Iterable[str]) -> HookStats | None:
    """How many callbacks are registered with :mod:`atexit`, with the first line of ``files``
    that registers one; ``None`` where there are none or their number cannot be read."""
    registered = exit_count()
    if not registered:
        return None
    where = None
    for path in files:
        line = _register_line(path, mtime(path))
        if line is not None:
            where = Location(short_path(path), line)
            break
    return HookStats(EXIT_REGISTRY, registered, registered=where)


@functools.lru_cache(maxsize=256)
def _register_line(path: str, stamp: float | None) -> int | None:
    """The first line of ``path`` that calls ``atexit.register(...)`` (not as a decorator:
    that registers once)."""
    lines = [node.lineno for node, _function in nodes(path, stamp)
             if isinstance(node, ast.Call) and _is_atexit_register(node.func)]
    return min(lines) if lines else None


def _is_atexit_register(func: Any) -> bool:
    return isinstance(func, ast.Attribute) and func.attr == "register" \
        and isinstance(func.value, ast.Name) and func.value.id == "atexit"
