"""Whether the user's code binds a name anew at every step of its loop before the line that
fills it: ``x = torch.randn(8 + 4 * step, 32, 16)`` or ``for x in loader`` make a fresh tensor
each step, so one that grows there follows its input (a longer sequence, a larger batch) and
keeps nothing of the step before; ``bank = torch.cat([bank, x])`` with no such binding carries
the last step's tensor into the next. Files are parsed once (see
:mod:`memsentry.usercode.lines`); nothing here raises.
"""

from __future__ import annotations

import ast
import functools

from memsentry.usercode.lines import mtime, nodes_by_line, parse, spells

_LOOPS = (ast.For, ast.AsyncFor, ast.While)
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def rebound_each_step(path: str | None, line: int | None, name: str) -> bool | None:
    """Whether ``name``, filled at ``line`` of ``path``, is bound to a value that does not
    read it at that line, or earlier in the body of the innermost loop around that line (the
    loop's own target counts); ``None`` when there is no line or the file cannot be read."""
    if not path or line is None:
        return None
    return _rebound(path, mtime(path), line, name)


@functools.lru_cache(maxsize=1024)
def _rebound(path: str, stamp: float | None, line: int, name: str) -> bool | None:
    tree = parse(path, stamp)
    if tree is None:
        return None
    if any(_fresh(node, name) for node in nodes_by_line(path, stamp).get(line, ())):
        return True
    loop = _innermost_loop(tree, line)
    if loop is None:
        return False
    if not isinstance(loop, ast.While) and _binds(loop.target, name):
        return True
    return any(_fresh(node, name) for node in _body_nodes(loop)
               if getattr(node, "lineno", line + 1) <= line)


def _binds(target: ast.AST, name: str) -> bool:
    """Whether an assignment or loop target binds ``name`` (``x``, ``self.x``, ``(x, y)``)."""
    if isinstance(target, ast.Tuple | ast.List):
        return any(_binds(item, name) for item in target.elts)
    if isinstance(target, ast.Starred):
        return _binds(target.value, name)
    return not isinstance(target, ast.Subscript) and spells(target, name)


def _reads(value: ast.AST | None, name: str) -> bool:
    """Whether an expression reads ``name`` (as a variable or an attribute's name)."""
    if value is None:
        return False
    return any((isinstance(sub, ast.Name) and sub.id == name)
               or (isinstance(sub, ast.Attribute) and sub.attr == name)
               for sub in ast.walk(value))


def _fresh(node: ast.AST, name: str) -> bool:
    """A statement that binds ``name`` to a value that does not read it, or a loop whose
    target is ``name``."""
    if isinstance(node, ast.Assign):
        return any(_binds(t, name) for t in node.targets) and not _reads(node.value, name)
    if isinstance(node, ast.AnnAssign):
        return node.value is not None and _binds(node.target, name) \
            and not _reads(node.value, name)
    if isinstance(node, ast.For | ast.AsyncFor):
        return _binds(node.target, name)
    return False


def _innermost_loop(tree: ast.AST, line: int) -> ast.For | ast.AsyncFor | ast.While | None:
    """The loop whose body holds ``line``, nested deepest (not looking into functions
    defined inside it)."""
    found = None
    pending = [tree]
    while pending:
        node = pending.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, _LOOPS) and child.body and child.body[0].lineno <= line \
                    <= (child.end_lineno or child.lineno):
                found = child
                pending.append(child)
            elif not isinstance(child, _LOOPS) and _spans(child, line):
                if isinstance(child, _FUNCTIONS):
                    found = None  # a function defined in a loop runs in its own loops
                pending.append(child)
    return found


def _spans(node: ast.AST, line: int) -> bool:
    """Whether ``node`` covers ``line`` (nodes without lines, such as a module, do)."""
    start = getattr(node, "lineno", None)
    if start is None:
        return True
    return start <= line <= (getattr(node, "end_lineno", None) or start)


def _body_nodes(loop: ast.For | ast.AsyncFor | ast.While) -> list[ast.AST]:
    """The statements of a loop's body, nested ones included, not those of functions or
    classes defined in it."""
    found: list[ast.AST] = []
    pending: list[ast.AST] = list(loop.body)
    while pending:
        node = pending.pop()
        found.append(node)
        pending.extend(child for child in ast.iter_child_nodes(node)
                       if not isinstance(child, _FUNCTIONS))
    return found
