"""How much a memory tool slows a CPU training step: memsentry against its peers.

Every mode runs in this one process on the same model, optimizer and batch. For each round the
modes run in a shuffled order; each mode opens its tool, runs ``--warmup`` untimed steps under
it (7 for memsentry modes that search for holders, past their censuses at iterations 2, 3, 4, 6),
then times each of a block of K steps. A step is forward, loss, backward, ``optimizer.step()`` and
``optimizer.zero_grad()``; work a tool's documented use requires after every step (MemTracker's
``reset_mod_stats()``, memlab's ``report()``) is part of the step. Opening and closing the tool
and building its report are timed apart from the steps. The table gives, per mode, the median
over rounds of the mean step time of a block, its ratio to the untracked baseline, and the
median of the per-round ratios (each block against the baseline block of the same round).
Censuses that memsentry takes inside the timed steps stay in the step time; the notes give how
many there were, what a step with one cost over the others, and the other steps alone.

    python benchmarks/overhead.py                       # the full run (about 8 minutes here)
    python benchmarks/overhead.py --quick               # a smoke run
    python benchmarks/overhead.py --rounds 25 --models transformer --json results.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import io
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate
from torch import nn

import memsentry

MODEL_NAMES = ("mlp", "cnn", "transformer")
CENSUS_WARMUP = 7  # past the censuses at iterations 2, 3, 4 and 6


# -- workloads ---------------------------------------------------------------------------------
@dataclass
class Workload:
    """One model with its optimizer and a fixed batch; every mode trains this same object."""

    name: str
    shape: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    inputs: torch.Tensor
    targets: torch.Tensor
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    block_steps: int  # K, the timed steps per block in a full run

    def step(self) -> None:
        loss = self.loss_fn(self.model(self.inputs), self.targets)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()


def _mlp() -> Workload:
    model = nn.Sequential(
        nn.Linear(784, 1024), nn.ReLU(),
        nn.Linear(1024, 1024), nn.ReLU(),
        nn.Linear(1024, 512), nn.ReLU(),
        nn.Linear(512, 10),
    )
    return Workload(
        name="mlp",
        shape="MLP 784-1024-1024-512-10, batch 128, cross-entropy, Adam",
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-4),
        inputs=torch.randn(128, 784),
        targets=torch.randint(0, 10, (128,)),
        loss_fn=nn.functional.cross_entropy,
        block_steps=8,
    )


def _conv_block(c_in: int, c_out: int) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU()]


def _cnn() -> Workload:
    model = nn.Sequential(
        *_conv_block(3, 32), nn.MaxPool2d(2),
        *_conv_block(32, 64), nn.MaxPool2d(2),
        *_conv_block(64, 128),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10),
    )
    return Workload(
        name="cnn",
        shape="CNN 3 conv(3x3)+BN+ReLU blocks 32/64/128, 3x32x32, batch 32, cross-entropy, Adam",
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-4),
        inputs=torch.randn(32, 3, 32, 32),
        targets=torch.randint(0, 10, (32,)),
        loss_fn=nn.functional.cross_entropy,
        block_steps=8,
    )


def _transformer() -> Workload:
    layer = nn.TransformerEncoderLayer(
        d_model=256, nhead=4, dim_feedforward=512, batch_first=True
    )
    model = nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False)
    return Workload(
        name="transformer",
        shape="TransformerEncoder 4 layers, d_model 256, nhead 4, ff 512, dropout 0.1, "
              "batch 16 x seq 64, MSE, Adam",
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-4),
        inputs=torch.randn(16, 64, 256),
        targets=torch.randn(16, 64, 256),
        loss_fn=nn.functional.mse_loss,
        block_steps=3,
    )


WORKLOADS: dict[str, Callable[[], Workload]] = {
    "mlp": _mlp, "cnn": _cnn, "transformer": _transformer,
}


# -- modes ---------------------------------------------------------------------------------------
@dataclass
class Session:
    """One opened tool: the context around the block, work after every step, the report."""

    context: contextlib.AbstractContextManager[Any]
    after_step: Callable[[], object] | None = None
    report: Callable[[], object] | None = None
    # (iteration, seconds) of the periodic work the tool itself reports (memsentry's censuses)
    periodic: Callable[[object], list[tuple[int, float]]] | None = None


@dataclass
class Mode:
    name: str
    open: Callable[[Workload], Session]
    note: str
    unavailable: str | None = None  # why this mode cannot run at all ("not installed: ...")
    min_warmup: int = 0  # untimed steps per block this tool needs before its steady state


def _baseline(_: Workload) -> Session:
    return Session(contextlib.nullcontext())


def _censuses(report: object) -> list[tuple[int, float]]:
    return [(c.iteration, c.seconds) for c in getattr(report, "censuses", ())]


def _memsentry_mode(name: str, note: str, **kwargs: Any) -> Mode:
    def open_(w: Workload) -> Session:
        tracker = memsentry.track(w.model, on_leak="ignore", **kwargs)
        return Session(tracker, report=tracker.report, periodic=_censuses)

    # With holder searches on (memsentry's default where the keyword exists), the tracker takes
    # censuses at iterations 2, 3 and 4 and then at doubling gaps (6, 10, 18, ...): the first
    # three are its warm-up and fall in the untimed steps; later ones are counted per block.
    params = inspect.signature(memsentry.track).parameters
    searches = "holders" in params and kwargs.get("holders", params["holders"].default)
    return Mode(name, open_, note, min_warmup=CENSUS_WARMUP if searches else 0)


def _lite_mode() -> Mode:
    kwargs: dict[str, Any] = {"backward": False, "saved_tensors": False}
    note = "track(model, backward=False, saved_tensors=False)"
    if "holders" in inspect.signature(memsentry.track).parameters:
        kwargs["holders"] = False
        note = "track(model, backward=False, saved_tensors=False, holders=False)"
    else:
        note += "; installed Tracker has no holders= keyword"
    return _memsentry_mode("memsentry-lite", note, **kwargs)


def _profiler(_: Workload) -> Session:
    from torch.profiler import ProfilerActivity, profile

    prof = profile(
        activities=[ProfilerActivity.CPU],
        profile_memory=True,
        record_shapes=True,
        with_stack=True,
    )
    return Session(prof, report=prof.key_averages)


def _memtracker_mode() -> Mode:
    note = ("track_external(model, optimizer); reset_mod_stats() after every step (timed, needed "
            "for a 2nd iteration); report = get_tracker_snapshot('peak')")
    try:
        from torch.distributed._tools.mem_tracker import MemTracker
    except Exception as exc:  # a torch build without torch.distributed
        return Mode("MemTracker", _baseline, note, unavailable=f"not available: {_reason(exc)}")

    def open_(w: Workload) -> Session:
        tracker = MemTracker()
        tracker.track_external(w.model, w.optimizer)
        return Session(
            tracker,
            after_step=tracker.reset_mod_stats,
            report=lambda: tracker.get_tracker_snapshot("peak"),
        )

    return Mode("MemTracker", open_, note)


def _memlab_mode() -> Mode:
    note = "MemReporter(model).report() after every step (timed), its print to a StringIO"
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # it prints a CUDA notice on import
            from pytorch_memlab import MemReporter
    except Exception as exc:
        return Mode("memlab MemReporter", _baseline, note,
                    unavailable=f"not installed: {_reason(exc)}")

    def open_(w: Workload) -> Session:
        reporter = MemReporter(w.model)

        def report_quietly() -> None:
            with contextlib.redirect_stdout(io.StringIO()):
                reporter.report()

        return Session(contextlib.nullcontext(), after_step=report_quietly)

    return Mode("memlab MemReporter", open_, note)


def build_modes() -> list[Mode]:
    return [
        Mode("baseline", _baseline, "no tracking"),
        _memsentry_mode("memsentry", "track(model); report() timed once per block"),
        _lite_mode(),
        _memsentry_mode("memsentry-exact", "track(model, exact=True)", exact=True),
        Mode("torch.profiler", _profiler,
             "CPU, profile_memory, record_shapes, with_stack; teardown = stop, "
             "report = key_averages() (the lazy post-processing)"),
        _memtracker_mode(),
        _memlab_mode(),
    ]


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    reason = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return reason if len(reason) <= 120 else reason[:117] + "..."


# -- timing --------------------------------------------------------------------------------------
@dataclass
class Block:
    step_times: list[float]  # seconds of each timed step
    setup_s: float  # building the tool and entering its context
    teardown_s: float  # leaving its context
    report_s: float | None  # building its report once, after the block
    periodic: list[tuple[int, float]]  # (timed step, seconds) of the tool's periodic work

    @property
    def step_s(self) -> float:
        return statistics.fmean(self.step_times)


def run_block(mode: Mode, w: Workload, steps: int, warmup: int) -> Block:
    clock = time.perf_counter
    warmup = max(warmup, mode.min_warmup)
    gc.collect()  # the previous block's garbage is not this block's cost
    start = clock()
    session = mode.open(w)
    after_step = session.after_step
    times: list[float] = []
    with session.context:
        entered = clock()
        for _ in range(warmup):
            w.step()
            if after_step is not None:
                after_step()
        for _ in range(steps):
            began = clock()
            w.step()
            if after_step is not None:
                after_step()
            times.append(clock() - began)
        end = clock()
    exited = clock()
    report_s = None
    periodic: list[tuple[int, float]] = []
    if session.report is not None:
        report = session.report()
        report_s = clock() - exited
        if session.periodic is not None:
            # Step j of the block (warm-up included) closes the tool's iteration j.
            periodic = [(i - warmup, s) for i, s in session.periodic(report)
                        if warmup <= i < warmup + steps]
    return Block(times, entered - start, exited - end, report_s, periodic)


@dataclass
class ModeResult:
    mode: str
    note: str
    blocks: list[Block] = field(default_factory=list)
    paired_ratios: list[float] = field(default_factory=list)
    failed: str | None = None


def measure(w: Workload, modes: Sequence[Mode], rounds: int, steps: int, warmup: int,
            rng: random.Random) -> list[ModeResult]:
    results = {m.name: ModeResult(m.name, m.note, failed=m.unavailable) for m in modes}

    def attempt(mode: Mode, block_steps: int) -> Block | None:
        try:
            return run_block(mode, w, block_steps, warmup)
        except Exception as exc:
            if mode.name == "baseline":
                raise
            results[mode.name].failed = f"failed: {_reason(exc)}"
            return None

    # One untimed block per mode first: lazy imports, thread pools, the allocator's caches.
    for mode in modes:
        if results[mode.name].failed is None:
            attempt(mode, 2)
    for index in range(rounds):
        began = time.perf_counter()
        order = [m for m in modes if results[m.name].failed is None]
        rng.shuffle(order)
        blocks: dict[str, Block] = {}
        for mode in order:
            block = attempt(mode, steps)
            if block is not None:
                blocks[mode.name] = block
        base = blocks["baseline"].step_s
        for name, block in blocks.items():
            results[name].blocks.append(block)
            results[name].paired_ratios.append(block.step_s / base)
        print(f"  [{w.name}] round {index + 1}/{rounds} in {time.perf_counter() - began:.1f} s",
              file=sys.stderr, flush=True)
    return [results[m.name] for m in modes]


# -- output --------------------------------------------------------------------------------------
def _quartiles(values: Sequence[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def _periodic(result: ModeResult, baseline_ms: float | None) -> dict[str, Any]:
    """The tool's periodic work inside timed steps (memsentry's censuses): how many per block,
    what a step with one costs over the block's other steps, and the steps without them."""
    blocks = result.blocks
    if not any(b.periodic for b in blocks):
        return {}
    extra_ms, clean_ms = [], []
    for b in blocks:
        marked = {j for j, _ in b.periodic}
        clean = [t for j, t in enumerate(b.step_times) if j not in marked]
        busy = [t for j, t in enumerate(b.step_times) if j in marked]
        if clean:
            clean_ms.append(statistics.fmean(clean) * 1e3)
            if busy:
                extra_ms.append((statistics.fmean(busy) - statistics.fmean(clean)) * 1e3)
    out: dict[str, Any] = {
        "periodic_per_block": statistics.fmean(len(b.periodic) for b in blocks),
        "periodic_self_ms": statistics.median(s * 1e3 for b in blocks for _, s in b.periodic),
        "periodic_extra_ms": statistics.median(extra_ms) if extra_ms else None,
    }
    if clean_ms:
        out["clean_ms"] = statistics.median(clean_ms)
        out["clean_ratio"] = out["clean_ms"] / baseline_ms if baseline_ms else None
    return out


