"""Who holds what a test left behind: where to look (the test instance, its class, its module,
the wider-scoped fixtures still set up), one search for the largest leaked storages, and the
rows of the failure's table, the named ones first."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest

from memsentry.census import Root, find_holders
from memsentry.model import HeldTensor, HolderKind, Scope, ScopeKind, Step, StepKind
from memsentry.usercode.lines import short_path
from pytest_memsentry.cycles import kept_by_autograd
from pytest_memsentry.measurement import TOP, LeakedTensor
from pytest_memsentry.storages import LiveStorage, Storages

#: Seconds the holder search may take for all the listed tensors of one test together.
HOLDER_BUDGET = 1.0
#: Leaked storages, largest first, whose holders are searched for (those named are listed).
SEARCHED = 500


# -- where to look ---------------------------------------------------------------------------
def _wider_fixtures(item: pytest.Item) -> Iterator[tuple[str, str, Any]]:
    """(name, scope, value) of the item's fixtures wider than function scope that are still
    set up. Reads pytest's private fixture state, defensively."""
    try:
        definitions = item._fixtureinfo.name2fixturedefs  # type: ignore[attr-defined]
        for name, defs in definitions.items():
            fixturedef = defs[-1]
            cached = fixturedef.cached_result
            if fixturedef.scope != "function" and cached is not None and cached[2] is None:
                yield name, fixturedef.scope, cached[0]
    except Exception:
        return


def _path(*names: str) -> tuple[Step, ...]:
    return (Step(StepKind.ROOT, names[0]), *(Step(StepKind.ATTRIBUTE, n) for n in names[1:]))


def _instance_roots(item: pytest.Item) -> list[Root]:
    """The test instance (pytest keeps it until the session ends)."""
    instance = getattr(item, "instance", None)
    if instance is None:
        return []
    return [Root(_path("self"), instance, HolderKind.TEST_INSTANCE, None)]


def _class_roots(item: pytest.Item) -> list[Root]:
    """The test class's attributes."""
    cls = getattr(item, "cls", None)
    if cls is None:
        return []
    scope = Scope(ScopeKind.CLASS, cls.__qualname__)
    return [Root(_path(cls.__qualname__, name), value, HolderKind.CLASS_ATTRIBUTE, scope)
            for name, value in list(vars(cls).items()) if not name.startswith("__")]


def _module_roots(item: pytest.Item) -> list[Root]:
    """The test module's globals, in the scope of its file."""
    module = getattr(item, "module", None)
    if module is None:
        return []
    path = getattr(module, "__file__", None)
    scope = Scope(ScopeKind.SCRIPT, short_path(path)) if path \
        else Scope(ScopeKind.MODULE, module.__name__)
    return [Root(_path(name), value, HolderKind.GLOBAL, scope)
            for name, value in list(vars(module).items()) if not name.startswith("__")]


def _fixture_roots(item: pytest.Item) -> list[Root]:
    """The wider-scoped fixtures still set up."""
    return [Root(_path(f"fixture {name!r}"), value, HolderKind.FIXTURE,
                 Scope(ScopeKind.FIXTURE, scope))
            for name, scope, value in _wider_fixtures(item)]


def holder_roots(item: pytest.Item) -> list[Root]:
    """Where to look for what a test left behind, named as the test file spells it: the test
    instance (pytest keeps it until the session ends), the test class's attributes, the test
    module's globals and the wider-scoped fixtures still set up."""
    return [*_instance_roots(item), *_class_roots(item), *_module_roots(item),
            *_fixture_roots(item)]


# -- the rows of the table ---------------------------------------------------------------------
def _where(held: HeldTensor) -> str:
    """Where the holder lives, as the table says it."""
    if held.kind == HolderKind.TEST_INSTANCE:
        return "test instance; pytest keeps it until the session ends"
    if held.kind == HolderKind.FIXTURE:
        return f"{held.scope} fixture"
    if held.kind == HolderKind.GLOBAL and held.scope:
        return f"global in {held.scope.name}"
    return str(held.kind)


def _row(storage: LiveStorage, held: HeldTensor | None) -> LeakedTensor:
    """A row of the table: the storage, and the tensor that holds it with its holder when the
    search found one."""
    site = str(storage.site) if storage.site is not None else None
    if held is None:
        return LeakedTensor(storage.nbytes, storage.device, None, None, site)
    tensor = f"{held.dtype}[{', '.join(map(str, held.shape))}]"
    return LeakedTensor(storage.nbytes, storage.device, tensor, f"{held.name} ({_where(held)})",
                        site, grad_fn=held.grad_fn)


def _rows(shown: list[int], storages: Storages, held: dict[int, HeldTensor]
          ) -> tuple[LeakedTensor, ...]:
    """The rows of the ``shown`` storages; those the search did not reach may be named as
    kept by a cycle inside autograd's graph."""
    rows = [_row(storages[pointer], held.get(pointer)) for pointer in shown]
    unreached = [index for index, pointer in enumerate(shown) if pointer not in held]
    if unreached:
        rows = kept_by_autograd(rows, unreached, shown)
    return tuple(rows)


# -- one search ----------------------------------------------------------------------------------
class Listing(NamedTuple):
    """The largest leaked tensors with their holders (at most :data:`TOP`), how many more
    there were and their bytes, and whether the holder search finished within its budget."""

    tensors: tuple[LeakedTensor, ...]
    hidden: int
    hidden_bytes: int
    complete: bool


def largest_first(storages: Storages, devices: set[str]) -> list[int]:
    """The pointers of the storages on ``devices``, largest first (the first made first
    among equals)."""
    return sorted((pointer for pointer, s in storages.items() if s.device in devices),
                  key=lambda pointer: -storages[pointer].nbytes)


def named_first(searched: list[int], held: dict[int, HeldTensor]) -> list[int]:
    """``searched`` with those the search named first, each group in its order."""
    return sorted(searched, key=lambda pointer: pointer not in held)


def list_leaked(item: pytest.Item, storages: Storages, devices: set[str]) -> Listing:
    """One search for the holders of the largest :data:`SEARCHED` storages on ``devices``;
    the listing shows those it named first, so that a small tensor a global keeps (a loss
    history) is not hidden behind the larger ones its graph saved."""
    ranked = largest_first(storages, devices)
    searched = ranked[:SEARCHED]
    found, complete = find_holders(set(searched), holder_roots(item), budget=HOLDER_BUDGET)
    held = {h.storage: h for h in found}
    shown = named_first(searched, held)[:TOP]
    listed = set(shown)
    hidden = [*shown, *(pointer for pointer in ranked if pointer not in listed)][TOP:]
    return Listing(_rows(shown, storages, held), len(hidden),
                   sum(storages[pointer].nbytes for pointer in hidden), complete)


def search_notes(listing: Listing) -> list[str]:
    """The note for a holder search that ran out of time, or none."""
    if listing.complete:
        return []
    return [f"the holder search stopped after {HOLDER_BUDGET:g} s: some holders may be "
            "missing"]


__all__ = ["HOLDER_BUDGET", "SEARCHED", "Listing", "holder_roots", "list_leaked", "search_notes"]
