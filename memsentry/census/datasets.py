"""A DataLoader's dataset as a worker copies it: its largest container of Python objects (a
list of dicts, a dict of lists), named as the user's code spells it, with its Python size
estimated from a sample of its items."""

from __future__ import annotations

import collections
import sys
import types
from typing import Any

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


def _estimate(container: Any) -> tuple[str, int]:
    """("list of dict", estimated bytes) of a long container."""
    items = list(container.values()) if isinstance(container, dict) else container
    count = len(items)
    stride = max(1, count // SAMPLE)
    sample = [items[i] for i in range(0, count, stride)][:SAMPLE]
    each = sum(_deep_size(item) for item in sample) / max(len(sample), 1)
    kinds = sorted({type(item).__name__ for item in sample})
    kind = f"{type(container).__name__} of {' and '.join(kinds) or 'nothing'}"
    return kind, int(sys.getsizeof(container) + each * count)


#: Attributes of attributes followed, this many levels down (a reader, a wrapper's dataset).
DEPTH = 3
#: Objects whose attributes are looked at, at most.
MAX_OBJECTS = 200


def _containers(dataset: Any) -> list[tuple[str, Any]]:
    """(attribute path, container) of every container of :data:`MIN_ITEMS` items or more
    among ``dataset``'s attributes and theirs, :data:`DEPTH` levels down (``reader.samples``
    for a dataset that keeps a reader)."""
    found: list[tuple[str, Any]] = []
    seen: set[int] = {id(dataset)}
    queue: list[tuple[str, Any, int]] = [("", dataset, 0)]
    while queue and len(seen) <= MAX_OBJECTS:
        path, obj, depth = queue.pop(0)
        attributes = getattr(obj, "__dict__", None)
        if not isinstance(attributes, dict):
            continue
        for name, value in list(attributes.items()):
            if not isinstance(name, str) or id(value) in seen:
                continue
            seen.add(id(value))
            spelled = f"{path}.{name}" if path else name
            if isinstance(value, _CONTAINERS):
                if len(value) >= MIN_ITEMS:
                    found.append((spelled, value))
            elif depth + 1 < DEPTH and _plain(value):
                queue.append((spelled, value, depth + 1))
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
    found = [(path, container, *_estimate(container)) for path, container in
             _containers(dataset)]
    if not found:
        return None
    attribute, container, kind, size = max(found, key=lambda entry: entry[3])
    name = spelled_name(dataset, frame, frames=None) or type(dataset).__name__
    return DatasetObjects(f"{name}.{attribute}", kind, len(container), size, name)
