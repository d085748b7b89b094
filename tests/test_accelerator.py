"""The device-generic backend over ``torch.accelerator``, against a fake accelerator that keeps
an allocator's counters (allocated, reserved, a peak that only resets when asked)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_mlp

import memsentry
from memsentry.measure import AcceleratorBackend, make_backend, parse_device
from memsentry.measure.accelerator import accelerator_type
from memsentry.measure.devices import supported_device_types

MiB = 1 << 20


class FakeAllocator:
    """The counters of one device's caching allocator, as ``memory_stats()`` reports them."""

    def __init__(self) -> None:
        self.allocated = 4 * MiB
        self.peak = self.allocated
        self.reserved = 8 * MiB
        self.resets = 0

    def allocate(self, size: int) -> None:
        self.allocated += size
        self.peak = max(self.peak, self.allocated)
        self.reserved = max(self.reserved, -(-self.allocated // (2 * MiB)) * 2 * MiB)

    def free(self, size: int) -> None:
        self.allocated -= size

    def api(self) -> dict[str, object]:
        def memory_stats(index: int | None = None) -> dict[str, int]:
            return {"allocated_bytes.all.current": self.allocated,
                    "allocated_bytes.all.peak": self.peak,
                    "reserved_bytes.all.current": self.reserved}

        def reset_peak_memory_stats(index: int | None = None) -> None:
            self.peak = self.allocated
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
