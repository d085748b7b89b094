"""What a census saw at an iteration boundary: holders of tensors, hooks, garbage; and the
forward calls whose graph no backward used."""

from __future__ import annotations

from dataclasses import dataclass, field

from memsentry.model.codec import SIGNED
from memsentry.model.kinds import HolderKind
from memsentry.model.places import Location, Scope, Step, spell
from memsentry.usercode.feeds import Feed


@dataclass(frozen=True)
class HolderStats:
    """Tensors reachable through one holder at a census (see :class:`Census`).

    ``path`` is how the user's code reaches the holder, as typed steps; ``name`` spells it
    (``total_loss``, ``self.history['loss']``, ``Block.saved``, ``fc.weight.grad``). ``kind``
    says where the path starts (a :class:`~memsentry.HolderKind`: a local, a global, a class
    attribute, the model, parameters' gradients); ``scope`` where that lives (``train() in
    train.py``); ``where`` the line that fills it, when found. ``items`` is the holder's length
    when it is a container (for gradients, how many parameters carry one). ``tensors`` and
    ``bytes`` count the tensors under it (each storage once per census), ``modules`` the
    ``nn.Module`` objects kept under it (their parameters are in ``bytes``); ``graph_tensors``
    those carrying a ``grad_fn``, ``graph_nodes`` the autograd nodes reachable from them and
    ``graph_saved_bytes`` the tensors those nodes keep for backward; ``graph_oldest`` and
    ``graph_newest`` are the autograd sequence numbers of its oldest and newest nodes (``None``
    when not read: a graph that outlives the census before it has an oldest node at or below
    that census's :attr:`Census.graph_newest`); ``graph_kept`` counts its nodes that were
    alive at the census before (numbers at or below that census's newest; ``None`` when not
    read). ``bound`` is the most
    items the container can hold (a ``deque``'s ``maxlen``), ``None`` when unbounded.
    ``shared_bytes``: of its ``bytes``, those another holder reaches too. ``arrays`` counts
    the NumPy arrays under it (their memory is in ``bytes``: a ``tensor.numpy()`` view as its
    tensor's storage), ``nodes`` the autograd nodes it keeps by themselves (a ``grad_fn``, a
    custom Function's ``ctx``: their graphs are in the ``graph_*`` figures), ``buffers`` the
    ``bytearray``, ``memoryview`` and unconsumed DLPack capsules (their memory is in
    ``bytes``). ``container`` is the holder's type when it is a container (``list``,
    ``dict``, ``deque``) or a function's cache (``lru_cache``: ``functools.lru_cache`` or
    ``functools.cache``), else ``None``. ``added`` is the expression the line at ``where``
    adds to the holder, as written (``errD`` in ``epoch_errD += errD``); ``rewrite``, when
    the line folds a tensor into the holder some other way (``ema = 0.9 * ema + 0.1 *
    loss``), that line adding a number instead; ``feed``, for an attribute filled inside a
    method of the user's class, the call that hands it the value (``losses.update(loss,
    n)``). ``rebound`` is ``True`` where the code binds the holder to a fresh value at that
    line or earlier in the step (``x = torch.randn(n, 16)``, ``for x in loader``, ``outs =
    []``): what it holds follows the step's input and nothing of the step before;
    ``False`` where that line builds it from itself or grows it in place (``bank =
    torch.cat([bank, x])``, ``preds.append(y)``); ``None`` where neither was read.
    ``chained`` names the tensor attribute through which its tensors keep others (``prev``
    for ``out.prev = last``), ``None`` when none does. ``untrained``, for a registry of
    modules or parameters (``nn.ModuleList``...), how many of the parameters under it are in
    the ``param_groups`` of no optimizer the census met; ``None`` when it met none.
    """

    path: tuple[Step, ...]
    kind: HolderKind
    scope: Scope | None
    where: Location | None
    items: int | None
    tensors: int
    bytes: int
    graph_tensors: int = 0
    graph_nodes: int = 0
    graph_saved_bytes: int = 0
    graph_oldest: int | None = None
    graph_newest: int | None = None
    graph_kept: int | None = None
    modules: int = 0
    bound: int | None = None
    shared_bytes: int = 0
    arrays: int = 0
    nodes: int = 0
    buffers: int = 0
    container: str | None = None
    added: str | None = None
    rewrite: str | None = None
    feed: Feed | None = None
    rebound: bool | None = None
    chained: str | None = None
    untrained: int | None = None

    @property
    def name(self) -> str:
        """The path as code spells it."""
        return spell(self.path)

    @property
    def root(self) -> str:
        """The name the path starts from: ``logger`` for ``logger.history['loss']``."""
        return self.path[0].name if self.path else ""

    @property
    def held(self) -> int:
        """What it keeps, counted: tensors, whole models, NumPy arrays, autograd nodes and
        byte buffers."""
        return self.tensors + self.modules + self.arrays + self.nodes + self.buffers


