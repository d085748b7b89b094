"""What a holder that tensor-accumulation reports keeps, in words, and the fix for it: the
notes its message adds (a function's cache, NumPy arrays, buffers, autograd nodes and graphs,
a mutable default argument, IPython's output history) and the advice that fits the holder."""

from __future__ import annotations

from memsentry.model import HolderKind, HolderStats
from memsentry.rules.series import base_name
from memsentry.units import format_bytes

#: Names under which IPython keeps cell results in a notebook's namespace.
IPYTHON_HISTORY = frozenset({"Out", "_oh", "_", "__", "___"})


def tensor_kept(last: HolderStats, base: str) -> tuple[str, str]:
    """What a holder growing with as many tensors keeps, and its fix."""
    tensors = f"{last.tensors:,} tensor{'s' if last.tensors != 1 else ''}"
    kept = (f"{tensors}: a tensor made larger every iteration (concatenated onto itself, or "
            "padded) keeps everything each step added")
    fix = (
        f"bound `{base}`: preallocate it and write in place (a ring buffer, "
        f"`{base}[i % k] = x`), or keep only the last rows (`{base} = torch.cat([{base}, "
        f"x])[-k:]`); move what must stay to the CPU (`.cpu()`) or to disk"
    )
    return kept, fix


def buffer_kept(last: HolderStats, base: str) -> tuple[str, str]:
    """What a holder growing with Python buffers and no tensor keeps, and its fix."""
    buffers = f"{last.buffers:,} Python buffer{'s' if last.buffers != 1 else ''}"
    kept = (f"no tensor but {buffers} (a bytearray, a memoryview or a DLPack capsule): a "
            "buffer extended every iteration keeps every byte each step added")
    fix = (f"bound `{base}`: drop what was used (`del {base}[:n]`, or `{base}.clear()` once "
           "written out), or write into a buffer of fixed size; move what must stay to disk")
    return kept, fix


def what_it_keeps(last: HolderStats, graphs_complete: bool) -> str:
    """The accumulation message's notes on what the holder is and keeps: a function's cache,
    a registry of modules, a tee, an optimizer's state, a context variable, tensors chained
    through an attribute, NumPy arrays, autograd nodes, tensors that carry graphs."""
    return (_cache_note(last) + _place_note(last) + _arrays_note(last) + _buffers_note(last)
            + _nodes_note(last) + _graphs_note(last, graphs_complete))


#: Modules that keep modules or parameters by position, as a holder's ``container`` names them.
MODULE_CONTAINERS = frozenset({"ModuleList", "ModuleDict", "ParameterList", "ParameterDict"})
#: How an optimizer's per-parameter state is spelled in a holder's path (``opt.state[p]...``).
OPTIMIZER_STATE = "state[p]"


def optimizer_key(last: HolderStats) -> str | None:
    """The key of an optimizer's per-parameter state the holder is, as written (``'history'``
    for ``opt.state[p]['history']``), or ``None``."""
    step = last.path[-1].name if last.path else ""
    return step[len(OPTIMIZER_STATE) + 1:-1] if step.startswith(OPTIMIZER_STATE + "[") \
        and step.endswith("]") else None


def context_variable(last: HolderStats) -> str | None:
    """The context variable whose value the holder is (``seen`` for ``seen.get()``), or
    ``None``."""
    root = last.root
    return root.removesuffix(".get()") if len(last.path) == 1 and root.endswith(".get()") \
        else None


def _place_note(last: HolderStats) -> str:
    """Where the holder keeps what it gains, when that is not a plain container."""
    if last.container in MODULE_CONTAINERS:
        return (f"; it is an `nn.{last.container}`: every module or parameter added stays "
                "registered with the model (`parameters()`, `state_dict()`, `.to()`) while the "
                "model lives" + _training_note(last.untrained))
    if last.container == "tee":
        return ("; it is a branch of `itertools.tee` that reads behind the others (or not at "
                "all): the tee keeps every item until each branch has read it")
    key = optimizer_key(last)
    if key is not None:
        return (f"; it is the optimizer's per-parameter state: `{key}` grows in the state of "
                "each parameter at every step")
    variable = context_variable(last)
    if variable is not None:
        return (f"; it is the value of the context variable `{variable}` "
                "(`contextvars.ContextVar`), which the running context keeps")
    if last.chained:
        return (f"; they are chained through a tensor attribute (`.{last.chained}`): each "
                "tensor keeps the one set on it, back to the first")
    return ""


def _training_note(untrained: int | None) -> str:
    """Whether an optimizer trains the parameters of a registry of modules, as the census
    found them in the optimizers' ``param_groups``."""
    if untrained is None:
        return ""
    if untrained == 0:
        return ("; every parameter under it is in an optimizer's `param_groups`, which "
                "keeps it too, with any state the optimizer has for it")
    return (f"; {untrained:,} parameter{'s' if untrained > 1 else ''} under it "
            f"{'are' if untrained > 1 else 'is'} in no optimizer's `param_groups`: no step "
            "trains them")


