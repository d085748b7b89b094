"""Public-corpus benchmark: memsentry on real public training scripts and test suites.

Each public program runs twice, unmodified and as a leaky copy: the harness copies it into a
temporary folder and applies a small textual mutation (every replaced text must occur exactly
once, so a mutation can never silently do nothing). Scripts run under ``memsentry run --json``;
test suites under ``pytest --memsentry``. Per run the table says what memsentry reported, whether
the expected LEAK (rule and holder name) was found, the LEAK findings nobody expected (on an
unmodified program each one is a false LEAK unless shown real), and the iteration whose census
first names the expected leak (the saved report replayed through the rules with only the
censuses up to that iteration).

No public code is kept in this repository; it is read at run time from

* ``--examples DIR``: a checkout of github.com/pytorch/examples (word_language_model,
  regression, time_sequence_prediction, gat), and
* packages installed in the corpus virtualenv: skorch (its tests ship in the wheel) and
  gpytorch (its tests come from the sdist of the installed version, downloaded with pip).

Set up a separate virtualenv (never let pip pick another torch), then run the harness with it:

    python3 -m venv /tmp/corpus/venv
    /tmp/corpus/venv/bin/pip install torch==2.13.0
    /tmp/corpus/venv/bin/pip install -e . numpy matplotlib requests pytest skorch gpytorch \\
        torch==2.13.0
    /tmp/corpus/venv/bin/python benchmarks/public_corpus.py --examples /tmp/corpus/examples \\
        --json benchmarks/public-corpus-results.json

Small data is made at run time: the wikitext-2 files cut to a few hundred lines (train.txt from
valid.txt where the checkout lacks it), the sine waves of generate_sine_wave.py cut to 24 series
of 201 points, and a random graph in Cora's file format for gat (Cora itself is downloaded by
the script, and this machine has no network but PyPI). Every run has a time limit and runs with
OMP_NUM_THREADS=1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import date
from itertools import pairwise
from pathlib import Path
from typing import Any

from tabulate import tabulate

# --------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mutation:
    """A leaky copy: ``edits`` are (old, new) replacements in ``file`` (each ``old`` must occur
    exactly once); memsentry should then report ``rule`` as a LEAK naming ``holder``. For a
    suite, ``test`` is the node id suffix of the test that must fail as LEAKED."""

    description: str
    file: str
    edits: tuple[tuple[str, str], ...]
    rule: str
    holder: str
    test: str | None = None


@dataclass
class Context:
    """What the cases are built from."""

    python: str
    examples: Path | None
    sdist_cache: Path
    env: dict[str, str]


Prepare = Callable[[Context, Path], None]


@dataclass(frozen=True)
class Case:
    """One public program. ``prepare`` fills an empty work folder; ``args`` is the script and its
    arguments (kind ``script``) or pytest's targets (kind ``suite``), relative to that folder."""

    name: str
    source: str
    kind: str
    prepare: Prepare
    args: tuple[str, ...]
    mutation: Mutation
    needs_examples: bool = False
    modules: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)


def _copy_example(ctx: Context, folder: str, work: Path) -> None:
    assert ctx.examples is not None
    shutil.copytree(ctx.examples / folder, work, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("data", "__pycache__"))


def _head(src: Path, dst: Path, start: int, count: int) -> None:
    lines = src.read_text(encoding="utf-8").splitlines(keepends=True)
    dst.write_text("".join(lines[start:start + count]), encoding="utf-8")


def prepare_word_lm(ctx: Context, work: Path) -> None:
    """word_language_model, with wikitext-2 cut to ~600/200/200 lines in ``work/data``."""
    assert ctx.examples is not None
    _copy_example(ctx, "word_language_model", work)
    corpus = ctx.examples / "word_language_model" / "data" / "wikitext-2"
    data = work / "data"
    data.mkdir()
    if (corpus / "train.txt").is_file():
        _head(corpus / "train.txt", data / "train.txt", 0, 600)
        _head(corpus / "valid.txt", data / "valid.txt", 0, 200)
    else:  # some mirrors lack the 10 MB train.txt: train on the first part of valid.txt
        _head(corpus / "valid.txt", data / "train.txt", 0, 600)
        _head(corpus / "valid.txt", data / "valid.txt", 600, 200)
    _head(corpus / "test.txt", data / "test.txt", 0, 200)


