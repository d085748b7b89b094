"""``missing-no-grad``: forward passes whose autograd graph no backward used."""

from __future__ import annotations

import re
from collections.abc import Sequence

from memsentry.model import (
    Cost,
    Finding,
    ReportData,
    Severity,
    Subject,
    SubjectKind,
    UnusedGraph,
)
from memsentry.rules.registry import rule
from memsentry.units import format_bytes

RULE_ID = "missing-no-grad"
#: A notebook cell's name, as memsentry labels cells (``In[5]``).
_CELL = re.compile(r"In\[\d+\]")
#: Cells named in a finding about several, at most.
_CELLS_NAMED = 4


def _in_cell(unused: UnusedGraph) -> bool:
    return unused.where is not None and bool(_CELL.fullmatch(unused.where.file))


def _by_site(unused: Sequence[UnusedGraph]) -> list[tuple[UnusedGraph, list[str]]]:
    """Each call site as it is, except that a module's calls from the top level of several
    notebook cells (a model looked at cell after cell) are one: the cells are the sites,
    named in the message; the first is the finding's line."""
    result: list[tuple[UnusedGraph, list[str]]] = []
    cells: dict[str, int] = {}  # module -> its merged entry in result
    for graph in unused:
        if not _in_cell(graph):
            result.append((graph, []))
            continue
        at = cells.get(graph.module)
        if at is None:
            cells[graph.module] = len(result)
            result.append((graph, [str(graph.where)]))
            continue
        known, sites = result[at]
        saved = max((b for b in (known.saved_bytes, graph.saved_bytes) if b is not None),
                    default=None)
        result[at] = (UnusedGraph(
            module=known.module, calls=known.calls + graph.calls,
            eval_calls=known.eval_calls + graph.eval_calls, saved_bytes=saved,
            where=known.where, unwatched=known.unwatched + graph.unwatched,
        ), [*sites, str(graph.where)])
    return result


def _caller(unused: UnusedGraph, cells: list[str]) -> str:
    where = unused.where
    if len(cells) > 1:
        named = ", ".join(cells[:_CELLS_NAMED]) + (", …" if len(cells) > _CELLS_NAMED else "")
        return f" in {len(cells)} notebook cells ({named})"
    if where is not None and where.function and where.function != "<module>":
        return f" from {where.function}() at {where}"
    return f" at {where}" if where is not None else ""


@rule(RULE_ID, severities={Severity.WASTE})
def missing_no_grad(report: ReportData) -> list[Finding]:
    """An outermost module ran with autograd on and no backward reached its output by the end
    of the iteration: evaluation or inference without ``torch.no_grad()``. Everything its ops
    saved for backward was kept for nothing, raising the peak (``eval()`` does not turn
    autograd off)."""
    return [_finding(unused, cells, report.cost) for unused, cells
            in _by_site(report.unused_graphs)
            if unused.saved_bytes != 0]  # nothing saved, nothing wasted


def _partial(cost: Cost | None) -> bool:
    """Whether memsentry followed every module call in only some of the iterations."""
    return cost is not None and cost.sampled < cost.iterations


def _finding(unused: UnusedGraph, cells: list[str], cost: Cost | None) -> Finding:
    """The WASTE of one call site's (or notebook cells') forward passes whose graph no
    backward used."""
    least = "at least " if _partial(cost) or unused.unwatched else ""
    passes = "es" if unused.calls != 1 else ""
    graphs = "s" if unused.calls != 1 else ""
    message = (
        f"`{unused.module}` ran {least}{unused.calls:,} forward "
        f"pass{passes} with autograd on{_caller(unused, cells)} ({_mode(unused)}) whose "
        f"graph{graphs} no backward used"
    )
    message += _budget_note(unused, cost) + _saved_note(unused)
    fix = (
        "run evaluation and inference under `with torch.no_grad():` (or "
        "`torch.inference_mode()`); `model.eval()` only switches dropout and batch norm, "
        "it leaves autograd on"
    )
    return Finding(rule=RULE_ID, severity=Severity.WASTE, message=message, fix=fix,
                   bytes=unused.saved_bytes, objects=unused.calls, location=unused.where,
                   subject=Subject(SubjectKind.MODULE, unused.module))


def _mode(unused: UnusedGraph) -> str:
    if unused.eval_calls:
        return f"{unused.eval_calls:,} of them in eval() mode"
    return "in train() mode"


def _budget_note(unused: UnusedGraph, cost: Cost | None) -> str:
    """Why memsentry may have seen only some of the calls: it watched some of this site's
    calls, or followed every call in only some iterations (nothing said when neither)."""
    if unused.unwatched:
        return (
            f" (memsentry watched only some of its calls, to keep to its budget: "
            f"{unused.unwatched:,} more were not judged)"
        )
    if cost is None or not _partial(cost):
        return ""
    return (
        f" (memsentry followed every module call in {cost.sampled:,} of "
        f"{cost.iterations:,} iterations, to keep to its budget, and not all calls in "
        "the others)"
    )


def _saved_note(unused: UnusedGraph) -> str:
    """What each call kept saved for backward, when measured."""
    if unused.saved_bytes is None:
        return ""
    return (
        f"; each kept up to {format_bytes(unused.saved_bytes)} saved for backward "
        "for nothing, on top of the peak"
    )
