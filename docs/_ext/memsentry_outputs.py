"""Running the commands and programs the documentation shows, and keeping what they printed.

Nothing here imports Sphinx: the directives (:mod:`memsentry_docs`) call these functions, and
so can the tests. A command runs with ``bash -c`` in a fresh temporary directory holding a
copy of the repository's ``samples/`` folder, with the interpreter's own directory first on
``PATH`` (so ``python`` and ``memsentry`` are the build's). Its standard output and error come
through one pipe, in the order they were written, and the temporary directory's path is taken
out of what it printed.

Results are kept on disk, keyed by what was run and by the contents of the package's sources
and the samples, so that a rebuild with nothing changed runs nothing
(``MEMSENTRY_DOCS_FRESH=1`` runs everything again).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

#: The repository: this file is ``docs/_ext/memsentry_outputs.py``.
ROOT = Path(__file__).resolve().parents[2]

#: The folders whose contents decide whether a kept output is still good.
SOURCES = ("memsentry", "pytest_memsentry", "samples")

#: Lines of output a warning about a failed command quotes.
TAIL_LINES = 30

#: Seconds a command may run unless its directive says otherwise.
DEFAULT_TIMEOUT = 300.0

#: Bumped when what is kept, or how it is made, changes: older results are then ignored.
_CACHE_FORMAT = 1


class OutputTimeout(Exception):
    """A command ran past its time; ``output`` is what it had printed until then."""

    def __init__(self, timeout: float, output: str) -> None:
        super().__init__(f"timed out after {timeout:g} s")
        self.timeout = timeout
        self.output = output


@dataclass(frozen=True)
class Result:
    """What a command printed, its exit status, and the torch and device it ran with."""

    returncode: int
    output: str
    torch: str
    device: str


def environment() -> dict[str, str]:
    """The environment commands run in: this one, with the interpreter's directory first on
    ``PATH`` and the settings that keep outputs the same from one build to the next."""
    env = dict(os.environ)
    bindir = os.path.dirname(sys.executable)
    env["PATH"] = os.pathsep.join([bindir, *(p for p in env.get("PATH", "").split(os.pathsep)
                                            if p and p != bindir)])
    env.update(COLUMNS="100", PYTHONHASHSEED="0", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return env


def scrub(output: str, directory: str) -> str:
    """``output`` without the temporary ``directory``: ``<tmp>/quick.py`` becomes
    ``quick.py`` and ``<tmp>`` alone becomes ``.`` (also where the path went through
    symbolic links)."""
    spellings = {directory, os.path.realpath(directory)}
    for spelling in sorted(spellings, key=len, reverse=True):
        output = output.replace(spelling + "/", "").replace(spelling, ".")
    return output


class SetupFailed(Exception):
    """A directive's setup command exited with a status other than 0."""

    def __init__(self, command: str, returncode: int, output: str) -> None:
        super().__init__(f"the setup command `{command}` exited with status {returncode}")
        self.command = command
        self.returncode = returncode
        self.output = output


def run_output(command: str, *, timeout: float = DEFAULT_TIMEOUT, stdout_only: bool = False,
               files: Mapping[str, str] | None = None, setup: str | None = None
               ) -> tuple[int, str]:
    """Run ``command`` with ``bash -c`` in a fresh temporary directory that holds a copy of
    ``samples/`` and ``files`` (name -> text); return its exit status and what it printed
    (standard error too, unless ``stdout_only``), the directory's path taken out.

    ``setup``, when given, is run first in the same directory, its output unseen; it must
    exit with 0 (:class:`SetupFailed` otherwise). Raises :class:`OutputTimeout` when a
    command runs past ``timeout`` seconds (it and every process it started are killed)."""
    with tempfile.TemporaryDirectory(prefix="memsentry-docs-") as directory:
        shutil.copytree(ROOT / "samples", Path(directory) / "samples",
                        ignore=shutil.ignore_patterns("__pycache__"))
        for name, text in (files or {}).items():
            path = Path(directory) / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        if setup:
            returncode, output = _run(setup, directory, timeout, stdout_only=False)
            if returncode != 0:
                raise SetupFailed(setup, returncode, output)
        return _run(command, directory, timeout, stdout_only=stdout_only)


def _run(command: str, directory: str, timeout: float, *, stdout_only: bool
         ) -> tuple[int, str]:
    process = subprocess.Popen(
        ["bash", "-c", command], cwd=directory, env=environment(),
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL if stdout_only else subprocess.STDOUT,
        start_new_session=True,  # its own process group, to stop all of it on timeout
    )
    try:
        raw, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        raw, _ = process.communicate()
        raise OutputTimeout(timeout, _text(raw, directory)) from None
    return process.returncode, _text(raw, directory)


def _text(raw: bytes, directory: str) -> str:
    return scrub(raw.decode("utf-8", errors="replace"), directory).rstrip()


def status_problem(command: str, expected: int, result: Result) -> str | None:
    """What to warn about when ``command`` exited with a status other than ``expected``
    (``None`` when it did not): the command, both statuses and its last lines."""
    if result.returncode == expected:
        return None
    return (f"`{command}` exited with status {result.returncode}, expected {expected}; "
            f"{ending(result.output)}")


