"""Whether the user's code puts hooks on single saved tensors.

``grad_fn._raw_saved_self.register_hooks(pack, unpack)`` sets the hooks of one tensor saved for
backward, and torch allows one pair per tensor (torch/csrc/autograd/saved_variable.cpp,
``SavedVariable::register_hooks``: "Calling register_hooks on a saved tensor whose hooks have
already been set"). A tensor saved under default hooks (``saved_tensors_hooks``, which
memsentry uses to count what each layer saves) already has its pair, so the user's call would
fail; nothing reaches the pair once set. So memsentry looks for such calls in the user's source
before it puts its own on, and leaves the saved tensors to the user's code where it finds one.
"""

from __future__ import annotations

import linecache
import re
from collections.abc import Iterable

from memsentry.usercode.lines import short_path
from memsentry.usercode.location import Location

_CALL = re.compile(r"\.register_hooks\s*\(")
_SAVED = "_raw_saved_"


def registers_saved_hooks(paths: Iterable[str | None]) -> Location | None:
    """The first line of ``paths`` (files of the user's code) that registers hooks on a saved
    tensor: a file that reads a ``_raw_saved_*`` attribute and calls ``.register_hooks(``."""
    for path in dict.fromkeys(p for p in paths if p):
        lines = linecache.getlines(path)
        if not any(_SAVED in line for line in lines):
            continue
        for number, line in enumerate(lines, 1):
            if _CALL.search(line):
                return Location(short_path(path), number)
    return None