def prepare_regression(ctx: Context, work: Path) -> None:
    _copy_example(ctx, "regression", work)


def prepare_time_sequence(ctx: Context, work: Path) -> None:
    """The example's own generate_sine_wave.py, then its data cut to 24 series of 201 points
    (a 1000-point LBFGS step takes a minute on two cores)."""
    _copy_example(ctx, "time_sequence_prediction", work)
    _check([ctx.python, "generate_sine_wave.py"], work, ctx.env)
    cut = ("import torch\n"
           "d = torch.load('traindata.pt', weights_only=False)\n"
           "torch.save(d[:24, :201].copy(), open('traindata.pt', 'wb'))\n")
    _check([ctx.python, "-c", cut], work, ctx.env)


def prepare_gat(ctx: Context, work: Path, nodes: int = 1700, features: int = 128,
                classes: int = 7, edges: int = 5000) -> None:
    """gat/main.py and a random graph in Cora's format in ``work/cora`` (the script downloads
    Cora only when that folder lacks it). It needs more than 1600 nodes (its split)."""
    _copy_example(ctx, "gat", work)
    rng = random.Random(0)
    ids = rng.sample(range(1, 1_000_000), nodes)
    labels = [rng.randrange(classes) for _ in range(nodes)]
    (work / "cora").mkdir()
    with open(work / "cora" / "cora.content", "w", encoding="utf-8") as content:
        for node, label in zip(ids, labels, strict=True):
            bits = [int(rng.random() < 0.05 or j == 3 * label) for j in range(features)]
            content.write("\t".join([str(node), *map(str, bits), f"class_{label}"]) + "\n")
    with open(work / "cora" / "cora.cites", "w", encoding="utf-8") as cites:
        for _ in range(edges):
            cites.write(f"{rng.choice(ids)}\t{rng.choice(ids)}\n")


def prepare_gpytorch(ctx: Context, work: Path) -> None:
    """The sdist of the installed gpytorch (pip download), unpacked into ``work``."""
    version = _query(ctx, "import importlib.metadata as m; print(m.version('gpytorch'))")
    name = f"gpytorch-{version}.tar.gz"
    sdist = ctx.sdist_cache / name
    if not sdist.is_file():
        _check([ctx.python, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                "-d", str(ctx.sdist_cache), f"gpytorch=={version}"], work, ctx.env)
    with tarfile.open(sdist) as archive:
        archive.extractall(work, filter="data")
    root = work / f"gpytorch-{version}"
    for entry in root.iterdir():
        entry.rename(work / entry.name)
    root.rmdir()


def prepare_skorch(ctx: Context, work: Path) -> None:
    """The tests skorch ships inside its package, copied to ``work/tests``."""
    package = _query(ctx, "import os, skorch; print(os.path.dirname(skorch.__file__))")
    shutil.copytree(Path(package) / "tests", work / "tests",
                    ignore=shutil.ignore_patterns("__pycache__"))


_WLM_ARGS = ("--data", "data", "--emsize", "32", "--nhid", "32", "--bptt", "20",
             "--save", "model.pt")
_GP_TESTS = tuple(f"test/examples/test_{name}.py" for name in (
    "simple_gp_regression", "sgpr_regression", "simple_gp_classification",
    "kissgp_gp_regression", "batch_gp_regression", "fixed_noise_fanatasy_updates",
    "white_noise_regression", "grid_gp_regression", "lowrank_gp_regression",
    "svgp_gp_regression"))

