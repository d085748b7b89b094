"""Reading a recorded stack: the user's own frame, and the phase of training it was in.

The snapshot may come from another machine, so whether a file is the user's is told from its
path alone: installed packages (``site-packages``, ``dist-packages``), a Python's standard
library (``.../lib/python3.X/``), frozen modules, and native frames (``stacks="all"`` adds
C++ frames: ``.cpp``/``.h``/``.cu`` files, or ``??``) are not. Both readings are cached by
stack: a trace repeats a few thousand stacks millions of times.
"""

from __future__ import annotations

import enum
import functools
import re

from memsentry.snapshots.read import Frame
from memsentry.usercode.phases import BACKWARD, FORWARD, SETUP, STEP, torch_phase

#: A Python's standard library: ``/usr/lib/python3.11/``, ``C:\\Python311\\Lib\\``.
_STDLIB = re.compile(r"[/\\]lib[/\\]python3\.\d+[/\\]|python3\d*[/\\]lib[/\\]", re.IGNORECASE)
_NATIVE = (".cpp", ".cc", ".h", ".hpp", ".cu", ".cuh", ".c", ".so")


def is_user_frame(frame: Frame) -> bool:
    """Whether ``frame`` is in the user's code."""
    name = frame.filename
    if not name or name == "??" or name.startswith("<frozen") or name.endswith(_NATIVE):
        return False
    return "-packages" not in name and _STDLIB.search(name) is None


@functools.lru_cache(maxsize=1 << 16)
def user_frame(frames: tuple[Frame, ...]) -> Frame | None:
    """The innermost frame of the user's code in a stack (innermost first)."""
    for frame in frames:
        if is_user_frame(frame):
            return frame
    return None


class Part(enum.Enum):
    """What a block was made for, guessed from the torch frames of its stack."""

    SETUP = "the model's set-up (parameters, buffers)"
    FORWARD = "a forward (activations, outputs)"
    BACKWARD = "a backward (gradients, temporaries)"
    STEP = "an optimizer step (state, temporaries)"
    OTHER = "your code outside torch's (inputs, copies)"


@functools.lru_cache(maxsize=1 << 16)
def part_of(frames: tuple[Frame, ...]) -> Part:
    """The phase a stack (innermost first) was in: an optimizer's step, autograd's backward,
    a module's forward, moving or building a model (``Module._apply``, a module's
    ``__init__``), else the program's own code. The outermost torch frame that says one
    decides: a forward inside a step is the step's. A stack with no frames at all is the
    backward's: autograd runs it on its own worker thread, which has no Python frames (with
    ``stacks="python"``; the viewer says so too)."""
    if not frames:
        return Part.BACKWARD
    found = Part.OTHER
    for frame in frames:
        phase = torch_phase(frame.filename, frame.name)
        if phase is not None:
            found = _PARTS[phase]
    return found


_PARTS = {STEP: Part.STEP, BACKWARD: Part.BACKWARD, SETUP: Part.SETUP, FORWARD: Part.FORWARD}


__all__ = ["Part", "is_user_frame", "part_of", "user_frame"]
