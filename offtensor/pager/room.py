"""Room in the budget: evicting cached copies no op uses until what comes next fits.

What comes next is a new copy, a prefetch, or resident weights moved onto the device. The eviction
policy picks each victim (``cache.py``: LRU by default, the expert cache's order when the model has
routed experts); this module evicts it, tells the observers and gives its slot back. A copy also
needs one free range of the arena (``arena.py``): when no free range is long enough, the copies of a
run of ranges move out of it, into free ranges elsewhere (``open_range``). The arena's size follows
the room (``fit_arena``). The calls the
layers above make through the pager (resident bytes, free bytes, forgetting a master's copies)
take the pager's ``lock``; ``make_room``, ``evict`` and ``remove`` run with it held. ``RoomCalls``
is the pager's side of those calls.
"""

from __future__ import annotations

from typing import Optional

from .cache import LeastRecentlyUsed
from .lifetimes import storage_ptr
from .masters import notify_write
from .slots import lead_bytes, placed


class Room:
    """Makes room in one pager's budget and drops its cached copies."""

    def __init__(self, lock, device, budget, cache, pool, lifetimes, observers, policy):
        self.lock, self.device, self.budget, self.cache, self.pool = lock, device, budget, cache, pool
        self.lifetimes, self.observers = lifetimes, observers
        self.policy = policy  # the eviction policy: LRU, or the expert cache's order (the pager sets it)
        self.refit_due = False  # the arena is larger than the room but a range of it is in use: fit_arena
        self.overflowed = []  # cached copies in overflow slots (slots.py): evicted once no op holds them

    # ``budget_bytes`` below is the pager's (``Pager.budget_bytes``), passed by each call.

    def free_bytes(self, budget_bytes: Optional[int]) -> Optional[int]:
        """Bytes an op could page right now, evicting every cached copy no op is using; None
        without a budget. Lets an op that selects many slices (all experts of a prefill) page
        them a chunk at a time instead of failing."""
        if budget_bytes is None:
            return None
        with self.lock:  # waits for another thread's op: its copies in use are not this op's
            budget = self.budget
            return budget_bytes - budget.resident_bytes - (budget.paged_bytes - self.cache.evictable_bytes())

    def hold_resident(self, nbytes: int, budget_bytes: Optional[int]) -> None:
        """Resident weights grew to ``nbytes`` (a weight kept or moved onto the device): cached copies
        no op uses are evicted first, so that resident + paged stays within the budget and the peak
        never counts new resident bytes beside old copies that room was needed for."""
        with self.lock:
            self.for_resident(nbytes, budget_bytes)
            self.budget.hold_resident(nbytes)

    def recount_resident(self, nbytes: int, budget_bytes: Optional[int]) -> None:
        """Resident weights hold ``nbytes`` now (a recount after placing, loading, unwrapping or
        deleting weights); when they grew, cached copies make room first, as for ``hold_resident``."""
        with self.lock:
            self.for_resident(nbytes, budget_bytes)
            self.budget.recount_resident(nbytes)

    def for_resident(self, nbytes: int, budget_bytes: Optional[int]) -> None:
        """Evict cached copies no op uses until ``nbytes`` of resident weights fit beside the copies
        left, and let the arena go if it is now larger than the room: called before a weight is
        moved onto the device, so its bytes are never allocated while the copies (and on a GPU the
        arena memory) they displace still hold the budget."""
        if budget_bytes is None:
            return
        with self.lock:
            grow = nbytes - self.budget.resident_bytes
            if grow > 0 and not self.budget.fits(grow):
                self.evict_for(grow)
            self.fit_arena(budget_bytes - nbytes)

    def make_room(self, nbytes: int, strict: bool, what="tensor", keep_prefetched: bool = False,
                  span: Optional[int] = None) -> bool:
        """Evict unused copies until ``nbytes`` more fit the budget, and open one free range of the
        arena for them (``open_range``), of ``span`` bytes where the copy starts into its first
        line (``slots.lead_bytes``). A prefetch passes ``keep_prefetched``: evicting an earlier
        prefetch that is still to be used would throw away a copy to make room for one needed
        later. False when the budget cannot hold them (``strict``: a ``BudgetError``) or no range can
        be made free (then a copy that goes ahead gets an overflow slot: ``slots.py``)."""
        budget = self.budget
        if not budget.fits(nbytes) and not self.evict_for(nbytes, keep_prefetched):
            if not strict:
                return False
            in_use = budget.paged_bytes - self.cache.evictable_bytes()
            raise budget.shortfall_error(what if isinstance(what, str) else repr(what), nbytes, in_use, self.device)
        if span is not None:
            nbytes = span  # the budget counts the copy's bytes, the arena the range it lies in
        pool = self.pool
        arena = pool.arena
        if arena is not None and arena.find(nbytes) is not None or pool.has_range(nbytes):
            return True
        return self.open_range(nbytes, keep_prefetched)

    def evict_for(self, nbytes: int, keep_prefetched: bool = False) -> bool:
        """Evict unused copies, in the policy's order, until ``nbytes`` more (which do not fit now)
        fit the budget."""
        budget, cache, policy = self.budget, self.cache, self.policy
        while True:
            # The few entries the current op holds are skipped. The policy picks among the rest:
            # least recently used first, routed experts by layer order and use frequency.
            victim = policy.victim(cache.view, budget.room(), cache.evictable(keep_prefetched))
            if victim is None:
                return False
            self.evict(victim)
            if budget.fits(nbytes):
                return True

    # The arena (``arena.py``): one free range for each copy, and its size.

    def open_range(self, nbytes: int, keep_prefetched: bool) -> bool:
        """The budget holds ``nbytes`` more but no free range of the arena does (its free bytes lie
        in pieces): free a run of ranges (``Arena.window``: the run long enough with the fewest
        bytes of copies in it, then the one whose copies the policy would drop first) by moving its
        copies into free ranges outside it (``move``: a copy at device memory bandwidth, not a page
        from the host), evicting only those no free range outside holds. So the arena costs the
        cache no copy the budget itself would not evict, and a new copy evicts no copy by LRU
        until two holes happen to meet. The policy's order ranks the copies (``order``: least
        recently used first, or the expert cache's expected next use, furthest first; without one,
        least recently used first). Any copy no op holds may move; for a prefetch, a copy
        prefetched and still to be used is never evicted (if it fits nowhere else, no range opens).
        An arena smaller than the pager may page now (masters added, resident weights gone since it
        was made) is re-made at that size instead, when no op holds a range of it. False: the
        ranges in use split every run."""
        pool, cache = self.pool, self.cache
        arena = pool.arena
        order = getattr(self.policy, "order", None)
        remake = not keep_prefetched and arena.capacity < pool.wanted_bytes()
        if not remake and self.move_one_for_range(nbytes, order):
            return True
        # Any copy no op holds may move; a prefetch evicts no copy prefetched and still to be used.
        ranked = cache.evictable(False) if order is None else order(cache.view, cache.evictable(False))
        movable = {}
        for rank, entry in enumerate(ranked):
            slot = entry.slot
            if slot is not None and slot.start is not None:
                movable[id(slot)] = (rank, entry)
        if remake and all(id(slot) in movable for slot in arena.live.values()):
            for _, entry in list(movable.values()):
                self.evict(entry)
            pool.drop()
            return pool.has_range(nbytes)
        run = arena.window(nbytes, movable)
        if run is None:
            return False
        lo, hi, copies = run
        # Copies that may not be evicted first (they decide whether the range opens), then the
        # largest first (the hardest to place).
        copies.sort(key=lambda e: (not (keep_prefetched and e.prefetched), -e.slot.size))
        for entry in copies:
            at = arena.place_outside(entry.slot.size, lo, hi)
            if at is not None:
                self.move(entry, at)
            elif keep_prefetched and entry.prefetched:
                return False
            else:
                self.evict(entry)
        return True

    def move_one_for_range(self, nbytes: int, order) -> bool:
        """``open_range``'s usual case, found without ranking every cached copy: a free range beside
        a copy no op holds, which holds ``nbytes`` once that copy moves to a free range elsewhere
        (``Arena.one_move_runs``). Of such copies, the one the policy would drop first (ranked
        among them alone; least recently used first: the first of them in LRU order), at its
        lowest run: ``window``'s choice wherever one move suffices."""
        arena, entries = self.pool.arena, self.cache.entries

        def movable(slot) -> bool:  # (a slot's owner is a hint: checked)
            owner = slot.owner
            return owner is not None and owner.slot is slot and not owner.users and entries.get(owner.key) is owner

        runs = arena.one_move_runs(nbytes, movable)
        if not runs:
            return False
        candidates = {id(slot.owner): slot.owner for slot, _, _ in runs}
        if order is None or isinstance(self.policy, LeastRecentlyUsed):
            first = next(e for e in self.cache.evictable(False) if id(e) in candidates)
        else:
            ranked = order(self.cache.view, iter(candidates.values()))
            if not ranked:
                return False
            first = ranked[0]
        slot = first.slot
        lo, hi = min((lo, hi) for s, lo, hi in runs if s is slot)
        self.move(first, arena.place_outside(slot.size, lo, hi))
        return self.pool.has_range(nbytes)

    def move(self, entry, at: int) -> None:
        """Move ``entry``'s copy to the free range at ``at``: the next op reading it waits for the
        move, and its old range is free once the move has read it."""
        for notify in self.observers.freed:  # timeline: the copy into its old range waits for its last reader
            notify(entry)
        old = entry.slot
        new, moved = self.pool.move(old, at, (entry.ready, entry.last_use))
        buf = entry.buf  # the slot's bytes move whole: the copy keeps its place in its first line
        buf = placed(new, buf.dtype, lead_bytes(entry.key[2], buf.element_size()), buf.numel())
        # One assignment, no call inside it: an interrupt sees the entry before or after the move.
        entry.slot, entry.buf, entry.ready, entry.last_use, entry.view = new, buf, moved, None, None
        new.owner = entry
        self.pool.give(old, moved)
        stats = self.budget.stats
        stats.arena_moves += 1
        stats.arena_moved_bytes += old.nbytes

    def drop_overflowed(self) -> None:
        """Evict the cached copies in overflow slots that no op holds: an overflow lasts for the op
        that needed it, not for as long as its copy would stay cached."""
        with self.lock:
            entries = self.cache.entries
            kept = []
            for entry in self.overflowed:
                if entry.key is not None and entries.get(entry.key) is entry:
                    if entry.users:
                        kept.append(entry)
                    else:
                        self.evict(entry)
            self.overflowed[:] = kept

    def fit_arena(self, room: Optional[int] = None) -> bool:
        """Let the arena go if it is larger than the budget's room (``room``, default the room now)
        allows: the copies no op uses are evicted, and the next copy makes an arena of the new size.
        If an op holds a range of it, it stays until the pager's next recount, when none does
        (``refit_due``)."""
        pool = self.pool
        self.refit_due = False
        if pool is None or not pool.exceeds(self.budget.room() if room is None else room):
            return True
        with self.lock:
            for entry in list(self.cache.evictable(False)):
                self.evict(entry)
            if pool.drop():
                return True
            self.refit_due = True
            return False

    def evict(self, entry) -> None:
        for notify in self.observers.evicted:
            notify(entry)
        self.remove(entry)
        self.budget.stats.evictions += 1

    def remove(self, entry) -> None:
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
            self.pool.give(entry.slot, entry.last_use or entry.ready)
            entry.slot = None

    def before_write(self, master) -> None:
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
                self.remove(entry)

    def clear(self) -> None:
        """Drop every cached copy (e.g. before unwrapping) and let the arena go."""
        with self.lock:
            for master_id in self.cache.masters():
                self.forget_master(master_id)
            if self.pool is not None:
                self.pool.clear()


