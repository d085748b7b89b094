"""The categories values are made of: string enums, so that they compare equal to their JSON
spelling (``Boundary.OPTIMIZER == "optimizer"``) and print as it."""

from __future__ import annotations

import enum


class _Text(str, enum.Enum):
    def __str__(self) -> str:
        return str(self.value)


class Severity(_Text):
    """How bad a finding is: LEAK grows without bound, WASTE raises the peak, HINT is advice."""

    LEAK = "leak"
    WASTE = "waste"
    HINT = "hint"


class Boundary(_Text):
    """What closed an iteration: an optimizer step, ``t.step()``, the end of a backward pass
    (loops without a ``torch.optim`` optimizer), the next call of the outermost module
    (inference), or the end of tracking (a partial iteration)."""

    OPTIMIZER = "optimizer"
    STEP = "step"
    BACKWARD = "backward"
    FORWARD = "forward"
    EXIT = "exit"


class Phase(_Text):
    """Where a training loop is at a moment: inside a layer's forward or backward, in an
    optimizer step, or between those (loss, data, the loop's own code)."""

    FORWARD = "forward"
    BACKWARD = "backward"
    STEP = "optimizer step"
    BETWEEN = "between layers"


class FixKind(_Text):
    """What an out-of-memory fix changes."""

    BATCH = "batch"
    CHECKPOINT = "checkpoint"
    AUTOCAST = "autocast"
    OPTIMIZER = "optimizer"
    REQUEST = "request"
    HEADROOM = "headroom"


class ForecastMethod(_Text):
    """Where a forecast's line comes from."""

    BATCHES = "the peaks measured"
    ACTIVATIONS = "the activations per sample measured"


class PeakMode(_Text):
    """How peaks were measured: at sample points (a lower bound), counting every allocation
    (exact, layers too), or from a device's peak counter reset where each iteration begins
    (each iteration's peak exact; a layer's exact only where it set the iteration's high)."""

    SAMPLED = "sampled"
    EXACT = "exact"
    ITERATIONS = "exact per iteration"


class Measured(_Text):
    """What a backend's figures count: tensor memory only (a device allocator, storage
    counting), or the process heap (every C allocation, tensors among them)."""

    TENSORS = "tensors"
    HEAP = "heap"


class HolderKind(_Text):
    """What a holder of tensors is, where its path starts."""

    LOCAL = "local"
    GLOBAL = "global"
    CLASS_ATTRIBUTE = "class attribute"
    MODEL = "model"
    INSTANCE = "instance"  # an object a framework runs, named as its own methods spell it
    GRADIENT = "gradient"
    TEST_INSTANCE = "test instance"
    FIXTURE = "fixture"
    PACKAGE = "package global"  # a global of an installed package the user's code calls


class ScopeKind(_Text):
    """Where a holder lives: a function's frame, a module, the script run as ``__main__``, a
    class, or a pytest fixture's scope."""

    FUNCTION = "function"
    MODULE = "module"
    SCRIPT = "script"
    CLASS = "class"
    FIXTURE = "fixture"


class StepKind(_Text):
    """One step of a holder's path: the root name, an attribute, a dict key, a sequence index,
    a set member, a local of a frame kept by a traceback, or an entry of a function's cache
    (``functools.lru_cache``: spelled ``table(…)``, a result the cache keeps)."""

    ROOT = "root"
    ATTRIBUTE = "attribute"
    KEY = "key"
    INDEX = "index"
    MEMBER = "member"
    FRAME_LOCAL = "frame local"
    CACHED = "cached"


class SubjectKind(_Text):
    """What a finding is about."""

    HOLDER = "holder"
    MODULE = "module"
    TYPE = "type"
    DEVICE = "device"
    LOOP = "loop"
    PROCESS = "process"


__all__ = ["Boundary", "FixKind", "ForecastMethod", "HolderKind", "Measured", "PeakMode", "Phase",
           "ScopeKind", "Severity", "StepKind", "SubjectKind"]
