"""One fake of torch's CUDA, for the tests that run without a GPU: each stands in for torch's
C++ side (the ``torch._C`` bindings, the allocators' refusals and messages), lets torch's own
Python run on it, and names in its docstring the torch source it follows:

- :class:`FakeCachingAllocator` (the native allocator), :class:`FakePinnedAllocator`,
  :class:`FakeAsyncAllocator` (``backend:cudaMallocAsync``) and
  :class:`FakePluggableAllocator` (``change_current_allocator``), put where torch reads them
  by :func:`install` and :func:`install_history`; :func:`format_size` prints sizes as they do;
- :func:`props` and :func:`install_devices`: the devices torch sees, without an allocator;
- :class:`FakeCublas`, :data:`CUBLAS`, :data:`RUNTIME_NOW` and :data:`RUNTIME_BEFORE`: what
  torch raises when memory runs out outside the caching allocator.

NVML (nvidia-ml-py's pynvml) is faked in tests/fake_nvml.py; the fake of
``torch.accelerator`` (not CUDA) stays in tests/test_fake_devices.py; and
tests/plugin_cases/plugin_fake_cuda.py fakes the pytest plugin's own CUDA calls, not torch's.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import torch

from memsentry.measure.cuda import OOM_OBSERVER

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
#: A fake allocator, as :func:`install` hands it back.
Fake = TypeVar("Fake", bound="FakeCachingAllocator")


def format_size(size: int, units: tuple[str, str, str] = ("KiB", "MiB", "GiB")) -> str:
    """A size as torch's allocators print it in their messages (c10's ``format_size``, used
    by c10/cuda/CUDACachingAllocator.cpp and CUDAMallocAsyncAllocator.cpp): ``N bytes`` up
    to 1024, then KiB up to 1 MiB, MiB up to 1 GiB, else GiB, with two decimals (``units``:
    the names printed for those three)."""
    kib, mib, gib = units
    if size <= 1024:
        return f"{size} bytes"
    for unit, scale in ((kib, KiB), (mib, MiB)):
        if size <= 1024 * scale:
            return f"{size / scale:.2f} {unit}"
    return f"{size / GiB:.2f} {gib}"


class FakeCachingAllocator:
    """CUDA's caching allocator in miniature, as c10/cuda/CUDACachingAllocator.cpp does it:

    - ``round_size``: requests round up to 512 bytes (kMinBlockSize);
    - ``get_allocation_size``: a new segment is 2 MiB for a request up to 1 MiB (kSmallSize,
      kSmallBuffer), 20 MiB for one under 10 MiB (kMinLargeAlloc, kLargeBuffer), else the
      request rounded up to 2 MiB (kRoundLarge); freed blocks stay cached (reserved);
    - ``alloc_block``: with a fraction set (``limit``, as ``setMemoryFraction`` makes
      ``allowed_memory_maximum``), a segment that would take the reserved bytes past it
      fails; otherwise cudaMalloc fails when the device has too little free (``others``
      stands for what other processes hold);
    - ``malloc``, when no segment can be had: each out-of-memory observer is called as
      ``(device, alloc_size, set_fraction ? allowed_memory_maximum : device_total,
      device_free)``, then ``OutOfMemoryError`` is raised with "CUDA out of memory. Tried to
      allocate <alloc_size>. GPU 0 has a total capacity of <total> of which <free> is free.
      [<limit> allowed; ]Of the allocated memory ...". (torch first frees its unused cached
      segments and retries; the fake does not, which leaves reserved plus free unchanged);
    - a peak per statistic: bytes allocated, reserved and active (active is allocated here:
      no block waits on another stream) and the count of live allocations; nothing resets
      them but ``resetPeakStats``, which resets every one of them to its current value
      (``DeviceCachingAllocator::resetPeakStats`` calls ``reset_peak_stat`` on the
      allocation, segment, active, inactive_split and every bytes stat of each pool, and on
      the oversize ones): torch has no reset of one peak alone;
    - the statistics are nested as torch/csrc/cuda/Module.cpp's ``memoryStats`` nests them
      (``{stat: {"all": {"current": ..., "peak": ...}}}``, beside plain counters such as
      ``num_ooms``), and reach the program through torch/cuda/memory.py's own functions
      (``memory_stats``, ``max_memory_allocated``, ``reset_peak_memory_stats``), which call
      ``torch._C._cuda_memoryStats`` and ``torch._C._cuda_resetPeakMemoryStats``: the fake
      stands in for those two bindings, not for torch's Python;
    - until CUDA is initialised (``initialized``, set by the first allocation or by hand),
      the raw statistics call refuses the device index, as torch's does, and torch's
      ``memory_stats`` answers ``{}`` without asking;
    - ``torch.cuda.get_allocator_backend()`` says ``native`` (torch/csrc/cuda/Module.cpp
      returns the allocator's ``name()``)."""

    backend = "native"

    def __init__(self, total: int = 80 * 1024 * MiB, *, initialized: bool = True) -> None:
        self.total = total
        self.initialized = initialized
        self.limit: int | None = None  # set_per_process_memory_fraction's cap
        self.others = 0  # what other processes hold on the device
        self.allocated = self.reserved = self.blocks = 0
        self.peaks = dict.fromkeys(self.current(), 0)
        self.cached = {"small": 0, "large": 0}
        self.resets = 0
        self.ooms = 0
        self.observers: list[Callable[[int, int, int, int], None]] = []

    def set_fraction(self, fraction: float) -> None:
        self.limit = int(fraction * self.total)

    def current(self) -> dict[str, int]:
        """Each statistic's current value, by its name in ``memory_stats()``."""
        return {"allocated_bytes": self.allocated, "reserved_bytes": self.reserved,
                "active_bytes": self.allocated, "allocation": self.blocks}

    @property
    def peak(self) -> int:
        return self.peaks["allocated_bytes"]

    def taken(self, size: int) -> None:
        """A block of ``size`` bytes handed out: the statistics and their peaks follow."""
        self.allocated += size
        self.blocks += 1
        for name, value in self.current().items():
            self.peaks[name] = max(self.peaks[name], value)

    @property
    def device_free(self) -> int:
        return self.total - self.others - self.reserved

    def malloc(self, size: int) -> int:
        self.initialized = True
        size = -(-size // 512) * 512
        pool = "small" if size <= MiB else "large"
        if self.cached[pool] < size:
            segment = 2 * MiB if pool == "small" else (
                20 * MiB if size < 10 * MiB else -(-size // (2 * MiB)) * 2 * MiB)
            if not self.fits(segment):
                self.out_of_memory(segment)
            self.reserved += segment
            self.cached[pool] += segment
        self.cached[pool] -= size
        self.taken(size)
        return size

    def fits(self, segment: int) -> bool:
        if self.limit is not None and self.reserved + segment > self.limit:
            return False
        return segment <= self.device_free

    def out_of_memory(self, segment: int) -> None:
        self.ooms += 1
        for observer in self.observers:  # as the allocator does before raising
            observer(0, segment, self.total if self.limit is None else self.limit,
                     self.device_free)
        allowed = "" if self.limit is None else f"{format_size(self.limit)} allowed; "
        raise torch.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate {format_size(segment)}. GPU 0 has a "
            f"total capacity of {format_size(self.total)} of which "
            f"{format_size(self.device_free)} is free. {allowed}Of the allocated memory "
            f"{format_size(self.allocated)} is allocated by PyTorch, and "
            f"{format_size(self.reserved - self.allocated)} is reserved by PyTorch but "
            "unallocated.")

    def free(self, size: int) -> None:
        self.allocated -= size
        self.blocks -= 1
        self.cached["small" if size <= MiB else "large"] += size

    def nested(self, index: int) -> dict[str, Any]:
        """``torch._C._cuda_memoryStats(index)``."""
        if not self.initialized:
            raise RuntimeError("Invalid device argument")
        stats: dict[str, Any] = {name: {"all": {"current": value, "peak": self.peaks[name]}}
                                 for name, value in self.current().items()}
        stats["num_ooms"] = self.ooms
        return stats

    def reset_peak(self, index: int | None = None) -> None:
        """``torch._C._cuda_resetPeakMemoryStats(index)``: every peak at once."""
        self.peaks = self.current()
        self.resets += 1

    def attach_observer(self, observer: Callable[[int, int, int, int], None]) -> None:
        self.observers.append(observer)


class FakePinnedAllocator:
    """CUDA's pinned host allocator in miniature, as aten/src/ATen/core/CachingHostAllocator.h
    does it: a request rounds up to a power of two (``PowerOf2Ceil``) and takes a cached
    block of that size or makes one; a freed block stays cached; the stats are
    ``torch.cuda.host_memory_stats()``'s flat keys."""

    def __init__(self) -> None:
        self.blocks: dict[int, int] = {}  # size: blocks made
        self.free_blocks: dict[int, int] = {}
        self.active = self.peak = 0

    def pin(self, size: int) -> int:
        size = 1 << (size - 1).bit_length()
        if self.free_blocks.get(size, 0):
            self.free_blocks[size] -= 1
        else:
            self.blocks[size] = self.blocks.get(size, 0) + 1
        self.active += size
        self.peak = max(self.peak, self.held)
        return size

    def unpin(self, size: int) -> None:
        self.active -= size
        self.free_blocks[size] = self.free_blocks.get(size, 0) + 1

    def unpin_after_copy(self, size: int) -> None:
        """A block given back once its ``non_blocking`` copy's event completed, as torch 2.11
        does it on an H100: the block is reusable but its bytes stay counted as active (20
        batches of 64 KiB: 1.3 MiB active of 128 KiB held)."""
        self.free_blocks[size] = self.free_blocks.get(size, 0) + 1

    @property
    def held(self) -> int:
        return sum(size * count for size, count in self.blocks.items())

    def stats(self) -> dict[str, int]:
        return {"allocated_bytes.current": self.held, "allocated_bytes.peak": self.peak,
                "active_bytes.current": self.active,
                "allocations.current": sum(self.blocks.values())}


#: How torch words a refusal: TORCH_CHECK(false, "<who> does not yet support <what>. If you
#: need it, please file an issue describing your use case.") becomes a RuntimeError.
ASK = "If you need it, please file an issue describing your use case."


class FakeAsyncAllocator(FakeCachingAllocator):
    """CUDA's stream-ordered allocator as c10/cuda/CUDAMallocAsyncAllocator.cpp drives it:

    - ``mallocAsync``: a request takes its exact size from the device's pool; it fails when
      ``pytorch_used_bytes + size`` passes ``pytorch_memory_limits`` (``UINT64_MAX`` until
      ``setMemoryFraction`` sets ``fraction * device_total``) or when cudaMallocAsync cannot
      grow the pool (``others``: what other processes hold); it then raises
      ``OutOfMemoryError`` with "Allocation on device 0 would exceed allowed memory. (out of
      memory)" and the lines "Currently allocated", "Requested", "Device limit", "Free
      (according to CUDA)" and "PyTorch limit (set by user-supplied memory fraction)";
      no out-of-memory observer is called;
    - the pool keeps what was freed (``lazy_init_device`` sets its release threshold to
      ``UINT64_MAX``): reserved never shrinks;
    - ``getDeviceStats`` fills only the aggregate allocated and reserved bytes and their
      peaks (the driver's used and reserved memory); ``resetPeakStats`` works;
    - ``attachOutOfMemoryObserver`` and ``recordHistory`` raise "cudaMallocAsync does not
      yet support <it>. If you need it, ..."; ``snapshot`` raises "Calling snapshot with
      backend:cudaMallocAsync is not meaningful. ...";
    - its ``name()`` is ``cudaMallocAsync``."""

    backend = "cudaMallocAsync"
    UNSET = 2**64 - 1

    def __init__(self) -> None:
        super().__init__()
        self.history_calls = 0
        self.attach_calls = 0

    def current(self) -> dict[str, int]:
        return {"allocated_bytes": self.allocated, "reserved_bytes": self.reserved}

    def malloc(self, size: int) -> int:
        self.initialized = True
        limit = self.UNSET if self.limit is None else self.limit
        grow = max(0, self.allocated + size - self.reserved)
        if self.allocated + size > limit or grow > self.device_free:
            self.out_of_memory(size)
        self.reserved += grow
        self.taken(size)
        return size

    def free(self, size: int) -> None:
        self.allocated -= size
        self.blocks -= 1

    def out_of_memory(self, size: int) -> None:
        limit = self.UNSET if self.limit is None else self.limit
        raise torch.OutOfMemoryError(
            "Allocation on device 0 would exceed allowed memory. (out of memory)"
            f"\nCurrently allocated     : {format_size(self.allocated)}"
            f"\nRequested               : {format_size(size)}"
            f"\nDevice limit            : {format_size(self.total)}"
            f"\nFree (according to CUDA): {format_size(self.device_free)}"
            "\nPyTorch limit (set by user-supplied memory fraction)"
            f"\n                        : {format_size(limit)}")

    def attach_observer(self, observer: Callable[[int, int, int, int], None]) -> None:
        self.attach_calls += 1
        raise RuntimeError(f"cudaMallocAsync does not yet support attachOutOfMemoryObserver. "
                           f"{ASK}")

    def record_history(self, *args: Any, **kwargs: Any) -> None:
        self.history_calls += 1
        raise RuntimeError(f"cudaMallocAsync does not yet support recordHistory. {ASK}")

    def snapshot(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.history_calls += 1
        raise RuntimeError("Calling snapshot with backend:cudaMallocAsync is not meaningful.")


class FakePluggableAllocator(FakeCachingAllocator):
    """An allocator loaded with ``torch.cuda.memory.change_current_allocator`` (RMM, a custom
    ``.so``), as torch/csrc/cuda/CUDAPluggableAllocator.cpp serves it: ``getDeviceStats``,
    ``resetPeakStats``, ``attachOutOfMemoryObserver``, ``recordHistory`` and ``snapshot``
    each raise "CUDAPluggableAllocator does not yet support <it>. If you need it, ..."; its
    ``name()`` is ``pluggable``. torch/cuda/memory.py's readers answer ``{}`` (so 0) before
    CUDA is initialised and call ``getDeviceStats`` after; ``reset_peak_memory_stats``
    always calls ``resetPeakStats``. ``changeCurrentAllocator`` refuses an initialised
    allocator: :meth:`plug` is the swap, made before the first allocation."""

    backend = "native"

    def __init__(self, *, plugged: bool = True) -> None:
        super().__init__(initialized=False)
        if plugged:
            self.plug()
        self.refused: list[str] = []

    def plug(self) -> None:
        assert not self.initialized, "Can't swap an already initialized allocator"
        self.backend = "pluggable"

    def refuse(self, what: str) -> None:
        if self.backend == "pluggable":
            self.refused.append(what)
            raise RuntimeError(f"CUDAPluggableAllocator does not yet support {what}. {ASK}")

    def nested(self, index: int) -> dict[str, Any]:
        self.refuse("getDeviceStats")
        return super().nested(index)

    def reset_peak(self, index: int | None = None) -> None:
        self.refuse("resetPeakStats")
        super().reset_peak(index)

    def attach_observer(self, observer: Callable[[int, int, int, int], None]) -> None:
        self.refuse("attachOutOfMemoryObserver")
        super().attach_observer(observer)

    def record_history(self, *args: Any, **kwargs: Any) -> None:
        self.refuse("recordHistory")

    def snapshot(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.refuse("snapshot")
        return {"segments": [], "device_traces": [[]]}


def install(monkeypatch: pytest.MonkeyPatch, fake: Fake) -> Fake:
    """Put ``fake`` where torch reads CUDA: the raw statistics and reset bindings (torch's
    own Python readers, ``torch.cuda.memory_stats`` and the rest, run unchanged on them),
    whether and where CUDA runs, and the out-of-memory observer's binding; ``fake`` back,
    for a fixture to return."""
    fake.pinned = FakePinnedAllocator()  # type: ignore[attr-defined]
    for name, value in {
        "is_available": lambda: True, "device_count": lambda: 1, "current_device": lambda: 0,
        "is_initialized": lambda: fake.initialized,
        "get_allocator_backend": lambda: fake.backend,
        "get_device_properties": lambda index=None: props(None, name="Fake GPU",
                                                           total=fake.total),
        "host_memory_stats": fake.pinned.stats,  # type: ignore[attr-defined]
    }.items():
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(torch.cuda.memory, "is_initialized", lambda: fake.initialized)
    monkeypatch.setattr(torch._C, "_cuda_memoryStats", fake.nested, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_resetPeakMemoryStats", fake.reset_peak,
                        raising=False)
    monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer",
                        fake.attach_observer, raising=False)
    monkeypatch.setattr(OOM_OBSERVER, "attached", False)  # attach to this fake
    return fake


def install_history(monkeypatch: pytest.MonkeyPatch,
                    fake: FakeAsyncAllocator | FakePluggableAllocator) -> None:
    """Put ``fake``'s ``recordHistory`` and ``snapshot`` (and their refusals) where
    torch/cuda/memory.py calls them."""
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", fake.record_history)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", fake.snapshot)


# -- the devices torch sees ------------------------------------------------------------------


class CUuuid:
    """torch._C._CUuuid: ``str()`` gives the bare 8-4-4-4-12 hex form, without NVML's prefix."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __str__(self) -> str:
        return self.text


def props(uuid: str | None, bus: int | None = None, name: str = "GPU", *,
          total: int = 80 * GiB) -> types.SimpleNamespace:
    """torch.cuda.get_device_properties(i) (torch/csrc/cuda/Module.cpp): ``uuid`` a
    :class:`CUuuid`, absent without one; the PCI fields only with ``bus``."""
    fields: dict[str, Any] = {"name": name, "total_memory": total}
    if uuid is not None:
        fields["uuid"] = CUuuid(uuid)
    if bus is not None:
        fields.update(pci_bus_id=bus, pci_domain_id=0, pci_device_id=0)
    return types.SimpleNamespace(**fields)


def install_devices(monkeypatch: pytest.MonkeyPatch, devices: list[types.SimpleNamespace],
                    initialised: bool = True) -> None:
    """torch.cuda seeing ``devices`` (:func:`props`, in CUDA's order), no allocator."""
    for name, value in {
        "is_available": lambda: True, "device_count": lambda: len(devices),
        "is_initialized": lambda: initialised,
        "get_device_properties": lambda index=None: devices[index or 0],
    }.items():
        monkeypatch.setattr(torch.cuda, name, value)


# -- out of memory outside the caching allocator ---------------------------------------------

#: aten/src/ATen/cuda/Exceptions.h's ``TORCH_CUDABLAS_CHECK`` around CublasHandlePool.cpp's
#: ``cublasCreate``, raised as a ``RuntimeError`` (TORCH_CHECK).
CUBLAS = "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"
#: As torch 2.8 and later word a failed CUDA runtime call (c10/cuda/CUDAException.cpp's
#: "CUDA error: " and ``cudaGetErrorString``, then CUDAMiscFunctions.cpp's help lines), raised
#: as ``torch.AcceleratorError`` whose ``error_code`` is the cudaError_t.
RUNTIME_NOW = (
    "CUDA error: {}\nSearch for `{}' in https://docs.nvidia.com/cuda/cuda-runtime-api/"
    "group__CUDART__TYPES.html for more information.\nFor more detailed error information, run "
    "with CUDA_LOG_FILE=stderr\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side "
    "assertions.\n")
#: As older releases word it (get_cuda_check_suffix), raised as a RuntimeError.
RUNTIME_BEFORE = (
    "CUDA error: {}\nCUDA kernel errors might be asynchronously reported at some other API "
    "call, so the stacktrace below might be incorrect.\nFor debugging consider passing "
    "CUDA_LAUNCH_BLOCKING=1\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side "
    "assertions.\n")


class FakeCublas:
    """cuBLAS's handle pool: the first matmul of a device and thread creates a handle, which
    cuBLAS allocates with cudaMalloc (``handle_bytes``) from the device's free memory, outside
    the caching allocator; with too little free, torch raises what TORCH_CUDABLAS_CHECK says
    (:data:`CUBLAS`). The handle counts as the process's memory outside the allocator: the
    device's ``own``, which the test's fixture sets."""

    def __init__(self, device: FakeCachingAllocator, handle_bytes: int = 64 * MiB) -> None:
        self.device = device
        self.handle_bytes = handle_bytes
        self.handles = 0

    def create(self) -> None:
        if self.device.device_free < self.handle_bytes:
            raise RuntimeError(CUBLAS)
        self.device.others += self.handle_bytes  # the process's, not the allocator's
        self.device.own += self.handle_bytes  # type: ignore[attr-defined]
        self.handles += 1
