"""An out-of-memory failure inside a tracked block: where it happened, what memory held, and
what would have made it fit."""

from __future__ import annotations

from dataclasses import dataclass, field

from memsentry.model.breakdown import Breakdown, where
from memsentry.model.codec import SIGNED
from memsentry.model.kinds import FixKind, Phase


@dataclass(frozen=True)
class LayerBytes:
    """A layer and a number of bytes it accounts for (its activations saved for backward)."""

    layer: str
    bytes: int


@dataclass(frozen=True)
class OomFix:
    """One change that would lower the memory the run needed: what to do (``text``), the
    bytes it would save by memsentry's arithmetic (``saves``; ``None`` when it cannot say),
    and for a smaller batch the batch that would have fit (``batch``)."""

    kind: FixKind
    text: str
    saves: int | None = field(default=None, metadata=SIGNED)
    batch: int | None = None


@dataclass(frozen=True)
class OutOfMemory:
    """``report.oom``: the out-of-memory error that ended the tracked block.

    - ``error`` and ``message``: the exception's type and the first line of its message.
    - ``phase`` and ``layer``: where the loop was (the forward or backward of that layer, an
      optimizer step, or between layers); ``iteration``: the iteration running.
    - ``requested_bytes``: the size of the allocation that failed, from CUDA's out-of-memory
      observer or read from the message (``None`` when neither says).
    - ``segment``: ``requested_bytes`` is the segment CUDA's caching allocator asked the
      driver for, not the tensor's own size: its observer and its message give that segment
      (2 MiB for a request up to 1 MiB, 20 MiB for one up to 10 MiB, larger ones rounded up
      to 2 MiB).
    - ``breakdown``: what memory held when the error was caught, by category.
    - ``capacity``: the most the allocator could have held: on CUDA the least of ``limit``
      and ``reserved`` plus ``device_free``; elsewhere the device's memory (the machine's
      for the CPU), when known.
    - ``batch``: the batch size of the running iteration, when known.
    - ``largest``: the layers with the most activations saved for backward.
    - ``fixes``: changes that would have made it fit, with their arithmetic.
    - ``device_free``: on CUDA, the device's free memory when the allocator gave up, from
      its out-of-memory observer or its message.
    - ``limit``: on CUDA, the allocator's limit: the cap ``torch.cuda.
      set_per_process_memory_fraction`` set, else the device's memory.
    - ``reserved``: on CUDA, the memory the allocator held from the driver when the error
      was caught (its cache included).
    - ``device_total``: on CUDA, the device's memory.
    """

    error: str
    message: str
    phase: Phase
    layer: str | None
    iteration: int
    requested_bytes: int | None
    breakdown: Breakdown
    capacity: int | None = None
    batch: int | None = None
    largest: tuple[LayerBytes, ...] = ()
    fixes: tuple[OomFix, ...] = ()
    device_free: int | None = None
    segment: bool = False
    limit: int | None = None
    reserved: int | None = None
    device_total: int | None = None

    @property
    def where(self) -> str:
        """``forward of `encoder.3```, ``optimizer step``, ``between layers``."""
        return where(self.phase, self.layer)


__all__ = ["LayerBytes", "OomFix", "OutOfMemory"]