CASES: tuple[Case, ...] = (
    Case(
        name="word_language_model (LSTM, manual SGD)",
        source="pytorch/examples word_language_model/main.py",
        kind="script", prepare=prepare_word_lm, needs_examples=True,
        args=("main.py", *_WLM_ARGS, "--epochs", "2"),
        mutation=Mutation(
            description="`total_loss += loss.item()` -> `total_loss += loss`",
            file="main.py",
            edits=(("total_loss += loss.item()", "total_loss += loss"),),
            rule="retained-graph", holder="total_loss"),
    ),
    Case(
        name="word_language_model (Transformer, AdamW)",
        source="pytorch/examples word_language_model/main.py",
        kind="script", prepare=prepare_word_lm, needs_examples=True,
        args=("main.py", *_WLM_ARGS, "--epochs", "1", "--model", "Transformer",
              "--use-optimizer", "--lr", "0.001"),
        mutation=Mutation(
            description="module-level `outputs = []`; `outputs.append(output)` after the loss",
            file="main.py",
            edits=(("\ndef train():\n", "\noutputs = []\ndef train():\n"),
                   ("        loss = criterion(output, targets)\n",
                    "        loss = criterion(output, targets)\n"
                    "        outputs.append(output)\n")),
            rule="tensor-accumulation", holder="outputs"),
    ),
    Case(
        name="regression (manual SGD, until converged)",
        source="pytorch/examples regression/main.py",
        kind="script", prepare=prepare_regression, needs_examples=True,
        args=("main.py",),
        mutation=Mutation(
            description="`losses = []` before the loop; `losses.append(output)` after `.item()`",
            file="main.py",
            edits=(("\nfor batch_idx in count(1):\n",
                    "\nlosses = []\nfor batch_idx in count(1):\n"),
                   ("    loss = output.item()\n",
                    "    loss = output.item()\n    losses.append(output)\n")),
            rule="tensor-accumulation", holder="losses"),
    ),
    Case(
        name="time_sequence_prediction (LSTMCell, LBFGS)",
        source="pytorch/examples time_sequence_prediction/train.py",
        kind="script", prepare=prepare_time_sequence, needs_examples=True,
        args=("train.py", "--steps", "12"), modules=("numpy", "matplotlib"),
        # the script's torch.load of a numpy array predates torch 2.6's weights_only default
        env={"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1", "MPLBACKEND": "Agg"},
        mutation=Mutation(
            description="`losses = []`; `losses.append(optimizer.step(closure))` (LBFGS "
                        "returns the closure's first loss, graph attached)",
            file="train.py",
            edits=(("    #begin to train\n", "    losses = []\n    #begin to train\n"),
                   ("        optimizer.step(closure)\n",
                    "        losses.append(optimizer.step(closure))\n")),
            rule="tensor-accumulation", holder="losses"),
    ),
    Case(
        name="gat (graph attention, Adam)",
        source="pytorch/examples gat/main.py",
        kind="script", prepare=prepare_gat, needs_examples=True,
        args=("main.py", "--epochs", "20", "--hidden-dim", "16", "--num-heads", "2",
              "--val-every", "5", "--no-accel"),
        modules=("numpy", "requests"),
        mutation=Mutation(
            description="mutable default `history=[]` on train_iter(); "
                        "`history.append(output)` after optimizer.step()",
            file="main.py",
            edits=(("mask_train, mask_val, print_every=10):\n",
                    "mask_train, mask_val, print_every=10, history=[]):\n"),
                   ("    loss.backward()\n    optimizer.step()\n",
                    "    loss.backward()\n    optimizer.step()\n    history.append(output)\n")),
            # the default list, as Python spells it: the local `history` is gone after a call
            rule="tensor-accumulation", holder="train_iter.__defaults__"),
    ),
    Case(
        name="gpytorch test suite (test/examples, 10 files)",
        source="PyPI gpytorch sdist test/examples",
        kind="suite", prepare=prepare_gpytorch, args=_GP_TESTS, modules=("gpytorch",),
        mutation=Mutation(
            description="module-level `loss_history = []`; the SGPR training loop appends "
                        "its loss",
            file="test/examples/test_sgpr_regression.py",
            edits=(("from gpytorch.utils.warnings import NumericalWarning\n",
                    "from gpytorch.utils.warnings import NumericalWarning\n\n"
                    "loss_history = []\n"),
                   ("                loss.backward()\n                optimizer.step()\n\n"
                    "                # Check that we have the right LinearOperator type\n",
                    "                loss.backward()\n                optimizer.step()\n"
                    "                loss_history.append(loss)\n\n"
                    "                # Check that we have the right LinearOperator type\n")),
            rule="LEAKED", holder="loss_history",
            test="test_sgpr_regression.py::TestSGPRRegression::test_sgpr_mean_abs_error"),
    ),
    Case(
        name="skorch test suite (classifier, regressor)",
        source="PyPI skorch wheel skorch/tests",
        kind="suite", prepare=prepare_skorch,
        args=("tests/test_classifier.py", "tests/test_regressor.py"), modules=("skorch",),
        mutation=Mutation(
            description="module-level `predictions = []`; test_net_learns appends "
                        "`net.forward(X)`",
            file="tests/test_regressor.py",
            edits=(("\nimport numpy as np\n", "\nimport numpy as np\n\npredictions = []\n"),
                   ("        net.fit(X, y)\n        train_losses = net.history[:, 'train_loss']\n",
                    "        net.fit(X, y)\n        predictions.append(net.forward(X))\n"
                    "        train_losses = net.history[:, 'train_loss']\n")),
            rule="LEAKED", holder="predictions",
            test="test_regressor.py::TestNeuralNetRegressor::test_net_learns"),
    ),
)


