"""Allocation history in the snapshot format of PyTorch's memory viewer (pytorch.org/memory_viz
and the offline functions of ``torch.cuda._memory_viz``), for ``track(snapshot=...)``.

A snapshot is a dict ``{"segments": [...], "device_traces": [[entry, ...]]}`` (see the
``torch.cuda.memory._snapshot`` docstring). On CUDA the caching allocator records it itself:
:class:`CudaHistory` switches its recording on (or uses the program's own) and takes the
snapshot. On CPU there is no such allocator; :class:`History` is what the storage-counting mode
(:class:`~memsentry.measure.storage.StorageCounter`) records when it is given one: the user's
Python stack for each new storage, and the same address and size when it is freed. Each CPU
storage is its own ``malloc``, so it is shown as a segment holding one block, with the events
the caching allocator records for such a block: ``segment_alloc`` and ``alloc`` when it is
made, ``free_requested``, ``free_completed`` and ``segment_free`` when it is freed (memory_viz
replays them; its segment view needs every live block inside a segment). A free carries the
stack of the allocation (no stack walk when a storage dies). Only ints and strings are kept,
never a tensor; at most ``max_entries`` entries, the oldest dropped first.
"""

from __future__ import annotations

import sys
import time
import types
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch

from memsentry.usercode.frames import is_machinery_frame
from memsentry.usercode.phases import torch_phase

#: One frame of a stack: ``{"filename": str, "line": int, "name": str}``.
Frame = dict[str, Any]
#: A trace entry, a segment or a whole snapshot: plain dicts, as torch's tools read them.
Snapshot = dict[str, Any]
#: A stack as recorded: (filename, line, function) of each user frame (and each of torch's
#: that says the phase), innermost first.
Stack = tuple[tuple[str, int, str], ...]

#: The user's frames kept per allocation, innermost first.
MAX_FRAMES = 16
#: Frames walked at most to find them, machinery frames included.
MAX_WALK = 256
#: Distinct frames and stacks shared between entries, and code objects known to be machinery
#: or not; past it, fresh ones.
_CACHE_LIMIT = 65536

ALLOC_ACTIONS = ("segment_alloc", "alloc")
FREE_ACTIONS = ("free_requested", "free_completed", "segment_free")