def summarise(result: ModeResult, baseline_ms: float | None) -> dict[str, Any]:
    if result.failed is not None or not result.blocks:
        return {"mode": result.mode, "status": result.failed or "no data", "note": result.note}
    steps_ms = [b.step_s * 1e3 for b in result.blocks]
    median_ms = statistics.median(steps_ms)
    q1, q3 = _quartiles(steps_ms)
    r1, r3 = _quartiles(result.paired_ratios)
    reports = [b.report_s * 1e3 for b in result.blocks if b.report_s is not None]
    return {
        "mode": result.mode,
        "status": "ok",
        "note": result.note,
        "rounds": len(steps_ms),
        "median_ms": median_ms,
        "q1_ms": q1,
        "q3_ms": q3,
        "min_ms": min(steps_ms),
        "max_ms": max(steps_ms),
        "ratio": median_ms / baseline_ms if baseline_ms else None,
        "paired_ratio": statistics.median(result.paired_ratios),
        "paired_ratio_q1": r1,
        "paired_ratio_q3": r3,
        "open_close_ms": statistics.median(
            [(b.setup_s + b.teardown_s) * 1e3 for b in result.blocks]
        ),
        "report_ms": statistics.median(reports) if reports else None,
        **_periodic(result, baseline_ms),
        "step_ms_per_round": steps_ms,
        "periodic_per_round": [b.periodic for b in result.blocks],
    }


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def _notes(row: dict[str, Any]) -> str:
    if row["status"] != "ok":
        return f"{row['status']}; {row['note']}"
    note = row["note"]
    if "periodic_per_block" in row:
        note += (f"; {row['periodic_per_block']:.2g} census(es) per block in the timed steps, "
                 f"{_ms(row['periodic_extra_ms'])} ms each on the clock "
                 f"({_ms(row['periodic_self_ms'])} by memsentry's own)")
        if "clean_ms" in row:
            note += (f"; the other steps: {_ms(row['clean_ms'])} ms/step, "
                     f"{row['clean_ratio']:.3f}x")
    return note


