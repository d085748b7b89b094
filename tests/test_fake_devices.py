"""The device backends without the device: the CUDA backend against a fake of the caching
allocator (512-byte block rounding, 2 MiB and 20 MiB segments kept after frees, a peak
counter that only resets when asked), and the device-generic ``torch.accelerator`` backend
against a fake accelerator."""

from __future__ import annotations

import types
from collections.abc import Callable

import pytest
import torch
from conftest import make_mlp
from torch import nn

import memsentry
from memsentry.measure import AcceleratorBackend, CudaBackend, make_backend, parse_device
from memsentry.measure.accelerator import accelerator_type
from memsentry.measure.cuda import OOM_OBSERVER
from memsentry.measure.devices import supported_device_types

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


class FakeAllocator:
    """The counters of one device's caching allocator, as ``memory_stats()`` reports them.
    ``reset_peak_memory_stats`` resets both peaks, allocated and reserved
    (torch/accelerator/memory.py: it resets "the 'peak' stats tracked by the current
    accelerator memory allocator")."""

    def __init__(self) -> None:
        self.allocated = 4 * MiB
        self.peak = self.allocated
        self.reserved = self.reserved_peak = 8 * MiB
        self.resets = 0

    def allocate(self, size: int) -> None:
        self.allocated += size
        self.peak = max(self.peak, self.allocated)
        self.reserved = max(self.reserved, -(-self.allocated // (2 * MiB)) * 2 * MiB)
        self.reserved_peak = max(self.reserved_peak, self.reserved)

    def free(self, size: int) -> None:
        self.allocated -= size

    def api(self) -> dict[str, object]:
        def memory_stats(index: int | None = None) -> dict[str, int]:
            return {"allocated_bytes.all.current": self.allocated,
                    "allocated_bytes.all.peak": self.peak,
                    "reserved_bytes.all.current": self.reserved,
                    "reserved_bytes.all.peak": self.reserved_peak}

        def reset_peak_memory_stats(index: int | None = None) -> None:
            self.peak, self.reserved_peak = self.allocated, self.reserved
            self.resets += 1

        return {
            "current_accelerator": lambda: torch.device("xpu"),
            "current_device_index": lambda: 0,
            "memory_stats": memory_stats,
            "reset_peak_memory_stats": reset_peak_memory_stats,
            "get_memory_info": lambda index=None: (48 * 1024 * MiB, 64 * 1024 * MiB),
        }


@pytest.fixture
def xpu(monkeypatch: pytest.MonkeyPatch) -> FakeAllocator:
    fake = FakeAllocator()
    for name, function in fake.api().items():  # torch.accelerator's functions, not the module
        monkeypatch.setattr(torch.accelerator, name, function)
    return fake


def test_without_an_accelerator_only_cpu_and_cuda_are_measured() -> None:
    assert accelerator_type() is None  # this CPU build has none
    assert supported_device_types() == ("cpu", "cuda")
    with pytest.raises(memsentry.UnsupportedDeviceError, match="'cpu', 'cuda' memory"):
        parse_device("xpu")


def test_the_process_accelerator_is_measured(xpu: FakeAllocator) -> None:
    assert supported_device_types() == ("cpu", "cuda", "xpu")
    backend = make_backend(parse_device("xpu"))
    assert isinstance(backend, AcceleratorBackend)
    assert (backend.name, str(backend.device)) == ("xpu-accelerator", "xpu:0")
    assert backend.allocated() == 4 * MiB and backend.reserved() == 8 * MiB
    assert backend.total_memory() == 64 * 1024 * MiB
    xpu.allocate(6 * MiB)
    xpu.free(6 * MiB)
    # The peak counter rose in between: the sample reports it, without resetting it.
    assert backend.sample() == (4 * MiB, 10 * MiB)
    assert backend.sample() == (4 * MiB, None)
    assert xpu.resets == 0 and backend.peak_mode == "sampled"


def test_exact_mode_resets_the_accelerator_peak_counter(xpu: FakeAllocator) -> None:
    backend = make_backend(torch.device("xpu", 0), exact=True)
    xpu.allocate(2 * MiB)
    xpu.free(2 * MiB)
    assert backend.sample() == (4 * MiB, 6 * MiB)
    assert backend.sample() == (4 * MiB, 4 * MiB)
    assert xpu.resets == 2 and backend.peak_mode == "exact"
    assert "reset at every hook" in backend.notes[0]
    assert ("torch.accelerator.max_memory_allocated(), max_memory_reserved() and every '.peak' "
            "of memory_stats() now read from memsentry's last sample") in backend.notes[0]


def test_track_on_the_accelerator_follows_its_counters(xpu: FakeAllocator) -> None:
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with memsentry.track(model, device="xpu", on_leak="ignore", holders=False) as t:
        for _ in range(8):
            model(torch.randn(8, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
            xpu.allocate(MiB)  # a leak of 1 MiB per iteration on the device
    report = t.report()
    assert (report.device, report.backend) == ("xpu:0", "xpu-accelerator")
    assert report.baseline == 4 * MiB
    assert [it.allocated - report.baseline for it in report.iterations] == [
        i * MiB for i in range(8)
    ]
    (finding,) = report.findings
    assert finding.rule == "memory-growth" and "1.0 MiB/iter on xpu:0" in finding.message
    assert report.total_memory == 64 * 1024 * MiB


def format_size(size: int) -> str:
    """A size as torch's allocators print it in their messages (c10's ``format_size``, used
    by c10/cuda/CUDACachingAllocator.cpp and CUDAMallocAsyncAllocator.cpp): ``N bytes`` up
    to 1024, then KiB up to 1 MiB, MiB up to 1 GiB, else GiB, with two decimals."""
    if size <= 1024:
        return f"{size} bytes"
    for unit, scale in (("KiB", KiB), ("MiB", MiB)):
        if size <= 1024 * scale:
            return f"{size / scale:.2f} {unit}"
    return f"{size / GiB:.2f} GiB"


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
    - until CUDA is initialised (``initialized``, set by the first allocation or by hand),
      the raw statistics call refuses the device index, as torch's does;
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

    def nested(self, index: int) -> dict[str, dict[str, dict[str, int]]]:
        if not self.initialized:
            raise RuntimeError("Invalid device argument")
        return {name: {"all": {"current": value, "peak": self.peaks[name]}}
                for name, value in self.current().items()}

    def flat(self, index: int | None = None) -> dict[str, int]:
        """``torch.cuda.memory_stats()`` (torch/cuda/memory.py: ``{}`` before CUDA is
        initialised)."""
        if not self.initialized:
            return {}
        flat = {}
        for name, value in self.current().items():
            flat[f"{name}.all.current"] = value
            flat[f"{name}.all.peak"] = self.peaks[name]
        return flat

    def reset_peak(self, index: int | None = None) -> None:
        self.peaks = self.current()
        self.resets += 1

    def attach_observer(self, observer: Callable[[int, int, int, int], None]) -> None:
        self.observers.append(observer)


class FakePinnedAllocator:
    """CUDA's pinned host allocator in miniature: a request rounds up to a power of two and
    takes a cached block of that size or makes one; a freed block stays cached; the stats are
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


def install(monkeypatch: pytest.MonkeyPatch, fake: FakeCachingAllocator) -> None:
    """Put ``fake`` where memsentry reads CUDA: ``torch.cuda``'s functions (its readers
    answer from ``memory_stats()``, as torch/cuda/memory.py's do), the raw statistics call
    and the out-of-memory observer's binding."""
    fake.pinned = FakePinnedAllocator()  # type: ignore[attr-defined]
    for name, value in {
        "is_available": lambda: True, "device_count": lambda: 1, "current_device": lambda: 0,
        "is_initialized": lambda: fake.initialized,
        "get_allocator_backend": lambda: fake.backend,
        "memory_allocated": lambda index=None: fake.flat(index).get(
            "allocated_bytes.all.current", 0),
        "max_memory_allocated": lambda index=None: fake.flat(index).get(
            "allocated_bytes.all.peak", 0),
        "memory_reserved": lambda index=None: fake.flat(index).get(
            "reserved_bytes.all.current", 0),
        "max_memory_reserved": lambda index=None: fake.flat(index).get(
            "reserved_bytes.all.peak", 0),
        "reset_peak_memory_stats": fake.reset_peak,
        "get_device_properties": lambda index=None: types.SimpleNamespace(
            total_memory=fake.total, name="Fake GPU"),
        "memory_stats": fake.flat,
        "host_memory_stats": fake.pinned.stats,  # type: ignore[attr-defined]
    }.items():
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(torch._C, "_cuda_memoryStats", fake.nested, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer",
                        fake.attach_observer, raising=False)
    monkeypatch.setattr(OOM_OBSERVER, "attached", False)  # attach to this fake


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCachingAllocator:
    fake = FakeCachingAllocator()
    install(monkeypatch, fake)
    return fake


def test_the_fake_allocator_rounds_caches_and_runs_out(cuda: FakeCachingAllocator) -> None:
    assert cuda.malloc(1000) == 1024
    assert (cuda.allocated, cuda.reserved) == (1024, 2 * MiB)
    cuda.free(1024)
    assert (cuda.allocated, cuda.reserved, cuda.peak) == (0, 2 * MiB, 1024)
    cuda.malloc(3 * MiB)
    assert cuda.reserved == 22 * MiB
    with pytest.raises(torch.OutOfMemoryError):
        cuda.malloc(cuda.total)


def test_cuda_backend_reads_allocated_reserved_and_new_peaks(cuda: FakeCachingAllocator) -> None:
    backend = make_backend(parse_device("cuda"))
    assert isinstance(backend, CudaBackend) and str(backend.device) == "cuda:0"
    size = cuda.malloc(5 * MiB)
    cuda.free(size)
    # Freed memory stays reserved; the peak counter rose: reported once, never reset.
    assert (backend.allocated(), backend.reserved()) == (0, 20 * MiB)
    assert backend.sample() == (0, 5 * MiB)
    assert backend.sample() == (0, None)
    assert cuda.resets == 0 and backend.peak_mode == "sampled"
    assert backend.total_memory() == cuda.total


def test_a_cuda_backend_made_before_cuda_is_initialised_reads_zero(
        cuda: FakeCachingAllocator) -> None:
    # Seen on an H100 (torch 2.11): the raw statistics call raised "Invalid device argument"
    # when the backend was made before the process's first CUDA call.
    cuda.initialized = False
    backend = make_backend(parse_device("cuda"))
    assert backend.allocated() == 0 and backend.sample() == (0, None)
    size = cuda.malloc(3 * MiB)  # the first allocation initialises CUDA
    assert backend.allocated() == size and backend.sample() == (size, size)


def test_cuda_exact_mode_resets_the_peak_counter_at_every_read(
        cuda: FakeCachingAllocator) -> None:
    backend = make_backend(parse_device("cuda:0"), exact=True)
    cuda.free(cuda.malloc(MiB))
    assert backend.sample() == (0, MiB)
    assert backend.sample() == (0, 0)
    assert cuda.resets == 2 and backend.peak_mode == "exact"


def test_exact_mode_says_that_every_peak_the_program_reads_was_reset(
        cuda: FakeCachingAllocator) -> None:
    """The program warmed up with four 3 MiB blocks, then reads its own peaks after an
    exact-mode run: torch's one reset took every peak back, the count of allocations and
    the active bytes too, not only max_memory_allocated(); the note says so."""
    for block in [cuda.malloc(3 * MiB) for _ in range(4)]:
        cuda.free(block)
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with memsentry.track(model, device="cuda", exact=True, on_leak="ignore",
                         holders=False) as t:
        for _ in range(3):
            model(torch.randn(8, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
            cuda.free(cuda.malloc(MiB))
    stats = torch.cuda.memory_stats()
    assert torch.cuda.max_memory_allocated() < 12 * MiB
    assert stats["allocation.all.peak"] < 4 and stats["active_bytes.all.peak"] < 12 * MiB
    shown = " ".join(" ".join(t.report().notes).split())
    assert ("torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved() and every "
            "'.peak' of torch.cuda.memory_stats() now read from memsentry's last sample, not "
            "from the start of your run; track without exact=True to keep them") in shown


def test_tracking_without_exact_leaves_every_peak_of_the_program_alone(
        cuda: FakeCachingAllocator) -> None:
    for block in [cuda.malloc(3 * MiB) for _ in range(4)]:
        cuda.free(block)
    model = make_mlp()
    with memsentry.track(model, device="cuda", on_leak="ignore", holders=False) as t:
        for _ in range(3):
            model(torch.randn(8, 16)).sum().backward()
    stats = torch.cuda.memory_stats()
    assert (stats["allocation.all.peak"], torch.cuda.max_memory_allocated()) == (4, 12 * MiB)
    assert cuda.resets == 0
    assert "no peak statistic was reset" in " ".join(" ".join(t.report().notes).split())


def test_track_on_cuda_follows_the_allocator(cuda: FakeCachingAllocator) -> None:
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with memsentry.track(model, device="cuda", on_leak="ignore", holders=False) as t:
        for _ in range(8):
            model(torch.randn(8, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
            cuda.malloc(3 * MiB)  # kept: 3 MiB a step
    report = t.report()
    assert (report.device, report.backend) == ("cuda:0", "cuda-caching-allocator")
    # Each step closes at optimizer.step(), before that step's 3 MiB is kept.
    assert [it.allocated for it in report.iterations] == [3 * MiB * i for i in range(8)]
    assert report.reserved == 40 * MiB  # two 20 MiB segments hold the eight 3 MiB blocks
    rules = {f.rule: f for f in report.findings}
    assert "3.0 MiB/iter on cuda:0" in rules["memory-growth"].message
    assert rules["memory-headroom"].severity is memsentry.Severity.HINT
    assert report.nvml is not None and report.nvml["available"] is False


def test_pinned_host_memory_is_in_the_breakdown(cuda: FakeCachingAllocator) -> None:
    """Batches pinned as a DataLoader(pin_memory=True) pins them: each 3 MB request takes a
    4 MiB block, and the next batch is pinned before the one in use is given back (three
    blocks, two in use); the report says what the pinned allocator holds,
    apart from the device's figures."""
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    pinned = cuda.pinned  # type: ignore[attr-defined]
    with memsentry.track(model, device="cuda", on_leak="ignore", holders=False) as t:
        in_flight = [pinned.pin(3_000_000), pinned.pin(3_000_000)]
        for _ in range(6):
            model(torch.randn(8, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
            in_flight.append(pinned.pin(3_000_000))  # the next batch, while one is in use
            pinned.unpin(in_flight.pop(0))
    report = t.report()
    assert report.pinned == memsentry.PinnedMemory(held=12 * MiB, in_use=8 * MiB,
                                                   peak=12 * MiB, blocks=3)
    text = " ".join(str(report).split())
    assert ("Pinned host memory (page-locked RAM, not in the device's figures): 12 MiB held by "
            "PyTorch's pinned allocator in 3 blocks, 8.0 MiB of it in use, at most 12 MiB"
            ) in text
    assert report.allocated == 0  # pinned pages are host memory: the device's count is apart


def test_a_pinned_count_torch_gets_wrong_is_not_reported(cuda: FakeCachingAllocator) -> None:
    """Batches pinned and copied with non_blocking=True, on a torch whose count of bytes in use
    never drops for blocks given back after a copy: the report keeps what it holds and its
    peak, and says the part in use is not known rather than "1.3 MiB of 128 KiB in use"."""
    model = nn.Linear(256, 256)
    pinned = cuda.pinned  # type: ignore[attr-defined]
    with memsentry.track(model, device="cuda", on_leak="ignore", holders=False) as t:
        for _ in range(20):
            block = pinned.pin(64 * 256 * 4)
            model(torch.randn(64, 256)).sum().backward()
            pinned.unpin_after_copy(block)
    report = t.report()
    assert report.pinned == memsentry.PinnedMemory(held=64 * KiB, in_use=None,
                                                   peak=64 * KiB, blocks=1)
    text = " ".join(str(report).split())
    assert ("64 KiB held by PyTorch's pinned allocator in 1 block, the part of it in use not "
            "known (torch counted more bytes in use than the allocator holds), at most 64 KiB"
            ) in text
    assert "B of it in use" not in text  # no figure for bytes in use


def test_nothing_pinned_leaves_the_breakdown_as_it_was(cuda: FakeCachingAllocator) -> None:
    model = make_mlp()
    with memsentry.track(model, device="cuda", on_leak="ignore", holders=False) as t:
        for _ in range(3):
            model(torch.randn(8, 16)).sum().backward()
            t.step()
    assert t.report().pinned is None
    assert "Pinned host memory" not in str(t.report())


def test_an_out_of_memory_error_on_cuda_is_explained_with_the_allocator_figures(
        cuda: FakeCachingAllocator) -> None:
    """A layer's forward asks the allocator for more than the device has left, as a batch
    too large would: the post-mortem reads the allocator's figures at that moment, the size
    from CUDA's message, and works out the batch that fits in the device's memory."""

    class Wide(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            # 16 MiB of activations at batch 8 (2 MiB a sample), kept until the backward;
            # the fourth call asks for a batch's worth 8,000 times too large.
            size = 16 * MiB if self.calls < 4 else 8000 * 16 * MiB
            block = cuda.malloc(size)
            x = x * 1.0
            x.register_hook(lambda grad: cuda.free(block))
            return x

    model = torch.nn.Sequential(torch.nn.Linear(16, 16), Wide(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(torch.OutOfMemoryError) as caught:
        with memsentry.track(model, device="cuda", on_leak="ignore", holders=False) as t:
            for _ in range(6):
                model(torch.randn(8, 16)).sum().backward()
                opt.step()
                opt.zero_grad()
    assert str(caught.value).startswith("CUDA out of memory. Tried to allocate 125.00 GiB")
    oom = t.report().oom
    assert oom is not None
    assert (oom.phase, oom.layer, oom.iteration, oom.batch) == ("forward", "1", 3, 8)
    assert oom.requested_bytes == 128000 * MiB  # the observer's figure, exact
    assert oom.capacity == cuda.total
    assert oom.device_free == cuda.total - cuda.reserved
    assert "free on the device when it gave up" in str(t.report())
    # The allocator's figure when the error was caught: nothing of this step's 16 MiB yet.
    assert oom.breakdown.total == cuda.allocated
    (fix,) = [f for f in oom.fixes if f.kind == "batch"]
    # What does not scale (the breakdown's total less activations) plus, per sample, the
    # request's share: 16,000 MiB a sample against 80 GiB.
    per_sample = oom.breakdown.activations / 8 + 128000 * MiB / 8
    fixed = oom.breakdown.total - oom.breakdown.activations
    assert fix.batch == int((cuda.total - fixed) // per_sample) == 5
