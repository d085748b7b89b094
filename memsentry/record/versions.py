"""The error torch raises when a tensor saved for backward was modified in place, raised by
memsentry's unpack hook in torch's own words.

Under saved-tensor hooks torch skips its version check (torch/csrc/autograd/saved_variable.cpp,
``SavedVariable::unpack``: "Only check version counter in the case without hooks"), so
memsentry repeats it, and must raise what torch raises without hooks: a ``RuntimeError`` whose
text is torch's. That file builds the text from

- the tensor (``toString()`` and its sizes): ``[torch.FloatTensor [2, 3]]``;
- a node, when there is one: for a saved *output* (not a leaf), the node that saved it, with
  the output's number; for a saved input or leaf (the original tensor is kept), that tensor's
  grad_fn *at the time of the check*, with number 0 (``output_nr_`` is only set on the path
  that does not keep the original);
- the versions, and a hint that depends on anomaly mode.

How a node's name is spelled and what the hint says change between releases (2.13 writes
"output 0 of Sigmoid" and "set_detect_anomaly(True, check_nan=False)", older ones
"SigmoidBackward0" and "set_detect_anomaly(True)"), so the wording is learned once per mode
from torch itself: a sigmoid's output changed in place, run without hooks, on the CPU, when
tracking starts (:func:`learn`).
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass

import torch

#: The probe: ``x.sigmoid()`` saves its output, which ``mul_`` then changes.
_PROBE_NODE = "SigmoidBackward0"
_PROBE_SHAPE = (2, 3)
_TAIL = re.compile(r"(?:, which is output 0 of (?P<name>[^,]+),)? is at version 1; "
                   r"expected version 0 instead\.(?P<hint>.*)", re.DOTALL)


@dataclass(frozen=True)
class Wording:
    """What torch writes around the figures: the opening, whether node names lose their
    ``Backward`` suffix, and the closing hint."""

    opening: str
    short_names: bool
    hint: str

    def node(self, name: str) -> str:
        return re.sub(r"Backward\d*$", "", name) if self.short_names else name

    def message(self, tensor: torch.Tensor, node: tuple[str, int] | None, saved: int) -> str:
        which = f", which is output {node[1]} of {self.node(node[0])}," if node else ""
        return (f"{self.opening}[{describe(tensor)}]{which} is at version {tensor._version}; "
                f"expected version {saved} instead.{self.hint}")


#: torch's wording as torch/csrc/autograd/saved_variable.cpp has it before 2.13, for when the
#: probe cannot run (saved-tensor hooks on the stack would take its tensor).
FALLBACK = {
    False: Wording("one of the variables needed for gradient computation has been modified "
                   "by an inplace operation: ", False,
                   " Hint: enable anomaly detection to find the operation that failed to "
                   "compute its gradient, with torch.autograd.set_detect_anomaly(True)."),
    True: Wording("one of the variables needed for gradient computation has been modified "
                  "by an inplace operation: ", False,
                  " Hint: the backtrace further above shows the operation that failed to "
                  "compute its gradient. The variable in question was changed in there or "
                  "anywhere later. Good luck!"),
}
_learned: dict[bool, Wording] = {}


def describe(tensor: torch.Tensor) -> str:
    """``torch.FloatTensor [2, 3]``, as ``toString()`` and the sizes print."""
    return f"{tensor.type()} {list(tensor.shape)}"


def parse(text: str) -> Wording | None:
    """The wording of torch's message for the probe, or ``None`` when it is not recognised."""
    marker = f"[{describe(torch.empty(_PROBE_SHAPE, dtype=torch.float32, device='cpu'))}]"
    opening, found, tail = text.partition(marker)
    matched = _TAIL.fullmatch(tail) if found else None
    if matched is None:
        return None
    name = matched.group("name")
    return Wording(opening, name is not None and name != _PROBE_NODE, matched.group("hint"))


def _probe() -> str:
    """torch's message for the probe (on the CPU whatever the default device, so that no
    device is touched; with autograd on whatever the mode the caller is in)."""
    with torch.inference_mode(False), torch.enable_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # anomaly mode warns with the forward's traceback
        x = torch.zeros(_PROBE_SHAPE, dtype=torch.float32, device="cpu", requires_grad=True)
        out = x.sigmoid()
        out.mul_(2)
        try:
            out.sum().backward()
        except RuntimeError as error:
            return str(error)
    return ""


def wording(has_hooks: bool) -> Wording:
    """torch's wording in the current anomaly mode; ``has_hooks``: saved-tensor hooks are on
    this thread's stack, where the probe cannot run (the fallback is used, not learned)."""
    anomaly = torch.is_anomaly_enabled()
    known = _learned.get(anomaly)
    if known is not None:
        return known
    found = None if has_hooks else parse(_probe())
    if found is None:
        return FALLBACK[anomaly]
    _learned[anomaly] = found
    return found


def learn(has_hooks: bool) -> None:
    """Learn torch's wording for the current anomaly mode now (once per process), at the
    start of tracking: before memsentry's hooks are on, and before a census that reads a
    changed saved tensor would run the probe in the middle of the program's own work."""
    wording(has_hooks)
