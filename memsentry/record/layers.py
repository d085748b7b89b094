"""Per-layer accumulators and the names of modules, in first-call order.

Holds no tensor and no module strongly: modules are looked up through a ``WeakKeyDictionary``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from memsentry.measure.storage import storage_of
from memsentry.model import LayerStats

MAX_LAYERS = 5000
OVERFLOW_LAYER = "<other modules>"


def _max(current: int | None, value: int) -> int:
    return value if current is None or value > current else current


@dataclass(eq=False)
class LayerRecord:
    """Running figures of one layer; the worst forward (and backward) call is kept."""

    name: str
    type: str
    depth: int
    param_bytes: int
    calls: int = 0
    output_bytes: int | None = None
    saved_bytes: int | None = None
    forward_delta: int | None = None
    forward_peak: int | None = None
    backward_delta: int | None = None
    backward_peak: int | None = None
    backward_calls: int = 0
    is_leaf: bool = True
    index: int = 0  # the layer's place in first-call order
    measured: int = 0  # forward calls measured (some are only counted, see record.coverage)
    # Some of its calls may have run with none of memsentry's hooks on it (a light
    # iteration, a window without it): ``calls`` is then a lower bound.
    uncounted: bool = False
    # The module's own parameters (not its children's), weakly: their gradients are read
    # when its backward ends.
    own_params: list[weakref.ref[torch.Tensor]] = field(default_factory=list)

    def add_forward(self, delta: int | None, peak: int | None, output: int,
                    saved: int | None) -> None:
        """Fold in one forward call. The first call's deltas and peaks carry one-time set-up
        (thread pools, kernels' workspaces, lazily created buffers), so from the second call
        on they are replaced by the worst of the later calls."""
        self.calls += 1
        self.measured += 1
        if self.measured == 2:
            self.forward_delta = self.forward_peak = None
        if delta is not None and peak is not None:
            self.forward_delta = _max(self.forward_delta, delta)
            self.forward_peak = _max(self.forward_peak, peak)
        self.output_bytes = _max(self.output_bytes, output)
        if saved is not None:
            self.saved_bytes = _max(self.saved_bytes, saved)

    def add_backward(self, delta: int, peak: int) -> None:
        """Fold in one backward; as for the forward, the first is dropped once a second ran."""
        self.backward_calls += 1
        if self.backward_calls == 2:
            self.backward_delta = self.backward_peak = None
        self.backward_delta = _max(self.backward_delta, delta)
        self.backward_peak = _max(self.backward_peak, peak)

    def freeze(self) -> LayerStats:
        return LayerStats(
            name=self.name,
            type=self.type,
            depth=self.depth,
            calls=self.calls,
            param_bytes=self.param_bytes,
            output_bytes=self.output_bytes,
            saved_bytes=self.saved_bytes,
            forward_delta=self.forward_delta,
            forward_peak=self.forward_peak,
            backward_delta=self.backward_delta,
            backward_peak=self.backward_peak,
            backward_calls=self.backward_calls,
            is_leaf=self.is_leaf,
            measured_calls=self.measured,
            calls_complete=not self.uncounted,
        )


def storage_bytes(
    tensors: Iterable[torch.Tensor],
    seen: dict[int, int] | None = None,
    skip: Container[int] = frozenset(),
) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once; a
    DTensor counts its local shard; sparse, nested and other storage-less tensors count 0).

    ``seen`` (storage pointer -> bytes) is updated when given, so callers can de-duplicate
    across several calls; storages whose pointer is in ``skip`` are not counted.
    """
    seen = {} if seen is None else seen
    total = 0
    for tensor in tensors:
        found = storage_of(tensor)
        if found is None or found[0] in seen or found[0] in skip:
            continue
        key, size, _storage = found
        seen[key] = size
        total += size
    return total


def _param_bytes(module: nn.Module) -> int | None:
    """Bytes of the module's parameters, ``None`` while a lazy module's are uninitialized."""
    parameters: list[torch.Tensor] = list(module.parameters())
    if any(is_lazy(p) for p in parameters):
        return None
    return storage_bytes(parameters)


#: Wrappers that run the user's model as their ``module`` (layers are named without it).
DATA_PARALLEL = frozenset({"DistributedDataParallel", "DataParallel"})

#: Where torch.compile's ``OptimizedModule`` keeps the module it compiled.
COMPILED_ATTRIBUTE = "_orig_mod"


def compiled_original(module: nn.Module) -> nn.Module | None:
    """The module ``torch.compile`` wrapped, when ``module`` is its ``OptimizedModule``."""
    if type(module).__name__ != "OptimizedModule":
        return None
    original = module._modules.get(COMPILED_ATTRIBUTE)
    return original if isinstance(original, nn.Module) else None


def fully_sharded(module: nn.Module) -> bool:
    """Whether ``module`` is a unit of FSDP2 (``fully_shard``), whose hooks all-gather its
    parameters before its forward and free them after (by class: torch's import path for
    ``FSDPModule`` moved between versions, and memsentry does not import it)."""
    return any(klass.__name__ == "FSDPModule" and klass.__module__.startswith("torch.")
               for klass in type(module).__mro__)


def _data_parallel(root: nn.Module) -> bool:
    """Whether ``root`` is DDP's (or DataParallel's) wrapper of the user's model."""
    return type(root).__name__ in DATA_PARALLEL and isinstance(
        getattr(root, "module", None), nn.Module)


def _shown_name(root: nn.Module, qualified: str, wrapped: bool,
                compiled: nn.Module | None) -> str:
    """A submodule's qualified name as the user's model spells it: through DDP's and
    torch.compile's wrappers, and a scripted or traced root by its original class."""
    if wrapped:  # DDP's wrapper: the user's modules keep the names of their model
        if qualified == "module":
            return type(root.module).__name__
        return qualified.removeprefix("module.")
    if compiled is not None:  # torch.compile's wrapper: name the user's modules
        if not qualified:
            return f"{type(compiled).__name__} (compiled)"
        if qualified == COMPILED_ATTRIBUTE:
            return type(compiled).__name__
        return qualified.removeprefix(COMPILED_ATTRIBUTE + ".")
    if not qualified and isinstance(root, torch.jit.ScriptModule):
        how = "traced" if isinstance(root, torch.jit.TracedModule) else "scripted"
        return f"{getattr(root, 'original_name', 'ScriptModule')} ({how})"
    return qualified


class LayerRegistry:
    """Names modules and owns their records, in first-call order.

    With a model, names are those of ``model.named_modules()`` (the root is called by its
    class name). Without one, the first module called with no tracked module running is a
    root: it is named by its class and its submodules relative to it; a module called inside
    another that is not its submodule is named ``parent.<Type>``. A second root whose names
    another took is named by the variable that calls it (see :meth:`name_tree`); names still
    alike are made unique with ``#2``, ``#3``.
    """

    def __init__(self) -> None:
        # (name, depth, parameter bytes or None: read at the first call)
        self._names: weakref.WeakKeyDictionary[nn.Module, tuple[str, int, int | None]] = (
            weakref.WeakKeyDictionary()
        )
        self._by_module: weakref.WeakKeyDictionary[nn.Module, LayerRecord] = (
            weakref.WeakKeyDictionary()
        )
        self.records: dict[str, LayerRecord] = {}
        # Every module call went through the hooks until the global hooks first came off
        # (without a model): a layer first seen after that may have run before.
        self.unhooked = False
        self._taken: set[str] = set()
        self.static_storages: set[int] = set()
        self.sharded: set[str] = set()  # the layers that are FSDP2 units

    def _unique(self, name: str) -> str:
        if name not in self._taken:
            self._taken.add(name)
            return name
        k = 2
        while f"{name}#{k}" in self._taken:
            k += 1
        self._taken.add(f"{name}#{k}")
        return f"{name}#{k}"

    def name_tree(self, root: nn.Module, spelled: Callable[[], str | None] | None = None
                  ) -> None:
        """Give ``root`` and its submodules names (those already named keep theirs), and read
        their parameters' bytes now, before their own hooks run (at start, or from a global
        hook at the root's first call): FSDP2's hook swaps a module's sharded parameters
        (DTensors, counted by their local shard) for unsharded ones for its forward.

        A second root whose names another root took (a GAN's two ``main`` attributes) is
        named as the code spells it, when ``spelled`` finds that (``netG``), else by its class,
        and its submodules after it: ``netG.main``, not ``main#2``."""
        compiled = compiled_original(root)
        wrapped = _data_parallel(root)
        clash = self._clashes(root, wrapped, compiled)
        prefix = self._name_root(root, _shown_name(root, "", wrapped, compiled), clash, spelled)
        for qualified, module in root.named_modules():
            if module is root or module in self._names:
                continue
            shown = _shown_name(root, qualified, wrapped, compiled)
            depth = shown.count(".") + 1 if shown else 0
            if shown and clash:  # another root has attributes of these names
                shown = f"{prefix}.{shown}"
            self._names[module] = (self._unique(shown), depth, _param_bytes(module))

    def _name_root(self, root: nn.Module, shown: str, clash: bool,
                   spelled: Callable[[], str | None] | None) -> str:
        """Name ``root`` (unless it has a name), by ``shown`` or else its class; where its
        submodules' names or its own are taken, as the code spells it. Returns what its
        submodules' names start with where they clash with another root's."""
        named = self._names.get(root)
        if named is not None:
            return named[0]
        name = shown or type(root).__name__
        prefix: str | None = None
        if clash or name in self._taken:  # named as the code spells it
            prefix = (spelled() if spelled is not None else None) or name
            name = prefix if prefix not in self._taken else name
        self._names[root] = (self._unique(name), 0, _param_bytes(root))
        return prefix or self._names[root][0]

    def _clashes(self, root: nn.Module, wrapped: bool, compiled: nn.Module | None) -> bool:
        """Whether a submodule of ``root`` would take a name another root's took."""
        return any(_shown_name(root, qualified, wrapped, compiled) in self._taken
                   for qualified, _ in root.named_modules() if qualified)

    def record_for(self, module: nn.Module, parent: LayerRecord | None,
                   owner: Callable[[], nn.Module | None] | None = None,
                   spelled: Callable[[], str | None] | None = None) -> LayerRecord:
        """The record of ``module``, created (and named, if needed) on its first call.
        ``owner`` says, for an outermost call of a module no tree names yet, which module's
        own method called it (a model entered through ``self.forward()``): that module's tree
        is named, so that its layers are named as its attributes (``fc1``, not ``Linear``).
        ``spelled`` says the name the code calls it by (see :meth:`name_tree`)."""
        record = self._by_module.get(module)
        if record is not None:
            return record
        name, depth, params = self._named(module, parent, owner, spelled)
        if len(self.records) >= MAX_LAYERS:
            return self._overflow(module)
        return self._new_record(module, name, depth, params)

    def _named(self, module: nn.Module, parent: LayerRecord | None,
               owner: Callable[[], nn.Module | None] | None,
               spelled: Callable[[], str | None] | None) -> tuple[str, int, int | None]:
        """The name, depth and parameter bytes (``None``: read at the first call) of
        ``module``: those its tree gave it; for a module called inside another that does not
        hold it, ``parent.<Type>``; for an outermost one, those of its owner's tree or its own
        (named now)."""
        named = self._names.get(module)
        if named is not None:
            return named
        if parent is not None:
            named = (self._unique(f"{parent.name}.<{type(module).__name__}>"),
                     parent.depth + 1, None)
            self._names[module] = named
            return named
        holder = owner() if owner is not None else None
        if holder is not None and holder not in self._names:
            self.name_tree(holder)
        if module not in self._names:
            self.name_tree(module, spelled)
        return self._names[module]

    def _overflow(self, module: nn.Module) -> LayerRecord:
        """Past :data:`MAX_LAYERS` layers, every new module shares one record."""
        record = self.records.get(OVERFLOW_LAYER)
        if record is None:
            record = LayerRecord(OVERFLOW_LAYER, "various", 1, 0, index=MAX_LAYERS)
            self.records[OVERFLOW_LAYER] = record
        self._by_module[module] = record
        return record

    def _new_record(self, module: nn.Module, name: str, depth: int,
                    params: int | None) -> LayerRecord:
        """The record of a layer called for the first time; its parameters' and buffers'
        storages are static (not what a call allocates)."""
        if params is None:
            params = _param_bytes(module) or 0
        record = LayerRecord(name, type(module).__name__, depth, params, index=len(self.records),
                             own_params=[weakref.ref(p) for p in module.parameters(recurse=False)],
                             uncounted=self.unhooked)
        if fully_sharded(module):
            self.sharded.add(name)
        for tensor in (*module.parameters(), *module.buffers()):
            found = storage_of(tensor)
            if found is not None and found[0]:  # 0: freed (resized to 0 bytes) or none
                self.static_storages.add(found[0])
        self.records[name] = record
        self._by_module[module] = record
        return record

    def freeze(self) -> tuple[LayerStats, ...]:
        return tuple(record.freeze() for record in self.records.values() if record.calls)

    def by_index(self) -> dict[int, nn.Module]:
        """Each live module called so far, by its layer's number."""
        return {record.index: module for module, record in list(self._by_module.items())}

    def may_be_stale(self, module: nn.Module) -> bool:
        """Whether a call of ``module`` with calls on the stack may find stale ones: it is a
        module no tree names (a new model, under global hooks) or an outermost one."""
        record = self._by_module.get(module)
        if record is not None:
            return record.depth == 0
        return module not in self._names

    def name_of(self, module: nn.Module | None) -> str | None:
        """The name given to ``module`` (called or not), or ``None``."""
        named = self._names.get(module) if module is not None else None
        return named[0] if named is not None else None

    def record_of(self, module: nn.Module) -> LayerRecord | None:
        """The record of ``module`` if it was called, without creating one."""
        return self._by_module.get(module)

    def modules(self) -> list[tuple[str, nn.Module]]:
        """(name, module) of every module called so far that is still alive."""
        return [(record.name, module) for module, record in list(self._by_module.items())]

    def clear_modules(self) -> None:
        """Forget every module (names and records stay), so nothing refers to them."""
        self._names = weakref.WeakKeyDictionary()
        self._by_module = weakref.WeakKeyDictionary()
