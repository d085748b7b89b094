"""Which GPU NVML describes (issue 39, item 5), on fakes: torch's ``cuda:N`` is found in NVML
by its UUID, never by NVML's index N (another GPU under ``CUDA_VISIBLE_DEVICES`` or the default
``CUDA_DEVICE_ORDER``); a MIG slice is described by the slice's figures, not its parent's; a
model spread over two GPUs is reported device by device.

The fakes follow the sources: NVML as nvidia-ml-py's pynvml serves it (tests/fake_nvml.py:
``nvmlDeviceGetHandleByUUID`` takes a GPU's ``GPU-<hex>`` or a MIG device's ``MIG-<hex>``
and returns its handle; a MIG device handle's memory is the slice's and its utilisation is
not supported; ``nvmlDeviceIsMigDeviceHandle`` returns a ctypes ``c_uint``; a process's
``usedGpuMemory`` is ``None`` where NVML gives NVML_VALUE_NOT_AVAILABLE), and torch's device
properties (tests/fake_cuda.py), which carry ``uuid`` as a ``_CUuuid`` whose ``str()`` is
the bare hex form (torch/csrc/cuda/Module.cpp)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from typing import Any

import pytest
import torch
from conftest import make_mlp
from fake_cuda import FakeCachingAllocator, GiB, MiB, install, install_devices, props
from fake_nvml import Gpu, fake_pynvml

import memsentry
from memsentry.measure.nvml import query
from memsentry.model import ReportData
from memsentry.reporters.text import render_header

UUID_A = "aaaaaaaa-1111-2222-3333-444444444444"  # NVML's GPU 0, CUDA's cuda:1
UUID_B = "bbbbbbbb-5555-6666-7777-888888888888"  # NVML's GPU 1, CUDA's cuda:0
SLICE_1 = "c1c1c1c1-0000-1111-2222-333333333333"  # a 1g.10gb slice of the MIG GPU
SLICE_2 = "c2c2c2c2-0000-1111-2222-333333333333"  # a 3g.40gb slice beside it


def two_gpus() -> list[Gpu]:
    """NVML's order (PCI): A at bus 0x17, B at bus 0x65; this process uses 20 GiB on B and
    6 GiB on A."""
    pid = os.getpid()
    return [
        Gpu(f"GPU-{UUID_A}", "NVIDIA A100-SXM4-80GB", 80 * GiB, 10 * GiB,
            "00000000:17:00.0", {pid: 6 * GiB}),
        Gpu(f"GPU-{UUID_B}", "NVIDIA H100 80GB HBM3", 80 * GiB, 30 * GiB, "00000000:65:00.0",
            {pid: 20 * GiB, pid + 1: 5 * GiB}),
    ]


def mig_gpu() -> Gpu:
    """An A100 80GB in MIG mode, with a 10 GiB slice (this process on it, its memory not
    given by NVML) and a 40 GiB one."""
    slices = [
        Gpu(f"MIG-{SLICE_1}", "NVIDIA A100-SXM4-80GB MIG 1g.10gb", 10 * GiB, 4 * GiB,
            processes={os.getpid(): None}, is_mig=True),
        Gpu(f"MIG-{SLICE_2}", "NVIDIA A100-SXM4-80GB MIG 3g.40gb", 40 * GiB, 21 * GiB,
            is_mig=True),
    ]
    return Gpu("GPU-dddddddd-0000-0000-0000-000000000000", "NVIDIA A100-SXM4-80GB", 80 * GiB,
               25 * GiB, "00000000:17:00.0", mig_mode=1, slices=slices)


# -- which GPU -------------------------------------------------------------------------------


def test_cuda_0_is_found_by_uuid_not_by_nvmls_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA_VISIBLE_DEVICES=1,0: cuda:0 is NVML's GPU 1. torch's properties carry no PCI
    fields here (the stub of _CudaDeviceProperties lists none), which sent the lookup to
    NVML's index 0: the other GPU's figures, reported as cuda:0's."""
    nvml = fake_pynvml(two_gpus())
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    install_devices(monkeypatch, [props(UUID_B), props(UUID_A)])
    first, second = query(0), query(1)
    assert (first.available, first.name, first.total, first.used, first.process_used) == (
        True, "NVIDIA H100 80GB HBM3", 80 * GiB, 30 * GiB, 20 * GiB)
    assert (second.name, second.used, second.process_used) == (
        "NVIDIA A100-SXM4-80GB", 10 * GiB, 6 * GiB)
    assert (first.uuid, first.mig, first.gpu_utilization) == (f"GPU-{UUID_B}", False, 40)
    assert nvml.by_index == []  # type: ignore[attr-defined]


