"""Loops and reports the documentation shows next to the findings they get (the docs build
runs them; ``docs/_ext`` prints each finding the way the text report does). The scenario
suite (``scenarios.py``) gives most examples; these are the ones it has no loop for."""

from __future__ import annotations

from dataclasses import replace

import torch
from scenarios import _batch, _setup
from test_device_rules import GiB, MiB, _as_cuda, recorded
from torch import nn

import memsentry
from memsentry.rules import analyse

_recorded = getattr(recorded, "__wrapped__", recorded)  # the fixture's function


def outputs_kept_without_holder_search(steps: int) -> memsentry.Report:
    """Outputs kept with their graphs, the holder search off: only the growth is seen."""
    model, opt = _setup()
    kept = []
    with memsentry.track(model, holders=False, on_leak="ignore") as t:
        for _ in range(steps):
            x, y = _batch()
            out = model(x)
            nn.functional.cross_entropy(out, y).backward()
            opt.step()
            opt.zero_grad()
            kept.append(torch.cat([out] * 64))  # about 1 MiB a step, with its graph
    return t.report()


def _cuda(**figures: object) -> memsentry.Report:
    report = _as_cuda(_recorded(), **figures)  # type: ignore[arg-type]
    return replace(report, findings=analyse(report))


def cuda_headroom(steps: int) -> memsentry.Report:
    """An 80 GiB device, 2 GiB resident, a 6 GiB peak at batch 64 (4 GiB activations)."""
    return _cuda(total=80 * GiB, resident=2 * GiB, peak=6 * GiB)


def cuda_fragmentation(steps: int) -> memsentry.Report:
    """The same run with reserved memory growing 256 MiB an iteration."""
    run = _recorded()
    report = _as_cuda(run, total=80 * GiB, resident=2 * GiB, peak=6 * GiB,
                      reserved=[8 * GiB + i * 256 * MiB for i in range(len(run.iterations))],
                      allocator_stats={"inactive_split_bytes.all.current": 900 * MiB})
    return replace(report, findings=analyse(report))


def cuda_outside_pytorch(steps: int) -> memsentry.Report:
    """NVML counts 34 GiB for the process against 30 GiB PyTorch reserved."""
    base = _as_cuda(_recorded(), total=80 * GiB, resident=2 * GiB, peak=30 * GiB)
    report = replace(base, reserved=30 * GiB,
                     nvml={"available": True, "process_used": 34 * GiB})
    return replace(report, findings=analyse(report))
