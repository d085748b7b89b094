"""Running totals of the four parts of a training step's memory: parameters, gradients,
optimizer state and activations (saved for backward), read where they change.

- Parameters (the tracked model's, or the outermost modules' without one, and every
  optimizer's) and optimizer state are enumerated at iteration boundaries: they change in an
  optimizer step, which a boundary follows.
- Gradients are enumerated at the start of each iteration's first forward (after
  ``zero_grad``), at the end of each backward pass and at boundaries; in between, the end of
  a measured layer's backward adds the gradients of that layer's own parameters.
- Activations are counted as autograd saves and frees them: each tensor saved inside a
  module's forward is packed in a :class:`Saved`, whose release (when autograd frees the
  graph node that kept it) takes its bytes off, storage by storage.

When measuring every layer call costs more than ``track(overhead=...)`` allows, the parts are
read only in the iterations whose outermost call is measured (its saved-tensor hooks see
every op then); the other iterations carry that reading.

Every storage counts once, in the first of parameters, gradients, optimizer state that has
it. Only weak references to modules, parameters and optimizers are kept.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

import torch
from torch import nn

from memsentry.model import Breakdown
from memsentry.record.budget import PARTS
from memsentry.record.coverage import Coverage
from memsentry.record.layers import LayerRecord, storage_bytes

Keys = dict[int, int]  # storage pointer -> bytes


def _nothing() -> None:
    """A dead weak reference's answer."""
    return None


class LiveSaved:
    """Bytes of the storages saved for backward that autograd still keeps.

    Each counted :class:`Saved` is watched through a weak reference whose callback is a list's
    ``append``: when autograd frees the pack, only C code runs (no Python frame, so a
    ``KeyboardInterrupt`` or any other exception can never be raised, and lost, inside a
    finaliser of memsentry's). The dead packs are taken off when the total is next read.
    """

    __slots__ = ("_dead", "_refs", "_total", "_watched")

    def __init__(self) -> None:
        self._refs: dict[int, list[int]] = {}  # pointer -> [packs alive, bytes]
        self._total = 0
        self._watched: dict[int, tuple[weakref.ref[Saved], int]] = {}  # id(ref) -> ref, key
        self._dead: list[weakref.ref[Saved]] = []  # filled by the weak references' callback

    def add(self, key: int, size: int, packed: Saved) -> None:
        entry = self._refs.get(key)
        if entry is None:
            self._refs[key] = [1, size]
            self._total += size
        else:
            entry[0] += 1
        ref = weakref.ref(packed, self._dead.append)
        self._watched[id(ref)] = (ref, key)

    @property
    def total(self) -> int:
        if self._dead:
            self._settle()
        return self._total

    def _settle(self) -> None:
        """Take off the packs autograd freed since the last reading."""
        dead, watched = self._dead, self._watched
        while dead:
            watch = watched.pop(id(dead.pop()), None)
            if watch is not None:
                self.release(watch[1])

    def release(self, key: int) -> None:
        entry = self._refs.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] <= 0:
            del self._refs[key]
            self._total -= entry[1]


class Saved:
    """What the saved-tensor hook packs: the saved tensor and its version. A saved output
    (``node``: the name of the node that saved it and its output number) is kept as a
    detached alias, which does not keep that node alive; an input or a leaf is kept as it is,
    as torch keeps it without hooks. When its storage counts as an activation,
    :class:`LiveSaved` watches it weakly."""

    __slots__ = ("__weakref__", "node", "tensor", "version")

    def __init__(self, tensor: torch.Tensor, version: int,
                 node: tuple[str, int] | None = None) -> None:
        self.tensor = tensor
        self.version = version
        self.node = node