def test_a_device_nvml_cannot_find_is_unavailable_with_the_reason(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither cuda:0's UUID nor its PCI bus id is known to NVML: no figures (NVML's GPU 0
    would be another board), and the reason names the device and what was tried."""
    nvml = fake_pynvml(two_gpus())
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    install_devices(monkeypatch, [props("eeeeeeee-0000-0000-0000-000000000000", bus=0xB3)])
    info = query(0)
    assert (info.available, info.used, info.total, info.name) == (False, None, None, None)
    reason = info.reason or ""
    assert "NVML finds no GPU that is surely cuda:0" in reason
    assert "no device with UUID GPU-eeeeeeee-0000-0000-0000-000000000000" in reason
    assert "no GPU at PCI bus id 00000000:b3:00.0" in reason
    assert "CUDA_VISIBLE_DEVICES" in reason
    assert nvml.by_index == []  # type: ignore[attr-defined]


def test_a_mig_slice_reports_the_slices_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuda:0 is the 10 GiB slice of an 80 GiB A100 (its PCI bus id is the parent's): NVML's
    figures are the slice's; what NVML cannot attribute to the slice (utilisation, this
    process's bytes it did not give) is unknown, not the parent's."""
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([mig_gpu()]))
    install_devices(monkeypatch, [props(SLICE_1, bus=0x17,
                                        name="NVIDIA A100-SXM4-80GB MIG 1g.10gb")])
    info = query(0)
    assert (info.available, info.name, info.used, info.total) == (
        True, "NVIDIA A100-SXM4-80GB MIG 1g.10gb", 4 * GiB, 10 * GiB)
    assert (info.mig, info.uuid) == (True, f"MIG-{SLICE_1}")
    assert (info.process_used, info.gpu_utilization, info.memory_utilization) == (
        None, None, None)
    report = ReportData(device="cuda:0", backend="cuda-caching-allocator", baseline=0,
                        nvml=asdict(info))
    assert "NVML: MIG slice used 4.0 GiB of 10 GiB, this process -" in render_header(report)


