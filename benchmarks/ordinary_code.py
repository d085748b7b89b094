"""Ordinary training code under memsentry, each run twice (without memsentry, then under its
integration callback) and compared: weights bit for bit, and what the code made.

- ``lightning``: an EMA teacher deep-copied at fit start and updated every batch, a copy of the
  whole LightningModule every 5 batches ("the best so far"), ``torch.save`` and
  ``torch.jit.script`` of its body, ModelCheckpoint on.
- ``transformers``: a tiny GPT-2 (built from a config, nothing downloaded) trained by
  ``transformers.Trainer`` saving a checkpoint every 4 steps, with a callback deep-copying the
  model every 4 steps.

    python benchmarks/ordinary_code.py lightning|transformers

Prints one line per check; exits 1 when one fails. Figures in benchmarks/README.md.
"""

from __future__ import annotations

import copy
import io
import os
import shutil
import sys
import tempfile
import warnings
from typing import Any

import torch
from torch import nn


def _hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def lightning_run(tracked: bool, root: str) -> dict[str, Any]:
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from memsentry.integrations.lightning import MemsentryCallback

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.body(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    class Ema(L.Callback):
        def on_fit_start(self, trainer: Any, module: Any) -> None:
            self.teacher = copy.deepcopy(module.body)
            self.saved: list[bytes] = []
            self.best: Any = None

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any,
                               index: int) -> None:
            with torch.no_grad():
                for t, s in zip(self.teacher.parameters(), module.body.parameters(),
                                strict=True):
                    t.mul_(0.9).add_(s, alpha=0.1)
            if index % 5 == 0:
                self.best = copy.deepcopy(module)
                buffer = io.BytesIO()
                torch.save(module.body, buffer)
                self.saved.append(buffer.getvalue())
                torch.jit.script(module.body)

    L.seed_everything(0, verbose=False)
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256, 16, generator=generator),
                         torch.randn(256, 1, generator=generator))
    ema = Ema()
    trainer = L.Trainer(max_epochs=2, callbacks=[ema, *([MemsentryCallback()] if tracked else [])],
                        logger=False, default_root_dir=root, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu")
    model = Net()
    trainer.fit(model, DataLoader(data, batch_size=16))
    return {"weights": [p.detach() for p in model.parameters()],
            "teacher": [p.detach() for p in ema.teacher.parameters()],
            "saved files": len(ema.saved),
            "files naming memsentry": sum(b"memsentry" in s for s in ema.saved),
            "hooks on the copy": _hooks(ema.best)}


def transformers_run(tracked: bool, root: str) -> dict[str, Any]:
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from memsentry.integrations.transformers import MemsentryCallback

    class Best(TrainerCallback):
        best: Any = None

        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None,
                        **kwargs: Any) -> None:
            if state.global_step % 4 == 0:
                self.best = copy.deepcopy(model)

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100,
                                       n_positions=32))
    ids = torch.randint(0, 100, (64, 16), generator=torch.Generator().manual_seed(0))
    best = Best()
    args = TrainingArguments(root, max_steps=12, per_device_train_batch_size=8, save_steps=4,
                             logging_steps=100, report_to=[], use_cpu=True, seed=0,
                             data_seed=0, disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in ids],
            callbacks=[best, *([MemsentryCallback()] if tracked else [])]).train()
    return {"weights": [p.detach() for p in model.parameters()],
            "checkpoints": sorted(os.listdir(root)), "hooks on the copy": _hooks(best.best)}


def main(which: str) -> int:
    warnings.filterwarnings("ignore")
    run = {"lightning": lightning_run, "transformers": transformers_run}[which]
    results = []
    for tracked in (False, True):
        root = tempfile.mkdtemp(prefix="memsentry-ordinary-")
        try:
            results.append(run(tracked, root))
        finally:
            shutil.rmtree(root, ignore_errors=True)
    plain, under = results
    failed = 0
    for key in plain:
        same = _same(plain[key], under[key]) if key in ("weights", "teacher") \
            else plain[key] == under[key]
        failed += not same
        shown = "bitwise equal" if key in ("weights", "teacher") else under[key]
        print(f"{which}: {key}: {shown if same else 'DIFFERS'} (without memsentry: "
              f"{'the same' if same else plain[key]})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "lightning"))
