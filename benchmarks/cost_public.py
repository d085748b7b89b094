"""Cost of memsentry on unmodified public programs, as whole processes.

Every program runs as a whole process in each mode, and each run's wall time (start to exit,
interpreter start-up, imports and the tool's report included) is measured:

* ``python``: ``python prog.py ARGS`` (the reference);
* ``memsentry``: ``python -m memsentry run --json R -o T prog.py ARGS``;
* ``memsentry-watch``: the same with ``--watch`` (skipped, with a note, while ``memsentry run``
  does not accept ``--watch``);
* ``torch.profiler``: a wrapper (written to a temporary file at run time) that runs the script
  with ``runpy`` inside ``torch.profiler.profile(activities=[CPU], profile_memory=True)`` and
  then prints ``key_averages().table(...)`` to stderr;
* ``MemTracker``: a wrapper that runs the script inside
  ``torch.distributed._tools.mem_tracker.MemTracker`` and prints its peak snapshot to stderr.
  MemTracker needs to know the modules it tracks and refuses a second top-level call of a module
  in one "iteration" (``NotImplementedError``, asking for ``reset_mod_stats()``); an unmodified
  script calls neither. The wrapper therefore calls ``reset_mod_stats()`` before each top-level
  call of a module it already tracks (global forward hooks; modules are tracked at their first
  call). A program that MemTracker still cannot run shows as failed: when one root module's
  graph is still to be backpropagated after another root was called again (dcgan: netG, then
  netD twice), the reset has dropped the first and MemTracker's backward hook raises KeyError;
  makemore fails inside its ``@torch.no_grad()`` sampling, where ModTracker's forward pre-hook
  raises ``AssertionError: Expected gradient function to be set``.

Every round runs every program in every mode, the modes in a shuffled (seeded) order. Before the
rounds each program runs once plainly, untimed (warm file cache; a failure there skips the
program). Per program and mode the table gives the median wall seconds, the median of the
per-round ratios to the same round's ``python`` run (and their min-max), user+system CPU seconds
and the peak RSS of the process (``wait4``), the exit status, whether standard output was the
plain run's (after masking the program's timing figures; "n/a" where the plain runs disagree
among themselves), and for memsentry modes the LEAK findings of the ``--json`` report (an
unmodified public program must have none) and the iterations it recorded.

Every run runs with ``OMP_NUM_THREADS=1``, a bytecode cache in the scratch folder
(``PYTHONPYCACHEPREFIX``; memsentry's modules are compiled into it before the rounds, as
``pip`` compiles an installed package; before 2026-11-26 every run compiled them), a time
limit (``--timeout-ratio`` times the program's plain warm-up run, at least 60 s, at most
``--timeout``) and an address-space limit
(``--memory-limit``: torch.profiler's post-processing of a long run takes many GiB). A mode
stopped at the time limit or out of memory is not run again for that program in later rounds.
Times count only where a run ended as the same round's plain run did. The wrappers save the
seconds of their phases (script, profiler exit, ``key_averages()``, report), given in the notes.

Setup (no public code is kept in this repository): ``--programs DIR`` must hold

* ``DIR/examples``: github.com/pytorch/examples at 77f55b912142e11fcfdf5b530231fb9c52f181e8
  (the folders reinforcement_learning, vae, mnist_rnn and dcgan are used);
* ``DIR/minimalRL``: github.com/seungeunrho/minimalRL at
  c8efed8481e3cd40e9739cfde220a55522555b57;
* ``DIR/makemore``: github.com/karpathy/makemore at 988aa59e4d8fefa526d06f3b453ad116258398d4;
* ``DIR/minGPT``: github.com/karpathy/minGPT at 37baab71b9abea1b76ab957409a1cc2fbfba8a26.

for example::

    mkdir -p /tmp/pubprogs && cd /tmp/pubprogs
    for r in pytorch/examples seungeunrho/minimalRL karpathy/makemore karpathy/minGPT; do
        git clone -q https://github.com/$r "$(basename $r)"; done
    git -C examples checkout -q 77f55b9
    git -C minimalRL checkout -q c8efed8
    git -C makemore checkout -q 988aa59
    git -C minGPT checkout -q 37baab7
    . .venv/bin/activate && pip install gymnasium   # check that torch stays as it is
    python benchmarks/cost_public.py --programs /tmp/pubprogs --rounds 3 --json OUT.json

By default the installed memsentry runs (an editable install: the working tree, as it is at each
run). To measure a commit instead, unpack its package and pass the folder::

    mkdir /tmp/ms-head && git archive HEAD memsentry | tar -x -C /tmp/ms-head
    python benchmarks/cost_public.py --programs /tmp/pubprogs --memsentry-path /tmp/ms-head

The RL programs need ``gymnasium`` (CartPole-v1, no rendering) in the venv; a program whose
modules are missing is skipped with a note. Each program is copied into a fresh temporary folder
for every run, and the changes that make it run here are applied there as textual replacements,
each of which must occur exactly once (``Program.edits``): episode caps for the RL loops
(they otherwise run until solved, minutes), ``gym`` -> ``gymnasium`` and seeds for minimalRL's
dqn (unseeded, no two runs did the same work), and a stub ``SummaryWriter`` for makemore
(tensorboard is not installed). Programs that import torchvision
(vae, mnist_rnn, dcgan) get a small stand-in ``torchvision`` package on ``PYTHONPATH``, written
by this harness (the installed torchvision is a CUDA build beside a CPU torch): ``MNIST`` and
``FakeData`` return seeded random images of the right shape (their own generator, so the
program's random stream is untouched), the transforms used are implemented with tensor ops, and
``save_image`` writes an empty file. Sizes and lengths come from the command-line arguments and
the ``FAKE_MNIST_*`` sizes below.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tabulate import tabulate

REPO = Path(__file__).resolve().parents[1]

# --------------------------------------------------------------------------------------------
# Programs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Edit:
    """Replace ``old`` by ``new`` in ``file`` (``old`` must occur exactly once)."""

    file: str
    old: str
    new: str
    why: str


@dataclass(frozen=True)
class Program:
    """A public program: ``folder`` (under ``--programs``) is copied into a work folder, the
    ``edits`` applied, and ``script`` run there with ``args``."""

    name: str
    repo: str
    commit: str
    folder: str
    script: str
    args: tuple[str, ...]
    loop: str
    edits: tuple[Edit, ...] = ()
    modules: tuple[str, ...] = ()
    fake_torchvision: bool = False
    pythonpath: tuple[str, ...] = ()  # folders (relative to the work folder) put on PYTHONPATH
    env: dict[str, str] = field(default_factory=dict)
    volatile: tuple[str, ...] = ()  # regexes of stdout text that differs between runs (timings)
    deterministic: bool = True  # False: the program seeds nothing, stdout is not compared


_EXAMPLES = ("pytorch/examples", "77f55b912142e11fcfdf5b530231fb9c52f181e8")
_MINIMALRL = ("seungeunrho/minimalRL", "c8efed8481e3cd40e9739cfde220a55522555b57")
_MAKEMORE = ("karpathy/makemore", "988aa59e4d8fefa526d06f3b453ad116258398d4")
_MINGPT = ("karpathy/minGPT", "37baab71b9abea1b76ab957409a1cc2fbfba8a26")

_STUB_WRITER = (
    "class SummaryWriter:  # benchmark stub: tensorboard is not installed\n"
    "    def __init__(self, *args, **kwargs): pass\n"
    "    def add_scalar(self, *args, **kwargs): pass\n"
    "    def flush(self): pass\n")


def _episodes(file: str, count: int) -> Edit:
    return Edit(file, "    for i_episode in count(1):\n",
                f"    for i_episode in range(1, {count + 1}):\n",
                f"stop after {count} episodes (it runs until CartPole is solved: minutes)")


PROGRAMS: tuple[Program, ...] = (
    Program(
        name="reinforce", repo=_EXAMPLES[0], commit=_EXAMPLES[1],
        folder="examples/reinforcement_learning", script="reinforce.py", args=(),
        loop="REINFORCE on CartPole-v1: one forward per env step, one Adam step per episode",
        edits=(_episodes("reinforce.py", 200),), modules=("gymnasium",)),
    Program(
        name="actor_critic", repo=_EXAMPLES[0], commit=_EXAMPLES[1],
        folder="examples/reinforcement_learning", script="actor_critic.py", args=(),
        loop="actor-critic on CartPole-v1: one forward per env step, one Adam step per episode",
        edits=(_episodes("actor_critic.py", 300),), modules=("gymnasium",)),
    Program(
        name="minimalRL dqn", repo=_MINIMALRL[0], commit=_MINIMALRL[1],
        folder="minimalRL", script="dqn.py", args=(),
        loop="DQN on CartPole-v1, replay buffer, target net; 10 Adam steps (batch 32) "
             "per episode",
        edits=(Edit("dqn.py", "import gym\n", "import gymnasium as gym\n",
                    "gym (not installed) -> gymnasium, whose step() API the script uses"),
               Edit("dqn.py", "    for n_epi in range(10000):\n",
                    "    for n_epi in range(260):\n",
                    "260 episodes instead of 10000 (an episode only ends when the pole falls: "
                    "once the agent is good, one lasts minutes)"),
               Edit("dqn.py", "    env = gym.make('CartPole-v1')\n",
                    "    env = gym.make('CartPole-v1')\n"
                    "    random.seed(0); torch.manual_seed(0); env.reset(seed=0)\n",
                    "seeded (it seeds nothing), so that every run does the same work")),
        modules=("gymnasium",)),
    Program(
        name="makemore gru", repo=_MAKEMORE[0], commit=_MAKEMORE[1],
        folder="makemore", script="makemore.py",
        args=("-i", "names.txt", "-o", "out", "--type", "gru", "--max-steps", "501",
              "--num-workers", "0"),
        loop="char-level GRU (16 cell calls per step), batch 32, AdamW; eval + sampling",
        edits=(Edit("makemore.py", "from torch.utils.tensorboard import SummaryWriter\n",
                    _STUB_WRITER, "tensorboard is not installed: a no-op SummaryWriter"),),
        volatile=(r"step time [\d.]+ms",)),
    Program(
        name="minGPT adder", repo=_MINGPT[0], commit=_MINGPT[1],
        folder="minGPT", script="projects/adder/adder.py",
        args=("--trainer.max_iters=501", "--trainer.num_workers=0", "--trainer.device=cpu"),
        loop="gpt-nano learning 2-digit addition, batch 64, AdamW; eval at iters 0 and 500",
        pythonpath=(".",), volatile=(r"iter_dt [\d.]+ms",)),
    Program(
        name="vae", repo=_EXAMPLES[0], commit=_EXAMPLES[1],
        folder="examples/vae", script="main.py", args=("--epochs", "3", "--no-accel"),
        loop="MLP VAE on (fake) MNIST, batch 128, Adam; test pass each epoch",
        fake_torchvision=True, env={"FAKE_MNIST_TRAIN": "12800", "FAKE_MNIST_TEST": "1280"}),
    Program(
        name="mnist_rnn", repo=_EXAMPLES[0], commit=_EXAMPLES[1],
        folder="examples/mnist_rnn", script="main.py",
        args=("--epochs", "3", "--log-interval", "20"),
        loop="LSTM over 28 rows of (fake) MNIST, batch 64, Adadelta, StepLR",
        fake_torchvision=True, env={"FAKE_MNIST_TRAIN": "6400", "FAKE_MNIST_TEST": "2000"}),
    Program(
        name="dcgan", repo=_EXAMPLES[0], commit=_EXAMPLES[1],
        folder="examples/dcgan", script="main.py",
        args=("--dataset", "fake", "--batchSize", "16", "--ngf", "16", "--ndf", "16",
              "--niter", "1", "--manualSeed", "1", "--outf", "out"),
        loop="DCGAN 64x64 on FakeData (1000 images, 2 loader workers), two Adam optimizers, "
             "netD called 3 times a step",
        fake_torchvision=True),
)


def apply_edits(work: Path, edits: Sequence[Edit]) -> None:
    """Apply ``edits`` in ``work``; each replaced text must occur exactly once."""
    for edit in edits:
        path = work / edit.file
        text = path.read_text(encoding="utf-8")
        found = text.count(edit.old)
        if found != 1:
            raise RuntimeError(f"{edit.file}: {edit.old!r} occurs {found} times, not once "
                               "(did the public code change?)")
        path.write_text(text.replace(edit.old, edit.new), encoding="utf-8")


# --------------------------------------------------------------------------------------------
# Files written at run time: the stand-in torchvision and the two wrappers
# --------------------------------------------------------------------------------------------

FAKE_TORCHVISION: dict[str, str] = {
    "torchvision/__init__.py": '''\
"""Stand-in torchvision for the cost benchmark: only what its programs use."""
from torchvision import datasets, transforms, utils  # noqa: F401

__version__ = "0.0-benchmark-stub"
''',
    "torchvision/datasets.py": '''\
import os

import torch


class _Random(torch.utils.data.Dataset):
    """Seeded random uint8 images (own generator: the program's random stream is untouched)."""

    def __init__(self, size, shape, classes, seed, transform=None, target_transform=None):
        gen = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, 256, (size, *shape), dtype=torch.uint8, generator=gen)
        self.targets = torch.randint(0, classes, (size,), generator=gen)
        self.transform = transform
        self.target_transform = target_transform

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        image, target = self.data[index], int(self.targets[index])
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target


