"""Issuing the pager's host->device copies: a cached copy ahead of use on the copy stream, a
transient copy in line for one op, and a copy the caller owns.

Each copy is counted (``stats``, the budget's paged bytes and peak) and told to the observers; its
host source is kept alive until the copy has completed. Room for a cached or transient copy is made
first, through ``room.py``. ``insert`` and ``transient`` run with the pager's ``lock`` held (the
pager's hot path calls them); the copies the caller owns take it for their copy.
"""

from __future__ import annotations

import torch

from .cache import CachedCopy, CacheKey, covering_range
from .slots import lead_bytes, placed


class Copies:
    """The copies of one pager, issued through its device operations into its slots."""

    def __init__(self, device, budget, cache, pool, lifetimes, observers, ops, room):
        self.device, self.budget, self.cache, self.pool = device, budget, cache, pool
        self.lifetimes, self.observers, self.device_ops, self.room = lifetimes, observers, ops, room

    def insert(self, pager, key: CacheKey, src: torch.Tensor, nbytes: int, what, prefetch: bool = False,
               room_made: bool = False) -> CachedCopy:
        """A new cached copy of ``src`` (``key``'s bytes), issued ahead of use on the copy stream;
        ``pager`` (the façade) is what the observers are told of."""
        lead = lead_bytes(key[2], src.element_size())
        if not room_made:
            self.room.make_room(nbytes, strict=True, what=what, span=nbytes + lead)
        ops = self.device_ops
        slot = self.pool.take(nbytes + lead, ops.copy_stream)
        buf = placed(slot, src.dtype, lead, src.numel()) if lead else slot.typed(src.dtype)
        ready = ops.copy_ahead(buf, src)
        self.lifetimes.keep(src, ready)
        entry = slot.owner = CachedCopy(key, slot, buf, nbytes, ready)
        self.cache.add(entry)
        if slot.start is None:  # an overflow slot: dropped once its op is done (Room.drop_overflowed)
            self.room.overflowed.append(entry)
        for notify in self.observers.copied:  # timeline: a copy on the copy stream
            notify(pager, entry, nbytes, "copy", prefetch)
        self.budget.add_paged(nbytes)
        stats = self.budget.stats
        stats.page_ins += 1
        stats.bytes_h2d += nbytes
        return entry

    def transient(self, pager, src: torch.Tensor, nbytes: int, what, lead: int = 0) -> CachedCopy:
        """A copy for one op outside the cache, in line on the op's stream, starting ``lead`` bytes
        into a ``LINE`` (``lead_bytes``). This is the whole paging path of a pager without a budget,
        so the budget calls are inlined."""
        budget = self.budget
        if budget.budget_bytes is not None:
            self.room.make_room(nbytes, strict=True, what=what, span=nbytes + lead)
        ops = self.device_ops
        if self.pool is not None:
            slot = self.pool.take(nbytes + lead, ops.op_stream())
            buf = placed(slot, src.dtype, lead, src.numel()) if lead else slot.typed(src.dtype)
        elif not lead:
            # No budget, no pool: on a GPU the block is allocated on the compute stream, so the
            # allocator reuses it only after the op that reads it.
            slot, buf = None, torch.empty(src.numel(), dtype=src.dtype, device=self.device)
        else:
            first = lead // src.element_size()
            slot, buf = None, torch.empty(first + src.numel(), dtype=src.dtype, device=self.device)[first:]
        ready = ops.copy_in_line(buf, src, nbytes, self.lifetimes)
        stats = budget.stats
        budget.paged_bytes = used = budget.paged_bytes + nbytes  # budget.add_paged, inlined
        used += budget.resident_bytes
        if used > stats.peak_device_bytes:
            stats.peak_device_bytes = used
        stats.page_ins += 1
        stats.bytes_h2d += nbytes
        entry = CachedCopy(None, slot, buf, nbytes, ready)
        for notify in self.observers.copied:  # timeline: a copy in line, on the compute stream
            notify(pager, entry, nbytes, "compute", False)
        return entry

    def copy_out(self, host: torch.Tensor, lock) -> torch.Tensor:
        """A device copy owned by the caller (``materialize``, ``unwrap_model``) of a non-empty
        ``host``: never cached, outside the budget. The host bytes stay alive until the copy has
        completed, even if the caller drops the master right after (unwrap swaps the copy in at
        once). Only the copy and its counts take ``lock``."""
        lo, hi = covering_range(host)
        src = host.as_strided((hi - lo,), (1,), lo)
        buf = torch.empty(hi - lo, dtype=host.dtype, device=self.device)
        with lock:
            self.device_ops.copy_out(buf, src, self.lifetimes)
            stats = self.budget.stats
            stats.page_ins += 1
            stats.bytes_h2d += (hi - lo) * host.element_size()
        return buf.as_strided(host.shape, host.stride(), host.storage_offset() - lo)

    def copy_into_graph(self, out: torch.Tensor, host: torch.Tensor, lock) -> None:
        """Under CUDA graph capture: record a copy of ``host`` straight into ``out``, graph memory
        (a replay runs no Python, so the cache cannot be consulted); counted like a page."""
        self.device_ops.check_capturable(host)
        out.copy_(host, non_blocking=True)
        lo, hi = covering_range(host)
        with lock:
            self.budget.stats.bytes_h2d += (hi - lo) * host.element_size()