def mutate(work: Path, mutation: Mutation) -> None:
    """Apply ``mutation`` in ``work``; each replaced text must occur exactly once."""
    path = work / mutation.file
    text = path.read_text(encoding="utf-8")
    for old, new in mutation.edits:
        found = text.count(old)
        if found != 1:
            raise RuntimeError(f"mutation of {mutation.file}: {old!r} occurs {found} times, "
                               "not once (did the public code change?)")
        text = text.replace(old, new)
    path.write_text(text, encoding="utf-8")


# --------------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    code: int | None  # None: killed at the time limit
    seconds: float
    output: str


def _run(command: Sequence[str], cwd: Path, env: dict[str, str], timeout: float) -> Outcome:
    """Run ``command`` in its own process group; kill the group at ``timeout`` seconds."""
    started = time.perf_counter()
    with subprocess.Popen(list(command), cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, errors="replace",
                          start_new_session=True) as process:
        try:
            output, _ = process.communicate(timeout=timeout)
            code: int | None = process.returncode
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            code = None
    return Outcome(code, round(time.perf_counter() - started, 1), output)


def _check(command: Sequence[str], cwd: Path, env: dict[str, str]) -> str:
    outcome = _run(command, cwd, env, timeout=600)
    if outcome.code != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({outcome.code}):\n"
                           f"{outcome.output[-2000:]}")
    return outcome.output


def _query(ctx: Context, code: str) -> str:
    return _check([ctx.python, "-c", code], Path.cwd(), ctx.env).strip().splitlines()[-1]


def _missing_modules(ctx: Context, modules: Sequence[str]) -> list[str]:
    if not modules:
        return []
    code = ("import importlib.util, sys; print(' '.join(m for m in sys.argv[1:] "
            "if importlib.util.find_spec(m) is None))")
    return _check([ctx.python, "-c", code, *modules], Path.cwd(), ctx.env).split()


# --------------------------------------------------------------------------------------------
# Scripts: memsentry run
# --------------------------------------------------------------------------------------------


def _matches(finding: dict[str, Any], rule: str, holder: str) -> bool:
    return finding["rule"] == rule and finding["severity"] == "leak" and holder in finding[
        "message"]


def first_detection(report_path: Path, rule: str, holder: str) -> int | None:
    """The first census iteration at which the rules, given only the censuses and iterations up
    to it, report the expected LEAK (None: at none)."""
    from memsentry import Severity
    from memsentry.report import Report
    from memsentry.rules import analyse

    report = Report.from_dict(json.loads(report_path.read_text(encoding="utf-8")))
    for census in report.censuses:
        upto = census.iteration
        prefix = dataclasses.replace(
            report, findings=(),
            censuses=tuple(c for c in report.censuses if c.iteration <= upto),
            iterations=tuple(i for i in report.iterations if i.index <= upto))
        found = analyse(prefix)
        if any(f.rule == rule and f.severity is Severity.LEAK and holder in f.message
               for f in found):
            return upto
    return None


