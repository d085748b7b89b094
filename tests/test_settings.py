"""Each option of track() is spelled once (memsentry.settings): the signature, the checks, the
documentation, ``memsentry run``'s flags and what the callbacks pass on all follow it."""

from __future__ import annotations

import inspect

import pytest

import memsentry
from memsentry.cli import build_parser
from memsentry.integrations.session import TRACK_OPTIONS
from memsentry.settings import BY_NAME, SETTINGS


def test_the_signature_of_track_is_the_settings() -> None:
    parameters = inspect.signature(memsentry.Tracker.__init__).parameters
    keywords = {name: p.default for name, p in parameters.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert list(keywords) == [s.name for s in SETTINGS]
    for setting in SETTINGS:
        assert keywords[setting.name] == setting.default, setting.name


def test_every_option_is_documented_in_the_tracker_docstring() -> None:
    doc = memsentry.Tracker.__doc__ or ""
    for setting in SETTINGS:
        assert f"``{setting.name}`` (default ``{setting.default!r}``): " in doc


@pytest.mark.parametrize(("name", "value", "says"), [
    ("exact", 1, "takes True or False"),
    ("max_iterations", 1, "takes an int of at least 2"),
    ("holder_budget", 0, "takes a number above 0"),
    ("overhead", 11, "takes a number above 0 and at most 10, or None"),
    ("gather_timeout", float("nan"), "takes a number above 0"),
    ("on_leak", "shout", "takes one of 'warn', 'raise', 'ignore'"),
    ("snapshot_entries", 0, "takes an int of at least 1"),
    ("alarm", 3, "takes a function"),
])
def test_a_bad_value_is_refused_as_its_setting_says(name: str, value: object, says: str) -> None:
    with pytest.raises((TypeError, ValueError), match=rf"track\({name}=\.\.\.\) {says}"):
        memsentry.track(**{name: value})


def test_the_callbacks_pass_on_the_framework_options() -> None:
    assert TRACK_OPTIONS == {s.name for s in SETTINGS if s.framework}
    assert "on_leak" not in TRACK_OPTIONS and "exact" in TRACK_OPTIONS


def test_memsentry_run_has_a_flag_for_each_setting_that_names_one() -> None:
    run = build_parser()._subparsers._group_actions[0].choices["run"]  # type: ignore[union-attr]
    helps = {option: action.help for action in run._actions for option in action.option_strings}
    for setting in SETTINGS:
        if setting.flag is not None:
            assert helps[setting.flag.name] == setting.flag.help.replace("%", "%%")
    assert BY_NAME["gather_timeout"].flag is not None
