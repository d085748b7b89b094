"""What the user's code puts into a holder, as the code spells it: the expression a line adds
(``errD`` in ``epoch_errD += errD``), and the call that hands a value to a method which stores it
(``losses.update(loss, n)`` filling ``losses.avg``), so that a fix names the user's own words.
Files are parsed once (see :mod:`memsentry.usercode.lines`); nothing here raises.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass

from memsentry.usercode.lines import (
    mtime,
    nodes,
    nodes_by_line,
    parse,
    short_path,
    source_text,
    spells,
)
from memsentry.usercode.location import Location

#: Methods that add their argument to the container they are called on.
_ADDING = frozenset({"append", "extend", "insert", "add", "appendleft", "extendleft", "put",
                     "push"})


@dataclass(frozen=True)
class Feed:
    """A call in the user's code that hands a value to a method storing it in a holder:
    ``call`` as written (``losses.update(loss, n)``), ``argument`` the argument that carries
    the value (``loss``) at ``start``:``end`` of ``call``, and the call's line."""

    where: Location
    call: str
    argument: str
    start: int
    end: int

    def with_argument(self, text: str) -> str:
        """The call with its value argument written as ``text``."""
        return self.call[:self.start] + text + self.call[self.end:]


def _segment(path: str, node: ast.AST) -> str | None:
    try:
        return ast.get_source_segment(source_text(path), node)
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def added_value(path: str | None, line: int | None, name: str) -> str | None:
    """The expression the statement at ``line`` adds to ``name``: ``errD`` for
    ``epoch_errD += errD`` or ``epoch_errD = epoch_errD + errD``, ``y`` for ``outs.append(y)``;
    ``None`` when the line is none of these."""
    if not path or line is None:
        return None
    return _added_value(path, mtime(path), line, name)


@functools.lru_cache(maxsize=1024)
def _added_value(path: str, mtime: float | None, line: int, name: str) -> str | None:
    for node in nodes_by_line(path, mtime).get(line, ()):
        value = _value_of(node, name)
        if value is not None:
            return _segment(path, value)
    return None


def rewritten(path: str | None, line: int | None, name: str) -> str | None:
    """The statement at ``line`` with the one tensor it folds into ``name`` made a number:
    ``loss_ema = 0.9 * loss_ema + 0.1 * loss.item()`` for a running average, which
    ``+= x.item()`` would turn into a sum. ``None`` unless the line assigns to ``name`` an
    expression of ``name`` and exactly one other value (a name, attribute, subscript or call)
    on one line."""
    if not path or line is None:
        return None
    return _rewritten(path, mtime(path), line, name)


@functools.lru_cache(maxsize=1024)
def _rewritten(path: str, mtime: float | None, line: int, name: str) -> str | None:
    for node in nodes_by_line(path, mtime).get(line, ()):
        if isinstance(node, ast.Assign) and line == node.end_lineno \
                and any(spells(t, name) for t in node.targets):
            return _with_item(path, node, name)
    return None


def _with_item(path: str, node: ast.Assign, name: str) -> str | None:
    """The assignment ``node`` with the one tensor it folds into ``name`` made a number;
    ``None`` when it folds none, several, or one that is a number already."""
    others = _other_values(node.value, name)
    if others is None or len(others) != 1 or graph_free(others[0]):
        return None
    statement = _segment(path, node)
    term = _segment(path, others[0])
    if statement is None or term is None:
        return None
    start = others[0].col_offset - node.col_offset
    end = start + len(term)
    return statement[:start] + term + ".item()" + statement[end:]


#: Methods whose result carries no autograd graph (a number, a list, a detached tensor).
_GRAPH_FREE_METHODS = frozenset({"item", "tolist", "detach"})
#: Functions whose result is a Python number.
_NUMBER_FUNCTIONS = frozenset({"float", "int"})


