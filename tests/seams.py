"""The seams tests give memsentry's policy fixed facts through: a tracker on a fake clock, a
tuning other than the default, or a judging credit, passed in, never patched into modules."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from torch import nn

import memsentry
from memsentry.record.clock import Clock
from memsentry.record.policy import DEFAULT, Tuning

#: Every iteration sampled, every layer call measured, whatever measuring costs next to the
#: loop (a budget still applies to the censuses after the first seven).
MEASURE_ALL = replace(DEFAULT, sampled_first=1 << 60, floor=3600.0, startup_credit=1e9)


def tracked(model: nn.Module | None = None, *, clock: Clock | None = None,
            tuning: Tuning | None = None, credit: float | None = None,
            **options: Any) -> memsentry.Tracker:
    """``memsentry.track(model, **options)`` on the given clock, tuning and judging credit
    (untracked seconds credited; ``None``: as the process ran)."""
    tracker = memsentry.track(model, **options)
    return tracker._with_policy(clock=clock, tuning=tuning, credit=credit)


def watched(model: nn.Module | None = None, *, clock: Clock | None = None,
            tuning: Tuning | None = None, credit: float | None = None,
            **options: Any) -> memsentry.Tracker:
    """``memsentry.watch(model, **options)`` on the given clock, tuning and credit."""
    tracker = memsentry.watch(model, **options)
    return tracker._with_policy(clock=clock, tuning=tuning, credit=credit)