def _cache_note(last: HolderStats) -> str:
    if last.container != "lru_cache":
        return ""
    return (
        f"; it is the cache of `{base_name(last)}()` (`functools.lru_cache`/`cache`"
        f"{', unbounded' if last.bound is None else ''}), which keeps the arguments and "
        f"result of every call with new arguments: {last.items or 0:,} entries"
    )


def _arrays_note(last: HolderStats) -> str:
    if not last.arrays:
        return ""
    return (f"; {last.arrays:,} are NumPy arrays, counted with the memory they own or "
            "the tensor they view (`.numpy()` shares the tensor's storage)")


def _buffers_note(last: HolderStats) -> str:
    if not last.buffers:
        return ""
    return (f"; {last.buffers:,} are buffers (`bytearray`, `memoryview`, DLPack "
            "capsules not yet consumed), counted with the memory they hold")


def _nodes_note(last: HolderStats) -> str:
    """Autograd nodes kept by themselves, and their graph."""
    if not last.nodes:
        return ""
    note = (f"; {last.nodes:,} are autograd nodes kept by themselves (a `grad_fn`, a "
            f"custom Function's `ctx`), and with them their graph "
            f"({last.graph_nodes:,} nodes")
    if last.graph_saved_bytes:
        return note + f", {format_bytes(last.graph_saved_bytes)} saved for backward)"
    return note + "; backward() freed what they saved, the nodes stay in host memory)"


def _graphs_note(last: HolderStats, graphs_complete: bool) -> str:
    """Tensors that carry an autograd graph, and the graph's size where it was counted."""
    if not last.graph_tensors:
        return ""
    note = (f"; {last.graph_tensors:,} carry an autograd graph (grad_fn), which keeps "
            "their batch's graph")
    if not graphs_complete and not last.graph_nodes:
        return note + (" alive (too large to count within the census's time budget: its "
                       "nodes and saved tensors are not in the figures)")
    least = "" if graphs_complete else "at least "
    note += f" ({least}{last.graph_nodes:,} nodes"
    if last.graph_saved_bytes:
        note += f", {format_bytes(last.graph_saved_bytes)} saved for backward"
    return note + ") alive"


#: The fix for a holder of what it mostly keeps (``holders._noun``), when nothing more
#: particular applies.
_FIXES = {
    "model": (
        "keep results, not models: store the score and, for the best model only, a CPU copy "
        "of state_dict(); `del` the model and optimizer after each trial"
    ),
    "NumPy array": (
        "keep in `{base}` what you need of each array (a summary such as `float(a.mean())`, "
        "or a `.copy()` of the rows you use: a `.numpy()` view keeps its tensor's whole "
        "storage), write them to disk (`np.save`), and clear `{base}` each epoch or bound it "
        "with `collections.deque(maxlen=k)`"
    ),
    "buffer": (
        "keep in `{base}` only what you still need: a DLPack capsule keeps its tensor's "
        "memory until it is consumed (`torch.from_dlpack`) or dropped, a `memoryview` keeps "
        "the object it views; copy out the bytes you use (`bytes(view)`) and clear `{base}` "
        "each epoch or bound it with `collections.deque(maxlen=k)`"
    ),
    "autograd node": (
        "keep in `{base}` the values you need, not `grad_fn` or `ctx` objects: each keeps its "
        "graph and what it saved for backward until it is dropped; clear `{base}` once used"
    ),
}


def accumulation_fix(last: HolderStats, what: str, *, default: bool) -> str:
    """The fix for a holder that accumulates ``what`` (its ``_noun``); ``default``: it is a
    function's mutable default argument."""
    place = _place_fix(last)
    if place is not None:
        return place
    if default:
        return (
            "default the argument to `None` and make the container inside the function "
            "(`def f(..., kept=None)`, then `if kept is None: kept = []`), or pass it "
            "explicitly; store `.detach()`ed tensors or `.item()` numbers in it"
        )
    if last.modules:
        return _FIXES["model"]
    if what in _FIXES:
        return _FIXES[what].format(base=base_name(last))
    if last.graph_tensors and last.tensors and last.bytes <= 8 * last.tensors:
        return (  # scalars (losses, metrics): a detached one would still pile up a tensor
            "store Python numbers: `.item()` (a `.detach()`ed scalar still adds a tensor "
            "every step); clear the container each epoch or bound it with "
            "`collections.deque(maxlen=k)`"
        )
    base = base_name(last)
    if last.graph_tensors:
        return (
            "store `.detach()`ed tensors (or `.item()` for scalars), and run evaluation "
            f"under `torch.no_grad()`: that frees their graphs, but `{base}` still gains a "
            f"tensor each time, so also {_bound_words(last, base)}"
        )
    return (
        f"keep less in `{base}`: Python numbers (`.item()`, `.tolist()`) or a running "
        f"aggregate (a sum, a mean) instead of tensors; and {_bound_words(last, base)}. "
        "Copies moved to the CPU (`.cpu()`) free a GPU's memory, not the host's"
    )


