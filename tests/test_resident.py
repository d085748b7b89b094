"""The process as the system sees it: its resident memory beside the allocator's count, and the
``memory-growth`` hint when resident memory climbs that no tensor explains."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch
from torch import nn

import memsentry
from memsentry.model import IterationStats, Measured, ReportData, SubjectKind
from memsentry.rules.growth import memory_growth

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc/self/statm")

MiB = 1024 * 1024


def _train(steps: int, after_step: object = None, *, exact: bool = True) -> memsentry.Report:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with memsentry.track(model, exact=exact, on_leak="ignore") as t:
        for step in range(steps):
            loss = model(torch.randn(8, 16)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if callable(after_step):
                after_step(step, loss)
    return t.report()


def _growth(report: memsentry.Report) -> list[memsentry.Finding]:
    return [f for f in report.findings if f.rule == "memory-growth"]


@pytest.mark.parametrize("exact", [True, False], ids=["tensors", "heap"])
def test_python_values_kept_every_step_are_named_as_the_source(exact: bool) -> None:
    """A log that keeps 100,000 floats a step: no tensor grows, the process does."""
    history: list[list[float]] = []

    def log(step: int, loss: torch.Tensor) -> None:
        history.append([loss.item() + i for i in range(100_000)])

    report = _train(24, log, exact=exact)
    (finding,) = _growth(report)
    assert finding.severity is memsentry.Severity.HINT
    assert "Python's small objects grew by 100," in finding.message
    assert "Python values pile up" in finding.message
    assert "never cleared" in finding.fix
    if exact:  # the allocator counts tensors only: the resident climb is what shows
        assert finding.subject is not None and finding.subject.kind is SubjectKind.PROCESS
        assert "the process's resident memory grows by" in finding.message
        assert "no tensor explains it" in finding.message
        assert finding.rate is not None and finding.rate > 2 * MiB


def test_memory_mapped_outside_python_and_malloc_is_told_apart() -> None:
    """4 MiB mapped and written each step (as a library's own pool would): neither Python's
    objects nor the C heap hold it."""
    maps: list[mmap.mmap] = []

    def grow(step: int, loss: torch.Tensor) -> None:
        region = mmap.mmap(-1, 4 * MiB)
        region.write(b"x" * (4 * MiB))
        maps.append(region)

    report = _train(24, grow, exact=False)
    (finding,) = _growth(report)
    assert finding.subject is not None and finding.subject.kind is SubjectKind.PROCESS
    assert "not in Python's small objects nor in the C heap (malloc)" in finding.message
    assert "MALLOC_ARENA_MAX" in finding.fix
    for region in maps:
        region.close()


def test_a_steady_loop_gets_no_growth_finding_and_shows_its_resident_memory() -> None:
    report = _train(30)
    assert not _growth(report)
    assert all(it.resident for it in report.iterations)
    header = next(line for line in str(report).splitlines()
                  if line.startswith("process resident at start "))
    assert "highest ever" in header
    assert report.resident_peak is not None and report.resident_peak >= report.process[-1].rss


def _report(residents: list[int], blocks: list[int] | None = None) -> ReportData:
    its = tuple(IterationStats(index=i, allocated=100 * MiB, reserved=None, peak=100 * MiB,
                               seconds=0.01, resident=rss,
                               python_blocks=None if blocks is None else blocks[i])
                for i, rss in enumerate(residents))
    return ReportData(device="cpu", backend="cpu-storage", baseline=100 * MiB, iterations=its,
                      measured=Measured.TENSORS)


def test_resident_memory_that_levels_off_or_falls_back_is_not_judged() -> None:
    warm = [300 * MiB, 320 * MiB]
    filled = warm + [330 * MiB + i * 8 * MiB for i in range(6)] + [378 * MiB] * 6
    sawtooth = warm + [330 * MiB + (i % 4) * 10 * MiB for i in range(12)]
    small = warm + [330 * MiB + i * 512 * 1024 for i in range(12)]  # 6 MiB in all
    for residents in (filled, sawtooth, small):
        assert memory_growth(_report(residents)) == []
    climbing = warm + [330 * MiB + i * 8 * MiB for i in range(12)]
    (finding,) = memory_growth(_report(climbing))
    assert "grows by 8.0 MiB/iter: +88 MiB from iteration 2 to 13" in finding.message
    assert "not in Python's small objects" in finding.message  # no block counts: not named


def test_the_censuses_own_objects_are_not_the_programs_python_blocks() -> None:
    """A loop that makes no lasting Python object, tracked with every census taken
    (overhead=None): Python's block count per iteration stays the program's, not the
    censuses' records (they added about 190 blocks an iteration here, and 1,162 in a loop
    whose C buffer grew: there the report said "Python values pile up" with overhead=None
    and not with the default)."""
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with memsentry.track(model, on_leak="ignore", overhead=None) as t:
        for _ in range(60):
            model(torch.randn(8, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
    report = t.report()
    assert len(report.censuses) >= 5
    read = [(it.index, it.python_blocks) for it in report.iterations[2:]
            if it.python_blocks is not None]
    (first, low), (last, high) = read[0], read[-1]
    assert (high - low) / (last - first) < 64
