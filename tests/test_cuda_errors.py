"""Out of memory outside PyTorch's caching allocator, and on another device than the tracked
one (issue 39, items 4 and 5), on fakes of torch's CUDA (tests/fake_cuda.py) and of NVML
(tests/fake_nvml.py): a tracked loop on the CPU whose layer raises what torch raises, with
the words torch writes.

- ``CUDA error: out of memory``: c10/cuda/CUDAException.cpp (``c10_cuda_check_implementation``:
  "CUDA error: " and ``cudaGetErrorString``, then c10/cuda/CUDAMiscFunctions.cpp's help
  lines), raised as ``torch.AcceleratorError`` (c10::AcceleratorError, whose ``error_code``
  is the cudaError_t: 2, ``cudaErrorMemoryAllocation``) since torch 2.8, as ``RuntimeError``
  with the "CUDA kernel errors might be asynchronously reported" lines before;
- ``CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)```:
  aten/src/ATen/cuda/Exceptions.h's ``TORCH_CUDABLAS_CHECK`` around CublasHandlePool.cpp's
  ``cublasCreate``, a ``RuntimeError`` (TORCH_CHECK). :class:`FakeCublas` fails as cuBLAS
  does: its handle is device memory it asks the driver for, which the caching allocator's
  cache cannot lend;
- cuDNN, cuFFT, cuSOLVER and the CUDA driver: aten/src/ATen/cuda/Exceptions.h
  (``AT_CUDNN_CHECK``, ``TORCH_CUSOLVER_CHECK``), aten/src/ATen/native/cuda/CuFFTUtils.h
  (``CUFFT_CHECK``), c10/cuda/driver_api.h (``C10_CUDA_DRIVER_CHECK``);
- NVML (nvidia-ml-py's pynvml) counts the process's memory on the device: what the caching
  allocator reserved plus the CUDA context and the libraries' own memory; torch's
  ``get_device_properties(i).uuid`` names the GPU NVML finds (torch/csrc/cuda/Module.cpp).
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
from fake_cuda import (
    CUBLAS,
    RUNTIME_BEFORE,
    RUNTIME_NOW,
    FakeCachingAllocator,
    FakeCublas,
    GiB,
    MiB,
    format_size,
    install,
    props,
)
from fake_nvml import Gpu, fake_pynvml
from torch import nn

import memsentry
from memsentry.model import FixKind, Phase
from memsentry.units import format_bytes

CONTEXT = 600 * MiB  # the CUDA context and the libraries loaded with it, outside the allocator
OTHERS = 3 * GiB  # another process on the same GPU
UUID = "0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9"
AcceleratorError: type[RuntimeError] = getattr(torch, "AcceleratorError", RuntimeError)


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> FakeCachingAllocator:
    """One GPU of 80 GiB: the caching allocator (tests/fake_cuda.py), beside it this process's
    memory outside the allocator (``own``: the CUDA context, ``CONTEXT``) and another process
    (``OTHERS``); the driver's free memory (``torch.cuda.mem_get_info``) and NVML's counts
    (this process: what the allocator reserved and ``own``), read as they change."""
    fake = install(monkeypatch, FakeCachingAllocator())
    fake.own = CONTEXT  # type: ignore[attr-defined]
    fake.others = OTHERS + CONTEXT  # all the allocator cannot have

    def process() -> int:
        return fake.reserved + fake.own  # type: ignore[attr-defined]

    def others() -> int:
        return fake.others - fake.own  # type: ignore[attr-defined]

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=None: props(
        UUID, name="Fake GPU", total=fake.total))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index=None: (
        fake.device_free, fake.total))
    pid = os.getpid()
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([Gpu(
        f"GPU-{UUID}", "Fake GPU", fake.total, used=lambda: process() + others(),
        processes={pid + 1: others, pid: process}, utilization=(90, 40))]))
    return fake


class Fills(nn.Module):
    """Each call keeps bytes of activations on the device until its backward (``sizes``, one a
    call, the last repeated); from the ``fail_at``-th call on it runs ``then`` (a call that
    fails) and passes its output through ``launch`` (an op whose backward fails)."""

    def __init__(self, device: FakeCachingAllocator, sizes: list[int],
                 then: Callable[[], None] = lambda: None, fail_at: int = 3,
                 launch: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        self.device, self.sizes, self.then, self.fail_at = device, sizes, then, fail_at
        self.launch = launch
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        block = self.device.malloc(self.sizes[min(self.calls, len(self.sizes)) - 1])
        x = x * 1.0
        x.register_hook(lambda grad: self.device.free(block))
        if self.calls >= self.fail_at:
            self.then()
            if self.launch is not None:
                x = self.launch(x)
        return x


def model_with(layer: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), layer, nn.Linear(16, 1))


def run(model: nn.Module, *, tracked: bool = True, steps: int = 6
        ) -> tuple[BaseException, memsentry.Report | None]:
    """The loop, tracked on ``cuda`` or not, until it fails: its error and the report."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tracker = memsentry.track(model, device="cuda", on_leak="ignore", holders=False) \
        if tracked else None
    try:
        if tracker is not None:
            tracker.start()
        for _ in range(steps):
            model(torch.randn(8, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
    except BaseException as error:  # the test looks at it
        return error, tracker.stop(error) if tracker is not None else None
    raise AssertionError("the loop did not fail")


def frames(error: BaseException) -> list[tuple[str, str]]:
    return [(f.name, f.line or "") for f in traceback.extract_tb(error.__traceback__)
            if f.filename == __file__]


def flat(text: str) -> str:
    return " ".join(text.split())


def cublas_loop(device: FakeCachingAllocator) -> tuple[nn.Module, FakeCublas]:
    """Two steps whose activations take all the device has (76.4 GiB, with 3 GiB another
    process's and this process's 600 MiB context), then a small step whose first matmul makes
    cuBLAS's handle: the caching allocator keeps 75.4 GiB of it cached, 48 MiB are free."""
    cublas = FakeCublas(device)
    room = device.total - device.others - 48 * MiB
    return model_with(Fills(device, [room, room, 1000 * MiB], cublas.create)), cublas


def test_cublas_failing_to_make_its_handle_gets_a_post_mortem_of_memory_outside_the_allocator(
        gpu: FakeCachingAllocator, tmp_path: Any) -> None:
    """cuBLAS asks the driver for its handle's 64 MiB with 48 MiB free: the caching
    allocator's cache, which cuBLAS cannot use, holds the rest. The user gets torch's
    RuntimeError as it was; the report says cuBLAS ran out outside the allocator, with the
    figures there are, and fixes that leave room, not a batch worked out of no size."""
    elsewhere = FakeCachingAllocator()  # the same loop, untracked, on a device of its own
    elsewhere.others = OTHERS + CONTEXT
    plain, _ = run(cublas_loop(elsewhere)[0], tracked=False)
    model, cublas = cublas_loop(gpu)
    error, report = run(model)
    assert type(error) is type(plain) is RuntimeError and str(error) == str(plain) == CUBLAS
    assert frames(error) == frames(plain)
    assert cublas.handles == 0 and gpu.device_free == 48 * MiB < cublas.handle_bytes
    assert report is not None and report.oom is not None
    oom = report.oom
    assert (oom.source, oom.call, oom.requested_bytes) == ("cuBLAS", "cublasCreate(handle)", None)
    assert (oom.phase, oom.layer, oom.iteration, oom.device) == (Phase.FORWARD, "1", 2, "cuda:0")
    reserved = gpu.reserved
    assert oom.reserved == reserved and oom.breakdown.total == gpu.allocated == 1000 * MiB
    assert oom.process_used == reserved + CONTEXT and oom.outside_allocator == CONTEXT
    assert oom.device_free == 48 * MiB and oom.others == OTHERS
    assert {fix.kind for fix in oom.fixes} == {FixKind.HEADROOM}  # no batch from no size
    texts = [fix.text for fix in oom.fixes]
    assert texts[0] == (
        "call torch.cuda.empty_cache() before the call that failed: PyTorch's caching allocator "
        f"reserved {format_bytes(reserved)} and its tensors used 1000 MiB; the "
        f"{format_bytes(reserved - 1000 * MiB)} it kept cached is memory cuBLAS cannot use "
        "until empty_cache() gives it back to the driver")
    assert oom.fixes[0].saves == reserved - 1000 * MiB
    assert any(text.startswith("make cuBLAS's handles while the device is empty")
               for text in texts)
    assert any("CUBLAS_WORKSPACE_CONFIG=:16:8" in text for text in texts)
    assert any("set_per_process_memory_fraction(0.94) holds it to 75 GiB of 80 GiB, leaving "
               "the 600 MiB held outside it now and other processes' 3.0 GiB plus 1.0 GiB"
               in text for text in texts)  # (80 GiB - 600 MiB - 3 GiB - 1 GiB) / 80 GiB
    shown = flat(str(report))
    assert ("Out of memory outside PyTorch's caching allocator: RuntimeError in the forward of "
            "`1` (iteration 2, batch 8): cuBLAS could not allocate device memory in "
            "`cublasCreate(handle)`") in shown
    assert ("why: cuBLAS allocates its handle and its internal buffers with cudaMalloc itself, "
            "outside PyTorch's caching allocator, which cannot lend it what it holds cached; "
            "the error gives no size, so no batch is worked out") in shown
    assert (f"outside the allocator: 600 MiB: NVML counted {format_bytes(reserved + CONTEXT)} "
            f"for this process on cuda:0, of which the caching allocator reserved "
            f"{format_bytes(reserved)}") in shown
    assert "free on the device: 48 MiB" in shown and "other processes: 3.0 GiB" in shown
    assert "would have fit" not in shown
    if sys.version_info >= (3, 11):
        (note,) = error.__notes__
        assert note.startswith("memsentry: out of memory outside PyTorch's caching allocator in "
                               "the forward of `1` (iteration 2): cuBLAS could not allocate")
        assert "fix: call torch.cuda.empty_cache()" in note
    path = tmp_path / "report.json"
    report.to_json(path)
    assert memsentry.Report.from_json(path).oom == oom


@pytest.mark.parametrize(("kind", "words"), [(AcceleratorError, RUNTIME_NOW),
                                             (RuntimeError, RUNTIME_BEFORE)])
def test_cuda_error_out_of_memory_is_explained_and_other_cuda_errors_are_not(
        gpu: FakeCachingAllocator, kind: type[RuntimeError], words: str) -> None:
    """A kernel launch in the backward runs out of device memory outside the allocator (torch
    2.8 and later raise torch.AcceleratorError, carrying cudaErrorMemoryAllocation's code 2;
    older releases a RuntimeError): explained, and reaching the user as it was raised. An
    illegal memory access and a device-side assert, in the same words, are no out of memory."""

    def launching(text: str) -> nn.Module:
        class Launch(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
                return x * 2

            @staticmethod
            def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
                error = kind(text)
                error.error_code = 2 if "out of memory" in text else 700  # type: ignore[attr-defined]
                raise error

        def launch(x: torch.Tensor) -> torch.Tensor:
            return Launch.apply(x)  # type: ignore[no-any-return]

        return Fills(gpu, [4 * MiB], launch=launch)

    message = words.format("out of memory", "cudaErrorMemoryAllocation")
    error, report = run(model_with(launching(message)))
    assert type(error) is kind and str(error) == message
    assert getattr(error, "error_code", None) == 2
    assert report is not None and report.oom is not None
    oom = report.oom
    assert (oom.source, oom.phase, oom.message) == ("CUDA runtime", Phase.BACKWARD,
                                                    "CUDA error: out of memory")
    assert oom.requested_bytes is None and not [f for f in oom.fixes if f.kind is FixKind.BATCH]
    assert any("CUDA_MODULE_LOADING=LAZY" in fix.text for fix in oom.fixes)
    assert "why: the CUDA runtime allocates this memory itself" in flat(str(report))

    for other in (words.format("an illegal memory access was encountered",
                               "cudaErrorIllegalAddress"),
                  words.format("device-side assert triggered", "cudaErrorAssert")):
        error, report = run(model_with(launching(other)))
        assert type(error) is kind and str(error) == other
        assert report is not None and report.oom is None
        assert getattr(error, "__notes__", []) == []


@pytest.mark.parametrize(("message", "source", "call", "fix"), [
    ("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED", "cuDNN", None,
     "runs a convolution"),
    ("cuDNN error: CUDNN_STATUS_ALLOC_FAILED", "cuDNN", None, "runs a convolution"),
    ("cuDNN error: CUDNN_STATUS_NOT_INITIALIZED", "cuDNN start", None, "runs a convolution"),
    ("cuFFT error: CUFFT_ALLOC_FAILED", "cuFFT", None, "cufft_plan_cache[0].max_size"),
    ("cusolver error: CUSOLVER_STATUS_ALLOC_FAILED, when calling `cusolverDnCreate(handle)`. "
     "If you keep seeing this error, you may use "
     "`torch.backends.cuda.preferred_linalg_library()` to try linear algebra operators with "
     "other supported backends.", "cuSOLVER", "cusolverDnCreate(handle)", "torch.linalg call"),
    ("CUDA driver error: out of memory", "CUDA driver", None, "CUDA_MODULE_LOADING=LAZY"),
])
def test_each_library_that_runs_out_outside_the_allocator_is_named(
        gpu: FakeCachingAllocator, message: str, source: str, call: str | None,
        fix: str) -> None:
    def fail() -> None:
        raise RuntimeError(message)

    error, report = run(model_with(Fills(gpu, [4 * MiB], fail)))
    assert type(error) is RuntimeError and str(error) == message
    assert report is not None and report.oom is not None
    assert (report.oom.source, report.oom.call) == (source, call)
    assert any(fix in f.text for f in report.oom.fixes)
    assert report.oom.outside_allocator == CONTEXT
    if source == "cuDNN start":  # not certainly memory: said so
        assert "a cuDNN that does not match the driver gives it too" in flat(str(report))


class OtherGpu(FakeCachingAllocator):
    """A second device's caching allocator: its observers are called, and its message is
    written, with its own index (c10/cuda/CUDACachingAllocator.cpp: ``obs(device, ...)`` and
    "GPU <device> has a total capacity of ..."); ``observed`` False plays a torch whose
    observer is not attached (the message alone names the device)."""

    def __init__(self, index: int, total: int, *, observed: bool = True) -> None:
        super().__init__(total)
        self.index, self.observed = index, observed

    def out_of_memory(self, segment: int) -> None:
        for observer in self.observers if self.observed else ():
            observer(self.index, segment, self.total, self.device_free)
        raise torch.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate {format_size(segment)}. GPU {self.index} "
            f"has a total capacity of {format_size(self.total)} of which "
            f"{format_size(self.device_free)} is free. Of the allocated memory "
            f"{format_size(self.allocated)} is allocated by PyTorch, and "
            f"{format_size(self.reserved - self.allocated)} is reserved by PyTorch but "
            "unallocated.")


@pytest.mark.parametrize("observed", [True, False])
def test_an_out_of_memory_on_another_device_is_explained_with_that_devices_figures(
        monkeypatch: pytest.MonkeyPatch, observed: bool) -> None:
    """memsentry tracks cuda:0 (80 GiB); the model's middle layer lives on cuda:1 (24 GiB) and
    runs out there. The post-mortem says cuda:1 ran out, with cuda:1's reserved, free and total
    memory, and does not present cuda:0's breakdown as cuda:1's (no batch worked out of it)."""
    first, second = FakeCachingAllocator(), OtherGpu(1, 24 * GiB, observed=observed)
    install(monkeypatch, first)
    devices = [first, second]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch._C, "_cuda_memoryStats", lambda index: devices[index].nested(index),
                        raising=False)
    monkeypatch.setattr(torch._C, "_cuda_resetPeakMemoryStats",
                        lambda index: devices[index].reset_peak(index), raising=False)
    monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer", lambda observer: [
        device.attach_observer(observer) for device in devices])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=None: props(
        None, name="Fake GPU", total=devices[index or 0].total))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index=None: (
        devices[index or 0].device_free, devices[index or 0].total))
    first.malloc(10 * GiB)  # the tracked device holds 10 GiB: not the one that ran out
    second.malloc(20 * GiB)

    error, report = run(model_with(Fills(second, [2 * GiB, 2 * GiB, 6 * GiB],
                                                fail_at=99)))
    assert type(error) is torch.OutOfMemoryError
    assert "GPU 1 has a total capacity of 24.00 GiB" in str(error)
    assert report is not None and report.oom is not None
    oom = report.oom
    assert (oom.reserved, oom.device_total) == (second.reserved, 24 * GiB)  # not cuda:0's
    assert (oom.device, oom.tracked) == ("cuda:1", "cuda:0")
    assert oom.device_free == second.device_free
    assert oom.capacity == second.reserved + second.device_free  # cuda:1's ceiling
    assert oom.requested_bytes == 6 * GiB  # the third call's segment
    assert not [f for f in oom.fixes if f.kind is FixKind.BATCH]
    shown = flat(str(report))
    assert "Out of memory on cuda:1: OutOfMemoryError in the forward of `1`" in shown
    assert "held then: 10 GiB in use on cuda:0 (parameters" in shown
    assert ("device: cuda:1 ran out; memsentry tracked cuda:0, so `held then` is cuda:0's and "
            "the other figures are cuda:1's") in shown
    assert "in use of 80 GiB" not in shown and "in use of 24 GiB" not in shown


