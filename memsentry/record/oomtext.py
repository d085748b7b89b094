"""What an allocator's out-of-memory message says: the size that failed and, on CUDA, the
device's figures when the allocator gave up.

The messages, as torch writes them (sizes by c10's ``format_size``: ``512 bytes``,
``1.50 KiB``, ``2.00 MiB``, ``80.00 GiB``):

- the CPU allocator: ``DefaultCPUAllocator: can't allocate memory: you tried to allocate
  1099511627776 bytes``;
- CUDA's caching allocator (c10/cuda/CUDACachingAllocator.cpp): ``CUDA out of memory. Tried
  to allocate <alloc_size>. GPU 0 has a total capacity of <device_total> of which
  <device_free> is free. [<allowed_memory_maximum> allowed; ]Of the allocated memory ...``,
  where ``alloc_size`` is the segment it asked the driver for and the ``allowed`` clause is
  there only when ``set_per_process_memory_fraction`` set a cap;
- CUDA's cudaMallocAsync allocator (c10/cuda/CUDAMallocAsyncAllocator.cpp): ``Allocation on
  device 0 would exceed allowed memory. (out of memory)`` followed by lines ``Currently
  allocated :``, ``Requested :`` (the tensor's size), ``Device limit :``, ``Free (according
  to CUDA):`` and ``PyTorch limit (set by user-supplied memory fraction)`` (``UINT64_MAX``,
  printed as about 17 billion GiB, when no fraction was set);
- MPS's allocator (aten/src/ATen/mps/MPSAllocator.mm, ``alloc_buffer_block``): ``MPS backend
  out of memory (MPS allocated: <size>, other allocations: <size>[, max allowed: <size>]).
  Tried to allocate <size> on private pool. ...``. Its sizes come from the allocator's own
  ``format_size`` in the releases that print ``KB``, ``MB`` and ``GB``: it divides by
  1024.0, 1048576.0 and 1073741824.0 and prints two decimals, so there ``256.00 MB`` is
  256 MiB and a ``GB`` is a GiB (later releases call c10's ``format_size`` and print
  ``MiB`` and ``GiB``);
- other accelerators: ``... Tried to allocate <size>``.

The device: the caching allocator's message names it as ``GPU <index> has a total capacity``,
cudaMallocAsync's as ``Allocation on device <index>``.

Out of memory outside PyTorch's allocator (:func:`read_outside`): memory a part of CUDA asks
the driver for itself, which the caching allocator neither counts nor can lend from its
cache. These messages give no size. As torch words them:

- a CUDA runtime call torch checks (``C10_CUDA_CHECK``; c10/cuda/CUDAException.cpp,
  ``c10_cuda_check_implementation``): ``CUDA error: out of memory`` (``cudaGetErrorString``
  of ``cudaErrorMemoryAllocation``), then torch's help lines (c10/cuda/CUDAMiscFunctions.cpp:
  ``Search for `cudaErrorMemoryAllocation' ...``, or in older releases ``CUDA kernel errors
  might be asynchronously reported ...``, and ``Compile with `TORCH_USE_CUDA_DSA` to enable
  device-side assertions.``). Since torch 2.8 it is raised as ``torch.AcceleratorError``
  (c10::AcceleratorError, a ``RuntimeError`` subclass carrying ``error_code``, 2 here), before
  as ``RuntimeError``; ROCm's hipified build says ``HIP error: out of memory``;
- a CUDA driver call (c10/cuda/driver_api.h, ``C10_CUDA_DRIVER_CHECK``): ``CUDA driver error:
  out of memory``, a ``RuntimeError``;
- cuBLAS (aten/src/ATen/cuda/Exceptions.h, ``TORCH_CUDABLAS_CHECK``, with the status names of
  aten/src/ATen/cuda/Exceptions.cpp's ``_cublasGetErrorEnum``): ``CUDA error:
  CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)``` when
  aten/src/ATen/cuda/CublasHandlePool.cpp creates a handle (``cublasLtCreate`` likewise), a
  ``RuntimeError``;
- cuDNN (aten/src/ATen/cuda/Exceptions.h, ``AT_CUDNN_CHECK``; ``cudnnCreate`` in
  aten/src/ATen/cudnn/Handle.cpp): ``cuDNN error: CUDNN_STATUS_ALLOC_FAILED`` (cuDNN 8),
  ``cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED`` (cuDNN 9's sub-code
  for a device allocation), and ``cuDNN error: CUDNN_STATUS_NOT_INITIALIZED`` (cuDNN could
  not start: most often no device memory left for it), a c10::CuDNNError, so a
  ``RuntimeError``;
- cuFFT (aten/src/ATen/native/cuda/CuFFTUtils.h, ``CUFFT_CHECK``): ``cuFFT error:
  CUFFT_ALLOC_FAILED``, a ``RuntimeError``;
- cuSOLVER (aten/src/ATen/cuda/Exceptions.h, ``TORCH_CUSOLVER_CHECK``): ``cusolver error:
  CUSOLVER_STATUS_ALLOC_FAILED, when calling `<call>`. ...``, a ``RuntimeError``.

Other CUDA errors (``CUDA error: an illegal memory access was encountered``, ``CUDA error:
device-side assert triggered``) are not out of memory and are not read as such.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from memsentry.model.oom import OomSource
from memsentry.units import parse_size

_SIZE = r"(\d+(?:\.\d+)?) ?(bytes|[KMGT]i?B|B)\b"
_CPU_SIZE = re.compile(r"you tried to allocate (\d+) bytes")
_NATIVE = re.compile(r"CUDA out of memory\. Tried to allocate " + _SIZE)
_NATIVE_DEVICE = re.compile(r"has a total capacity of " + _SIZE + " of which " + _SIZE
                            + " is free")
_NATIVE_ALLOWED = re.compile(_SIZE + " allowed;")
_ASYNC = "would exceed allowed memory. (out of memory)"
_ASYNC_LINES = {
    "requested": re.compile(r"Requested\s*: " + _SIZE),
    "total": re.compile(r"Device limit\s*: " + _SIZE),
    "free": re.compile(r"Free \(according to CUDA\): " + _SIZE),
    "limit": re.compile(r"PyTorch limit \(set by user-supplied memory fraction\)\s*: " + _SIZE),
}
_OTHER = re.compile(r"Tried to allocate " + _SIZE)
_MPS = "MPS backend out of memory"
#: MPS's decimal-looking units, which its ``format_size`` computes in powers of 1024.
_BINARY = {"KB": "KiB", "MB": "MiB", "GB": "GiB", "TB": "TiB"}
_DEVICE = (re.compile(r"\bGPU (\d+) has a total capacity"),
           re.compile(r"Allocation on device (\d+) would exceed"))
#: The texts of failures outside the allocator, each at the start of a line of the message
#: (or after an exception's name there, as a DataParallel replica's traceback quotes it).
_START = r"(?:^|Error: )"
_OUTSIDE = tuple((re.compile(_START + text + r"\b", re.M), source) for text, source in (
    (r"(?:CUDA|HIP) error: out of memory", OomSource.CUDA_RUNTIME),
    (r"CUDA driver error: out of memory", OomSource.CUDA_DRIVER),
    (r"CUDA error: (?:CUBLAS|HIPBLAS)_STATUS_ALLOC_FAILED", OomSource.CUBLAS),
    (r"cuDNN error: CUDNN_STATUS_(?:ALLOC_FAILED|INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED)",
     OomSource.CUDNN),
    (r"cuDNN error: CUDNN_STATUS_NOT_INITIALIZED", OomSource.CUDNN_START),
    (r"cuFFT error: CUFFT_ALLOC_FAILED", OomSource.CUFFT),
    (r"cusolver error: CUSOLVER_STATUS_ALLOC_FAILED", OomSource.CUSOLVER),
))
_CALL = re.compile(r"when calling `([^`\n]{1,200})`")


@dataclass(frozen=True)
class OomText:
    """What a message gives: ``requested`` (the size that failed; ``segment`` when it is the
    segment CUDA's caching allocator asked the driver for), and on CUDA the device's
    ``total`` and ``free`` memory and the ``limit`` a memory fraction set."""

    requested: int | None = None
    segment: bool = False
    total: int | None = None
    free: int | None = None
    limit: int | None = None
    device: int | None = None


@dataclass(frozen=True)
class OutsideText:
    """A failure outside PyTorch's allocator: what ran out (``source``) and the call torch
    names (``call``: ``cublasCreate(handle)``), where it names one."""

    source: OomSource
    call: str | None = None


def read_outside(message: str) -> OutsideText | None:
    """What ran out of memory outside PyTorch's allocator, as ``message`` says it; ``None``
    for any other message (another CUDA error included)."""
    for pattern, source in _OUTSIDE:
        if pattern.search(message):
            call = _CALL.search(message)
            return OutsideText(source, call.group(1) if call else None)
    return None


def named_device(message: str) -> int | None:
    """The index of the device the allocator's message names, where it names one."""
    for pattern in _DEVICE:
        match = pattern.search(message)
        if match:
            return int(match.group(1))
    return None


def _size(number: str, unit: str, *, binary: bool = False) -> int | None:
    if binary:
        unit = _BINARY.get(unit, unit)
    try:
        return parse_size(f"{number} {'B' if unit == 'bytes' else unit}")
    except ValueError:
        return None


def _found(pattern: re.Pattern[str], message: str, group: int = 0, *,
           binary: bool = False) -> int | None:
    match = pattern.search(message)
    if match is None:
        return None
    return _size(match.group(2 * group + 1), match.group(2 * group + 2), binary=binary)


def _native(message: str) -> OomText:
    return OomText(requested=_found(_NATIVE, message), segment=True,
                   total=_found(_NATIVE_DEVICE, message),
                   free=_found(_NATIVE_DEVICE, message, group=1),
                   limit=_found(_NATIVE_ALLOWED, message), device=named_device(message))


def _async(message: str) -> OomText:
    found = {name: _found(pattern, message) for name, pattern in _ASYNC_LINES.items()}
    return OomText(requested=found["requested"], total=found["total"], free=found["free"],
                   limit=found["limit"], device=named_device(message))


def read_message(message: str) -> OomText:
    """What the out-of-memory ``message`` says, as far as it says it."""
    cpu = _CPU_SIZE.search(message)
    if cpu:
        return OomText(requested=int(cpu.group(1)))
    if _NATIVE.search(message):
        return _native(message)
    if _ASYNC in message:
        return _async(message)
    return OomText(requested=_found(_OTHER, message, binary=_MPS in message))


__all__ = ["OomText", "OutsideText", "named_device", "read_message", "read_outside"]
