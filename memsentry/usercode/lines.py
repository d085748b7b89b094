"""Find, in the user's source, the statement that fills a holder: ``total += loss``,
``outs.append(y)``, ``self.history[k] = v``, ``layer.register_forward_hook(fn)``.

Findings name a ``file:line``; the line where a frame happens to stand (``opt.step()``) says
little, the line that accumulates says what to change. Files are parsed once (cached by
path and modification time); code that has no file of its own (a notebook's cell) is read
from :mod:`linecache`, where IPython keeps it. Nothing here raises.
"""

from __future__ import annotations

import ast
import functools
import linecache
import os
import re
from collections.abc import Callable, Iterable, Iterator
from typing import TypeGuard

#: Calls that grow a container in place.
GROWING_METHODS = frozenset(
    {"append", "extend", "insert", "add", "update", "appendleft", "extendleft", "setdefault",
     "__setitem__", "put", "push", "log", "record"}
)


def mtime(path: str) -> float | None:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None


@functools.lru_cache(maxsize=64)
def parse(path: str, mtime: float | None) -> ast.Module | None:
    try:
        return ast.parse(source_text(path), filename=path)
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None


def source_text(path: str) -> str:
    """The text of ``path``; for code compiled from a string (a notebook cell, named
    ``<ipython-input-5-...>`` or a kernel's temporary file that was never written), the
    lines :mod:`linecache` keeps for it. Raises ``OSError`` when there is neither."""
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except OSError:
        lines = linecache.getlines(path)
        if not lines:
            raise
        return "".join(lines)


def _tree(path: str) -> ast.Module | None:
    return parse(path, mtime(path))


def enclosing(tree: ast.Module, first_line: int | None) -> ast.AST:
    """The function starting at ``first_line`` (a code object's ``co_firstlineno``, which
    counts decorators), or the whole module."""
    if first_line is None:
        return tree
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            if start == first_line:
                return node
    return tree


def _names(node: ast.AST) -> set[str]:
    """Identifiers used in an expression: names and attribute names."""
    found: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            found.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            found.add(sub.attr)
    return found


def spells(target: ast.AST, name: str) -> bool:
    """``target`` is ``name``, ``<x>.name`` or a subscript of either."""
    while isinstance(target, ast.Subscript):
        target = target.value
    if isinstance(target, ast.Name):
        return target.id == name
    return isinstance(target, ast.Attribute) and target.attr == name


#: Values that reset a holder rather than fill it (``self.avg = 0``, ``self.outs = []``).
_RESETS = (ast.Constant, ast.List, ast.Dict, ast.Tuple, ast.Set)


#: Functions that grow the container given as their first argument.
_FIRST_ARGUMENT_GROWS = frozenset({"heappush", "insort", "insort_left", "insort_right"})
#: Methods that return what a key holds (``state.setdefault("history", [])``).
_KEY_READS = frozenset({"setdefault", "get", "__getitem__"})
#: A holder spelled with a string key at its end: ``state[p]['history']``.
_KEYED = re.compile(r".*\[('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")\]")


def _score(node: ast.AST, name: str) -> float:
    """How surely ``node`` is the statement that makes ``name`` grow: 3 for accumulation
    (``+=``, ``x = x + ...``, ``x.append(...)``, ``x[k] = ...``, ``heapq.heappush(x, ...)``),
    1 for a plain binding, 0.5 for one that resets it to a constant or an empty literal
    (``reset()``'s ``self.avg = 0``). A name ending in a string key (``state[p]['history']``)
    is scored by that key (:func:`_key_score`)."""
    key = string_key(name)
    if key is not None:
        return _key_score(node, key)
    if isinstance(node, ast.AugAssign) and spells(node.target, name):
        return 3
    if isinstance(node, ast.Assign | ast.AnnAssign):
        return _assignment_score(node, name)
    if isinstance(node, ast.Call):
        return 3 if _grows(node, lambda target: spells(_receiver(target), name)) else 0
    return 0


