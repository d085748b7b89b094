"""memsentry's callback on a real ``transformers.Trainer`` (a two-layer BERT built from a
config, no download, CPU), and ``memsentry.track`` around a plain ``accelerate`` loop: clean
runs give no finding, a list filled in a custom ``compute_loss`` or in a callback is named as
its methods spell it, with the line; the scalars reach ``trainer.log``; results, exceptions
and hooks are as without memsentry."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import optimizer_post_hooks
from torch.utils.data import Dataset

import memsentry
from memsentry import LeakWarning, Severity

transformers = pytest.importorskip("transformers", reason="the Hugging Face tests need "
                                   "transformers (pip install 'memsentry[hf]')")
from memsentry.integrations.transformers import MemsentryCallback  # noqa: E402

THIS = Path(__file__).name
STEPS = 2 * 64 // 8  # two epochs of 64 samples in batches of 8


class Tokens(Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int = 64) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 100, (n, 16), generator=generator)
        self.labels = torch.randint(0, 2, (n,), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


class KeepsLosses(transformers.Trainer):
    """A Trainer whose compute_loss keeps every loss with its graph."""

    def __init__(self, *args: Any, fail_at: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.losses: list[torch.Tensor] = []
        self.fail_at = fail_at

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False,
                     **kwargs: Any) -> Any:
        outputs = model(**inputs)
        if self.fail_at is not None and self.state.global_step == self.fail_at:
            raise RuntimeError(f"bad step {self.state.global_step}")
        self.losses.append(outputs.loss)
        return (outputs.loss, outputs) if return_outputs else outputs.loss


class Probe(transformers.TrainerCallback):
    """A user's callback that runs the model on a probe batch after each step, autograd on,
    and keeps the logits."""

    def __init__(self) -> None:
        self.probe_logits: list[torch.Tensor] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = kwargs["model"]
        self.probe_logits.append(model(input_ids=torch.arange(16)[None]).logits)


def model() -> Any:
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64,
                                     max_position_embeddings=32)
    return transformers.BertForSequenceClassification(config)


def train(tmp_path: Path, callbacks: list[Any], trainer_class: type = transformers.Trainer,
          **options: Any) -> Any:
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), num_train_epochs=2, per_device_train_batch_size=8,
        report_to=[], save_strategy="no", logging_steps=4, use_cpu=True, disable_tqdm=True,
        seed=0, data_seed=0)
    trainer = trainer_class(model=model(), args=args, train_dataset=Tokens(),
                            callbacks=callbacks, **options)
    trainer.train()
    return trainer


def leaks(report: memsentry.Report) -> list[memsentry.Finding]:
    return [f for f in report.findings if f.severity is Severity.LEAK]


def line_of(finding: memsentry.Finding) -> str:
    assert finding.location is not None and finding.location.file.endswith(THIS)
    return Path(__file__).read_text().splitlines()[finding.location.line - 1]


def test_a_clean_trainer_gives_no_finding(tmp_path: Path) -> None:
    callback = MemsentryCallback(print_report=False, overhead=None)  # a row a step: no budget
    trainer = train(tmp_path, [callback])
    report = callback.report
    assert report is not None
    assert report.findings == ()
    steps = [it for it in report.iterations if it.boundary is memsentry.Boundary.OPTIMIZER]
    assert len(steps) == STEPS
    assert any(layer.type == "BertLayer" for layer in report.layers)
    logged = [h for h in trainer.state.log_history if "memsentry/peak_bytes" in h]
    assert len(logged) == 1 and logged[0]["memsentry/leaks"] == 0.0
    assert logged[0]["memsentry/peak_bytes"] == float(report.peak)


def test_a_loss_kept_in_compute_loss_is_named_as_self_losses(tmp_path: Path) -> None:
    callback = MemsentryCallback(print_report=False, on_leak="ignore",
                                 report_path=tmp_path / "report.json")
    trainer = train(tmp_path, [callback], KeepsLosses)
    assert callback.report is not None
    [leak] = leaks(callback.report)
    assert leak.rule == "tensor-accumulation"
    assert leak.subject is not None and leak.subject.name == "self.losses"
    assert "the Trainer KeepsLosses" in leak.message
    assert "self.losses.append(outputs.loss)" in line_of(leak)
    logged = [h for h in trainer.state.log_history if "memsentry/leaks" in h]
    assert logged[-1]["memsentry/leaks"] == 1.0
    assert logged[-1]["memsentry/growth_bytes_per_iter"] > 0
    saved = json.loads((tmp_path / "report.json").read_text())
    assert [f["rule"] for f in saved["findings"]] == ["tensor-accumulation"]


def test_a_callback_that_keeps_outputs_is_named_as_self_probe_logits(tmp_path: Path) -> None:
    callback = MemsentryCallback(print_report=False, on_leak="ignore")
    train(tmp_path, [Probe(), callback])
    assert callback.report is not None
    found = leaks(callback.report)
    assert [f.subject.name for f in found if f.subject] == ["self.probe_logits"]
    assert "the callback Probe" in found[0].message
    assert "self.probe_logits.append" in line_of(found[0])


class KeepsEvalLogits:
    """A ``preprocess_logits_for_metrics`` that keeps every evaluation batch's logits."""

    def __init__(self) -> None:
        self.kept: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.kept.append(logits)
        return logits.argmax(-1)


def accuracy(prediction: Any) -> dict[str, float]:
    return {"accuracy": float((prediction.predictions == prediction.label_ids).mean())}


