"""Reading a snapshot file of PyTorch's caching allocator into frozen values, running nothing
the file names.

The format is the dict ``torch.cuda.memory._snapshot()`` returns, as documented in its
docstring (torch/cuda/memory.py) and built in torch/csrc/cuda/memory_snapshot.cpp:
``segments`` (each with its ``blocks`` and their ``frames``), ``device_traces`` (one list of
trace entries per device, each an ``action`` with ``addr``, ``size``, ``stream``, ``frames``
and, from torch 2.1, ``time_us``; an ``oom`` entry has ``device_free``) and, from torch 2.2,
``allocator_settings``. Only dicts, lists, tuples, strings, numbers, booleans and ``None``
appear in it, so the unpickler admits nothing else: a file that asks for a class or a
function (how a pickle runs code) is refused before anything it names is looked up.

A snapshot may be large (several KB an entry, gigabytes for a long recording): the file's
size is checked against a limit before reading, and reading is one pass over the file and one
over what it held.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO, NamedTuple, cast

from memsentry.errors import MemsentryError
from memsentry.model.reading import NotRegularFile, open_regular
from memsentry.units import format_bytes

#: The largest file read unless the caller allows more (``--max-snapshot-size``): a file
#: takes several times its size in memory once read.
DEFAULT_LIMIT = 2 * 2**30

#: Values a snapshot's ``allocator_settings`` may hold.
_PLAIN = (str, int, float, bool, type(None))


class SnapshotError(MemsentryError, ValueError):
    """A file could not be read as an allocator snapshot; ``str()`` says why and what to do,
    in one line."""


@dataclass(frozen=True, slots=True, eq=False)
class Frame:
    """One frame of the Python stack that asked for memory (innermost first in a stack).
    Frames of one snapshot are read once each (equal ones are the same value), so they
    compare and hash by identity: a stack of them hashes in a few nanoseconds a frame."""

    filename: str
    line: int
    name: str


@dataclass(frozen=True, slots=True)
class Block:
    """A piece of a segment: in use by a tensor (``active_allocated``), waiting for another
    stream (``active_pending_free``; the docstring of ``_snapshot`` says
    ``active_awaiting_free``, the allocator writes this) or cached for reuse (``inactive``).
    ``size`` is the block's, rounded; ``requested`` what was asked for."""

    address: int
    size: int
    requested: int
    state: str
    frames: tuple[Frame, ...]

    @property
    def allocated(self) -> bool:
        return self.state == "active_allocated"


@dataclass(frozen=True, slots=True)
class Segment:
    """Memory the allocator got from the device (a ``cudaMalloc``), cut into blocks."""

    device: int
    address: int
    total_size: int
    allocated_size: int
    stream: int
    segment_type: str
    expandable: bool | None
    blocks: tuple[Block, ...]


class Event(NamedTuple):
    """One entry of a device's trace (a named tuple, not a dataclass: a trace has millions of
    entries, and a frozen dataclass takes four times as long to make): ``alloc``,
    ``free_requested``, ``free_completed``,
    ``segment_alloc``, ``segment_free``, ``segment_map``, ``segment_unmap``, ``oom`` or
    ``snapshot`` (others, from later torches, are kept and passed over). ``size`` is the bytes
    requested (an ``oom``'s is rounded); ``address`` is ``None`` where the entry has none
    (``oom``); ``time_us`` where the torch that wrote it did not record times (before 2.2);
    ``device_free`` is an ``oom``'s. ``frames`` is empty where no stack was recorded: the
    backward's allocations, made on autograd's worker thread, have no Python frames."""

    action: str
    address: int | None
    size: int
    stream: int
    frames: tuple[Frame, ...]
    time_us: int | None = None
    device_free: int | None = None


@dataclass(frozen=True, slots=True)
class AllocatorSnapshot:
    """What one snapshot file holds: the segments alive when it was taken, each device's
    trace (``traces[i]`` is device ``i``'s) and the allocator's settings; for a snapshot
    ``track(snapshot=...)`` recorded on the CPU, ``device_type`` is ``"cpu"`` and
    ``iteration_ends`` the index of each iteration's last trace entry, ``dropped`` the older
    entries its bound let go (``None``: not said, as in torch's own snapshots) and
    ``phases`` whether its stacks keep torch's frames that say the phase of training."""

    path: str
    file_bytes: int
    segments: tuple[Segment, ...]
    traces: tuple[tuple[Event, ...], ...]
    settings: tuple[tuple[str, str | int | float | bool | None], ...] = ()
    device_type: str = "cuda"
    iteration_ends: tuple[int, ...] | None = None
    dropped: int | None = None
    phases: bool = False

    def trace(self, device: int) -> tuple[Event, ...]:
        """``device``'s trace (empty where the file has none for it)."""
        return self.traces[device] if device < len(self.traces) else ()

    def device_name(self, index: int) -> str:
        """``cuda:0``; ``cpu`` for the snapshots memsentry records on the CPU."""
        return self.device_type if self.device_type == "cpu" else f"{self.device_type}:{index}"

    @property
    def devices(self) -> tuple[int, ...]:
        """The devices with a trace or a segment."""
        found = {segment.device for segment in self.segments}
        found.update(index for index, trace in enumerate(self.traces) if trace)
        return tuple(sorted(found))

    def setting(self, name: str) -> str | int | float | bool | None:
        return dict(self.settings).get(name)


