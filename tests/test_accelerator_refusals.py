"""Accelerators whose torch refuses memsentry's reads, without the device: a Mac whose torch
release has ``torch.accelerator.memory_stats`` but no MPS device allocator behind it, an
accelerator that refuses later, in a hook, and MPS's out-of-memory message, whose MB and GB
are powers of 1024. Each fake says which torch source it plays."""

from __future__ import annotations

import pytest
import torch
from conftest import make_mlp
from fake_cuda import GiB, MiB, format_size
from test_fake_devices import FakeAllocator, xpu  # noqa: F401  (the fixture)
from torch import nn

import memsentry

#: The message torch gives: c10/core/CachingDeviceAllocator.cpp (``GetDeviceAllocator``) does
#: ``TORCH_INTERNAL_ASSERT(device_allocator, "Allocator for ", t, " is not a
#: DeviceAllocator.")``, and c10/util/Exception.h puts the condition, file and line first.
NOT_A_DEVICE_ALLOCATOR = (
    'device_allocator INTERNAL ASSERT FAILED at "/Users/runner/work/pytorch/pytorch/c10/core/'
    'CachingDeviceAllocator.cpp":14, please report a bug to PyTorch. Allocator for mps is not '
    "a DeviceAllocator.")


def mps_format_size(size: int) -> str:
    """A size as aten/src/ATen/mps/MPSAllocator.mm's own ``format_size`` prints it (the
    releases before it called c10's): ``N bytes`` up to 1024, then the size divided by
    1024.0, 1048576.0 or 1073741824.0 with two decimals and ``KB``, ``MB`` or ``GB``: c10's
    arithmetic under other names."""
    return format_size(size, ("KB", "MB", "GB"))


class FakeMps:
    """torch on a Mac, from a release whose MPS allocator is not yet a device allocator:

    - ``torch.accelerator.current_accelerator()`` is ``mps``;
    - ``torch.accelerator.memory_stats``, ``reset_peak_memory_stats`` and
      ``get_memory_info``: torch/accelerator/memory.py calls a ``torch._C._accelerator_*``
      binding that asks ``at::getDeviceAllocator(mps)`` for the allocator, and
      c10/core/CachingDeviceAllocator.cpp fails its internal assert (a ``RuntimeError``);
    - ``torch.mps.current_allocated_memory()`` (torch/mps/__init__.py: the memory occupied
      by tensors, the pools' cached blocks left out) and ``driver_allocated_memory()`` (all
      the Metal driver allocated for the process, cached blocks and MPS/MPSGraph's own
      allocations included): the pools keep what was freed, so the driver's figure never
      falls. With ``counters=False`` those refuse too; ``refuse_counters`` makes them start
      refusing later;
    - ``alloc_buffer_block`` (aten/src/ATen/mps/MPSAllocator.mm), past the high watermark:
      ``MPS backend out of memory (MPS allocated: <total>, other allocations: <other>, max
      allowed: <limit>). Tried to allocate <size> on private pool. Use
      PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 ...`` from ``TORCH_CHECK``: a ``RuntimeError``,
      sizes by its own ``format_size``."""

    def __init__(self, *, counters: bool = True) -> None:
        self.allocated = 4 * MiB
        self.driver = 64 * MiB
        self.limit = 18 * GiB
        self.counters = counters
        self.refused: list[str] = []

    def allocate(self, size: int) -> None:
        if self.allocated + size > self.limit:
            raise RuntimeError(
                f"MPS backend out of memory (MPS allocated: {mps_format_size(self.driver)}, "
                f"other allocations: {mps_format_size(0)}, max allowed: "
                f"{mps_format_size(self.limit)}). Tried to allocate {mps_format_size(size)} "
                "on private pool. Use PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable upper "
                "limit for memory allocations (may cause system failure).")
        self.allocated += size
        self.driver = max(self.driver, self.allocated + 60 * MiB)

    def refuse(self, what: str) -> None:
        self.refused.append(what)
        raise RuntimeError(NOT_A_DEVICE_ALLOCATOR)

    def current_allocated_memory(self) -> int:
        if not self.counters:
            raise RuntimeError("MPS backend is not available")
        return self.allocated

    def driver_allocated_memory(self) -> int:
        if not self.counters:
            raise RuntimeError("MPS backend is not available")
        return self.driver


@pytest.fixture
def mps(monkeypatch: pytest.MonkeyPatch) -> FakeMps:
    fake = FakeMps()
    for name, function in {
        "current_accelerator": lambda: torch.device("mps"),
        "current_device_index": lambda: 0,
        "memory_stats": lambda index=None: fake.refuse("memory_stats"),
        "reset_peak_memory_stats": lambda index=None: fake.refuse("reset_peak_memory_stats"),
        "get_memory_info": lambda index=None: fake.refuse("get_memory_info"),
    }.items():
        monkeypatch.setattr(torch.accelerator, name, function)
    monkeypatch.setattr(torch.mps, "current_allocated_memory", fake.current_allocated_memory)
    monkeypatch.setattr(torch.mps, "driver_allocated_memory", fake.driver_allocated_memory)
    return fake


