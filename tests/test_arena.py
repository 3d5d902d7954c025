"""The arena: every paged copy of a budgeted pager lives in one device buffer allocated once, so the
memory paging reserves is that buffer whatever the sequence of sizes (on a GPU, slots allocated one
by one stayed reserved in the caching allocator, towards the sum over the sizes ever paged).

Proved on the emulated device, which runs the same arena code with a CPU buffer: ranges never
overlap and tile the buffer, a range is reused only after the tokens of its previous users have
completed (strict copies complete late), a copy goes outside the arena only when the ranges in use
leave no run long enough, the bytes are accounted, and the arena follows the room.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_interrupts import assert_arena_consistent

import offtensor as ot
from offtensor import _ext
from offtensor.pager import BudgetError, Pager
from offtensor.pager.arena import PAD, Arena, aligned
from offtensor.pager.lifetimes import HostLifetimes
from offtensor.pager.slots import SlotPool, arena_bytes

CPU = torch.device("cpu")
MiB = 1 << 20


def _page(pager, t, private=False):
    return pager.page(t._host, t._master, private=private)


def _cached(pager, t):
    return [e for e in pager.cache.entries.values() if e.key[0] == t._master.id]


def _within(arena, slot) -> bool:
    base = arena.buf.data_ptr()
    return base <= slot.buf.data_ptr() and slot.buf.data_ptr() + slot.nbytes <= base + arena.capacity


# ---------------------------------------------------------------------------- the GPU's scenario


def test_sizes_that_alternate_page_into_one_arena_that_never_grows_past_the_budget():
    # The scenario that reserved 512 MiB against a 256 MiB budget on an H200: 25 MiB x8, 100 MiB x2
    # and 7 MiB x5 paged in turn, three rounds. Every copy is a range of one buffer, allocated once.
    budget = 256 * MiB
    pager = Pager(CPU, budget_bytes=budget)
    sizes = [25 * MiB] * 8 + [100 * MiB] * 2 + [7 * MiB] * 5
    ts = [ot.offload(torch.zeros(n // 2, dtype=torch.bfloat16), pager=pager) for n in sizes]
    for _ in range(3):
        for t in ts:
            view, entry = _page(pager, t)
            assert entry.slot.start is not None and _within(pager.pool.arena, entry.slot)
            pager.release([entry])
            assert pager.pool.arena.capacity <= budget + PAD
    s = pager.snapshot()
    assert pager.pool.allocations == 1, "one device allocation for every size"
    assert s.peak_pool_bytes <= budget + PAD and s.arena_overflows == 0 and s.arena_overflow_bytes == 0
    assert s.peak_device_bytes <= budget and s.page_ins == 45


# ---------------------------------------------------------------------------- the eviction rule


def test_a_copy_that_finds_no_free_range_moves_copies_to_open_one_instead_of_evicting_more():
    unit = 16384  # bytes of each small copy; the big one is two units
    pager = Pager(CPU, budget_bytes=6 * unit, strict=True)  # strict: the move's copy completes late
    small = [ot.offload(torch.randn(unit // 4), pager=pager) for _ in range(6)]  # A..F, in that order
    big = ot.offload(torch.randn(2 * unit // 4), pager=pager)
    for t in small:
        pager.release([_page(pager, t)[1]])
    a, b, c, d, e, f = small
    for t in (b, d, f):  # least recently used first: A C E B D F
        pager.release([_page(pager, t)[1]])
    assert [s.start // unit for s in (_cached(pager, t)[0].slot for t in small)] == [0, 1, 2, 3, 4, 5]
    evictions = pager.snapshot().evictions
    view, entry = _page(pager, big)
    assert torch.equal(view, big._host)
    # The budget takes A and C, leaving two holes of one unit. Evicting on in LRU order until two
    # holes meet would take E and B as well. The run with the fewest bytes of copies, and of those
    # the one whose copy the policy would drop first, is A's hole and B: B moves into C's hole.
    s = pager.snapshot()
    assert s.evictions == evictions + 2 and s.arena_moves == 1 and s.arena_moved_bytes == unit
    assert [bool(_cached(pager, t)) for t in small] == [False, True, False, True, True, True]
    assert entry.slot.start == 0 and _cached(pager, b)[0].slot.start == 2 * unit
    pager.release([entry])
    view, entry = _page(pager, b)  # a hit on the moved copy: its values, once the move has landed
    assert s.hits < pager.snapshot().hits and torch.equal(view, b._host)
    pager.release([entry])
    assert s.arena_overflows == 0


class _FixedOrder:
    """An eviction policy that drops copies in a fixed order of names, and records how many copies
    each ranking of the arena's was given."""

    def __init__(self, names, order):
        self.names, self.order_of, self.ranked = names, order, []

    def _key(self, entry):
        return self.order_of.index(self.names[entry.key[0]])

    def victim(self, view, room, candidates):
        return min(candidates, key=self._key, default=None)

    def order(self, view, candidates):
        out = sorted(candidates, key=self._key)
        self.ranked.append(len(out))
        return out