def ending(output: str) -> str:
    """How a warning quotes what a command printed: its last lines, or that it printed
    nothing."""
    return f"its output ended with:\n{tail(output)}" if output.strip() else "it printed nothing"


def tail(output: str, lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines of ``output``."""
    return "\n".join(output.splitlines()[-lines:])


def shorten(output: str, *, head: int | None = None, tail: int | None = None) -> str:
    """``output`` with only its first ``head`` and/or last ``tail`` lines, a line ``...``
    where lines were left out."""
    lines = output.splitlines()
    if head is None and tail is None:
        return output
    first = lines[:head or 0]
    last = lines[len(lines) - tail:] if tail else []
    if len(first) + len(last) >= len(lines):
        return output
    return "\n".join([*first, "...", *last])


def source_digest(root: Path = ROOT) -> str:
    """A hash of the names and contents of every file under :data:`SOURCES` (compiled
    files aside): a kept output is good as long as this is unchanged."""
    digest = hashlib.sha256()
    for folder in SOURCES:
        for path in sorted((root / folder).rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts or path.suffix == ".pyc":
                continue
            digest.update(path.relative_to(root).as_posix().encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def cache_key(kind: str, text: str, options: Mapping[str, object], sources: str) -> str:
    """The name a result is kept under: what ran (the directive's kind, its command or
    program, the options that change the run) and the sources it ran against."""
    plain = json.dumps([_CACHE_FORMAT, kind, text, sorted(options.items()), sources])
    return hashlib.sha256(plain.encode()).hexdigest()[:32]


def fresh() -> bool:
    """Whether kept results are to be ignored (``MEMSENTRY_DOCS_FRESH=1``)."""
    return os.environ.get("MEMSENTRY_DOCS_FRESH", "") not in ("", "0")


def platform() -> tuple[str, str]:
    """The torch version the commands run with and the device they find ("CPU", or the
    CUDA device's name), asked of the interpreter they use."""
    probe = ("import torch; print(torch.__version__); "
             "print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU')")
    try:
        done = subprocess.run([sys.executable, "-c", probe], env=environment(), check=True,
                              capture_output=True, text=True, timeout=120)
        version, device = done.stdout.split("\n")[:2]
    except (subprocess.SubprocessError, OSError, ValueError):
        return "unknown", "unknown device"
    return version.strip(), device.strip()


_PLATFORM: tuple[str, str] | None = None


def _platform() -> tuple[str, str]:
    global _PLATFORM
    if _PLATFORM is None:
        _PLATFORM = platform()
    return _PLATFORM


@contextlib.contextmanager
def _one_at_a_time(cache: Path) -> Iterator[None]:
    """Commands run one after another, even when Sphinx reads pages in parallel."""
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def cached_run(kind: str, command: str, *, cache: Path, sources: str, expected: int = 0,
               timeout: float = DEFAULT_TIMEOUT, stdout_only: bool = False,
               files: Mapping[str, str] | None = None, setup: str | None = None
               ) -> tuple[Result, bool]:
    """The result of ``command`` and whether it came from ``cache`` (a folder). A result is
    kept only when the command exited with ``expected``, so a failure is run again on the
    next build. Raises :class:`OutputTimeout` and :class:`SetupFailed` like
    :func:`run_output`."""
    options = {"stdout_only": stdout_only, "expected": expected, "setup": setup or "",
               "files": sorted((files or {}).items())}
    path = cache / f"{cache_key(kind, command, options, sources)}.json"
    if not fresh() and path.is_file():
        try:
            result = Result(**json.loads(path.read_text(encoding="utf-8")))
        except (ValueError, TypeError):
            pass  # a damaged entry: run again
        else:
            path.touch()  # used: kept by prune()
            return result, True
    with _one_at_a_time(cache):
        returncode, output = run_output(command, timeout=timeout, stdout_only=stdout_only,
                                        files=files, setup=setup)
        result = Result(returncode, output, *_platform())
    if returncode == expected:
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(asdict(result)), encoding="utf-8")
        partial.replace(path)
    return result, False


def prune(cache: Path, days: float = 30.0) -> int:
    """Remove the results in ``cache`` unused for ``days`` (made against sources long
    changed); returns how many."""
    limit = time.time() - days * 86400
    removed = 0
    for path in cache.glob("*.json") if cache.is_dir() else ():
        with contextlib.suppress(OSError):
            if path.stat().st_mtime < limit:
                path.unlink()
                removed += 1
    return removed


__all__ = [
    "DEFAULT_TIMEOUT",
    "ROOT",
    "SOURCES",
    "OutputTimeout",
    "Result",
    "SetupFailed",
    "cache_key",
    "cached_run",
    "ending",
    "environment",
    "fresh",
    "platform",
    "prune",
    "run_output",
    "scrub",
    "shorten",
    "source_digest",
    "status_problem",
    "tail",
]
