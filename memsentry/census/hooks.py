"""Hooks the user registered: per module (module hooks and its parameters' tensor hooks) and
globally, memsentry's own left out; and the number of callbacks registered with
:mod:`atexit` (see :mod:`memsentry.census.registries`)."""

from __future__ import annotations

import atexit
from collections.abc import Iterable
from typing import Any

from torch import nn

from memsentry.model import EXIT_REGISTRY, HookStats, Location
from memsentry.usercode.lines import register_line, short_path

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOK_DICTS = ("_global_forward_hooks", "_global_forward_pre_hooks",
                      "_global_backward_hooks", "_global_backward_pre_hooks")


def exit_count() -> int | None:
    """How many callbacks are registered with :mod:`atexit` (``atexit._ncallbacks()``, the
    only figure CPython exposes of them); ``None`` where it cannot be read."""
    count = getattr(atexit, "_ncallbacks", None)
    if count is None:
        return None
    try:
        return int(count())
    except Exception:
        return None


def _describe_hook(hook: Any) -> tuple[str | None, Location | None, Location | None]:
    """The hook's name, where it is defined and the line of its file that registers it."""
    while hasattr(hook, "func") and not hasattr(hook, "__code__"):  # functools.partial
        hook = hook.func
    hook = getattr(hook, "__func__", hook)
    code = getattr(hook, "__code__", None)
    if code is None:
        return type(hook).__name__, None, None
    path = short_path(code.co_filename)
    line = register_line(code.co_filename, code.co_name)
    return (code.co_name, Location(path, code.co_firstlineno, code.co_name),
            Location(path, line) if line is not None else None)


def _count_hooks(module: str | None, dicts: Iterable[dict[int, Any] | None], own: set[int],
                 out: list[HookStats]) -> None:
    count, newest = 0, None
    for hooks in dicts:
        for key, hook in (hooks or {}).items():
            if key not in own:
                count += 1
                newest = hook
    if count:
        out.append(HookStats(module, count, *_describe_hook(newest)))


def _module_dicts(module: nn.Module) -> list[Any]:
    """The hook dicts of a module and of its parameters (``None`` where one is missing)."""
    dicts: list[Any] = [getattr(module, attr, None) for attr in _HOOK_DICTS]
    for param in module._parameters.values():
        if param is not None:
            dicts.append(param._backward_hooks)
            dicts.append(getattr(param, "_post_accumulate_grad_hooks", None))
    return dicts


def _global_dicts() -> list[Any]:
    from torch.nn.modules import module as module_globals

    return [getattr(module_globals, a, None) for a in _GLOBAL_HOOK_DICTS]


def hook_census(modules: Iterable[tuple[str, nn.Module]], own: set[int]) -> tuple[HookStats, ...]:
    """User hooks per module (module hooks and its parameters' tensor hooks) and global ones
    (``module=None``); hooks whose handle id is in ``own`` are memsentry's."""
    found: list[HookStats] = []
    for name, module in modules:
        _count_hooks(name, _module_dicts(module), own, found)
    _count_hooks(None, _global_dicts(), own, found)
    return tuple(found)


def _user_hooks(dicts: Iterable[dict[int, Any] | None], own: set[int]) -> int:
    return sum(1 for hooks in dicts for key in (hooks or {}) if key not in own)


def hook_counts(modules: Iterable[tuple[str, nn.Module]], own: set[int]
                ) -> tuple[tuple[str | None, int], ...]:
    """How many user hooks each module has (those with any) and the global ones
    (``None``): what :func:`hook_census` counts, without describing them (a comparison
    between two boundaries; tens of microseconds for a small model)."""
    counts: list[tuple[str | None, int]] = [
        (name, _user_hooks(_module_dicts(module), own)) for name, module in modules]
    counts.append((None, _user_hooks(_global_dicts(), own)))
    counts.append((EXIT_REGISTRY, exit_count() or 0))
    return tuple((name, count) for name, count in counts if count)
