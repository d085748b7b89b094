"""The options of ``track()``, each spelled once: its name, default, what it accepts (the check
every entry point runs), its help text and, where it has one, its ``memsentry run`` flag.

From this table come ``track()``'s checks (:meth:`memsentry.record.options.Options.checked`),
the documentation of :class:`memsentry.Tracker`, ``memsentry run``'s flags, the options the
framework callbacks pass on, and the options table of the docs. It imports nothing of torch,
so the command's parser is built without it.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeGuard

from memsentry.paths import unwritable

#: The share of the loop's time memsentry may take by default, and under ``watch()``.
OVERHEAD = 0.04
WATCH_OVERHEAD = 0.01
#: Trace entries a memory_viz snapshot keeps by default (the oldest are dropped).
SNAPSHOT_ENTRIES = 100_000
#: What ``on_leak`` accepts.
ON_LEAK = ("warn", "raise", "ignore")


@dataclass(frozen=True)
class Flag:
    """An option's flag under ``memsentry run``: ``--exact`` (a switch) or ``--device DEVICE``
    (a value, ``metavar``), with the help the command shows."""

    name: str
    help: str
    metavar: str | None = None  # None: a switch


@dataclass(frozen=True)
class Setting:
    """One option. ``kind`` says what it accepts and how it is checked: ``bool``; ``int`` and
    ``number`` (at least ``low``, or above it when ``above``; at most ``high``); ``choice``
    (one of ``choices``); ``path`` (a writable file, str or ``os.PathLike``); ``callable``;
    ``device``, ``snapshot`` and ``names``, which the recorder checks with what it knows of
    devices and files. ``optional``: ``None`` is accepted too. ``framework``: the callbacks of
    :mod:`memsentry.integrations` pass it on to ``track()``."""

    name: str
    kind: str
    default: Any
    help: str
    low: float | None = None
    above: bool = False
    high: float | None = None
    choices: tuple[str, ...] = ()
    optional: bool = False
    framework: bool = True
    flag: Flag | None = None

    @property
    def accepts(self) -> str:
        """What the option takes, in words."""
        words = _WORDS.get(self.kind)
        if words is None:
            return _SPECIAL[self.kind]
        return words(self) + (", or None" if self.optional else "")

    def check(self, value: object) -> Any:
        """``value`` as the option keeps it; a bad one raises ``TypeError`` or ``ValueError``
        naming the option, what it takes and what it got."""
        if value is None and self.optional:
            return None
        checker = _CHECKS.get(self.kind)
        if checker is None:  # device, snapshot, names: checked where they are used
            return value
        if not checker(self, value):
            error = TypeError if self.kind in ("bool", "path", "callable") else ValueError
            raise error(f"track({self.name}=...) takes {self.accepts} (default "
                        f"{self.default!r}: {self.help_line}); got {value!r}")
        if self.kind == "path":
            return writable(self.name, os.fspath(value))  # type: ignore[call-overload]
        if self.kind == "number":
            return float(value)  # type: ignore[arg-type]
        return value

    @property
    def help_line(self) -> str:
        """The first sentence of the help, for error messages: ``the seconds one holder
        search may take``."""
        first = self.help.split(". ")[0].split(": ")[0].split("; ")[0].rstrip(".")
        return first[:1].lower() + first[1:]


def writable(option: str, path: str) -> str:
    """``path``, given as ``track(option=path)``, when a file can be written there; else a
    ``ValueError`` saying why (checked before anything runs)."""
    problem = unwritable(path)
    if problem is not None:
        raise ValueError(f"track({option}={path!r}): {problem}")
    return path


def _bounds_words(setting: Setting) -> str:
    """What a number option takes, in words: ``an int of at least 2``, ``a number above 0 and
    at most 10``."""
    text = "an int" if setting.kind == "int" else "a number"
    if setting.low is not None:
        text += f" {'above' if setting.above else 'of at least'} {setting.low:g}"
    if setting.high is not None:
        text += f" and at most {setting.high:g}"
    return text


#: What each kind of option takes, in words (without ``, or None``); the kinds checked where
#: they are used are in :data:`_SPECIAL`.
_WORDS: dict[str, Callable[[Setting], str]] = {
    "bool": lambda setting: "True or False",
    "int": _bounds_words,
    "number": _bounds_words,
    "choice": lambda setting: "one of " + ", ".join(map(repr, setting.choices)),
    "path": lambda setting: "the path of a file to write (a str or os.PathLike)",
    "callable": lambda setting: "a function",
}


def _is_number(value: object, kind: str) -> TypeGuard[int | float]:
    """Whether ``value`` is a finite number an option of ``kind`` (int or number) takes: not a
    bool, an int where an int belongs."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    if kind == "int" and not isinstance(value, int):
        return False
    return not (value != value or value in (float("inf"), float("-inf")))


