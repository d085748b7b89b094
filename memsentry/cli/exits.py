"""The end python gives a program that an uncaught ``KeyboardInterrupt`` stopped, for
``memsentry run`` (:func:`end_interrupted`).

When ``KeyboardInterrupt`` leaves the main module, python notes it; once the threads that
are not daemons are joined and the ``atexit`` functions have run, it dies of SIGINT where the
note still stands (so that a shell knows of the Ctrl-C), and exits with status 1 where it
does not. Code compiled from a string that runs meanwhile (``exec`` or ``eval`` of a string,
as the first import of a module that makes a named tuple or a dataclass does) clears the
note: with torch 2.13's compiler imported (an optimizer imports it), one of torch's ``atexit``
functions imports ``tabulate`` for the first time, and python exits with status 1.

``memsentry run`` leaves the decision to python itself: the interrupt leaves memsentry's
entry point again, without a second traceback (the script's was printed before the report),
and python joins the threads, runs the ``atexit`` functions and decides. What memsentry
imported for itself is first put out of the program's sight, so that a late import does what
it would have done under python: the modules of memsentry's own packages (:data:`OWN`) and
of the packages its report imported first, unless the script's own modules hold them.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Collection, Iterable
from typing import NoReturn

#: memsentry's own third-party packages, imported before the script starts (torch imports
#: neither): under python a program meets them only where it imports them itself.
OWN = ("tabulate", "wcwidth")


def end_interrupted(started: Collection[str], ended: Collection[str],
                    main: types.ModuleType) -> NoReturn:
    """End as python ends the script after an uncaught ``KeyboardInterrupt``. ``started``
    and ``ended``: the names in ``sys.modules`` as the script began and as it ended;
    ``main``: the script's module."""
    hide_own_modules(started, ended, main)
    _silence_once()
    raise KeyboardInterrupt


def hide_own_modules(started: Collection[str], ended: Collection[str],
                     main: types.ModuleType) -> None:
    """Take out of ``sys.modules`` the modules the program would not have found there under
    python: those of :data:`OWN`, and those of the packages first imported after the script
    ended; a package that the script's module, or a module first imported while it ran,
    holds stays (memsentry's own modules stay too)."""
    loaded_then = {_package(name) for name in ended}
    program = [main, *(sys.modules.get(name) for name in set(ended) - set(started)
                       if _package(name) != "memsentry")]
    kept = {"memsentry", *_held_packages(program)}
    for name, module in list(sys.modules.items()):
        package = _package(name)
        if package in kept:
            continue
        if (package in OWN or package not in loaded_then) and _pure_python(module):
            del sys.modules[name]  # an extension module is never loaded twice: it stays


def _package(name: str) -> str:
    return name.partition(".")[0]


def _pure_python(module: types.ModuleType | None) -> bool:
    file = getattr(module, "__file__", None)
    return isinstance(file, str) and file.endswith(".py")


def _held_packages(modules: Iterable[types.ModuleType | None]) -> set[str]:
    """The packages whose modules, classes or functions ``modules`` hold in their globals."""
    held = set()
    for module in modules:
        for value in list(getattr(module, "__dict__", {}).values()):
            if isinstance(value, types.ModuleType):
                owner = value.__name__
            elif isinstance(value, type | types.FunctionType | types.BuiltinFunctionType):
                owner = value.__module__
            else:
                continue
            if isinstance(owner, str):
                held.add(_package(owner))
    return held


def _silence_once() -> None:
    """The next call of ``sys.excepthook`` prints nothing and puts the hook back: python's own
    print of the interrupt leaving memsentry's entry point."""
    hook = sys.excepthook

    def silent(kind: type[BaseException], value: BaseException,
               tb: types.TracebackType | None) -> None:
        sys.excepthook = hook

    sys.excepthook = silent


__all__ = ["OWN", "end_interrupted", "hide_own_modules"]