class MNIST(_Random):
    def __init__(self, root, train=True, transform=None, target_transform=None,
                 download=False):
        size = int(os.environ.get("FAKE_MNIST_TRAIN" if train else "FAKE_MNIST_TEST",
                                  "6000" if train else "1000"))
        super().__init__(size, (28, 28), 10, 0 if train else 1, transform, target_transform)


class FakeData(_Random):
    def __init__(self, size=1000, image_size=(3, 224, 224), num_classes=10, transform=None,
                 target_transform=None, random_offset=0):
        super().__init__(size, tuple(image_size), num_classes, random_offset, transform,
                         target_transform)
''',
    "torchvision/transforms.py": '''\
import torch
import torch.nn.functional as F


class Compose:
    def __init__(self, transforms):
        self.transforms = transforms

    def __call__(self, x):
        for t in self.transforms:
            x = t(x)
        return x


class ToTensor:
    def __call__(self, x):
        if x.dtype == torch.uint8:
            x = x.float().div(255)
        return x.unsqueeze(0) if x.dim() == 2 else x


class Normalize:
    def __init__(self, mean, std):
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, x):
        return (x - self.mean) / self.std


class Resize:
    def __init__(self, size):
        self.size = size

    def __call__(self, x):
        size = (self.size, self.size) if isinstance(self.size, int) else tuple(self.size)
        if tuple(x.shape[-2:]) == size:
            return x
        return F.interpolate(x.float().unsqueeze(0), size=size).squeeze(0).to(x.dtype)


