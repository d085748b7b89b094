"""memsentry for the Hugging Face ``Trainer`` (``transformers``): pass
``callbacks=[MemsentryCallback()]`` to the ``Trainer`` (or ``trainer.add_callback(...)``).

It tracks the trainer's model from ``on_train_begin`` to ``on_train_end``: an iteration ends
at each optimizer step (gradient accumulation's micro-batches are one iteration) and the
evaluations that run during training are tracked with it. Holders reached through the model,
your ``Trainer`` subclass (a list filled in your ``compute_loss``) or one of your callbacks
are named the way their methods spell them (``self.losses``), with the line that fills
them. At the end the report's scalars (``memsentry/peak_bytes``,
``memsentry/growth_bytes_per_iter``, ``memsentry/findings``, ``memsentry/leaks``) go
through ``trainer.log`` (so to ``state.log_history`` and every ``report_to`` integration),
each finding is logged on the ``transformers`` logger, the report is printed
(``print_report``) and saved (``report_path``: ``.json``, ``.html`` or text), then leaks are
signalled as ``on_leak`` says. ``per_epoch=True`` logs and saves (``report.epochN.json``)
the report at each epoch's end too. Other keyword arguments go to :func:`memsentry.track`.

A plain ``accelerate`` loop needs no callback: ``with memsentry.track(model):`` around it
(after ``accelerator.prepare``) sees each ``optimizer.step()``.
"""

from __future__ import annotations

import functools
import sys
import weakref
from typing import Any

from transformers import Trainer, TrainerCallback
from transformers.utils import logging

from memsentry.integrations.session import TrainingSession, scalars
from memsentry.report import Report
from memsentry.usercode.frames import is_user_class

_LOG = logging.get_logger("transformers.trainer")


def _calling_trainer() -> Trainer | None:
    """The ``Trainer`` whose loop calls the callbacks: the callback handler is given the
    model, optimizer and data, not the trainer, whose ``log`` and subclass we need."""
    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _guard(trainer: Trainer, session: TrainingSession) -> None:
    """Make ``trainer.train()`` stop tracking when it raises (a ``TrainerCallback`` has no
    exception hook): the hooks come off and the report keeps the post-mortem; the exception
    goes on as it was. Until its first call the wrapper holds the trainer (in
    ``Trainer(...).train()`` nothing else does once ``.train`` is looked up); from then on,
    weakly, so no cycle outlives the call."""
    if "train" in vars(trainer):
        return
    owner = weakref.ref(trainer)
    first: list[Trainer] = [trainer]
    method = type(trainer).train

    @functools.wraps(method)
    def train(*args: Any, **kwargs: Any) -> Any:
        current = first.pop() if first else owner()
        assert current is not None  # it is calling us: looked up on a live trainer
        try:
            return method(current, *args, **kwargs)
        except BaseException as error:
            if session.active:
                try:
                    session.finish(error)
                except Exception:
                    pass
            raise

    trainer.train = train  # type: ignore[method-assign]


def _trainer_names(trainer: Trainer, own: object) -> list[tuple[str, object, str]]:
    """The ``Trainer`` when it is of the user's class, and the callbacks of the user's
    classes other than ``own`` (memsentry's), as their methods spell them."""
    names: list[tuple[str, object, str]] = []
    if is_user_class(type(trainer)):
        names.append(("self", trainer, "Trainer"))
    names += [("self", callback, "callback") for callback in trainer.callback_handler.callbacks
              if callback is not own and is_user_class(type(callback))]
    return names


def _framework_names(model: Any, trainer: Trainer | None,
                     own: object) -> list[tuple[str, object, str]]:
    """The objects the holder search starts from, as (name, object, role): the model, the
    ``Trainer`` and the other callbacks, those of the user's classes."""
    names: list[tuple[str, object, str]] = []
    if model is not None and is_user_class(type(model)):
        names.append(("self", model, "model"))
    if trainer is not None:
        names += _trainer_names(trainer, own)
    return names


class MemsentryCallback(TrainerCallback):
    """A ``TrainerCallback`` that tracks training with memsentry (see the module's text)."""

    def __init__(self, *, on_leak: str = "warn", report_path: Any = None,
                 per_epoch: bool = False, print_report: bool = True,
                 **track_options: Any) -> None:
        self.session = TrainingSession(on_leak=on_leak, report_path=report_path,
                                       per_epoch=per_epoch, print_report=print_report,
                                       options=track_options, who="MemsentryCallback",
                                       say=_LOG.warning)
        self._trainer: weakref.ref[Trainer] | None = None

    @property
    def report(self) -> Report | None:
        """The last run's report (``None`` before the end of training)."""
        return self.session.report

    @property
    def epoch_reports(self) -> list[Report]:
        """With ``per_epoch=True``, the report as it stood at the end of each epoch."""
        return list(self.session.epoch_reports)

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = _calling_trainer()
        if trainer is not None:
            _guard(trainer, self.session)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = kwargs.get("model")
        trainer = _calling_trainer()
        if self.session.active:  # a run that ended without on_train_end (a retry)
            self.session.finish()
        if trainer is not None:
            _guard(trainer, self.session)  # added after __init__: guards the next train()
        self._trainer = weakref.ref(trainer) if trainer is not None else None
        self.session.start(model, _framework_names(model, trainer, self))

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The epoch's evaluation comes after this hook: its census is taken in on_evaluate.
        report = self.session.epoch_end(round(state.epoch or 0) - 1, census=False)
        if report is not None:
            self._log(state, report)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.session.census()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        report = self.session.finish()
        if report is None:
            return
        self._log(state, report)
        if state.is_world_process_zero:
            for finding in report.findings:
                _LOG.warning(f"memsentry: {finding.severity.value.upper()} {finding.rule}: "
                             f"{finding.message}. Fix: {finding.fix}")
            if self.session.print_report:
                print(report)
        self.session.signal_leaks(report)

    def _log(self, state: Any, report: Report) -> None:
        """The report's scalars through the trainer's ``log`` (rank 0 only)."""
        if not state.is_world_process_zero:
            return
        trainer = self._trainer() if self._trainer is not None else None
        if trainer is not None:
            trainer.log(scalars(report))
        else:  # no trainer on the stack (called by hand): the history still gets them
            state.log_history.append({**scalars(report), "step": state.global_step})


__all__ = ["MemsentryCallback"]