class _PlainUnpickler(pickle.Unpickler):
    """Admits the plain types only: every class or function a pickle asks for (``GLOBAL``,
    ``STACK_GLOBAL``, the extension registry's ``EXT`` codes all come here) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise SnapshotError(
            f"it asks to load `{module}.{name}`, which an allocator snapshot never does (it "
            "holds only dicts, lists, strings and numbers); memsentry runs nothing a file "
            "names, so it stopped there. Open only snapshots you or torch wrote")

    def persistent_load(self, pid: Any) -> Any:
        raise SnapshotError("it refers to objects outside the file (a persistent id), which "
                            "an allocator snapshot never does; memsentry stopped there")


def is_pickle(path: str) -> bool:
    """Whether the file at ``path`` starts as a pickle of protocol 2 or later does (a report
    saved as JSON starts with ``{``); ``False`` when it cannot be read or is not a regular
    file (a FIFO would wait for a writer: the report's reader refuses it)."""
    if not os.path.isfile(path):
        return False
    try:
        with open(path, "rb") as file:
            return file.read(1) == b"\x80"
    except OSError:
        return False


def read_snapshot(path: str, *, limit: int = DEFAULT_LIMIT) -> AllocatorSnapshot:
    """The snapshot in the file at ``path``. Raises :class:`SnapshotError` when the file is
    missing, not a regular file (a FIFO is refused before it is opened: it could block),
    larger than ``limit`` bytes, not a pickle, asks for anything but plain types, or does
    not hold a snapshot's fields."""
    try:
        handle, size = open_regular(path)
    except FileNotFoundError:
        raise SnapshotError(f"no such file: {path!r}") from None
    except NotRegularFile as error:
        raise SnapshotError(f"{path}: is {error.kind}, not a snapshot; give the file "
                            "torch.cuda.memory._dump_snapshot() wrote") from None
    except OSError as error:
        raise SnapshotError(f"{path}: cannot read it ({error.strerror or error})") from None
    with handle:
        _refuse_larger(path, size, limit)
        data = _load(handle, path)
    return snapshot_of(data, path=path, file_bytes=size)


def _load(handle: BinaryIO, path: str) -> object:
    """What the pickle in ``handle`` holds, read by :class:`_PlainUnpickler`."""
    try:
        return _PlainUnpickler(handle).load()
    except SnapshotError as error:
        raise SnapshotError(f"{path}: refused: {error}") from None
    except OSError as error:
        raise SnapshotError(f"{path}: cannot read it ({error.strerror or error})") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError,
            KeyError, MemoryError, RecursionError) as error:
        raise SnapshotError(
            f"{path}: not a readable pickle ({type(error).__name__}: {str(error)[:120]}); a "
            "file cut short (a job killed while writing it) reads so: write it again "
            "(torch.cuda.memory._dump_snapshot(), or memsentry's --snapshot)") from None


def _refuse_larger(path: str, size: int, limit: int) -> None:
    if size > limit:
        raise SnapshotError(
            f"{path}: {format_bytes(size)}, past the {format_bytes(limit)} memsentry reads "
            f"(a snapshot takes several times its size in memory once read); raise the limit "
            f"with --max-snapshot-size {size} if this machine has the memory")


def snapshot_of(data: object, *, path: str = "<snapshot>", file_bytes: int = 0
                ) -> AllocatorSnapshot:
    """The snapshot a dict as ``torch.cuda.memory._snapshot()`` returns holds (raises
    :class:`SnapshotError` naming the first field that is not as the format has it)."""
    top = _mapping(data, path, "the file")
    if "segments" not in top and "device_traces" not in top:
        raise SnapshotError(f"{path}: a pickle, but not of an allocator snapshot (no "
                            "`segments` nor `device_traces`); give a file written by "
                            "torch.cuda.memory._dump_snapshot()")
    frames = _Frames(path)
    segments = tuple(_segment(item, frames, f"segments[{i}]", path)
                     for i, item in enumerate(_list(top.get("segments", []), path, "segments")))
    traces = tuple(_trace(trace, frames, d, path) for d, trace in
                   enumerate(_list(top.get("device_traces", []), path, "device_traces")))
    return AllocatorSnapshot(path=path, file_bytes=file_bytes, segments=segments,
                             traces=traces, settings=_settings(top.get("allocator_settings"),
                                                               path),
                             device_type=_device_type(top.get("memsentry")),
                             iteration_ends=_iteration_ends(top.get("memsentry"), path),
                             dropped=_dropped(top.get("memsentry")),
                             phases=_phases(top.get("memsentry")))


def _device_type(marks: object) -> str:
    """The device a snapshot memsentry wrote names (``cpu``); ``cuda`` for torch's own."""
    device = marks.get("device") if isinstance(marks, dict) else None
    return device if device == "cpu" else "cuda"


def _phases(marks: object) -> bool:
    """Whether memsentry's record keeps torch's frames that say the phase (its CPU records
    keep them since they say so; earlier ones kept the user's frames only)."""
    return isinstance(marks, dict) and marks.get("phases") is True


def _dropped(marks: object) -> int | None:
    dropped = marks.get("dropped") if isinstance(marks, dict) else None
    return dropped if type(dropped) is int and dropped >= 0 else None


def _iteration_ends(marks: object, path: str) -> tuple[int, ...] | None:
    """Where memsentry's iterations ended in the trace, when it recorded the snapshot."""
    ends = marks.get("iteration_ends") if isinstance(marks, dict) else None
    if ends is None:
        return None
    return tuple(_int(end, path, f"memsentry.iteration_ends[{i}]")
                 for i, end in enumerate(_list(ends, path, "memsentry.iteration_ends")))


class _Frames:
    """Frames and stacks read so far. A frame repeated in thousands of stacks is one value,
    and so is a stack: torch's pickle shares each frame's dict between the entries that hold
    it, so a dict met before is known by its identity and read once (the file's objects stay
    alive while it is read)."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._known: dict[tuple[str, int, str], Frame] = {}
        self._seen: dict[int, tuple[object, Frame]] = {}
        self._stacks: dict[tuple[Frame, ...], tuple[Frame, ...]] = {}
        # the identities of a stack's frame dicts -> the stack (the dicts are kept in _seen)
        self._by_ids: dict[tuple[int, ...], tuple[Frame, ...]] = {}

    def stack(self, value: object, field: Field) -> tuple[Frame, ...]:
        """The stack of ``value`` (a list of frame dicts, or ``None``); ``field`` names it
        for an error (:func:`_name`)."""
        if value is None:
            return ()
        if type(value) is not list:
            _list(value, self._path, _name(field))
        ids = tuple(map(id, value))  # type: ignore[call-overload]
        stack = self._by_ids.get(ids)
        if stack is None:
            stack = self._read(value, field)  # type: ignore[arg-type]
            self._by_ids[ids] = stack
        return stack

    def _read(self, value: list[object], field: Field) -> tuple[Frame, ...]:
        """A stack first met (its frame dicts, by their identities, in this order)."""
        seen = self._seen
        found: list[Frame] = []
        for item in value:
            known = seen.get(id(item))
            found.append(known[1] if known is not None else
                         self._frame(item, f"{_name(field)}[{len(found)}]"))
        stack = tuple(found)
        return self._stacks.setdefault(stack, stack)

    def _frame(self, item: object, where: str) -> Frame:
        entry = _mapping(item, self._path, where)
        key = (_text(entry.get("filename", "??"), self._path, f"{where}.filename"),
               _int(entry.get("line", 0), self._path, f"{where}.line"),
               _text(entry.get("name", "??"), self._path, f"{where}.name"))
        frame = self._known.get(key)
        if frame is None:
            frame = self._known[key] = Frame(*key)
        self._seen[id(item)] = (item, frame)
        return frame


#: A field's name, or where a trace entry's stack is: (device, index of the entry).
Field = str | tuple[int, int]


def _name(field: Field) -> str:
    if isinstance(field, str):
        return field
    device, index = field
    return f"device_traces[{device}][{index}].frames"


def _trace(value: object, frames: _Frames, device: int, path: str) -> tuple[Event, ...]:
    entries = _list(value, path, f"device_traces[{device}]")
    return tuple(_event(entry, frames, (device, index), path)
                 for index, entry in enumerate(entries))


def _segment(value: object, frames: _Frames, field: str, path: str) -> Segment:
    entry = _mapping(value, path, field)
    blocks = tuple(_block(item, frames, f"{field}.blocks[{i}]", path)
                   for i, item in enumerate(_list(entry.get("blocks", []), path,
                                                  f"{field}.blocks")))
    expandable = entry.get("is_expandable")
    return Segment(
        device=_int(entry.get("device", 0), path, f"{field}.device"),
        address=_int(entry.get("address", 0), path, f"{field}.address"),
        total_size=_int(entry.get("total_size", 0), path, f"{field}.total_size"),
        allocated_size=_int(entry.get("allocated_size", 0), path, f"{field}.allocated_size"),
        stream=_int(entry.get("stream", 0), path, f"{field}.stream"),
        segment_type=_text(entry.get("segment_type", ""), path, f"{field}.segment_type"),
        expandable=expandable if isinstance(expandable, bool) else None,
        blocks=blocks)


def _block(value: object, frames: _Frames, field: str, path: str) -> Block:
    entry = _mapping(value, path, field)
    size = _int(entry.get("size", 0), path, f"{field}.size")
    return Block(
        address=_int(entry.get("address", 0), path, f"{field}.address"), size=size,
        requested=_int(entry.get("requested_size", size), path, f"{field}.requested_size"),
        state=_text(entry.get("state", ""), path, f"{field}.state"),
        frames=frames.stack(entry.get("frames"), f"{field}.frames"))


_INT_OR_NONE = (int, type(None))


def _event(value: object, frames: _Frames, at: tuple[int, int], path: str) -> Event:
    """The trace entry ``at`` (device, index): read at once where every field has its type
    (nearly always: a trace has millions), else field by field, to name the one that does
    not."""
    if type(value) is dict:
        get = value.get
        action, address, size, stream = (get("action"), get("addr"), get("size", 0),
                                          get("stream", 0))
        time_us, device_free = get("time_us"), get("device_free")
        if _plain(action, size, stream) and type(address) in _INT_OR_NONE \
                and type(time_us) in _INT_OR_NONE and type(device_free) in _INT_OR_NONE:
            return Event(cast(str, action), address, size, stream,
                         frames.stack(get("frames"), at), time_us, device_free)
    return _checked_event(value, frames, _name(at).removesuffix(".frames"), path)


def _plain(action: object, size: object, stream: object) -> bool:
    return type(action) is str and type(size) is int and type(stream) is int


def _checked_event(value: object, frames: _Frames, field: str, path: str) -> Event:
    entry = _mapping(value, path, field)
    address = entry.get("addr")
    time_us = entry.get("time_us")
    device_free = entry.get("device_free")
    return Event(
        action=_text(entry.get("action"), path, f"{field}.action"),
        address=None if address is None else _int(address, path, f"{field}.addr"),
        size=_int(entry.get("size", 0), path, f"{field}.size"),
        stream=_int(entry.get("stream", 0), path, f"{field}.stream"),
        frames=frames.stack(entry.get("frames"), f"{field}.frames"),
        time_us=None if time_us is None else _int(time_us, path, f"{field}.time_us"),
        device_free=None if device_free is None else _int(device_free, path,
                                                          f"{field}.device_free"))


def _settings(value: object, path: str
              ) -> tuple[tuple[str, str | int | float | bool | None], ...]:
    """The allocator's settings, those with plain values (others are left out)."""
    if value is None:
        return ()
    entry = _mapping(value, path, "allocator_settings")
    return tuple((str(key), item) for key, item in entry.items() if isinstance(item, _PLAIN))


def _mapping(value: object, path: str, field: str) -> Mapping[str, object]:
    if not isinstance(value, dict):
        raise SnapshotError(f"{path}: {field} is {_kind(value)} where the snapshot format has "
                            "a dict; give a file written by torch.cuda.memory._dump_snapshot()")
    return value


def _list(value: object, path: str, field: str) -> list[object] | tuple[object, ...]:
    if not isinstance(value, list | tuple):
        raise SnapshotError(f"{path}: {field} is {_kind(value)} where the snapshot format has "
                            "a list; give a file written by torch.cuda.memory._dump_snapshot()")
    return value


def _int(value: object, path: str, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SnapshotError(f"{path}: {field} is {_kind(value)} where the snapshot format has "
                            "an integer")
    return value


def _text(value: object, path: str, field: str) -> str:
    if not isinstance(value, str):
        raise SnapshotError(f"{path}: {field} is {_kind(value)} where the snapshot format has "
                            "a string")
    return value


def _kind(value: object) -> str:
    shown = repr(value)
    return f"{type(value).__name__} {shown[:40]}{'...' if len(shown) > 40 else ''}"


__all__ = ["DEFAULT_LIMIT", "AllocatorSnapshot", "Block", "Event", "Frame", "Segment",
           "SnapshotError", "is_pickle", "read_snapshot", "snapshot_of"]