def table(rows: Sequence[dict[str, Any]]) -> str:
    body = []
    for row in rows:
        if row["status"] != "ok":
            status = row["status"].split(":", 1)[0]
            body.append([row["mode"], status, "", "", "", "", "", _notes(row)])
            continue
        body.append([
            row["mode"],
            _ms(row["median_ms"]),
            f"{_ms(row['q1_ms'])}-{_ms(row['q3_ms'])}",
            f"{row['ratio']:.3f}x",
            f"{row['paired_ratio']:.3f}x ({row['paired_ratio_q1']:.3f}-"
            f"{row['paired_ratio_q3']:.3f})",
            _ms(row["open_close_ms"]),
            _ms(row["report_ms"]),
            _notes(row),
        ])
    headers = ["mode", "ms/step", "IQR ms", "vs base", "paired (IQR)", "open+close ms",
               "report ms", "notes"]
    return tabulate(body, headers=headers, disable_numparse=True,
                    maxcolwidths=[None, None, None, None, None, None, None, 56])


def _git_state() -> str:
    """The commit measured, and whether memsentry's sources differ from it."""
    repo = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                              timeout=10, check=True)
        return done.stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--", "memsentry").splitlines()
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    if not changed:
        return commit
    return f"{commit} + uncommitted changes in {len(changed)} file(s) under memsentry/"


