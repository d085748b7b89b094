"""What memsentry costs the loop where no clock of its own can see: PyTorch calling its hooks,
Python entering its functions before the first clock reading, and the paths too short to clock
(a counted call, a step passed with a count). The ledger charges them per event, so that the
share it reports agrees with what the machine does.

Each cost is a number of *calls*: the time of one call of a Python function that returns at
once, timed in this process when the first tracker starts (:func:`call_seconds`), so the
charges follow the machine they run on. The numbers come from counting instructions under
valgrind's callgrind (``benchmarks/instructions.py``, torch 2.13, Python 3.11, 2026-11-28),
against one such call (1,520 instructions with its loop):

- a module call with a forward pre hook and an always-called forward hook that return at once,
  over the same call with none: +17,900 instructions (PyTorch's long path in
  ``Module._call_impl``), 12 calls;
- a call through the counter of :mod:`memsentry.record.counted`: +3,300, 2 calls;
- an optimizer step passed with a count: PyTorch's step hooks, the process's step hook, the
  short way through the recorder and the wrapped ``torch.autograd.backward``: +9,000 with the
  light closings between them, 6 calls.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

#: Seconds of one call where none was timed (a test's clock: no machine to calibrate on).
CALL_SECONDS = 5e-7
_ROUNDS = 5
_CALLS = 200
_timed: float | None = None


@dataclass(frozen=True)
class Unseen:
    """Seconds each event costs the loop beyond what memsentry clocks."""

    hooked_call: float  # a module call with memsentry's pre and post hooks on
    counted_call: float  # a call through the counter
    passed_step: float  # an optimizer step passed with a count

    @classmethod
    def of(cls, call: float) -> Unseen:
        """The costs on a machine where one call takes ``call`` seconds."""
        return cls(hooked_call=12 * call, counted_call=2 * call, passed_step=6 * call)


def _returns(*args: object, **kwargs: object) -> None:
    return None


def call_seconds() -> float:
    """Seconds of one call of a Python function that returns at once, with one argument:
    the fastest of five rounds of 200 calls (about 0.1 ms in all), timed once a process."""
    global _timed
    if _timed is None:
        best = float("inf")
        argument = object()
        for _ in range(_ROUNDS):
            started = time.perf_counter()
            for _ in range(_CALLS):
                _returns(argument)
            best = min(best, time.perf_counter() - started)
        _timed = best / _CALLS if best > 0 else CALL_SECONDS
    return _timed
