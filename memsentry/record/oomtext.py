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
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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
                   limit=_found(_NATIVE_ALLOWED, message))


def _async(message: str) -> OomText:
    found = {name: _found(pattern, message) for name, pattern in _ASYNC_LINES.items()}
    return OomText(requested=found["requested"], total=found["total"], free=found["free"],
                   limit=found["limit"])


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


__all__ = ["OomText", "read_message"]
