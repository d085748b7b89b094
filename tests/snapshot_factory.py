"""Allocator snapshots built as PyTorch's caching allocator records them, for the tests of
``memsentry show snap.pickle``. Each behaviour names its source:

- the dict's layout (``segments`` with ``blocks``, ``device_traces`` of entries with
  ``action``, ``addr``, ``size``, ``stream``, ``frames``, ``time_us``; ``device_free`` on an
  ``oom``, which has no ``addr``; ``allocator_settings``): the docstring of ``_snapshot`` in
  torch/cuda/memory.py (torch 2.13) and torch/csrc/cuda/memory_snapshot.cpp;
- a free is ``free_requested`` then ``free_completed`` (no other stream used the block), and
  the free entries carry the stack of the allocation (``context_when_allocated``):
  c10/cuda/CUDACachingAllocator.cpp, ``free`` and ``free_block``;
- an ``alloc`` or free entry's ``size`` is the bytes requested; a block's ``size`` is rounded
  up to 512 bytes (``kMinBlockSize``, ``round_size``) and its ``requested_size`` is the
  request: c10/cuda/CUDACachingAllocator.cpp (``record_trace`` calls, ``round_size``);
- an ``oom`` entry has no ``addr`` and carries ``device_free``: the same file's ``malloc``;
- the backward's allocations have no frames (autograd's worker thread has no Python stack,
  with ``stacks="python"``), but the seed gradient made in ``_make_grads`` on the calling
  thread has: torch/autograd/__init__.py, and MemoryViz.js's message for frameless blocks;
- the trace keeps the newest ``max_entries`` (a ring buffer): ``_record_memory_history``'s
  docstring in torch/cuda/memory.py;
- frames are innermost first, with torch's Python files under ``site-packages/torch``: the
  ``stacks="python"`` recording of torch/cuda/memory.py.

Segments are simplified: the live blocks of a device are laid in one segment, followed by one
cached free block of ``cached_free`` bytes (the fragmentation tests give their own).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

TORCH = "/opt/conda/lib/python3.11/site-packages/torch"
ROUND = 512

Frame = dict[str, Any]


def frame(filename: str, line: int, name: str) -> Frame:
    return {"filename": filename, "line": line, "name": name}


def user(line: int, name: str = "train", filename: str = "/home/me/train.py") -> Frame:
    return frame(filename, line, name)


MAIN = user(90, "<module>")
FORWARD = [frame(f"{TORCH}/nn/modules/linear.py", 125, "forward"),
           frame(f"{TORCH}/nn/modules/module.py", 1762, "_call_impl"),
           frame(f"{TORCH}/nn/modules/module.py", 1751, "_wrapped_call_impl")]
SEED = [frame(f"{TORCH}/autograd/__init__.py", 233, "_make_grads"),
        frame(f"{TORCH}/autograd/__init__.py", 347, "backward"),
        frame(f"{TORCH}/_tensor.py", 626, "backward")]
#: The backward's own allocations, made on autograd's worker thread.
BACKWARD: list[Frame] = []
STEP = [frame(f"{TORCH}/optim/adam.py", 401, "_single_tensor_adam"),
        frame(f"{TORCH}/optim/adam.py", 247, "step"),
        frame(f"{TORCH}/optim/optimizer.py", 485, "wrapper")]
SETUP = [frame(f"{TORCH}/nn/modules/module.py", 1343, "convert"),
         frame(f"{TORCH}/nn/modules/module.py", 942, "_apply"),
         frame(f"{TORCH}/nn/modules/module.py", 1355, "to")]


def stack(torch_frames: list[Frame], line: int) -> list[Frame]:
    """Torch's frames (innermost first), then the user's line in ``train()``, then the
    script's top."""
    return [*torch_frames, user(line), MAIN]


