"""The pager's façade: one budget on one device, and the calls the layers above make.

``page`` (the device tensor for a host view, from the cache, an in-flight prefetch or a new copy),
``upload`` (a host temporary for one op), ``copy_out`` (a device copy the caller owns), ``prefetch``,
``release`` (the op that read these copies is enqueued), ``before_write`` (a master is about to
change), ``clear``, ``new_step`` and ``snapshot``. What each call does is composed from the owners
beside this file: budget, cache and eviction policy, device operations, slots, host lifetimes,
masters, stats and observers (state.py builds them), through two collaborators: ``room.py`` (eviction, resident room,
dropping copies) and ``copies.py`` (issuing copies). The per-op path (``page``, ``upload``,
``release``) stays here, one call per op.
"""

from __future__ import annotations

import threading
from operator import attrgetter as _attrgetter
from typing import Optional

import torch

from .. import forking
from . import device as _device
from .budget import Budget
from .device import _NOTHING_AFTER
from .cache import LRU, CacheKey, page_layout
from .masters import Master
from .observers import Observers, _quietly
from .room import RoomCalls
from .safety import Recovering, lock_depth
from .slots import LINE, lead_bytes
from .state import PagingState
from .stats import OffloadStats, snapshot

_new_key = tuple.__new__  # cache_key() without its call
_LINE_REST = LINE - 1


class _NoObservers:
    paging = accessed = reading = ()
    quiet = None


_NO_OBSERVERS = _NoObservers()  # what the hot path loops over when no observer is set


