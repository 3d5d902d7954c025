"""Which copies are on the device: the cache of paged byte ranges and the choice of what to evict.

A cached copy is the element range [lo, hi) of one host master, read as ``dtype``: its
``CacheKey``. The prefetcher, the expert cache and the timeline name copies by that one type.

Eviction is a policy: ``victim(cache, room, candidates)`` gets a read-only ``CacheView`` and the
evictable copies in least-recently-used order, and returns the copy to drop (or None);
``order(cache, candidates)`` ranks them all, the first to drop first (a policy without one is
ranked least recently used first). The default
is LRU (``LeastRecentlyUsed``); a model with offloaded routed experts gets
``moe.ExpertStacks``, which orders experts by their expected next use.
"""

from __future__ import annotations

import collections
import types
from typing import Iterator, NamedTuple, Optional

import torch


class CacheKey(NamedTuple):
    """Elements [lo, hi) of the master ``master_id`` read as ``dtype``."""

    master_id: int
    dtype: torch.dtype
    lo: int
    hi: int

    @property
    def nbytes(self) -> int:
        return (self.hi - self.lo) * self.dtype.itemsize


# CacheKey(...) without NamedTuple's Python-level __new__: the cached page builds one per op.
_new_key = tuple.__new__


def cache_key(master_id: int, dtype: torch.dtype, lo: int, hi: int) -> CacheKey:
    return _new_key(CacheKey, (master_id, dtype, lo, hi))


def host_layout(host: torch.Tensor):
    """(lo, hi, shape, stride, offset) of a host view: the element range [lo, hi) of its storage
    that it covers (what a cached copy of it holds), and its layout inside that storage."""
    lo = offset = host.storage_offset()
    shape, stride = host.shape, host.stride()
    hi = lo + 1
    for size, step in zip(shape, stride):
        hi += (size - 1) * step
    return lo, hi, shape, stride, offset


def page_layout(host: torch.Tensor, master_id: int):
    """``host_layout(host)`` and the ``CacheKey`` of the range it covers: what ``Pager.page`` needs,
    which the dispatch layer memoizes per OffloadedTensor (its master and metadata are fixed until
    an in-place view or ``.data =`` drops the memo)."""
    # host_layout, inlined: dispatch calls this once per fresh view (``w.t()`` in every forward).
    lo = offset = host.storage_offset()
    shape, stride = host.shape, host.stride()
    hi = lo + 1
    for size, step in zip(shape, stride):
        hi += (size - 1) * step
    return lo, hi, shape, stride, offset, _new_key(CacheKey, (master_id, host.dtype, lo, hi))


def covering_range(host: torch.Tensor):
    """Elements [lo, hi) of the master storage that a (possibly strided) view touches."""
    return host_layout(host)[:2]


class CachedCopy:
    """One paged copy on the device: ``buf`` holds the bytes of ``key`` (None for a transient copy,
    which lives for one op outside the cache). Policies and observers read ``key``, ``nbytes``,
    ``users`` and ``prefetched``; only the pager writes them."""

    __slots__ = ("key", "slot", "buf", "nbytes", "ready", "last_use", "users", "prefetched", "view")

    def __init__(self, key: Optional[CacheKey], slot, buf, nbytes: int, ready):
        self.key = key
        self.slot = slot  # the pool slot holding buf; None for a copy outside the pool
        self.buf = buf
        self.nbytes = nbytes
        self.ready = ready  # completion token of the copy into buf; None once known complete
        self.last_use = None  # GPU: the mark of the last op that read buf (marks.py; one per stream if several)
        self.users = 0  # ops currently holding this copy; never evicted while > 0
        self.prefetched = False  # copied ahead of its use and not used yet
        # (layout, device view of buf) of the last cache hit that passed a memoized layout: the
        # pager hands the same view to the next op reading buf with that layout (saves the view's
        # construction and teardown, ~2 us of a hit). Ops read their paged arguments, never
        # change them: a write pages a private copy.
        self.view = None

    def view_of(self, layout, shape, stride, offset: int) -> torch.Tensor:
        """The device view of ``buf`` for a cache hit: the one handed out last time when ``layout``
        is the same memoized layout tuple (identity), else a new one, kept when ``layout`` is given."""
        memo = self.view
        if memo is not None and memo[0] is layout:  # never (None, view): see below
            return memo[1]
        buf = self.buf  # a range of the arena: as_strided's offset counts from the arena's start
        view = buf.as_strided(shape, stride, buf.storage_offset() + offset)
        self.view = (layout, view) if layout is not None else None
        return view