class CenterCrop:
    def __init__(self, size):
        self.size = size

    def __call__(self, x):
        h, w = x.shape[-2:]
        top, left = (h - self.size) // 2, (w - self.size) // 2
        return x[..., top:top + self.size, left:left + self.size]


class Lambda:
    def __init__(self, fn):
        self.fn = fn

    def __call__(self, x):
        return self.fn(x)
''',
    "torchvision/utils.py": '''\
def save_image(tensor, fp, **kwargs):
    """Writes an empty file (no image library here)."""
    with open(fp, "wb"):
        pass
''',
}

_WRAPPER_HEAD = '''\
import json
import os
import runpy
import sys
import time

script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script.py` sets it
phases = {}


def phase(name, started):
    """Record a phase's seconds, saved at once (a run stopped later still has them)."""
    phases[name] = round(time.perf_counter() - started, 3)
    path = os.environ.get("COST_PUBLIC_PHASES")
    if path:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(phases, handle)
    return time.perf_counter()


'''

PROFILER_WRAPPER = _WRAPPER_HEAD + '''\
from torch.profiler import ProfilerActivity, profile

started = time.perf_counter()
prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
prof.__enter__()
started = phase("enter_s", started)
try:
    runpy.run_path(script, run_name="__main__")
finally:
    started = phase("script_s", started)
    prof.__exit__(None, None, None)
    started = phase("exit_s", started)
    averages = prof.key_averages()
    started = phase("key_averages_s", started)
    print(averages.table(sort_by="self_cpu_memory_usage", row_limit=10), file=sys.stderr)
    phase("table_s", started)
'''

MEMTRACKER_WRAPPER = _WRAPPER_HEAD + '''\
import contextlib

from torch.distributed._tools.mem_tracker import MemTracker
from torch.nn.modules.module import (register_module_forward_hook,
                                     register_module_forward_pre_hook)

tracker = MemTracker()
depth = 0
resets = 0


def _pre(module, args):
    # registered before MemTracker's own global hooks, so it runs first
    global depth, resets
    if depth == 0 and module in tracker.memory_tracking:
        tracker.reset_mod_stats()  # what its NotImplementedError asks for
        resets += 1
    depth += 1


def _post(module, args, output):
    global depth
    depth -= 1


register_module_forward_pre_hook(_pre)
register_module_forward_hook(_post, always_call=True)
started = time.perf_counter()
with tracker:
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        phases["resets"] = resets
        started = phase("script_s", started)
        with contextlib.redirect_stdout(sys.stderr):
            tracker.display_snapshot("peak", units="MiB", tabulate=True)
        phase("report_s", started)
'''


def write_files(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


# --------------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    code: int | None  # None: killed at the time limit
    seconds: float
    cpu_seconds: float
    max_rss_mib: float
    stdout: str
    stderr: str


def run_process(command: Sequence[str], cwd: Path, env: dict[str, str], timeout: float,
                memory_limit: int | None = None) -> Outcome:
    """Run ``command`` in its own process group, output to files; kill the group at
    ``timeout`` seconds. ``memory_limit``: bytes of address space (RLIMIT_AS, inherited by its
    children). Wall time from the start to the exit; CPU time and peak RSS from ``wait4``
    (the process and the children it waited for)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        started = time.perf_counter()
        process = subprocess.Popen(list(command), cwd=cwd, env=env, stdout=out, stderr=err,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
        if memory_limit:
            resource.prlimit(process.pid, resource.RLIMIT_AS, (memory_limit, memory_limit))
        killed = threading.Event()

        def kill() -> None:
            killed.set()
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        timer = threading.Timer(timeout, kill)
        timer.start()
        try:
            _, status, usage = os.wait4(process.pid, 0)
        finally:
            timer.cancel()
        seconds = time.perf_counter() - started
        process.returncode = os.waitstatus_to_exitcode(status)
        try:  # leftovers of the group (e.g. data loader workers) go too
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out.seek(0)
        err.seek(0)
        return Outcome(
            code=None if killed.is_set() else process.returncode,
            seconds=round(seconds, 3),
            cpu_seconds=round(usage.ru_utime + usage.ru_stime, 2),
            max_rss_mib=round(usage.ru_maxrss / 1024, 1),
            stdout=out.read().decode("utf-8", "replace"),
            stderr=err.read().decode("utf-8", "replace"))


def _compile_memsentry(setup: Setup) -> None:
    """Fill the bytecode cache with memsentry's modules before the rounds (as ``pip install``
    compiles them); the programs' own modules are compiled by their first run, which is the
    untimed one."""
    where = _query(setup.python, "import memsentry, os; print(os.path.dirname(memsentry.__file__))",
                   env=setup.env)
    subprocess.run([setup.python, "-m", "compileall", "-q", where], env=setup.env, check=True,
                   stdout=subprocess.DEVNULL)


def _query(python: str, code: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True,
                          env=env)
    return done.stdout.strip()


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                              check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return done.stdout.strip()


def _tree_digest(folder: Path) -> str:
    """sha256 of the .py files under ``folder`` (names and contents), to tell snapshots apart."""
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*.py")):
        digest.update(str(path.relative_to(folder)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = None
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        pass
    return {"cpu": cpu, "logical_cores": os.cpu_count(),
            "usable_cores": len(os.sched_getaffinity(0)), "memory_bytes": memory,
            "platform": platform.platform(), "node": platform.node(),
            "python": platform.python_version()}


# --------------------------------------------------------------------------------------------
# Modes
# --------------------------------------------------------------------------------------------

MODES = ("python", "memsentry", "memsentry-watch", "torch.profiler", "MemTracker")


@dataclass
class Setup:
    python: str
    scratch: Path
    programs_dir: Path
    timeout: float
    timeout_ratio: float
    memory_limit: int | None
    env: dict[str, str]
    wrappers: dict[str, Path]
    fake_torchvision: Path
    memsentry_path: Path | None


def command_for(mode: str, setup: Setup, program: Program, run_dir: Path) -> list[str]:
    py = setup.python
    script = [program.script, *program.args]
    if mode == "python":
        return [py, *script]
    if mode in ("memsentry", "memsentry-watch"):
        watch = ["--watch"] if mode == "memsentry-watch" else []
        return [py, "-m", "memsentry", "run", *watch, "--json", str(run_dir / "report.json"),
                "-o", str(run_dir / "report.txt"), *script]
    return [py, str(setup.wrappers[mode]), *script]


def program_env(setup: Setup, program: Program, work: Path, run_dir: Path) -> dict[str, str]:
    env = {**setup.env, **program.env, "COST_PUBLIC_PHASES": str(run_dir / "phases.json")}
    paths = [str(work / p) for p in program.pythonpath]
    if program.fake_torchvision:
        paths.insert(0, str(setup.fake_torchvision))
    if setup.memsentry_path:
        paths.insert(0, str(setup.memsentry_path))
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def _mask(text: str, program: Program) -> list[str]:
    for pattern in program.volatile:
        text = re.sub(pattern, "<masked>", text)
    return [line.rstrip() for line in text.splitlines()]


def _report_figures(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {"report": None}
    report = json.loads(path.read_text(encoding="utf-8"))
    findings = report.get("findings", [])
    iterations = report.get("iterations", [])
    cost = report.get("cost") or {}
    return {
        "report": True,
        "leaks": [{"rule": f["rule"], "message": f["message"]} for f in findings
                  if f.get("severity") == "leak"],
        "findings": [f"{f['rule']} ({f['severity']})" for f in findings],
        # the iterations table may be thinned out: the count is the cost ledger's, where the
        # report has one, else the last index in the table
        "iterations_recorded": len(iterations),
        "iterations_last_index": max((i["index"] for i in iterations), default=None),
        "iterations": cost.get("iterations") or max(
            (i["index"] + 1 for i in iterations), default=0),
        "censuses": [c["iteration"] for c in report.get("censuses", [])],
        "cost": cost,
    }


_OOM = re.compile(r"MemoryError|can't allocate memory|Cannot allocate memory|bad_alloc")


def run_once(setup: Setup, program: Program, mode: str, template: Path, label: str,
             limit: float) -> dict[str, Any]:
    """Copy the prepared program to a fresh folder and run it once in ``mode`` (at most
    ``limit`` seconds)."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"{label}-", dir=setup.scratch))
    work = run_dir / "work"
    shutil.copytree(template, work)
    outcome = run_process(command_for(mode, setup, program, run_dir), work,
                          program_env(setup, program, work, run_dir), limit,
                          setup.memory_limit)
    row: dict[str, Any] = {
        "mode": mode, "exit": outcome.code, "seconds": outcome.seconds, "limit_s": limit,
        "cpu_seconds": outcome.cpu_seconds, "max_rss_mib": outcome.max_rss_mib,
        "stdout_lines": _mask(outcome.stdout, program)}
    if mode.startswith("memsentry"):
        row.update(_report_figures(run_dir / "report.json"))
    phases = run_dir / "phases.json"
    if phases.is_file():
        row["phases"] = json.loads(phases.read_text(encoding="utf-8"))
    if outcome.code != 0:
        row["stderr_tail"] = outcome.stderr[-3000:]
        row["out_of_memory"] = bool(_OOM.search(outcome.stderr))
    shutil.rmtree(run_dir, ignore_errors=True)
    return row


def prepare(setup: Setup, program: Program) -> Path:
    """The program's folder copied into the scratch folder with its edits applied."""
    source = setup.programs_dir / program.folder
    if not source.is_dir():
        raise RuntimeError(f"{source} is missing (see the setup in this file's docstring)")
    template = setup.scratch / f"template-{re.sub(r'[^A-Za-z0-9]+', '_', program.name)}"
    shutil.copytree(source, template, ignore=shutil.ignore_patterns(".git", "__pycache__"))
    apply_edits(template, program.edits)
    return template


def _missing_modules(python: str, modules: Sequence[str]) -> list[str]:
    if not modules:
        return []
    code = ("import importlib.util, sys; print(' '.join(m for m in sys.argv[1:] "
            "if importlib.util.find_spec(m) is None))")
    done = subprocess.run([python, "-c", code, *modules], capture_output=True, text=True,
                          check=True)
    return done.stdout.split()


def available_modes(setup: Setup, wanted: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """The modes that can run here, and a note for each one that cannot."""
    notes: dict[str, str] = {}
    helptext = subprocess.run([setup.python, "-m", "memsentry", "run", "--help"],
                              capture_output=True, text=True, env=setup.env).stdout
    if "--watch" not in helptext:
        notes["memsentry-watch"] = "skipped: `memsentry run --help` has no --watch yet"
    try:
        _query(setup.python, "from torch.distributed._tools.mem_tracker import MemTracker")
    except subprocess.CalledProcessError:
        notes["MemTracker"] = "skipped: torch.distributed._tools.mem_tracker cannot be imported"
    return [m for m in wanted if m not in notes], notes


# --------------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------------


def _status(run: dict[str, Any]) -> str:
    if run["exit"] is None:
        return "timeout"
    if run.get("out_of_memory"):
        return "out of memory"
    return str(run["exit"])


def summarise(runs: list[dict[str, Any]], modes: Sequence[str]) -> list[dict[str, Any]]:
    """Per mode of one program: medians, ratios to the same round's python run, checks. Times
    count only where the run ended as the same round's python run did (a run that failed,
    ran out of memory or was stopped is not a comparable time)."""
    by_round: dict[int, dict[str, dict[str, Any]]] = {}
    for run in runs:
        by_round.setdefault(run["round"], {})[run["mode"]] = run
    pairs = {mode: [(r[mode], r["python"]) for r in by_round.values()
                    if mode in r and "python" in r] for mode in modes}
    plain_outputs = {tuple(r["python"]["stdout_lines"]) for r in by_round.values()
                     if "python" in r and r["python"]["exit"] == 0}
    rows = []
    for mode in modes:
        mine = [r[mode] for r in by_round.values() if mode in r]
        good = [(m, p) for m, p in pairs[mode] if m["exit"] is not None and m["exit"] == p["exit"]]
        ratios = [m["seconds"] / p["seconds"] for m, p in good]
        bad = [(m, p) for m, p in pairs[mode] if (m, p) not in good]
        row: dict[str, Any] = {
            "mode": mode, "runs": len(mine), "comparable": len(good),
            "median_s": statistics.median(m["seconds"] for m, _ in good) if good else None,
            "ratio": statistics.median(ratios) if ratios else None,
            "ratio_min": min(ratios) if ratios else None,
            "ratio_max": max(ratios) if ratios else None,
            "timeouts": sum(r["exit"] is None for r in mine),
            "out_of_memory": sum(bool(r.get("out_of_memory")) for r in mine),
            "limit_s": max((r["limit_s"] for r in mine), default=None),
            # how far the runs that did not end comparably got, as a ratio (a lower bound)
            "ratio_before_end": min((m["seconds"] / p["seconds"] for m, p in bad),
                                    default=None),
            "cpu_s": statistics.median(m["cpu_seconds"] for m, _ in good) if good else None,
            "max_rss_mib": max((r["max_rss_mib"] for r in mine if r["exit"] is not None),
                               default=None),
            "exits": sorted({_status(r) for r in mine}),
            "stdout_compared": len(plain_outputs) == 1,
            "stdout_same": None if mode == "python" or len(plain_outputs) != 1 or not good
            else all(m["stdout_lines"] == p["stdout_lines"] for m, p in good),
        }
        phases = [r["phases"] for r in mine if r.get("phases")]
        if phases:
            row["phases_median"] = {k: statistics.median(ph[k] for ph in phases if k in ph)
                                    for k in phases[0]}
        if mode.startswith("memsentry"):
            row["leaks"] = sum(len(r.get("leaks") or []) for r in mine)
            row["reports"] = sum(bool(r.get("report")) for r in mine)
            row["iterations"] = sorted({r["iterations"] for r in mine if r.get("report")})
            row["leak_messages"] = sorted({f"{leak['rule']}: {leak['message']}"
                                           for r in mine for leak in r.get("leaks") or []})
        rows.append(row)
    return rows


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _seconds(row: dict[str, Any]) -> str:
    if row["median_s"] is None and row["timeouts"]:
        return f"> {row['limit_s']:.0f}"
    return _fmt(row["median_s"])


def _ratio(row: dict[str, Any]) -> str:
    if row["mode"] == "python":
        return "1"
    others = row["runs"] - row["comparable"]
    if row["ratio"] is None:
        before = row["ratio_before_end"]
        if row["timeouts"]:
            return f"> {before:.1f}x (stopped)"
        if row["out_of_memory"]:
            return f"out of memory after {before:.1f}x"
        return "failed" if others else "-"
    text = f"{row['ratio']:.2f}x ({row['ratio_min']:.2f}-{row['ratio_max']:.2f})"
    return text + (f", {others} run(s) not comparable" if others else "")


def _stdout(row: dict[str, Any], program: Program) -> str:
    if row["mode"] == "python" or (row["stdout_same"] is None and row["stdout_compared"]):
        return "-"
    if not program.deterministic:
        return "n/a (unseeded)"
    if not row["stdout_compared"]:
        return "n/a (plain runs differ)"
    return "same" if row["stdout_same"] else "DIFFERS"


def _leak(row: dict[str, Any]) -> str:
    if "leaks" not in row:
        return ""
    if row["reports"] < row["runs"]:
        return f"no report in {row['runs'] - row['reports']} run(s)"
    return "none" if not row["leaks"] else f"LEAK x{row['leaks']}"


def table(results: list[dict[str, Any]]) -> str:
    lines = []
    for result in results:
        program = next(p for p in PROGRAMS if p.name == result["program"])
        if "skipped" in result:
            lines.append([program.name, "-", result["skipped"], "", "", "", "", "", "", ""])
            continue
        for row in result["modes"]:
            lines.append([
                program.name, row["mode"], _seconds(row), _ratio(row), _fmt(row["cpu_s"], 1),
                _fmt(row["max_rss_mib"], 0), ",".join(row["exits"]), _stdout(row, program),
                _leak(row), ",".join(map(str, row.get("iterations", []))) or ""])
    return tabulate(lines, headers=["program", "mode", "median s", "vs python (min-max)",
                                    "CPU s", "max RSS MiB", "exit", "stdout vs python",
                                    "LEAK", "iterations"],
                    tablefmt="github", disable_numparse=True)


def notes_for(results: list[dict[str, Any]]) -> list[str]:
    """Failures, stopped runs, where the wrappers' time went, differences and false LEAKs."""
    out = []
    for result in results:
        name = result["program"]
        program = next(p for p in PROGRAMS if p.name == name)
        for run in result.get("runs", []):
            if run["exit"] is None:
                out.append(f"- {name} / {run['mode']} (round {run['round'] + 1}): stopped at "
                           f"{run['limit_s']:.0f} s; phases done: {run.get('phases', {})}")
            elif run["exit"] != 0:
                tail = run.get("stderr_tail", "").strip().splitlines()[-3:]
                out.append(f"- {name} / {run['mode']} (round {run['round'] + 1}): "
                           f"{_status(run)} (exit {run['exit']}): " + " | ".join(tail)[:400])
        for row in result.get("modes", []):
            if row.get("phases_median") and row["mode"] != "python":
                out.append(f"- {name} / {row['mode']}: median phases {row['phases_median']}")
            for message in row.get("leak_messages", []):
                out.append(f"- {name} / {row['mode']}: false LEAK? {message}")
            if row.get("stdout_same") is False and program.deterministic:
                out.append(f"- {name} / {row['mode']}: stdout differs from the plain run's "
                           "(see the JSON's stdout_lines)")
    return out


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def bench_round(setup: Setup, program: Program, template: Path, modes: Sequence[str],
                index: int, rounds: int, limit: float, dropped: set[str],
                rng: random.Random) -> list[dict[str, Any]]:
    """One round of ``program``: every mode once, in a shuffled order. A mode stopped at the
    time limit or out of memory joins ``dropped`` and is not run again."""
    order = [m for m in modes if m not in dropped]
    rng.shuffle(order)
    runs = []
    for mode in order:
        run = run_once(setup, program, mode, template, f"r{index}", limit)
        run["round"] = index
        runs.append(run)
        if mode != "python" and (run["exit"] is None or run.get("out_of_memory")):
            dropped.add(mode)
        leaks = len(run.get("leaks") or [])
        print(f"  round {index + 1}/{rounds} {program.name} / {mode}: {run['seconds']:.2f} s, "
              f"{_status(run)}" + (f", {leaks} LEAK" if leaks else ""),
              file=sys.stderr, flush=True)
    return runs


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--programs", type=Path, required=True,
                        help="folder holding the public checkouts (see the docstring)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, help="save the raw figures to this file")
    parser.add_argument("--only", action="append", default=[],
                        help="only programs whose name contains this text (repeatable)")
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated modes (python always runs): {','.join(MODES)}")
    parser.add_argument("--timeout", type=float, default=600,
                        help="seconds per run at most (default 600)")
    parser.add_argument("--timeout-ratio", type=float, default=20,
                        help="a run is stopped after this many times the program's plain "
                             "warm-up run (at least 60 s, at most --timeout); default 20")
    parser.add_argument("--memory-limit", type=float, default=8,
                        help="GiB of address space per run (RLIMIT_AS; 0: none); default 8")
    parser.add_argument("--memsentry-path", type=Path,
                        help="a folder holding the memsentry package to measure, put first on "
                             "PYTHONPATH (e.g. `git archive HEAD memsentry | tar -x -C DIR`); "
                             "default: the installed one")
    parser.add_argument("--seed", type=int, default=0, help="seed of the mode order")
    parser.add_argument("--python", default=sys.executable, help="interpreter to run with")
    return parser.parse_args(argv)


def _result(program: Program) -> dict[str, Any]:
    folder = program.folder.split("/", 1)[1] + "/" if "/" in program.folder else ""
    return {"program": program.name, "repo": program.repo, "commit": program.commit,
            "path": folder + program.script, "args": list(program.args), "loop": program.loop,
            "edits": [{"file": e.file, "why": e.why} for e in program.edits],
            "fake_torchvision": program.fake_torchvision, "env": program.env, "runs": []}


def warm_up(setup: Setup, program: Program, result: dict[str, Any]) -> float | None:
    """Prepare ``program`` and run it once plainly; its time limit (None: skipped)."""
    if missing := _missing_modules(setup.python, program.modules):
        result["skipped"] = f"skipped: missing {', '.join(missing)}"
        return None
    try:
        template = prepare(setup, program)
    except RuntimeError as exc:
        result["skipped"] = f"skipped: {exc}"
        return None
    result["template"] = str(template)
    warm = run_once(setup, program, "python", template, "warm", setup.timeout)
    result["warmup_s"] = warm["seconds"]
    if warm["exit"] != 0:
        result["skipped"] = f"skipped: the plain warm-up run failed ({_status(warm)})"
        result["warmup"] = warm
        return None
    seconds: float = warm["seconds"]
    limit = min(setup.timeout, max(60.0, setup.timeout_ratio * seconds))
    print(f"{program.name}: warm-up {seconds:.1f} s, limit {limit:.0f} s",
          file=sys.stderr, flush=True)
    return limit


def _meta(args: argparse.Namespace, setup: Setup, modes: list[str],
          mode_notes: dict[str, str], seconds: float, head: str | None) -> dict[str, Any]:
    versions = _query(setup.python, "import torch, platform; print(torch.__version__, "
                      "platform.python_version())").split()
    where = _query(setup.python, "import os, memsentry; print(os.path.dirname(os.path.dirname("
                   "memsentry.__file__)))") if not setup.memsentry_path else str(
                       setup.memsentry_path)
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": _machine(), "torch": versions[0], "python": versions[1],
        "memsentry_commit": head,  # the checkout's HEAD when the run began
        "memsentry_commit_at_end": _git("rev-parse", "--short", "HEAD"),
        "memsentry_worktree_modified": bool(_git("status", "--porcelain", "--", "memsentry")),
        "memsentry_from": where,
        "memsentry_py_sha256": _tree_digest(Path(where) / "memsentry"),
        "rounds": args.rounds, "seed": args.seed,
        "timeout_s": args.timeout, "timeout_ratio": args.timeout_ratio,
        "memory_limit_gib": args.memory_limit, "modes": modes, "mode_notes": mode_notes,
        "env": {"OMP_NUM_THREADS": "1", "PYTHONPYCACHEPREFIX": "(scratch)/pyc"},
        "programs_dir": str(setup.programs_dir),
        "wall_seconds": round(seconds, 1),
    }


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    scratch = Path(tempfile.mkdtemp(prefix="cost-public-"))
    # Bytecode is cached (in the scratch folder) as for any installed package: pip compiles
    # what it installs, so a user's process never compiles memsentry's modules, while this
    # machine's PYTHONDONTWRITEBYTECODE=1 made every run compile them (0.3-0.4 s a run here).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPYCACHEPREFIX": str(scratch / "pyc"),
           "MPLBACKEND": "Agg"}
    env.pop("PYTHONPATH", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    wrappers = {"torch.profiler": scratch / "profiler_wrapper.py",
                "MemTracker": scratch / "memtracker_wrapper.py"}
    wrappers["torch.profiler"].write_text(PROFILER_WRAPPER, encoding="utf-8")
    wrappers["MemTracker"].write_text(MEMTRACKER_WRAPPER, encoding="utf-8")
    write_files(scratch / "fake_torchvision", FAKE_TORCHVISION)
    setup = Setup(
        python=args.python, scratch=scratch, programs_dir=args.programs.resolve(),
        timeout=args.timeout, timeout_ratio=args.timeout_ratio,
        memory_limit=int(args.memory_limit * 2**30) or None, env=env, wrappers=wrappers,
        fake_torchvision=scratch / "fake_torchvision",
        memsentry_path=args.memsentry_path.resolve() if args.memsentry_path else None)
    if setup.memsentry_path:
        env["PYTHONPATH"] = str(setup.memsentry_path)  # for the --help probe too
    wanted = ["python", *(m for m in args.modes.split(",") if m in MODES and m != "python")]
    modes, mode_notes = available_modes(setup, wanted)
    _compile_memsentry(setup)
    env.pop("PYTHONPATH", None)
    programs = [p for p in PROGRAMS if not args.only or any(o in p.name for o in args.only)]
    rng = random.Random(args.seed)
    head = _git("rev-parse", "--short", "HEAD")
    started = time.perf_counter()
    results = [_result(p) for p in programs]
    try:
        ready = []
        for program, result in zip(programs, results, strict=True):
            limit = warm_up(setup, program, result)
            if limit is not None:
                ready.append((program, result, limit, set[str]()))
        for index in range(args.rounds):  # rounds outermost: noise spreads over all programs
            for program, result, limit, dropped in ready:
                result["runs"].extend(bench_round(setup, program, Path(result["template"]),
                                                  modes, index, args.rounds, limit, dropped,
                                                  rng))
        for _, result, _, dropped in ready:
            result["modes"] = summarise(result["runs"], modes)
            result["dropped_after_stop"] = sorted(dropped)
            result.pop("template", None)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    meta = _meta(args, setup, modes, mode_notes, time.perf_counter() - started, head)
    machine = meta["machine"]
    if setup.memsentry_path:
        measured = (f"memsentry from {meta['memsentry_from']} (.py sha256 "
                    f"{meta['memsentry_py_sha256']}; checkout at {head})")
    else:
        modified = " + uncommitted changes" if meta["memsentry_worktree_modified"] else ""
        measured = f"memsentry {head}{modified} from {meta['memsentry_from']}"
    print(f"memsentry cost on public programs, {meta['date']}: {measured}, torch "
          f"{meta['torch']}, Python {meta['python']}, {machine['cpu']}, "
          f"{machine['usable_cores']} cores, OMP_NUM_THREADS=1, {args.rounds} rounds, "
          f"{meta['wall_seconds']} s")
    print()
    print(table(results))
    extra = [f"- {mode}: {note}" for mode, note in mode_notes.items()]
    extra += notes_for(results)
    if extra:
        print("\nNotes:\n" + "\n".join(extra))
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n",
                             encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
