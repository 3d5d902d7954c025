"""The pager's façade: one budget on one device, and the calls the layers above make.

``page`` (the device tensor for a host view, from the cache, an in-flight prefetch or a new copy),
``upload`` (a host temporary for one op), ``copy_out`` (a device copy the caller owns), ``prefetch``,
``release`` (the op that read these copies is enqueued), ``before_write`` (a master is about to
change), ``clear``, ``new_step`` and ``snapshot``. What each call does is composed from the owners
beside this file: budget, cache and eviction policy, device operations, slots, host lifetimes,
masters, stats and observers.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
import weakref
from operator import attrgetter as _attrgetter
from typing import Optional

import torch

from . import device as _device
from .budget import Budget
from .device import _NOTHING_AFTER
from .cache import LRU, CachedCopy, CacheKey, DeviceCache, covering_range, page_layout
from .lifetimes import HostLifetimes, storage_ptr
from .masters import Master
from .observers import Observers
from .slots import SlotPool
from .stats import OffloadStats

_new_key = tuple.__new__  # cache_key() without its call


class _NoObservers:
    paging = accessed = reading = ()


_NO_OBSERVERS = _NoObservers()  # what the hot path loops over when no observer is set


class Pager:
    """Budget, device cache and copies for one device.

    ``budget_bytes=None`` means "no cache": every op pages what it needs and the copy dies with the
    op. That is what a standalone ``offload()`` tensor uses. With a budget, paged copies stay
    cached (LRU, or the expert cache's order) as long as resident + cached + in-flight bytes fit,
    in slots of one pool.

    One code path for both devices: only ``device_ops`` (``device.py``) tells them apart.
    ``strict`` (default: the ``OFFTENSOR_STRICT`` environment variable) makes the emulated device
    complete copies late and out of order into poisoned buffers, so a missing wait or a premature
    free gives wrong values or an error instead of passing by luck.

    Threads: ``lock`` (an ``RLock``) guards every piece of state here. ``page`` and ``upload``
    take it and each entry they return keeps one hold of it until ``release``, so an op holds the
    pager from its first page, through its compute, to its release: an op of another thread (or an
    eviction, a write to a master, an unwrap) runs between two ops, never inside one. That keeps the
    budget arithmetic single-threaded: the copies in use are always the current op's, so no thread
    fails for want of room another thread's op is holding, and no copy is evicted or poisoned under
    an op reading it. The other public calls take it for their own duration.
    """

    _defaults: dict = {}
    _defaults_lock = threading.Lock()

    def __init__(self, device: torch.device, budget_bytes: Optional[int] = None, strict: Optional[bool] = None):
        self.device = device
        self.budget_bytes = budget_bytes
        self.lock = threading.RLock()
        self.stats = OffloadStats()
        self.budget = Budget(budget_bytes, self.stats)
        self.cache = DeviceCache()
        self._entries = self.cache.entries  # the hot path's lookup, without a method call
        self.device_ops = ops = _device.for_device(device, bool(_device.strict_from_env() if strict is None else strict))
        self.strict = ops.strict
        self.pool = SlotPool(ops) if budget_bytes is not None else None
        self.lifetimes = HostLifetimes(ops)
        self.observers = Observers()
        self._observed = False  # whether any observer is set: the hot path skips every event otherwise
        self._policy = LRU  # the eviction policy: LRU, or the expert cache's order
        self.experts = self.prefetcher = self.recorder = None
        # dispatch's host read of a grouped GEMM's routing offsets, shared by the calls of one MoE
        # layer that pass the same unchanged offsets: (weakref to offs, its version, its values).
        self.routing_read = (None, -1, None)
        # Teardown waits for the last use of every slot and the last copy from every host source
        # before the slots and sources go (the finalizer holds them, not the pager).
        weakref.finalize(self, _teardown, self.cache, self.pool, self.lifetimes, ops)

    # ------------------------------------------------------------------ construction and observers

    @classmethod
    def default(cls, device: torch.device) -> "Pager":
        """The uncached pager that standalone ``offload()`` tensors on ``device`` share."""
        pager = cls._defaults.get(device)
        if pager is None:
            with cls._defaults_lock:  # two threads' first offload() must share one pager
                pager = cls._defaults.get(device)
                if pager is None:
                    pager = cls._defaults[device] = cls(device, None)
        return pager

    def new_master(self, nbytes: int) -> Master:
        return Master(self, nbytes)

    # ``experts`` (``moe.ExpertStacks`` when the model has offloaded stacked experts: per-stack
    # counters, the frequency-aware eviction policy, routing speculation), ``prefetcher``
    # (``prefetch.Prefetcher``, set by wrap_model when ``prefetch=True``) and ``recorder``
    # (``timeline.Recorder`` while ``ot.timeline`` / ``ot.plan`` records) are plain attributes,
    # read on every op; setting one updates the observers (and, for experts, the eviction policy).
    _ROLES = frozenset(("experts", "prefetcher", "recorder"))

    def __setattr__(self, name, value) -> None:
        object.__setattr__(self, name, value)
        if name in Pager._ROLES:
            if name == "experts":
                object.__setattr__(self, "_policy", LRU if value is None else value)
            self.observers.set(name, value)
            object.__setattr__(self, "_observed", any(self.observers.get(r) is not None for r in Pager._ROLES))

    # ------------------------------------------------------------------ accounting

    # The budget's counts, read-only here: the placing layer changes resident bytes through
    # ``pager.budget.recount_resident`` / ``hold_resident``.
    resident_bytes = property(_attrgetter("budget.resident_bytes"))
    paged_bytes = property(_attrgetter("budget.paged_bytes"))
    offloaded_bytes = property(_attrgetter("budget.offloaded_bytes"))

    def free_bytes(self) -> Optional[int]:
        """Bytes an op could page right now, evicting every cached copy no op is using; None
        without a budget. Lets an op that selects many slices (all experts of a prefill) page
        them a chunk at a time instead of failing."""
        if self.budget_bytes is None:
            return None
        with self.lock:  # waits for another thread's op: its copies in use are not this op's
            budget = self.budget
            return self.budget_bytes - budget.resident_bytes - (budget.paged_bytes - self.cache.evictable_bytes())

    def hold_resident(self, nbytes: int) -> None:
        """Resident weights grew to ``nbytes`` (a weight kept or moved onto the device): cached copies
        no op uses are evicted first, so that resident + paged stays within the budget and the peak
        never counts new resident bytes beside old copies that room was needed for."""
        with self.lock:
            self.room_for_resident(nbytes)
            self.budget.hold_resident(nbytes)

    def recount_resident(self, nbytes: int) -> None:
        """Resident weights hold ``nbytes`` now (a recount after placing, loading, unwrapping or
        deleting weights); when they grew, cached copies make room first, as for ``hold_resident``."""
        with self.lock:
            self.room_for_resident(nbytes)
            self.budget.recount_resident(nbytes)

    def room_for_resident(self, nbytes: int) -> None:
        """Evict cached copies no op uses until ``nbytes`` of resident weights fit beside the copies
        left: called before a weight is moved onto the device, so its bytes are never allocated while
        the copies they displace still hold the budget."""
        if self.budget_bytes is None:
            return
        with self.lock:
            grow = nbytes - self.budget.resident_bytes
            if grow > 0:
                self._make_room(grow, strict=False)

    def count_write_back(self, nbytes: int) -> None:
        """``nbytes`` of device values were written back to a host master (an in-place op's result)."""
        self.stats.bytes_d2h += nbytes

    def snapshot(self) -> OffloadStats:
        with self.lock:
            return self._snapshot()

    def _snapshot(self) -> OffloadStats:
        s = dataclasses.replace(self.stats)
        budget = self.budget
        s.resident_bytes = budget.resident_bytes
        s.offloaded_bytes = budget.offloaded_bytes
        s.cached_bytes = budget.paged_bytes
        s.budget_bytes = self.budget_bytes
        if self.pool is not None:
            s.pool_bytes = self.pool.live_bytes + self.pool.idle_bytes
            s.peak_pool_bytes = self.pool.peak_bytes
        figures = self.device_ops.memory_figures()
        if figures is not None:  # the real figures beside the logical ones
            s.max_memory_allocated, s.max_memory_reserved = figures
        if self.experts is not None:
            s.experts = self.experts.report()
            if self.experts.speculator is not None:
                s.guesses = self.experts.speculator.report()
        return s

    def reset_stats(self) -> None:
        with self.lock:
            self._reset_stats()

    def _reset_stats(self) -> None:
        self.stats = self.budget.stats = OffloadStats()
        if self.experts is not None:
            self.experts.reset()
        if self.pool is not None:
            self.pool.peak_bytes = self.pool.live_bytes + self.pool.idle_bytes
        self.budget.note_peak()

    # ------------------------------------------------------------------ paging

    def page(self, host: torch.Tensor, master: Master, what="tensor", private: bool = False, layout=None):
        """Device tensor with ``host``'s values, shape and strides, and the entry backing it.

        The copy comes from the cache, an in-flight prefetch, or a new host->device copy. With
        ``private=True`` (the op will write to it) the copy bypasses the cache. The caller must
        ``release`` the entry once its op is enqueued; until then the entry cannot be evicted.
        ``what`` describes the tensor in a ``BudgetError``: a string, or any object whose repr does
        (formatted only for the error). ``layout`` is ``page_layout(host, master.id)`` if the caller
        has it already (it memoizes it per tensor).

        Takes ``lock``, and the entry returned keeps that hold until its ``release`` (see the class
        docstring); an empty tensor's None entry holds nothing. One function, not a locking wrapper
        around a body: every compute op on an offloaded weight runs it.
        """
        if host.numel() == 0:
            return torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=self.device), None
        self.lock.acquire()
        try:
            lo, hi, shape, stride, offset, key = layout or page_layout(host, master.id)
            observers = self.observers if self._observed else _NO_OBSERVERS
            if private or self.budget_bytes is None:
                entry = self._transient(host.as_strided((hi - lo,), (1,), lo), (hi - lo) * host.element_size(), what)
                base = lo
            else:
                for notify in observers.paging:  # before the lookup: eviction for this copy knows the layer
                    notify(master.id)
                entry = self._entries.get(key) or self.cache.find_containing(master.id, host.dtype, lo, hi)
                hit = entry is not None
                if hit:
                    self._entries.move_to_end(entry.key)
                    self.stats.hits += 1
                    if entry.prefetched:
                        entry.prefetched = False
                        self.stats.prefetch_hits += 1
                else:
                    src = host.as_strided((hi - lo,), (1,), lo)
                    entry = self._insert(key, src, (hi - lo) * host.element_size(), what)
                base = entry.key[2]
                # Held before the observers run: a prefetch makes room by evicting unused entries, and
                # this one must survive until its op is enqueued (on a GPU its block would be reused).
                entry.users += 1
                for notify in observers.accessed:
                    notify(self, master, key, entry, hit)
                for notify in observers.reading:  # timeline: the op about to run reads this copy
                    notify(entry)
                if entry.ready is not None:  # a cache hit on a completed copy skips the call
                    self.device_ops.wait_ready(entry, self.lifetimes)
                return entry.buf.as_strided(shape, stride, offset - base), entry
            for notify in observers.reading:
                notify(entry)
            if entry.ready is not None:
                self.device_ops.wait_ready(entry, self.lifetimes)
            entry.users += 1
            return entry.buf.as_strided(shape, stride, offset - base), entry
        except BaseException:
            self.lock.release()
            raise

    def upload(self, src: torch.Tensor, what="tensor"):
        """Copy a host tensor (e.g. gathered rows) to the device for one op; accounted like a page.
        ``src`` is kept alive until the copy has completed, so the caller may drop it at once.
        Takes ``lock``, held until the entry's ``release``, as ``page`` does (in its own body too:
        every embedding lookup of an offloaded table runs it)."""
        self.lock.acquire()
        try:
            src = src.contiguous()
            entry = self._transient(src.view(-1), src.numel() * src.element_size(), what)
            for notify in self.observers.reading:
                notify(entry)
            if entry.ready is not None:
                self.device_ops.wait_ready(entry, self.lifetimes)
            entry.users += 1
            return entry.buf.view(src.shape), entry
        except BaseException:
            self.lock.release()
            raise

    def copy_out(self, host: torch.Tensor) -> torch.Tensor:
        """A device copy owned by the caller (``materialize``, ``unwrap_model``): never cached,
        outside the budget. The host bytes stay alive until the copy has completed, even if the
        caller drops the master right after (unwrap swaps the copy in at once)."""
        if host.numel() == 0:
            return torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=self.device)
        lo, hi = covering_range(host)
        src = host.as_strided((hi - lo,), (1,), lo)
        buf = torch.empty(hi - lo, dtype=host.dtype, device=self.device)
        with self.lock:
            self.device_ops.copy_out(buf, src, self.lifetimes)
            self.stats.page_ins += 1
            self.stats.bytes_h2d += (hi - lo) * host.element_size()
        return buf.as_strided(host.shape, host.stride(), host.storage_offset() - lo)

    def copy_into_graph(self, out: torch.Tensor, host: torch.Tensor) -> None:
        """Under CUDA graph capture: record a copy of ``host`` straight into ``out``, graph memory
        (a replay runs no Python, so the cache cannot be consulted); counted like a page."""
        self.device_ops.check_capturable(host)
        out.copy_(host, non_blocking=True)
        lo, hi = covering_range(host)
        with self.lock:
            self.stats.bytes_h2d += (hi - lo) * host.element_size()

    def capturing(self) -> bool:
        """Whether the op is being recorded into a CUDA graph on this pager's device."""
        return self.device_ops.capturing()

    def new_step(self) -> None:
        """A forward of the wrapped model begins: one pass of the prefetch schedule and of the
        expert statistics ends."""
        with self.lock:
            for notify in self.observers.new_step:
                notify()

    def is_cached(self, key) -> bool:
        return key in self._entries

    def prefetch(self, master: Master, dtype: torch.dtype, lo: int, hi: int) -> bool:
        """Start copying elements [lo, hi) of ``master`` unless cached; never evicts an entry that
        is in use and never exceeds the budget. Returns whether a copy is cached or started."""
        with self.lock:
            return self._prefetch(master, dtype, lo, hi)

    def _prefetch(self, master: Master, dtype: torch.dtype, lo: int, hi: int) -> bool:
        key = _new_key(CacheKey, (master.id, dtype, lo, hi))
        if key in self._entries:
            return True
        if self.budget_bytes is None or master.flat is None:
            return False
        itemsize = dtype.itemsize
        nbytes = (hi - lo) * itemsize
        if not self._make_room(nbytes, strict=False, keep_prefetched=True):
            return False
        src = master.flat[lo * itemsize : hi * itemsize].view(dtype)
        entry = self._insert(key, src, nbytes, "a prefetch", prefetch=True, room_made=True)
        entry.prefetched = True
        self.stats.prefetches += 1
        return True

    def release(self, entries) -> None:
        """The op that used ``entries`` has been enqueued: mark when the device is done with them
        (on a GPU, an event after the op when a cached copy was used: ``CudaDevice.last_use``),
        then give back the holds of ``lock`` that ``page`` and ``upload`` took, one per entry: the
        op is over, another thread's may run."""
        try:
            ops = self.device_ops
            stream, last_use = ops.after_op(entries) if ops.tracks_last_use else _NOTHING_AFTER
            if self._observed:
                for notify in self.observers.released:  # timeline: the op just enqueued is their last reader
                    notify(entries)
            budget = self.budget
            for entry in entries:
                entry.users -= 1
                if entry.key is None:  # transient, or dropped from the cache while this op used it
                    budget.paged_bytes -= entry.nbytes
                    if entry.slot is not None:
                        self.pool.give(entry.slot, ops.transient_free_after(entry), budget.room(), stream)
                        entry.slot = None
                elif last_use is not None:
                    entry.last_use = last_use
        finally:
            release = self.lock.release
            for _ in entries:
                release()

    def before_write(self, master: Master) -> None:
        """The host master is about to change: wait until no copy still reads it (its own copies
        only, not the whole device), and drop its cached copies, which would be stale. A caller
        that then writes holds ``lock`` across this call and its write, so no op pages in between."""
        with self.lock:
            self.lifetimes.wait_for(storage_ptr(master.flat))
            self.forget_master(master.id)

    def forget_master(self, master_id: int) -> None:
        """Drop every cached copy of ``master_id`` (it died, moved to another pager, or changes)."""
        with self.lock:
            for entry in self.cache.of_master(master_id):
                self._remove(entry)

    def clear(self) -> None:
        """Drop every cached copy (e.g. before unwrapping) and the pool's idle slots."""
        with self.lock:
            for master_id in self.cache.masters():
                self.forget_master(master_id)
            if self.pool is not None:
                self.pool.clear()

    def wait_copies(self) -> None:
        """Block until every copy this pager started has completed (and release their sources)."""
        with self.lock:
            self.lifetimes.wait_for(None)

    # ------------------------------------------------------------------ internals

    def _insert(self, key: CacheKey, src: torch.Tensor, nbytes: int, what, prefetch: bool = False,
                room_made: bool = False) -> CachedCopy:
        """A new cached copy of ``src`` (``key``'s bytes), issued ahead of use on the copy stream."""
        if not room_made:
            self._make_room(nbytes, strict=True, what=what)
        ops = self.device_ops
        slot = self.pool.take(nbytes, self.budget.room(), ops.copy_stream)
        buf = slot.buf.view(src.dtype)
        ready = ops.copy_ahead(buf, src)
        self.lifetimes.keep(src, ready)
        entry = CachedCopy(key, slot, buf, nbytes, ready)
        self.cache.add(entry)
        for notify in self.observers.copied:  # timeline: a copy on the copy stream
            notify(self, entry, nbytes, "copy", prefetch)
        self.budget.add_paged(nbytes)
        self.stats.page_ins += 1
        self.stats.bytes_h2d += nbytes
        return entry

    def _transient(self, src: torch.Tensor, nbytes: int, what) -> CachedCopy:
        """A copy for one op outside the cache, in line on the op's stream. This is the whole
        paging path of a pager without a budget, so the budget calls are inlined."""
        budget = self.budget
        if budget.budget_bytes is not None:
            self._make_room(nbytes, strict=True, what=what)
        ops = self.device_ops
        if self.pool is not None:
            slot = self.pool.take(nbytes, self.budget.room(), ops.op_stream())
            buf = slot.buf.view(src.dtype)
        else:
            # No budget, no pool: on a GPU the block is allocated on the compute stream, so the
            # allocator reuses it only after the op that reads it.
            slot, buf = None, torch.empty(src.numel(), dtype=src.dtype, device=self.device)
        ready = ops.copy_in_line(buf, src, nbytes, self.lifetimes)
        stats = self.stats
        budget.paged_bytes = used = budget.paged_bytes + nbytes  # budget.add_paged, inlined
        used += budget.resident_bytes
        if used > stats.peak_device_bytes:
            stats.peak_device_bytes = used
        stats.page_ins += 1
        stats.bytes_h2d += nbytes
        entry = CachedCopy(None, slot, buf, nbytes, ready)
        for notify in self.observers.copied:  # timeline: a copy in line, on the compute stream
            notify(self, entry, nbytes, "compute", False)
        return entry

    def _make_room(self, nbytes: int, strict: bool, what="tensor", keep_prefetched: bool = False) -> bool:
        """Evict unused copies until ``nbytes`` more fit the budget. A prefetch passes
        ``keep_prefetched``: evicting an earlier prefetch that is still to be used would throw away
        a copy to make room for one needed later."""
        budget = self.budget
        if budget.fits(nbytes):
            return True
        cache, policy = self.cache, self._policy
        while True:
            # The few entries the current op holds are skipped. The policy picks among the rest:
            # least recently used first, routed experts by layer order and use frequency.
            victim = policy.victim(cache.view, budget.room(), cache.evictable(keep_prefetched))
            if victim is None:
                break
            self._evict(victim)
            if budget.fits(nbytes):
                return True
        if not strict:
            return False
        in_use = budget.paged_bytes - cache.evictable_bytes()
        raise budget.shortfall_error(what if isinstance(what, str) else repr(what), nbytes, in_use, self.device)

    def _evict(self, entry: CachedCopy) -> None:
        for notify in self.observers.evicted:
            notify(entry)
        self._remove(entry)
        self.stats.evictions += 1

    def _remove(self, entry: CachedCopy) -> None:
        """Drop a cached copy without waiting: its slot goes back to the pool, to be reused only
        after the last op that read it (or, if none did, its copy) has completed. Its host source
        stays with the lifetime records until the copy has completed."""
        for notify in self.observers.freed:  # timeline: the next copy reuses this block after its last reader
            notify(entry)
        self.cache.remove(entry)
        if entry.users:
            # An op of this thread still reads it (a write to, or the death of, a master the op
            # also reads): it leaves the cache now; its bytes and slot go when the op releases it,
            # as a transient copy's do. Giving the slot back now would poison it under the op.
            entry.key = None
            return
        self.budget.paged_bytes -= entry.nbytes
        if entry.slot is not None:
            self.pool.give(entry.slot, entry.last_use or entry.ready, self.budget.room())
            entry.slot = None


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