def test_a_bus_id_never_names_a_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a UUID, the PCI bus id leads to the parent of a GPU in MIG mode; which slice
    cuda:0 is cannot be told from it, so the parent's 80 GiB is not reported as cuda:0's."""
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([mig_gpu()]))
    install_devices(monkeypatch, [props(None, bus=0x17)])
    info = query(0)
    assert (info.available, info.total) == (False, None)
    assert "the GPU at PCI bus id 00000000:17:00.0 is in MIG mode" in (info.reason or "")


def test_nvml_is_not_asked_to_start_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """At the end of tracking, a process that never initialised CUDA is not made to: the
    device properties (which initialise it) are not read."""
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(two_gpus()))
    install_devices(monkeypatch, [props(UUID_B)], initialised=False)

    def refuse(index: int | None = None) -> None:
        raise AssertionError("get_device_properties initialises CUDA")

    monkeypatch.setattr(torch.cuda, "get_device_properties", refuse)
    info = query(0, initialise=False)
    assert info.available is False
    assert "CUDA was never initialised in this process" in (info.reason or "")


# -- per device ------------------------------------------------------------------------------


@pytest.fixture
def two_devices(monkeypatch: pytest.MonkeyPatch) -> list[FakeCachingAllocator]:
    """Two CUDA devices, each with its caching allocator; CUDA's order is NVML's reversed."""
    cuda = [FakeCachingAllocator(), FakeCachingAllocator()]
    install(monkeypatch, cuda[0])
    devices = [props(UUID_B, bus=0x65, name="NVIDIA H100 80GB HBM3"),
               props(UUID_A, bus=0x17, name="NVIDIA A100-SXM4-80GB")]
    for name, value in {
        "device_count": lambda: 2,
        "memory_stats": torch.cuda.memory.memory_stats,  # torch's own, on the bindings below
        "get_device_properties": lambda index=None: devices[index or 0],
    }.items():
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(torch.cuda.memory, "is_initialized", lambda: cuda[0].initialized)
    monkeypatch.setattr(torch._C, "_cuda_memoryStats",
                        lambda index: cuda[index].nested(index), raising=False)
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(two_gpus()))
    return cuda


def spread_run(cuda: list[FakeCachingAllocator]) -> memsentry.Report:
    """A model spread over cuda:0 and cuda:1: 3 MiB kept on cuda:0 and 5 MiB on cuda:1 each
    step; cuda:1 held a 24 MiB temporary before tracking began."""
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cuda[1].free(cuda[1].malloc(24 * MiB))  # before tracking: the all-time peak
    with memsentry.track(model, device="cuda", on_leak="ignore", holders=False) as t:
        for _ in range(4):
            model(torch.randn(8, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
            cuda[0].malloc(3 * MiB)
            cuda[1].malloc(5 * MiB)
    return t.report()


def test_a_model_spread_over_two_gpus_is_reported_per_device(
        two_devices: list[FakeCachingAllocator]) -> None:
    report = spread_run(two_devices)
    assert report.device == "cuda:0"
    first, second = report.devices
    assert (first.device, first.allocated, first.reserved, first.allocator_peak) == (
        "cuda:0", 12 * MiB, 20 * MiB, 12 * MiB)
    assert (second.device, second.allocated, second.reserved, second.allocator_peak) == (
        "cuda:1", 20 * MiB, 24 * MiB, 24 * MiB)
    # NVML's figures of each, found by UUID: cuda:0 is NVML's GPU 1 (the H100).
    assert (first.name, first.nvml_used, first.nvml_total, first.process_used) == (
        "NVIDIA H100 80GB HBM3", 30 * GiB, 80 * GiB, 20 * GiB)
    assert (second.name, second.nvml_used, second.process_used, second.mig) == (
        "NVIDIA A100-SXM4-80GB", 10 * GiB, 6 * GiB, False)
    assert report.nvml is not None and report.nvml["name"] == "NVIDIA H100 80GB HBM3"
    lines = str(report).splitlines()
    at = lines.index("memory on 2 CUDA devices:")
    assert lines[at + 1].startswith("  cuda:0 (NVIDIA H100 80GB HBM3): allocated 12 MiB, ")
    assert lines[at + 3].startswith("  cuda:1 (NVIDIA A100-SXM4-80GB): allocated 20 MiB, ")
    text = " ".join(" ".join(lines[at + 1:at + 5]).split())
    assert ("cuda:0 (NVIDIA H100 80GB HBM3): allocated 12 MiB, reserved 20 MiB, allocator's "
            "all-time peak 12 MiB; NVML: device used 30 GiB of 80 GiB, this process 20 GiB "
            "cuda:1 (NVIDIA A100-SXM4-80GB): allocated 20 MiB, reserved 24 MiB, allocator's "
            "all-time peak 24 MiB; NVML: device used 10 GiB of 80 GiB, this process 6.0 GiB"
            ) == text


def test_the_per_device_summary_survives_json(two_devices: list[FakeCachingAllocator]) -> None:
    report = spread_run(two_devices)
    back = ReportData.from_dict(json.loads(report.to_json()))
    assert back.devices == report.devices and len(back.devices) == 2
    older = report.to_dict()
    del older["devices"]  # a report written before the field existed
    assert ReportData.from_dict(older).devices == ()


def test_devices_are_read_without_reaching_the_loop_on_failure(
        two_devices: list[FakeCachingAllocator], monkeypatch: pytest.MonkeyPatch) -> None:
    """A device whose statistics cannot be read is left out; the run and its report go on."""
    def stats(index: int | None = None) -> dict[str, Any]:
        if index == 1:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return torch.cuda.memory.memory_stats(index)

    monkeypatch.setattr(torch.cuda, "memory_stats", stats)
    report = spread_run(two_devices)
    assert [device.device for device in report.devices] == ["cuda:0"]
    assert "memory on" not in str(report)  # the tracked device alone: its header says it

