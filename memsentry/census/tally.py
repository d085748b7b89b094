"""What a census walk counts as it goes: each holder's tensors, arrays, buffers, nodes and
bytes (every storage once, through the :class:`StorageLedger`), each container's length; or,
in a search for given storages, the tensors found with their paths."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from memsentry.census.buffers import CAPSULE, buffer_memory, dlpack_memory
from memsentry.census.children import array_memory
from memsentry.census.ledger import StorageLedger
from memsentry.measure.storage import storage_of
from memsentry.model import HeldTensor, HolderKind, Scope, Step


class SourceHint(NamedTuple):
    """Where to look for the line that fills a holder: the ``name`` it is spelled by, the
    ``files`` to search, the first line of the function to search in (``None``: the whole
    file) and a line to fall back on. (A tuple: one is made per attribute walked.)"""

    name: str
    files: tuple[str, ...] = ()
    function_line: int | None = None
    fallback_line: int | None = None


@dataclass(eq=False)
class Holder:
    """A holder's running counts during one walk."""

    path: tuple[Step, ...]
    kind: HolderKind
    scope: Scope | None
    hint: SourceHint
    items: int | None = None
    bound: int | None = None
    tensors: int = 0
    bytes: int = 0
    modules: int = 0
    graph_tensors: int = 0
    shared_bytes: int = 0
    arrays: int = 0
    nodes: int = 0
    buffers: int = 0
    container: str | None = None
    chained: str | None = None  # the tensor attribute that keeps other tensors
    registered: list[int] = field(default_factory=list)  # ids of a registry's parameters
    grad_fns: list[Any] = field(default_factory=list)  # where its tensors' graphs begin


class Item:
    """One object waiting in the walk's queue, with the holder it belongs to."""

    __slots__ = ("depth", "frozen", "hint", "kind", "obj", "path", "scope")

    def __init__(self, obj: Any, path: tuple[Step, ...], kind: HolderKind, scope: Scope | None,
                 hint: SourceHint, depth: int, frozen: bool) -> None:
        self.obj, self.path, self.kind, self.scope = obj, path, kind, scope
        self.hint, self.depth, self.frozen = hint, depth, frozen


def storage_key(tensor: torch.Tensor) -> tuple[tuple[str, int], int] | None:
    """((device, storage pointer), storage bytes), or ``None`` for storage-less tensors (a
    DTensor: its local shard's; a storage FSDP resized to 0 bytes: ((device, 0), 0))."""
    found = storage_of(tensor)
    return None if found is None else ((str(tensor.device), found[0]), found[1])


