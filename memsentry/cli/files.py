"""Reading saved reports for the subcommands that take them (``show``, ``diff``)."""

from __future__ import annotations

import json

from memsentry.report import Report


def read_report(path: str) -> Report | str:
    """The report saved at ``path``, or what is wrong with the file."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except FileNotFoundError:
        return f"no such file: {path!r}"
    except (OSError, UnicodeDecodeError) as exc:
        return f"cannot read {path!r}: {exc}"
    except json.JSONDecodeError as exc:
        return (f"{path!r} is not JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); "
                "give a file written by `memsentry run --json` or Report.to_json()")
    try:
        return Report.from_dict(data)
    except (ValueError, TypeError, KeyError) as exc:
        return f"{path!r}: {exc}"


__all__ = ["read_report"]
