"""Byte sizes for the plugin's options and messages: ``memsentry.units``, which imports no
torch (the plugin reads sizes while pytest starts, also in runs that never touch torch)."""

from memsentry.units import format_bytes, parse_size

__all__ = ["format_bytes", "parse_size"]