class Tally:
    """The counts of one walk. With ``targets`` (storage pointers) it records only the
    tensors whose storage is one of them, as :class:`HeldTensor` with their full paths."""

    def __init__(self, static: set[int], targets: set[int] | None) -> None:
        self.targets = targets
        self.found: list[HeldTensor] = []
        self.ledger = StorageLedger(static)
        self.holders: dict[tuple[Step, ...], Holder] = {}
        #: Each container holder's length, bound and kind (``list``, ``deque``, ``lru_cache``).
        self.items: dict[tuple[Step, ...], tuple[int, int | None, str]] = {}
        #: The ids of the parameters in the ``param_groups`` of the optimizers met, ``None``
        #: until one is met.
        self.optimized: set[int] | None = None

    def holder(self, item: Item) -> Holder:
        holder = self.holders.get(item.path)
        if holder is None:
            items, bound, container = self.items.get(item.path, (None, None, None))
            holder = self.holders[item.path] = Holder(
                item.path, item.kind, item.scope, item.hint, items, bound, container=container
            )
        return holder

    def container(self, path: tuple[Step, ...], length: int, bound: int | None,
                  kind: str) -> None:
        """A container holder's length, its bound and its type, as last met."""
        self.items[path] = (length, bound, kind)
        holder = self.holders.get(path)
        if holder is not None:
            holder.items, holder.bound = length, bound

    def count_bytes(self, tensor: torch.Tensor, *, parameters: bool = False,
                    holder: Holder | None = None) -> int:
        """The storage's bytes the first time it is met (see :class:`StorageLedger`)."""
        key = storage_key(tensor)
        if key is None:
            return 0
        return self.ledger.count(key[0], key[1], holder, parameters=parameters)

    def tensor(self, item: Item, tensor: torch.Tensor) -> None:
        if self.targets is not None:
            self._match(item, tensor)
        elif not isinstance(tensor, nn.Parameter):
            holder = self.holder(item)
            holder.tensors += 1
            holder.bytes += self.count_bytes(tensor, holder=holder)
            if tensor.grad_fn is not None:
                holder.graph_tensors += 1
                holder.grad_fns.append(tensor.grad_fn)

    def module_container(self, item: Item, container: nn.Module) -> None:
        """A ``ModuleList``, ``ModuleDict``, ``ParameterList`` or ``ParameterDict``: its
        length, the modules or parameters it keeps, and the bytes of the parameters under it
        that are not the tracked model's own (those made after tracking began)."""
        listed = isinstance(container, nn.ParameterList | nn.ParameterDict)
        length = len(container._parameters if listed else container._modules)
        self.container(item.path, length, None, type(container).__name__)
        holder = self.holder(item)
        if listed:
            holder.tensors += length
        else:
            holder.modules += length
        parameters = list(container.parameters())
        holder.registered = [id(p) for p in parameters]
        holder.bytes += sum(self.count_bytes(p, holder=holder) for p in parameters)

    def optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer met in the walk: the parameters it trains."""
        if self.optimized is None:
            self.optimized = set()
        for group in list(getattr(optimizer, "param_groups", None) or ()):
            params = group.get("params", ()) if isinstance(group, dict) else ()
            self.optimized.update(id(p) for p in params)

    def untrained(self, holder: Holder) -> int | None:
        """How many of a registry's parameters no optimizer met holds; ``None`` when the walk
        met no optimizer, or the holder is no registry of parameters."""
        if self.optimized is None or not holder.registered:
            return None
        return sum(1 for p in holder.registered if p not in self.optimized)

    def chained(self, item: Item, attribute: str) -> None:
        """A tensor of the holder keeps another tensor as its attribute ``attribute``
        (``out.prev = last``): the first such attribute met is the holder's."""
        holder = self.holder(item)
        if holder.chained is None:
            holder.chained = attribute

    def model(self, item: Item, module: nn.Module) -> None:
        """A whole model kept in a container: counted with its parameters."""
        holder = self.holder(item)
        holder.modules += 1
        holder.bytes += sum(self.count_bytes(p, parameters=True) for p in module.parameters())

    def array(self, item: Item, array: Any) -> None:
        """A NumPy array: the tensor it views (``tensor.numpy()``) is counted as that tensor's
        storage; memory it owns is counted by its address, so that a tensor made from it
        (``torch.from_numpy``) is not counted twice."""
        tensor, address, size = array_memory(array)
        if self.targets is not None:
            if tensor is not None:
                self._match(item, tensor)
            return
        holder = self.holder(item)
        holder.arrays += 1
        if tensor is not None:
            holder.bytes += self.count_bytes(tensor, holder=holder)
        elif address:
            holder.bytes += self.ledger.count(("cpu", address), size, holder)

    def buffer(self, item: Item, obj: Any) -> None:
        """A ``bytearray``, a ``memoryview`` or an unconsumed DLPack capsule: the memory it
        holds, counted once (a view of a NumPy array is counted as that array)."""
        if isinstance(obj, CAPSULE):
            found = dlpack_memory(obj) if self.targets is None else None
        else:
            viewed, key, size = buffer_memory(obj)
            if viewed is not None:
                self.array(item, viewed)
                return
            found = (key, size) if key is not None and self.targets is None else None
        if found is None:
            return
        key, size = found
        holder = self.holder(item)
        holder.buffers += 1
        holder.bytes += self.ledger.count(key, size, holder)

    def node(self, item: Item, node: Any) -> None:
        """An autograd node kept by itself (a ``grad_fn``, a custom Function's ``ctx``): its
        graph and the tensors it saved for backward are counted with the holder's graphs."""
        if self.targets is None:
            holder = self.holder(item)
            holder.nodes += 1
            holder.grad_fns.append(node)

    def _match(self, item: Item, tensor: torch.Tensor) -> None:
        key = storage_key(tensor)
        assert self.targets is not None
        if key is None or key[0][1] not in self.targets or not self.ledger.claim(key[0]):
            return
        self.found.append(
            HeldTensor(
                path=item.path, kind=item.kind, scope=item.scope,
                shape=tuple(tensor.shape), dtype=str(tensor.dtype).removeprefix("torch."),
                device=str(tensor.device), bytes=key[1], grad_fn=tensor.grad_fn is not None,
                storage=key[0][1],
            )
        )
