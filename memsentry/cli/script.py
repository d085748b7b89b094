"""Running a script as ``python script.py`` and ``python -m module`` do, for ``memsentry run``.

The script's code runs in a fresh module installed as ``sys.modules["__main__"]`` for the whole
run (its report included), with the attributes python gives its main module: ``__file__``
absolute as python makes it (the working directory joined to the path given, not
normalised), ``__spec__`` ``None`` for a path and the module's spec for ``-m``, python's
loader, ``__builtins__`` the module. ``sys.argv`` is the script's, ``sys.path[0]`` the
script's real directory (or the working directory for ``-m``): it replaces the entry python
made for memsentry's own start, which python would not give the script. So pickling a
function defined in the script works, and multiprocessing's spawn finds the script's
functions in its children, as they do under python.

A script's uncaught exception is printed through ``sys.excepthook`` without memsentry's and
runpy's frames, as python prints it; :func:`exit_status` is python's exit status for it.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import os
import runpy
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.machinery import ModuleSpec, SourceFileLoader

import memsentry


@dataclass(frozen=True)
class Outcome:
    """How the script ended: the exit status python would give (1 for an uncaught exception,
    whose ``error`` is kept), and the exception that ended it (``None`` when it returned)."""

    status: int
    error: BaseException | None = None


class Script:
    """A script (or module, with ``-m``) compiled and ready to run as ``__main__``."""

    def __init__(self, code: types.CodeType, module: types.ModuleType, argv: list[str],
                 path0: str) -> None:
        self.code = code
        self.module = module
        self.argv = argv
        self.path0 = path0

    @classmethod
    def from_path(cls, path: str, args: list[str]) -> Script:
        """``python path args``: raises ``OSError`` when the file cannot be read and
        ``SyntaxError`` (or ``ValueError``) when it does not compile."""
        full = path if os.path.isabs(path) else os.path.join(os.getcwd(), path)
        with io.open_code(full) as handle:
            source = handle.read()
        code = compile(source, full, "exec", dont_inherit=True)
        module = _main_module(file=full, loader=SourceFileLoader("__main__", full))
        return cls(code, module, [path, *args], os.path.dirname(os.path.realpath(full)))

    @classmethod
    def from_module(cls, name: str, args: list[str]) -> Script:
        """``python -m name args``: imports the module's parent packages, as python does;
        raises ``ImportError`` when it cannot be found, or what its parents raise."""
        saved_argv, saved_path, path0 = sys.argv, sys.path[:], os.getcwd()
        sys.argv = ["-m", *args]  # python's argv while it looks for the module
        sys.path[:] = _script_path(path0)
        try:
            found: tuple[str, ModuleSpec, types.CodeType] = (
                runpy._get_module_details(name))  # type: ignore[attr-defined]
        finally:
            sys.argv, sys.path[:] = saved_argv, saved_path
        _name, spec, code = found
        module = _main_module(file=spec.origin, loader=spec.loader, spec=spec)
        module.__cached__ = spec.cached  # type: ignore[attr-defined]
        module.__package__ = spec.parent
        return cls(code, module, [spec.origin or name, *args], path0)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """``sys.argv``, ``sys.path[0]`` and ``sys.modules["__main__"]`` as python sets them
        for the script, put back afterwards."""
        saved_argv, saved_path = sys.argv, sys.path[:]
        saved_main = sys.modules.get("__main__")
        sys.argv = self.argv[:]
        sys.path[:] = _script_path(self.path0)
        sys.modules["__main__"] = self.module
        try:
            yield
        finally:
            sys.argv, sys.path[:] = saved_argv, saved_path
            if saved_main is not None:
                sys.modules["__main__"] = saved_main

    def run(self) -> Outcome:
        """Run the script's code; how it ended (a ``SystemExit``'s message is printed, as
        python prints it at exit)."""
        try:
            exec(self.code, self.module.__dict__)
        except SystemExit as stop:
            return Outcome(exit_status(stop), stop)
        except BaseException as error:  # whatever python itself would print
            return Outcome(1, error)
        return Outcome(0)


def _main_module(*, file: str | None, loader: object,
                 spec: ModuleSpec | None = None) -> types.ModuleType:
    module = types.ModuleType("__main__")
    module.__annotations__ = {}
    module.__builtins__ = builtins  # type: ignore[attr-defined]
    module.__loader__ = loader  # type: ignore[assignment]
    module.__spec__ = spec
    if file is not None:
        module.__file__ = file
    module.__cached__ = None  # type: ignore[attr-defined]
    return module


def _script_path(path0: str) -> list[str]:
    """``sys.path`` for the script: ``path0`` first, in place of the entry python made for
    the program now running (the console script's folder, or the working directory of
    ``python -m memsentry``), else before everything."""
    path = sys.path[:]
    main = sys.modules.get("__main__")
    if path and path[0] == _start_entry(main):
        replaced = path.pop(0)
        root = os.path.dirname(os.path.dirname(os.path.abspath(memsentry.__file__)))
        if os.path.abspath(replaced or ".") == root and root not in path:
            path.append(root)  # memsentry imports from there later on
    return [path0, *path]


def _start_entry(main: types.ModuleType | None) -> str | None:
    """The ``sys.path[0]`` python made for the ``__main__`` module now running."""
    if main is None:
        return None
    if getattr(main, "__spec__", None) is not None:
        return os.getcwd()
    file = getattr(main, "__file__", None)
    return os.path.dirname(os.path.realpath(file)) if isinstance(file, str) else None


def exit_status(stop: SystemExit) -> int:
    """The exit status python gives ``SystemExit(code)``, printing a code that is neither a
    number nor ``None`` on standard error, as python does."""
    code = stop.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    try:
        print(code, file=sys.stderr)
    except Exception:  # python ignores a failure to print it too
        pass
    return 1


def _is_machinery(frame: types.FrameType) -> bool:
    name = frame.f_globals.get("__name__")
    return isinstance(name, str) and (name == "runpy" or name.split(".")[0] == "memsentry")


def without_machinery(tb: types.TracebackType | None) -> types.TracebackType | None:
    """``tb`` without the frames of memsentry and runpy that the error only went through:
    the command's own frames before the script's module, and memsentry's wrappers inside
    the loop (its ``torch.autograd.backward``), as python itself would show it. Frames of
    memsentry's where the error was raised stay, the frames that called them too; none
    where the script's code never ran (a syntax error, which python shows without any)."""
    entries = _entries(tb)
    if all(_is_machinery(entry.tb_frame) for entry in entries):
        return None
    return _rebuilt(_kept(entries))