def machine() -> dict[str, Any]:
    cpu = platform.processor() or "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as info:
        for line in info:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": cpu,
        "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "torch": torch.__version__,
        "memsentry": getattr(memsentry, "__version__", "unknown"),
        "memsentry_source": _git_state(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def header(info: dict[str, Any], args: argparse.Namespace) -> str:
    return "\n".join([
        "memsentry overhead benchmark (CPU training step)",
        f"machine: {info['cpu']}, {info['logical_cores']} logical cores "
        f"({info['usable_cores']} usable), {info['platform']}",
        f"torch {info['torch']} (threads {info['torch_threads']}, interop "
        f"{info['torch_interop_threads']}), Python {info['python']}",
        f"memsentry {info['memsentry']} at {info['memsentry_source']}",
        f"date: {info['date']}",
        f"rounds {args.rounds}, seed {args.seed}; modes interleaved in a shuffled order every "
        f"round; {args.warmup} untimed step(s) under the tool before each timed block "
        f"({max(args.warmup, CENSUS_WARMUP)} for memsentry modes that search for holders)",
    ])


# -- main ----------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 3 rounds of 2-step blocks")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 20; 3 quick)")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per block, K (default per model: mlp 8, cnn 8, "
                             "transformer 3; 2 quick)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed steps under the tool before each timed block (default 1)")
    parser.add_argument("--models", default=",".join(MODEL_NAMES),
                        help="comma-separated subset of mlp,cnn,transformer")
    parser.add_argument("--modes", default=None,
                        help="comma-separated subset of the modes (baseline is always run)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch.set_num_threads (default 1: on a shared 2-core machine, two "
                             "OpenMP threads stall whole steps whenever another process runs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="also save the results as JSON")
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 3 if args.quick else 20
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(models) - set(MODEL_NAMES))
    if unknown or not models:
        parser.error(f"--models: unknown {', '.join(unknown) or '(none given)'}; "
                     f"choose from {', '.join(MODEL_NAMES)}")
    args.models = models
    for name in ("rounds", "steps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name} must be at least 1")
    if args.warmup < 0 or args.threads < 1:
        parser.error("--warmup must be >= 0 and --threads >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # memlab's gc.get_objects() scan trips torch's deprecated-alias warning once per step.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"pytorch_memlab\.")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    modes = build_modes()
    if args.modes is not None:
        wanted = {m.strip() for m in args.modes.split(",")} | {"baseline"}
        unknown = wanted - {m.name for m in modes}
        if unknown:
            print(f"--modes: unknown {', '.join(sorted(unknown))}; choose from "
                  f"{', '.join(m.name for m in modes)}", file=sys.stderr)
            return 2
        modes = [m for m in modes if m.name in wanted]
    info = machine()
    print(header(info, args), flush=True)
    saved: dict[str, Any] = {"machine": info, "config": vars(args), "models": {}}
    started = time.perf_counter()
    for name in args.models:
        w = WORKLOADS[name]()
        steps = args.steps or (2 if args.quick else w.block_steps)
        results = measure(w, modes, args.rounds, steps, args.warmup, rng)
        baseline = summarise(results[0], None)
        rows = [summarise(r, baseline.get("median_ms")) for r in results]
        print(f"\n{w.name}: {w.shape}; K = {steps} timed steps per block\n{table(rows)}",
              flush=True)
        saved["models"][name] = {"shape": w.shape, "steps_per_block": steps, "modes": rows}
    elapsed = time.perf_counter() - started
    print(f"\ntotal time {elapsed:.0f} s. ms/step: median over rounds of a block's mean step; "
          "vs base: its ratio to the baseline's median; paired: median of per-round ratios "
          "against the same round's baseline block; open+close: building, entering and leaving "
          "the tool per block; report: building its report once per block. Neither is in "
          "ms/step.")
    if args.json:
        saved["elapsed_s"] = elapsed
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(saved, out, indent=2, default=str)
        print(f"results saved to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
