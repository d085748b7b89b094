"""Which frames, modules and classes belong to the user's code, and the user's line on the stack.

Machinery is torch, memsentry, test runners, notebook shells and the standard library; the
user's code is everything else (a script, a notebook cell, the user's own package).
"""

from __future__ import annotations

import inspect
import sys
import sysconfig
import types
import weakref
from typing import Any

from memsentry.usercode.lines import short_path
from memsentry.usercode.location import Location

#: Packages whose frames and objects are machinery, not the user's training code.
MACHINERY = frozenset(
    {"torch", "memsentry", "pytest_memsentry", "_pytest", "pytest", "pluggy", "IPython",
     "ipykernel", "traitlets", "tornado", "asyncio", "runpy", "importlib", "contextlib",
     "functools", "threading", "unittest", "typing", "abc", "collections", "numpy", "xdist",
     "execnet", "coverage", "debugpy", "pydevd",
     # training frameworks and what they bring: their loops' frames, globals and objects are
     # not the user's code (a holder reached only through them is named from the user's side)
     "lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities",
     "torchmetrics", "transformers", "accelerate", "huggingface_hub", "safetensors",
     "tokenizers", "datasets", "peft", "deepspeed", "tqdm", "rich", "tensorboard",
     "tensorboardX", "wandb", "mlflow", "jsonargparse", "fsspec"}
)
_STDLIB = tuple({sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib")})

_SOURCE_FILES: weakref.WeakKeyDictionary[type, str | None] = weakref.WeakKeyDictionary()
#: (name, id) -> (the module, weakly, whether it is the user's).
_MODULE_KINDS: dict[tuple[str, int], tuple[weakref.ref[Any], bool]] = {}
#: The last answer of :func:`user_modules`: (size of sys.modules and id of ``__main__``,
#: (name, module weakly) of each user module).
_USER_MODULES: tuple[tuple[int, int], list[tuple[str, weakref.ref[Any]]]] | None = None
#: Code object -> whether its frames are machinery. Code objects of exec'd cells come and go:
#: bounded, then the answer is worked out again each time.
_MACHINERY_CODE: dict[types.CodeType, bool] = {}
_MACHINERY_CODE_LIMIT = 65536


def root_package(name: str | None) -> str:
    """``torch`` for ``torch.nn.modules``."""
    return (name or "").partition(".")[0]


def is_stdlib(path: str | None) -> bool:
    return path is not None and path.startswith(_STDLIB) and "-packages" not in path


def is_library_file(path: str) -> bool:
    """A file of the standard library or of an installed package: not the user's code."""
    return is_stdlib(path) or "-packages" in path


def is_machinery_frame(frame: types.FrameType) -> bool:
    """Frames of torch, memsentry, pytest, the standard library and notebook shells
    (remembered per code object: the storage counter asks for every new storage)."""
    code = frame.f_code
    known = _MACHINERY_CODE.get(code)
    if known is None:
        filename = code.co_filename
        known = (root_package(frame.f_globals.get("__name__")) in MACHINERY
                 or filename.startswith("<frozen") or is_stdlib(filename))
        if len(_MACHINERY_CODE) < _MACHINERY_CODE_LIMIT:
            _MACHINERY_CODE[code] = known
    return known


def is_user_class(cls: type) -> bool:
    """A class defined in the user's code (not a library's, not a builtin)."""
    module = sys.modules.get(cls.__module__)
    if module is None or root_package(cls.__module__) in MACHINERY | {"builtins"}:
        return False
    return not is_stdlib(getattr(module, "__file__", None))


def source_file(cls: type) -> str | None:
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


def user_site() -> Location | None:
    """The line (and function) of the innermost frame of the user's code on the stack, or
    ``None`` when there is none."""
    return site_location(user_line(sys._getframe(1)))


def user_line(frame: types.FrameType | None) -> tuple[types.CodeType, int] | None:
    """The code and line of the innermost frame of the user's code from ``frame`` outwards,
    or ``None`` when there is none: what :func:`site_location` makes a location of, later
    (the storage counter asks for the line of every new storage, and reads few of them)."""
    known = _MACHINERY_CODE.get
    while frame is not None:
        machinery = known(frame.f_code)  # the usual answer, without a call
        if not (is_machinery_frame(frame) if machinery is None else machinery):
            return frame.f_code, frame.f_lineno or 0
        frame = frame.f_back
    return None


def site_location(line: tuple[types.CodeType, int] | None) -> Location | None:
    """The location of a line :func:`user_line` found."""
    if line is None:
        return None
    code, lineno = line
    return Location(short_path(code.co_filename), lineno, code.co_name)


def user_frames(start: types.FrameType | None) -> list[types.FrameType]:
    """The user's frames on the stack, innermost first."""
    frames = []
    frame = start
    while frame is not None:
        if not is_machinery_frame(frame):
            frames.append(frame)
        frame = frame.f_back
    return frames


def running_frames(frame: types.FrameType | None) -> set[int]:
    """The ids of ``frame`` and every frame below it on the stack."""
    running = set()
    while frame is not None:
        running.add(id(frame))
        frame = frame.f_back
    return running


def spelled_name(obj: Any, frame: types.FrameType | None, *, frames: int | None = 1
                 ) -> str | None:
    """The name the user's code calls ``obj`` by, from the innermost of the user's frames on
    the stack outwards (``frames`` of them; ``None``: all): a local or global bound to it
    (``netG``, ``train_set``), or an attribute of that frame's ``self`` (``self.critic``:
    ``critic``); ``None`` when none is."""
    found = user_frames(frame)
    try:
        for user_frame in found[:frames]:
            name = _name_in(user_frame, obj)
            if name is not None:
                return name
    finally:
        for user_frame in found:
            release_locals(user_frame)
        del found
    return None


def _name_in(frame: types.FrameType, obj: Any) -> str | None:
    """The local or global of ``frame`` bound to ``obj``, else the attribute of its ``self``
    that is; ``None`` when none is."""
    names = frame_locals(frame)
    for scope in (names, frame.f_globals):
        for name, value in list(scope.items()):
            if value is obj and name.isidentifier() and name != "self":
                return name
    return _attribute_name(names.get("self"), obj)


def _attribute_name(instance: Any, obj: Any) -> str | None:
    """The attribute of ``instance`` bound to ``obj`` (``critic`` for ``self.critic``)."""
    for name, value in list(getattr(instance, "__dict__", {}).items()):
        if value is obj and name.isidentifier():
            return name
    return None


def frame_locals(frame: types.FrameType) -> dict[str, Any]:
    """A copy of a frame's locals (call :func:`release_locals` when done with the frame)."""
    return dict(frame.f_locals)


#: Whether reading ``f_locals`` leaves a snapshot dict on a function frame (before 3.13).
_SNAPSHOTS = sys.version_info < (3, 13)


def one_local(frame: types.FrameType, name: str) -> tuple[bool, Any]:
    """Whether the function frame ``frame`` has the local ``name`` bound, and its value: the
    snapshot dict Python before 3.13 makes is read once and emptied again (see
    :func:`release_locals`), a later one's proxy read."""
    values = frame.f_locals
    try:
        return name in values, values.get(name)
    finally:
        if _snapshots(frame):
            _empty(frame, values)


def release_locals(frame: types.FrameType) -> None:
    """Before Python 3.13 reading ``f_locals`` leaves a snapshot dict on a function frame that
    keeps every local's value alive after the code rebinds it; empty it again. The interpreter
    refreshes it whenever someone reads it (debuggers, ``locals()``); the one visible effect is
    on a dict that the function got from ``locals()`` earlier and still reads without calling
    ``locals()`` again: it is that same dict, and it is empty after a census (or a reading of
    the length of a container among its locals, at a boundary)."""
    if _snapshots(frame):
        _empty(frame, frame.f_locals)


def _snapshots(frame: types.FrameType) -> bool:
    """Whether reading ``frame``'s ``f_locals`` left a snapshot dict on it."""
    return _SNAPSHOTS and bool(frame.f_code.co_flags & inspect.CO_OPTIMIZED)


def _empty(frame: types.FrameType, snapshot: Any) -> None:
    if snapshot is not frame.f_globals:
        snapshot.clear()


def _judge(name: str, module: Any) -> bool:
    path = getattr(module, "__file__", None)
    return bool(isinstance(path, str) and root_package(name) not in MACHINERY
                and not is_library_file(path))


def _scan_modules() -> list[tuple[str, Any]]:
    """Every user module in ``sys.modules`` now, judged once per module object: an entry
    remembers its module by a weak reference, so a module made later at a freed one's address
    (a script's ``__main__`` replaced by another, with no file) is judged again."""
    found: list[tuple[str, Any]] = []
    for name, module in list(sys.modules.items()):
        if root_package(name) in MACHINERY:  # most of them (torch's): no file to read
            continue
        key = (name, id(module))
        known = _MODULE_KINDS.get(key)
        if known is not None and known[0]() is module \
                and not (known[1] and not isinstance(getattr(module, "__file__", None), str)):
            user = known[1]
        else:
            user = _judge(name, module)
            try:
                _MODULE_KINDS[key] = (weakref.ref(module), user)
            except TypeError:  # an object that is not a module, put in sys.modules by hand
                pass
        if user and type(module).__weakrefoffset__:
            found.append((name, module))
    return found


def user_modules() -> list[types.ModuleType]:
    """Modules of the user's own code: not the standard library, not installed packages.
    Scanning ``sys.modules`` (thousands of entries with torch loaded) is done again only when
    it changed in size or ``__main__`` changed, or a module found before lost its place or its
    file; otherwise the last answer is checked module by module and given again."""
    global _USER_MODULES
    fingerprint = (len(sys.modules), id(sys.modules.get("__main__")))
    cached = _USER_MODULES
    if cached is not None and cached[0] == fingerprint:
        modules = [ref() for _, ref in cached[1]]
        if all(module is not None and sys.modules.get(name) is module
               and isinstance(getattr(module, "__file__", None), str)
               for (name, _), module in zip(cached[1], modules, strict=True)):
            return modules  # type: ignore[return-value]
    scanned = _scan_modules()
    _USER_MODULES = (fingerprint, [(name, weakref.ref(module)) for name, module in scanned])
    return [module for _, module in scanned]
