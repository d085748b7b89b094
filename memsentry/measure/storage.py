"""CPU memory counted storage by storage: a dispatch mode that sees every ATen op.

``StorageBackend`` (``track(exact=True)``, and the fallback where glibc is absent or its
counters are slow) counts each new tensor storage once, views included, until the storage is
freed. It knows the true peak inside ops, at a cost of about 1.2x on a training step. The
pytest plugin uses :class:`StorageCounter` directly, with the line that made each storage.
Given a :class:`~memsentry.measure.history.History`, the counter also records each storage
made and freed for PyTorch's memory_viz (``track(snapshot=...)``).
"""

from __future__ import annotations

import collections
import sys
import types
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import memsentry.measure.jitaside as jitaside
from memsentry.measure.base import Passive
from memsentry.measure.cpu import physical_memory
from memsentry.measure.history import History
from memsentry.model import Measured, PeakMode
from memsentry.usercode.frames import site_location, user_line
from memsentry.usercode.location import Location


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds ``tensor``'s bytes in this process: a DTensor's local
    shard (the DTensor's own storage is a placeholder that raises when read), else itself."""
    while type(tensor) is not torch.Tensor:
        local = getattr(tensor, "_local_tensor", None)
        if not isinstance(local, torch.Tensor) or local is tensor:
            break
        tensor = local
    return tensor


def storage_of(tensor: torch.Tensor) -> tuple[int, int, torch.UntypedStorage] | None:
    """(data pointer, bytes, storage) of the storage behind ``tensor`` in this process (a
    DTensor's local shard), or ``None`` where there is none to read: sparse and nested
    layouts, wrapper subclasses. A storage freed by resizing it to 0 bytes (FSDP's unsharded
    parameters between uses) reads as pointer 0, 0 bytes. Never raises for a tensor (a
    subclass's ``__torch_function__`` may raise anything: a lazy module's uninitialized
    parameter raises ``ValueError``)."""
    try:
        if type(tensor) is not torch.Tensor:
            tensor = local_tensor(tensor)
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes(), storage
    except Exception:
        return None


def storage_pointer(tensor: torch.Tensor) -> int:
    """The data pointer of the tensor's storage (0 where there is none to read). Read for
    every input of every op in the dispatch mode: plain tensors and parameters take the
    short way (a DTensor's placeholder storage raises, and is read through its shard)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except Exception:
        found = storage_of(tensor)
        return 0 if found is None else found[0]


_LIFT_FRESH = torch.ops.aten.lift_fresh.default


def tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors in an op's arguments or results: a tensor, or lists, tuples and dicts of
    them (what ATen ops take and return); a third of the time of a general pytree flatten."""
    if isinstance(value, torch.Tensor):
        return [value]
    found: list[torch.Tensor] = []
    if isinstance(value, list | tuple):
        for item in value:
            if isinstance(item, torch.Tensor):
                found.append(item)
            elif isinstance(item, list | tuple | dict):
                found += tensors_of(item)
    elif isinstance(value, dict):
        found += tensors_of(list(value.values()))
    return found


_WRAPPED_NUMBER = "Expected a value of type 'Tensor' for argument"


def _numbers_as_tensors(func: Any, args: Any, kwargs: dict[str, Any]
                        ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The op's arguments with each Python number its schema declares a Tensor made a
    0-dimensional tensor."""
    def fixed(value: Any, kind: Any) -> Any:
        if isinstance(kind, torch.TensorType) and isinstance(value, bool | int | float):
            return torch.tensor(value)
        return value

    schema = func._schema.arguments
    new_args = tuple(fixed(value, schema[i].type) if i < len(schema) else value
                     for i, value in enumerate(args))
    kinds = {argument.name: argument.type for argument in schema}
    new_kwargs = {name: fixed(value, kinds.get(name)) for name, value in kwargs.items()}
    return new_args, new_kwargs


def _input_storages(func: Any, args: Any, kwargs: dict[str, Any]) -> set[int]:
    """The storages of an op's inputs. Views and in-place results share an input's storage:
    not new memory, and when the input predates tracking it belongs to the baseline."""
    if func is _LIFT_FRESH:  # torch.tensor(data): the storage was made just before
        return set()
    pointers = set()
    for value in args:  # most arguments are tensors and numbers: read those here
        if type(value) is torch.Tensor:
            pointers.add(storage_pointer(value))
        elif isinstance(value, torch.Tensor | list | tuple | dict):
            pointers.update(storage_pointer(t) for t in tensors_of(value))
    if kwargs:
        pointers.update(storage_pointer(t) for t in tensors_of(kwargs))
    return pointers


def _run_op(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """Run one op. TorchScript passes a number it keeps as a tensor (a traced shape check's
    ``aten::equal``) to a Python mode as a Python number, which the op then refuses before
    running. Given back as the 0-dimensional tensor it was, the op runs."""
    try:
        return func(*args, **kwargs)
    except RuntimeError as error:
        if _WRAPPED_NUMBER not in str(error):
            raise
        args, kwargs = _numbers_as_tensors(func, args, kwargs)
        return func(*args, **kwargs)


class _CountingMode(TorchDispatchMode):
    """A dispatch mode that steps aside while torch.compile traces and compiles (Dynamo
    refuses to compile under other dispatch modes): it sees the eager ops around compiled
    code, not the kernels inside it (read by torch 2.8 and newer)."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __enter__(self) -> Any:
        entered = super().__enter__()
        jitaside.enter(_CountingMode)  # and steps aside for torch.jit.trace
        return entered

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            jitaside.leave()


class StorageCounter(_CountingMode):
    """Counts the bytes of tensor storages created by ops while the mode is active; ``live``
    maps the CPU storages still alive to their size. With ``sites``, also remembers the user's
    line that created each one (``None`` when no user code was on the stack), for leak
    reports. With ``other_devices``,
    ``device_live`` also maps the storages made on other devices (CUDA) that are still alive
    to (device, bytes, the user's code and line number); :attr:`device_sites` gives them with
    the line as a location. They stay out of the CPU figures. With a ``history`` (set at
    any time, ``None`` to stop), every CPU storage made and freed is recorded into it."""

    def __init__(self, *, sites: bool = False, other_devices: bool = False) -> None:
        super().__init__()
        self._live: dict[int, int] = {}
        # The user's line that made each storage, as code and line number: made a
        # Location only when read (:attr:`sites`).
        self._lines: dict[int, tuple[types.CodeType, int] | None] | None = (
            {} if sites else None)
        self.history: History | None = None
        self.device_live: dict[int, tuple[str, int, tuple[types.CodeType, int] | None]] | None = (
            {} if other_devices else None
        )
        self._current = 0
        self.peak = 0
        # Freed storages are queued by weak references whose callback is a list's ``append``
        # (C code only: nothing of memsentry's runs in a finaliser, where an exception, a
        # Ctrl-C among them, would be printed and lost) and taken off before the next count.
        self._watched: dict[int, tuple[weakref.ref[Any], int, bool]] = {}
        self._freed: collections.deque[weakref.ref[Any]] = collections.deque()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        return self.dispatch(func, args, kwargs)

    @property
    def current(self) -> int:
        """Bytes of the CPU storages made while counting and still alive."""
        self.settle()
        return self._current

    @property
    def sites(self) -> dict[int, Location | None] | None:
        """The user's line that made each CPU storage still alive (with ``sites``), else
        ``None``."""
        if self._lines is None:
            return None
        self.settle()
        return {key: site_location(line) for key, line in self._lines.items()}

    @property
    def device_sites(self) -> dict[int, tuple[str, int, Location | None]]:
        """The storages on other devices still alive (with ``other_devices``): pointer ->
        (device, bytes, the user's line that made it); empty without."""
        self.settle()
        return {key: (device, size, site_location(line))
                for key, (device, size, line) in (self.device_live or {}).items()}

    @property
    def live(self) -> dict[int, int]:
        """The CPU storages made while counting and still alive: pointer -> bytes."""
        self.settle()
        return self._live

    def settle(self) -> None:
        """Take the storages freed since the last count off it, in the order they died."""
        freed, watched = self._freed, self._watched
        while freed:
            watch = watched.pop(id(freed.popleft()), None)
            if watch is None:
                continue
            _ref, key, on_device = watch
            if on_device:
                if self.device_live is not None:
                    self.device_live.pop(key, None)
            else:
                self._free(key)

    def _watch(self, storage: Any, key: int, on_device: bool) -> None:
        ref = weakref.ref(storage, self._freed.append)
        self._watched[id(ref)] = (ref, key, on_device)

    def in_thread(self) -> ThreadCounter:
        """A mode to enter in another thread (dispatch modes are per thread) that counts into
        this counter."""
        return ThreadCounter(self)

    def dispatch(self, func: Any, args: Any, kwargs: Any) -> Any:
        """Run one op and count the storages it made."""
        kwargs = kwargs or {}
        inputs = _input_storages(func, args, kwargs)
        out = _run_op(func, args, kwargs)
        if self._freed:  # before counting: a new storage may take a freed one's address
            self.settle()
        self._count(out, inputs)
        return out

    def _count(self, out: Any, inputs: set[int]) -> None:
        """Count the new storages among an op's results: those on the CPU, and those on other
        devices when they are counted too."""
        for leaf in [out] if type(out) is torch.Tensor else tensors_of(out):
            if leaf.is_cpu:
                self._see(leaf, inputs)
            elif self.device_live is not None:
                self._see_device(leaf, inputs)

    @staticmethod
    def _new_storage(tensor: torch.Tensor, inputs: set[int],
                     known: dict[int, Any]) -> tuple[int, int, Any] | None:
        """(pointer, bytes, storage) when ``tensor``'s storage is new: not an input's, not
        known."""
        found = storage_of(tensor)
        if found is None or found[0] == 0 or found[0] in known or found[0] in inputs:
            return None  # sparse and other storage-less layouts, freed or known storages
        return found

    def _see(self, tensor: torch.Tensor, inputs: set[int]) -> None:
        new = self._new_storage(tensor, inputs, self._live)
        if new is None:
            return
        key, size, storage = new
        self._live[key] = size
        if self._lines is not None:
            self._lines[key] = user_line(sys._getframe(1))
        if self.history is not None:
            self.history.alloc(key, size)
        self._current += size
        if self._current > self.peak:
            self.peak = self._current
        self._watch(storage, key, False)

    def _see_device(self, tensor: torch.Tensor, inputs: set[int]) -> None:
        assert self.device_live is not None
        new = self._new_storage(tensor, inputs, self.device_live)
        if new is None:
            return
        key, size, storage = new
        self.device_live[key] = (str(tensor.device), size, user_line(sys._getframe(1)))
        self._watch(storage, key, True)

    def _free(self, key: int) -> None:
        size = self._live.pop(key, 0)
        self._current -= size
        if self._lines is not None:
            self._lines.pop(key, None)
        if self.history is not None and size:
            self.history.free(key, size)


class ThreadCounter(_CountingMode):
    """A :class:`StorageCounter`'s stand-in on another thread: counts into it while
    ``counting`` is set, and only runs the ops after that (a thread may outlive the
    measurement it was started in)."""

    def __init__(self, parent: StorageCounter) -> None:
        super().__init__()
        self.parent = parent
        self.counting = True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if self.counting:
            return self.parent.dispatch(func, args, kwargs)
        return func(*args, **(kwargs or {}))


class StorageBackend(Passive):
    """Exact CPU backend: every tensor storage created while tracking, counted once."""

    name = "cpu-storages"
    peak_mode = PeakMode.EXACT
    measured = Measured.TENSORS
    notes: tuple[str, ...] = (
        "CPU figures count tensor storages created while tracking (a dispatch mode sees "
        "every op); storages that existed before tracking began are the baseline.",
    )

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self._counter = StorageCounter()
        self._active = False

    def sample(self) -> tuple[int, int | None]:
        self._counter.settle()
        return self._counter.current, self.peak_since_last_read()

    def allocated(self) -> int:
        self._counter.settle()
        return self._counter.current

    def counts(self, key: int) -> bool:
        """Whether the storage at pointer ``key`` is in the count (made while tracking)."""
        self._counter.settle()
        return key in self._counter.live

    def reserved(self) -> int | None:
        return None

    def record_history(self, history: History | None) -> None:
        """Record every storage made and freed from now on into ``history`` (memory_viz's
        trace), or stop recording (``None``)."""
        self._counter.history = history

    def live_storages(self) -> dict[int, int]:
        """The storages made while tracking and still alive: pointer -> bytes."""
        self._counter.settle()
        return dict(self._counter.live)

    def peak_since_last_read(self) -> int | None:
        peak = self._counter.peak
        self._counter.peak = self._counter.current
        return peak

    def total_memory(self) -> int | None:
        return physical_memory()

    def stats(self) -> dict[str, Any]:
        self._counter.settle()
        return {"live_storages": len(self._counter.live), "current": self._counter.current}

    def start(self) -> None:
        if not self._active:
            self._counter.__enter__()
            self._active = True

    def stop(self) -> None:
        if self._active:
            self._counter.__exit__(None, None, None)
            self._active = False
