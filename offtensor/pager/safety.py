"""Exception safety: what puts a pager right after an exception cut one of its steps short.

The rule itself is in the package docstring (``pager/__init__.py``, "Exceptions"). This module holds
its three tools: the lock's hold count read as a depth (``lock_depth``), giving the lock back to a
depth read before anything was touched (``restore_depth``, right wherever the exception struck), and
the recount of every derived count from the cache itself (``recount``), which the pager runs once
no op holds it.
"""

from __future__ import annotations

import re

import torch


def lock_depth(lock):
    """A function returning how many holds of ``lock`` (an ``RLock``) the calling thread has: its
    C method where Python has one (3.11+), else read from its repr."""
    count = getattr(lock, "_recursion_count", None)
    if count is not None:
        return count
    pattern = re.compile(r"count=(\d+)")

    def depth() -> int:
        if not lock._is_owned():
            return 0
        found = pattern.search(repr(lock))
        return int(found.group(1)) if found else 1

    return depth


def restore_depth(lock, depth_of, depth: int) -> None:
    """Give back the calling thread's holds of ``lock`` above ``depth``: idempotent, so the same call
    is right whether the step it undoes took its hold or not."""
    while depth_of() > depth:
        lock.release()


def recount(cache, budget, pool, lifetimes, ops) -> None:
    """Recount, from the cached copies, everything a step cut short may have left wrong. Runs with
    the lock held and no op holding a copy: every copy's users is 0, the paged bytes are the cached
    copies', the slot pool holds the cached copies' slots as live and its idle lists as idle.

    A slot or transient copy an interrupted step took and never recorded is simply forgotten, once
    every copy in flight has completed and, on a GPU, every op queued has run (nothing reads or
    writes it after that)."""
    lifetimes.wait_for(None)
    if ops.gpu:
        torch.cuda.synchronize(ops.device)
    budget.paged_bytes, slots = cache.recount()
    if pool is not None:
        pool.recount(slots)