def graph_free(node: ast.AST) -> bool:
    """Whether ``node`` already gives a value without a graph: ``loss.item()``,
    ``loss.detach()``, ``float(loss)``. A line that adds one is not the line that adds the
    tensor and its graph (that one is elsewhere, on another branch)."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr in _GRAPH_FREE_METHODS
    return isinstance(func, ast.Name) and func.id in _NUMBER_FUNCTIONS


def _other_values(value: ast.AST, name: str) -> list[ast.expr] | None:
    """The values ``value`` combines with ``name`` (``None`` when ``name`` is not in it)."""
    found: list[ast.expr] = []
    uses = False
    pending = [value]
    while pending:
        node = pending.pop()
        if spells(node, name):
            uses = True
        elif isinstance(node, ast.Name | ast.Attribute | ast.Subscript | ast.Call):
            found.append(node)
        else:
            pending.extend(ast.iter_child_nodes(node))
    return found if uses else None


def _value_of(node: ast.AST, name: str) -> ast.AST | None:
    """The expression ``node`` adds to ``name`` (``x`` in ``name += x``, ``name = name + x``,
    ``name.append(x)``), or ``None``."""
    if isinstance(node, ast.AugAssign) and spells(node.target, name):
        return node.value
    if isinstance(node, ast.Assign):
        return _folded_value(node, name)
    return _added_by_call(node.value if isinstance(node, ast.Expr) else node, name)


def _folded_value(node: ast.Assign, name: str) -> ast.AST | None:
    """``x`` in ``name = name + x`` or ``name = x + name`` (any binary operator)."""
    if not isinstance(node.value, ast.BinOp) or not any(spells(t, name) for t in node.targets):
        return None
    left, right = node.value.left, node.value.right
    if spells(left, name):
        return right
    return left if spells(right, name) else None


def _added_by_call(node: ast.AST, name: str) -> ast.AST | None:
    """The last argument of a call that adds it to ``name`` (``name.append(x)``)."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return None
    adds = node.func.attr in _ADDING and spells(node.func.value, name)
    return node.args[-1] if adds and node.args else None


def feeding_call(method_file: str | None, line: int | None, caller_file: str | None,
                 root: str) -> Feed | None:
    """The call ``root.method(...)`` in ``caller_file`` of the method whose body holds
    ``line`` of ``method_file`` (a statement storing into ``self``), with the argument that
    carries the value: the first one not a constant. ``None`` when ``line`` is in no method or
    no such call is found."""
    if not method_file or not caller_file or line is None:
        return None
    return _feeding_call(method_file, mtime(method_file), line, caller_file,
                         mtime(caller_file), root)


@functools.lru_cache(maxsize=256)
def _feeding_call(method_file: str, method_mtime: float | None, line: int, caller_file: str,
                  caller_mtime: float | None, root: str) -> Feed | None:
    method = _method_at(method_file, method_mtime, line)  # None too when it cannot be parsed
    callers = parse(caller_file, caller_mtime)
    if method is None or callers is None:
        return None
    for node in ast.walk(callers):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == method and isinstance(node.func.value, ast.Name) \
                and node.func.value.id == root:
            return _feed(caller_file, node)
    return None


def _method_at(path: str, mtime: float | None, line: int) -> str | None:
    """The name of the method (a function whose first parameter is ``self``) whose body holds
    ``line``, not ``__init__``, in the file at ``path``."""
    for node, _function in nodes(path, mtime):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.args.args \
                and node.args.args[0].arg == "self" and node.name != "__init__" \
                and node.lineno <= line <= (node.end_lineno or node.lineno):
            return node.name
    return None


def _feed(path: str, call: ast.Call) -> Feed | None:
    text = _segment(path, call)
    if text is None or call.end_lineno != call.lineno:
        return None  # a call over several lines: its offsets would not map onto one string
    for argument in [*call.args, *(k.value for k in call.keywords)]:
        if isinstance(argument, ast.Constant | ast.Starred):
            continue
        start = argument.col_offset - call.col_offset
        end = (argument.end_col_offset or argument.col_offset) - call.col_offset
        if text[start:end] != _segment(path, argument):
            return None  # offsets count UTF-8 bytes: a line with other characters
        return Feed(Location(short_path(path), call.lineno), text, text[start:end], start, end)
    return None


__all__ = ["Feed", "added_value", "feeding_call", "graph_free"]
