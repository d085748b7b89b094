"""An out-of-memory failure inside a tracked block: where it happened, what memory held, and
what would have made it fit."""

from __future__ import annotations

from dataclasses import dataclass, field

from memsentry.model.breakdown import Breakdown, outside_allocator, where
from memsentry.model.codec import SIGNED
from memsentry.model.kinds import FixKind, Phase, _Text


class OomSource(_Text):
    """What ran out of memory: PyTorch's own allocator (the caching allocator, cudaMallocAsync,
    the CPU's, MPS's), or a part of CUDA that allocates device memory outside it: a CUDA
    runtime or driver call torch checks itself (the context, a kernel launch, an extension's
    ``cudaMalloc``), or a library creating a handle or a workspace. ``CUDNN_START`` is cuDNN
    failing to start (``CUDNN_STATUS_NOT_INITIALIZED``), which is most often this too, and
    sometimes a cuDNN that does not match the driver."""

    ALLOCATOR = "allocator"
    CUDA_RUNTIME = "CUDA runtime"
    CUDA_DRIVER = "CUDA driver"
    CUBLAS = "cuBLAS"
    CUDNN = "cuDNN"
    CUDNN_START = "cuDNN start"
    CUFFT = "cuFFT"
    CUSOLVER = "cuSOLVER"


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
    - ``source``: what ran out: the allocator, or a part of CUDA outside it (then
      ``requested_bytes`` is ``None``: those errors give no size, and ``call`` is the call
      torch names, such as ``cublasCreate(handle)``, when it names one).
    - ``device``: on CUDA, the device the figures are of: the one that ran out (``cuda:1``)
      as the allocator's out-of-memory observer or its message names it, else the tracked
      device (an error outside the allocator names none). ``tracked`` is the device memsentry
      measured when that is another one: ``breakdown`` is then ``tracked``'s, while
      ``reserved``, ``device_free``, ``device_total`` and the NVML figures are ``device``'s
      (``None`` where they could not be read).
    - ``process_used`` and ``device_used``: NVML's count of this process's memory on the
      device and of every process's, read when the error was caught (``None`` without NVML).
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
    source: OomSource = OomSource.ALLOCATOR
    call: str | None = None
    device: str | None = None
    tracked: str | None = None
    process_used: int | None = None
    device_used: int | None = None

    @property
    def where(self) -> str:
        """``forward of `encoder.3```, ``optimizer step``, ``between layers``."""
        return where(self.phase, self.layer)

    @property
    def outside(self) -> bool:
        """Whether what ran out is outside PyTorch's allocator."""
        return self.source != OomSource.ALLOCATOR

    @property
    def outside_allocator(self) -> int | None:
        """The process's device memory that PyTorch's allocator does not hold: NVML's count for
        the process less what the allocator reserved (``None`` when either is unknown)."""
        return outside_allocator(self.process_used, self.reserved)

    @property
    def others(self) -> int | None:
        """The device memory other processes held, by NVML (``None`` when it does not say)."""
        if self.device_used is None or self.process_used is None:
            return None
        return max(0, self.device_used - self.process_used)


__all__ = ["LayerBytes", "OomFix", "OomSource", "OutOfMemory"]