class Pager(RoomCalls, Recovering, PagingState):
    """Budget, device cache and copies for one device.

    ``budget_bytes=None`` means "no cache": every op pages what it needs and the copy dies with the
    op. That is what a standalone ``offload()`` tensor uses. With a budget, paged copies stay
    cached (LRU, or the expert cache's order) as long as resident + cached + in-flight bytes fit,
    in ranges of one device arena (``arena.py``, ``slots.py``).

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
        self.lock = threading.RLock()
        self._depth = lock_depth(self.lock)  # the calling thread's holds of it
        self._recount_due = False  # an exception cut a step short: counts to recount once no op holds the pager
        self.stats = OffloadStats()
        self.budget = Budget(budget_bytes, self.stats)
        self.device_ops = ops = _device.for_device(device, bool(_device.strict_from_env() if strict is None else strict))
        self.strict = ops.strict
        self.observers = Observers()
        self._observed = False  # whether any observer is set: the hot path skips every event otherwise
        self.new_paging_state()
        self.experts = self.prefetcher = self.recorder = None
        self.expert_pool = None  # moe.pool.ExpertPools of a model wrapped with expert_pool=True
        forking.track(self)  # a forked child renews the lock and the paging state (after_fork_in_child)

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
                self.room.policy = LRU if value is None else value
            self.observers.set(name, value)
            object.__setattr__(self, "_observed", any(self.observers.get(r) is not None for r in Pager._ROLES))

    # ------------------------------------------------------------------ accounting

    # The budget's counts, read-only here: the placing layer changes resident bytes through
    # ``pager.budget.recount_resident`` / ``hold_resident``.
    resident_bytes = property(_attrgetter("budget.resident_bytes"))
    # The budget's one figure (``Budget.budget_bytes``; ``hold_outside`` changes it).
    budget_bytes = property(_attrgetter("budget.budget_bytes"),
                            lambda self, nbytes: setattr(self.budget, "budget_bytes", nbytes))
    paged_bytes = property(_attrgetter("budget.paged_bytes"))
    offloaded_bytes = property(_attrgetter("budget.offloaded_bytes"))

    def count_write_back(self, nbytes: int) -> None:
        """``nbytes`` of device values were written back to a host master (an in-place op's result)."""
        self.stats.bytes_d2h += nbytes

    def count_host_compute(self, activation_bytes: int) -> None:
        """One routed expert was computed on the host, moving ``activation_bytes`` to it and back."""
        self.stats.host_experts += 1
        self.stats.host_activation_bytes += activation_bytes

    def snapshot(self) -> OffloadStats:
        """A copy of the counters, with the budget's, the pool's and the device's figures now (and
        an expert pool's counters: read from the device, which on a GPU waits for it)."""
        self.settle()
        with self.lock:
            return snapshot(self.stats, self.budget, self.pool, self.device_ops.memory_figures(),
                            self.experts, self.expert_pool)

    def reset_stats(self) -> None:
        """New counters; the peaks start again from what is held now."""
        with self.lock:
            self.stats = self.budget.stats = OffloadStats()
            if self.experts is not None:
                self.experts.reset()
            if self.expert_pool is not None:
                self.expert_pool.reset_counts()  # a device op: no wait
            if self.pool is not None:
                self.pool.reset_peak()
            self.budget.note_peak()

    # ------------------------------------------------------------------ paging

    def page(self, host: torch.Tensor, master: Master, what="tensor", private: bool = False, layout=None, held=None):
        """Device tensor with ``host``'s values, shape and strides, and the entry backing it.

        The copy comes from the cache, an in-flight prefetch, or a new host->device copy. With
        ``private=True`` (the op will write to it) the copy bypasses the cache. The last step appends
        ``(pager, entry, depth)`` to ``held``, the op's record; the op gives the entry back with
        ``release``, until then it cannot be evicted. ``what`` describes the tensor in a ``BudgetError``: a string, or any object whose repr does
        (formatted only for the error). ``layout`` is ``page_layout(host, master.id)`` if the caller
        has it already (it memoizes it per tensor).

        Takes ``lock``, and the entry returned keeps that hold until its ``release`` (see the class
        docstring); an empty tensor's None entry holds nothing. One function, not a locking wrapper
        around a body: every compute op on an offloaded weight runs it. Exceptions: the package's rule."""
        if host.numel() == 0:
            return torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=self.device), None
        depth = self._depth()
        item = taken = users = None
        try:
            self.lock.acquire()
            if self._recount_due and not depth:
                self._recount()
            lo, hi, shape, stride, offset, key = layout or page_layout(host, master.id)
            observers = self.observers if self._observed else _NO_OBSERVERS
            if private or self.budget_bytes is None:
                itemsize = host.element_size()
                entry = _quietly(observers.quiet, self.copies.transient, self, host.as_strided((hi - lo,), (1,), lo),
                                 (hi - lo) * itemsize, what, lo * itemsize & _LINE_REST)  # slots.lead_bytes, inlined
                base = lo
                for notify in observers.reading:
                    notify(entry)
                if entry.ready is not None:
                    _quietly(observers.quiet, self.device_ops.wait_ready, entry, self.lifetimes)
                users, taken = 0, entry
                entry.users = 1
                layout = None  # a copy for this op only: no view to memoize
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
                    entry = _quietly(observers.quiet, self.copies.insert, self, key, src,
                                     (hi - lo) * host.element_size(), what)
                base = entry.key[2]
                # Held before the observers run: a prefetch makes room by evicting unused entries, and
                # this one must survive until its op is enqueued (on a GPU its block would be reused).
                users, taken = entry.users, entry
                entry.users = users + 1
                for notify in observers.accessed:
                    notify(self, master, key, entry, hit)
                for notify in observers.reading:  # timeline: the op about to run reads this copy
                    notify(entry)
                if entry.ready is not None:  # a cache hit on a completed copy skips the call
                    _quietly(observers.quiet, self.device_ops.wait_ready, entry, self.lifetimes)
            # A hit with the caller's memoized layout gets the device view it got last time.
            view = entry.view_of(layout, shape, stride, offset - base)
            item = (self, entry, depth)
            if held is not None:
                held.append(item)  # the commit: from here on the hold is the op's to give back
            return view, entry
        except BaseException:
            if item is None or not (held is None or (held and held[-1] is item)):
                try:  # (a BudgetError is routine here: slices and tiles answer it)
                    self.cut_short(depth, taken, users)
                except BaseException:  # a Ctrl-C on the way in: once more, or the thread keeps the lock
                    self.cut_short(depth, taken, users)
                    raise
            raise

    def upload(self, src: torch.Tensor, what="tensor", held=None):
        """Copy a host tensor (e.g. gathered rows) to the device for one op; accounted like a page.
        ``src`` is kept alive until the copy has completed, so the caller may drop it at once.
        Takes ``lock`` and commits into ``held`` as ``page`` does (in its own body too: every
        embedding lookup of an offloaded table runs it)."""
        depth = self._depth()
        item = taken = None
        try:
            self.lock.acquire()
            if self._recount_due and not depth:
                self._recount()
            src = src.contiguous()
            observers = self.observers
            entry = _quietly(observers.quiet, self.copies.transient, self, src.view(-1),
                             src.numel() * src.element_size(), what)
            for notify in observers.reading:
                notify(entry)
            if entry.ready is not None:
                _quietly(observers.quiet, self.device_ops.wait_ready, entry, self.lifetimes)
            taken = entry
            entry.users = 1
            view = entry.buf.view(src.shape)
            item = (self, entry, depth)
            if held is not None:
                held.append(item)
            return view, entry
        except BaseException:
            if item is None or not (held is None or (held and held[-1] is item)):
                try:
                    self.cut_short(depth, taken, 0)
                except BaseException:  # as in ``page``
                    self.cut_short(depth, taken, 0)
                    raise
            raise

    def copy_out(self, host: torch.Tensor) -> torch.Tensor:
        """A device copy owned by the caller: never cached, outside the budget (``Copies.copy_out``)."""
        if host.numel() == 0:
            return torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=self.device)
        return _quietly(self.observers.quiet, self.copies.copy_out, host, self.lock)

    def new_step(self) -> None:
        """A forward of the wrapped model begins: one pass of the prefetch schedule and of the
        expert statistics ends."""
        with self.lock:
            for notify in self.observers.new_step:
                notify()

    def is_cached(self, key) -> bool:
        return key in self._entries

    def prefetch(self, master: Master, dtype: torch.dtype, lo: int, hi: int, key=None) -> bool:
        """Start copying elements [lo, hi) of ``master`` unless cached; never evicts an entry that
        is in use and never exceeds the budget. Returns whether a copy is cached or started.
        ``key``: the range's ``CacheKey`` if the caller keeps one (made once, not one per copy)."""
        with self.lock:
            try:
                if key is None:
                    key = _new_key(CacheKey, (master.id, dtype, lo, hi))
                if key in self._entries:
                    return True
                if self.budget_bytes is None or master.flat is None:
                    return False
                return _quietly(self.observers.quiet, _prefetch, self, master, dtype, lo, hi, key)
            except BaseException:
                self._recount_due = True
                raise

    def release(self, entries) -> None:
        """The op that used ``entries`` has been enqueued: mark when the device is done with them
        (on a GPU, a mark after the op when a cached copy was used: ``CudaDevice.after_op``),
        then give back the holds of ``lock`` that ``page`` and ``upload`` took, one per entry: the
        op is over, another thread's may run (after an exception, the op's record: ``Paged``)."""
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
                        self.pool.give(entry.slot, ops.transient_free_after(entry), stream)
                        entry.slot = None
                elif last_use is not None:
                    before = entry.last_use
                    # Read on another stream before (a caller's stream switch): that reader stays
                    # one to wait for (``Marks.join``); the usual case is one stream, replaced.
                    entry.last_use = (last_use if before is None or before.track is last_use.track
                                      else ops.marks.join(before, last_use))
            if self._overflowed:
                self.room.drop_overflowed()  # cached copies outside the arena go with their op
        except BaseException:
            self.cut_short(self._depth() - len(entries))
            raise
        release = self.lock.release
        for _ in entries:
            release()


