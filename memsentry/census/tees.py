"""What a branch of ``itertools.tee`` keeps: the items it has not read yet.

The branches of a tee share a linked list of blocks (``teedataobject`` in CPython's
``Modules/itertoolsmodule.c``): each block holds up to ``LINKCELLS`` (57) items read from the
source (``values[0:numread]``), the source iterator (``it``) and the next block
(``nextlink``). A branch (``teeobject``) points at a block (``dataobj``) and at its place in it
(``index``). A block stays alive while a branch points at it or at a block before it, so the
branch furthest behind keeps everything the others have read since.

Python shows none of this but the garbage collector's view (``gc.get_referents``: ``it``,
the values read, ``nextlink``, in that order), and only CPython's layout tells a branch's
place: the first ``int`` after the block's pointer. That layout is read here with
:mod:`ctypes` only after the pointers at the places it gives are checked against what the
garbage collector lists; where they do not match (another build), the branch is given none
of them (a census then misses a tee, never blames one for what it has read).
"""

from __future__ import annotations

import ctypes
import gc
import itertools
from typing import Any

#: A branch of ``itertools.tee`` (``itertools._tee``).
TEE: type = type(itertools.tee(())[0])
#: Items a block holds (``LINKCELLS`` in ``Modules/itertoolsmodule.c``).
LINKCELLS = 57
_HEAD = object.__basicsize__
_POINTER = ctypes.sizeof(ctypes.c_void_p)
_BLOCK_NAME = "_tee_dataobject"


def _pointer(obj: Any, offset: int) -> int:
    return ctypes.c_void_p.from_address(id(obj) + offset).value or 0


def _int(obj: Any, offset: int) -> int:
    return ctypes.c_int.from_address(id(obj) + offset).value


def _is_block(obj: Any) -> bool:
    return type(obj).__name__ == _BLOCK_NAME


def _block_of(tee: Any) -> Any | None:
    """The block a branch points at (the one object the garbage collector lists for it)."""
    blocks = [ref for ref in gc.get_referents(tee) if _is_block(ref)]
    return blocks[0] if len(blocks) == 1 else None


def _place(tee: Any, block: Any) -> int | None:
    """The branch's ``index`` in its block, where CPython's layout is confirmed."""
    if type(tee).__basicsize__ < _HEAD + 2 * _POINTER or _pointer(tee, _HEAD) != id(block):
        return None
    index = _int(tee, _HEAD + _POINTER)
    return index if 0 <= index <= LINKCELLS else None


def _values(block: Any) -> tuple[list[Any], Any | None] | None:
    """(the items a block has read, the next block), where CPython's layout is confirmed."""
    if type(block).__basicsize__ < _HEAD + 3 * _POINTER + 8:
        return None
    refs = gc.get_referents(block)
    source = _pointer(block, _HEAD)
    numread = _int(block, _HEAD + _POINTER)
    nextlink = _pointer(block, _HEAD + _POINTER + 8)
    start = 1 if source else 0
    if not _matches(refs, source, numread, nextlink):
        return None
    return refs[start:start + numread], refs[-1] if nextlink else None


def _matches(refs: list[Any], source: int, numread: int, nextlink: int) -> bool:
    """Whether what the layout gives (the source's and the next block's addresses, the items
    read) is what the garbage collector lists: ``source``, ``numread`` items, ``nextlink``."""
    if not 0 <= numread <= LINKCELLS:
        return False
    if len(refs) != (1 if source else 0) + numread + (1 if nextlink else 0):
        return False
    return not (source and id(refs[0]) != source) and not (nextlink and id(refs[-1]) != nextlink)


def tee_items(tee: Any) -> list[Any]:
    """The items the branch ``tee`` has not read yet, oldest first."""
    block = _block_of(tee)
    if block is None:
        return []
    index = _place(tee, block)
    if index is None:
        return []
    waiting: list[Any] = []
    while block is not None:
        read = _values(block)
        if read is None:  # another layout
            return []
        values, block = read
        waiting += values[index:]
        index = 0
    return waiting