@dataclass(frozen=True)
class HolderLength:
    """How many items a container kept at the iteration boundaries after a census found it
    growing: its length read again at each boundary memsentry closed, by following its
    ``path`` (``name``) from its root, with no census (a few lookups). ``items`` is its length
    at the last boundary read (``until``), which it had since the boundary ``since``;
    ``first`` is the first boundary read. ``pause`` is the most iterations it kept one
    length before that (a leak that grows in bursts pauses between them), ``spacing`` the
    most iterations between two readings (a pause shorter than that could go unseen)."""

    path: tuple[Step, ...]
    items: int
    since: int
    until: int
    first: int
    pause: int = 0
    spacing: int = 0

    @property
    def name(self) -> str:
        """The path as code spells it."""
        return spell(self.path)

    @property
    def still(self) -> int:
        """The iterations it has kept its last length, as read."""
        return self.until - self.since


#: The ``module`` of the :class:`HookStats` that counts the callbacks registered with
#: :mod:`atexit` (no module of a model can be named so).
EXIT_REGISTRY = "<atexit>"


@dataclass(frozen=True)
class HookStats:
    """User hooks registered on one module (``module=None``: registered globally;
    :data:`EXIT_REGISTRY`: the callbacks registered with :mod:`atexit`), memsentry's
    own left out. ``hook`` names the newest hook function, ``where`` its definition and
    ``registered`` the line that registers it (``None`` where no such line was found)."""

    module: str | None
    count: int
    hook: str | None = None
    where: Location | None = None
    registered: Location | None = None


@dataclass(frozen=True)
class GarbageStats:
    """What the census's own garbage collection found: objects kept only by reference cycles.

    ``objects`` and ``tensors`` count the unreachable objects found in the young generation,
    ``bytes`` the storage of those tensors, ``freed`` the allocated memory the collection gave
    back. ``types`` are the most frequent types among them (the cycle's members), most first.
    ``gc_enabled`` is whether the automatic collector was on; ``full_collections`` and
    ``full_freed`` count the automatic full collections since the previous census and the
    memory they freed.
    """

    objects: int
    tensors: int
    bytes: int
    freed: int = field(metadata=SIGNED)
    types: tuple[tuple[str, int], ...] = ()
    gc_enabled: bool = True
    full_collections: int = 0
    full_freed: int = field(default=0, metadata=SIGNED)


@dataclass(frozen=True)
class Census:
    """Who held tensors at one iteration boundary: taken after warm-up and then at growing
    intervals, within a time budget. ``complete`` is false when the budget ran out before every
    holder was found; ``graphs_complete`` is false when the autograd graphs behind the holders
    were too large to walk in their share of it (their node and saved-byte figures are then
    lower bounds, the holders' own figures are whole). ``carried`` names the census this one
    repeats when none was taken: as it was due to begin, memory stood where it stood when that
    census ran (within the heap's jitter) and no hook was added or removed, so its holders are
    those of ``carried`` and its ``garbage`` is ``None`` (no collection ran). ``graph_newest``
    is the highest autograd sequence number among the graphs its holders keep (``None``: no
    graph, or not read): a graph at a later census whose oldest node is at or below it was
    already alive at this one. ``closing``: taken as tracking ended, after the last iteration
    (a holder still growing at the census before would otherwise be judged on censuses that
    stopped well before the end); the functions that ran the loop may have returned, so a
    holder it does not see is unknown there, not emptied."""

    iteration: int
    seconds: float
    complete: bool
    objects: int
    holders: tuple[HolderStats, ...] = ()
    hooks: tuple[HookStats, ...] = ()
    garbage: GarbageStats | None = None
    graphs_complete: bool = True
    carried: int | None = None
    graph_newest: int | None = None
    closing: bool = False


@dataclass(frozen=True)
class UnusedGraph:
    """Forward calls of an outermost module, run with autograd on, whose graph no backward ever
    used. ``saved_bytes`` is the most one call saved for backward (``None`` when not measured),
    ``eval_calls`` how many of the calls ran in ``eval()`` mode, ``where`` the caller's line
    (with its function), ``unwatched`` how many calls of the module memsentry did not watch
    (in light iterations, to keep its budget): whether their graphs were used is unknown."""

    module: str
    calls: int
    eval_calls: int
    saved_bytes: int | None
    where: Location | None = None
    unwatched: int = 0


@dataclass(frozen=True)
class HeldTensor:
    """A tensor found by a search for given storages: the ``path`` that reaches it (``name``
    spells it: ``CACHE['warm'][3]``, ``TestModel.outputs[0]``), what the tensor is and which
    storage it matched."""

    path: tuple[Step, ...]
    kind: HolderKind
    scope: Scope | None
    shape: tuple[int, ...]
    dtype: str
    device: str
    bytes: int
    grad_fn: bool
    storage: int = 0  # the storage's data pointer, one of those searched for

    @property
    def name(self) -> str:
        return spell(self.path)


__all__ = ["Census", "GarbageStats", "HeldTensor", "HolderStats", "HookStats", "Location",
           "Scope", "Step", "UnusedGraph", "spell"]
