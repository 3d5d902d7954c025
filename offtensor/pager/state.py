"""What a pager pages with, built new: its cache, slot pool and host lifetimes and the
collaborators over them (``new_paging_state``), the same state renewed in a forked child
(``after_fork_in_child``, called by ``offtensor.forking``), and the teardown a dead pager's
finalizer runs; and copies into a CUDA graph, and waits on copies. A base of ``Pager``, so the
façade keeps to the calls the layers above make."""

from __future__ import annotations

import warnings
import weakref

import torch

from .. import forking
from .cache import LRU, DeviceCache
from .copies import Copies
from .lifetimes import HostLifetimes
from .room import Room
from .slots import SlotPool


class PagingState:
    """``Pager``'s paging state; reads the pager's device, budget, lock, observers and device ops."""

    def new_paging_state(self) -> None:
        """An empty cache, slot pool and host lifetimes, and the collaborators over them."""
        ops, device = self.device_ops, self.device
        self.cache = DeviceCache()
        self._entries = self.cache.entries  # the hot path's lookup, without a method call
        self.pool = SlotPool(ops, self.budget) if self.budget_bytes is not None else None
        self.lifetimes = HostLifetimes(ops)
        # Collaborators over the same owners: making room (eviction, by LRU or the expert cache's
        # order) and dropping copies; issuing copies.
        policy = LRU if getattr(self, "experts", None) is None else self.experts
        self.room = Room(self.lock, device, self.budget, self.cache, self.pool, self.lifetimes, self.observers, policy)
        self._overflowed = self.room.overflowed  # release's test, without the attribute lookups
        self.copies = Copies(device, self.budget, self.cache, self.pool, self.lifetimes, self.observers, ops, self.room)
        # dispatch's host read of a grouped GEMM's routing offsets, shared by the calls of one MoE
        # layer that pass the same unchanged offsets: (weakref to offs, its version, what dispatch
        # made of it: the routed groups and their sizes).
        self.routing_read = (None, -1, None)
        # Teardown waits for the last use of every slot and the last copy from every host source
        # before the slots and sources go (the finalizer holds them, not the pager).
        self._teardown = weakref.finalize(self, _teardown, self.cache, self.pool, self.lifetimes, ops)

    def after_fork_in_child(self) -> None:
        """In a forked child (``offtensor.forking``): the lock is free and no copy that may have
        been in flight at the fork is used (its bytes may be half copied). If another thread held
        the lock (an op between its page and its release, which the child never finishes), the
        cache, slots and host lifetimes start empty, as a new pager's. A CUDA pager only gets its
        lock: CUDA cannot be used in a forked child, and torch says so on first use."""
        if self.lock._is_owned():
            return  # the forking thread's own op or call: it goes on as usual
        held_elsewhere = forking.renew_lock(self.lock)
        if self.device.type == "cuda":
            return
        if held_elsewhere:
            self._teardown.detach()  # the old state's copies and uses are the parent's
            self.new_paging_state()
            self.budget.paged_bytes = 0
        else:
            for entry in [e for e in self.cache.entries.values() if e.ready is not None]:
                self.room.remove(entry)

    # Copies into a CUDA graph, and waits on the copies.

    def copy_into_graph(self, out: torch.Tensor, host: torch.Tensor) -> None:
        """Under CUDA graph capture: record a copy of ``host`` straight into ``out``, counted like a page."""
        self.copies.copy_into_graph(out, host, self.lock)

    def capturing(self) -> bool:
        """Whether the op is being recorded into a CUDA graph on this pager's device."""
        return self.device_ops.capturing()

    def wait_copies(self) -> None:
        """Block until every copy this pager started has completed (and release their sources)."""
        with self.lock:
            self.lifetimes.wait_for(None)


def _teardown(cache: DeviceCache, pool, lifetimes: HostLifetimes, ops) -> None:
    """A pager died: wait for the last use of each cached copy and slot and for each copy still
    reading a host source, then let them go. Runs from a finalizer, so it must not raise."""
    try:
        for entry in cache.entries.values():
            ops.settle(entry.ready)
            ops.settle(entry.last_use)
        if pool is not None:
            for token in pool.tokens():
                ops.settle(token)
        lifetimes.wait_for(None)
    except Exception as error:  # e.g. at interpreter exit, after CUDA has shut down
        warnings.warn(f"offtensor: a pager's teardown could not wait for its copies: {error}", RuntimeWarning)