def fill_score(node: ast.AST, name: str) -> float:
    """:func:`_score`: 3 where ``node`` builds ``name`` from itself or grows it in place, 1
    where it binds it, 0.5 where it resets it, 0 where it does neither."""
    return _score(node, name)


def _grows(call: ast.Call, names: Callable[[ast.AST], bool]) -> bool:
    """Whether ``call`` grows a container that ``names`` accepts: a growing method called on
    it (``x.append(y)``) or a function that grows its first argument (``heappush(x, y)``)."""
    func = call.func
    if isinstance(func, ast.Attribute) and func.attr in GROWING_METHODS:
        return names(func.value)
    called = func.attr if isinstance(func, ast.Attribute) else \
        func.id if isinstance(func, ast.Name) else None
    return called in _FIRST_ARGUMENT_GROWS and bool(call.args) and names(call.args[0])


def _receiver(target: ast.AST) -> ast.AST:
    """What a method is called on, through the calls that hand back what it holds:
    ``seen`` for ``seen.get().append(x)``."""
    while isinstance(target, ast.Call) and isinstance(target.func, ast.Attribute) \
            and target.func.attr in _KEY_READS | {"get"}:
        target = target.func.value
    return target


@functools.lru_cache(maxsize=1024)
def string_key(name: str) -> str | None:
    """The string key a holder's name ends with (``history`` for ``state[p]['history']``),
    or ``None``. Cached: a file's every node is scored against the same name."""
    match = _KEYED.fullmatch(name) if name.endswith("]") else None
    if match is None:
        return None
    try:
        key = ast.literal_eval(match.group(1))
    except (ValueError, SyntaxError):
        return None
    return key if isinstance(key, str) else None


def _reads_key(node: ast.AST, key: str) -> bool:
    """``x[key]`` or ``x.setdefault(key, ...)``/``x.get(key)``."""
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == key
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
        and node.func.attr in _KEY_READS and bool(node.args) \
        and isinstance(node.args[0], ast.Constant) and node.args[0].value == key


def _key_score(node: ast.AST, key: str) -> float:
    """:func:`_score` for what a string key holds: 3 where it grows
    (``state["history"].append(g)``, ``state.setdefault("history", []).append(g)``,
    ``state["buf"] = torch.cat([state["buf"], g])``, ``state["sum"] += g``), 1 where it is
    set, 0.5 where it is reset to an empty literal or a constant."""
    if isinstance(node, ast.AugAssign):
        return 3 if _reads_key(node.target, key) else 0
    if isinstance(node, ast.Call):
        return 3 if _grows(node, lambda target: _reads_key(target, key)) else 0
    if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
        return _key_assignment_score(node, node.value, key)
    return 0


def _key_assignment_score(node: ast.Assign | ast.AnnAssign, value: ast.expr, key: str
                          ) -> float:
    """:func:`_key_score` of an assignment: 3 where it sets the key from itself, 1 where it
    sets it, 0.5 where it resets it, 0 where it does not set it."""
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    if not any(_reads_key(target, key) for target in targets):
        return 0
    if any(_reads_key(sub, key) for sub in ast.walk(value)):
        return 3
    return 0.5 if isinstance(value, _RESETS) and not _filled(value) else 1


def _assignment_score(node: ast.Assign | ast.AnnAssign, name: str) -> float:
    """:func:`_score` of an assignment: by its first target that spells ``name``."""
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    for target in targets:
        if isinstance(target, ast.Subscript) and spells(target, name):
            return 3
        if spells(target, name) or _unpacks(target, name):
            return _binding_score(node.value, name)
    return 0


def _unpacks(target: ast.AST, name: str) -> bool:
    """Whether a tuple or list target binds ``name`` (``first, second = tee(batches)``)."""
    if not isinstance(target, ast.Tuple | ast.List):
        return False
    return any(spells(getattr(item, "value", item) if isinstance(item, ast.Starred) else item,
                      name) or _unpacks(item, name) for item in target.elts)


