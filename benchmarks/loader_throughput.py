"""DataLoader throughput with and without memsentry (issue 26): batches per second of a
2-worker loader over a list-of-dicts dataset, with a small model's step per batch.

Each round runs one epoch under each mode (plain, ``track()``, ``watch()``) in a shuffled
order; the figure is the median over rounds of each mode's batches per second, and the ratio
to plain in the same round (median, min-max).

    python benchmarks/loader_throughput.py --rounds 5 \
        --json benchmarks/loader-throughput-results.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import memsentry


class Records(Dataset[tuple[torch.Tensor, int]]):
    def __init__(self, size: int) -> None:
        self.records = [{"features": [float(i % 97)] * 16, "label": i % 10, "id": f"s{i}"}
                        for i in range(size)]

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        record = self.records[index]
        return torch.tensor(record["features"]), record["label"]


@contextlib.contextmanager
def _mode(name: str, model: nn.Module) -> Iterator[None]:
    if name == "plain":
        yield
    elif name == "track":
        with memsentry.track(model, on_leak="ignore"):
            yield
    else:
        with memsentry.watch(model, on_leak="ignore"):
            yield


def _epoch(loader: DataLoader[Any], model: nn.Module, opt: torch.optim.Optimizer) -> int:
    batches = 0
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        batches += 1
    return batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--size", type=int, default=200_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dataset = Records(args.size)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    modes = ["plain", "track", "watch"]
    rates: dict[str, list[float]] = {m: [] for m in modes}
    ratios: dict[str, list[float]] = {m: [] for m in modes}
    rng = random.Random(0)
    for round_ in range(args.rounds):
        order = modes[:]
        rng.shuffle(order)
        this: dict[str, float] = {}
        for mode in order:
            loader = DataLoader(dataset, batch_size=256, num_workers=args.workers,
                                shuffle=True)
            began = time.perf_counter()
            with _mode(mode, model):
                batches = _epoch(loader, model, opt)
            this[mode] = batches / (time.perf_counter() - began)
        for mode in modes:
            rates[mode].append(this[mode])
            ratios[mode].append(this[mode] / this["plain"])
        print(f"round {round_ + 1}: " + ", ".join(f"{m} {this[m]:.1f}/s" for m in modes),
              file=sys.stderr)
    rows = {m: {"batches_per_second": statistics.median(rates[m]),
                "ratio_median": statistics.median(ratios[m]),
                "ratio_min": min(ratios[m]), "ratio_max": max(ratios[m])} for m in modes}
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{when}, {platform.machine()}, Python {platform.python_version()}, torch "
          f"{torch.__version__} (1 thread), {args.workers} workers, {args.size:,} records, "
          f"rounds {args.rounds}")
    print("| mode | batches/s (median) | vs plain, median (min-max) |\n|---|---|---|")
    for mode, row in rows.items():
        print(f"| {mode} | {row['batches_per_second']:.1f} | {row['ratio_median']:.3f}x "
              f"({row['ratio_min']:.3f}-{row['ratio_max']:.3f}) |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump({"when": when, "rounds": args.rounds, "workers": args.workers,
                       "records": args.size, "torch": torch.__version__, "modes": rows},
                      out, indent=2)


if __name__ == "__main__":
    main()
