"""The phase of training a torch frame says a stack was in, from the frame's path inside the
``torch`` package and its function: an optimizer's step, autograd's backward, a module's
forward, or building and moving a model. Read by the snapshot judge on any record, and by
memsentry's own CPU record, which keeps exactly those of torch's frames (it keeps the user's
frames and leaves the rest of the machinery out)."""

from __future__ import annotations

SETUP = "setup"
FORWARD = "forward"
BACKWARD = "backward"
STEP = "step"

_BACKWARD = ("backward", "grad", "_make_grads")
_SETUP = ("_apply", "to", "cuda", "__init__", "reset_parameters")
_FORWARD = ("_call_impl", "_wrapped_call_impl", "forward")


def torch_path(filename: str) -> str | None:
    """The path of a file inside a ``torch`` folder (``nn/modules/module.py``), else
    ``None``."""
    name = filename.replace("\\", "/")
    at = name.rfind("/torch/")
    return name[at + 7:] if at >= 0 else None


def torch_phase(filename: str, function: str) -> str | None:
    """The phase a frame of ``function`` in ``filename`` says (:data:`STEP`,
    :data:`BACKWARD`, :data:`SETUP`, :data:`FORWARD`), or ``None`` when it is not one of
    torch's frames that say one."""
    inside = torch_path(filename)
    if inside is None:
        return None
    if inside.startswith("optim/"):
        return STEP
    if inside.startswith("autograd/") and function in _BACKWARD:
        return BACKWARD
    if inside == "_tensor.py" and function == "backward":
        return BACKWARD
    if inside.startswith("nn/modules/"):
        if function in _SETUP:
            return SETUP
        if function in _FORWARD:
            return FORWARD
    return None


__all__ = ["BACKWARD", "FORWARD", "SETUP", "STEP", "torch_path", "torch_phase"]
