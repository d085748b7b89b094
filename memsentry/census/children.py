"""What an object holds, as a census walk meets it: a container's items, an object's
attributes and slots, a module's submodules, what a callable captured, a traceback's frame
locals; and the values with nothing to find inside (numbers, strings, and large containers of
them, checked in bulk)."""

from __future__ import annotations

import collections
import functools
import gc
import itertools
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from memsentry.model import StepKind
from memsentry.usercode.frames import MACHINERY, is_user_class, root_package

_ATOMS = (int, float, complex, bool, str, bytes, type(None), range, slice,
          type(Ellipsis), torch.dtype, torch.device, torch.Size)
CONTAINERS = (dict, list, tuple, set, frozenset, collections.deque)
_MODULE_INTERNALS = frozenset(nn.Module().__dict__) | {"_is_full_backward_hook"}


def atomic(obj: Any) -> bool:
    """Nothing to find inside (numbers, strings, dtypes) or nothing safe to look at (a weak
    proxy whose object is gone raises on any access)."""
    try:
        return isinstance(obj, _ATOMS)
    except Exception:
        return True


#: A child as the walk meets it: (step kind, the raw step: an attribute's name, a dict key, an
#: index, a frame-kept local's (function, name); the child; whether it is positional). The
#: typed :class:`Step` is built only when the child extends a path.
Child = tuple[StepKind, Any, Any, bool]


def _traceback_locals(tb: types.TracebackType | None, live: set[int]) -> Iterator[Child]:
    """The locals of the finished frames a traceback keeps (frames still running are roots of
    their own, and reading theirs here would keep a snapshot alive)."""
    while tb is not None:
        frame = tb.tb_frame
        if id(frame) not in live:
            function = frame.f_code.co_name
            for name, value in list(frame.f_locals.items()):
                yield StepKind.FRAME_LOCAL, (function, name), value, True
        tb = tb.tb_next


def _attributes(obj: Any) -> Iterator[Child]:
    """An object's instance attributes, from its ``__dict__`` and its slots."""
    attributes = getattr(obj, "__dict__", None)
    if isinstance(attributes, dict):
        for name, value in list(attributes.items()):
            yield StepKind.ATTRIBUTE, name, value, False
    for name in getattr(type(obj), "__slots__", ()):
        if isinstance(name, str) and hasattr(obj, name):
            yield StepKind.ATTRIBUTE, name, getattr(obj, name), False


def _module_attributes(module: nn.Module) -> Iterator[Child]:
    """A module's submodules and its own attributes (not nn.Module's bookkeeping)."""
    for name, child in module._modules.items():
        if child is not None:
            yield StepKind.ATTRIBUTE, name, child, False
    for name, value in list(vars(module).items()):
        if name not in _MODULE_INTERNALS:
            yield StepKind.ATTRIBUTE, name, value, False


def _items(obj: Any) -> Iterator[Child]:
    """A container's items: string keys extend the path, the rest are positional."""
    if isinstance(obj, dict):
        for key, value in list(obj.items()):
            yield StepKind.KEY, key, value, not isinstance(key, str)
    elif isinstance(obj, set | frozenset):
        for value in list(obj):
            yield StepKind.MEMBER, None, value, True
    else:
        for index, value in enumerate(list(obj)):
            yield StepKind.INDEX, index, value, True


#: Containers longer than this are first checked at C speed for anything but plain values.
BULK = 256
_ATOM_TYPES = frozenset(t for t in _ATOMS if isinstance(t, type))


def only_atoms(obj: Any) -> bool:
    """A large list, tuple, set or dict holding only numbers, strings and the like, or
    records of them (a replay buffer's tuples of floats and NumPy arrays): nothing to walk
    into (three million floats are checked in tens of milliseconds, not seconds)."""
    if not isinstance(obj, CONTAINERS) or len(obj) <= BULK:
        return False
    try:
        kinds = set(map(type, obj.values())) | set(map(type, obj)) if isinstance(obj, dict) \
            else set(map(type, obj))
        if kinds <= _ATOM_TYPES:
            return True
        if isinstance(obj, dict) or not kinds <= _RECORDS | _ATOM_TYPES:
            return False
        return _plain_values(_fields_of(iter(_sample(obj)), depth=3))
    except Exception:  # changed size while read: walk it item by item
        return False


#: The records whose fields :func:`only_atoms` checks in bulk (a dict: its keys and values).
_RECORDS = frozenset((tuple, list, dict))


#: Records whose fields are checked when a container holds more: the first and the last
#: (what a loop appends comes last) and some spread between.
SAMPLED = 256