def _bound_words(last: HolderStats, base: str) -> str:
    """How to bound a growing container, in words that work on its kind: a list keeps its
    slicing when trimmed in place; a deque cannot be sliced."""
    if last.container in (None, "list"):
        return (f"clear it each epoch or keep the last k (`del {base}[:-k]` after each "
                "append; a `collections.deque(maxlen=k)` bounds it too, but cannot be "
                f"sliced: `{base}[-1:]` becomes `list({base})[-1:]`)")
    return ("clear it each epoch or keep the last k (a `collections.deque(maxlen=k)`, or "
            "drop the oldest entry past k)")


def _place_fix(last: HolderStats) -> str | None:
    """The fix where the holder is a function's cache, IPython's output history, a registry
    of modules, a tee, an optimizer's state, a context variable or a chain of tensors;
    ``None`` for other holders."""
    base = base_name(last)
    if last.kind == HolderKind.PACKAGE:
        return (f"hand the package numbers (`.item()`) or `.detach().cpu()` copies, not the "
                f"step's tensors; empty `{last.name}` between epochs if the package allows "
                "it, or look in its documentation for a bound or an option that keeps less")
    if last.container == "lru_cache":
        return (
            f"bound the cache (`@functools.lru_cache(maxsize=k)`) or call "
            f"`{base}.cache_clear()` each epoch, and do not key it by what "
            "changes every step (the step, the batch); cache `.detach()`ed or CPU tensors"
        )
    if last.root in IPYTHON_HISTORY:
        return (
            "end such cells with `;` (or assign the result), drop kept results with "
            "`%reset -f out`, or turn the cache off (`%config InteractiveShell.cache_size = 0`)"
        )
    return _registry_fix(last, base)


def _registry_fix(last: HolderStats, base: str) -> str | None:
    """:func:`_place_fix` for registries of modules, tees, an optimizer's state, context
    variables and chains of tensors."""
    if last.container in MODULE_CONTAINERS:
        return (f"build `{base}` once, before the loop, and reuse its modules; a module tried "
                "for one step belongs in a local that goes out of scope, and one meant to be "
                "trained must be given to the optimizer (`opt.add_param_group`)")
    if last.container == "tee":
        return (f"read the branches of the tee together (`zip(...)`), or drop the branch that "
                f"is not read (`del {base}`); for a look-ahead of one item, keep the previous "
                "item yourself or use `itertools.pairwise`")
    key = optimizer_key(last)
    if key is not None:
        return (f"bound `{key}` in the optimizer's state: keep the last k entries "
                f"(`state[p].setdefault({key}, collections.deque(maxlen=k))`) or fold each "
                "step into a running value updated in place, and store `.detach()`ed tensors")
    variable = context_variable(last)
    if variable is not None:
        return (f"bound what `{variable}` keeps, or give it a fresh value each epoch "
                f"(`{variable}.set([])`), and keep `.item()` numbers or `.detach()`ed CPU "
                "copies in it")
    if last.chained:
        return (f"cut the chain: clear the attribute once it has been used (`x.{last.chained} "
                "= None`) or keep the last few tensors in a `collections.deque(maxlen=k)` "
                "instead of on each other")
    return None


def models_note(last: HolderStats) -> str:
    if not last.modules or last.container in MODULE_CONTAINERS:
        return ""  # a registry of modules says what it is in its own note
    return f"; {last.modules} of them are whole nn.Module objects"


def default_note(default: str | None) -> str:
    if default is None:
        return ""
    return ("; it is a mutable default argument, made once when the `def` ran and shared by "
            "every call, so it keeps what each call adds")


def history_note(last: HolderStats) -> str:
    if last.root not in IPYTHON_HISTORY:
        return ""
    return ("; this is IPython's output history, which keeps the result of every cell that "
            "ends with an expression (`del` and `torch.cuda.empty_cache()` do not free it)")


__all__ = [
    "IPYTHON_HISTORY",
    "MODULE_CONTAINERS",
    "OPTIMIZER_STATE",
    "accumulation_fix",
    "buffer_kept",
    "context_variable",
    "default_note",
    "history_note",
    "models_note",
    "optimizer_key",
    "tensor_kept",
    "what_it_keeps",
]
