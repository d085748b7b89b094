"""Findings on a recorded snapshot, with the ids and fixes of the live rules where the class
is the same: blocks piling up once per iteration are ``tensor-accumulation``, cached memory
cut into pieces is ``allocator-fragmentation``; an out-of-memory error the trace holds is
``out-of-memory``. Pure functions of a :class:`~memsentry.snapshots.judge.DeviceVerdict`."""

from __future__ import annotations

from memsentry.model import Finding, Severity, SubjectKind
from memsentry.model.findings import Subject
from memsentry.rules.device import FRAGMENT_BYTES, FRAGMENT_SHARE, FRAGMENTATION
from memsentry.rules.holders import ACCUMULATION
from memsentry.snapshots.frames import Part
from memsentry.snapshots.judge import Cache, DeviceVerdict, OomEvent, PileUp, SnapshotVerdict
from memsentry.units import format_bytes
from memsentry.usercode.location import Location

OUT_OF_MEMORY = "out-of-memory"

#: What to change where a part's blocks pile up.
_PILE_FIXES = {
    Part.FORWARD: "a forward's outputs are kept with their autograd graph every iteration: "
                  "keep `loss.item()` or `out.detach()` (or run that forward under "
                  "`torch.no_grad()`), and bound the list that keeps them",
    Part.BACKWARD: "gradients are kept every iteration: read them as numbers "
                   "(`.norm().item()`), and do not keep `backward(create_graph=True)` graphs",
    Part.STEP: "the optimizer's state grows every step: a parameter group or state entry "
               "added at each step; create the optimizer once, before the loop",
    Part.SETUP: "parameters or buffers are made every iteration: build the model once, "
                "before the loop",
    Part.OTHER: "the tensors this line makes stay referenced: find the list or dict that "
                "keeps them and keep numbers (`.item()`) or a bounded window "
                "(`collections.deque(maxlen=k)`) instead",
}

#: What to cut where a part fills memory at an out-of-memory error.
_OOM_FIXES = {
    Part.FORWARD: "activations fill it: a smaller batch, activation checkpointing "
                  "(`torch.utils.checkpoint`) or autocast to bf16/fp16",
    Part.BACKWARD: "the backward fills it: a smaller batch, or activation checkpointing",
    Part.STEP: "the optimizer's state fills it: a lighter optimizer (SGD, 8-bit Adam) or "
               "sharding its state (ZeRO, FSDP)",
    Part.SETUP: "the model's own parameters fill it: a smaller model, bf16 weights, or "
                "sharding (FSDP)",
    Part.OTHER: "your own tensors fill it: free or move to the CPU what the lines below keep",
}


def findings(verdict: SnapshotVerdict) -> tuple[Finding, ...]:
    """Every device's findings, pile-ups first."""
    found: list[Finding] = []
    for device in verdict.devices:
        found.extend(device_findings(device))
    return tuple(found)


def device_findings(device: DeviceVerdict) -> list[Finding]:
    found = [pile_up_finding(pile, device) for pile in device.pile_ups]
    found.extend(oom_finding(oom, device) for oom in device.ooms)
    fragmented = fragmentation_finding(device.cache, device.name)
    if fragmented is not None:
        found.append(fragmented)
    return found


def _subject(name: str) -> Subject:
    return Subject(SubjectKind.DEVICE, name)


def _location(site: str | None) -> Location | None:
    """``file:line (function)`` as a location (the function is after the last `` (``: a
    folder's name may hold one)."""
    if site is None:
        return None
    where, _, function = site.rpartition(" (")
    file, _, line = where.rpartition(":")
    return Location(file, int(line), function.rstrip(")") or None) if line.isdigit() else None


def pile_up_finding(pile: PileUp, device: DeviceVerdict) -> Finding:
    """A LEAK: blocks one line made kept alive once per iteration to the end."""
    who = f"from {pile.site}" if pile.site else "from stacks with no frame of your code"
    if pile.iterations is not None:
        pace = (f"kept from {pile.iterations} of the last {pile.span} iterations (read from "
                f"{device.rhythm})")
        rate = pile.bytes / pile.iterations
    else:
        pace = (f"made at a steady pace, one burst every {pile.gap:.0f} trace entries, and "
                "never freed (the trace shows no optimizer step nor backward to count "
                "iterations by)")
        rate = None
    made = f"; made in {pile.part.value}" if device.phases_known else ""
    older = (f" ({pile.before:,} more from this line are alive from before the trace began)"
             if pile.before else "")
    message = (f"{format_bytes(pile.bytes)} in {pile.blocks:,} blocks {who} made in the "
               f"trace and alive at its end on {device.name}{older}, {pace}{made}")
    return Finding(rule=ACCUMULATION, severity=Severity.LEAK, message=message,
                   fix=_PILE_FIXES[pile.part], bytes=pile.bytes, rate=rate,
                   objects=pile.blocks, subject=_subject(device.name),
                   location=_location(pile.site))


def oom_finding(oom: OomEvent, device: DeviceVerdict) -> Finding:
    """What an out-of-memory error asked for, what the device had, and what filled it."""
    free = f"; the device had {format_bytes(oom.device_free)} free" \
        if oom.device_free is not None else ""
    parts = ", ".join(f"{part.value} {format_bytes(size)}" for part, size in oom.parts[:3])
    top = oom.parts[0][0] if oom.parts else Part.OTHER
    holder = next((site for site in oom.sites if site.site), None)
    held = f"; the most from your line {holder.site} ({format_bytes(holder.bytes)})" \
        if holder is not None else ""
    message = (f"out of memory on {device.name} at trace entry {oom.index:,}: asked for "
               f"{format_bytes(oom.requested)}{free}; tensors held "
               f"{format_bytes(oom.allocated)} ({parts or 'nothing the trace shows'}){held}")
    cached = device.cache.reserved - device.cache.allocated
    fix = _OOM_FIXES[top]
    if device.cache.largest_free < oom.requested <= cached:
        fix = (f"{format_bytes(cached)} was cached but free in pieces of at most "
               f"{format_bytes(device.cache.largest_free)}: set "
               "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before the first CUDA call; "
               f"else {fix}")
    return Finding(rule=OUT_OF_MEMORY, severity=Severity.WASTE, message=message, fix=fix,
                   bytes=oom.requested, subject=_subject(device.name),
                   location=_location(holder.site if holder else None))


def fragmentation_finding(cache: Cache, device: str) -> Finding | None:
    """WASTE when the segments cached far more than tensors used when the snapshot was
    taken (the live rule's share and floor)."""
    unused = cache.reserved - cache.allocated
    if unused < max(FRAGMENT_SHARE * cache.reserved, FRAGMENT_BYTES):
        return None
    expandable = {True: "; expandable segments were on", False: "; expandable segments were "
                  "off", None: ""}[cache.expandable]
    message = (f"{format_bytes(cache.reserved)} reserved in {cache.segments} segments on "
               f"{device} against {format_bytes(cache.allocated)} in tensors when the "
               f"snapshot was taken: {format_bytes(unused)} cached and unused, the largest "
               f"free piece {format_bytes(cache.largest_free)}{expandable}")
    fix = ("pad or bucket inputs to a few fixed shapes" if cache.expandable else
           "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before the first CUDA call; "
           "pad or bucket inputs to a few fixed shapes")
    return Finding(rule=FRAGMENTATION, severity=Severity.WASTE, message=message, fix=fix,
                   bytes=unused, subject=_subject(device))


__all__ = ["OUT_OF_MEMORY", "device_findings", "findings", "fragmentation_finding",
           "oom_finding", "pile_up_finding"]
