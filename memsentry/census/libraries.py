"""The module-level state of the installed packages the user's code calls.

A package can keep what it is handed in its own globals (a registry dict, a list of every
value it was given, an ``lru_cache`` on a function of tensors). Walking every module of
``sys.modules`` costs tens of milliseconds a census (86 ms with torch and transformers
loaded, against 1.3 to 4 ms for a whole census), so only the packages named by the code
running (the frames on the stack and their modules) are looked at: one bound to a name
(``import fakelib``, ``import fakelib as fl``), or the module of a function imported from
one (``from fakelib import register``); a test suite's other modules (which import
hypothesis or radon) do not add theirs to every census. Of those,
only the containers and function caches among their globals are roots, named as the user
spells the module (``fl._seen``); the line given is the user's call of the package's
function that touches that global (``fl.remember(out)``). Frameworks and the scientific
stack (``MACHINERY``: torch, numpy, transformers, lightning...) are left out: their state is
their business, and what the user hands them is met from the user's side.
"""

from __future__ import annotations

import collections
import functools
import sys
import types
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

from memsentry.census.children import CACHES
from memsentry.census.tally import SourceHint
from memsentry.census.walk import Walk
from memsentry.model import HolderKind, Scope, ScopeKind, Step, StepKind
from memsentry.usercode.frames import MACHINERY, is_stdlib, root_package
from memsentry.usercode.lines import call_line

#: The globals of a package that are roots: containers and function caches.
_STATE = (list, dict, set, collections.deque, *CACHES)


class Package(NamedTuple):
    """An installed package's module the user's code names: how it spells the module
    (``None`` when only functions imported from it are used), the names its functions are
    called by in the user's code (``{"register": "register"}``: the function's own name ->
    the user's name), and the user's file."""

    module: types.ModuleType
    spelled: str | None
    functions: dict[str, str]
    user_file: str | None


def code_names(namespace: dict[str, Any]) -> dict[str, Any]:
    """The modules and functions among a frame's locals (``import fakelib`` inside
    ``main()``), kept past the frame's release for :func:`packages`."""
    return {name: value for name, value in namespace.items()
            if issubclass(type(value), types.ModuleType | types.FunctionType)}


def _third_party(module: Any) -> bool:
    """An installed package's module, not the standard library's nor the machinery's."""
    path = getattr(module, "__file__", None)
    return isinstance(path, str) and "-packages" in path and not is_stdlib(path) \
        and root_package(getattr(module, "__name__", None)) not in MACHINERY


def _named(namespace: dict[str, Any]) -> Iterator[tuple[str, Any, str | None]]:
    """(name in the user's module, the package's module, the function's own name or
    ``None`` for the module itself) for each global bound to a package or one of its
    functions."""
    for name, value in list(namespace.items()):
        kind = type(value)  # not isinstance: it asks a dead weakref.proxy for its class
        if issubclass(kind, types.ModuleType):
            if _third_party(value):
                yield name, value, None
        elif issubclass(kind, types.FunctionType):
            module = _module_of(value)
            if module is not None and _third_party(module):
                yield name, module, value.__name__


def _module_of(function: types.FunctionType) -> types.ModuleType | None:
    globals_ = function.__globals__
    module = globals_.get("__spec__")
    name = getattr(module, "name", None) or globals_.get("__name__")
    found = sys.modules.get(name) if isinstance(name, str) else None
    return found if isinstance(found, types.ModuleType) else None


def packages(namespaces: Sequence[tuple[dict[str, Any], str | None]]) -> list[Package]:
    """The packages the user's modules (their globals and files) name, each once, as the
    first module that names it spells it."""
    found: dict[int, Package] = {}
    for namespace, path in namespaces:
        for name, module, function in _named(namespace):
            package = found.setdefault(id(module), Package(module, None, {}, path))
            if function is None and package.spelled is None:
                found[id(module)] = package = package._replace(spelled=name)
            if function is not None:
                package.functions.setdefault(function, name)
    return list(found.values())


@functools.lru_cache(maxsize=256)
def _state_names(module_name: str, namespace: int, size: int) -> tuple[str, ...]:
    """The globals of a package's module that are containers or caches, found again only
    when its namespace is another or changed in size (sympy's has thousands of names: going
    through it at every census cost 2 ms)."""
    module = sys.modules.get(module_name)
    if module is None or id(vars(module)) != namespace:
        return ()
    return tuple(name for name, value in list(vars(module).items())
                 if not name.startswith("__") and isinstance(value, _STATE))


@functools.lru_cache(maxsize=4096)
def _touching(module_name: str, global_name: str) -> tuple[str, ...]:
    """The module's functions whose code names ``global_name`` (the package's functions that
    fill it), as the module defines them."""
    module = sys.modules.get(module_name)
    if module is None:
        return ()
    return tuple(sorted(
        name for name, value in list(vars(module).items())
        if isinstance(value, types.FunctionType) and value.__module__ == module_name
        and global_name in value.__code__.co_names))


def _callers(package: Package, global_name: str) -> set[str]:
    """How the user's code calls the functions of ``package`` that touch ``global_name``:
    ``fl.remember`` through the module's name, ``register`` as imported."""
    touching = _touching(package.module.__name__, global_name)
    spelled = {f"{package.spelled}.{name}" for name in touching} if package.spelled else set()
    return spelled | {package.functions[name] for name in touching if name in package.functions}


def add_package_state(walk: Walk, namespaces: Sequence[tuple[dict[str, Any], str | None]]
                      ) -> None:
    """The containers and caches among the globals of the packages the user's modules name,
    as roots (see the module's docstring)."""
    for package in packages(namespaces):
        module = package.module
        prefix = package.spelled or module.__name__
        scope = Scope(ScopeKind.MODULE, module.__name__)
        library = getattr(module, "__file__", None)
        namespace = vars(module)
        for name in _state_names(module.__name__, id(namespace), len(namespace)):
            value = namespace.get(name)
            if not isinstance(value, _STATE):
                continue
            callers = _callers(package, name)
            line = call_line(package.user_file, callers) if callers else None
            files = tuple(f for f in (package.user_file, library) if f)
            hint = SourceHint(name, files, None, line)  # line: where the user calls the filler
            walk.add_root(value, (Step(StepKind.ROOT, prefix), Step(StepKind.ATTRIBUTE, name)),
                          HolderKind.PACKAGE, scope, hint)