def run_script(ctx: Context, case: Case, work: Path, leaky: bool,
               timeout: float) -> dict[str, Any]:
    report_path = work / "memsentry-report.json"
    command = [ctx.python, "-m", "memsentry", "run", "--json", str(report_path), *case.args]
    outcome = _run(command, work, {**ctx.env, **case.env}, timeout)
    row: dict[str, Any] = {"exit": outcome.code, "seconds": outcome.seconds}
    if not report_path.is_file():
        row["error"] = outcome.output[-3000:]
        return row
    report = json.loads(report_path.read_text(encoding="utf-8"))
    findings = [{"rule": f["rule"], "severity": f["severity"], "message": f["message"]}
                for f in report["findings"]]
    leaks = [f for f in findings if f["severity"] == "leak"]
    mutation = case.mutation
    expected = [f for f in leaks if _matches(f, mutation.rule, mutation.holder)] if leaky else []
    row.update(
        iterations=len(report["iterations"]),
        censuses=[c["iteration"] for c in report["censuses"]],
        reported=findings,
        found=bool(expected) if leaky else not leaks,
        rule_found=any(f["rule"] == mutation.rule for f in leaks) if leaky else None,
        holder_named=bool(expected) if leaky else None,
        # in a leaky copy, memory-growth (the fallback when no cause is named) is the same leak
        unexpected_leaks=[f for f in leaks if f not in expected
                          and not (leaky and f["rule"] == "memory-growth")],
        first_leak_at=first_detection(report_path, mutation.rule, mutation.holder)
        if expected else None,
    )
    if outcome.code not in (0, None):
        row["error"] = outcome.output[-3000:]
    return row


# --------------------------------------------------------------------------------------------
# Suites: pytest --memsentry, and a plain re-run that checks a LEAKED test's growth
# --------------------------------------------------------------------------------------------

#: A pytest plugin the harness writes next to each suite run: it records every failed report
#: (node id, phase, its text with the memsentry section, captured output left out) and, with
#: CORPUS_PROBE_REPEAT=N, runs each selected test N times and records the process's malloc'd
#: bytes after each run.
PROBE = '''
import ctypes, gc, json, os
import pytest

OUT = os.environ["CORPUS_PROBE_OUT"]
REPEAT = int(os.environ.get("CORPUS_PROBE_REPEAT", "0"))
_records = []


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _used():
    gc.collect()
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
    except (OSError, AttributeError):
        return None
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def pytest_collection_modifyitems(items):
    if REPEAT:
        items[:] = [item for item in items for _ in range(REPEAT)]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    yield
    if REPEAT:
        _records.append({"nodeid": item.nodeid, "used": _used()})


def pytest_runtest_logreport(report):
    if report.failed:
        text = report.longreprtext + "\\n" + "\\n".join(
            f"--- {title}\\n{body}" for title, body in report.sections
            if "memsentry" in title)
        _records.append({"nodeid": report.nodeid, "when": report.when, "text": text})
    elif report.when == "call":
        _records.append({"nodeid": report.nodeid, "when": "call", "passed": report.passed})


def pytest_sessionfinish(session):
    with open(OUT, "w", encoding="utf-8") as handle:
        json.dump(_records, handle)
'''

_LEAKED = re.compile(r"^memsentry: (?P<size>[\d.]+ ?[KMGT]?i?B) leaked on ")


def _pytest(ctx: Context, work: Path, targets: Sequence[str], timeout: float,
            memsentry: bool, repeat: int = 0) -> tuple[Outcome, list[dict[str, Any]]]:
    probe_dir = work / ".corpus_probe"
    probe_dir.mkdir(exist_ok=True)
    (probe_dir / "_corpus_probe.py").write_text(PROBE, encoding="utf-8")
    out = probe_dir / f"records-{int(memsentry)}-{repeat}.json"
    env = {**ctx.env, "CORPUS_PROBE_OUT": str(out), "CORPUS_PROBE_REPEAT": str(repeat),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(probe_dir),
                                                       ctx.env.get("PYTHONPATH")]))}
    command = [ctx.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
               "_corpus_probe", "-W", "ignore", *(["--memsentry"] if memsentry else []),
               *targets]
    outcome = _run(command, work, env, timeout)
    records = json.loads(out.read_text(encoding="utf-8")) if out.is_file() else []
    return outcome, records