def test_outputs_kept_by_each_evaluation_are_found_in_three_epochs(tmp_path: Path) -> None:
    # The list grows only while the trainer evaluates, at each epoch's end (iterations 7, 15
    # and 23): the censuses taken after the evaluations (15 and 23; 7 is next to the one of
    # 6) see it grow; the doubling schedule alone (2, 3, 4, 6, 10, 18) would see it twice.
    keeper = KeepsEvalLogits()
    callback = MemsentryCallback(print_report=False, on_leak="ignore")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), num_train_epochs=3, per_device_train_batch_size=8,
        per_device_eval_batch_size=8, eval_strategy="epoch", report_to=[], save_strategy="no",
        use_cpu=True, disable_tqdm=True, seed=0, data_seed=0)
    transformers.Trainer(model=model(), args=args, train_dataset=Tokens(),
                         eval_dataset=Tokens(32), callbacks=[callback],
                         preprocess_logits_for_metrics=keeper,
                         compute_metrics=accuracy).train()  # the chained call, as users write it
    assert len(keeper.kept) == 3 * 4
    assert callback.report is not None
    [leak] = leaks(callback.report)
    assert leak.rule == "tensor-accumulation"
    assert leak.subject is not None and leak.subject.name == "keeper.kept"
    assert "self.kept.append(logits)" in line_of(leak)


def test_results_are_bitwise_the_same_with_the_callback(tmp_path: Path) -> None:
    plain = train(tmp_path / "a", [], KeepsLosses)
    tracked = train(tmp_path / "b", [MemsentryCallback(print_report=False, on_leak="ignore")],
                    KeepsLosses)
    assert [x.item() for x in plain.losses] == [x.item() for x in tracked.losses]
    for a, b in zip(plain.model.state_dict().values(), tracked.model.state_dict().values(),
                    strict=True):
        assert torch.equal(a, b)


def test_findings_go_to_the_transformers_log_and_warn_at_the_users_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    hf_logger = logging.getLogger("transformers")
    hf_logger.addHandler(handler)
    try:
        with pytest.warns(LeakWarning, match="self.losses") as caught:
            train(tmp_path, [MemsentryCallback()], KeepsLosses)
    finally:
        hf_logger.removeHandler(handler)
    assert any(Path(w.filename).name == THIS for w in caught if w.category is LeakWarning)
    logged = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert any(m.startswith("memsentry: LEAK tensor-accumulation: `self.losses`")
               for m in logged)
    assert "Findings (1)" in capsys.readouterr().out


def test_an_exception_comes_out_unchanged_with_no_hook_left(tmp_path: Path) -> None:
    callback = MemsentryCallback(print_report=False)
    with pytest.raises(RuntimeError, match="bad step 3") as caught:
        train(tmp_path, [callback], KeepsLosses, fail_at=3)
    assert caught.traceback[-1].name == "compute_loss"
    assert not optimizer_post_hooks()
    assert not torch.nn.modules.module._global_forward_hooks
    assert callback.report is not None and len(callback.report.iterations) >= 3


def test_a_plain_accelerate_loop_is_tracked_with_track() -> None:
    accelerate = pytest.importorskip("accelerate")

    def run(tracked: bool) -> tuple[list[float], memsentry.Report | None]:
        accelerator = accelerate.Accelerator(cpu=True)
        net = model()
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
        loader = torch.utils.data.DataLoader(Tokens(), batch_size=8)
        net, optimizer, loader = accelerator.prepare(net, optimizer, loader)
        kept, seen = [], []
        tracker = memsentry.track(net, on_leak="ignore")
        if tracked:
            tracker.start()
        for batch in loader:
            loss = net(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            kept.append(loss)  # the leak
            seen.append(loss.item())
        return seen, tracker.stop() if tracked else None

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        plain, _ = run(False)
        seen, report = run(True)
    assert plain == seen
    assert report is not None
    [leak] = leaks(report)
    assert leak.subject is not None and leak.subject.name == "kept"
    assert "a local of run()" in leak.message


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_runs_bitwise_and_gives_no_finding(tmp_path: Path,
                                                                   reentrant: bool) -> None:
    """``gradient_checkpointing=True`` in both modes: the recomputed forwards are no steps and
    no leak (only the losses the trainer keeps on purpose), and the results are those of the
    run without memsentry."""

    def run(where: Path, callbacks: list[Any]) -> Any:
        args = transformers.TrainingArguments(
            output_dir=str(where), num_train_epochs=1, per_device_train_batch_size=8,
            report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
            data_seed=0, gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        trainer = KeepsLosses(model=model(), args=args, train_dataset=Tokens(),
                              callbacks=callbacks)
        trainer.train()
        return trainer

    callback = MemsentryCallback(print_report=False, on_leak="ignore")
    plain, tracked = run(tmp_path / "a", []), run(tmp_path / "b", [callback])
    assert [x.item() for x in plain.losses] == [x.item() for x in tracked.losses]
    for a, b in zip(plain.model.state_dict().values(), tracked.model.state_dict().values(),
                    strict=True):
        assert torch.equal(a, b)
    report = callback.report
    assert report is not None  # the losses KeepsLosses keeps, and nothing else
    assert [f.subject.name for f in leaks(report) if f.subject is not None] == ["self.losses"]
    steps = [it for it in report.iterations if it.boundary is memsentry.Boundary.OPTIMIZER]
    assert len(steps) == STEPS // 2
    assert any("inside backward passes" in note for note in report.notes)
