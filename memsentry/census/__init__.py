"""Censuses: who holds tensors, hooks and garbage at an iteration boundary.

``walk`` (the object walk and its budget), ``graphs`` (autograd nodes and saved tensors),
``hooks`` (the user's hooks), ``garbage`` (what only reference cycles keep) and ``take`` (one
census, and the pytest plugin's search for given storages). A census is not cheap, so the
recorder takes one after warm-up and then at doubling intervals, each within a time budget.
Nothing here keeps an object alive after it returns.
"""

from memsentry.census.garbage import garbage_census
from memsentry.census.hooks import hook_census
from memsentry.census.take import Root, find_holders, take_census

__all__ = ["Root", "find_holders", "garbage_census", "hook_census", "take_census"]
