"""The device memory paged copies live in: one arena per budgeted pager, and overflow slots beside it."""

from __future__ import annotations

import torch

from .arena import ALIGN, PAD, Arena, Slot, aligned

__all__ = ["LINE", "Slot", "SlotPool", "arena_bytes", "lead_bytes", "placed"]

# A copy starts as many bytes past a ``LINE`` boundary of device memory as its host view starts
# past one in its master's storage, as the unwrapped view does in its own storage, which starts on
# such a boundary (the CUDA caching allocator's 512 bytes; torch's CPU allocator gives 64, enough
# for the 64 bytes a CPU kernel sees). So a view at a storage offset (one expert of a stack, a split
# of a fused weight, a strided window) reaches its kernels at the unwrapped view's alignment: BLAS
# may sum a misaligned head apart (MKL promises the same bits only for the same alignment), and
# PyTorch tells cuBLASLt each pointer's alignment, which its choice of kernel follows. Ranges of the
# arena start on a LINE, so a copy from a boundary, the usual case, is placed as before.
LINE = ALIGN


def lead_bytes(lo: int, itemsize: int) -> int:
    """How far into a ``LINE`` the copy of elements from ``lo`` of a master starts."""
    return lo * itemsize & (LINE - 1)


def placed(slot, dtype: torch.dtype, lead: int, numel: int) -> torch.Tensor:
    """The ``numel`` elements of ``dtype`` at ``lead`` bytes into ``slot``: where a copy goes."""
    typed = slot.typed(dtype)
    if not lead:
        return typed
    first = lead // dtype.itemsize
    with torch.inference_mode(False):  # kept for later ops, as ``Slot.typed`` is
        return typed[first : first + numel]


def arena_bytes(room: int, offloaded: int) -> int:
    """The size of an arena for ``room`` bytes of copies (budget minus resident bytes) and
    ``offloaded`` bytes of host masters: what the pager may page, the smaller of the two (a pager
    never caches more than it pages from, and an arena sized to a room its masters never fill would
    hold memory that others, vLLM's KV cache, size themselves from), aligned up to 256 bytes, plus
    ``PAD`` (4 KiB) for the alignment of ranges of odd sizes."""
    return aligned(max(0, min(room, offloaded))) + PAD