def _binding_score(value: ast.AST | None, name: str) -> float:
    """:func:`_score` of ``name = value``: 3 when ``value`` uses ``name`` (``x = x + y``),
    0.5 for a reset (a constant, an empty literal), else 1."""
    if value is not None and name in _names(value):
        return 3
    return 0.5 if isinstance(value, _RESETS) and not _filled(value) else 1


def _filled(literal: ast.AST) -> bool:
    """A literal with items (``[x]``), or a constant (never filled: a reset)."""
    return bool(getattr(literal, "elts", None) or getattr(literal, "keys", None))


def growth_line(path: str | None, name: str, *, function_line: int | None = None) -> int | None:
    """The line in ``path`` (inside the function starting at ``function_line`` when given)
    that most likely makes ``name`` grow; ``None`` when there is none or the file is unreadable.
    """
    if not path:
        return None
    return _growth_line(path, mtime(path), name, function_line)


@functools.lru_cache(maxsize=1024)
def _growth_line(path: str, mtime: float | None, name: str, function_line: int | None
                 ) -> int | None:
    best, line = 0.0, None
    for node, function in _candidates(path, mtime, function_line):
        score = _score(node, name)
        lineno = getattr(node, "lineno", None)
        if lineno is None or not score:
            continue
        if function == "__init__":
            score -= 0.5  # set up once in a constructor; the line that refills it is elsewhere
        if _better(score, lineno, best, line):
            best, line = score, lineno
    return line


def _candidates(path: str, mtime: float | None, function_line: int | None
                ) -> Iterable[tuple[ast.AST, str | None]]:
    """The nodes of the file, or of the function starting at ``function_line``, each with the
    function it is in."""
    if function_line is None:
        return scorable(path, mtime)
    tree = parse(path, mtime)
    if tree is None:
        return ()
    return ((node, function) for node, function in walk_functions(enclosing(tree, function_line),
                                                                 None)
            if isinstance(node, _SCORED))


def _better(score: float, lineno: int, best: float, line: int | None) -> bool:
    """Whether a node scoring ``score`` at ``lineno`` beats the best so far (``best`` at
    ``line``): a higher score, or the same one earlier in the file."""
    return score > best or (score == best and line is not None and lineno < line)


_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def children(node: ast.AST) -> list[ast.AST]:
    """The nodes right under ``node``, in the order of its fields (as
    :func:`ast.iter_child_nodes`, without its two generators per node)."""
    found: list[ast.AST] = []
    for field in node._fields:
        value = getattr(node, field, None)
        if isinstance(value, ast.AST):
            found.append(value)
        elif isinstance(value, list):
            found.extend(item for item in value if isinstance(item, ast.AST))
    return found


def walk_functions(node: ast.AST, function: str | None) -> Iterator[tuple[ast.AST, str | None]]:
    """Every node under ``node``, depth first in source order, with the name of the function
    it is in. One stack, not a generator per level: a node deep in a module is not handed up
    through every level above it."""
    pending = [(child, child.name if isinstance(child, _FUNCTIONS) else function)
               for child in reversed(children(node))]
    while pending:
        child, inner = pending.pop()
        yield child, inner
        pending.extend((grand, grand.name if isinstance(grand, _FUNCTIONS) else inner)
                       for grand in reversed(children(child)))


@functools.lru_cache(maxsize=64)
def nodes(path: str, mtime: float | None) -> tuple[tuple[ast.AST, str | None], ...]:
    """Every node of the file at ``path`` with the function it is in (:func:`walk_functions`),
    walked once for all the names asked about it; empty when it cannot be parsed."""
    tree = parse(path, mtime)
    return () if tree is None else tuple(walk_functions(tree, None))


#: The statements :func:`_score` can score above 0 (the others are passed over unscored).
_SCORED = (ast.AugAssign, ast.Assign, ast.AnnAssign, ast.Call)


@functools.lru_cache(maxsize=64)
def scorable(path: str, mtime: float | None) -> tuple[tuple[ast.AST, str | None], ...]:
    """The nodes of :func:`nodes` that :func:`_score` can score: a file is scored once for
    every holder's name, and most of its nodes are names, constants and expressions."""
    return tuple(item for item in nodes(path, mtime) if isinstance(item[0], _SCORED))


