"""The pytest plugin's options and ini keys, as its ``pytest_addoption`` declares them (read by
calling it with a parser that records what it is given). No Sphinx here, so tests can use it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PluginOption:
    """One command-line option with the ini key that sets the same (when there is one)."""

    option: str
    metavar: str | None
    default: Any
    help: str
    ini: str | None
    ini_type: str | None


class _Recorder:
    def __init__(self) -> None:
        self.options: list[tuple[tuple[str, ...], dict[str, Any]]] = []
        self.inis: dict[str, tuple[str, str | None]] = {}

    def getgroup(self, *args: Any, **kwargs: Any) -> _Recorder:
        return self

    def addoption(self, *names: str, **kwargs: Any) -> None:
        self.options.append((names, kwargs))

    def addini(self, name: str, help: str, type: str | None = None, **kwargs: Any) -> None:
        self.inis[name] = (help, type)


def _declared() -> _Recorder:
    """What the plugin's ``pytest_addoption`` declares."""
    from pytest_memsentry.plugin import pytest_addoption

    recorder = _Recorder()
    pytest_addoption(recorder)  # type: ignore[arg-type]
    return recorder


def plugin_options() -> list[PluginOption]:
    """Each option of ``pytest --memsentry``'s plugin, in the order it declares them."""
    recorder = _declared()
    found = []
    for names, kwargs in recorder.options:
        option = next(n for n in names if n.startswith("--"))
        ini = option[2:].replace("-", "_")
        _, ini_type = recorder.inis.get(ini, ("", None))
        found.append(PluginOption(
            option=option, metavar=kwargs.get("metavar"), default=kwargs.get("default"),
            help=kwargs.get("help", ""), ini=ini if ini in recorder.inis else None,
            ini_type=ini_type or ("string" if ini in recorder.inis else None)))
    return found


def unmatched_inis() -> list[str]:
    """Ini keys no command-line option matches (the table would not show them)."""
    recorder = _declared()
    options = {next(n for n in names if n.startswith("--"))[2:].replace("-", "_")
               for names, _ in recorder.options}
    return sorted(set(recorder.inis) - options)


__all__ = ["PluginOption", "plugin_options", "unmatched_inis"]
