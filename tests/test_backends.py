"""Backends: glibc counters, exact storage counting, NVML, the machine survey, and CUDA."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import MiB, make_mlp, train
from torch import nn

import memsentry
from memsentry.measure import make_backend, parse_device
from memsentry.measure.cpu import MALLINFO2_UNAVAILABLE, MallinfoBackend
from memsentry.measure.machine import collect
from memsentry.measure.nvml import NvmlInfo, query
from memsentry.measure.storage import StorageBackend

FOUR_MIB = 4 * MiB

needs_glibc = pytest.mark.skipif(MALLINFO2_UNAVAILABLE is not None,
                                 reason=str(MALLINFO2_UNAVAILABLE))


# -- glibc mallinfo2 ---------------------------------------------------------------------------


@needs_glibc
def test_mallinfo_backend_sees_a_tensor_come_and_go() -> None:
    backend = MallinfoBackend()
    assert backend.peak_mode == "sampled" and backend.device == torch.device("cpu")
    before = backend.allocated()
    tensor = torch.ones(1 << 20)  # 4 MiB
    alive, peak = backend.sample()
    assert peak is None  # sampled backend: the tracker's samples are the peak
    assert alive == backend.allocated()
    assert alive - before >= FOUR_MIB
    reserved = backend.reserved()
    assert reserved is not None and reserved >= alive
    del tensor
    freed = backend.allocated()
    assert alive - freed >= FOUR_MIB
    assert backend.peak_since_last_read() is None
    total = backend.total_memory()
    assert total is not None and total > FOUR_MIB
    assert {"uordblks", "hblkhd", "arena"} <= backend.stats().keys()


@needs_glibc
def test_default_cpu_backend_is_mallinfo() -> None:
    assert isinstance(make_backend(torch.device("cpu")), MallinfoBackend)
    assert isinstance(make_backend(torch.device("cpu"), exact=True), StorageBackend)


@needs_glibc
@pytest.mark.parametrize("slow", [False, True])
def test_reads_at_saved_tensor_packs_stop_when_the_heap_makes_them_slow(
        slow: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from memsentry.record import sampler

    packs = []
    real_sample = sampler.Sampler.sample_at_pack

    def counted(self: sampler.Sampler) -> None:
        packs.append(1)
        real_sample(self)

    monkeypatch.setattr(sampler.Sampler, "sample_at_pack", counted)
    if slow:  # what a heap fragmented by kept graphs does to mallinfo2()
        real = MallinfoBackend.sample

        def fragmented(self: MallinfoBackend) -> tuple[int, int | None]:
            time.sleep(0.0004)
            return real(self)

        monkeypatch.setattr(MallinfoBackend, "sample", fragmented)
    else:  # a fast heap, however loaded the machine running the test is
        monkeypatch.setattr(sampler, "SLOW_PACK_SAMPLE", 3600.0)
    model = make_mlp()
    # every forward's packs reach the sampler (light iterations hook no layer): no budget
    with memsentry.track(model, on_leak="ignore", overhead=None) as t:
        losses = train(model, 120)  # 2 packs a forward: 240 in all
    report = t.report()
    said = [n for n in report.notes if "saved-tensor packs" in n]
    if slow:
        assert len(packs) == sampler.PACK_SAMPLES_JUDGED  # no read at a pack after that
        assert len(said) == 1 and "track(exact=True)" in said[0]
    else:
        assert len(packs) >= 200 and said == []
    assert len(report.iterations) == 120 and len(losses) == 120


# -- exact storage counting --------------------------------------------------------------------


def test_storage_backend_counts_a_storage_once_and_drops_it_on_free() -> None:
    backend = StorageBackend()
    assert backend.peak_mode == "exact"
    backend.start()
    try:
        start = backend.allocated()
        tensor = torch.empty(1 << 20)  # 4 MiB
        assert backend.allocated() - start == FOUR_MIB
        views = [tensor.view(1024, 1024), tensor[::2], tensor.unsqueeze(0), tensor.add_(1)]
        assert backend.allocated() - start == FOUR_MIB  # views and in-place: same storage
        del tensor
        assert backend.allocated() - start == FOUR_MIB  # the views still hold it
        del views
        assert backend.allocated() == start
    finally:
        backend.stop()


def test_storage_backend_peak_sees_a_temporary() -> None:
    backend = StorageBackend()
    backend.start()
    try:
        backend.peak_since_last_read()  # start a fresh interval
        start = backend.allocated()
        total = torch.ones(1 << 20).sum()  # a 4 MiB temporary, freed at once
        assert backend.allocated() - start == total.untyped_storage().nbytes()
        peak = backend.peak_since_last_read()
        assert peak is not None and peak - start >= FOUR_MIB
        # Read again: the interval restarted, the temporary is not seen twice.
        again = backend.peak_since_last_read()
        assert again is not None and again - start < FOUR_MIB
        allocated, sampled_peak = backend.sample()
        assert allocated == backend.allocated()
        assert sampled_peak is not None and sampled_peak >= allocated
    finally:
        backend.stop()


def test_storage_backend_does_not_count_storages_that_predate_it() -> None:
    # Memory that existed before tracking is baseline: reading it through views or changing
    # it in place inside the tracked block must not count it as allocated.
    old = torch.zeros(1 << 20)  # 4 MiB, before start()
    backend = StorageBackend()
    backend.start()
    try:
        start = backend.allocated()
        batch = old[:1024]
        old.add_(1)
        assert backend.allocated() - start < FOUR_MIB
        del batch
    finally:
        backend.stop()


def test_storage_backend_stop_leaves_the_dispatch_mode() -> None:
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    backend = StorageBackend()
    backend.start()
    backend.start()  # idempotent
    assert _get_current_dispatch_mode() is not None
    backend.stop()
    backend.stop()
    assert _get_current_dispatch_mode() is None


# -- NVML and the machine survey ----------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer of a machine without GPU")
def test_nvml_query_without_a_gpu_says_why() -> None:
    info = query(0)
    assert isinstance(info, NvmlInfo)
    assert info.available is False
    assert info.reason  # non-empty
    assert info.total is None and info.used is None


def test_nvml_query_without_pynvml_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    info = query(0)
    assert info.available is False
    assert info.reason is not None and "nvidia-ml-py" in info.reason


def test_nvml_query_when_nvml_fails_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    class NVMLError(Exception):
        pass

    def failing_init() -> None:
        raise NVMLError("Driver Not Loaded")

    fake = types.ModuleType("pynvml")
    fake.nvmlInit = failing_init  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    info = query(0)
    assert info.available is False
    assert info.reason is not None and "Driver Not Loaded" in info.reason


def test_machine_survey_works_without_a_gpu() -> None:
    info = collect()
    assert info.torch_version == torch.__version__
    assert info.memsentry_version == memsentry.__version__
    assert info.ram_total is not None and info.ram_total > 0
    assert info.cuda_available == torch.cuda.is_available()
    data = info.to_dict()
    assert data["torch_version"] == torch.__version__
    if not info.cuda_available:
        assert info.cuda_devices == ()
        assert info.cuda_reason
        assert info.nvml is not None and info.nvml.available is False
    if MALLINFO2_UNAVAILABLE is None:
        assert info.cpu_backend == "cpu-mallinfo2"
        assert info.cpu_allocated is not None and info.cpu_allocated > 0


def test_parse_device_accepts_cpu_forms() -> None:
    assert parse_device("cpu") == torch.device("cpu")
    assert parse_device(torch.device("cpu")) == torch.device("cpu")


# -- CUDA (run on a GPU machine; skipped elsewhere) --------------------------------------------

CUDA = torch.device("cuda", 0)


@pytest.mark.cuda
def test_cuda_backend_matches_torch_allocator_stats() -> None:
    from memsentry.measure.cuda import CudaBackend

    backend = CudaBackend(CUDA)
    assert backend.device == CUDA and backend.peak_mode == "exact per iteration"
    torch.cuda.synchronize()
    before = backend.allocated()
    tensor = torch.empty(1 << 20, device=CUDA)  # 4 MiB
    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats(CUDA)
    allocated, _peak = backend.sample()
    assert allocated == stats["allocated_bytes.all.current"]
    assert backend.allocated() == stats["allocated_bytes.all.current"]
    assert backend.reserved() == stats["reserved_bytes.all.current"]
    assert allocated == torch.cuda.memory_allocated(CUDA)
    # The caching allocator may hand out a slightly larger cached block, never a smaller one.
    assert allocated - before >= FOUR_MIB
    del tensor
    assert backend.allocated() == torch.cuda.memory_stats(CUDA)["allocated_bytes.all.current"]
    assert backend.allocated() <= allocated - FOUR_MIB
    total = backend.total_memory()
    assert total == torch.cuda.get_device_properties(CUDA).total_memory


@pytest.mark.cuda
def test_default_cuda_tracking_leaves_max_memory_allocated_as_the_program_reads_it() -> None:
    big = torch.empty(256 * MiB, dtype=torch.uint8, device=CUDA)
    del big
    peak_before = torch.cuda.max_memory_allocated(CUDA)
    assert peak_before >= 256 * MiB
    model = make_mlp().to(CUDA)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with memsentry.track(model) as t:
        for _ in range(3):
            loss = model(torch.randn(8, 16, device=CUDA)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = t.report()
    assert report.device == "cuda:0"
    assert report.backend == "cuda-caching-allocator"
    assert report.peak_mode == "exact per iteration"
    assert report.nvml is not None and report.nvml["available"] is True
    assert report.allocator_stats is not None
    assert "allocated_bytes.all.current" in report.allocator_stats
    assert len(report.iterations) == 3
    assert torch.cuda.max_memory_allocated(CUDA) == peak_before  # the MLP's steps are smaller


@pytest.mark.cuda
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_cuda_linear_forward_delta_is_exactly_its_output(grad: bool) -> None:
    # CUDA's caching allocator rounds small blocks to 512 bytes and splits cached segments
    # exactly, so a 128 KiB output is a 128 KiB delta (cuBLAS workspaces are created by the
    # first call, which is excluded once the layer ran twice).
    torch.manual_seed(0)
    lin = nn.Linear(256, 512).to(CUDA)
    x = torch.randn(64, 256, device=CUDA)
    with memsentry.track(lin) as t:
        for _ in range(4):
            with torch.set_grad_enabled(grad):
                y = lin(x)
                if grad:
                    y.sum().backward()
            del y
            t.step()
    stats = t.report().layer("Linear")
    assert stats.output_bytes == 64 * 512 * 4
    assert stats.forward_delta == 64 * 512 * 4
    assert stats.saved_bytes == (64 * 256 * 4 if grad else 0)


@pytest.mark.cuda
def test_cuda_training_is_unchanged_and_measured() -> None:
    def run(tracked: bool) -> list[float]:
        model = make_mlp().to(CUDA)
        if not tracked:
            torch.manual_seed(1)
            return train_cuda(model)
        with memsentry.track(model) as t:
            torch.manual_seed(1)
            losses = train_cuda(model)
        for layer in t.report().layers:
            assert layer.backward_calls == 3
        return losses

    def train_cuda(model: nn.Module) -> list[float]:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        losses = []
        for _ in range(3):
            loss = model(torch.randn(8, 16, device=CUDA)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    assert run(True) == run(False)


@pytest.mark.cuda
def test_track_without_model_picks_cuda_from_the_first_call() -> None:
    model = make_mlp().to(CUDA)
    with memsentry.track() as t:
        model(torch.randn(4, 16, device=CUDA)).sum().backward()
        t.step()
    assert t.report().device == "cuda:0"


@pytest.mark.cuda
def test_nvml_sees_the_gpu() -> None:
    info = query(0)
    assert info.available is True, info.reason
    assert info.total is not None and info.total > 0
    assert info.used is not None and 0 <= info.used <= info.total
    # The handle is torch's device 0 (found by PCI bus id, so CUDA_VISIBLE_DEVICES holds).
    assert info.name == torch.cuda.get_device_name(0)
    assert info.total >= torch.cuda.get_device_properties(0).total_memory


@pytest.mark.cuda
def test_machine_survey_lists_cuda_devices() -> None:
    info = collect()
    assert info.cuda_available
    assert len(info.cuda_devices) == torch.cuda.device_count()
    assert info.cuda_devices[0].total > 0


def test_cpu_model_trains_under_tracking_on_any_machine() -> None:
    # On a CUDA machine too, a CPU model is measured on the CPU.
    model = make_mlp()
    with memsentry.track(model) as t:
        train(model, 2)
    assert t.report().device == "cpu"


def test_storage_counter_sees_tensors_made_from_python_data() -> None:
    # torch.tensor() builds its storage outside dispatch, then lifts it (aten.lift_fresh).
    from memsentry.measure.storage import StorageCounter

    counter = StorageCounter()
    with counter:
        kept = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert counter.current == 16 and len(counter.live) == 1
    del kept
    assert counter.current == 0
