"""``reference-cycle`` on reports built by hand: tensors found among the unreachable objects
of the censuses' collections, at two censuses at least, are owned by reference cycles: waste
while the garbage collector runs or `gc.collect()` calls free them, a leak when it is disabled
and nothing does."""

from __future__ import annotations

from builders import MiB, censuses, check, garbage, report

from memsentry.model import Finding, GarbageStats, Severity, SubjectKind
from memsentry.rules.cycles import MIN_SIGHTINGS

RULE = "reference-cycle"
AT = [4, 8]
NODES = (("Node", 6), ("Tensor", 3))


def _cycles(*found: GarbageStats | None, at: list[int] = AT) -> list[Finding]:
    return check(RULE, report(censuses=censuses(at, garbage=list(found))))


def test_cycles_owning_tensors_with_the_collector_on_are_waste_with_the_rate_they_pile_up() -> None:
    """Three tensors (3 MiB) in a cycle at iterations 4 and 8: they wait for the collector,
    and pile up by 3 MiB over the 4 iterations between censuses."""
    cycle = garbage(tensors=3, bytes=3 * MiB, types=NODES)
    (finding,) = _cycles(cycle, cycle)
    assert (finding.rule, finding.severity) == (RULE, Severity.WASTE)
    assert finding.subject is not None
    assert (finding.subject.kind, finding.subject.name) == (SubjectKind.TYPE, "Node")
    assert finding.bytes == 3 * MiB and finding.objects == 3 and finding.iteration == 8
    assert finding.rate == 3 * MiB / 4
    assert ("reference cycles owned 3 tensors (3.0 MiB) at iteration 8, found at 2 of 2 "
            "censuses; only the garbage collector frees them") in finding.message
    assert "The unreachable objects are Node (6), Tensor (3)" in finding.message
    assert "memory rises until the collector runs, then drops (a sawtooth)" in finding.message
    assert "weakref.ref" in finding.fix and "do not capture `self`" in finding.fix


def test_cycles_with_the_collector_disabled_are_a_leak() -> None:
    """``gc.disable()`` in the host application: nothing ever frees them."""
    cycle = garbage(tensors=2, bytes=MiB, types=NODES, gc_enabled=False)
    (finding,) = _cycles(cycle, cycle)
    assert finding.severity is Severity.LEAK
    assert "the garbage collector is disabled, so nothing frees them" in finding.message
    assert ("with gc disabled, call `gc.collect()` every few iterations: each call frees the "
            "cycles made since the one before, so they no longer pile up, but memory still "
            "rises between calls (waste, not a leak) until the cycle is broken") in finding.fix


def test_cycles_freed_by_gc_collect_calls_with_the_collector_disabled_are_waste() -> None:
    """``gc.disable()`` and ``gc.collect()`` every few steps, as the leak's fix says: the
    calls free the cycles since the census before (2 MiB), so they wait for the next call,
    and the fix no longer asks for the calls."""
    before = garbage(tensors=2, bytes=MiB, types=NODES, gc_enabled=False)
    collected = garbage(tensors=2, bytes=MiB, types=NODES, gc_enabled=False,
                        full_freed=2 * MiB)
    (finding,) = _cycles(before, collected)
    assert finding.severity is Severity.WASTE
    assert finding.message.endswith(
        "; `gc.collect()` calls freed 2.0 MiB meanwhile: the garbage collector is disabled, "
        "so only those calls free them: memory rises until the next one, then drops "
        "(a sawtooth)")
    assert "gc.collect()" not in finding.fix
    assert finding.fix.startswith("break the cycle: give back-references as `weakref.ref`")


def test_cycles_no_call_freed_since_the_census_before_are_a_leak_again() -> None:
    """One ``gc.collect()`` early on, none since: nothing frees the cycles now."""
    collected = garbage(tensors=2, bytes=MiB, types=NODES, gc_enabled=False,
                        full_freed=2 * MiB)
    since = garbage(tensors=2, bytes=MiB, types=NODES, gc_enabled=False)
    (finding,) = _cycles(collected, since)
    assert finding.severity is Severity.LEAK
    assert ("the garbage collector is disabled, and no `gc.collect()` call freed them since "
            "the census before, so nothing frees them now") in finding.message
    assert "with gc disabled, call `gc.collect()` every few iterations" in finding.fix


def test_tensors_kept_on_ctx_of_a_custom_function_get_the_save_for_backward_fix() -> None:
    """``ctx.y = y`` in ``MyRelu.forward``: the output and its ctx point at each other, and
    the cycle's members name the Function (field guide #9)."""
    cycle = garbage(tensors=4, bytes=4 * MiB, types=(("MyReluBackward", 4), ("Tensor", 4)))
    (finding,) = _cycles(cycle, cycle)
    assert finding.subject is not None and finding.subject.name == "MyReluBackward"
    assert "in `MyRelu.forward`" in finding.fix
    assert "ctx.save_for_backward(...)" in finding.fix


def test_memory_freed_by_automatic_full_collections_is_told() -> None:
    first = garbage(tensors=1, bytes=MiB, types=NODES, full_freed=8 * MiB)
    last = garbage(tensors=1, bytes=MiB, types=NODES, full_freed=4 * MiB)
    (finding,) = _cycles(first, last)
    assert "automatic full collections freed 12 MiB meanwhile" in finding.message


def test_the_bytes_are_the_largest_cycle_seen_or_what_the_last_collection_freed() -> None:
    large = garbage(tensors=5, bytes=5 * MiB, types=NODES)
    small = garbage(tensors=1, bytes=MiB, types=NODES)
    assert _cycles(large, small)[0].bytes == 5 * MiB
    freeing = garbage(tensors=1, bytes=MiB, types=NODES, freed=9 * MiB)
    assert _cycles(large, freeing)[0].bytes == 9 * MiB


def test_the_rate_spreads_the_last_cycle_over_the_iterations_since_the_census_before() -> None:
    """The census at 6 saw no cycle; the one at 8 did: 2 MiB over two iterations."""
    cycle = garbage(tensors=2, bytes=2 * MiB, types=NODES)
    (finding,) = _cycles(cycle, None, cycle, at=[2, 6, 8])
    assert finding.rate == MiB
    assert "found at 2 of 3 censuses" in finding.message


def test_cycles_of_plain_objects_without_tensors_are_not_reported() -> None:
    """Heap noise freed by the interpreter's own collections holds no tensor."""
    plain = garbage(tensors=0, bytes=0, types=(("dict", 20),), objects=40, full_freed=4096)
    assert _cycles(plain, plain, plain, at=[2, 4, 8]) == []


def test_one_sighting_could_be_a_coincidence_and_is_not_reported() -> None:
    cycle = garbage(tensors=3, bytes=3 * MiB, types=NODES)
    once = [cycle] + [None] * (MIN_SIGHTINGS - 1)
    assert _cycles(*once, at=[4 * (i + 1) for i in range(MIN_SIGHTINGS)]) == []
    enough = [cycle] * MIN_SIGHTINGS
    assert len(_cycles(*enough, at=[4 * (i + 1) for i in range(MIN_SIGHTINGS)])) == 1


def test_a_cycle_of_unknown_types_still_names_what_it_owns() -> None:
    cycle = garbage(tensors=2, bytes=2 * MiB)
    (finding,) = _cycles(cycle, cycle)
    assert finding.subject is None
    assert "The unreachable objects are unknown" in finding.message


def test_a_report_without_censuses_has_no_finding() -> None:
    assert check(RULE, report()) == []