def _leaked(records: list[dict[str, Any]]) -> dict[str, str]:
    """LEAKED tests (node id -> memsentry's failure text)."""
    return {r["nodeid"]: r["text"] for r in records
            if "text" in r and _LEAKED.match(r["text"])}


def confirm_growth(ctx: Context, work: Path, leaked: dict[str, str], timeout: float,
                   repeat: int = 8) -> dict[str, dict[str, Any]]:
    """Re-run each LEAKED test ``repeat`` times in one plain pytest process (no memsentry) and
    measure glibc's malloc'd bytes after each run: a real leak grows by about what memsentry
    said on every run. Confirmed: growth per run (after a warm-up run) >= half memsentry's
    size, and the bytes rose after most runs."""
    from memsentry.units import parse_size

    if not leaked:
        return {}
    outcome, records = _pytest(ctx, work, list(leaked), timeout, memsentry=False,
                               repeat=repeat)
    verdicts: dict[str, dict[str, Any]] = {}
    for nodeid, text in leaked.items():
        match = _LEAKED.match(text)
        reported = parse_size(match["size"].replace(" ", "")) if match else 0
        used = [r["used"] for r in records if r["nodeid"] == nodeid and "used" in r]
        if len(used) < 3 or None in used:
            verdicts[nodeid] = {"confirmed": None, "reported_bytes": reported,
                                "why": f"re-run gave {len(used)} samples ({outcome.code})"}
            continue
        steps = [b - a for a, b in pairwise(used[1:])]
        per_run = (used[-1] - used[1]) / len(steps)
        verdicts[nodeid] = {
            "confirmed": per_run >= reported / 2 and sum(s > 0 for s in steps) > len(steps) / 2,
            "reported_bytes": reported, "growth_per_run": round(per_run),
            "runs": len(used)}
    return verdicts


def run_suite(ctx: Context, case: Case, work: Path, leaky: bool, timeout: float,
              baseline: dict[str, Any] | None) -> dict[str, Any]:
    outcome, records = _pytest(ctx, work, case.args, timeout, memsentry=True)
    leaked = _leaked(records)
    calls = [r for r in records if r.get("when") == "call"]
    failed_other = sorted({r["nodeid"] for r in records if "text" in r} - set(leaked))
    row: dict[str, Any] = {
        "exit": outcome.code, "seconds": outcome.seconds,
        "tests": len({r["nodeid"] for r in calls}),
        "leaked": leaked, "failed_for_other_reasons": failed_other,
        "reported": [{"rule": "LEAKED", "severity": "leak", "test": n,
                      "message": t.splitlines()[0]} for n, t in leaked.items()],
    }
    mutation = case.mutation
    if leaky:
        assert mutation.test is not None
        hits = {n: t for n, t in leaked.items() if n.endswith(mutation.test)}
        before = set((baseline or {}).get("leaked", {}))
        row["mutated_test_text"] = "\n".join(hits.values()) or None
        row.update(found=any(mutation.holder in t for t in hits.values()),
                   rule_found=bool(hits), holder_named=any(
                       mutation.holder in t for t in hits.values()),
                   unexpected_leaks=[{"test": n, "message": t.splitlines()[0]}
                                     for n, t in leaked.items()
                                     if n not in hits and n not in before])
    else:
        growth = confirm_growth(ctx, work, leaked, timeout)
        row["growth_check"] = growth
        unconfirmed = [n for n in leaked if not growth.get(n, {}).get("confirmed")]
        row.update(found=not unconfirmed, rule_found=None, holder_named=None,
                   unexpected_leaks=[{"test": n, "message": leaked[n].splitlines()[0]}
                                     for n in unconfirmed],
                   real_leaks=[n for n in leaked if n not in unconfirmed])
    if not records:
        row["error"] = outcome.output[-3000:]
    return row


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def evaluate(ctx: Context, case: Case, scratch: Path, timeout: float) -> list[dict[str, Any]]:
    """Both runs of ``case``: unmodified, then the leaky copy."""
    rows: list[dict[str, Any]] = []
    base: dict[str, Any] = {"case": case.name, "source": case.source, "kind": case.kind}
    skip = None
    if case.needs_examples and ctx.examples is None:
        skip = "no --examples checkout given"
    elif missing := _missing_modules(ctx, case.modules):
        skip = f"missing in the corpus venv: {', '.join(missing)}"
    baseline: dict[str, Any] | None = None
    for leaky in (False, True):
        mutation = case.mutation
        row = {**base, "variant": "leaky copy" if leaky else "unmodified",
               "mutation": mutation.description if leaky else None,
               "expected": f"{mutation.rule} `{mutation.holder}`" if leaky else "no LEAK"}
        if skip:
            rows.append({**row, "skipped": skip})
            continue
        work = Path(tempfile.mkdtemp(prefix="case-", dir=scratch))
        started = time.perf_counter()
        try:
            case.prepare(ctx, work)
            if leaky:
                mutate(work, mutation)
            if case.kind == "script":
                row.update(run_script(ctx, case, work, leaky, timeout))
            else:
                row.update(run_suite(ctx, case, work, leaky, timeout, baseline))
        except RuntimeError as exc:
            row["error"] = str(exc)
        row["total_seconds"] = round(time.perf_counter() - started, 1)
        baseline = baseline or row
        rows.append(row)
        print(f"  {row['case']} / {row['variant']}: {_summary(row)} "
              f"({row['total_seconds']} s)", file=sys.stderr, flush=True)
    return rows


