"""What memsentry costs a short run whose iterations are long: a REINFORCE-shaped loop (issue
24). Each step runs a small policy (Linear(4,128)-Dropout-ReLU-Linear(128,2)-softmax) on one
random state and samples an action from a ``Categorical``; each episode of ``--steps`` steps
ends with one Adam step on the summed log-probabilities. No environment: the states are random,
so nothing here is public code.

Blocks of ``--episodes`` episodes run without memsentry, under ``track()`` and under
``watch()`` (no model given: global hooks, as ``memsentry run`` does), in a shuffled order each
round (seeded), one thread; a block includes the tool's start, its stop and its report. The
figure is the median over rounds of each block's time over the same round's untracked block,
with the lowest and highest; and memsentry's ledger (``report.cost``) of the last block of each
mode: the iterations sampled and the seconds of each part.

    python benchmarks/episodes.py --rounds 15 --episodes 30 [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import torch
from torch import nn
from torch.distributions import Categorical

import memsentry

MODES = ("baseline", "track", "watch")


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(4, 128)
        self.dropout = nn.Dropout(0.6)
        self.out = nn.Linear(128, 2)

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.out(torch.relu(self.dropout(self.hidden(state)))), dim=1)


class Agent:
    def __init__(self, steps: int) -> None:
        self.policy = Policy()
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=1e-2)
        self.steps = steps

    def episode(self) -> None:
        log_probs = []
        for _ in range(self.steps):
            probs = self.policy(torch.randn(1, 4))
            action = Categorical(probs)
            log_probs.append(action.log_prob(action.sample()))
        loss = -torch.cat(log_probs).sum()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()


def block(agent: Agent, mode: str, episodes: int) -> tuple[float, memsentry.Report | None]:
    started = time.perf_counter()
    if mode == "baseline":
        for _ in range(episodes):
            agent.episode()
        return time.perf_counter() - started, None
    make = memsentry.watch if mode == "watch" else memsentry.track
    with make(on_leak="ignore") as tracker:
        for _ in range(episodes):
            agent.episode()
    report = tracker.report()
    return time.perf_counter() - started, report


def ledger(report: memsentry.Report) -> dict[str, Any]:
    cost = report.cost
    assert cost is not None
    return {"iterations": cost.iterations, "sampled": cost.sampled,
            "share": round(cost.share, 4),
            "ms_by_part": {p.part: round(p.seconds * 1e3, 1) for p in cost.parts}}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--episodes", type=int, default=30)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    agent = Agent(args.steps)
    for _ in range(5):  # warm up: first calls, Adam's state
        agent.episode()
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    ledgers: dict[str, dict[str, Any]] = {}
    order = random.Random(args.seed)
    for _ in range(args.rounds):
        modes = list(MODES)
        order.shuffle(modes)
        for mode in modes:
            spent, report = block(agent, mode, args.episodes)
            seconds[mode].append(spent)
            if report is not None:
                ledgers[mode] = ledger(report)
    results: dict[str, Any] = {"rounds": args.rounds, "episodes": args.episodes,
                               "steps": args.steps, "torch": torch.__version__,
                               "baseline_s": statistics.median(seconds["baseline"])}
    print(f"{args.rounds} rounds of {args.episodes} episodes x {args.steps} steps; "
          f"untracked block {results['baseline_s']:.2f} s (median)")
    for mode in MODES[1:]:
        ratios = [a / b for a, b in zip(seconds[mode], seconds["baseline"], strict=True)]
        results[mode] = {"ratio": statistics.median(ratios), "min": min(ratios),
                         "max": max(ratios), "ledger": ledgers[mode]}
        print(f"{mode}: {statistics.median(ratios):.3f}x ({min(ratios):.2f}-{max(ratios):.2f}); "
              f"last block: {ledgers[mode]}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=2)
            handle.write("\n")


if __name__ == "__main__":
    main()
