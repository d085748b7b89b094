"""A DataLoader's dataset as a worker copies it: its largest container of Python objects (a
list of dicts, a dict of lists), named as the user's code spells it, with its Python size
estimated from a sample of its items."""

from __future__ import annotations

import collections
import sys
import types
from typing import Any, NamedTuple

import torch.utils.data

from memsentry.model.processes import DatasetObjects
from memsentry.usercode.frames import spelled_name

#: A container shorter than this is no dataset's storage.
MIN_ITEMS = 1000
#: Items whose deep size is measured to estimate a container's.
SAMPLE = 64
_CONTAINERS = (list, tuple, dict, collections.deque)


def _deep_size(obj: Any, depth: int = 3) -> int:
    """``obj``'s size with what it holds, ``depth`` levels down (shared objects counted each
    time: an estimate)."""
    size = sys.getsizeof(obj)
    if depth <= 0:
        return size
    if isinstance(obj, dict):
        return size + sum(_deep_size(k, depth - 1) + _deep_size(v, depth - 1)
                          for k, v in list(obj.items())[:SAMPLE])
    if isinstance(obj, list | tuple):
        return size + sum(_deep_size(item, depth - 1) for item in obj[:SAMPLE])
    return size


class _Container(NamedTuple):
    """A long container among a dataset's attributes: the attribute path that reaches it
    (``reader.samples``), the container, what it holds (``list of dict``) and its estimated
    bytes."""

    path: str
    container: Any
    kind: str
    nbytes: int


def _estimate(path: str, container: Any) -> _Container:
    """The kind and the estimated bytes of a long container, from a sample of its items."""
    items = list(container.values()) if isinstance(container, dict) else container
    count = len(items)
    stride = max(1, count // SAMPLE)
    sample = [items[i] for i in range(0, count, stride)][:SAMPLE]
    each = sum(_deep_size(item) for item in sample) / max(len(sample), 1)
    kinds = sorted({type(item).__name__ for item in sample})
    kind = f"{type(container).__name__} of {' and '.join(kinds) or 'nothing'}"
    return _Container(path, container, kind, int(sys.getsizeof(container) + each * count))


#: Attributes of attributes followed, this many levels down (a reader, a wrapper's dataset).
DEPTH = 3
#: Objects whose attributes are looked at, at most.
MAX_OBJECTS = 200


class _Attribute(NamedTuple):
    """An object among a dataset's attributes (or theirs): the path that reaches it, the
    object and how many levels below the dataset it is."""

    path: str
    obj: Any
    depth: int


def _attributes(parent: _Attribute, seen: set[int]) -> list[_Attribute]:
    """The attributes of ``parent`` not met before (``seen``: the ids met, these added)."""
    attributes = getattr(parent.obj, "__dict__", None)
    if not isinstance(attributes, dict):
        return []
    found = []
    for name, value in list(attributes.items()):
        if not isinstance(name, str) or id(value) in seen:
            continue
        seen.add(id(value))
        path = f"{parent.path}.{name}" if parent.path else name
        found.append(_Attribute(path, value, parent.depth + 1))
    return found


def _containers(dataset: Any) -> list[_Attribute]:
    """Every container of :data:`MIN_ITEMS` items or more among ``dataset``'s attributes and
    theirs, :data:`DEPTH` levels down (``reader.samples`` for a dataset that keeps a
    reader)."""
    found: list[_Attribute] = []
    seen: set[int] = {id(dataset)}
    queue = [_Attribute("", dataset, 0)]
    while queue and len(seen) <= MAX_OBJECTS:
        for attribute in _attributes(queue.pop(0), seen):
            if isinstance(attribute.obj, _CONTAINERS):
                if len(attribute.obj) >= MIN_ITEMS:
                    found.append(attribute)
            elif attribute.depth < DEPTH and _plain(attribute.obj):
                queue.append(attribute)
    return found


_NOT_HOLDERS = (type, types.ModuleType, types.FunctionType, types.MethodType)


def _plain(value: Any) -> bool:
    """An instance whose attributes may keep the samples: a user's or a library's object
    (a reader, the dataset a ``Subset`` wraps), not a class, module, function, tensor or
    array (those keep none), nor another of torch's objects."""
    if isinstance(value, _NOT_HOLDERS) or not hasattr(value, "__dict__"):
        return False
    if isinstance(value, torch.utils.data.Dataset):
        return True
    return (not hasattr(value, "__array_interface__")
            and type(value).__module__.partition(".")[0] != "torch")


def dataset_objects(dataset: Any, frame: types.FrameType | None) -> DatasetObjects | None:
    """The largest container of Python objects among ``dataset``'s attributes, or theirs
    (``None`` when it keeps none of :data:`MIN_ITEMS` items or more)."""
    found = [_estimate(attribute.path, attribute.obj) for attribute in _containers(dataset)]
    if not found:
        return None
    largest = max(found, key=lambda entry: entry.nbytes)
    name = spelled_name(dataset, frame, frames=None) or type(dataset).__name__
    return DatasetObjects(f"{name}.{largest.path}", largest.kind, len(largest.container),
                          largest.nbytes, name)