class History:
    """A bounded record of the CPU storages made and freed while tracking, in memory_viz's
    trace format. :meth:`alloc` and :meth:`free` are called by the storage counter;
    :meth:`snapshot` turns the record and the storages still alive into a snapshot.

    Entries are kept as tuples of strings and ints (which the garbage collector stops
    scanning) and become the dicts torch's tools read only when the snapshot is taken."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        # (action, address, bytes, stack, time in microseconds since the epoch)
        self._entries: deque[tuple[str, int, int, Stack, int]] = deque(maxlen=max_entries)
        self._stacks: dict[int, Stack] = {}  # live storage's address -> its stack
        self._interned: dict[Stack, Stack] = {}
        self._kinds: dict[types.CodeType, str] = {}  # code object -> frame_kind()
        self.recorded = 0  # entries ever recorded
        # (entries recorded, iteration) at each iteration's end
        self._ends: deque[tuple[int, int]] = deque(maxlen=max_entries)

    @property
    def dropped(self) -> int:
        """Entries recorded and then dropped to stay within ``max_entries``."""
        return self.recorded - len(self._entries)

    def alloc(self, addr: int, size: int) -> None:
        """A new storage of ``size`` bytes at ``addr``: its stack is the user's frames below
        the caller (the dispatch mode's own frames are machinery)."""
        stack = self._user_stack(sys._getframe(1))
        self._stacks[addr] = stack
        self._add(ALLOC_ACTIONS, addr, size, stack)

    def mark(self, iteration: int) -> None:
        """Iteration ``iteration`` ended: its last entry is the newest one. Iterations merged
        into it (numbered from it again) lose their marks."""
        ends = self._ends
        while ends and ends[-1][1] >= iteration:
            ends.pop()
        ends.append((self.recorded, iteration))

    def free(self, addr: int, size: int) -> None:
        """The storage at ``addr`` was freed."""
        self._add(FREE_ACTIONS, addr, size, self._stacks.pop(addr, ()))

    def _add(self, actions: tuple[str, ...], addr: int, size: int, stack: Stack) -> None:
        now = time.time_ns() // 1000
        append = self._entries.append
        for action in actions:
            append((action, addr, size, stack, now))
        self.recorded += len(actions)

    def _user_stack(self, frame: types.FrameType | None) -> Stack:
        """The user's frames from ``frame`` outwards, innermost first, with those of torch's
        that say the phase of training (:func:`~memsentry.usercode.phases.torch_phase`: an
        optimizer's step, a backward, a module's forward), of a run of one phase with no
        frame of the user's between them the outermost only (the one that decides); the rest
        of torch's, memsentry's and the standard library's left out (each code object's kind
        remembered: every storage walks the stack)."""
        frames: list[tuple[str, int, str]] = []
        kinds = self._kinds
        walked, run = 0, USER
        while frame is not None and len(frames) < MAX_FRAMES and walked < MAX_WALK:
            kind = kinds.get(frame.f_code) or self._learn(frame)
            if kind != LEFT_OUT:
                _keep(frames, frame, kind, run)
                run = kind
            frame = frame.f_back
            walked += 1
        stack = tuple(frames)
        known = self._interned.get(stack)
        if known is not None:
            return known
        if len(self._interned) < _CACHE_LIMIT:
            self._interned[stack] = stack
        return stack

    def _learn(self, frame: types.FrameType) -> str:
        """:func:`frame_kind` of a code object not met yet, remembered."""
        kind = frame_kind(frame)
        if len(self._kinds) < _CACHE_LIMIT:
            self._kinds[frame.f_code] = kind
        return kind

    def close(self) -> None:
        """Recording is over: forget the code objects remembered while walking stacks."""
        self._kinds.clear()

    def snapshot(self, live: Mapping[int, int]) -> Snapshot:
        """The snapshot: a segment for each storage in ``live`` (address -> bytes, the
        storages alive now), and the recorded entries, oldest first. Equal stacks are one
        list of frame dicts, which a pickle stores once."""
        live = dict(live)  # one atomic copy: another thread may be making storages
        stacks = dict(self._stacks)
        entries = list(self._entries)
        first = self.recorded - len(entries)  # the number of the oldest entry kept
        ends = [end - first - 1 for end, _iteration in list(self._ends) if end - first > 0]
        lists: dict[Stack, list[Frame]] = {}
        frames: dict[tuple[str, int, str], Frame] = {}

        def frame_list(stack: Stack) -> list[Frame]:
            found = lists.get(stack)
            if found is None:
                found = lists[stack] = [
                    frames.setdefault(key, {"filename": key[0], "line": key[1], "name": key[2]})
                    for key in stack]
            return found

        segments = [segment(addr, size, frame_list(stacks.get(addr, ())))
                    for addr, size in sorted(live.items())]
        trace = [{"action": action, "addr": addr, "size": size, "stream": 0,
                  "frames": frame_list(stack), "time_us": when}
                 for action, addr, size, stack, when in entries]
        # The extra key names the device, where each iteration ended (the index of its last
        # trace entry) and how many older entries were dropped, for `memsentry show`;
        # torch's readers and the viewer read the keys they know and pass over the others.
        return {"segments": segments, "device_traces": [trace],
                "memsentry": {"device": "cpu", "iteration_ends": ends, "dropped": first,
                              "phases": True}}


#: :func:`frame_kind`: a frame of the user's, one left out, or (else) the phase it says.
USER = "user"
LEFT_OUT = "-"


def _keep(frames: list[tuple[str, int, str]], frame: types.FrameType, kind: str,
          run: str) -> None:
    """Add ``frame`` (of ``kind``) to ``frames``; a frame saying the phase the frame kept
    before it said (``run``) takes its place: further out in the same phase."""
    code = frame.f_code
    entry = (code.co_filename, frame.f_lineno or 0, code.co_name)
    if kind != USER and kind == run:
        frames[-1] = entry
    else:
        frames.append(entry)


def frame_kind(frame: types.FrameType) -> str:
    """What the record does with ``frame``: keeps it as the user's (:data:`USER`), leaves it
    out (:data:`LEFT_OUT`: machinery that says no phase), or keeps it for the phase of
    training it says (the phase's name)."""
    if not is_machinery_frame(frame):
        return USER
    code = frame.f_code
    return torch_phase(code.co_filename, code.co_name) or LEFT_OUT


def segment(addr: int, size: int, frames: list[Frame]) -> Snapshot:
    """A segment of ``size`` bytes at ``addr`` wholly taken by one live block."""
    block = {"address": addr, "size": size, "requested_size": size,
             "state": "active_allocated", "frames": frames}
    return {"device": 0, "address": addr, "total_size": size, "allocated_size": size,
            "active_size": size, "requested_size": size, "stream": 0, "segment_type": "large",
            "segment_pool_id": (0, 0), "is_expandable": False, "frames": frames,
            "blocks": [block]}


def recording_now() -> bool | None:
    """Whether CUDA's caching allocator records an allocation history now (switched on by
    the program itself, before tracking), or ``None`` where this torch cannot say."""
    query = getattr(torch._C, "_cuda_isHistoryEnabled", None)
    if not callable(query):
        return None
    try:
        return bool(query())
    except Exception:  # a torch that refuses: as good as not knowing
        return None


class CudaHistory:
    """The CUDA caching allocator's own history: :meth:`start` switches recording on
    (``torch.cuda.memory._record_memory_history``, Python stacks, at most ``max_entries``
    entries), :meth:`stop` takes the snapshot (``torch.cuda.memory._snapshot``) and switches
    recording off.

    ``borrowed``: the program was recording already, and memsentry leaves its recording as
    it was. torch says whether a recording is on (``torch._C._cuda_isHistoryEnabled``, the
    caching allocator's ``record_history`` flag, which torch/_inductor/cudagraph_trees.py
    consults the same way before it records) but not with which settings: ``recordHistory``
    keeps its context, stacks, ``max_entries`` and skipped actions with no getter, and a
    snapshot's ``allocator_settings`` are PYTORCH_CUDA_ALLOC_CONF's, not the history's. And
    switching recording off empties the trace (c10/cuda/CUDACachingAllocator.cpp clears it
    when ``enabled`` is false). So a recording memsentry replaced could not be restored:
    memsentry never replaces one. A borrowed history is neither switched on nor off; its
    snapshot is the program's recording, with its settings and what it held before tracking.
    Tested against a fake of those functions; not yet run on a GPU."""

    def __init__(self, max_entries: int, *, borrowed: bool = False) -> None:
        self.max_entries = max_entries
        self.borrowed = borrowed
        self.recording = False

    def start(self) -> None:
        if not self.borrowed:
            torch.cuda.memory._record_memory_history(max_entries=self.max_entries,
                                                     stacks="python")
        self.recording = True

    def snapshot(self) -> Snapshot:
        """The allocator's snapshot now (recording goes on)."""
        return dict(torch.cuda.memory._snapshot())

    def stop(self) -> Snapshot:
        """The snapshot at the end; memsentry's own recording is switched off even when
        taking it fails (a borrowed one goes on)."""
        try:
            return self.snapshot()
        finally:
            self.recording = False
            if not self.borrowed:
                torch.cuda.memory._record_memory_history(enabled=None)
