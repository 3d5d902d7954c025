"""Fork safety: what a forked child renews so that it never waits on a thread it does not have.

``fork()`` copies the calling thread only. A lock another thread held at that moment stays held
in the child forever, a condition's waiters are gone, a worker thread does not exist. As CPython
and torch do for their own, offtensor renews its state in the child (``os.register_at_fork``):

- every live object registered with ``track`` (each ``Pager``, held weakly) gets its
  ``after_fork_in_child()`` called: new locks, and paging state rebuilt where a thread that is
  gone was in the middle of changing it;
- modules with process-wide locks or worker threads register their own renewal with
  ``at_fork_in_child`` (the copy engines' worker and ticket sequence).

``renew_lock`` is the rule for one lock: free in the child unless the forking thread itself holds
it (it will release it). The native copy engine renews its worker thread itself (a
``pthread_atfork`` handler); a copy that was in flight on it at the fork may be half done in the
child, so pagers drop every cached copy not known to be complete.
"""

from __future__ import annotations

import os
import warnings
import weakref

_tracked: "weakref.WeakSet" = weakref.WeakSet()


def track(obj) -> None:
    """Call ``obj.after_fork_in_child()`` in every forked child while ``obj`` lives."""
    _tracked.add(obj)


def at_fork_in_child(callback) -> None:
    """Run ``callback()`` in every forked child (where the OS has fork)."""
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=callback)


def renew_lock(lock) -> bool:
    """In a forked child: make ``lock`` (a ``threading.Lock`` or ``RLock``) free unless the
    forking thread holds it. Returns whether another thread held it at the fork, that is,
    whether what it guards may have been left half changed."""
    owned = getattr(lock, "_is_owned", None)
    if owned is not None and owned():
        return False  # this thread's own hold: it releases it as usual
    if lock.acquire(blocking=False):
        lock.release()
        return False
    lock._at_fork_reinit()  # CPython's own renewal of a lock in a child (threading, logging)
    return True


def _in_child() -> None:
    for obj in list(_tracked):
        try:
            obj.after_fork_in_child()
        except Exception as error:  # a child must not die in a fork handler; say what failed
            warnings.warn(f"offtensor: renewing {type(obj).__name__} after fork failed: {error!r}", RuntimeWarning)


at_fork_in_child(_in_child)
