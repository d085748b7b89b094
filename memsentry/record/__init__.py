"""Recording: the hooks, the iteration clock, the timeline and the censuses of a tracking run,
the only mutable state of memsentry.

``options`` (checked arguments), ``layers`` (per-layer accumulators and names), ``calls``
(running forwards and backwards), ``sampler`` (reading the backend on the hot path),
``coverage`` (which calls are measured, within a share of the loop's time),
``forward`` (module hooks and the saved-tensor hook), ``backward`` (each layer's backward),
``outermost`` (forwards no backward used), ``timeline`` (the iteration clock and timeline),
``schedule`` (when censuses run) and ``recorder`` (the shell that wires them).
"""

from memsentry.record.options import OnLeak, Options
from memsentry.record.policy import census_due
from memsentry.record.recorder import Recorder

__all__ = ["OnLeak", "Options", "Recorder", "census_due"]
