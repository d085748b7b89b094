"""memsentry's Lightning callback on a real ``lightning.Trainer`` (CPU, a tiny classifier):
clean runs give no finding, a list filled in ``training_step``, in ``validation_step`` or in
a callback is named as the user's code spells it, with its line, and the callback changes no
result, no exception and leaves no hook behind."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import optimizer_post_hooks
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

import memsentry
from memsentry import LeakError, LeakWarning, Severity

L = pytest.importorskip("lightning", reason="the Lightning tests need lightning "
                                            "(pip install 'memsentry[lightning]')")
from memsentry.integrations.lightning import MemsentryCallback  # noqa: E402

THIS = Path(__file__).name


class Classifier(L.LightningModule):
    """A tiny classifier; ``keep`` says what its steps keep by mistake."""

    def __init__(self, keep: str = "", fail_at: int | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 3))
        self.keep, self.fail_at = keep, fail_at
        self.step_losses: list[torch.Tensor] = []
        self.validation_step_outputs: list[torch.Tensor] = []
        self.seen: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.keep.startswith("checkpointed"):  # not a leak: activation checkpointing
            reentrant = self.keep == "checkpointed-reentrant"  # needs an input with grad
            logits = checkpoint(self.net, x.requires_grad_(reentrant), use_reentrant=reentrant)
        else:
            logits = self.net(x)
        loss = nn.functional.cross_entropy(logits, y)
        if self.fail_at is not None and self.global_step == self.fail_at:
            raise ValueError(f"bad batch {batch_idx}")
        if self.keep == "train":
            self.step_losses.append(loss)  # the leak: every step's graph
        if self.keep == "train-cleared":  # kept for the epoch's end, then cleared
            self.step_losses.append(loss.detach())
        self.seen.append(loss.item())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self.net(x)
        if self.keep in ("validation", "validation-cleared"):
            self.validation_step_outputs.append(logits)
        self.log("val_loss", nn.functional.cross_entropy(logits, y))

    def on_validation_epoch_end(self) -> None:
        if self.keep == "validation-cleared":  # Lightning's documented pattern: not a leak
            torch.cat(self.validation_step_outputs).mean()
            self.validation_step_outputs.clear()

    def on_train_epoch_end(self) -> None:
        if self.keep == "train-cleared":  # Lightning's documented pattern: not a leak
            torch.stack(self.step_losses).mean()
            self.step_losses.clear()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class KeepsPredictions(L.Callback):
    """A user's callback that keeps every batch's outputs (with their graphs)."""

    def __init__(self) -> None:
        self.outputs: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.outputs.append(outputs["loss"])


class Recording(L.pytorch.loggers.Logger):
    """A logger that keeps what it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[tuple[dict[str, float], int | None]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> str:
        return "0"

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.append((dict(metrics), step))


def data(n: int = 256, batch: int = 16) -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    dataset = TensorDataset(torch.randn(n, 16, generator=generator),
                            torch.randint(0, 3, (n,), generator=generator))
    return DataLoader(dataset, batch_size=batch)


def fit(module: Classifier, callbacks: list[Any], *, epochs: int = 3, logger: Any = False,
        **trainer_options: Any) -> Any:
    torch.manual_seed(0)
    trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", logger=logger,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks,
                        num_sanity_val_steps=0, **trainer_options)
    with warnings.catch_warnings():
        # Lightning's advice about CPU workers and logging intervals (LeakWarning, also a
        # UserWarning, is issued at this file's line and so stays)
        warnings.filterwarnings("ignore", category=UserWarning, module="lightning")
        trainer.fit(module, data(), data(64, 32))
    return trainer


def made(keep: str = "", fail_at: int | None = None) -> Classifier:
    torch.manual_seed(0)
    return Classifier(keep, fail_at)


def assert_unhooked(module: nn.Module) -> None:
    for sub in module.modules():
        assert not sub._forward_hooks and not sub._forward_pre_hooks
        assert not sub._backward_hooks and not sub._backward_pre_hooks
    assert not torch.nn.modules.module._global_forward_hooks
    assert not torch.nn.modules.module._global_forward_pre_hooks
    assert not optimizer_post_hooks()


