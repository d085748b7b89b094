"""What memsentry's Lightning callback does, apart from the ``Callback`` class it extends (the
``lightning`` package's or the older ``pytorch_lightning``'s): see
:mod:`memsentry.integrations.lightning`. Nothing here imports Lightning."""

from __future__ import annotations

import logging
from typing import Any

from memsentry.integrations.session import TrainingSession, scalars
from memsentry.report import Report
from memsentry.usercode.frames import is_user_class


class LightningAdapter:
    """Tracks the LightningModule from ``on_train_start`` to ``on_train_end``; see
    :class:`memsentry.integrations.lightning.MemsentryCallback`."""

    def __init__(self, *, on_leak: str = "warn", report_path: Any = None,
                 per_epoch: bool = False, print_report: bool = True,
                 **track_options: Any) -> None:
        super().__init__()
        self.session = TrainingSession(on_leak=on_leak, report_path=report_path,
                                       per_epoch=per_epoch, print_report=print_report,
                                       options=track_options, who="MemsentryCallback",
                                       say=logging.getLogger(type(self).__module__).warning)

    @property
    def report(self) -> Report | None:
        """The last run's report (``None`` before the end of training)."""
        return self.session.report

    @property
    def epoch_reports(self) -> list[Report]:
        """With ``per_epoch=True``, the report as it stood at the end of each epoch."""
        return list(self.session.epoch_reports)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        names: list[tuple[str, object, str]] = [("self", pl_module, "LightningModule")]
        names += [("self", callback, "callback") for callback in trainer.callbacks
                  if callback is not self and is_user_class(type(callback))]
        self.session.start(pl_module, names)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        report = self.session.epoch_end(trainer.current_epoch)
        if report is not None:
            self._log(trainer, report)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        report = self.session.finish()
        if report is None:
            return
        self._log(trainer, report)
        if self.session.print_report and trainer.is_global_zero:
            print(report)
        self.session.signal_leaks(report)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        try:  # unhook and keep the report (with its post-mortem); the error stays the user's
            self.session.finish(exception)
        except Exception:
            pass

    @staticmethod
    def _log(trainer: Any, report: Report) -> None:
        """The report's scalars through each of the trainer's loggers (rank 0 only)."""
        if not trainer.is_global_zero:
            return
        metrics = scalars(report)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)


__all__ = ["LightningAdapter"]
