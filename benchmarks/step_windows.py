"""Where a long block's extra time goes: step times by window, untracked and under memsentry.

``cost.py`` gives one ratio per block. On an H100 (2026-11-26) the Transformer's ratio grew with
the block's length (1.06x at 300 iterations, 1.10x at 1,000, 1.32x at 2,000) while memsentry's
own ledger stayed at its budget. This script looks inside such blocks. For each mode it runs
blocks of N iterations of one of ``cost.py``'s loops and records, per block:

* the median step time of each window of W iterations (a step's time is taken on the host, as
  the loop issues it; the block's total waits for the device at its end);
* the block's wall time, the main thread's CPU time and the whole process's CPU time (a wall
  time above the main thread's CPU time is waiting; process CPU above it is other threads);
* Python's garbage collections during the block: how many of each generation and their time;
* the objects the collector tracks at the block's end;
* on CUDA, the caching allocator's device allocations and frees during the block, and its
  retries after a failed allocation;
* for memsentry's modes, the ledger's own seconds and share.

    python benchmarks/step_windows.py --device cuda --iterations 2000 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cost import LOOPS, MODES, Loop, _settle


class Collections:
    """Python's garbage collections while it is installed: counts and seconds per generation."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            generation = info["generation"]
            self.count[generation] += 1
            self.seconds[generation] += time.perf_counter() - self._started

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        gc.callbacks.append(self)
        try:
            yield
        finally:
            gc.callbacks.remove(self)


def _allocator(device: torch.device) -> dict[str, int]:
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {key: int(stats.get(key, 0)) for key in
            ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")}


def run_block(loop: Loop, mode: str, iterations: int, window: int,
              device: torch.device) -> dict[str, Any]:
    """One block as ``cost.py`` runs it (the tool's start, the steps, its stop and report),
    each step's end stamped."""
    stamps = [0.0] * (iterations + 1)
    collections = Collections()
    out: dict[str, Any] = {}
    before = _allocator(device)
    _settle(loop)
    wall0, thread0, process0 = time.perf_counter(), time.thread_time(), time.process_time()
    with collections.installed():
        with MODES[mode](loop, out) as step:
            stamps[0] = time.perf_counter()
            for index in range(1, iterations + 1):
                step()
                stamps[index] = time.perf_counter()
            _settle(loop)
    report = out.get("report")
    wall = time.perf_counter() - wall0
    thread_cpu, process_cpu = time.thread_time() - thread0, time.process_time() - process0
    after = _allocator(device)
    steps = [b - a for a, b in itertools.pairwise(stamps)]
    windows = [statistics.median(steps[i:i + window]) * 1e3
               for i in range(0, len(steps), window)]
    result: dict[str, Any] = {
        "wall_s": wall, "main_thread_cpu_s": thread_cpu, "process_cpu_s": process_cpu,
        "steps_s": stamps[-1] - stamps[0], "window_median_ms": windows,
        "gc_count": collections.count, "gc_s": collections.seconds,
        "gc_tracked_objects": len(gc.get_objects()),
        "allocator": {key: after[key] - before[key] for key in after},
    }
    if report is not None and report.cost is not None:
        cost = report.cost
        result["ledger"] = {
            "own_s": cost.own_seconds, "share": cost.share, "loop_s": cost.loop_seconds,
            "sampled": cost.sampled, "iterations": cost.iterations,
            "parts_s": {p.part: p.seconds for p in cost.parts},
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loop", default="transformer", choices=sorted(LOOPS))
    parser.add_argument("--modes", default="baseline,track,watch")
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--window", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available on this machine")
    if args.window < 1 or args.iterations < args.window:
        parser.error(f"--window {args.window} must be between 1 and --iterations "
                     f"({args.iterations})")
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in ("baseline", "track", "watch")]
    if unknown:
        parser.error(f"--modes: unknown mode(s) {unknown}; use baseline, track, watch")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    loop = LOOPS[args.loop](args.iterations).to(device)
    for mode in modes:
        run_block(loop, mode, args.warmup, args.warmup, device)
    rng = random.Random(args.seed)
    blocks: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for round_index in range(args.rounds):
        order = modes[:]
        rng.shuffle(order)
        for mode in order:
            block = run_block(loop, mode, args.iterations, args.window, device)
            blocks[mode].append(block)
            windows = " ".join(f"{w:.2f}" for w in block["window_median_ms"])
            share = block.get("ledger", {}).get("share")
            print(f"round {round_index} {mode:8s} wall {block['wall_s']:.2f}s main-cpu "
                  f"{block['main_thread_cpu_s']:.2f}s proc-cpu {block['process_cpu_s']:.2f}s "
                  f"gc {block['gc_count']} {sum(block['gc_s']):.3f}s objs "
                  f"{block['gc_tracked_objects']:,} alloc {block['allocator']} share "
                  f"{share if share is None else round(share, 4)}\n    windows ms: {windows}",
                  flush=True)
    header = (f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
              f"{platform.platform()}, Python {platform.python_version()}, torch "
              f"{torch.__version__}, {os.cpu_count()} CPUs, device {device}"
              + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""))
    print(header)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"header": header, "loop": args.loop, "iterations": args.iterations,
                       "window": args.window, "blocks": blocks}, handle, indent=1)


if __name__ == "__main__":
    main()
