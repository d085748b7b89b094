"""The CUDA rules (memory-headroom, allocator-fragmentation, non-pytorch-memory) as pure
functions: fed a report recorded on CPU and given CUDA figures, the way a GPU run records
them. The same rules run for real in the CUDA-marked tests."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import make_mlp

import memsentry
from memsentry.model import Breakdown, PeakMode
from memsentry.rules import analyse

GiB, MiB = 1 << 30, 1 << 20


@pytest.fixture(scope="module")
def recorded() -> memsentry.Report:
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # Every iteration recorded: the reserved figures below are set per iteration.
    with memsentry.track(model, on_leak="ignore", overhead=None) as t:
        for _ in range(8):
            model(torch.randn(64, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
    return t.report()


def _as_cuda(report: memsentry.Report, *, total: int, resident: int, peak: int,
             reserved: list[int] | None = None, **fields) -> memsentry.Report:
    """The report's iterations rescaled to a CUDA run: ``resident`` at each boundary, ``peak``
    inside, ``reserved`` per iteration; each peak exact, as the allocator's counter reset
    where each iteration begins gives it."""
    # At the peak, what is not resident is activations (the breakdown a GPU run records).
    parts = Breakdown.of(peak, parameters=resident // 2, gradients=0, optimizer_state=0,
                         activations=peak - resident)
    its = tuple(
        replace(it, allocated=resident, peak=peak,
                reserved=reserved[i] if reserved else peak + 64 * MiB, batch=64, parts=parts,
                peak_exact=True)
        for i, it in enumerate(report.iterations)
    )
    return replace(report, device="cuda:0", backend="cuda", total_memory=total,
                   peak_mode=PeakMode.ITERATIONS,
                   iterations=its, censuses=(), unused_graphs=(), **fields)


def _rules(report: memsentry.Report) -> dict[str, memsentry.Finding]:
    return {f.rule: f for f in analyse(report)}


def test_headroom_estimates_the_batch_that_fits(recorded: memsentry.Report) -> None:
    report = _as_cuda(recorded, total=80 * GiB, resident=2 * GiB, peak=6 * GiB)
    finding = _rules(report)["memory-headroom"]
    assert finding.severity is memsentry.Severity.HINT
    # 4 GiB of activations for 64 samples: 64 MiB each; 85% of 80 GiB minus 2 GiB resident.
    expected = int((0.85 * 80 * GiB - 2 * GiB) / (4 * GiB / 64))
    assert f"batch of about {expected:,}" in finding.message
    assert "8% of cuda:0's 80 GiB" in finding.message


def test_no_headroom_hint_when_the_device_is_well_used(recorded: memsentry.Report) -> None:
    report = _as_cuda(recorded, total=80 * GiB, resident=20 * GiB, peak=60 * GiB)
    assert "memory-headroom" not in _rules(report)
    assert "memory-headroom" not in _rules(recorded)  # never on CPU


def test_fragmentation_when_reserved_climbs_while_the_peak_is_flat(
    recorded: memsentry.Report,
) -> None:
    reserved = [8 * GiB + i * 256 * MiB for i in range(len(recorded.iterations))]
    report = _as_cuda(recorded, total=80 * GiB, resident=2 * GiB, peak=6 * GiB,
                      reserved=reserved,
                      allocator_stats={"inactive_split_bytes.all.current": 900 * MiB})
    finding = _rules(report)["allocator-fragmentation"]
    assert finding.severity is memsentry.Severity.WASTE
    assert "grows 256 MiB/iter while the peak stays flat" in finding.message
    assert "900 MiB sit in inactive split blocks" in finding.message
    assert "expandable_segments:True" in finding.fix


def test_the_cache_keeping_freed_blocks_is_not_fragmentation(
    recorded: memsentry.Report,
) -> None:
    # Field guide #24: reserved a little above the peak, flat: the allocator doing its job.
    report = _as_cuda(recorded, total=80 * GiB, resident=2 * GiB, peak=6 * GiB)
    assert "allocator-fragmentation" not in _rules(report)


def test_memory_outside_pytorch_is_a_hint_and_the_context_alone_is_not(
    recorded: memsentry.Report,
) -> None:
    base = _as_cuda(recorded, total=80 * GiB, resident=2 * GiB, peak=30 * GiB)
    lots = replace(base, reserved=30 * GiB, nvml={"available": True, "process_used": 34 * GiB})
    finding = _rules(lots)["non-pytorch-memory"]
    assert finding.severity is memsentry.Severity.HINT
    assert finding.bytes == 4 * GiB and "NCCL" in finding.message
    context = replace(lots, nvml={"available": True, "process_used": 30 * GiB + 600 * MiB})
    assert "non-pytorch-memory" not in _rules(context)
    unknown = replace(lots, nvml={"available": False, "reason": "no driver"})
    assert "non-pytorch-memory" not in _rules(unknown)