def _sample(obj: Any) -> list[Any]:
    """The records of ``obj`` whose fields are checked: all of a short container, else
    :data:`SAMPLED` of them (a container of records holds one kind: a dataset's samples, a
    buffer's transitions; a leak adds its kind at the end)."""
    items = obj if isinstance(obj, list | tuple) else list(obj)
    if len(items) > SAMPLED:
        quarter = SAMPLED // 4
        stride = max(1, len(items) // (SAMPLED // 2))
        items = [*items[:quarter], *items[quarter:-quarter:stride], *items[-quarter:]]
    return [item for item in items if type(item) in _RECORDS]


def _fields_of(records: Iterator[Any], depth: int = 2) -> list[Any]:
    """The fields of ``records``, and of the lists, tuples and dicts among them, ``depth``
    levels down (a dataset's ``{"features": [0.1, ...], "label": 3}``; a chat dataset's
    ``{"id": "a1", "conversations": [{"from": "human", "value": "..."}, ...]}``, three)."""
    fields = list(itertools.chain.from_iterable(
        itertools.chain(record, record.values()) if type(record) is dict else record
        for record in records))
    if depth > 1 and any(type(field) in _RECORDS for field in fields):
        nested = [field for field in fields if type(field) in _RECORDS]
        return [field for field in fields if type(field) not in _RECORDS] \
            + _fields_of(iter(nested), depth - 1)
    return fields


def _plain_values(values: list[Any]) -> bool:
    """Whether ``values`` are all atoms or NumPy arrays of numbers that own their memory
    (an array viewing a tensor's storage, ``tensor.numpy()``, has that tensor as its base)."""
    kinds = set(map(type, values))
    if kinds <= _ATOM_TYPES:
        return True
    numpy = sys.modules.get("numpy")
    array = getattr(numpy, "ndarray", None)
    if array is None or not kinds <= _ATOM_TYPES | {array}:
        return False
    return all(value.base is None and not value.dtype.hasobject
               for value in values if type(value) is array)


#: What ``torch.optim.Optimizer.__init__`` sets on every optimizer
#: (``torch/optim/optimizer.py``): its bookkeeping, not state a subclass added. Its
#: ``state`` is walked as ``state[p]``, its ``param_groups`` hold the parameters.
_OPTIMIZER_INTERNALS = frozenset({"defaults", "state", "param_groups",
                                  "_warned_capturable_if_run_uncaptured",
                                  "_zero_grad_profile_name"})


def optimizer_children(optimizer: torch.optim.Optimizer) -> Iterator[Child]:
    """An optimizer's per-parameter state, each key of it as ``state[p]['exp_avg']`` (one
    holder for the key across the parameters: ``opt.state[p]['history']`` is what a step
    appends to for every parameter), and the attributes a subclass sets on itself. Of
    PyTorch's own optimizers only the tensors: the lists LBFGS keeps are bounded by its
    ``history_size`` (``torch/optim/lbfgs.py`` drops the oldest entry once it is reached)."""
    tensors_only = type(optimizer).__module__.startswith("torch.")
    for state in list(optimizer.state.values()):
        if not isinstance(state, dict):
            if not tensors_only:
                yield StepKind.ATTRIBUTE, "state[p]", state, False
            continue
        for key, value in list(state.items()):
            if not tensors_only or isinstance(value, torch.Tensor):
                yield StepKind.ATTRIBUTE, f"state[p][{key!r}]", value, False
    for name, value in list(vars(optimizer).items()):
        if name not in _OPTIMIZER_INTERNALS and not name.startswith("_optimizer_"):
            yield StepKind.ATTRIBUTE, name, value, False


def _builtin_iterator(obj: Any) -> bool:
    """An iterator implemented in C by Python or :mod:`itertools` (``iter(list)``, ``zip``,
    ``map``, ``itertools.cycle``, ``islice``...): what it keeps is in C fields."""
    cls = type(obj)
    return cls.__module__ in ("builtins", "itertools") and hasattr(cls, "__next__") \
        and not isinstance(obj, types.GeneratorType)


def _iterator_state(obj: Any) -> Iterator[Child]:
    """What a C iterator keeps (its source, the items ``itertools.cycle`` saved, the value
    ``repeat`` repeats), as the garbage collector lists it: the iterator's holder's."""
    for ref in gc.get_referents(obj):
        if not isinstance(ref, type):
            yield StepKind.INDEX, 0, ref, True


def children(obj: Any, live: set[int]) -> Iterator[Child]:
    """What ``obj`` holds (see :data:`Child`); positional children (sequence indices, set
    members, non-string keys, a traceback's frame locals) belong to the holder above."""
    if isinstance(obj, types.TracebackType):
        return _traceback_locals(obj, live)
    if isinstance(obj, CONTAINERS):
        inner = _items(obj)
    elif isinstance(obj, nn.Module):
        inner = _module_attributes(obj)
    elif isinstance(obj, torch.optim.Optimizer):
        inner = optimizer_children(obj)
    elif _builtin_iterator(obj):
        inner = _iterator_state(obj)
    else:
        inner = _attributes(obj)
    if isinstance(obj, BaseException) and obj.__traceback__ is not None:
        traceback: Child = (StepKind.ATTRIBUTE, "__traceback__", obj.__traceback__, False)
        return itertools.chain((traceback,), inner)
    return inner


#: Callables whose captured values are walked: a function's defaults and closure cells, a
#: bound method's object, a ``functools.partial``'s function and arguments.
CALLABLES = (types.FunctionType, types.MethodType, functools.partial)


def walks_into(obj: Any) -> bool:
    """A callable of the user's code, whose captured values may hold tensors."""
    if isinstance(obj, types.FunctionType):
        return root_package(obj.__module__) not in MACHINERY
    if isinstance(obj, types.MethodType):
        return walks_into(obj.__func__) or is_user_class(type(obj.__self__))
    return isinstance(obj, functools.partial)


def captured(obj: Any) -> Iterator[Child]:
    """What a callable keeps alive, spelled as Python reaches it (``record.__defaults__[0]``,
    ``log.__closure__[0].cell_contents``, ``step.__self__``, ``fn.args``)."""
    if isinstance(obj, types.FunctionType):
        for index, value in enumerate(obj.__defaults__ or ()):
            yield StepKind.ATTRIBUTE, f"__defaults__[{index}]", value, False
        for name, value in (obj.__kwdefaults__ or {}).items():
            yield StepKind.ATTRIBUTE, f"__kwdefaults__[{name!r}]", value, False
        for index, cell in enumerate(obj.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            yield StepKind.ATTRIBUTE, f"__closure__[{index}].cell_contents", value, False
    elif isinstance(obj, types.MethodType):
        yield StepKind.ATTRIBUTE, "__self__", obj.__self__, False
        yield StepKind.ATTRIBUTE, "__func__", obj.__func__, False
    else:
        yield StepKind.ATTRIBUTE, "func", obj.func, False
        yield StepKind.ATTRIBUTE, "args", obj.args, False
        yield StepKind.ATTRIBUTE, "keywords", obj.keywords, False


#: ``functools.lru_cache`` and ``functools.cache`` wrap a function in this type; its cache lives
#: in C, reachable only through the garbage collector's view of the wrapper.
CACHES = (functools._lru_cache_wrapper,)


def cache_size(obj: Any) -> tuple[int, int | None]:
    """(entries, the most it may hold: ``None`` when unbounded) of an lru_cache wrapper."""
    info = obj.cache_info()
    return info.currsize, info.maxsize


def cached(obj: Any) -> Iterator[Child]:
    """What a ``functools`` cache keeps: the arguments and results of its calls (positional:
    they belong to the cached function's holder). An unbounded cache keeps them in a dict; a
    bounded one in a linked list whose links the garbage collector lists with the wrapper."""
    own = (getattr(obj, "__dict__", None), getattr(obj, "__wrapped__", None))
    for ref in gc.get_referents(obj):
        if any(ref is o for o in own) or isinstance(ref, type) or atomic(ref):
            continue
        if isinstance(ref, dict):
            for key, value in list(ref.items()):
                yield StepKind.CACHED, None, key, True
                if type(value).__name__ != "_lru_list_elem":  # a bounded cache's link
                    yield StepKind.CACHED, None, value, True
        else:
            yield StepKind.CACHED, None, ref, True


def array_memory(array: Any) -> tuple[torch.Tensor | None, int, int]:
    """Where a NumPy array's memory lives: (the tensor it views, ``tensor.numpy()``, or
    ``None``; the address and bytes of the memory it owns or views otherwise, 0 and 0 when
    that memory belongs to something else, such as a ``bytes`` object or a memory map)."""
    owner = array
    while True:
        base = owner.base
        if isinstance(base, torch.Tensor):
            return base, 0, 0
        if base is None:
            return None, owner.__array_interface__["data"][0], owner.nbytes
        if not hasattr(base, "base") or not hasattr(base, "__array_interface__"):
            return None, 0, 0
        owner = base


#: Suspended generators and coroutines: their frames keep their locals alive between resumes.
SUSPENDED = (types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType)


def suspended_locals(obj: Any, live: set[int]) -> Iterator[Child]:
    """The locals of a suspended generator's or coroutine's frame, when its code is the
    user's (positional: they belong to the generator's holder); none for one that is running
    (its frame is a root of its own) or finished."""
    frame = getattr(obj, "gi_frame", None) or getattr(obj, "cr_frame", None) \
        or getattr(obj, "ag_frame", None)
    if frame is None or id(frame) in live \
            or root_package(frame.f_globals.get("__name__", "")) in MACHINERY:
        return
    function = frame.f_code.co_name
    for name, value in list(frame.f_locals.items()):
        yield StepKind.FRAME_LOCAL, (function, name), value, True