def train(allocate: object, *, steps: int = 8, **options: object) -> memsentry.Report:
    """SGD steps of a small model tracked on the process's accelerator; ``allocate()`` after
    each step stands for what the step keeps on the device."""
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    device = options.pop("device", "mps")
    with memsentry.track(model, device=device, on_leak="ignore", holders=False,
                         **options) as t:  # type: ignore[arg-type]
        for _ in range(steps):
            model(torch.randn(8, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
            allocate()  # type: ignore[operator]
    return t.report()


def notes(report: memsentry.Report) -> str:
    return " ".join(" ".join(report.notes).split())


@pytest.mark.parametrize("exact", [False, True])
def test_on_a_mac_whose_torch_refuses_the_accelerator_stats_mps_counters_measure_the_run(
        mps: FakeMps, exact: bool) -> None:
    """torch.accelerator.memory_stats() fails torch's internal assert when tracking starts:
    the run is tracked from torch.mps's own counters, the leak is found in them, and the
    notes say where the figures came from and why."""
    report = train(lambda: mps.allocate(MiB), exact=exact, overhead=None)  # every row: no budget
    assert report.backend == "mps-counters" and report.device == "mps:0"
    assert [it.allocated - report.baseline for it in report.iterations] == [
        i * MiB for i in range(8)]
    assert report.reserved == mps.driver
    (finding,) = [f for f in report.findings if f.rule == "memory-growth"]
    assert "1.0 MiB/iter on mps:0" in finding.message
    shown = notes(report)
    assert "mps figures come from torch.mps.current_allocated_memory()" in shown
    assert "(Allocator for mps is not a DeviceAllocator)" in shown
    assert ("even with exact=True" in shown) is exact
    assert "reset_peak_memory_stats" not in mps.refused  # nothing else asked of it


def test_on_a_mac_whose_torch_refuses_every_counter_nothing_is_measured_and_nothing_raises(
        mps: FakeMps) -> None:
    mps.counters = False
    report = train(lambda: mps.allocate(MiB))
    assert {it.allocated for it in report.iterations} == {0}
    assert report.reserved is None and report.total_memory is None
    assert not [f for f in report.findings if f.rule in ("memory-growth", "memory-headroom")]
    shown = notes(report)
    assert ("Nothing was measured on mps:0: torch refused its memory statistics "
            "(torch.accelerator: Allocator for mps is not a DeviceAllocator; torch.mps: MPS "
            "backend is not available)") in shown
    assert "or track the run on the CPU (device='cpu')" in shown


def test_mps_counters_that_refuse_later_are_stepped_around_in_the_hooks(mps: FakeMps) -> None:
    calls = iter(range(100))

    def allocate() -> None:
        mps.allocate(MiB)
        if next(calls) == 3:
            mps.counters = False  # torch.mps starts refusing in the middle of the run

    report = train(allocate)
    shown = notes(report)
    assert "Nothing was measured on mps:0" in shown
    assert "torch.mps: MPS backend is not available" in shown


@pytest.mark.parametrize(("exact", "refused"), [(False, "memory_stats"),
                                                (True, "reset_peak_memory_stats")])
def test_an_accelerator_that_refuses_in_a_hook_stops_being_read_and_the_loop_goes_on(
        xpu: FakeAllocator, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
        exact: bool, refused: str) -> None:
    """The accelerator answered when tracking began; from the fourth step it refuses (the
    call memsentry makes at every hook: the statistics, or in exact mode the peak's
    reset): the loop runs to its end, and the notes quote torch."""
    answer = getattr(torch.accelerator, refused)
    steps = iter(range(100))
    asked: list[str] = []

    def refusing(index: int | None = None) -> object:
        if xpu.allocated >= 7 * MiB:
            asked.append(refused)
            raise RuntimeError(NOT_A_DEVICE_ALLOCATOR.replace("mps", "xpu"))
        return answer(index)

    monkeypatch.setattr(torch.accelerator, refused, refusing)
    report = train(lambda: xpu.allocate(MiB) if next(steps) < 8 else None, device="xpu",
                   exact=exact)
    assert asked == [refused]  # once: then memsentry asks no more
    assert report.backend == "xpu-accelerator"
    shown = notes(report)
    assert ("Nothing was measured on xpu:0: torch refused its memory statistics "
            "(Allocator for xpu is not a DeviceAllocator)") in shown
    assert report.reserved is None and report.total_memory is None


def test_an_mps_out_of_memory_message_reads_its_mb_as_mebibytes(mps: FakeMps) -> None:
    """The fourth step asks MPS for 256 MiB past its high watermark; its message says
    '256.00 MB', which MPSAllocator.mm computed in powers of 1024: the post-mortem reads
    256 MiB, not 244 MiB."""

    class Wide(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            if self.calls == 4:
                mps.limit = mps.allocated + 100 * MiB
                mps.allocate(256 * MiB)
            return x * 1.0

    model = nn.Sequential(nn.Linear(16, 16), Wide(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(RuntimeError, match=r"Tried to allocate 256\.00 MB on private pool"):
        with memsentry.track(model, device="mps", on_leak="ignore", holders=False) as t:
            for _ in range(6):
                model(torch.randn(8, 16)).sum().backward()
                opt.step()
                opt.zero_grad()
    oom = t.report().oom
    assert oom is not None and oom.requested_bytes == 256 * MiB
    assert (oom.phase, oom.layer) == ("forward", "1")
    assert "asking for 256 MiB" in " ".join(str(t.report()).split())