class RoomCalls:
    """The pager's calls into its ``Room`` (``Pager``'s base), each through ``Pager._room``: a step
    cut short marks the pager for a recount (the package docstring's "Exceptions")."""

    __slots__ = ()

    # Room in the budget for resident weights, and the free bytes an op could page.

    def hold_outside(self, account: str, nbytes: int) -> None:
        """``account`` holds ``nbytes`` of the budget from now on (``Budget.hold_outside``: what it
        held comes back): device memory the pager does not page into, the expert pools
        (``moe.pool``) or the learned look-ahead's maps (``moe.predictor.install``). What the pager
        pages then fits the rest: cached copies no op uses are evicted first, before the caller
        allocates those bytes. Setting an account again is a no-op, so a caller repeats it to undo
        whatever cut it short."""
        with self.lock:
            if self.budget_bytes is not None and self.budget.hold_outside(account, nbytes):
                self._recount_due = True  # cut short before the arena fits the new room: the recount fits it
                if not self.budget.fits(0):
                    self._room(self.room.evict_for, 0)
                self._room(self.room.fit_arena)  # the arena must not hold those bytes
                self.budget.note_peak()  # the caller allocates them now, in the room made for them

    def held_outside(self, account: str) -> int:
        """The bytes of the budget ``account`` holds (``hold_outside``)."""
        return self.budget.outside.get(account, 0)

    def free_bytes(self) -> Optional[int]:
        """Bytes an op could page right now, evicting every unused cached copy; None without a budget."""
        return self._room(self.room.free_bytes, self.budget_bytes)

    def hold_resident(self, nbytes: int) -> None:
        """Resident weights grew to ``nbytes``; unused cached copies make room first."""
        self._room(self.room.hold_resident, nbytes, self.budget_bytes)

    def recount_resident(self, nbytes: int) -> None:
        """Resident weights hold ``nbytes`` now; when they grew, unused cached copies make room first."""
        self._room(self.room.recount_resident, nbytes, self.budget_bytes)

    def room_for_resident(self, nbytes: int) -> None:
        """Evict unused cached copies until ``nbytes`` of resident weights fit beside the rest."""
        self._room(self.room.for_resident, nbytes, self.budget_bytes)

    # Dropping cached copies.

    def before_write(self, master) -> None:
        """``master`` is about to change: wait for its copies' reads and drop its cached copies (and,
        for a pooled expert stack, empty its pool: ``moe.pool``); lazy casts of it keep its bytes
        as they are now (``masters.observe_writes``)."""
        notify_write(master)
        self._room(self.room.before_write, master)
        if self.expert_pool is not None:
            self.expert_pool.invalidate(master.id)

    def cached_copies(self):
        """Master id -> its cached copies (a read-only, live mapping, as an eviction policy sees
        them): a master's few cached, without a look-up per key of it (a stack of 256 experts with
        a quarter of them cached), nor a list of them made per call."""
        return self.cache.view.by_master

    def drop_prefetch_hold(self, key) -> None:
        """``key``'s copy was made ahead of a use that is no longer coming (a wrong guess): until
        used, a prefetched copy is kept while anything else can go; from now it is evicted as any."""
        with self.lock:
            entry = self._entries.get(key)
            if entry is not None:
                entry.prefetched = False

    def forget_master(self, master_id: int) -> None:
        """Drop every cached copy of ``master_id`` (it died, moved to another pager, or changes)."""
        self._room(self.room.forget_master, master_id)

    def clear(self) -> None:
        """Drop every cached copy (e.g. before unwrapping) and let the arena go."""
        self._room(self.room.clear)