def _prefetch(pager: Pager, master: Master, dtype: torch.dtype, lo: int, hi: int, key) -> bool:
    """``Pager.prefetch``'s copy (its caller holds the lock and recounts after an exception): room
    made without evicting what is in use, then the copy."""
    itemsize = dtype.itemsize
    nbytes = (hi - lo) * itemsize
    if not pager.room.make_room(nbytes, strict=False, keep_prefetched=True, span=nbytes + lead_bytes(lo, itemsize)):
        return False
    src = master.flat[lo * itemsize : hi * itemsize].view(dtype)
    entry = pager.copies.insert(pager, key, src, nbytes, "a prefetch", prefetch=True, room_made=True)
    entry.prefetched = True
    pager.stats.prefetches += 1
    return True


forking.at_fork_in_child(lambda: forking.renew_lock(Pager._defaults_lock))


def upload_compact(pager, host: torch.Tensor, what="tensor", held=None) -> torch.Tensor:
    """``host`` gathered on the host into its own elements, in its memory order (outermost dim
    first), uploaded by ``pager.upload`` and viewed in ``host``'s shape: a view whose storage range
    holds more than its elements (a column tile of a row-major weight) takes only the room its
    elements take, and rows of a transposed weight stay column-major."""
    order = sorted(range(host.dim()), key=lambda d: -host.stride(d))
    view = pager.upload(host.permute(order).contiguous(), what, held)[0]
    return view.permute(sorted(range(host.dim()), key=order.__getitem__))