@functools.lru_cache(maxsize=64)
def nodes_by_line(path: str, mtime: float | None) -> dict[int, tuple[ast.AST, ...]]:
    """The nodes of the file at ``path`` by the line they start on, each line's in the order
    of :func:`nodes` (callers must not change what they get)."""
    lines: dict[int, list[ast.AST]] = {}
    for node, _function in nodes(path, mtime):
        lineno = getattr(node, "lineno", None)
        if lineno is not None:
            lines.setdefault(lineno, []).append(node)
    return {line: tuple(found) for line, found in lines.items()}


def attribute_line(path: str | None, root: str, name: str) -> int | None:
    """The line in ``path`` that most likely makes ``root.name`` grow (``lib._seen.append(x)``):
    :func:`growth_line`'s choice among the lines that spell it so."""
    if not path:
        return None
    spelled = f"{root}.{name}"
    best, line = 0.0, None
    for node, _function in scorable(path, mtime(path)):
        score = _score(node, name)
        lineno = getattr(node, "lineno", None)
        if score and lineno is not None and spelled in ast.unparse(node) \
                and _better(score, lineno, best, line):
            best, line = score, lineno
    return line


def call_line(path: str | None, callees: set[str]) -> int | None:
    """The first line in ``path`` that calls one of ``callees`` as written (``fl.remember``,
    ``register``) with an argument: what the user hands a package's function."""
    if not path:
        return None
    lines = [node.lineno for node, _function in nodes(path, mtime(path))
             if isinstance(node, ast.Call) and (node.args or node.keywords)
             and _spelled_call(node) in callees]
    return min(lines) if lines else None


def _spelled_call(call: ast.Call) -> str | None:
    """``fl.remember`` for ``fl.remember(x)``, ``register`` for ``register(k, x)``;
    ``None`` for any other callee."""
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return f"{func.value.id}.{func.attr}"
    return None


def register_line(path: str | None, hook: str) -> int | None:
    """The first line in ``path`` that registers ``hook`` (``x.register_forward_hook(hook)``,
    ``t.register_hook(self.hook)``, any ``register_*hook`` method given that name)."""
    tree = _tree(path) if path else None
    if tree is None:
        return None
    lines = [node.lineno for node in ast.walk(tree) if _registers(node, hook)]
    return min(lines) if lines else None


def _registers(node: ast.AST, hook: str) -> TypeGuard[ast.Call]:
    """Whether ``node`` calls a ``register_*hook`` method with an argument that names
    ``hook``."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return False
    method = node.func.attr
    return method.startswith("register_") and method.endswith("hook") \
        and any(hook in _names(arg) for arg in node.args)


#: Names code without a file of its own by the name it was compiled under (``In[5]`` for a
#: notebook cell), or says ``None``; set by the notebook integration while it is loaded.
_labeler: Callable[[str], str | None] | None = None


def label_sources(labeler: Callable[[str], str | None] | None) -> None:
    """Name code compiled from strings in findings with ``labeler`` (a notebook's cells as
    ``In[5]``, not ``<ipython-input-5-9f3a...>`` or a kernel's temporary file); ``None``
    stops."""
    global _labeler
    _labeler = labeler


def short_path(path: str) -> str:
    """``path`` relative to the working directory when inside it, else as it is; a notebook
    cell by its label (``In[5]``) while the notebook integration is loaded."""
    labeler = _labeler
    if labeler is not None:
        try:
            label = labeler(path)
        except Exception:
            label = None
        if label:
            return label
    return _relative(path, os.getcwd())


@functools.lru_cache(maxsize=4096)
def _relative(path: str, cwd: str) -> str:
    """Cached: the plugin's storage counter asks for the line of every new storage."""
    try:
        relative = os.path.relpath(path, cwd)
    except ValueError:
        return path
    return path if relative.startswith("..") else relative