def _summary(row: dict[str, Any]) -> str:
    if "skipped" in row:
        return f"skipped: {row['skipped']}"
    if "found" not in row:
        return "error"
    counts = Counter(f"{f['rule']} ({f['severity']})" for f in row["reported"])
    return ", ".join(f"{k} x{v}" if v > 1 else k for k, v in counts.items()) or "-"


def _yes(value: object) -> str:
    return "-" if value is None else ("yes" if value else "NO")


def _found(row: dict[str, Any]) -> str:
    """yes; rule only (the expected rule or LEAKED test, without the holder's name); NO."""
    if "skipped" in row:
        return "skipped"
    if row.get("found") is None:
        return "ERROR"
    if not row["found"] and row.get("rule_found"):
        return "rule only"
    return _yes(row["found"])


def table(rows: list[dict[str, Any]]) -> str:
    lines = []
    for r in rows:
        extra = ""
        if r.get("real_leaks"):
            extra = f" ({len(r['real_leaks'])} confirmed real)"
        lines.append([
            r["case"], r["variant"], r["expected"], _summary(r) + extra, _found(r),
            _yes(r.get("holder_named")), len(r.get("unexpected_leaks", [])),
            r.get("first_leak_at") or "-", r.get("exit", "-"),
            r.get("total_seconds", "-")])
    return tabulate(lines, headers=["program", "run", "expected", "memsentry reported", "found",
                                    "holder named", "unexpected LEAKs", "first LEAK at iter",
                                    "exit", "s"], tablefmt="github")


def details(rows: list[dict[str, Any]]) -> list[str]:
    """The messages behind every miss, unexpected LEAK and error."""
    out = []
    for r in rows:
        head = f"- {r['case']} / {r['variant']}"
        if r.get("error"):
            out.append(f"{head}: error (exit {r.get('exit')}): "
                       + r["error"].strip().splitlines()[-1][:300])
        if r.get("variant") == "leaky copy" and r.get("found") is False:
            if r["kind"] == "suite":
                text = r.get("mutated_test_text") or "the mutated test did not fail as LEAKED"
                got = "\n    " + "\n    ".join(text.splitlines()[:16])
            else:
                got = "; ".join(f"{f['rule']} ({f['severity']}): {f['message']}"
                                for f in r.get("reported", [])) or "nothing"
            out.append(f"{head}: MISSED {r['expected']}; memsentry said: {got}")
        for leak in r.get("unexpected_leaks", []):
            where = leak.get("test") or leak.get("rule")
            out.append(f"{head}: unexpected LEAK {where}: {leak['message']}")
        for nodeid in r.get("real_leaks", []):
            check = r["growth_check"][nodeid]
            out.append(f"{head}: LEAKED {nodeid} is real: memsentry said "
                       f"{check['reported_bytes']} B, a plain re-run grows "
                       f"{check['growth_per_run']} B per run")
    return out


def totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ran = [r for r in rows if "found" in r]
    leaky = [r for r in ran if r["variant"] == "leaky copy"]
    plain = [r for r in ran if r["variant"] == "unmodified"]
    return {
        "programs": len({r["case"] for r in ran}),
        "leaky_copies": len(leaky),
        "leaks_found": sum(bool(r["found"]) for r in leaky),
        "leaks_missed": sum(not r["found"] for r in leaky),
        "rule_without_holder": sum(not r["found"] and bool(r["rule_found"]) for r in leaky),
        "holders_named": sum(bool(r["holder_named"]) for r in leaky),
        "false_leaks_on_unmodified": sum(len(r["unexpected_leaks"]) for r in plain),
        "confirmed_real_leaks_on_unmodified": sum(len(r.get("real_leaks", [])) for r in plain),
        "stray_leaks_in_leaky_copies": sum(len(r["unexpected_leaks"]) for r in leaky),
        "errors_or_skips": len(rows) - len(ran) + sum("error" in r for r in ran),
        "seconds": round(sum(r.get("total_seconds", 0) for r in rows), 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--examples", type=Path,
                        help="a checkout of github.com/pytorch/examples")
    parser.add_argument("--python", default=sys.executable,
                        help="the corpus venv's python (default: this one)")
    parser.add_argument("--json", type=Path, help="write the rows and totals to this file")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per run")
    parser.add_argument("--only", action="append", default=[],
                        help="run the cases whose name contains this text (repeatable)")
    parser.add_argument("--sdist-cache", type=Path,
                        help="where downloaded sdists are kept (default: a temp folder)")
    parser.add_argument("--keep", action="store_true", help="keep the work folders")
    args = parser.parse_args(argv)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PYTHONPATH", None)
    scratch = Path(tempfile.mkdtemp(prefix="public-corpus-"))
    sdists = args.sdist_cache or scratch / "sdists"
    sdists.mkdir(parents=True, exist_ok=True)
    ctx = Context(python=args.python, examples=args.examples.resolve() if args.examples
                  else None, sdist_cache=sdists.resolve(), env=env)
    cases = [c for c in CASES if not args.only or any(o in c.name for o in args.only)]
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    try:
        for case in cases:
            rows.extend(evaluate(ctx, case, scratch, args.timeout))
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    summary = totals(rows)
    summary["wall_seconds"] = round(time.perf_counter() - started, 1)
    versions = _query(ctx, "import torch, memsentry, platform; print(memsentry.__version__, "
                      "torch.__version__, platform.python_version())").split()
    print(f"memsentry public-corpus benchmark, {date.today().isoformat()}: memsentry "
          f"{versions[0]}, torch {versions[1]}, Python {versions[2]}, {platform.machine()}, "
          f"CPU, OMP_NUM_THREADS=1")
    print(table(rows))
    print()
    print(", ".join(f"{k.replace('_', ' ')}: {v}" for k, v in summary.items()))
    notes = details(rows)
    if notes:
        print("\nDetails:\n" + "\n".join(notes))
    if args.json:
        args.json.write_text(json.dumps({
            "date": date.today().isoformat(), "memsentry": versions[0], "torch": versions[1],
            "python": versions[2], "machine": platform.machine(),
            "examples": str(ctx.examples) if ctx.examples else None,
            "rows": rows, "totals": summary}, indent=2) + "\n", encoding="utf-8")
    failed = summary["leaks_missed"] or summary["false_leaks_on_unmodified"]
    return 1 if failed or summary["errors_or_skips"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
