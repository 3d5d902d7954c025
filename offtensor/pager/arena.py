"""The arena: one device buffer, allocated once, that every paging slot of a budgeted pager is cut
from by offset.

Why one buffer: on a GPU, slots allocated one by one through the CUDA caching allocator stay
reserved after they are freed, in blocks that a copy of another size cannot use (a 100 MiB request
is not served from cached 25 MiB blocks), so reserved memory grew towards the sum over the sizes
ever paged, far past the budget. The arena is reserved once, at its full size, and never grows
while a range of it is in use: what paging reserves is the arena (and the overflows of
``slots.py``), whatever the sequence of sizes.

Ranges. Offsets and sizes are multiples of ``ALIGN`` (256 bytes, the alignment ``cudaMalloc``
gives and cuBLAS and vectorized kernels look for). The free ranges are kept by start and by size, a
sorted list of sizes bisected for the best fit: the smallest free range that holds the request,
and among ranges of that size the one given back last. A range given back stays as it is, for the
next copy of its size (layers repeat their shapes: the same addresses again, no split, no merge);
only when no free range holds a request are adjacent free ranges merged (one sort) and the search
repeated. A take or a give is a few dict operations and one bisect, O(log n) in the free ranges.

Tokens. A range given back may still be read (on a GPU, by the op that used it) or written (by a
copy still in flight). It goes back with its completion token, or on a GPU, for a transient copy,
with the stream of its last use; the free range keeps these as pieces ``(start, end, token,
stream)``. Whoever takes part of a free range orders itself after the pieces overlapping that part
and only those (on the emulated device the order is a host wait, and waiting for a piece elsewhere
would wait for nothing). Pieces whose token is known complete are dropped when ranges merge, and
adjacent pieces that wait for one stream become one.

Interrupts (the pager package's rule, "Exceptions"): the free ranges by start and the live ranges
are the truth; the index by size is checked against them on each use. A step cut short
leaves at worst a range out of both (so counted in use) until the pager's recount, which rebuilds
the arena from the slots the cache holds (``rebuild``).
"""

from __future__ import annotations

from bisect import bisect_left, insort

import torch

ALIGN = 256
# Alignment padding the arena gets beyond what the pager may page: ranges are aligned, the budget's
# bytes are not, so 16 ranges of odd sizes still fit where their exact bytes do (8 of copies that
# also start past a boundary, as their host views do: ``slots.lead_bytes``). Past that, a copy
# moves or evicts copies no op holds, or takes an overflow slot, as any copy finding no range does.
PAD = 16 * ALIGN
# Slots remembered per arena for reuse (same start and size: the same view, no new tensor), the
# oldest forgotten first. Enough for every range of a cache of tens of thousands of experts: a copy
# into a range the memo forgot makes a slot and tensors that live as long as the copy, which
# Python's garbage collector walks until then (DeepSeek-V3 with a quarter of its experts cached
# holds some 11,000 expert copies).
_MEMO_SLOTS = 32768


def aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) & -ALIGN


class Slot:
    """A device buffer a paged copy lives in: ``buf``, ``nbytes`` bytes, at ``start`` of the arena
    ``epoch`` and spanning ``size`` (``nbytes`` aligned) there; ``start`` None for an overflow slot,
    a buffer of its own outside the arena. ``owner``: the cached copy it was last taken for (a hint
    its reader checks: ``owner.slot is slot``; slots are reused)."""

    __slots__ = ("buf", "nbytes", "start", "size", "epoch", "owner", "_typed")

    def __init__(self, buf, nbytes: int, start, size: int, epoch: int):
        self.buf, self.nbytes, self.start, self.size, self.epoch = buf, nbytes, start, size, epoch
        self.owner = None
        self._typed = None  # buf viewed as the dtype it was last taken for

    def typed(self, dtype: torch.dtype) -> torch.Tensor:
        """``buf`` viewed as ``dtype``: the same view for a slot taken again for the same dtype."""
        typed = self._typed
        if typed is None or typed.dtype != dtype:
            # Kept for later ops: under inference_mode view(dtype) would make an inference tensor,
            # and an op outside it could not make the weight's page require grad (F.linear on a 3-D
            # input, tiling.as_linear_weight) nor write into it.
            with torch.inference_mode(False):
                typed = self._typed = self.buf.view(dtype)
        return typed