def leaks(report: memsentry.Report) -> list[memsentry.Finding]:
    return [f for f in report.findings if f.severity is Severity.LEAK]


def test_a_clean_module_gives_no_finding_and_one_iteration_per_step() -> None:
    callback = MemsentryCallback(print_report=False, overhead=None)  # a row a step: no budget
    module = made()
    fit(module, [callback])
    report = callback.report
    assert report is not None
    assert report.findings == ()
    steps = [it for it in report.iterations if it.boundary is memsentry.Boundary.OPTIMIZER]
    assert len(steps) == 3 * 16  # 256 samples in batches of 16, three epochs
    assert {layer.name for layer in report.layers} >= {"net", "net.0", "net.2"}
    assert_unhooked(module)


def test_a_loss_kept_in_training_step_is_named_as_self_step_losses_with_its_line() -> None:
    callback = MemsentryCallback(print_report=False, on_leak="ignore")
    fit(made("train"), [callback])
    assert callback.report is not None
    [leak] = leaks(callback.report)
    assert leak.rule == "tensor-accumulation"
    assert leak.subject is not None and leak.subject.name == "self.step_losses"
    assert "(an attribute of `self`, the LightningModule Classifier" in leak.message
    assert leak.location is not None and leak.location.file.endswith(THIS)
    source = Path(__file__).read_text().splitlines()[leak.location.line - 1]
    assert "self.step_losses.append(loss)" in source
    assert "autograd graph" in leak.message


