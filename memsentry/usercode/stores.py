"""What a dataset's ``__getitem__`` keeps: the attributes of ``self`` it adds to
(``self.cache[index] = sample``, ``self.seen.append(path)``), read from its source.

A DataLoader worker has its own copy of the dataset object; what ``__getitem__`` stores there
grows in every worker, where the main process never sees it. The statement that stores is the
holder to name. The methods of ``self`` that ``__getitem__`` calls are read too, one level
down (``self._load(i)`` that caches). Nothing here raises.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Iterator
from typing import Any

from memsentry.usercode.lines import GROWING_METHODS, enclosing, mtime, parse, short_path
from memsentry.usercode.location import Location

#: The methods whose stores are looked for first.
ENTRIES = ("__getitem__", "__getitems__")


def _self_attribute(node: ast.AST) -> str | None:
    """``X`` of an expression ``self.X``."""
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "self"):
        return node.attr
    return None


def _stores(function: ast.AST) -> Iterator[tuple[str, int]]:
    """(attribute, line) of each statement in ``function`` that adds to ``self.X``: an item
    set (``self.X[k] = v``) or a growing call (``self.X.append(v)``); a counter
    (``self.n += 1``) is no store."""
    for node in ast.walk(function):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                name = (_self_attribute(target.value) if isinstance(target, ast.Subscript)
                        else None)
                if name is not None:
                    yield name, node.lineno
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in GROWING_METHODS):
            name = _self_attribute(node.func.value)
            if name is not None:
                yield name, node.lineno


def _called_methods(function: ast.AST) -> set[str]:
    return {node.func.attr for node in ast.walk(function)
            if isinstance(node, ast.Call) and _self_attribute(node.func) is not None
            and isinstance(node.func, ast.Attribute)}


def _tree_of(method: Any) -> tuple[str, ast.AST] | None:
    """(file, the function's node) of a method defined in a file memsentry can parse."""
    try:
        path = inspect.getsourcefile(method)
        first = method.__code__.co_firstlineno
    except (TypeError, AttributeError, OSError):
        return None
    tree = parse(path, mtime(path)) if path else None
    if tree is None or path is None:
        return None
    function = enclosing(tree, first)
    return None if function is tree else (path, function)


def dataset_stores(dataset: Any) -> tuple[tuple[str, Location], ...]:
    """The attributes of ``dataset`` that its ``__getitem__`` (or a method of its own that
    it calls) adds to, as the code spells them (``self.cache``), each once, with the first
    line that does, in the order read."""
    cls = type(dataset)
    found: dict[str, tuple[str, Location]] = {}
    queue = [name for name in ENTRIES if callable(getattr(cls, name, None))]
    done: set[str] = set()
    while queue:
        name = queue.pop(0)
        done.add(name)
        read = _tree_of(getattr(cls, name, None))
        if read is None:
            continue
        path, function = read
        for attribute, line in _stores(function):
            found.setdefault(attribute, (f"self.{attribute}",
                                         Location(short_path(path), line, name)))
        if name in ENTRIES:  # one level down: the methods __getitem__ calls
            queue += sorted(_called_methods(function) - done - set(queue))
    return tuple(found.values())


__all__ = ["dataset_stores"]