def _above_low(setting: Setting, value: float) -> bool:
    """Whether ``value`` is at least the option's ``low`` (above it, when ``above``)."""
    if setting.low is None:
        return True
    return value > setting.low if setting.above else value >= setting.low


def _within(setting: Setting, value: float) -> bool:
    """Whether ``value`` is within the option's bounds, ``low`` and ``high``."""
    return _above_low(setting, value) and (setting.high is None or value <= setting.high)


def _number(setting: Setting, value: object) -> bool:
    """Whether an int or number option takes ``value``."""
    return _is_number(value, setting.kind) and _within(setting, value)


def _path(setting: Setting, value: object) -> bool:
    return isinstance(value, str | os.PathLike) and bool(os.fspath(value))


_CHECKS: dict[str, Callable[[Setting, object], bool]] = {
    "bool": lambda setting, value: isinstance(value, bool),
    "int": _number,
    "number": _number,
    "choice": lambda setting, value: value in setting.choices,
    "path": _path,
    "callable": lambda setting, value: callable(value),
}

_SPECIAL = {
    "device": "a device: 'cpu', 'cuda', 'cuda:1', an int or a torch.device, or None",
    "snapshot": "False, True, or the path of the pickle file to write at the end",
    "names": "a sequence of (name, object, role) triples",
}


