"""What tracking costs where size makes it expensive: a model of 2,000 modules, a long loop
whose heap fragments, and a census in a process holding a 3-million-item container.

1. ``modules``: ``Sequential`` of 1,000 ``Linear(32, 32)`` + ``ReLU`` pairs (2,001 modules),
   batch 16, SGD. Each round times a block of untracked steps and a block under
   ``track(model)``, in a shuffled order; the figure is the median over rounds of the
   tracked block's mean step divided by the same round's untracked one.
2. ``transformer``: a 2-layer Transformer encoder (d_model 128, 4 heads, feed-forward 256)
   with an embedding and a head, trained for 500 iterations on batches of 16 sequences whose
   length is drawn from 8 to 192 tokens each iteration (the same draws in every run). The
   variable shapes fragment glibc's heap, which slows ``mallinfo2()``. Each round runs the
   500 iterations untracked and tracked, in a shuffled order. Also recorded: how many leaf
   layers had calls measured in the last 100 iterations (figures measured throughout), the
   fewest measured calls of a layer, and ``mallinfo2()``'s cost at the start and the end.
3. ``census``: a training loop beside a module-level list of 3 million tuples (objects the
   census must look into) and a list of 3 million ints; the longest census against its
   0.5 s budget.

    python benchmarks/scale.py [--rounds 5] [--only modules,transformer,census] [--json F]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from torch import nn

import memsentry
from memsentry.measure.cpu import MallinfoBackend

ROOT = Path(__file__).resolve().parent.parent


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def paired(base: list[float], tracked: list[float]) -> dict[str, Any]:
    ratios = [t / b for b, t in zip(base, tracked, strict=True)]
    return {
        "untracked_s": statistics.median(base), "tracked_s": statistics.median(tracked),
        "ratio_median": statistics.median(ratios), "ratios": ratios,
    }


# -- 1. a model of 2,000 modules -------------------------------------------------------------
def modules_case(rounds: int, steps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(1000):
        layers += [nn.Linear(32, 32), nn.ReLU()]
    model = nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(16, 32)

    def step() -> None:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()

    def block(tracked: bool) -> tuple[float, Any]:
        tracker = memsentry.track(model, on_leak="ignore") if tracked else None
        if tracker is not None:
            tracker.start()
        for _ in range(12):  # untimed: the full first iterations and the censuses up to 10
            step()
        started = time.perf_counter()
        for _ in range(steps):
            step()
        seconds = (time.perf_counter() - started) / steps
        report = tracker.stop() if tracker is not None else None
        return seconds, report

    base: list[float] = []
    tracked: list[float] = []
    report = None
    rng = random.Random(0)
    for _ in range(rounds):
        order = [False, True]
        rng.shuffle(order)
        for mode in order:
            seconds, r = block(mode)
            (tracked if mode else base).append(seconds)
            report = r or report
    assert report is not None
    leaves = [layer for layer in report.layers if layer.is_leaf]
    result = paired(base, tracked)
    result |= {
        "modules": len(list(model.modules())), "steps_timed": steps,
        "leaf_layers_measured": sum(1 for layer in leaves if layer.measured_calls),
        "leaf_layers": len(leaves),
        "notes": [n for n in report.notes if "in turn" in n],
    }
    return result


# -- 2. a long loop with variable sequence lengths -------------------------------------------
class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1000, 128)
        layer = nn.TransformerEncoderLayer(128, 4, 256, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(128, 1000)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


def transformer_run(iterations: int, tracked: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Encoder()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lengths = random.Random(1).choices(range(8, 193), k=iterations)
    tracker = memsentry.track(model, on_leak="ignore") if tracked else None
    cost_start = MallinfoBackend().sample_cost()
    midway: dict[str, int] = {}
    loop = 0.0
    if tracker is not None:
        tracker.start()
    for i, length in enumerate(lengths):
        started = time.perf_counter()
        tokens = torch.randint(0, 1000, (16, length))
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        loop += time.perf_counter() - started
        if tracker is not None and i == iterations - 101:  # outside the timed part
            midway = {layer.name: layer.measured_calls for layer in tracker.report().layers}
    report = tracker.stop() if tracker is not None else None
    out: dict[str, Any] = {"seconds": loop, "mallinfo2_us_start": cost_start * 1e6,
                           "mallinfo2_us_end": MallinfoBackend().sample_cost() * 1e6}
    if report is not None:
        leaves = [layer for layer in report.layers if layer.is_leaf]
        out |= {
            "leaf_layers": len(leaves),
            "measured_in_last_100": sum(1 for layer in leaves
                                        if layer.measured_calls > midway.get(layer.name, 0)),
            "fewest_measured_calls": min(layer.measured_calls for layer in leaves),
            "calls_per_layer": max(layer.calls for layer in leaves),
            "notes": [n for n in report.notes if "in turn" in n],
            "findings": [f"{f.severity.value} {f.rule}" for f in report.findings],
        }
    return out


def transformer_case(rounds: int, iterations: int) -> dict[str, Any]:
    base: list[float] = []
    tracked: list[float] = []
    runs: list[dict[str, Any]] = []
    rng = random.Random(0)
    for _ in range(rounds):
        order = [False, True]
        rng.shuffle(order)
        for mode in order:
            run = transformer_run(iterations, mode)
            (tracked if mode else base).append(run["seconds"])
            if mode:
                runs.append(run)
            print(f"  transformer {'tracked' if mode else 'untracked'}: "
                  f"{run['seconds']:.1f} s", file=sys.stderr)
    result = paired(base, tracked)
    result |= {"iterations": iterations, "tracked_runs": runs}
    return result


# -- 3. a census beside a 3-million-item container -------------------------------------------
BIG_TUPLES: list[tuple[int, int]] = []
BIG_INTS: list[int] = []


def census_case() -> dict[str, Any]:
    BIG_TUPLES.extend((i, i) for i in range(3_000_000))
    BIG_INTS.extend(range(3_000_000))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kept = []
    with memsentry.track(model, on_leak="ignore") as t:
        for _ in range(20):
            loss = model(torch.randn(32, 64)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            kept.append(torch.randn(16 * 1024))  # a leak the census must still name
    report = t.report()
    seconds = [c.seconds for c in report.censuses]
    BIG_TUPLES.clear()
    BIG_INTS.clear()
    return {
        "budget_s": 0.5, "censuses": len(seconds), "longest_s": max(seconds),
        "longest_vs_budget": max(seconds) / 0.5,
        "complete": sum(1 for c in report.censuses if c.complete),
        "leak_named": any("`kept`" in f.message for f in report.findings),
        "notes": [n for n in report.notes if "census" in n.lower()],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--iterations", type=int, default=500)
    parser.add_argument("--only", default="modules,transformer,census")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cases = set(args.only.split(","))
    unknown = cases - {"modules", "transformer", "census"}
    if unknown:
        parser.error(f"--only: unknown case(s) {', '.join(sorted(unknown))}")
    if args.json is not None and not args.json.parent.is_dir():
        parser.error(f"--json {args.json}: folder {args.json.parent} does not exist")
    torch.set_num_threads(1)
    started = time.perf_counter()
    results: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "commit": commit(),
        "machine": f"{platform.processor() or platform.machine()}, "
                   f"{platform.platform()}", "python": platform.python_version(),
        "torch": torch.__version__, "threads": 1, "rounds": args.rounds,
    }
    if "modules" in cases:
        results["modules"] = modules_case(args.rounds, args.steps)
        m = results["modules"]
        print(f"2,001-module model: untracked {m['untracked_s'] * 1e3:.1f} ms/step, tracked "
              f"{m['tracked_s'] * 1e3:.1f} ms/step, {m['ratio_median']:.3f}x (paired median); "
              f"{m['leaf_layers_measured']} of {m['leaf_layers']} leaf layers measured")
    if "transformer" in cases:
        results["transformer"] = transformer_case(args.rounds, args.iterations)
        m = results["transformer"]
        last = m["tracked_runs"][-1]
        print(f"Transformer, {args.iterations} iterations of variable length: untracked "
              f"{m['untracked_s']:.1f} s, tracked {m['tracked_s']:.1f} s, "
              f"{m['ratio_median']:.3f}x (paired median); last run: "
              f"{last['measured_in_last_100']} of {last['leaf_layers']} leaf layers measured "
              f"in the last 100 iterations, the fewest {last['fewest_measured_calls']} of "
              f"{last['calls_per_layer']} calls; mallinfo2 {last['mallinfo2_us_start']:.1f} "
              f"-> {last['mallinfo2_us_end']:.1f} us")
    if "census" in cases:
        results["census"] = census_case()
        m = results["census"]
        print(f"census beside 3M tuples + 3M ints: longest {m['longest_s']:.2f} s of a "
              f"{m['budget_s']} s budget ({m['longest_vs_budget']:.2f}x), "
              f"{m['complete']} of {m['censuses']} complete, leak named: {m['leak_named']}")
    results["seconds"] = time.perf_counter() - started
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
