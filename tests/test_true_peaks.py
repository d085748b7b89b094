"""Issue 39, items 1 and 6: on CUDA every iteration's peak is the allocator's true peak, while
every peak the program reads stays as it would be without memsentry; no verdict rests on a
peak that may be a lower bound; and memsentry touches CUDA only once the program has.

The loops run on the CPU against the fake of CUDA's caching allocator in
tests/fake_cuda.py, which follows torch's peak semantics: one all-time high per
statistic, and one reset that resets them all."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from fake_cuda import FakeCachingAllocator, GiB, MiB, install
from torch import nn

import memsentry
from memsentry.model import Boundary, Breakdown, IterationStats, PeakMode, ReportData
from memsentry.reporters.text import render_iterations
from memsentry.rules.device import allocator_fragmentation
from memsentry.rules.forecast import forecast
from memsentry.rules.headroom import memory_headroom


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCachingAllocator:
    return install(monkeypatch, FakeCachingAllocator())


class Transient(nn.Module):
    """Two layers with a 1 GiB temporary made and freed between them, inside the forward (as
    gpu_audit.py's transient loop does on a real GPU), and 16 MiB of activations kept on the
    device until the backward. ``inside`` runs right after the temporary is freed."""

    def __init__(self, fake: FakeCachingAllocator,
                 inside: Callable[[], None] = lambda: None) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 1)
        self.fake, self.inside = fake, inside

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        self.fake.free(self.fake.malloc(GiB))
        self.inside()
        block = self.fake.malloc(16 * MiB)
        h = h * 1.0
        h.register_hook(lambda grad: self.fake.free(block))
        return self.b(h)


def run(model: nn.Module, steps: int, *, read: Callable[[], None] = lambda: None,
        **options: object) -> ReportData | None:
    """``steps`` training steps, tracked when ``options`` are given (else untracked);
    ``read`` runs at the end of each step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def loop() -> None:
        for _ in range(steps):
            model(torch.randn(8, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
            read()

    if not options:
        loop()
        return None
    with memsentry.track(model, device="cuda", on_leak="ignore", holders=False,
                         **options) as t:  # type: ignore[arg-type]
        loop()
    return t.report()


def test_a_temporary_inside_a_forward_is_in_every_iteration_peak(
        cuda: FakeCachingAllocator) -> None:
    """Seen against torch's semantics: from the second iteration on, the peaks were the
    samples at hooks (16 MiB), blind to the 1 GiB temporary, and the rules called the 1 GiB
    the temporary reserved fragmentation and offered a batch hundreds of times larger.
    Whoever followed that advice ran out of memory."""
    report = run(Transient(cuda), 12, overhead=None)
    assert report is not None and report.peak_mode == PeakMode.ITERATIONS
    closed = [it for it in report.iterations if it.boundary != Boundary.EXIT]
    assert len(closed) == 12
    assert all(it.peak_exact and it.peak >= GiB for it in closed)
    assert report.reserved is not None
    assert report.reserved - max(it.peak for it in closed) < 64 * MiB
    rules = {finding.rule for finding in report.findings}
    assert "allocator-fragmentation" not in rules and "memory-headroom" not in rules


def test_exact_mode_counts_the_temporary_in_its_layer(cuda: FakeCachingAllocator) -> None:
    """With exact=True the counter is reset at every hook: the temporary, made in the
    model's own forward, is in the model's forward peak."""
    report = run(Transient(cuda), 4, exact=True)
    assert report is not None and report.peak_mode == PeakMode.EXACT
    (top,) = [layer for layer in report.layers if layer.depth == 0]
    assert top.forward_peak is not None and top.forward_peak >= GiB


def test_the_program_reads_its_own_peaks_as_without_memsentry(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A program that resets the peak at each step and reads it at the end (as torch's docs
    suggest for a per-iteration peak), then reads every peak statistic after the run: each
    figure is the same tracked as untracked, though memsentry reset the counters at each
    iteration too."""
    def program(track: bool) -> tuple[list[int], dict[str, int], int]:
        fake = FakeCachingAllocator()
        with monkeypatch.context() as patch:
            install(patch, fake)
            for block in [fake.malloc(3 * GiB) for _ in range(2)]:  # warm-up: a high
                fake.free(block)
            steps: list[int] = []

            def read() -> None:
                steps.append(torch.cuda.max_memory_allocated())
                torch.cuda.reset_peak_memory_stats()

            torch.manual_seed(0)
            run(Transient(fake), 6, read=read, **({"overhead": None} if track else {}))
            stats = {key: value for key, value in torch.cuda.memory_stats().items()
                     if key.endswith(".peak")}
            return steps, stats, fake.resets

    untracked, tracked = program(False), program(True)
    assert tracked[0] == untracked[0]
    assert tracked[0][0] == 6 * GiB  # the first read carries the warm-up's high
    assert tracked[1] == untracked[1]
    assert tracked[2] > untracked[2]  # memsentry's own resets happened, out of sight


def test_after_tracking_the_program_still_reads_the_high_of_its_whole_run(
        cuda: FakeCachingAllocator) -> None:
    for block in [cuda.malloc(3 * GiB) for _ in range(2)]:
        cuda.free(block)
    run(Transient(cuda), 4, overhead=None)
    assert cuda.peak < 2 * GiB  # the counter itself was reset by memsentry
    assert torch.cuda.max_memory_allocated() == 6 * GiB
    assert torch.cuda.memory_stats()["allocation.all.peak"] == 2
    torch.cuda.reset_peak_memory_stats()  # the program's reset is a reset again
    assert torch.cuda.max_memory_allocated() == cuda.allocated


def test_a_reset_by_the_program_inside_an_iteration_does_not_hide_its_peak(
        cuda: FakeCachingAllocator) -> None:
    """The program resets the peaks in the middle of a forward, after the temporary: the
    iteration's peak memsentry reports still holds the temporary."""
    report = run(Transient(cuda, inside=torch.cuda.reset_peak_memory_stats), 6, overhead=None)
    assert report is not None
    closed = [it for it in report.iterations if it.boundary != Boundary.EXIT]
    assert all(it.peak >= GiB for it in closed)


def test_two_trackers_on_one_device_each_see_the_true_peak(cuda: FakeCachingAllocator) -> None:
    """An outer tracker around the whole run and an inner one around each epoch: each one's
    resets would rob the other, and neither loses the temporary."""
    model = Transient(cuda)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with memsentry.track(model, device="cuda", on_leak="ignore", holders=False,
                         overhead=None) as outer:
        for _ in range(2):
            with memsentry.track(device="cuda", on_leak="ignore", holders=False,
                                 overhead=None) as inner:
                for _ in range(3):
                    model(torch.randn(8, 16)).sum().backward()
                    opt.step()
                    opt.zero_grad()
                    inner.step()
            closed = [it for it in inner.report().iterations if it.boundary != Boundary.EXIT]
            assert closed and all(it.peak >= GiB for it in closed)
    closed = [it for it in outer.report().iterations if it.boundary != Boundary.EXIT]
    assert len(closed) == 6 and all(it.peak >= GiB for it in closed)


# -- no verdict on a lower bound: rules and the text on reports built by hand -----------------
def _iterations(peak: int, *, exact: bool, reserved: int, other: int = 0) -> list[IterationStats]:
    parts = Breakdown.of(peak, parameters=peak - other, gradients=0, optimizer_state=0,
                         activations=0)
    return [IterationStats(index=i, allocated=peak // 2, reserved=reserved, peak=peak,
                           seconds=0.01, boundary=Boundary.OPTIMIZER, batch=32, parts=parts,
                           peak_exact=exact) for i in range(8)]


def _report(its: list[IterationStats], mode: PeakMode) -> ReportData:
    return ReportData(device="cuda:0", backend="cuda-caching-allocator", baseline=0,
                      iterations=its, peak_mode=mode, total_memory=80 * GiB)


@pytest.mark.parametrize("exact", [False, True])
def test_fragmentation_is_judged_on_exact_peaks_only(exact: bool) -> None:
    report = _report(_iterations(100 * MiB, exact=exact, reserved=1200 * MiB),
                     PeakMode.ITERATIONS)
    found = allocator_fragmentation(report)
    assert [f.rule for f in found] == (["allocator-fragmentation"] if exact else [])


def test_headroom_is_judged_on_exact_peaks_that_the_parts_explain() -> None:
    explained = _report(_iterations(GiB, exact=True, reserved=GiB), PeakMode.ITERATIONS)
    assert [f.rule for f in memory_headroom(explained)] == ["memory-headroom"]
    sampled = _report(_iterations(GiB, exact=False, reserved=GiB), PeakMode.SAMPLED)
    assert memory_headroom(sampled) == []
    temporaries = _report(_iterations(GiB, exact=True, reserved=GiB, other=GiB // 2),
                          PeakMode.ITERATIONS)
    assert memory_headroom(temporaries) == []


@pytest.mark.parametrize("exact", [False, True])
def test_a_forecast_from_sampled_peaks_says_it_may_be_low(exact: bool) -> None:
    its = [replace(it, parts=Breakdown.of(GiB, parameters=GiB // 2, gradients=0,
                                          optimizer_state=0, activations=GiB // 2))
           for it in _iterations(GiB, exact=exact, reserved=GiB)]
    caveat = forecast(_report(its, PeakMode.ITERATIONS), 64).caveat
    assert ("The measured peaks are lower bounds" in caveat) is not exact


def test_a_peak_the_counter_could_not_count_is_marked_as_a_lower_bound() -> None:
    its = _iterations(GiB, exact=True, reserved=GiB)
    its[3] = IterationStats(index=3, allocated=GiB // 2, reserved=None, peak=GiB // 2,
                            seconds=0.01, boundary=Boundary.OPTIMIZER, sampled=False)
    text = render_iterations(_report(its, PeakMode.ITERATIONS), width=100)
    rows = {line.split()[0]: line for line in text.splitlines() if line.strip()[:1].isdigit()}
    assert ">= 512 MiB" in rows["3"] and ">=" not in rows["2"]
    plain = render_iterations(_report(its, PeakMode.SAMPLED), width=100)
    assert ">=" not in plain  # the header says every peak is sampled


# -- CUDA untouched until the program uses it (item 6) --------------------------------------
def test_the_out_of_memory_observer_waits_for_the_program_to_start_cuda(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's native allocator hands an observer to the device allocators that exist, and
    none exists before CUDA starts: attached then, it would be attached to nothing (and be
    a CUDA call in a process that made none). memsentry attaches it at its first reading
    after the program started CUDA, so an out-of-memory error later has the observer's
    figures."""
    fake = FakeCachingAllocator(initialized=False)
    install(monkeypatch, fake)
    model = nn.Linear(16, 16)
    with pytest.raises(torch.OutOfMemoryError):
        with memsentry.track(model, device="cuda", on_leak="ignore", holders=False) as t:
            assert fake.observers == []
            for step in range(4):
                model(torch.randn(8, 16)).sum().backward()
                fake.malloc(MiB if step < 3 else 2 * fake.total)  # the first starts CUDA
                t.step()
    oom = t.report().oom
    assert len(fake.observers) == 1
    assert oom is not None and oom.requested_bytes == 2 * fake.total


def test_a_cpu_run_never_asks_the_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.cuda.is_available() registers torch's fork handler and torch.accelerator asks
    the driver for a device count: a CPU program that forks CUDA children later must not
    have had either done for it."""
    asked: list[str] = []

    def refuse(name: str) -> Callable[..., object]:
        def call(*args: object, **kwargs: object) -> object:
            asked.append(name)
            raise AssertionError(f"memsentry called {name}")
        return call

    monkeypatch.setattr(torch.cuda, "is_available", refuse("torch.cuda.is_available"))
    monkeypatch.setattr(torch.accelerator, "current_accelerator",
                        refuse("torch.accelerator.current_accelerator"))
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with memsentry.track(model, on_leak="ignore") as t, memsentry.track(
            on_leak="ignore", holders=False) as bare:
        for _ in range(4):
            model(torch.randn(8, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
    assert asked == []
    assert t.report().device == "cpu" and bare.report().device == "cpu"


def test_the_pytest_plugin_leaves_the_tests_own_peaks_alone(
        cuda: FakeCachingAllocator) -> None:
    """The plugin resets the peak before each test to measure the test's; a test suite that
    reads torch.cuda.max_memory_allocated() across tests (a session-wide budget) reads its
    own figure, and a test that resets the peak itself does not hide its peak from the
    plugin."""
    from pytest_memsentry.measure import TorchCuda

    plugin = TorchCuda()
    cuda.free(cuda.malloc(3 * GiB))  # an earlier test's high
    plugin.reset_peak(0)
    cuda.free(cuda.malloc(GiB))  # this test's temporary
    assert torch.cuda.max_memory_allocated() == 3 * GiB  # the session's high, as without
    torch.cuda.reset_peak_memory_stats()  # the test's own reset, for its own reading
    cuda.free(cuda.malloc(MiB))
    assert torch.cuda.max_memory_allocated() == MiB  # the test reads what it would alone
    assert plugin.peak(0) == GiB  # the plugin still sees this test's temporary
    plugin.reset_peak(0)
    assert plugin.peak(0) == cuda.allocated
    cuda.free(cuda.malloc(2 * MiB))
    assert torch.cuda.max_memory_allocated() == 2 * MiB