class Arena:
    """Ranges of one device buffer ``buf`` of ``capacity`` bytes: ``live`` (start -> the slot holding
    it) and the free ones, with what their previous users left pending."""

    __slots__ = ("buf", "capacity", "epoch", "live", "live_ends", "live_bytes", "_ops", "_free", "_by_size", "_sizes", "_loose",
                 "_found", "_memo")

    def __init__(self, buf, epoch: int, ops):
        self.buf = buf
        self.capacity = buf.numel()
        self.epoch = epoch
        self.live: dict = {}  # start -> Slot
        self.live_ends: dict = {}  # start + size -> Slot, of the same slots (one_move_runs)
        self.live_bytes = 0  # aligned bytes of the live ranges
        self._ops = ops  # the device operations: tokens, waits, strict mode
        self._free: dict = {}  # start -> (end, pieces)
        self._by_size: dict = {}  # size -> {start: None}, the range given back last last
        self._sizes: list = []  # the sizes of _by_size, sorted
        self._loose = False  # whether free ranges may lie side by side (given back since the last merge)
        self._found = None  # (size, start) that find() answered last: the pager's take follows its find
        self._memo: dict = {}  # (start, nbytes) -> Slot
        if self.capacity:
            self._add(0, self.capacity, [])

    # ------------------------------------------------------------------ taking and giving back

    def find(self, nbytes: int):
        """The start of the best free range for ``nbytes`` (merging free neighbours first if none
        holds it), or None."""
        size = (nbytes + ALIGN - 1) & -ALIGN
        starts = self._by_size.get(size)
        if starts:  # an exact fit, the usual case: _best's first step, inlined
            start = next(reversed(starts))
            found = self._free.get(start)
            if found is not None and found[0] - start == size:
                self._found = (size, start)
                return start
        start = self._best(size)
        if start is None and self._loose:
            self._merge()
            start = self._best(size)
        self._found = (size, start)
        return start

    def _best(self, size: int):
        sizes, by_size, free = self._sizes, self._by_size, self._free
        i = bisect_left(sizes, size)
        while i < len(sizes):
            have = sizes[i]
            starts = by_size.get(have)
            while starts:
                start = next(reversed(starts))
                found = free.get(start)
                if found is not None and found[0] - start == have:
                    return start
                del starts[start]  # an interrupted step's leftover
            by_size.pop(have, None)
            del sizes[i]
        return None

    def take(self, nbytes: int, stream, at=None):
        """A slot of ``nbytes`` whose previous contents are dead for work enqueued next on ``stream``
        (emulated: now); None when no free range holds it. ``at``: the start of the free range to
        cut it from."""
        size = (nbytes + ALIGN - 1) & -ALIGN
        found, self._found = self._found, None
        if at is not None:
            start = at
        elif found is not None and found[0] == size and found[1] in self._free:
            start = found[1]  # the room made for this copy (Room.make_room) found it just now
        else:
            start = self.find(size)
            if start is None:
                return None
        ops = self._ops
        end, pieces = self._remove(start)
        cut = start + size
        if end > cut:
            self._add(cut, end, [(max(a, cut), b, t, s) for a, b, t, s in pieces if b > cut] if pieces else pieces)
        for a, b, token, last in pieces:
            if a < cut:
                ops.order_after(ops.reuse_token(token, last, stream), stream)
        memo = self._memo
        slot = memo.get((start, nbytes))
        if slot is None:
            if len(memo) >= _MEMO_SLOTS:
                del memo[next(iter(memo))]
            slot = memo[(start, nbytes)] = Slot(self.buf[start : start + nbytes], nbytes, start, size, self.epoch)
        self.live[start] = slot
        self.live_ends[start + size] = slot
        self.live_bytes += size
        if ops.strict:
            slot.buf.fill_(0xFF)  # whatever a reader of the previous contents or of garbage would see
        return slot

    def give(self, slot: Slot, token, last_stream) -> bool:
        """``slot`` is free once ``token`` has completed (GPU, ``token`` None: once the work enqueued
        so far on ``last_stream`` has). False if it was not live here (given back already)."""
        start = slot.start
        if self.live.get(start) is not slot:
            return False
        del self.live[start]
        end = start + slot.size
        del self.live_ends[end]
        self.live_bytes -= slot.size
        ops = self._ops
        if ops.strict and last_stream is None and ops.done(token):
            # A reader that outlives its release (an op result aliasing a paged copy) now sees NaN /
            # -1 instead of plausible stale weights. Never waited for here: the wait would hide the
            # very races strict mode is for; a range still being copied into is poisoned when taken.
            slot.buf.fill_(0xFF)
            token = None
        # _add, inlined: every eviction runs this
        self._free[start] = (end, [] if token is None and last_stream is None else [(start, end, token, last_stream)])
        size = slot.size
        starts = self._by_size.get(size)
        if starts is None:
            starts = self._by_size[size] = {}
            insort(self._sizes, size)
        starts[start] = None
        self._loose = True
        return True

    # ------------------------------------------------------------------ the free ranges

    def _add(self, start: int, end: int, pieces: list) -> None:
        self._free[start] = (end, pieces)
        size = end - start
        starts = self._by_size.get(size)
        if starts is None:
            starts = self._by_size[size] = {}
            insort(self._sizes, size)
        starts[start] = None

    def _remove(self, start: int):
        end, pieces = self._free.pop(start)
        size = end - start
        starts = self._by_size.get(size)
        if starts is not None:
            starts.pop(start, None)  # an emptied size stays for the next range of it; _best drops it
        return end, pieces

    def _merge(self) -> None:
        """Merge free ranges that lie side by side; their pieces known complete go."""
        merged = []
        for start in sorted(self._free):
            end, pieces = self._free[start]
            if merged and merged[-1][1] == start:
                first, _, before = merged[-1]
                merged[-1] = (first, end, before + pieces if before else pieces)
            else:
                merged.append((start, end, pieces))
        self._free, self._by_size, self._sizes = {}, {}, []
        for start, end, pieces in merged:
            self._add(start, end, _pending(pieces, self._ops) if len(pieces) > 1 else pieces)
        self._loose = False

    def pending(self) -> list:
        """(token, stream) of every piece still pending in the free ranges."""
        return [(token, last) for _, pieces in self._free.values() for _, _, token, last in pieces]

    # ------------------------------------------------------------------ opening a range

    def window(self, nbytes: int, movable: dict):
        """The run of ranges to free so that ``nbytes`` are free in one range: (its start, its end,
        the copies in it), or None if ranges held by ops split every run long enough.

        ``movable`` maps ``id(slot)`` to ``(rank, copy)`` for the copies no op holds that the
        eviction policy may move or drop, ``rank`` its place in the policy's order (0: the first it
        would drop). The rule: of the runs of adjacent ranges, each free or holding such a copy,
        that span ``nbytes`` and are shortest for their last range, the run with the fewest bytes
        of copies (what has to move out of it), then the one whose highest-ranked copy ranks lowest
        (the policy's order, with a run as the unit: what is evicted if it cannot move)."""
        if self._loose:
            self._merge()
        size = (nbytes + ALIGN - 1) & -ALIGN
        blocks = self.blocks()
        best = None
        first, held, edge = 0, 0, 0
        for j, (start, end, slot) in enumerate(blocks):
            if slot is not None and id(slot) not in movable:
                first, held, edge = j + 1, 0, end  # a range in use ends every run
                continue
            if start != edge:
                first, held = j, 0  # a gap (a range a cut-short step left out) ends every run too
            edge = end
            if slot is not None:
                held += end - start
            while end - blocks[first][1] >= size:  # the run without its first range still spans size
                if blocks[first][2] is not None:
                    held -= blocks[first][1] - blocks[first][0]
                first += 1
            if end - blocks[first][0] >= size:
                newest = max((movable[id(b[2])][0] for b in blocks[first : j + 1] if b[2] is not None), default=-1)
                if best is None or (held, newest) < best[0]:
                    best = ((held, newest), first, j)
        if best is None:
            return None
        _, first, last = best
        return (blocks[first][0], blocks[last][1],
                [movable[id(b[2])][1] for b in blocks[first : last + 1] if b[2] is not None])

    def one_move_runs(self, nbytes: int, movable) -> list:
        """Runs that hold ``nbytes`` once one copy moves out: (its slot, the run's start, its end)
        for each copy whose slot ``movable(slot)`` says may move (no op holds it) beside a free range, the copy and
        the free range before it, or after it, or both where one side is not enough, the copy
        placeable outside the run (``place_outside``). Found from the free ranges (few), not from
        every range: the common case of ``window``, without ranking every cached copy."""
        if self._loose:
            self._merge()
        size = (nbytes + ALIGN - 1) & -ALIGN
        free, live, live_ends = self._free, self.live, self.live_ends
        free_ends = {end: start for start, (end, _) in free.items()}
        runs, seen = [], set()
        for start, (end, _) in free.items():
            for slot in (live.get(end), live_ends.get(start)):
                if slot is None or id(slot) in seen or not movable(slot):
                    continue
                seen.add(id(slot))
                lo, hi = slot.start, slot.start + slot.size
                before = free_ends.get(lo, lo)
                after = free[hi][0] if hi in free else hi
                for run in ((before, hi), (lo, after), (before, after)):
                    if run[1] - run[0] >= size and self.place_outside(slot.size, *run) is not None:
                        runs.append((slot,) + run)
                        break
        return runs

    def place_outside(self, nbytes: int, lo: int, hi: int):
        """The start of the best free range for ``nbytes`` that does not overlap [lo, hi), or None."""
        size = (nbytes + ALIGN - 1) & -ALIGN
        sizes, by_size, free = self._sizes, self._by_size, self._free
        for have in sizes[bisect_left(sizes, size):]:
            for start in reversed(by_size.get(have, ())):
                found = free.get(start)
                if found is not None and found[0] - start == have and (start + have <= lo or start >= hi):
                    return start
        return None

    def blocks(self) -> list:
        """(start, end, slot) of every range by start; ``slot`` None for a free one."""
        return sorted([(start, end, None) for start, (end, _) in self._free.items()]
                      + [(start, start + slot.size, slot) for start, slot in self.live.items()],
                      key=lambda block: block[0])

    # ------------------------------------------------------------------ recount

    def rebuild(self, live) -> None:
        """The live ranges are exactly ``live``'s (slots of this arena, the cache's), every other byte
        free with nothing pending: after a step cut short, once every copy and op has completed."""
        self.live = {slot.start: slot for slot in live}
        self.live_ends = {slot.start + slot.size: slot for slot in live}
        self.live_bytes = sum(slot.size for slot in self.live.values())
        self._free, self._by_size, self._sizes, self._loose, self._found = {}, {}, [], False, None
        edge = 0
        for start in sorted(self.live):
            if start > edge:
                self._add(edge, start, [])
            edge = start + self.live[start].size
        if edge < self.capacity:
            self._add(edge, self.capacity, [])


def _pending(pieces: list, ops) -> list:
    """``pieces`` (by start) without those known complete, adjacent ones waiting for one stream joined."""
    kept = []
    for piece in pieces:
        token, last = piece[2], piece[3]
        if token is not None:
            if ops.done(token):
                continue
        elif kept and kept[-1][2] is None and kept[-1][3] == last:
            # One stream's order covers both (its Python objects differ per lookup: ==, not is). The
            # joined piece may span bytes between them with nothing pending: ordering after more
            # work than needed is never wrong.
            kept[-1] = (kept[-1][0], piece[1], None, last)
            continue
        kept.append(piece)
    return kept