class DeviceCache:
    """The cached copies, least recently used first, and the same copies by master."""

    __slots__ = ("entries", "by_master", "view")

    def __init__(self):
        self.entries: "collections.OrderedDict[CacheKey, CachedCopy]" = collections.OrderedDict()
        self.by_master: dict[int, list[CachedCopy]] = {}
        self.view = CacheView(self)

    def __contains__(self, key) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key) -> Optional[CachedCopy]:
        return self.entries.get(key)

    def find_containing(self, master_id: int, dtype: torch.dtype, lo: int, hi: int) -> Optional[CachedCopy]:
        """A cached copy of ``master_id`` in ``dtype`` whose range covers [lo, hi)."""
        for entry in self.by_master.get(master_id, ()):
            _, edtype, elo, ehi = entry.key
            if edtype == dtype and elo <= lo and hi <= ehi:
                return entry
        return None

    def touch(self, entry: CachedCopy) -> None:
        self.entries.move_to_end(entry.key)

    def add(self, entry: CachedCopy) -> None:
        self.entries[entry.key] = entry
        self.by_master.setdefault(entry.key[0], []).append(entry)

    def remove(self, entry: CachedCopy) -> None:
        del self.entries[entry.key]
        siblings = self.by_master[entry.key[0]]
        siblings.remove(entry)
        if not siblings:
            del self.by_master[entry.key[0]]

    def of_master(self, master_id: int) -> list:
        return list(self.by_master.get(master_id, ()))

    def masters(self) -> list:
        return list(self.by_master)

    def evictable(self, keep_prefetched: bool) -> Iterator[CachedCopy]:
        """Copies no op holds, least recently used first (``keep_prefetched``: not those copied
        ahead and still to be used)."""
        return (e for e in self.entries.values() if not e.users and not (keep_prefetched and e.prefetched))

    def evictable_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values() if not e.users)

    def recount(self):
        """No op holds a copy (``pager/safety.py``): every copy's ``users`` back to 0 and the copies by
        master rebuilt from ``entries`` (in place: the ``CacheView`` shows them). Returns the cached
        bytes and the slots the cached copies hold."""
        by_master, nbytes, slots = {}, 0, []
        for key, entry in self.entries.items():
            entry.users = 0
            by_master.setdefault(key[0], []).append(entry)
            nbytes += entry.nbytes
            if entry.slot is not None:
                slots.append(entry.slot)
        self.by_master.clear()
        self.by_master.update(by_master)
        return nbytes, slots


class CacheView:
    """What an eviction policy sees of the cache: read-only mappings of the cached copies by key
    (``copies``, least recently used first) and by master (``by_master``: master id -> its copies)."""

    __slots__ = ("copies", "by_master")

    def __init__(self, cache: DeviceCache):
        self.copies = types.MappingProxyType(cache.entries)
        self.by_master = types.MappingProxyType(cache.by_master)


class LeastRecentlyUsed:
    """The default eviction policy: the least recently used copy that no op holds."""

    @staticmethod
    def victim(cache: CacheView, room: int, candidates: Iterator[CachedCopy]) -> Optional[CachedCopy]:
        return next(candidates, None)

    @staticmethod
    def order(cache: CacheView, candidates: Iterator[CachedCopy]) -> list:
        """Every candidate, the first to evict first (a policy's ranking of them all: which copies to
        evict when a copy needs one free range of the arena, ``Room.open_range``)."""
        return list(candidates)


LRU = LeastRecentlyUsed()