def _entries(tb: types.TracebackType | None) -> list[types.TracebackType]:
    """The entries of ``tb``, outermost first."""
    entries = []
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    return entries


def _kept(entries: list[types.TracebackType]) -> list[types.TracebackType]:
    """The entries to show, innermost first: memsentry's and runpy's only where no frame of
    another's comes after them (where the error was raised, and what called that)."""
    kept: list[types.TracebackType] = []
    foreign_after = False  # a frame not memsentry's comes later
    for entry in reversed(entries):
        machinery = _is_machinery(entry.tb_frame)
        if foreign_after and machinery:
            continue
        kept.append(entry)
        foreign_after = foreign_after or not machinery
    return kept


def _rebuilt(kept: list[types.TracebackType]) -> types.TracebackType | None:
    """A traceback of the ``kept`` entries (innermost first), outermost first again."""
    rebuilt = None
    for entry in kept:  # innermost first
        # An entry whose instruction has no line (a signal that arrived between two) says
        # None: it is rebuilt at its frame's line, the one python would show for it.
        line = entry.tb_lineno if entry.tb_lineno is not None else entry.tb_frame.f_lineno
        rebuilt = types.TracebackType(rebuilt, entry.tb_frame, entry.tb_lasti, line or 0)
    return rebuilt


def _trim(error: BaseException, seen: set[int]) -> None:
    """Trim ``error``'s traceback and those of the errors chained to it."""
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        error.__traceback__ = without_machinery(error.__traceback__)
        if error.__cause__ is not None:
            _trim(error.__cause__, seen)
        error = error.__context__  # type: ignore[assignment]


def print_error(error: BaseException) -> None:
    """Print ``error`` as python prints an uncaught exception: through ``sys.excepthook``
    (the script may have set its own), without memsentry's frames."""
    try:
        _trim(error, set())
    except Exception:  # a traceback it cannot rebuild: shown whole, memsentry's frames too
        pass
    tb = error.__traceback__
    try:
        sys.excepthook(type(error), error, tb)
    except Exception:  # a broken hook: python then prints with its own
        sys.__excepthook__(type(error), error, tb)


__all__ = ["Outcome", "Script", "exit_status", "print_error", "without_machinery"]
