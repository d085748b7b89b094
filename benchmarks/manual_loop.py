"""What memsentry costs a tiny loop whose weights are updated by hand (no torch.optim): its
iterations end at the ends of backward passes (issue 24). Blocks of 3,000 steps of
Linear(4,4)-ReLU-Linear(4,1), batch 8, without memsentry, under track() and under watch(), in a
shuffled order each round (seeded), one thread; each block's report is made inside it.

    python benchmarks/manual_loop.py 9          # rounds
    python benchmarks/manual_loop.py 5 cuda     # rounds, device
"""

from __future__ import annotations

import random
import statistics
import sys
import time

import torch
from torch import nn

import memsentry

STEPS = 3000
MODES = ("baseline", "track", "watch")


def main(rounds: int, device: str = "cpu") -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1)).to(device)
    x, y = torch.randn(8, 4, device=device), torch.randn(8, 1, device=device)

    def settle() -> None:
        if x.is_cuda:
            torch.cuda.synchronize(x.device)

    def step() -> None:
        loss = nn.functional.mse_loss(model(x), y)
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.01 * p.grad

    def block(mode: str) -> float:
        settle()
        started = time.perf_counter()
        if mode == "baseline":
            for _ in range(STEPS):
                step()
        else:
            make = memsentry.watch if mode == "watch" else memsentry.track
            with make(model, on_leak="ignore") as tracker:
                for _ in range(STEPS):
                    step()
            tracker.report()
        settle()
        return (time.perf_counter() - started) / STEPS * 1e6

    for mode in MODES:  # untimed: first-call caches
        block(mode)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    order = random.Random(0)
    for _ in range(rounds):
        modes = list(MODES)
        order.shuffle(modes)
        for mode in modes:
            times[mode].append(block(mode))
    _print(times)


def _print(times: dict[str, list[float]]) -> None:
    base = statistics.median(times["baseline"])
    for mode, values in times.items():
        median = statistics.median(values)
        print(f"{mode:9} {median:7.1f} us a step  {median / base:.3f}x "
              f"({min(values) / base:.3f}-{max(values) / base:.3f})")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5, sys.argv[2] if len(sys.argv) > 2 else "cpu")