def test_the_breakdown_shows_the_memory_outside_the_allocator(gpu: FakeCachingAllocator
                                                               ) -> None:
    """NVML counts 600 MiB more for the process than the caching allocator reserved: the
    breakdown says so, apart from the categories of tensors it counts."""
    model = model_with(nn.Identity())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with memsentry.track(model, device="cuda", on_leak="ignore", holders=False) as t:
        for _ in range(4):
            block = gpu.malloc(3 * MiB)
            model(torch.randn(8, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
            gpu.free(block)
    report = t.report()
    assert report.nvml is not None and report.nvml["process_used"] == gpu.reserved + CONTEXT
    shown = flat(str(report))
    assert ("Outside PyTorch's allocator: 600 MiB when tracking stopped: NVML counted 620 MiB "
            "for this process on cuda:0 and the caching allocator reserved 20 MiB; the rest is "
            "the CUDA context, cuBLAS and cuDNN handles and workspaces, NCCL buffers") in shown


def test_an_allocator_out_of_memory_shows_what_is_held_outside_it(gpu: FakeCachingAllocator
                                                                   ) -> None:
    """The caching allocator's own refusal: its post-mortem keeps its arithmetic and adds what
    NVML counts outside it and what other processes hold."""
    error, report = run(model_with(Fills(gpu, [100 * GiB], fail_at=99)))
    assert type(error) is torch.OutOfMemoryError
    assert report is not None and report.oom is not None
    oom = report.oom
    assert (oom.source, oom.device, oom.tracked) == ("allocator", "cuda:0", None)
    assert oom.process_used == gpu.reserved + CONTEXT
    assert oom.device_used == oom.process_used + OTHERS
    shown = flat(str(report))
    assert "Out of memory: OutOfMemoryError in the forward of `1` (iteration 0" in shown
    assert "outside the allocator: 600 MiB: NVML counted" in shown
    assert "other processes: 3.0 GiB on cuda:0" in shown
    assert oom.requested_bytes == 100 * GiB
