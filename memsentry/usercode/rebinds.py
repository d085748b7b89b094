"""Whether the user's code binds a holder anew at every step before the line that fills it,
or builds it from what it held the step before.

``x = torch.randn(8 + 4 * step, 32, 16)``, ``for x in loader`` or ``outs = []`` at the top of
the step make a fresh value each step: one that grows there follows its input (a longer
sequence, a larger batch) and keeps nothing of the step before. ``bank = torch.cat([bank,
x])`` or ``preds.append(out)`` with no such binding in the step carries what the last step
left into the next. The step is the loop that holds both the line that fills the holder and
the line where the loop's frame stood at the census (its ``optimizer.step()``): a list
emptied once an epoch, in the loop around it, is not bound anew each step. A binding to
another name's value (``hist = logger.history``) is an alias, not a fresh value, unless that
name is itself bound anew in the step (``x = batch[0]`` under ``for batch in loader``). Files
are parsed once (see :mod:`memsentry.usercode.lines`); nothing here raises.
"""

from __future__ import annotations

import ast
import functools

from memsentry.usercode.lines import fill_score, mtime, nodes_by_line, parse, spells

_LOOPS = (ast.For, ast.AsyncFor, ast.While)
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
Loop = ast.For | ast.AsyncFor | ast.While
#: How many aliases deep a fresh value is followed (``x = batch[0]``, ``batch = pair[1]``).
_ALIASES = 3


def rebound_each_step(path: str | None, line: int | None, name: str,
                      step_line: int | None = None) -> bool | None:
    """``True`` where ``name``, filled at ``line`` of ``path``, is bound to a fresh value at
    that line or earlier in the step (the loop around ``line`` and ``step_line``; with no
    ``step_line``, a line outside any loop counts: a method the step calls); ``False``
    where the statement at ``line`` builds it from itself or grows it in place; ``None``
    otherwise, or when there is no line or the file cannot be read."""
    if not path or line is None:
        return None
    return _rebound(path, mtime(path), line, name, step_line)


@functools.lru_cache(maxsize=1024)
def _rebound(path: str, stamp: float | None, line: int, name: str,
             step_line: int | None) -> bool | None:
    tree = parse(path, stamp)
    if tree is None:
        return None
    here = nodes_by_line(path, stamp).get(line, ())
    loop = _step_loop(tree, line, step_line)
    if loop is not None:
        body = _before(loop, line)
    else:  # no step loop around it: a method called each step binds at each call
        body = list(here) if step_line is None else []
    if any(_fresh(node, name, loop, body, _ALIASES) for node in body):
        return True
    if any(fill_score(node, name) >= 3 for node in here):
        return False
    return None


def _step_loop(tree: ast.AST, line: int, step_line: int | None) -> Loop | None:
    """The innermost loop whose body holds ``line`` and ``step_line`` (``None`` when none
    does: the line runs before the loop, once); without ``step_line``, the innermost around
    ``line``."""
    loops = _loops_around(tree, line)
    if step_line is not None:
        loops = [loop for loop in loops if _in_body(loop, step_line)]
    return loops[-1] if loops else None


def _in_body(loop: Loop, line: int) -> bool:
    return bool(loop.body) and loop.body[0].lineno <= line <= (loop.end_lineno or loop.lineno)


def _loops_around(tree: ast.AST, line: int) -> list[Loop]:
    """The loops whose bodies hold ``line``, outermost first, within the innermost function
    that holds it (a function defined in a loop runs in loops of its own)."""
    found: list[Loop] = []
    pending = [tree]
    while pending:
        node = pending.pop()
        for child in ast.iter_child_nodes(node):
            if not _spans(child, line):
                continue
            if isinstance(child, _FUNCTIONS):
                found = []
            elif isinstance(child, _LOOPS) and _in_body(child, line):
                found.append(child)
            pending.append(child)
    return found


def _spans(node: ast.AST, line: int) -> bool:
    """Whether ``node`` covers ``line`` (nodes without lines, such as a module, do)."""
    start = getattr(node, "lineno", None)
    if start is None:
        return True
    return start <= line <= (getattr(node, "end_lineno", None) or start)


def _before(loop: Loop, line: int) -> list[ast.AST]:
    """The loop itself (its target binds each step) and the statements of its body up to
    ``line``, nested ones included, not those of functions or classes defined in it."""
    found: list[ast.AST] = [loop]
    pending: list[ast.AST] = list(loop.body)
    while pending:
        node = pending.pop()
        if getattr(node, "lineno", line) <= line:
            found.append(node)
        pending.extend(child for child in ast.iter_child_nodes(node)
                       if not isinstance(child, _FUNCTIONS))
    return found


def _binds(target: ast.AST, name: str) -> bool:
    """Whether an assignment or loop target binds ``name`` (``x``, ``self.x``, ``(x, y)``)."""
    if isinstance(target, ast.Tuple | ast.List):
        return any(_binds(item, name) for item in target.elts)
    if isinstance(target, ast.Starred):
        return _binds(target.value, name)
    return not isinstance(target, ast.Subscript) and spells(target, name)


def _reads(value: ast.AST, name: str) -> bool:
    """Whether an expression reads ``name`` (as a variable or an attribute's name)."""
    return any((isinstance(sub, ast.Name) and sub.id == name)
               or (isinstance(sub, ast.Attribute) and sub.attr == name)
               for sub in ast.walk(value))


def _fresh(node: ast.AST, name: str, loop: Loop | None, body: list[ast.AST],
           depth: int) -> bool:
    """A statement that binds ``name`` to a fresh value: the step loop's own target, or an
    assignment of a value that neither reads ``name`` nor aliases what outlives the step."""
    if isinstance(node, ast.For | ast.AsyncFor):
        return node is loop and _binds(node.target, name)
    value = _bound_value(node, name)
    if value is None or _reads(value, name):
        return False
    base = _aliased(value)
    return base is None or (depth > 0 and base != name and any(
        _fresh(other, base, loop, body, depth - 1) for other in body))


def _bound_value(node: ast.AST, name: str) -> ast.expr | None:
    """The value an assignment binds ``name`` to, or ``None`` where it does not bind it."""
    if isinstance(node, ast.Assign):
        targets, value = node.targets, node.value
    elif isinstance(node, ast.AnnAssign) and node.value is not None:
        targets, value = [node.target], node.value
    else:
        return None
    return value if any(_binds(target, name) for target in targets) else None


def _aliased(value: ast.AST) -> str | None:
    """The name whose value ``value`` reaches without making a new one (``logger`` for
    ``logger.history``, ``batch`` for ``batch[0]``), or ``None`` for a value made anew (a
    call, a literal, arithmetic)."""
    while isinstance(value, ast.Attribute | ast.Subscript):
        value = value.value
    return value.id if isinstance(value, ast.Name) else None
