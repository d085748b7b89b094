"""CUDA's allocator backends without a GPU: the out-of-memory post-mortem's ceiling (a memory
fraction, a device shared with other processes) and the segment the caching allocator asks
the driver for; the cudaMallocAsync and pluggable allocators, played by fakes that refuse
what torch's source says they refuse (tests/fake_cuda.py)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from fake_cuda import (
    FakeAsyncAllocator,
    FakeCachingAllocator,
    FakePluggableAllocator,
    GiB,
    MiB,
    install,
    install_history,
)
from torch import nn

import memsentry
from memsentry.model import FixKind


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCachingAllocator:
    return install(monkeypatch, FakeCachingAllocator())


@pytest.fixture
def cuda_async(monkeypatch: pytest.MonkeyPatch) -> FakeAsyncAllocator:
    fake = install(monkeypatch, FakeAsyncAllocator())
    install_history(monkeypatch, fake)
    return fake


def _pluggable(monkeypatch: pytest.MonkeyPatch, *, plugged: bool) -> FakePluggableAllocator:
    fake = install(monkeypatch, FakePluggableAllocator(plugged=plugged))
    install_history(monkeypatch, fake)
    return fake


class Takes(nn.Module):
    """A layer whose forward takes ``sizes(call)`` from the fake allocator (activations kept
    for the backward, which gives them back)."""

    def __init__(self, fake: FakeCachingAllocator,
                 sizes: Callable[[int], Sequence[int]]) -> None:
        super().__init__()
        self.fake, self.sizes, self.calls = fake, sizes, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        blocks = [self.fake.malloc(size) for size in self.sizes(self.calls)]
        x = x * 1.0
        x.register_hook(lambda grad: [self.fake.free(block) for block in blocks] and None)
        return x


def train(fake: FakeCachingAllocator, sizes: Callable[[int], Sequence[int]], *,
          steps: int = 6, before: Callable[[], None] | None = None, **options: Any
          ) -> tuple[BaseException | None, memsentry.Report]:
    """Train a three-layer model whose middle layer takes ``sizes`` at each call, batch 8,
    tracked on the fake's cuda:0; the error that ended it (``None`` without one)."""
    model = nn.Sequential(nn.Linear(16, 16), Takes(fake, sizes), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tracker = memsentry.track(model, device="cuda", on_leak="ignore", holders=False, **options)
    error = None
    try:
        with tracker:
            if before is not None:
                before()
            for _ in range(steps):
                model(torch.randn(8, 16)).sum().backward()
                opt.step()
                opt.zero_grad()
    except Exception as caught:  # the test looks at it
        error = caught
    return error, tracker.report()


def fails_at_four(then: Sequence[int]) -> Callable[[int], Sequence[int]]:
    """16 MiB of activations a call (2 MiB a sample at batch 8); ``then`` at the fourth."""
    return lambda call: [16 * MiB] if call < 4 else then


def text(report: memsentry.Report) -> str:
    return " ".join(str(report).split())


def notes(error: BaseException | None) -> str:
    return " ".join(" ".join(getattr(error, "__notes__", [])).split())


# -- the post-mortem's ceiling ---------------------------------------------------------------


def test_a_memory_fraction_is_the_ceiling_of_the_post_mortem(
        cuda: FakeCachingAllocator) -> None:
    """set_per_process_memory_fraction(0.5) on an 80 GiB card: the allocator may hold
    40 GiB, and a batch asking 72 GiB fails there; the post-mortem says 'of 40 GiB' and the
    batch that fits is worked out in 40 GiB (in 80 GiB the batch of 8 would have fit)."""
    cuda.set_fraction(0.5)
    error, report = train(cuda, fails_at_four([8 * 9 * GiB]))
    assert isinstance(error, torch.OutOfMemoryError)
    oom = report.oom
    assert oom is not None and oom.capacity == 40 * GiB
    assert (oom.limit, oom.device_total) == (40 * GiB, 80 * GiB)
    (fix,) = [f for f in oom.fixes if f.kind is FixKind.BATCH]
    held = oom.breakdown
    per_sample = held.activations / 8 + 9 * GiB
    assert fix.batch == int((40 * GiB - (held.total - held.activations)) // per_sample) == 4
    assert "in the 40 GiB the allocator could have" in fix.text
    shown = text(report)
    assert "in use of 40 GiB" in shown and "of 80 GiB" not in shown.split("ceiling")[0]
    assert ("ceiling: 40 GiB, the 40 GiB torch.cuda.set_per_process_memory_fraction allows "
            "of the device's 80 GiB") in shown


def test_on_a_shared_device_the_ceiling_is_what_the_allocator_could_still_get(
        cuda: FakeCachingAllocator) -> None:
    """Other processes hold 50 GiB of the 80 GiB card: the allocator could get its reserved
    16 MiB plus what was free, 30 GiB in all, and the batch that fits is worked out there."""
    cuda.others = 50 * GiB
    error, report = train(cuda, fails_at_four([8 * 4 * GiB]))
    assert isinstance(error, torch.OutOfMemoryError)
    oom = report.oom
    assert oom is not None and oom.capacity == 30 * GiB
    assert (oom.reserved, oom.device_free, oom.limit) == (16 * MiB, 30 * GiB - 16 * MiB, 80 * GiB)
    (fix,) = [f for f in oom.fixes if f.kind is FixKind.BATCH]
    held = oom.breakdown
    per_sample = held.activations / 8 + 4 * GiB
    assert fix.batch == int((30 * GiB - (held.total - held.activations)) // per_sample) == 7
    assert ("ceiling: 30 GiB, what the allocator could still get: the 16 MiB it reserved plus "
            "30 GiB free on the device, below the device's 80 GiB") in text(report)


def test_the_observers_size_is_named_as_the_segment_asked_of_the_driver(
        cuda: FakeCachingAllocator) -> None:
    """A 3 MiB request on a full device: the caching allocator asks the driver for a 20 MiB
    segment, and that is the size its observer and its message give; the post-mortem says
    so rather than that the layer asked for 20 MiB."""
    cuda.others = cuda.total - 26 * MiB  # room for the 16 MiB segment and 10 MiB more
    error, report = train(cuda, fails_at_four([16 * MiB, 3 * MiB]))
    assert isinstance(error, torch.OutOfMemoryError)
    assert str(error).startswith("CUDA out of memory. Tried to allocate 20.00 MiB")
    shown = text(report)
    assert "asking the driver for a 20 MiB segment" in shown
    assert "the size is the segment the caching allocator asked the driver for" in shown
    oom = report.oom
    assert oom is not None and (oom.requested_bytes, oom.segment) == (20 * MiB, True)
    if sys.version_info >= (3, 11):
        assert "asking the driver for a 20 MiB segment" in notes(error)


def test_the_ceiling_survives_json_and_older_reports_still_read(
        cuda: FakeCachingAllocator, tmp_path: Path) -> None:
    cuda.set_fraction(0.5)
    _error, report = train(cuda, fails_at_four([8 * 9 * GiB]))
    path = tmp_path / "report.json"
    report.to_json(path)
    again = memsentry.Report.from_json(path)
    assert again.oom == report.oom and again.oom is not None
    assert (again.oom.limit, again.oom.segment) == (40 * GiB, True)
    data = json.loads(path.read_text())
    for key in ("segment", "limit", "reserved", "device_total"):  # as memsentry 0.2 wrote it
        del data["oom"][key]
    path.write_text(json.dumps(data))
    older = memsentry.Report.from_json(path).oom
    assert older is not None and older.capacity == 40 * GiB
    assert (older.limit, older.segment) == (None, False)


# -- cudaMallocAsync -------------------------------------------------------------------------


def test_a_cuda_malloc_async_error_gives_its_size_and_ceiling(
        cuda_async: FakeAsyncAllocator) -> None:
    """Under backend:cudaMallocAsync the message reads 'Requested : 2.00 GiB': the
    post-mortem has the size (the tensor's own, not a segment) and works its ceiling out of
    the message's free memory and the pool's reservation."""
    cuda_async.others = cuda_async.total - 16 * MiB - GiB
    error, report = train(cuda_async, fails_at_four([2 * GiB]))
    assert isinstance(error, torch.OutOfMemoryError)
    assert "Requested               : 2.00 GiB" in str(error)
    oom = report.oom
    assert oom is not None and oom.requested_bytes == 2 * GiB
    assert "asking for 2.0 GiB" in text(report)
    assert oom.capacity == GiB + 16 * MiB
    assert (oom.device_free, oom.reserved, oom.limit) == (GiB, 16 * MiB, 80 * GiB)
    assert not oom.segment
    assert [f.kind for f in oom.fixes][:1] == [FixKind.BATCH]


def test_cuda_malloc_async_is_measured_without_what_it_refuses(
        cuda_async: FakeAsyncAllocator) -> None:
    """No observer attached and no history recorded (both refused): the report says so,
    with what to change for a memory_viz snapshot."""
    # the peak of every iteration: no budget
    error, report = train(cuda_async, lambda call: [16 * MiB], snapshot=True, overhead=None)
    assert error is None
    assert (cuda_async.attach_calls, cuda_async.history_calls) == (0, 0)
    assert report.backend == "cuda-malloc-async"
    assert [it.peak for it in report.iterations][1:] == [16 * MiB] * 5
    shown = " ".join(report.notes)
    assert "runs CUDA's cudaMallocAsync allocator" in shown
    assert "attaches no out-of-memory observer" in shown
    assert ("No memory_viz snapshot: CUDA memory comes from the cudaMallocAsync allocator "
            "here, which records no allocation history (torch: 'cudaMallocAsync does not yet "
            "support recordHistory'); unset backend:cudaMallocAsync in PYTORCH_CUDA_ALLOC_CONF"
            ) in shown


def test_no_expandable_segments_advice_under_cuda_malloc_async(
        cuda_async: FakeAsyncAllocator) -> None:
    """The pool kept 1 GiB from before the loop, whose peak is 16 MiB: reserved far above
    the peak. expandable_segments is a setting of torch's native allocator: not advised."""

    def warm_up() -> None:
        cuda_async.free(cuda_async.malloc(GiB))

    # the rule reads reserved memory at several iterations, which light ones do not read:
    # every iteration measured, no budget
    error, report = train(cuda_async, lambda call: [16 * MiB], steps=8, before=warm_up,
                          overhead=None)
    assert error is None
    (finding,) = [f for f in report.findings if f.rule == "allocator-fragmentation"]
    assert "expandable_segments" in finding.fix and "does nothing under this one" in finding.fix
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" not in finding.fix


# -- a pluggable allocator -------------------------------------------------------------------


def test_under_a_pluggable_allocator_nothing_is_measured_and_nothing_raises(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torch refuses every statistic of a pluggable allocator: tracking starts, runs and
    reports without one reaching the loop, and says that nothing was measured on the
    device; no verdict rests on the zeros."""
    fake = _pluggable(monkeypatch, plugged=True)
    fake.initialized = True  # the model was moved to the GPU before tracking
    kept: list[int] = []

    def leaking(call: int) -> list[int]:
        kept.append(fake.malloc(3 * MiB))  # 3 MiB a call, never given back
        return [MiB]

    error, report = train(fake, leaking, steps=8, snapshot=True, exact=True)
    assert error is None
    assert fake.refused == []  # memsentry asked for nothing torch refuses
    assert report.backend == "cuda-pluggable-allocator"
    assert report.total_memory is None and report.reserved is None
    assert {it.allocated for it in report.iterations} == {0}
    assert not [f for f in report.findings if f.rule in ("memory-growth", "memory-headroom")]
    shown = " ".join(report.notes)
    assert "Nothing was measured on cuda:0: its memory comes from a pluggable allocator" \
        in shown
    assert "CUDAPluggableAllocator does not yet support getDeviceStats" in shown
    assert "CUDAPluggableAllocator does not yet support recordHistory" in shown


@pytest.mark.parametrize("exact", [False, True])
def test_an_allocator_swapped_in_after_tracking_began_is_stepped_around_in_the_hooks(
        monkeypatch: pytest.MonkeyPatch, exact: bool) -> None:
    """torch named the native allocator when tracking began; the loop then swapped in a
    pluggable one before CUDA's first allocation (change_current_allocator allows no later
    swap). A forward hook meets torch's refusal of the statistics once CUDA has started (in
    exact mode too: memsentry reads the counters before each reset, to keep the program's
    peaks): memsentry steps aside with a note quoting it, and the loop runs to its end."""
    refused = "getDeviceStats"
    fake = _pluggable(monkeypatch, plugged=False)
    error, report = train(fake, lambda call: [16 * MiB], steps=4, before=fake.plug,
                          exact=exact)
    assert error is None
    assert fake.refused == [refused]  # once: then memsentry asks no more
    shown = " ".join(report.notes)
    assert "Nothing was measured on cuda:0" in shown
    assert f"(CUDAPluggableAllocator does not yet support {refused})" in shown
    assert report.reserved is None and report.total_memory is None
