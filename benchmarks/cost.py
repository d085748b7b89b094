"""What memsentry costs a loop, whole and part by part (issue 24).

For each loop, blocks of N iterations run under each mode, the modes interleaved in a shuffled
order every round (seeded), all in one process with one thread. A block is what a user pays:
the tool's start, N iterations, its stop and (for memsentry) its report. ``ratio`` is the
median over rounds of a block's wall time divided by the baseline block of the same round,
with the lowest and highest ratio.

For memsentry's modes the report's ledger (``report.cost``) gives the breakdown: microseconds
per iteration for each part (module hooks, saved tensors, backward hooks, boundaries, parts,
censuses, analysis), microseconds per hook call, milliseconds per census, the iterations
measured layer by layer (sampled) and the censuses put off; plus what one read of glibc's
heap counters costs in that process now (``mallinfo2``, the CPU backend's reading).

Loops:

* ``tiny``: ``Linear(4,4)-ReLU-Linear(4,1)``, batch 8, MSE, SGD (about 0.3 ms a step here);
* ``mlp``: 784-1024-1024-512-10, batch 128, cross-entropy, Adam;
* ``transformer``: a 4-layer encoder (d_model 256, nhead 4, ff 512), batch 16 x 64, Adam;
* ``wide``: 1,000 blocks of ``Linear(8,8)-ReLU`` (2,001 modules), batch 4, SGD.

Modes: ``baseline``; ``track`` (``memsentry.track(model, on_leak="ignore")``, defaults);
``watch`` (``memsentry.watch(model, on_leak="ignore")``); ``profiler``
(``torch.profiler.profile(activities=[CPU], profile_memory=True)``, its ``key_averages()``
after the block); ``memtracker`` (``torch.distributed._tools.mem_tracker.MemTracker``,
``track_external(model, optimizer)``, ``reset_mod_stats()`` every iteration as it requires).

    python benchmarks/cost.py --rounds 5 --json benchmarks/cost-results.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import torch
from torch import nn

import memsentry
from memsentry.measure.cpu import MallinfoBackend


@dataclass
class Loop:
    name: str
    shape: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    inputs: torch.Tensor
    targets: torch.Tensor
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    iterations: int

    def to(self, device: torch.device) -> Loop:
        """The same loop on ``device`` (model, optimizer state and batch)."""
        self.model.to(device)
        self.inputs, self.targets = self.inputs.to(device), self.targets.to(device)
        return self

    def step(self) -> None:
        loss = self.loss_fn(self.model(self.inputs), self.targets)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()


def _tiny(n: int | None) -> Loop:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    return Loop("tiny", "Linear(4,4)-ReLU-Linear(4,1), batch 8, MSE, SGD", model,
                torch.optim.SGD(model.parameters(), lr=0.01), torch.randn(8, 4),
                torch.randn(8, 1), nn.functional.mse_loss, n or 3000)


def _mlp(n: int | None) -> Loop:
    model = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                          nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 10))
    return Loop("mlp", "MLP 784-1024-1024-512-10, batch 128, cross-entropy, Adam", model,
                torch.optim.Adam(model.parameters(), lr=1e-4), torch.randn(128, 784),
                torch.randint(0, 10, (128,)), nn.functional.cross_entropy, n or 100)


def _transformer(n: int | None) -> Loop:
    layer = nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=512,
                                       batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False)
    return Loop("transformer", "TransformerEncoder 4 layers, d_model 256, batch 16 x 64, Adam",
                model, torch.optim.Adam(model.parameters(), lr=1e-4),
                torch.randn(16, 64, 256), torch.randn(16, 64, 256), nn.functional.mse_loss,
                n or 40)


def _wide(n: int | None) -> Loop:
    model = nn.Sequential(*[m for _ in range(1000) for m in (nn.Linear(8, 8), nn.ReLU())])
    return Loop("wide", "1,000 x (Linear(8,8)-ReLU): 2,001 modules, batch 4, SGD", model,
                torch.optim.SGD(model.parameters(), lr=1e-3), torch.randn(4, 8),
                torch.randn(4, 8), nn.functional.mse_loss, n or 12)


LOOPS: dict[str, Callable[[int | None], Loop]] = {
    "tiny": _tiny, "mlp": _mlp, "transformer": _transformer, "wide": _wide}


@contextlib.contextmanager
def _baseline(loop: Loop, out: dict[str, Any]) -> Iterator[Callable[[], None]]:
    yield loop.step


@contextlib.contextmanager
def _memsentry(loop: Loop, out: dict[str, Any], *, watch: bool) -> Iterator[Callable[[], None]]:
    make = memsentry.watch if watch else memsentry.track
    tracker = make(loop.model, on_leak="ignore")
    with tracker:
        yield loop.step
    report = tracker.report()
    out["report"] = report


@contextlib.contextmanager
def _profiler(loop: Loop, out: dict[str, Any]) -> Iterator[Callable[[], None]]:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if loop.inputs.is_cuda:
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, profile_memory=True) as prof:
        yield loop.step
    prof.key_averages()


@contextlib.contextmanager
def _memtracker(loop: Loop, out: dict[str, Any]) -> Iterator[Callable[[], None]]:
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(loop.model, loop.optimizer)

    def step() -> None:
        loop.step()
        tracker.reset_mod_stats()

    with tracker:
        yield step
    tracker.get_tracker_snapshot("peak")


MODES = {
    "baseline": _baseline,
    "track": lambda loop, out: _memsentry(loop, out, watch=False),
    "watch": lambda loop, out: _memsentry(loop, out, watch=True),
    "profiler": _profiler,
    "memtracker": _memtracker,
}


def _settle(loop: Loop) -> None:
    """Wait for the device's queued work, so that a block's clock covers all of it."""
    if loop.inputs.is_cuda:
        torch.cuda.synchronize(loop.inputs.device)


def run_block(loop: Loop, mode: str, iterations: int | None = None) -> tuple[float,
                                                                           dict[str, Any]]:
    out: dict[str, Any] = {}
    _settle(loop)
    started = time.perf_counter()
    with MODES[mode](loop, out) as step:
        for _ in range(loop.iterations if iterations is None else iterations):
            step()
        _settle(loop)
    return time.perf_counter() - started, out


def breakdown(report: memsentry.Report) -> dict[str, Any]:
    cost = report.cost
    assert cost is not None
    iterations = max(cost.iterations, 1)
    return {
        "iterations": cost.iterations, "sampled": cost.sampled,
        "censuses": cost.part("censuses").events, "deferred": cost.censuses_deferred,
        "loop_s": cost.loop_seconds, "own_s": cost.own_seconds, "share": cost.share,
        "us_per_iteration": {p.part: p.seconds / iterations * 1e6 for p in cost.parts},
        "us_per_hook_call": cost.part("module hooks").each * 1e6,
        "ms_per_census": cost.part("censuses").each * 1e3,
        "leaks": sum(f.severity is memsentry.Severity.LEAK for f in report.findings),
    }


def mallinfo_read_us() -> float:
    try:
        return MallinfoBackend().sample_cost(50) * 1e6
    except RuntimeError:
        return float("nan")


def measure(name: str, modes: list[str], rounds: int, seed: int,
            iterations: int | None, device: torch.device) -> dict[str, Any]:
    torch.manual_seed(0)
    loop = LOOPS[name](iterations).to(device)
    rng = random.Random(seed)
    for mode in modes:  # one untimed block each (at most 200 steps): imports, first-call caches
        run_block(loop, mode, min(loop.iterations, 200))
    walls: dict[str, list[float]] = {m: [] for m in modes}
    parts: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for _ in range(rounds):
        order = modes[:]
        rng.shuffle(order)
        for mode in order:
            wall, out = run_block(loop, mode)
            walls[mode].append(wall)
            if "report" in out:
                parts[mode].append(breakdown(out["report"]))
        print(f"  {name}: round done", file=sys.stderr, flush=True)
    base = walls["baseline"]
    result: dict[str, Any] = {"shape": loop.shape, "iterations": loop.iterations,
                              "device": str(device),
                              "mallinfo_read_us": mallinfo_read_us(), "modes": {}}
    for mode in modes:
        ratios = [w / b for w, b in zip(walls[mode], base, strict=True)]
        result["modes"][mode] = {
            "wall_s": statistics.median(walls[mode]), "ratio": statistics.median(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios),
            "ledger": parts[mode][len(parts[mode]) // 2] if parts[mode] else None,
        }
    return result


def table(results: dict[str, Any]) -> str:
    lines = ["| loop | mode | wall s (median) | ratio median (min-max) | sampled / iterations "
             "| censuses (put off) | us/iter by part | us/hook call | ms/census |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, result in results.items():
        for mode, m in result["modes"].items():
            ledger = m["ledger"]
            if ledger is None:
                extra = "| - | - | - | - | - |"
            else:
                per = ", ".join(f"{part} {us:.1f}" for part, us in
                                ledger["us_per_iteration"].items() if us >= 0.05)
                extra = (f"| {ledger['sampled']} / {ledger['iterations']} | "
                         f"{ledger['censuses']} ({ledger['deferred']}) | {per} | "
                         f"{ledger['us_per_hook_call']:.1f} | {ledger['ms_per_census']:.1f} |")
            lines.append(f"| {name} | {mode} | {m['wall_s']:.3f} | {m['ratio']:.3f}x "
                         f"({m['ratio_min']:.3f}-{m['ratio_max']:.3f}) {extra}")
    return "\n".join(lines)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loops", default="tiny,mlp,transformer,wide")
    parser.add_argument("--modes", default="baseline,track,watch,profiler,memtracker")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=None,
                        help="iterations per block (default: per loop)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu",
                        help="where the loops run (cpu, cuda, cuda:1); default cpu")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available on this machine")
    torch.set_num_threads(1)
    modes = ["baseline", *[m for m in args.modes.split(",") if m != "baseline"]]
    started = datetime.now(timezone.utc)
    results = {name: measure(name, modes, args.rounds, args.seed, args.iterations, device)
               for name in args.loops.split(",")}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    header = (f"{started:%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, "
              f"{platform.platform()}, Python {platform.python_version()}, torch "
              f"{torch.__version__} (1 thread), memsentry at {commit}, rounds {args.rounds}, "
              f"device {_device_name(device)}")
    print(header)
    print(table(results))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"header": header, "results": results}, handle, indent=1)


if __name__ == "__main__":
    main()