class FakeAllocator:
    """Records a trace and the live blocks of one device."""

    def __init__(self, device: int = 0, max_entries: int | None = None) -> None:
        self.device = device
        self.max_entries = max_entries
        self.trace: list[dict[str, Any]] = []
        self.live: dict[int, tuple[int, int, list[Frame]]] = {}
        self._next = 0x7F00_0000_0000 + device * 0x10_0000_0000
        self._time = 1_000_000

    def _record(self, entry: dict[str, Any]) -> None:
        self._time += 7
        entry.setdefault("stream", 0)
        entry["time_us"] = self._time
        self.trace.append(entry)
        if self.max_entries is not None and len(self.trace) > self.max_entries:
            del self.trace[0]

    def alloc(self, requested: int, frames: list[Frame]) -> int:
        size = max(ROUND, -(-requested // ROUND) * ROUND)
        address, self._next = self._next, self._next + size
        self.live[address] = (size, requested, frames)
        self._record({"action": "alloc", "addr": address, "size": requested,
                      "frames": frames})
        return address

    def free(self, address: int) -> None:
        _size, requested, frames = self.live.pop(address)
        for action in ("free_requested", "free_completed"):
            self._record({"action": action, "addr": address, "size": requested,
                          "frames": frames})

    def oom(self, size: int, device_free: int, frames: list[Frame]) -> None:
        self._record({"action": "oom", "size": size, "device_free": device_free,
                      "frames": frames})

    def segments(self, cached_free: int = 0) -> list[dict[str, Any]]:
        if not self.live and not cached_free:
            return []
        blocks = [{"address": address, "size": size, "requested_size": requested,
                   "state": "active_allocated", "frames": frames}
                  for address, (size, requested, frames) in sorted(self.live.items())]
        start = min(self.live, default=self._next)
        used = sum(size for size, _requested, _frames in self.live.values())
        if cached_free:
            blocks.append({"address": self._next, "size": cached_free,
                           "requested_size": 0, "state": "inactive", "frames": []})
        return [{"device": self.device, "address": start, "total_size": used + cached_free,
                 "stream": 0, "segment_type": "large", "segment_pool_id": (0, 0),
                 "allocated_size": used, "active_size": used, "is_expandable": False,
                 "blocks": blocks}]


def snapshot(*allocators: FakeAllocator, cached_free: int = 0,
             settings: dict[str, Any] | None = None) -> dict[str, Any]:
    devices = max((a.device for a in allocators), default=0) + 1
    traces: list[list[dict[str, Any]]] = [[] for _ in range(devices)]
    segments: list[dict[str, Any]] = []
    for allocator in allocators:
        traces[allocator.device] = allocator.trace
        segments += allocator.segments(cached_free)
    data: dict[str, Any] = {"segments": segments, "device_traces": traces}
    if settings is not None:
        data["allocator_settings"] = settings
    return data


def write(data: dict[str, Any], path: Path) -> Path:
    with open(path, "wb") as file:
        pickle.dump(data, file)  # as torch.cuda.memory._dump_snapshot() does
    return path


KIB = 1024
MIB = 1024 * KIB


def training(iterations: int = 20, *, keep: str | None = None, ring: int = 0,
             allocator: FakeAllocator | None = None, width: int = 256 * KIB,
             adam: bool = True) -> FakeAllocator:
    """A training loop of a two-layer model with Adam, as the allocator sees it: the model
    moved to the device, then each iteration an input (line 40), two layers' outputs (line
    42), the loss (43), the seed gradient (44) and the backward's gradients and temporaries
    (no frames), the step's state (its first step) and temporaries (45),
    ``zero_grad(set_to_none=True)`` freeing the gradients.

    ``keep``: ``"output"`` keeps each iteration's output alive (``outputs.append(out)``),
    ``"loss"`` keeps the loss and the activations its graph saves (``total += loss``);
    ``ring``: the kept outputs are a ``deque(maxlen=ring)``; ``adam=False``: plain SGD,
    whose step makes nothing on the device (``torch.optim.SGD`` without momentum updates in
    place)."""
    gpu = allocator if allocator is not None else FakeAllocator()
    params = [gpu.alloc(width, stack(SETUP, 20)) for _ in range(4)]
    state: list[int] = []
    kept: list[int] = []
    for _ in range(iterations):
        x = gpu.alloc(64 * KIB, [user(40), MAIN])
        hidden = gpu.alloc(128 * KIB, stack(FORWARD, 42))
        out = gpu.alloc(32 * KIB, stack(FORWARD, 42))
        loss = gpu.alloc(4, [user(43), MAIN])
        seed = gpu.alloc(4, stack(SEED, 44))
        grads = [gpu.alloc(width, BACKWARD) for _ in params]
        temporary = gpu.alloc(128 * KIB, BACKWARD)
        gpu.free(temporary)
        gpu.free(seed)
        if adam and not state:
            state = [gpu.alloc(width, stack(STEP, 45)) for _ in range(2 * len(params))]
        if adam:
            gpu.free(gpu.alloc(width, stack(STEP, 45)))
        for grad in grads:
            gpu.free(grad)
        if keep == "loss":
            gpu.free(x)
            gpu.free(out)
            kept += [hidden, loss]
            continue
        gpu.free(x)
        gpu.free(hidden)
        gpu.free(loss)
        if keep == "output":
            kept.append(out)
            if ring and len(kept) > ring:
                gpu.free(kept.pop(0))
        else:
            gpu.free(out)
    del params
    return gpu
