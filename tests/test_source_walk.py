"""Walking the user's source: one pass over a file answers every name asked about it, in the
order and with the enclosing functions a plain recursive walk gives."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import memsentry
from memsentry.usercode.lines import growth_line, mtime, nodes, nodes_by_line, walk_functions
from memsentry.usercode.rebinds import rebound_each_step

SOURCES = sorted(Path(memsentry.__file__).parent.rglob("*.py"))


def _recursive(node: ast.AST, function: str | None) -> Iterator[tuple[ast.AST, str | None]]:
    for child in ast.iter_child_nodes(node):
        inner = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) \
            else function
        yield child, inner
        yield from _recursive(child, inner)


#: Every seventh of the modules big enough to hold functions in functions (over 4 KB).
WALKED = [path for path in SOURCES if path.stat().st_size > 4096][::7]


@pytest.mark.parametrize("path", WALKED, ids=lambda p: p.name)
def test_the_walk_is_the_recursive_walk(path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    walked = [(id(node), function) for node, function in walk_functions(tree, None)]
    assert walked == [(id(node), function) for node, function in _recursive(tree, None)]
    assert len(walked) > 50  # a real module, not an empty one


def test_nodes_by_line_keep_the_walk_order(tmp_path: Path) -> None:
    script = tmp_path / "loop.py"
    script.write_text(
        "history = []\n"
        "def train(model, batches):\n"
        "    for x in batches:\n"
        "        loss = model(x).sum(); history.append(loss)\n"
        "    def inner():\n"
        "        history.extend([1])\n"
        "    return inner\n", encoding="utf-8")
    path = str(script)
    every = nodes(path, mtime(path))
    by_line = nodes_by_line(path, mtime(path))
    assert [n for n, _f in every if getattr(n, "lineno", None) == 4] == list(by_line[4])
    assert {f for n, f in every if getattr(n, "lineno", None) == 6} == {"inner"}
    # the growing statement wins over the binding, whichever name is asked first
    assert growth_line(path, "loss") == 4
    assert growth_line(path, "history") == 4
    assert growth_line(path, "history", function_line=5) == 6


def test_an_unreadable_file_has_no_nodes(tmp_path: Path) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n", encoding="utf-8")
    assert nodes(str(broken), mtime(str(broken))) == ()
    assert growth_line(str(broken), "x") is None


def test_a_census_does_not_walk_memsentrys_own_caches() -> None:
    # This module holds `nodes`, memsentry's cache of walked source; once it keeps 64 files
    # (hundreds of thousands of nodes) a census that walked it stopped at its time budget
    # and named no holder. It is memsentry's state, not the program's: left alone.
    for path in SOURCES[:64]:
        nodes(str(path), mtime(str(path)))
    assert nodes.cache_info().currsize >= 64
    model = nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kept = []
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(7):
            out = model(torch.randn(8, 16))
            out.pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            kept.append(out)
    report = t.report()
    assert not [n for n in report.notes if "stopped at its" in n]
    leaks = [f for f in report.findings if f.severity is memsentry.Severity.LEAK]
    assert [f.rule for f in leaks] == ["tensor-accumulation"]
    assert "`kept`" in leaks[0].message


# -- the lines that fill holders of issue 42's places, and rebinding --------------------------
_FILLS = '''\
import heapq, bisect, torch

class HistorySGD(torch.optim.Optimizer):
    def step(self):
        for p in self.params:
            st = self.state[p]
            st["count"] = 0
            st.setdefault("history", []).append(p.grad.clone())
            st["trace"] = torch.cat([st["trace"], p.grad])

def train(loader, seen):
    best, ranked = [], []
    first, spare = itertools.tee(loader)
    bank = torch.zeros(0)
    for step, x in enumerate(first):
        x = x.float()
        heapq.heappush(best, (step, x))
        bisect.insort(ranked, (step, x))
        seen.get().append(x)
        bank = torch.cat([bank, x])
        y = torch.randn(8 + step)
        y = y * 2
'''


def _lines(tmp_path: Path) -> Path:
    source = tmp_path / "fills.py"
    source.write_text(_FILLS)
    return source


def test_a_holder_spelled_with_a_string_key_is_filled_where_that_key_grows(
        tmp_path: Path) -> None:
    source = str(_lines(tmp_path))
    assert growth_line(source, "state[p]['history']") == 8  # setdefault(...).append
    assert growth_line(source, "state[p]['trace']") == 9  # concatenated onto itself
    assert growth_line(source, "state[p]['count']") == 7  # only ever set


def test_heaps_sorted_lists_unpacked_names_and_context_values_have_their_lines(
        tmp_path: Path) -> None:
    source = str(_lines(tmp_path))
    assert growth_line(source, "best") == 17  # heapq.heappush(best, ...), not `best, ranked = []`
    assert growth_line(source, "ranked") == 18
    assert growth_line(source, "spare") == 13  # bound by unpacking the tee
    assert growth_line(source, "seen") == 19  # seen.get().append(x)


def test_a_name_bound_anew_in_its_loop_before_it_is_filled_is_rebound(tmp_path: Path) -> None:
    source = str(_lines(tmp_path))
    assert rebound_each_step(source, 16, "x") is True  # `x = x.float()` after `for ... x in`
    assert rebound_each_step(source, 22, "y") is True  # `y = y * 2` after `y = torch.randn`
    assert rebound_each_step(source, 21, "y") is True  # a fresh value at the line itself
    assert rebound_each_step(source, 20, "bank") is False  # carried from the step before
    assert rebound_each_step(source, 9, "state[p]['trace']") is False
    assert rebound_each_step(None, 9, "x") is None


_STEPS = '''\
def train(loader, logger, model, opt):
    for epoch in range(3):
        preds = []
        for batch in loader:
            outs = []
            for t in range(batch.shape[0]):
                outs.append(model(batch[t]))
            x = batch[0]
            hist = logger.history
            hist.append(x)
            preds.append(x)
            opt.step()
'''


def test_the_step_is_the_loop_around_the_fill_and_the_optimizer_step(tmp_path: Path) -> None:
    """``outs = []`` at the top of the step is fresh for the inner loop that fills it;
    ``preds = []`` once an epoch is not fresh for the step; an alias of what outlives the step
    (``hist = logger.history``) is not fresh; ``x = batch[0]`` under ``for batch in loader``
    is."""
    source = tmp_path / "steps.py"
    source.write_text(_STEPS)
    path, step = str(source), 12
    assert rebound_each_step(path, 7, "outs", step) is True
    assert rebound_each_step(path, 11, "preds", step) is False
    assert rebound_each_step(path, 10, "hist", step) is False
    assert rebound_each_step(path, 8, "x", step) is True
    assert rebound_each_step(path, 7, "outs") is False  # no step line: the innermost loop
