"""Per-layer and per-iteration figures, and the arithmetic every reader of a timeline shares."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from memsentry.model.breakdown import Breakdown
from memsentry.model.codec import SIGNED
from memsentry.model.kinds import Boundary


@dataclass(frozen=True)
class LayerStats:
    """Memory figures of one module, per forward call, the largest call seen.

    All sizes are bytes; ``None`` means the figure was not measured (for instance the
    backward figures of a layer whose forward ran without autograd).

    - ``param_bytes``: parameters of the module and its children (shared ones counted once).
    - ``output_bytes``: storage of the tensors the forward returned, each storage once.
    - ``saved_bytes``: activation memory saved for backward by ops run inside the forward,
      excluding parameters and buffers (they are not new memory).
    - ``forward_delta``: allocated after the forward minus allocated before it.
    - ``forward_peak``: highest allocated during the forward minus allocated before it.
    - ``backward_delta`` / ``backward_peak``: the same around the module's backward.
    - ``measured_calls``: the forward calls whose memory was read (the others were counted
      only, when measuring every call would have cost more than ``track(overhead=...)``).
    - ``calls_complete``: whether ``calls`` counts every call; ``False`` when some ran with
      no hook of memsentry's on the module (a light iteration, a window of layers without
      it), so that ``calls`` is a lower bound.
    """

    name: str
    type: str
    depth: int
    calls: int
    param_bytes: int
    output_bytes: int | None
    saved_bytes: int | None
    forward_delta: int | None = field(metadata=SIGNED)
    forward_peak: int | None = field(metadata=SIGNED)
    backward_delta: int | None = field(default=None, metadata=SIGNED)
    backward_peak: int | None = field(default=None, metadata=SIGNED)
    backward_calls: int = 0
    is_leaf: bool = True
    measured_calls: int = 0
    calls_complete: bool = True


@dataclass(frozen=True)
class IterationStats:
    """One iteration of the loop: from one boundary (optimizer step or ``t.step()``) to the next.

    ``allocated`` and ``reserved`` are read at the closing boundary; ``peak`` is the highest
    allocated seen inside the iteration; ``boundary`` says what closed it (a
    :class:`~memsentry.Boundary`: ``"optimizer"``, ``"step"`` for ``t.step()``, or ``"exit"``
    for the end of tracking, a partial iteration). ``data_seconds`` is the time the
    iteration's thread spent fetching batches from a ``DataLoader`` (collating them, or
    waiting for its workers), ``None`` when it fetched none; ``batch`` is the first
    dimension of the first tensor given to the outermost module (``None`` when no tensor was
    given). ``parts`` is what memory held at the iteration's peak, by category (``None`` in
    reports written before breakdowns existed).
    ``sampled`` is false for an iteration memsentry measured only at its closing boundary,
    to keep its cost budget: its ``peak`` is then that boundary's reading, a lower bound, and
    it has no ``parts``, ``reserved`` or ``batch``.
    ``peak_exact`` is true where ``peak`` counts every allocation of the iteration (a device's
    peak counter reset where it began, or storage counting); false where it is the highest
    of the samples taken at hooks, a lower bound that misses temporaries inside a layer
    (cuDNN and cuBLAS workspaces, attention scores): rules that judge the peak against the
    device or against reserved memory skip such iterations.
    ``resident`` is the process's resident memory as the system counts it (tensors, Python
    objects, libraries, everything) and ``python_blocks`` the blocks Python's small-object
    allocator hands out (each object of 512 bytes or less takes one), both read at the closing
    boundary (``None`` where the system does not say, and in reports written before they
    were read).
    """

    index: int
    allocated: int
    reserved: int | None
    peak: int
    seconds: float
    boundary: Boundary = Boundary.STEP
    forward_calls: int = 0
    data_seconds: float | None = None
    batch: int | None = None
    parts: Breakdown | None = None
    sampled: bool = True
    resident: int | None = None
    python_blocks: int | None = None
    peak_exact: bool = False


def complete(iterations: Sequence[IterationStats], *, skip: int = 0) -> list[IterationStats]:
    """The iterations a boundary closed (the partial one at the end of tracking left out),
    without the first ``skip`` of them (warm-up)."""
    return [it for it in iterations if it.boundary != Boundary.EXIT][skip:]


def growth_per_iteration(
    iterations: Sequence[IterationStats], *, warmup: int, at_least: int = 2
) -> float | None:
    """Least-squares slope of allocated bytes (per iteration) over the complete iterations
    after the first ``warmup``; ``None`` when fewer than ``at_least`` remain, or when they
    share one index (a report edited by hand: no slope)."""
    its = complete(iterations, skip=warmup)
    if len(its) < at_least:
        return None
    return slope([(it.index, it.allocated) for it in its])


def slope(points: Sequence[tuple[int, int]]) -> float | None:
    """Least-squares slope of (iteration, bytes) ``points``, per iteration; ``None`` with
    fewer than two, or when they share one index (a report edited by hand: no slope)."""
    if len(points) < 2 or len({index for index, _ in points}) < 2:
        return None
    return statistics.linear_regression([float(i) for i, _ in points],
                                        [float(v) for _, v in points]).slope