def test_a_copy_whose_room_lies_in_two_holes_moves_a_copy_and_evicts_no_more_than_the_budget_needs():
    # A MoE layer pages every expert's gate_up (two units), then every down (one unit); the policy
    # drops experts whole, so a gate_up copy can find the budget's room in two holes of one unit.
    # A copy beside a hole moves into the other: the cache keeps every copy the budget holds.
    unit = 16384
    pager = Pager(CPU, budget_bytes=8 * unit)
    a, c, e = (ot.offload(torch.randn(unit // 4), pager=pager) for _ in range(3))  # downs
    b, d, new = (ot.offload(torch.randn(2 * unit // 4), pager=pager) for _ in range(3))  # gate_ups
    names = {t._master.id: n for t, n in zip((a, b, c, d, e, new), "aBcDeN")}
    policy = pager.room.policy = _FixedOrder(names, "aDcBeN")
    for t in (a, b, c, d, e):  # the arena: a B c D e and one unit free at its end
        pager.release([_page(pager, t)[1]])
    view, entry = _page(pager, new)
    assert torch.equal(view, new._host)
    pager.release([entry])
    # The budget takes a: room for two units, in two holes of one (a's, and the end's).
    s = pager.snapshot()
    assert s.evictions == 1 and s.arena_moves == 1
    assert [bool(_cached(pager, t)) for t in (a, b, c, d, e)] == [False, True, True, True, True]
    for t in (b, c, d, e):
        got, held = _page(pager, t)
        assert torch.equal(got, t._host)
        pager.release([held])


def test_opening_a_range_with_one_move_ranks_only_the_copies_beside_free_ranges():
    unit = 16384
    pager = Pager(CPU, budget_bytes=12 * unit)
    small = [ot.offload(torch.randn(unit // 4), pager=pager) for _ in range(12)]
    big = ot.offload(torch.randn(2 * unit // 4), pager=pager)
    names = {t._master.id: n for t, n in zip(small + [big], "ABCDEFGHIJKLZ")}
    # A and C go for the budget, their holes apart: one copy moves.
    policy = pager.room.policy = _FixedOrder(names, "ACKBDEFGHIJLZ")
    for t in small:
        pager.release([_page(pager, t)[1]])
    view, entry = _page(pager, big)
    assert torch.equal(view, big._host)
    pager.release([entry])
    s = pager.snapshot()
    assert s.evictions == 2 and s.arena_moves == 1
    # Only B and D (beside A's and C's holes) were ranked, not the ten cached copies: B, the
    # first of them to drop, moves into C's hole and the copy takes A's and B's ranges.
    assert policy.ranked == [2]
    assert entry.slot.start == 0 and _cached(pager, small[1])[0].slot.start == 2 * unit


def test_a_copy_moved_while_its_prefetch_is_in_flight_is_read_after_both_have_landed():
    unit = 16384
    pager = Pager(CPU, budget_bytes=4 * unit, strict=True)
    a, p, c = (ot.offload(torch.randn(unit // 4), pager=pager) for _ in range(3))
    big = ot.offload(torch.randn(2 * unit // 4), pager=pager)
    with _ext.StrictCopyEngine.held():  # no copy runs unless someone waits for it
        pager.release([_page(pager, a)[1]])
        assert pager.prefetch(p._master, p.dtype, 0, p.numel())  # its copy stays in flight
        pager.release([_page(pager, c)[1]])
        assert _cached(pager, p)[0].ready is not None
        # A goes for the budget; the run of A's hole and P opens the big copy's range: P moves to
        # the free end of the arena, its copy from the host not yet run. The move must read P's old
        # range only after that copy, and P's next reader only after the move.
        pager.release([_page(pager, big)[1]])
        assert pager.snapshot().arena_moves == 1 and _cached(pager, p)[0].slot.start == 3 * unit
        view, entry = _page(pager, p)
        assert torch.equal(view, p._host)
        pager.release([entry])


def test_a_range_a_cut_short_copy_left_behind_is_reused_only_after_that_copy_has_run(monkeypatch):
    pager = Pager(CPU, budget_bytes=2 * 4096, strict=True)
    a, b = (ot.offload(torch.randn(1024), pager=pager) for _ in range(2))
    keep, sources = HostLifetimes.keep, []

    def interrupted_keep(lifetimes, src, token, stream=None):
        monkeypatch.setattr(HostLifetimes, "keep", keep)
        sources.append(src)  # the host bytes stay (a DMA reading a master that lives on)
        raise KeyboardInterrupt  # A's copy is submitted; its record and its cache entry never made

    with _ext.StrictCopyEngine.held():  # A's copy stays in flight
        monkeypatch.setattr(HostLifetimes, "keep", interrupted_keep)
        with pytest.raises(KeyboardInterrupt):
            pager.prefetch(a._master, a.dtype, 0, a.numel())
        # The recount frees A's range, and B's copy takes it: only once A's copy has run, which
        # would otherwise land on B's bytes.
        view, entry = _page(pager, b)
        assert entry.slot.start == 0
        pager.release([entry])
    _ext.StrictCopyEngine.drain()  # every copy submitted has run, A's lost one too
    view, entry = _page(pager, b)
    assert torch.equal(view, b._host)
    pager.release([entry])


class _RanksByName:
    """An eviction policy that evicts least recently used first but ranks copies for the arena by a
    fixed order of names (the expert cache ranks by expected next use the same way)."""

    def __init__(self, names, order):
        self.names, self.order_of = names, order

    @staticmethod
    def victim(view, room, candidates):
        return next(candidates, None)

    def order(self, view, candidates):
        return sorted(candidates, key=lambda entry: self.order_of.index(self.names[entry.key[0]]))


def test_the_run_freed_to_open_a_range_follows_the_policy_s_ranking():
    unit = 16384
    pager = Pager(CPU, budget_bytes=6 * unit)
    small = [ot.offload(torch.randn(unit // 4), pager=pager) for _ in range(6)]
    big = ot.offload(torch.randn(2 * unit // 4), pager=pager)
    names = {t._master.id: name for t, name in zip(small, "ABCDEF")}
    pager.room.policy = _RanksByName(names, "EDFBAC")  # E the first to drop, B kept longest
    for t in small + small[1::2]:  # least recently used first: A C E B D F
        pager.release([_page(pager, t)[1]])
    pager.release([_page(pager, big)[1]])
    # The budget takes A and C (its victims: least recently used). Three runs of two hold one unit
    # of copies (B beside either hole, D beside C's): of those, the policy would drop D first, so
    # D moves into A's hole and the big copy takes C's and D's ranges.
    s = pager.snapshot()
    assert s.evictions == 2 and s.arena_moves == 1
    assert [bool(_cached(pager, t)) for t in small] == [False, True, False, True, True, True]
    assert _cached(pager, small[3])[0].slot.start == 0 and _cached(pager, big)[0].slot.start == 2 * unit


def test_a_copy_goes_outside_the_arena_only_while_ranges_in_use_split_it_and_only_for_its_op():
    unit = 16384
    pager = Pager(CPU, budget_bytes=4 * unit)
    a, b, c, d = (ot.offload(torch.randn(unit // 4), pager=pager) for _ in range(4))
    big = ot.offload(torch.randn(2 * unit // 4), pager=pager)
    for t in (a, b, c, d):
        pager.release([_page(pager, t)[1]])
    # An op holds B and D: with A and C evicted, the free ranges are one unit each between them.
    held = [_page(pager, t)[1] for t in (b, d)]
    view, entry = _page(pager, big)
    assert torch.equal(view, big._host) and entry.slot.start is None
    s = pager.snapshot()
    assert s.arena_overflows == 1 and s.arena_overflow_bytes == 2 * unit
    assert s.peak_device_bytes <= 4 * unit  # the budget's count holds: A and C made room
    assert pager.pool.reserved_bytes == pager.pool.arena.capacity + 2 * unit
    pager.release(held + [entry])
    # The overflow lasts for its op: its copy is dropped with it, and paged again into the arena.
    assert not _cached(pager, big) and pager.pool.overflow_bytes == 0
    view, entry = _page(pager, big)
    assert entry.slot.start is not None and torch.equal(view, big._host)
    pager.release([entry])
    assert pager.snapshot().arena_overflows == 1


def test_a_prefetch_never_goes_outside_the_arena():
    unit = 16384
    pager = Pager(CPU, budget_bytes=4 * unit)
    a, b, c, d = (ot.offload(torch.randn(unit // 4), pager=pager) for _ in range(4))
    big = ot.offload(torch.randn(2 * unit // 4), pager=pager)
    for t in (a, b, c, d):
        pager.release([_page(pager, t)[1]])
    held = [_page(pager, t)[1] for t in (b, d)]
    master = big._master
    assert not pager.prefetch(master, big.dtype, 0, big.numel())  # skipped, not overflowed
    pager.release(held)
    assert pager.snapshot().arena_overflows == 0 and not _cached(pager, big)


# ---------------------------------------------------------------------------- the arena's size


def test_the_arena_is_what_the_pager_may_page_and_follows_the_room():
    unit = 16384
    pager = Pager(CPU, budget_bytes=100 * unit)
    ts = [ot.offload(torch.randn(unit // 4), pager=pager) for _ in range(3)]
    pager.release([_page(pager, ts[0])[1]])
    # Three masters under a budget for a hundred copies: the arena holds what the masters hold.
    assert pager.pool.arena.capacity == arena_bytes(100 * unit, 3 * unit) == 3 * unit + PAD
    # Resident weights grow to leave room for two copies: the arena must not keep their memory. The
    # copies go first, then the arena; the next copy makes one of the new room's size.
    pager.hold_resident(98 * unit)
    assert pager.pool.arena is None and not pager.cache.entries
    pager.release([_page(pager, ts[1])[1]])
    assert pager.pool.arena.capacity == 2 * unit + PAD
    # Resident weights shrink and more masters come: the arena is re-made larger when a copy finds
    # no range and no op holds one, not before.
    pager.recount_resident(0)
    more = [ot.offload(torch.randn(unit // 4), pager=pager) for _ in range(3)]
    assert pager.pool.arena.capacity == 2 * unit + PAD
    for _ in range(2):  # the first pass re-makes the arena (dropping the copies it held), the second fills it
        for t in ts + more:
            pager.release([_page(pager, t)[1]])
    assert pager.pool.arena.capacity == 6 * unit + PAD and len(pager.cache.entries) == 6
    assert pager.pool.allocations == 3 and pager.snapshot().arena_overflows == 0


def test_an_arena_larger_than_the_room_waits_for_the_op_holding_a_range_then_goes():
    unit = 16384
    pager = Pager(CPU, budget_bytes=4 * unit)
    a, b = (ot.offload(torch.randn(unit // 4), pager=pager) for _ in range(2))
    pager.release([_page(pager, a)[1]])
    view, entry = _page(pager, b)  # an op holds B's range
    pager.hold_resident(3 * unit)  # the same thread, inside the op (a hook placing a weight)
    assert pager.pool.arena.capacity == 2 * unit + PAD and _cached(pager, b) and not _cached(pager, a)
    pager.release([entry])
    view, entry = _page(pager, a)  # the next step that finds no op holding the pager re-makes it
    assert pager.pool.arena.capacity == 1 * unit + PAD and torch.equal(view, a._host)
    pager.release([entry])
    assert pager.snapshot().peak_device_bytes <= 4 * unit


def test_clear_lets_the_arena_go():
    pager = Pager(CPU, budget_bytes=1 * MiB)
    t = ot.offload(torch.randn(1024), pager=pager)
    pager.release([_page(pager, t)[1]])
    pager.clear()
    assert pager.pool.arena is None and pager.snapshot().pool_bytes == 0


def test_an_arena_made_under_inference_mode_serves_ops_with_grad_after_it():
    pager = Pager(CPU, budget_bytes=1 * MiB, strict=True)
    t = ot.offload(torch.randint(-4, 5, (8, 8)).float(), pager=pager)  # small integers: exact sums
    with torch.inference_mode():
        pager.release([_page(pager, t)[1]])
    assert not pager.pool.arena.buf.is_inference()
    x = torch.randn(2, 8, requires_grad=True)
    (x @ t).sum().backward()  # strict mode poisons ranges given back, outside inference mode too
    assert torch.equal(x.grad, t._host.sum(1).expand(2, 8))


def test_strict_mode_poisons_a_range_given_back():
    pager = Pager(CPU, budget_bytes=4 * 4096, strict=True)
    a = ot.offload(torch.randn(1024), pager=pager)
    view, entry = _page(pager, a)
    pager.release([entry])
    pager.forget_master(a._master.id)  # A's copy is dropped (its copy long complete): its range is poisoned
    assert not _cached(pager, a)
    assert torch.isnan(view).all()  # a reader that outlived its release sees NaN, not stale weights


# ---------------------------------------------------------------------------- the property


def _instrument(monkeypatch, pager, log):
    """Check every take and give of ``pager``'s pool and arena as it happens (a move takes its new
    range from the arena directly)."""
    take, arena_take, give = SlotPool.take, Arena.take, SlotPool.give
    engine = pager.device_ops.engine

    def checked_take(pool, nbytes, stream=None):
        slot = take(pool, nbytes, stream)
        if pool is not pager.pool:
            return slot
        arena = pool.arena
        assert arena.capacity <= aligned(pager.budget.room()) + PAD, "an arena larger than the room"
        if slot.start is None:
            # Unavoidable: no run of free ranges and copies no op holds spans the copy.
            movable = {id(e.slot): (i, e) for i, e in enumerate(pager.cache.evictable(False))
                       if e.slot is not None and e.slot.start is not None}
            assert arena.window(nbytes, movable) is None, "an overflow a run of ranges could have held"
            log["overflows"] += 1
        return slot

    def checked_arena_take(arena, nbytes, stream, at=None):
        slot = arena_take(arena, nbytes, stream, at)
        if slot is None or pager.pool is None or arena is not pager.pool.arena:
            return slot
        assert _within(arena, slot) and arena.live[slot.start] is slot
        end = slot.start + slot.size
        for start, stop, token, epoch in log["given"]:
            if epoch == slot.epoch and start < end and slot.start < stop:
                assert token is None or engine.query(token), "a range reused before its last use completed"
        log["given"] = [g for g in log["given"] if g[2] is not None and not engine.query(g[2])]
        log["moves"] += at is not None
        return slot

    def checked_give(pool, slot, free_after, last_stream=None):
        if pool is pager.pool and slot.start is not None:
            log["given"].append((slot.start, slot.start + slot.size, free_after, slot.epoch))
        return give(pool, slot, free_after, last_stream)

    monkeypatch.setattr(SlotPool, "take", checked_take)
    monkeypatch.setattr(Arena, "take", checked_arena_take)
    monkeypatch.setattr(SlotPool, "give", checked_give)


_STEP = st.tuples(
    st.lists(st.integers(0, 7), min_size=1, max_size=3, unique=True),  # the tensors one op pages
    st.booleans(),  # whether its first one is paged privately (a transient copy beside the cached one)
    st.one_of(st.none(), st.integers(0, 7)),  # a tensor prefetched while the op holds its copies
    st.one_of(st.none(), st.floats(0, 1)),  # resident weights set to this share of what they may hold
)


@given(sizes=st.lists(st.integers(1, 3000), min_size=8, max_size=8), steps=st.lists(_STEP, min_size=1, max_size=20),
       extra=st.floats(0, 1.5), firsts=st.lists(st.integers(0, 80), min_size=8, max_size=8))
def test_the_arena_holds_any_sequence_of_sizes_within_its_size(monkeypatch, sizes, steps, extra, firsts):
    nbytes = [4 * n for n in sizes]
    need = max(sum(nbytes[i] for i in op) + (nbytes[op[0]] if private else 0) for op, private, _, _ in steps)
    budget = need + int(extra * sum(nbytes))
    pager = Pager(CPU, budget_bytes=budget, strict=True)  # copies complete late: tokens are pending
    # Views from an element past the start of their masters: copies that start into a line.
    ts = [ot.offload(torch.randn(first + n), pager=pager)[first:] for n, first in zip(sizes, firsts)]
    log = {"given": [], "overflows": 0, "moves": 0}
    with monkeypatch.context() as patch:
        _instrument(patch, pager, log)
        for op, private, prefetch, resident in steps:
            if resident is not None:
                pager.hold_resident(int(resident * (budget - need)))
            held = []
            try:
                for k, i in enumerate(op):
                    view, entry = _page(pager, ts[i], private=private and k == 0)
                    held.append(entry)
                    assert torch.equal(view, ts[i]._host) and _line(view) == _line(ts[i]._host)
                    if prefetch is not None and k == 0:
                        t = ts[prefetch]
                        lo = t._host.storage_offset()
                        pager.prefetch(t._master, t.dtype, lo, lo + t.numel())
                live = [e.slot for e in pager.cache.entries.values() if e.slot is not None] + \
                       [e.slot for e in held if e.key is None and e.slot is not None]
                assert len({s.start for s in live if s.start is not None}) == len([s for s in live if s.start is not None])
            except BudgetError:
                raise AssertionError("the budget holds every op's copies")
            finally:
                pager.release(held)
            pool = pager.pool
            cached = [e.slot for e in pager.cache.entries.values()]
            if pool.arena is not None:
                assert_arena_consistent(pool.arena, [s for s in cached if s.start is not None])
            assert pool.overflow_bytes == 0, "an overflow outlived its op"
            assert pager.budget.paged_bytes == sum(e.nbytes for e in pager.cache.entries.values())
            assert pool.live_bytes == sum(s.size for s in cached if s.start is not None)
            s = pager.snapshot()
            assert s.peak_device_bytes <= budget
            assert s.arena_overflows == log["overflows"] and s.arena_moves == log["moves"]
    # What the pool reserved at most: an arena no larger than the room, plus the overflows of one op
    # (each copy with the bytes it starts into its line).
    assert pager.pool.peak_bytes <= aligned(budget) + PAD + (need + 4 * 256 if log["overflows"] else 0)


def test_a_range_taken_again_is_the_same_slot_and_view_and_the_memo_forgets_its_oldest_first(monkeypatch):
    # A slot made per copy and its tensors live as long as the copy: the garbage collector walks
    # them until then. A range taken again for the same bytes reuses them.
    from offtensor.pager import arena as ot_arena

    pager = Pager(CPU, budget_bytes=4 * MiB)
    pool = pager.pool
    first = pool.take(1000)
    typed = first.typed(torch.bfloat16)
    assert typed.dtype == torch.bfloat16 and typed.data_ptr() == first.buf.data_ptr()
    pool.give(first, None)
    again = pool.take(1000)
    assert again is first and again.typed(torch.bfloat16) is typed
    assert again.typed(torch.float32).dtype == torch.float32  # another dtype: its own view
    monkeypatch.setattr(ot_arena, "_MEMO_SLOTS", 2)
    memo = pool.arena._memo
    slots = [again] + [pool.take(1000) for _ in range(2)]
    assert len(memo) == 2 and list(memo.values()) == slots[1:]  # the oldest forgotten, not all


# ---------------------------------------------------------------------------- where a copy starts


def _line(t: torch.Tensor) -> int:
    return t.data_ptr() % 64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_paged_view_at_a_storage_offset_starts_as_far_into_a_64_byte_line_as_the_unwrapped_view(dtype):
    # A view at a storage offset (an expert of a stack, a split of a fused weight) lies that many
    # bytes into a 64-byte line of the unwrapped tensor's memory, and BLAS kernels may sum a
    # misaligned head apart: its copy must lie as far into a line of device memory, whichever way
    # it is paged, or the op can see other bits than unwrapped. The budget counts its bytes alone.
    itemsize = dtype.itemsize
    plain = torch.randn(4096).to(dtype)
    budgeted, unbudgeted = Pager(CPU, budget_bytes=4 * 4096), Pager(CPU)
    for first in (0, 1, 2, 3, 5, 8, 13, 16, 31):
        unwrapped = plain[first : first + 300]
        assert _line(unwrapped) == first * itemsize % 64  # torch's CPU allocator starts storages on a line
        for pager in (budgeted, unbudgeted):
            master = ot.offload(plain.clone(), pager=pager)
            view = master[first : first + 300]
            for private in (False, True):
                device_view, entry = _page(pager, view, private=private)
                assert _line(device_view) == _line(unwrapped) and torch.equal(device_view, unwrapped)
                pager.release([entry])
            if pager is budgeted:
                assert pager.budget.paged_bytes == sum(e.nbytes for e in pager.cache.entries.values())
                assert _cached(pager, view)[0].nbytes == 300 * itemsize
                # a prefetched copy, and a hit on a copy of a larger range holding the view
                pager.prefetch(master._master, dtype, first + 10, first + 200)
                inner = master[first + 10 : first + 200]
                device_view, entry = _page(pager, inner)
                assert pager.snapshot().prefetch_hits and _line(device_view) == _line(plain[first + 10 :])
                pager.release([entry])
                device_view, entry = _page(pager, master[first + 20 : first + 30])
                assert _line(device_view) == _line(plain[first + 20 :])
                assert torch.equal(device_view, plain[first + 20 : first + 30])
                pager.release([entry])


def test_a_copy_moved_within_the_arena_and_one_in_an_overflow_slot_keep_their_place_in_a_line():
    unit = 16384
    pager = Pager(CPU, budget_bytes=6 * unit, strict=True)
    plain = [torch.randn(unit // 4 + 16) for _ in range(6)]
    small = [ot.offload(p, pager=pager)[3 : 3 + unit // 4] for p in plain]  # 12 bytes into a line
    big = ot.offload(torch.randn(2 * unit // 4), pager=pager)
    for t in small:
        pager.release([_page(pager, t)[1]])
    for t in small[1::2]:
        pager.release([_page(pager, t)[1]])
    moves = pager.snapshot().arena_moves
    pager.release([_page(pager, big)[1]])  # opens a run by moving a copy (the eviction rule's test)
    assert pager.snapshot().arena_moves > moves
    for p, t in zip(plain, small):
        if _cached(pager, t):
            view, entry = _page(pager, t)
            assert _line(view) == 12 and torch.equal(view, p[3 : 3 + unit // 4])
            pager.release([entry])
    # An op holds B and D of four one-unit copies: the free ranges between them are one unit each,
    # and a copy of two units goes to an overflow slot, 12 bytes into a line as well.
    pager = Pager(CPU, budget_bytes=4 * unit + 64)
    a, b, c, d, big = (ot.offload(torch.randn(n // 4 + 16), pager=pager)[3 : 3 + n // 4] for n in [unit] * 4 + [2 * unit])
    for t in (a, b, c, d):
        pager.release([_page(pager, t)[1]])
    held = [_page(pager, t)[1] for t in (b, d)]
    try:
        view, entry = _page(pager, big)
        held.append(entry)
        assert entry.slot.start is None and pager.snapshot().arena_overflows == 1
        assert _line(view) == 12 and torch.equal(view, big._host)
    finally:
        pager.release(held)
