"""A DataLoader's dataset as a worker copies it: its largest container of Python objects (a
list of dicts, a dict of lists), named as the user's code spells it, with its Python size
estimated from a sample of its items."""

from __future__ import annotations

import collections
import sys
import types
from typing import Any

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


def dataset_objects(dataset: Any, frame: types.FrameType | None) -> DatasetObjects | None:
    """The largest container of Python objects among ``dataset``'s attributes (``None``
    when it keeps none of :data:`MIN_ITEMS` items or more)."""
    attributes = getattr(dataset, "__dict__", None)
    if not isinstance(attributes, dict):
        return None
    found = [(len(value), name, value) for name, value in list(attributes.items())
             if isinstance(value, _CONTAINERS) and len(value) >= MIN_ITEMS]
    if not found:
        return None
    items, attribute, container = max(found, key=lambda entry: entry[0])
    kind, size = _estimate(container)
    name = spelled_name(dataset, frame, frames=None) or type(dataset).__name__
    return DatasetObjects(f"{name}.{attribute}", kind, items, size)
