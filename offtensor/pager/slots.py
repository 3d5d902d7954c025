"""The device buffers paged copies live in: a pool of slots reused by byte size."""

from __future__ import annotations

import collections

import torch


class Slot:
    """One device buffer of the slot pool: ``nbytes`` bytes, reused for any copy of that size.

    ``free_after`` is the completion token (a ``torch.cuda.Event``, or a copy-engine ticket on the
    emulated device) after which nothing reads or writes the buffer's current contents any more;
    whoever takes the slot next orders itself after it."""

    __slots__ = ("buf", "nbytes", "free_after", "last_stream")

    def __init__(self, buf: torch.Tensor, nbytes: int):
        self.buf = buf
        self.nbytes = nbytes
        self.free_after = None
        self.last_stream = None  # GPU: the compute stream of its last (transient) use, when free_after is None


class SlotPool:
    """Every paged copy of a budgeted pager lives in a slot of this pool, reused by byte size.

    Why a pool rather than fresh ``torch.empty`` per copy:
    - on a GPU, the caching allocator keeps one pool of blocks per stream, so blocks freed after a
      copy-stream allocation cannot serve the compute stream (and the reverse): reserved memory
      grows past the budget. Here every slot is allocated on the copy stream once and reused in
      an order the pager's own events enforce, so the pool's bytes are what is reserved for paging;
    - stable addresses per size (the door to CUDA graphs) and no first-touch of fresh pages on the
      emulated device.
    The pool holds at most ``cap`` (budget minus resident) bytes of slots, in use or idle, unless
    the slots in use alone need more (they never do: the budget bounds them). Idle slots of other
    sizes are freed, least recently used first, to make room for a new size; exact sizes keep
    the bound exact, at the price of reallocating when sizes alternate under a tight budget.

    Stated slack of real (reserved) memory over the budget on a GPU: the caching allocator's
    rounding of each slot (to 2 MiB for large blocks, so at most 2 MiB per slot) plus what ops
    allocate themselves (activations, gathered-row results), which the budget never counted.
    ``test_reserved_memory_stays_within_the_budget_plus_slack`` checks budget + 64 MiB on a GPU.
    """

    __slots__ = ("_ops", "_idle", "live_bytes", "idle_bytes", "peak_bytes", "allocations")

    def __init__(self, ops):
        self._ops = ops
        # nbytes -> idle slots of that size; the dict's order is least recently given back first
        self._idle: "collections.OrderedDict[int, list[Slot]]" = collections.OrderedDict()
        self.live_bytes = 0
        self.idle_bytes = 0
        self.peak_bytes = 0
        self.allocations = 0  # slots ever allocated: page_ins minus this is how often a slot was reused

    def take(self, nbytes: int, cap: int, stream=None) -> Slot:
        """A slot of ``nbytes``, the pool holding at most ``cap`` bytes; its previous contents are
        dead for work enqueued on ``stream`` (the stream that will write it) or, emulated, now."""
        idle = self._idle.get(nbytes)
        if idle:
            slot = idle.pop()
            if not idle:
                del self._idle[nbytes]
            self.idle_bytes -= nbytes
            self._ops.order_after(self._ops.slot_token(slot, stream), stream)
            if self._ops.strict:
                slot.buf.fill_(0xFF)
        else:
            self._trim(cap - self.live_bytes - nbytes)
            slot = Slot(self._ops.allocate(nbytes), nbytes)
            self.allocations += 1
        self.live_bytes += nbytes
        total = self.live_bytes + self.idle_bytes
        if total > self.peak_bytes:
            self.peak_bytes = total
        return slot

    def give(self, slot: Slot, free_after, cap: int, last_stream=None) -> None:
        """``slot`` is no longer used once ``free_after`` has completed, or (GPU, ``free_after``
        None) once the work enqueued so far on ``last_stream`` has."""
        self.live_bytes -= slot.nbytes
        slot.free_after = free_after
        slot.last_stream = last_stream if free_after is None else None
        if self._ops.strict and self._ops.done(free_after):
            # A reader that outlives its release (an op result aliasing a paged copy) now sees
            # NaN / -1 instead of plausible stale weights. Never waited for here: the wait would
            # hide the very races strict mode is for; a slot still being copied into is poisoned
            # when it is taken again.
            slot.free_after = None
            slot.buf.fill_(0xFF)
        self._idle.setdefault(slot.nbytes, []).append(slot)
        self._idle.move_to_end(slot.nbytes)
        self.idle_bytes += slot.nbytes
        self._trim(cap - self.live_bytes)

    def _trim(self, room: int) -> None:
        """Free idle slots, least recently given back first, until idle bytes fit ``room``."""
        while self.idle_bytes > max(room, 0) and self._idle:
            nbytes, slots = next(iter(self._idle.items()))
            slot = slots.pop(0)
            if not slots:
                del self._idle[nbytes]
            self.idle_bytes -= nbytes
            self._ops.before_free(slot)

    def clear(self) -> None:
        self._trim(0)

    def recount(self, live) -> None:
        """``live``: the slots in use now, all of them (``pager/safety.py``, after an exception cut a
        step short). The counts are recomputed from them and the idle lists, which lose empty lists,
        repeated slots and slots in use."""
        seen = {id(slot) for slot in live}
        idle = collections.OrderedDict()
        for nbytes, slots in self._idle.items():
            for slot in slots:
                if id(slot) not in seen:
                    seen.add(id(slot))
                    idle.setdefault(nbytes, []).append(slot)
        self._idle = idle
        self.live_bytes = sum(slot.nbytes for slot in live)
        self.idle_bytes = sum(slot.nbytes for slots in idle.values() for slot in slots)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes + self.idle_bytes)

    def tokens(self):
        return [self._ops.slot_token(s, None) for slots in self._idle.values() for s in slots]