class Parts:
    """The four parts now. The parameters that count are the tracked ``model``'s, or without
    one those of the outermost modules called; optimizers are added as they step."""

    def __init__(self, model: nn.Module | None) -> None:
        self._model = weakref.ref(model) if model is not None else None
        self._outermost: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._last_optimizer: Callable[[], torch.optim.Optimizer | None] = _nothing
        self._params: list[weakref.ref[torch.Tensor]] = []
        self.live = LiveSaved()
        self.param_keys: Keys = {}
        self.grad_keys: Keys = {}
        self.state_keys: Keys = {}
        self.parameters = self.gradients = self.optimizer_state = 0
        # Whether the running iteration reads the parts: when layers are measured in turn
        # (record.coverage), only iterations whose outermost call is measured do; the others
        # carry the last reading (``fresh``: that breakdown, its iteration, and the bytes of
        # the parts' storages the backend did not count then).
        self.due = True
        self.fresh: tuple[Breakdown, int, int] | None = None

    @property
    def activations(self) -> int:
        return self.live.total

    def _top_modules(self) -> list[nn.Module]:
        """The tracked model, or without one the outermost modules called so far."""
        if self._model is not None:
            model = self._model()
            return [model] if model is not None else []
        return list(self._outermost)

    def begin(self, coverage: Coverage, module: nn.Module, root: LayerRecord | None, *,
              first: bool) -> None:
        """An outermost call of ``module``, whose layer is ``root`` (``None``: its first
        call). Without a tracked model, a module new among the outermost ones brings its
        parameters in. At the iteration's ``first`` call (after ``zero_grad()``): whether the
        iteration reads the parts (its outermost call is measured), and if so the gradients
        left from the last one."""
        if self._model is None and module not in self._outermost:
            self._outermost.add(module)
            self._params = []  # read everything again, this module's parameters with it
        if not first:
            return
        self.due = root is None or coverage.reads_parts(root.index)
        if self.due:
            started = coverage.clock()
            if self._params:
                self.read_gradients()
            else:  # no parameters known yet (global hooks before the first call): all of it
                self.read_all()
            coverage.count(started, PARTS)

    def add_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if self._last_optimizer() is not optimizer:  # at every step: a weak set add is dear
            self._optimizers.add(optimizer)
            self._last_optimizer = weakref.ref(optimizer)

    # -- reading ---------------------------------------------------------------------------
    def read_all(self) -> None:
        """Enumerate parameters, gradients and optimizer state (at a boundary)."""
        params = known_parameters(self._top_modules(), list(self._optimizers))
        self._params = [weakref.ref(p) for p in params.values()]
        self.param_keys = {}
        self.parameters = storage_bytes(params.values(), self.param_keys)
        self.read_gradients(list(params.values()))
        tensors = state_tensors(list(self._optimizers))
        self.state_keys = {}
        self.optimizer_state = storage_bytes(tensors, self.state_keys,
                                             skip=self.param_keys.keys() | self.grad_keys.keys())

    def read_gradients(self, params: list[torch.Tensor] | None = None) -> None:
        """Enumerate the gradients of the parameters read at the last boundary."""
        if params is None:
            params = [p for p in (ref() for ref in self._params) if p is not None]
        self.grad_keys = {}
        self.gradients = storage_bytes([p.grad for p in params if p.grad is not None],
                                       self.grad_keys, skip=self.param_keys)

    def add_gradients(self, params: Iterable[weakref.ref[torch.Tensor]]) -> None:
        """A layer's backward ended: count its own parameters' gradients made since."""
        grads = [grad for param in (ref() for ref in params)
                 if param is not None and (grad := param.grad) is not None]
        self.gradients += storage_bytes(grads, self.grad_keys, skip=self.param_keys)

    def outside(self, counted: Callable[[int], bool]) -> int:
        """Bytes of the storages of the four parts that the backend does not count (the
        storage-counting backend counts only storages made while tracking)."""
        return sum(size for keys in (self.param_keys, self.grad_keys, self.state_keys)
                   for key, size in keys.items() if not counted(key))


def known_parameters(modules: Iterable[nn.Module], optimizers: Iterable[torch.optim.Optimizer]
                     ) -> dict[int, torch.Tensor]:
    """The distinct parameters of the ``modules`` and of the optimizers' groups, by ``id``, in
    the order first met."""
    params: dict[int, torch.Tensor] = {}
    param: torch.Tensor
    for module in modules:
        for param in module.parameters():
            params.setdefault(id(param), param)
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for param in group.get("params", ()):
                if isinstance(param, torch.Tensor):
                    params.setdefault(id(param), param)
    return params


def state_tensors(optimizers: Iterable[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """The tensors of the optimizers' state: each parameter's dict of them (or a lone
    tensor)."""
    return [value for optimizer in optimizers
            for per_param in list(optimizer.state.values())
            for value in (per_param.values() if isinstance(per_param, dict) else (per_param,))
            if isinstance(value, torch.Tensor)]


__all__ = ["LiveSaved", "Parts", "Saved"]
