"""memsentry for PyTorch Lightning (the ``lightning`` package): add
``MemsentryCallback()`` to the ``Trainer``'s callbacks.

It tracks the LightningModule from ``on_train_start`` to ``on_train_end``: an iteration ends
at each optimizer step (several batches of gradient accumulation are one iteration), and the
validation loops that run during ``fit`` are tracked with the training. Holders reached
through the LightningModule or one of your own callbacks are named the way their methods
spell them (``self.step_losses``), with the line that fills them. At the end the report's
scalars (``memsentry/peak_bytes``, ``memsentry/growth_bytes_per_iter``,
``memsentry/findings``, ``memsentry/leaks``) go to the trainer's loggers, the report is
printed (``print_report``) and saved (``report_path``: ``.json``, ``.html`` or text), then
leaks are signalled as ``on_leak`` says (``"warn"``, ``"raise"`` or ``"ignore"``).
``per_epoch=True`` also logs and saves (``report.epochN.json``) the report at each epoch's
end. Other keyword arguments go to :func:`memsentry.track` (``exact``, ``overhead``, ...).
For the older ``pytorch_lightning`` package use
:mod:`memsentry.integrations.pytorch_lightning`.
"""

from __future__ import annotations

from lightning.pytorch import Callback

from memsentry.integrations.lightning_adapter import LightningAdapter


class MemsentryCallback(LightningAdapter, Callback):
    """A Lightning callback that tracks training with memsentry (see the module's text)."""


__all__ = ["MemsentryCallback"]
