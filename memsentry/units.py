"""Byte counts for people: formatting ``131072`` as ``128 KiB`` and parsing ``"1.5 MiB"``."""

from __future__ import annotations

import re

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")

_PARSE_FACTORS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def format_bytes(value: int | float | None, *, signed: bool = False, compact: bool = False) -> str:
    """Render a byte count with binary units: ``format_bytes(131072) == "128 KiB"``.

    Values under 10 units keep one decimal (``"1.5 MiB"``), larger ones are rounded to
    whole units, so a figure never takes more than eight characters. ``None`` renders as
    ``"-"`` (not measured). ``signed=True`` prefixes positive values with ``+``;
    ``compact=True`` drops the space before the unit (``"128KiB"``), for narrow tables.
    """
    if value is None:
        return "-"
    sign = "-" if value < 0 else ("+" if signed and value > 0 else "")
    size = float(abs(value))
    unit = 0
    while size >= 1024 and unit < len(_UNITS) - 1:
        size /= 1024
        unit += 1
    if unit == 0:
        text = f"{int(size)} B"
    elif size < 10:
        text = f"{size:.1f} {_UNITS[unit]}"
    else:
        text = f"{size:.0f} {_UNITS[unit]}"
    return sign + (text.replace(" ", "") if compact else text)


def parse_size(value: int | str) -> int:
    """Parse a size given as an int (bytes) or a string such as ``"512 KiB"``, ``"2GB"``.

    Binary suffixes (KiB, MiB, GiB, TiB) are powers of 1024; decimal ones (KB, MB, GB, TB,
    or K, M, G, T) are powers of 1000. Raises ``ValueError`` naming the accepted forms.
    """
    if isinstance(value, bool):
        raise ValueError(f"a size must be bytes or a string like '512 KiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative, got {value}")
        return value
    if not isinstance(value, str):
        raise ValueError(
            f"a size must be an int (bytes) or a string like '512 KiB', got {type(value).__name__}"
        )
    match = _SIZE_RE.match(value)
    factor = _PARSE_FACTORS.get(match.group(2).lower()) if match else None
    if match is None or factor is None:
        raise ValueError(
            f"cannot read {value!r} as a size: use bytes or a number with one of "
            "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (e.g. '512 KiB', '2GB', '1.5 MiB')"
        )
    return round(float(match.group(1)) * factor)
