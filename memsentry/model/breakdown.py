"""What memory held at an iteration's peak, split into the four parts of a training step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from memsentry.model.kinds import Phase

#: The categories in the order tables show them.
CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "other")


def where(phase: Phase, layer: str | None) -> str:
    """A moment of the loop for display: ``forward of `encoder.3```, ``optimizer step``."""
    if layer is None or phase in (Phase.BETWEEN, Phase.STEP):
        return str(phase)
    return f"{phase} of `{layer}`"


def outside_allocator(process_used: int | None, reserved: int | None) -> int | None:
    """A process's device memory outside PyTorch's caching allocator: what NVML counts for the
    process (``process_used``) less what the allocator ``reserved`` from the driver: the CUDA
    context, cuBLAS and cuDNN handles and workspaces, NCCL's buffers, other libraries'
    ``cudaMalloc``. ``None`` when either figure is unknown."""
    if process_used is None or reserved is None:
        return None
    return max(0, process_used - reserved)


@dataclass(frozen=True)
class Breakdown:
    """Memory at one moment, in bytes, by what it is.

    - ``parameters``: the storages of the model's and the optimizers' parameters (a storage
      shared by several parameters counted once).
    - ``gradients``: the storages of those parameters' ``.grad`` at that moment.
    - ``optimizer_state``: the tensors the optimizers keep per parameter (Adam's two moments
      and its step counters), created at their first step.
    - ``activations``: tensors saved for backward by the modules' forwards and not yet freed
      by the backward (saved-tensor accounting; parameters a layer saves are not counted
      twice).
    - ``other``: ``total`` less the four: temporaries, workspaces, inputs, outputs, and on a
      backend that reads the process heap every other allocation of the process.
    - ``total``: the backend's figure at that moment (the iteration's peak for a per-iteration
      breakdown, on the iterations table's scale).

    ``phase`` and ``layer`` say where the loop was when it was read: the forward or the
    backward of that layer, or an iteration boundary. When the four parts exceed ``total``
    (the peak was read between the samples the parts were read at), ``other`` is 0 and
    ``excess`` holds the difference. ``read_in`` is the iteration whose reading of the four
    parts this one carries (``None``: read in this one), when memsentry measured the layers
    in turn to keep within ``track(overhead=...)``.
    """

    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    other: int
    total: int
    phase: Phase = Phase.BETWEEN
    layer: str | None = None
    excess: int = 0
    read_in: int | None = None

    @classmethod
    def of(cls, total: int, *, parameters: int, gradients: int, optimizer_state: int,
           activations: int, phase: Phase = Phase.BETWEEN, layer: str | None = None,
           read_in: int | None = None) -> Breakdown:
        """A breakdown whose ``other`` is what the four parts leave of ``total``."""
        known = parameters + gradients + optimizer_state + activations
        return cls(parameters=parameters, gradients=gradients, optimizer_state=optimizer_state,
                   activations=activations, other=max(0, total - known), total=total,
                   phase=phase, layer=layer, excess=max(0, known - total), read_in=read_in)

    def part(self, name: str) -> int:
        """The bytes of category ``name`` (one of :data:`CATEGORIES`)."""
        if name not in CATEGORIES:
            raise KeyError(f"no category {name!r}; the categories are {', '.join(CATEGORIES)}")
        value: int = getattr(self, name)
        return value

    @property
    def where(self) -> str:
        """Where the loop was, for display: ``backward of `encoder.3```."""
        return where(self.phase, self.layer)


@dataclass(frozen=True)
class Breakdowns:
    """``report.breakdown``: the breakdown at each iteration's peak (``iterations``, in the
    order of ``report.iterations``) and at the highest of them (``peak``; ``None`` when no
    iteration was recorded)."""

    peak: Breakdown | None
    iterations: tuple[Breakdown, ...]

    @classmethod
    def of(cls, parts: Sequence[Breakdown | None]) -> Breakdowns:
        found = tuple(p for p in parts if p is not None)
        peak = max(found, key=lambda p: p.total) if found else None
        return cls(peak=peak, iterations=found)


__all__ = ["CATEGORIES", "Breakdown", "Breakdowns", "outside_allocator", "where"]