SETTINGS: tuple[Setting, ...] = (
    Setting("device", "device", None, optional=True, help=(
        "The device to measure. By default the model's (its first parameter's); without a "
        "model, the device of the first module called on a machine with CUDA, else the CPU "
        "(memsentry never initialises CUDA in a script that does not use it)."),
        flag=Flag("--device", "device to measure (default: the first module's device)",
                  metavar="DEVICE")),
    Setting("exact", "bool", False, help=(
        "Exact peaks. On the CPU every tensor storage is counted through a dispatch mode "
        "(true peaks inside ops, about 1.15x step time) instead of reading the process heap; "
        "on CUDA the allocator's peak counters are reset at every hook (torch has one reset, "
        "for every peak), after which torch.cuda.max_memory_allocated(), "
        "max_memory_reserved() and every peak of memory_stats() read from memsentry's last "
        "sample."),
        flag=Flag("--exact", "exact peaks (CPU: count every storage, ~1.15x slower; CUDA: "
                  "resets every peak counter of the allocator)")),
    Setting("saved_tensors", "bool", True, help=(
        "Attribute the bytes saved for backward to layers (a saved-tensors hook). Turn it "
        "off for code that refuses saved-tensor hooks, such as some torch.compile graphs.")),
    Setting("backward", "bool", True, help="Measure each layer's backward."),
    Setting("max_iterations", "int", 10_000, low=2, help=(
        "Timeline entries kept before older ones are thinned out, so that memory stays "
        "bounded over any number of iterations.")),
    Setting("on_leak", "choice", "warn", choices=ON_LEAK, framework=False, help=(
        "What a LEAK finding does, as soon as a census confirms it and at the end: 'warn' "
        "gives a memsentry.LeakWarning at your line while the loop runs (at the with-block "
        "at the end), 'raise' raises a memsentry.LeakError in the loop at the next iteration "
        "boundary (or at the end, unless the block is already raising), 'ignore' nothing.")),
    Setting("holders", "bool", True, help=(
        "Search for who holds tensors (the censuses) at iteration boundaries: the findings "
        "name holders and lines only with it.")),
    Setting("holder_budget", "number", 0.5, low=0, above=True, help=(
        "The seconds of CPU time (the searching thread's own, so a busy machine slows a "
        "search without cutting it short) one holder search may take; a search that runs "
        "out says so in the report's notes.")),
    Setting("overhead", "number", OVERHEAD, low=0, above=True, high=10, optional=True, help=(
        "The share of the loop's own time everything memsentry does may take (hooks, "
        "readings, censuses, the rules run while the loop runs): 0.04 by default, 0.01 under "
        "watch(). Past it memsentry thins out (light iterations, layers measured in turn, "
        "censuses later) and the report says so; report.cost is the ledger. None measures "
        "everything whatever it costs.")),
    Setting("gather_timeout", "number", 60.0, low=0, above=True, help=(
        "In a torch.distributed process group, the seconds rank 0 waits at the end for the "
        "other ranks' reports, which its report combines (10 once the job is being stopped "
        "by a signal)."),
        flag=Flag("--gather-timeout", "under torchrun: the seconds rank 0 waits at the end "
                  "for the other ranks' reports (default 60; 10 once the job is being "
                  "stopped by a signal)", metavar="SECONDS")),
    Setting("snapshot", "snapshot", False, help=(
        "Record the allocation history for PyTorch's memory_viz: True keeps it for "
        "tracker.snapshot(path), a path also writes it there when tracking ends. On the CPU "
        "it turns exact on (the storage counter records it)."),
        flag=Flag("--snapshot", "also save the allocation history as the pickle PyTorch's "
                  "memory_viz opens (https://pytorch.org/memory_viz); on CPU it implies "
                  "--exact", metavar="FILE")),
    Setting("snapshot_entries", "int", SNAPSHOT_ENTRIES, low=1, help=(
        "The memory_viz trace entries kept, the oldest dropped (a CPU storage takes five: "
        "made and freed)."),
        flag=Flag("--snapshot-entries", "with --snapshot: the trace entries kept, the oldest "
                  f"dropped (default {SNAPSHOT_ENTRIES:,}; a CPU storage takes five)",
                  metavar="N")),
    Setting("names", "names", (), framework=False, help=(
        "Objects a framework runs, as (name, object, role) triples, named the way their own "
        "methods spell them: ('self', lightning_module, 'LightningModule'). The holder search "
        "starts from them. Held weakly.")),
    Setting("alarm", "callable", None, optional=True, framework=False, help=(
        "Called as alarm(message, leaks) in the loop's thread as soon as the census that "
        "proves a leak is taken, instead of the warning on_leak='warn' gives then; an error "
        "it raises is raised in the loop at the next iteration boundary.")),
    Setting("report_path", "path", None, optional=True, framework=False, help=(
        "A JSON file that holds the report while the run goes on, rewritten atomically at "
        "every new finding, every two minutes and at the end: a run that is killed leaves "
        "its latest report.")),
    Setting("watch", "bool", False, help=(
        "The always-on mode (memsentry.watch()): censuses also when the memory left at "
        "iteration boundaries climbs by 1 MiB since the last one."),
        flag=Flag("--watch", "the always-on mode for long runs: memsentry keeps to 1% of the "
                  "loop's time (measuring layers in the iterations that budget pays for) and "
                  "takes a census when the memory left at iteration boundaries climbs; a leak "
                  "is said on stderr as soon as it is proven, and --json FILE holds the "
                  "latest report while it runs")),
)

#: Every option by its name.
BY_NAME: dict[str, Setting] = {setting.name: setting for setting in SETTINGS}


def docstring() -> str:
    """The options as the paragraphs of a docstring: ````name```` (default): help."""
    return "\n\n".join(textwrap.fill(f"``{s.name}`` (default ``{s.default!r}``): {s.help}", 88)
                       for s in SETTINGS)


__all__ = ["BY_NAME", "ON_LEAK", "OVERHEAD", "SETTINGS", "SNAPSHOT_ENTRIES", "WATCH_OVERHEAD",
           "Flag", "Setting", "docstring", "writable"]
