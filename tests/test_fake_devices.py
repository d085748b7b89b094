"""The device backends without the device: the CUDA backend against a fake of the caching
allocator (512-byte block rounding, 2 MiB and 20 MiB segments kept after frees, a peak
counter that only resets when asked: tests/fake_cuda.py), and the device-generic
``torch.accelerator`` backend against a fake accelerator (here: it fakes no CUDA)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_mlp
from fake_cuda import FakeCachingAllocator, KiB, MiB, install
from torch import nn

import memsentry
from memsentry.measure import AcceleratorBackend, CudaBackend, make_backend, parse_device
from memsentry.measure.accelerator import accelerator_type
from memsentry.measure.devices import supported_device_types


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
    # figures of every iteration: no budget
    with memsentry.track(model, device="xpu", on_leak="ignore", holders=False,
                         overhead=None) as t:
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


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCachingAllocator:
    return install(monkeypatch, FakeCachingAllocator())


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
    backend.start()
    size = cuda.malloc(5 * MiB)
    cuda.free(size)
    # Freed memory stays reserved; the peak counter rose: reported once, until an iteration
    # begins and the counter is reset for it.
    assert (backend.allocated(), backend.reserved()) == (0, 20 * MiB)
    assert backend.sample() == (0, 5 * MiB)
    assert backend.sample() == (0, None)
    assert backend.peak_mode == "exact per iteration"
    backend.restart_peak()
    cuda.free(cuda.malloc(2 * MiB))
    assert backend.sample() == (0, 2 * MiB)  # below the old high: seen only after the reset
    assert backend.total_memory() == cuda.total
    backend.stop()


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
    backend.start()
    cuda.free(cuda.malloc(MiB))
    assert backend.sample() == (0, MiB)
    assert backend.sample() == (0, 0)
    assert cuda.resets == 3 and backend.peak_mode == "exact"  # at start, and at each sample
    backend.stop()


def test_exact_mode_leaves_every_peak_the_program_reads_as_it_was(
        cuda: FakeCachingAllocator) -> None:
    """The program warmed up with four 3 MiB blocks, then reads its own peaks after an
    exact-mode run, which reset the counters at every hook: torch's one reset takes every
    peak back (the count of allocations and the active bytes too), yet the program reads
    the peaks of its whole run."""
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
    assert cuda.peak < 12 * MiB and cuda.resets > 3  # the counters themselves were reset
    assert torch.cuda.max_memory_allocated() == 12 * MiB
    assert (stats["allocation.all.peak"], stats["active_bytes.all.peak"]) == (4, 12 * MiB)
    assert torch.cuda.max_memory_reserved() == cuda.reserved
    shown = " ".join(" ".join(t.report().notes).split())
    assert ("torch.cuda.max_memory_allocated(), max_memory_reserved(), memory_stats() and your "
            "own reset_peak_memory_stats() read as they would without memsentry") in shown


def test_tracking_leaves_every_peak_of_the_program_as_it_reads_them(
        cuda: FakeCachingAllocator) -> None:
    for block in [cuda.malloc(3 * MiB) for _ in range(4)]:
        cuda.free(block)
    model = make_mlp()
    with memsentry.track(model, device="cuda", on_leak="ignore", holders=False) as t:
        for _ in range(3):
            model(torch.randn(8, 16)).sum().backward()
            t.step()
    stats = torch.cuda.memory_stats()
    assert (stats["allocation.all.peak"], torch.cuda.max_memory_allocated()) == (4, 12 * MiB)
    assert cuda.resets >= 3  # one where each iteration began
    assert "exact per iteration" in str(t.report())


def test_track_on_cuda_follows_the_allocator(cuda: FakeCachingAllocator) -> None:
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # figures of every iteration: no budget
    with memsentry.track(model, device="cuda", on_leak="ignore", holders=False,
                         overhead=None) as t:
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
    # Most of each peak is the kept blocks, which no part of the step holds: how the peak
    # would grow with the batch is not known, so no batch is offered.
    assert "memory-headroom" not in rules
    assert all(it.peak_exact for it in report.iterations)
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