class SlotPool:
    """Every paged copy of a budgeted pager lives in a slot of this pool: a range of its arena
    (``arena.py``) or, when no range of it can be made free, an overflow slot.

    - The arena is allocated at the first take, ``arena_bytes(room, offloaded)`` then, on the copy
      stream on a GPU; it never changes size while a range of it is in use. ``Room`` decides when it
      is re-made: when the room shrinks below it (resident weights grew: it must not hold their
      memory) and when it has grown past it (more masters, fewer resident weights) and a copy
      finds no range. ``drop`` lets it go once no range is in use; the next take makes the new one.
    - An overflow slot is a plain allocation outside the arena, for a copy that fits the budget
      but finds no range of the arena that moving or evicting copies no op holds could free: the
      ranges in use (the current op's copies) split the arena so that no run of the others is long
      enough. Freed when its op is done (``Room.drop_overflowed``), after its last use. Counted in
      ``stats.arena_overflows`` and ``stats.arena_overflow_bytes``: the slack over the arena.
    - Ordering: a range is reused only after every reader and writer of its previous contents
      (the tokens it was given back with, ``Arena.take``); strict mode poisons ranges given back
      and taken. A copy moved within the arena (``move``, to open a range) is read once the copy
      that filled it and the ops that read it are done, and its old range is free once the move is.
    - ``live_bytes``: aligned bytes in use; ``reserved_bytes``: the arena and overflow slots in use,
      what paging holds of device memory (``stats.pool_bytes``); ``peak_bytes`` its high-water mark.
    """

    __slots__ = ("_ops", "_budget", "arena", "_epoch", "overflow_bytes", "peak_bytes", "allocations")

    def __init__(self, ops, budget):
        self._ops = ops
        self._budget = budget
        self.arena = None
        self._epoch = 0
        self.overflow_bytes = 0  # bytes of overflow slots in use
        self.peak_bytes = 0
        self.allocations = 0  # device allocations made: arenas and overflow slots

    # ------------------------------------------------------------------ sizes

    @property
    def live_bytes(self) -> int:
        return (self.arena.live_bytes if self.arena is not None else 0) + self.overflow_bytes

    @property
    def reserved_bytes(self) -> int:
        return (self.arena.capacity if self.arena is not None else 0) + self.overflow_bytes

    def wanted_bytes(self, room=None) -> int:
        """``arena_bytes`` for ``room`` (default: the budget's room now) and the offloaded bytes now."""
        budget = self._budget
        return arena_bytes(budget.room() if room is None else room, budget.offloaded_bytes)

    def exceeds(self, room: int) -> bool:
        """Whether the arena is larger than an arena for ``room`` bytes may be."""
        return self.arena is not None and self.arena.capacity > arena_bytes(room, room)

    def reset_peak(self) -> None:
        self.peak_bytes = self.reserved_bytes

    def _note_peak(self) -> None:
        reserved = self.reserved_bytes
        if reserved > self.peak_bytes:
            self.peak_bytes = reserved

    # ------------------------------------------------------------------ slots

    def has_range(self, nbytes: int) -> bool:
        """Whether a free range of the arena (made now if there is none) holds ``nbytes``."""
        arena = self.arena or self._make()
        return arena.find(nbytes) is not None

    def take(self, nbytes: int, stream=None) -> Slot:
        """A slot of ``nbytes`` whose previous contents are dead for work enqueued on ``stream`` (the
        stream that will write it) or, emulated, now: a range of the arena, else an overflow slot."""
        arena = self.arena or self._make()
        slot = arena.take(nbytes, stream)
        if slot is None:
            slot = Slot(self._ops.allocate(nbytes), nbytes, None, nbytes, 0)
            self.allocations += 1
            self.overflow_bytes += nbytes
            stats = self._budget.stats
            stats.arena_overflows += 1
            stats.arena_overflow_bytes += nbytes
            self._note_peak()
        return slot

    def move(self, slot: Slot, at: int, after):
        """A copy of ``slot``'s bytes into the free range of the arena at ``at``, made once the
        tokens ``after`` (the copy that filled ``slot``, the last op that read it) have completed:
        (the new slot, the move's token). The caller gives ``slot`` back with that token."""
        ops = self._ops
        new = self.arena.take(slot.nbytes, ops.copy_stream, at)
        return new, ops.copy_within(new.buf, slot.buf, after)

    def give(self, slot: Slot, free_after, last_stream=None) -> None:
        """``slot`` is no longer used once ``free_after`` has completed, or (GPU, ``free_after``
        None) once the work enqueued so far on ``last_stream`` has."""
        if slot.start is None:
            self.overflow_bytes -= slot.nbytes
            self._ops.before_free(free_after, last_stream)  # its block goes back to the allocator
            return
        arena = self.arena
        if arena is not None and slot.epoch == arena.epoch:
            arena.give(slot, free_after, last_stream)

    # ------------------------------------------------------------------ the arena itself

    def _make(self) -> Arena:
        self._epoch += 1
        arena = self.arena = Arena(self._ops.allocate(self.wanted_bytes()), self._epoch, self._ops)
        self.allocations += 1
        self._note_peak()
        return arena

    def drop(self) -> bool:
        """Let the arena go if no range of it is in use (False if one is): the allocator may reuse
        its memory once everything pending on it has completed."""
        arena = self.arena
        if arena is None:
            return True
        if arena.live:
            return False
        ops = self._ops
        for token, last in arena.pending():
            ops.before_free(token, last)
        self.arena = None
        del arena
        ops.release_cached()
        return True

    def clear(self) -> None:
        self.drop()

    def recount(self, live) -> None:
        """``live``: the slots in use now, all of them (``pager/safety.py``, after an exception cut a
        step short, once every copy and op has completed). The arena is rebuilt around them; a slot
        a cut-short step took and never recorded is free again."""
        arena = self.arena
        if arena is not None:
            arena.rebuild([s for s in live if s.start is not None and s.epoch == arena.epoch])
        self.overflow_bytes = sum(slot.nbytes for slot in live if slot.start is None)
        self._note_peak()

    def tokens(self):
        """What the arena's free ranges still wait for, as tokens (a dying pager settles them)."""
        if self.arena is None:
            return []
        return [self._ops.reuse_token(token, last, None) for token, last in self.arena.pending()]