def test_results_are_bitwise_the_same_with_the_callback() -> None:
    plain, tracked = made("train"), made("train")
    fit(plain, [])
    fit(tracked, [MemsentryCallback(print_report=False, on_leak="ignore")])
    assert plain.seen == tracked.seen
    for a, b in zip(plain.state_dict().values(), tracked.state_dict().values(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("keep", ["checkpointed", "checkpointed-reentrant"])
def test_activation_checkpointing_in_training_step_runs_bitwise_with_no_finding(
        keep: str) -> None:
    plain, tracked = made(keep), made(keep)
    fit(plain, [])
    # a row a step, and the backward passes of every step seen: no budget
    callback = MemsentryCallback(print_report=False, overhead=None)
    fit(tracked, [callback])
    assert plain.seen == tracked.seen
    for a, b in zip(plain.state_dict().values(), tracked.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    report = callback.report
    assert report is not None and report.findings == ()
    steps = [it for it in report.iterations if it.boundary is memsentry.Boundary.OPTIMIZER]
    assert len(steps) == 3 * 16
    assert any("inside backward passes" in note for note in report.notes)
    assert_unhooked(tracked)


def test_gradient_accumulation_makes_one_iteration_of_each_optimizer_step() -> None:
    callback = MemsentryCallback(print_report=False, on_leak="ignore")
    fit(made("train"), [callback], epochs=2, accumulate_grad_batches=4)
    report = callback.report
    assert report is not None
    steps = [it for it in report.iterations if it.boundary is memsentry.Boundary.OPTIMIZER]
    assert len(steps) == 2 * 16 // 4
    [leak] = leaks(report)
    assert leak.subject is not None and leak.subject.name == "self.step_losses"
    assert "gains 4 tensors/iter" in leak.message  # four micro-batches an optimizer step


def test_validation_outputs_never_cleared_are_a_leak_and_cleared_ones_are_not() -> None:
    kept = MemsentryCallback(print_report=False, on_leak="ignore")
    fit(made("validation"), [kept], epochs=3)  # grows at epoch ends only: their censuses see it
    assert kept.report is not None
    found = leaks(kept.report)
    assert [f.subject.name for f in found if f.subject] == ["self.validation_step_outputs"]
    assert not any(f.rule == "missing-no-grad" for f in kept.report.findings)

    cleared = MemsentryCallback(print_report=False)
    fit(made("validation-cleared"), [cleared], epochs=3)
    assert cleared.report is not None and cleared.report.findings == ()


def test_training_outputs_cleared_at_each_epochs_end_are_not_a_leak() -> None:
    # memsentry's census at the epoch's end runs before the module's on_train_epoch_end
    # clears the list: it sees it full at every epoch, which is not growth.
    callback = MemsentryCallback(print_report=False)
    fit(made("train-cleared"), [callback], epochs=4)
    assert callback.report is not None
    assert [f for f in callback.report.findings if f.severity is not Severity.HINT] == []
    assert len(callback.report.censuses) >= 8


def test_a_users_callback_is_named_as_its_methods_spell_it() -> None:
    callback = MemsentryCallback(print_report=False, on_leak="ignore")
    fit(made(), [KeepsPredictions(), callback])
    assert callback.report is not None
    [leak] = leaks(callback.report)
    assert leak.subject is not None and leak.subject.name == "self.outputs"
    assert "the callback KeepsPredictions" in leak.message
    assert leak.location is not None
    source = Path(__file__).read_text().splitlines()[leak.location.line - 1]
    assert "self.outputs.append" in source


def test_scalars_go_to_the_loggers_and_reports_are_saved_each_epoch(tmp_path: Path) -> None:
    logger = Recording()
    path = tmp_path / "report.json"
    callback = MemsentryCallback(print_report=False, on_leak="ignore", report_path=path,
                                 per_epoch=True)
    fit(made("train"), [callback], epochs=2, logger=logger)
    ours = [(m, step) for m, step in logger.metrics if "memsentry/peak_bytes" in m]
    assert len(ours) == 3  # two epochs, then the end
    final, step = ours[-1]
    assert step == 2 * 16
    assert final["memsentry/leaks"] == 1.0 and final["memsentry/findings"] >= 1.0
    assert final["memsentry/growth_bytes_per_iter"] > 0
    assert callback.report is not None
    assert final["memsentry/peak_bytes"] == float(callback.report.peak)
    saved = json.loads(path.read_text())
    assert any(f["rule"] == "tensor-accumulation" for f in saved["findings"])
    assert (tmp_path / "report.epoch0.json").exists() and (tmp_path / "report.epoch1.json")\
        .exists()
    assert len(callback.epoch_reports) == 2
    assert len(callback.epoch_reports[0].iterations) < len(callback.report.iterations)


def test_on_leak_warns_at_the_users_line_and_raise_keeps_the_saved_report(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.warns(LeakWarning, match="self.step_losses") as caught:
        fit(made("train"), [MemsentryCallback()], epochs=1)
    assert any(Path(w.filename).name == THIS for w in caught if w.category is LeakWarning)
    assert "Findings (1)" in capsys.readouterr().out  # print_report=True prints it
    path = tmp_path / "report.html"
    pytest.importorskip("plotly")
    with pytest.raises(LeakError, match=r"self\.step_losses"):
        fit(made("train"), [MemsentryCallback(on_leak="raise", report_path=path,
                                              print_report=False)], epochs=1)
    assert "self.step_losses" in path.read_text()


def test_a_leak_is_logged_while_fit_runs_and_raise_ends_fit_there_with_the_report_saved(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # 16 steps an epoch, 3 epochs: the censuses of steps 2, 3 and 4 prove the leak, that of
    # step 34 confirms it, and it is said (on the callback's logger) as step 35 begins, not
    # when fit ends 13 steps later. Each census when due: no budget (under one, a census the
    # budget cannot pay for waits, and the leak is said later).
    module = made("train")
    with caplog.at_level(logging.WARNING, logger="memsentry.integrations.lightning"), \
            pytest.warns(LeakWarning):
        fit(module, [MemsentryCallback(print_report=False, overhead=None)])
    said = [r for r in caplog.records if r.getMessage().startswith("memsentry: LEAK")]
    assert said and "tensor-accumulation: `self.step_losses`" in said[0].getMessage()
    module = made("train")
    path = tmp_path / "report.json"
    with pytest.raises(LeakError, match=r"self\.step_losses"):
        fit(module, [MemsentryCallback(on_leak="raise", report_path=path,
                                       print_report=False, overhead=None)])
    assert 35 <= len(module.seen) <= 38  # the steps fit ran: it stopped there
    saved = memsentry.Report.from_json(path)
    assert [f.rule for f in leaks(saved)] == ["tensor-accumulation"]
    assert_unhooked(module)


def test_watch_true_keeps_to_one_percent_and_finds_the_leak() -> None:
    callback = MemsentryCallback(watch=True, on_leak="ignore", print_report=False)
    fit(made("train"), [callback], epochs=2)
    report = callback.report
    assert report is not None and report.cost is not None
    assert report.cost.budget == pytest.approx(0.01)
    assert [f.rule for f in leaks(report)] == ["tensor-accumulation"]


def test_an_exception_comes_out_unchanged_with_no_hook_left_and_the_report_kept() -> None:
    callback = MemsentryCallback(print_report=False)
    module = made(fail_at=5)
    with pytest.raises(ValueError, match="bad batch 5") as caught:
        fit(module, [callback])
    assert caught.traceback[-1].name == "training_step"
    assert_unhooked(module)
    assert callback.report is not None and len(callback.report.iterations) >= 5


@pytest.mark.parametrize(
    ("options", "error", "says"),
    [({"on_leak": "loud"}, ValueError, "on_leak='loud'"),
     ({"report_path": "/no/such/folder/r.json"}, ValueError, "does not exist"),
     ({"exact": True, "colour": 1}, TypeError, "unknown option(s) colour"),
     ({"overhead": -1}, ValueError, "overhead")],
)
def test_bad_options_are_refused_when_the_callback_is_made(options: dict[str, Any],
                                                           error: type, says: str) -> None:
    with pytest.raises(error, match=None) as caught:
        MemsentryCallback(**options)
    assert says in str(caught.value)


def test_the_pytorch_lightning_package_has_its_own_callback() -> None:
    pl = pytest.importorskip("pytorch_lightning")
    from memsentry.integrations.pytorch_lightning import MemsentryCallback as OldCallback

    class OldClassifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(16, 3)
            self.kept: list[torch.Tensor] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = nn.functional.cross_entropy(self.net(batch[0]), batch[1])
            self.kept.append(loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    callback = OldCallback(print_report=False, on_leak="ignore")
    assert isinstance(callback, pl.Callback)
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[callback])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module="pytorch_lightning")
        trainer.fit(OldClassifier(), data())
    assert callback.report is not None
    [leak] = leaks(callback.report)
    assert leak.subject is not None and leak.subject.name == "self.kept"


DDP_SCRIPT = '''
import warnings
import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from memsentry.integrations.lightning import MemsentryCallback


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(16, 3)
        self.step_losses = []

    def training_step(self, batch, batch_idx):
        loss = nn.functional.cross_entropy(self.net(batch[0]), batch[1])
        if self.global_rank == 1:
            self.step_losses.append(loss)  # the leak, on rank 1 only
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(512, 16), torch.randint(0, 3, (512,)))
    callback = MemsentryCallback(print_report=False, on_leak="ignore",
                                 report_path=REPORT)
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", strategy="ddp", devices=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[callback])
    trainer.fit(Classifier(), DataLoader(data, batch_size=16))
'''


def test_ddp_on_two_cpu_processes_combines_both_ranks_on_rank_0(tmp_path: Path) -> None:
    script = tmp_path / "ddp_train.py"
    report_path = tmp_path / "report.json"
    script.write_text(f"REPORT = {str(report_path)!r}\n" + DDP_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    saved = json.loads(report_path.read_text())
    assert saved["world_size"] == 2 and {r["rank"] for r in saved["ranks"]} == {0, 1}
    found = [(f["rank"], f["subject"]["name"]) for f in saved["findings"]
             if f["severity"] == "leak"]
    assert found == [(1, "self.step_losses")]
