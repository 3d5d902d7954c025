"""Exception safety: what puts a pager right after an exception cut one of its steps short.

The rule itself is in the package docstring (``pager/__init__.py``, "Exceptions"). This module holds
its three tools: the lock's hold count read as a depth (``lock_depth``), giving the lock back to a
depth read before anything was touched (``restore_depth``, right wherever the exception struck), and
the recount of every derived count from the cache itself (``recount``), which the pager runs once
no op holds it.
"""

from __future__ import annotations

import re



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
    copies', the arena's live ranges are the cached copies' slots and every other byte is free.

    A slot or transient copy an interrupted step took and never recorded is simply freed, once
    every copy submitted has run, those whose record the step lost included, and, on a GPU, every
    op queued has run (nothing reads or writes it after that)."""
    lifetimes.wait_for(None)
    ops.drain()
    budget.paged_bytes, slots = cache.recount()
    if pool is not None:
        pool.recount(slots)


class Recovering:
    """The pager's side of the rule (``Pager``'s base): its steps cut short are undone here and its
    counts recounted. Uses the pager's ``lock``, ``_depth`` (``lock_depth(lock)``), cache, budget,
    pool, lifetimes and device operations, and its flag ``_recount_due``."""

    __slots__ = ()

    def cut_short(self, depth: int, taken=None, users=None) -> None:
        """An exception cut a step short: ``taken``'s use goes back to ``users``, the counts are due
        for a recount (now, if no op holds the pager), the lock goes back to ``depth``."""
        if taken is not None:
            taken.users = users
        self._recount_due = True
        if not depth and self._depth():
            self._recount()
        restore_depth(self.lock, self._depth, depth)

    def settle(self) -> None:
        """Recount now what an exception cut short, if a recount is due and no op holds the pager."""
        with self.lock:
            if self._recount_due and self._depth() == 1:
                self._recount()

    def _recount(self) -> None:
        """``recount``, with the lock held and no op holding a copy."""
        recount(self.cache, self.budget, self.pool, self.lifetimes, self.device_ops)
        self._recount_due = False
        self.room.fit_arena()  # an arena re-make that had to wait for the ranges in use (room.py)

    def _room(self, call, *args):
        """A call into ``room.py`` (which takes ``lock``): counts a step of it cut short leaves
        wrong are recounted before the next, as on the per-op path."""
        if self._recount_due:
            self.settle()
        try:
            return call(*args)
        except BaseException:
            self._recount_due = True
            raise
        finally:
            if self.room.refit_due:
                self._recount_due = True  # the arena is re-made by the recount, once no op holds a range
