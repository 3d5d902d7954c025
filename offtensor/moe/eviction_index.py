"""What the expert eviction keeps between victim searches (``eviction.ExpertEviction``): each
layer's predicted chances at its next turn (``NextTurn``), each layer's and stack's best victim
candidate until something it depends on changes (``KeptBest``), and per stack a heap of use
records, the coldest first (``ColdHeaps``). Each is updated at the event that changes it, so a
search looks at a few candidates per stack rather than at every cached copy.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from .. import _ext

if TYPE_CHECKING:
    from .stack import Stack

# A layer with a predicted next turn keeps this many times its top-k of its likeliest experts out
# of the frequency index: they are ranked one by one (few), the rest by frequency off the heap.
LIKELY_PER_TOP_K = 2
# The native extension's pick of a layer's likeliest experts (csrc/guesses.cpp: the sort below in one
# call, at every MoE layer of every decode step), where it is built.
_NATIVE_LIKELIEST = _ext.native_function("likeliest")


class NextTurn:
    """Per stack group, each expert's chance of use at the layer's next turn, as predicted when the
    layer last routed (``predict``), and its likeliest few (``likely``). A layer without one (none
    installed, or a prefill since) is estimated by use frequency and reuse instead. A change marks
    the layer's kept victim candidate stale (``KeptBest``), which was ranked by the chances before."""

    __slots__ = ("_chances", "_likely", "_kept")

    def __init__(self, kept: KeptBest):
        self._chances: dict = {}  # group -> [chance per expert]
        self._likely: dict = {}  # group -> frozenset of its likeliest experts
        self._kept = kept

    def predict(self, stacks: list, chances: list, top_k) -> None:
        if stacks:
            group = stacks[0].group
            self._chances[group] = chances
            count = min(len(chances), LIKELY_PER_TOP_K * (top_k or 1))
            native = _NATIVE_LIKELIEST is not None and type(chances) is list
            likely = _NATIVE_LIKELIEST(chances, count) if native else None  # (None: NaN chances, below)
            self._likely[group] = likely if likely is not None else \
                frozenset(sorted(range(len(chances)), key=chances.__getitem__)[-count:])
            self._kept.changed(group)

    def forget(self, stacks: list) -> None:
        if stacks and self._chances.pop(stacks[0].group, None) is not None:
            self._likely.pop(stacks[0].group, None)
            self._kept.changed(stacks[0].group)

    def clear(self) -> None:
        self._chances, self._likely = {}, {}
        self._kept.renew()

    def tables(self):
        """(group -> its chances, group -> its likeliest experts), as kept (the native victim search
        reads them)."""
        return self._chances, self._likely

    def of(self, group):
        """The chances of ``group``'s experts, or None."""
        return self._chances.get(group)

    def likely(self, group):
        return self._likely.get(group)


class KeptBest:
    """Each layer's best victim candidate (``ExpertEviction._best_of``: its expected wait, the
    tie-break and the copy) kept from one victim search to the next until something it depends on
    changes, which marks it stale at the change (``changed``): the copies, uses (but of the keys
    the current op pages, which its ranking keeps) or turn of one of the layer's stacks, the
    experts a guess keeps for it, the chances it ranks by; or every layer's (``renew``: a new
    step, decayed frequencies, a new cycle length). A search then ranks the few
    stale layers anew and compares one figure per layer in a tight loop, with no per-layer check of
    what the figure depends on. The current layer, whose op's own experts are kept, is ranked with
    them (``current``: what it was ranked with, checked by identity at each search). The copy a
    search picks is checked still cached and evictable (a copy dropped without an eviction: the layer
    is ranked anew). The same victims as a search from scratch: a kept best that is no longer
    evictable only overstates its layer (the layer's others rank no higher), so it matters only if
    picked."""

    __slots__ = ("groups", "stacks", "best", "stale", "count", "current", "_index", "of_stack", "dirty")

    def __init__(self):
        self.groups: list = []  # stack groups, in registration order
        self.stacks: list = []  # per group: its stacks
        self.best: list = []  # per group: its best (expected wait less its distance, tie-break, copy) or None
        self.stale: list = []  # per group: True where its best must be found anew
        self.count = None  # the cycle's length the bests were ranked for
        self.current = None  # (group, its op's keys, chances): what the current layer was ranked with
        self._index: dict = {}  # group -> its place in groups
        # Per stack its own best, kept likewise: a copy, use or eviction of one stack's expert
        # changes only that stack's candidates (``changed_stack``), so its layer's other stacks
        # are not ranked again (an eviction takes one stack's copy: of w1, w3, w2, one is re-ranked).
        self.of_stack: dict = {}  # stack -> its best or None
        self.dirty: set = set()  # stacks whose best must be found anew

    def track(self, groups: dict) -> None:
        """The stack groups (group -> its stacks) are these now: every best is found anew."""
        self.groups, self.stacks = list(groups), list(groups.values())
        self._index = {group: i for i, group in enumerate(self.groups)}
        self.best = [None] * len(self.groups)
        self.of_stack = {}
        self.renew()

    def changed(self, group) -> None:
        i = self._index.get(group)
        if i is not None:
            self.stale[i] = True
            self.dirty.update(self.stacks[i])

    def changed_stack(self, stack) -> None:
        i = self._index.get(stack.group)
        if i is not None:
            self.stale[i] = True
            self.dirty.add(stack)

    def renew(self) -> None:
        self.stale = [True] * len(self.groups)
        self.dirty = {stack for stacks in self.stacks for stack in stacks}
        self.current = None


class ColdHeaps:
    """Per stack a heap of (frequency / scale, tick, expert) records, pushed at every use and copy
    of an expert, the coldest first: a stack's least used evictable copy in a look or two. A record
    whose tick is not its key's last one is stale and dropped when it surfaces. Frequencies decay
    alike every step, so dividing by the common decay (``scale``) keeps older records comparable
    with newer ones. A record names its expert by index (its key is the stack's), and carries a
    key of its own only for a copy of part of an expert: records of plain numbers, which Python's
    cyclic garbage collector stops tracking (thousands are alive at a time, one more per use)."""

    __slots__ = ("_heaps", "scale")

    def __init__(self):
        self._heaps: dict = {}  # master id -> heap of records
        self.scale = 1.0

    def push(self, stack: "Stack", key, expert: int, frequency: float, tick: int, last: dict) -> None:
        heap = self._heaps.get(stack.master_id)
        if heap is None:
            heap = self._heaps[stack.master_id] = []
        value, keys = frequency / self.scale, stack.keys
        whole = 0 <= expert < len(keys) and keys[expert] == key
        heapq.heappush(heap, (value, tick, expert) if whole else (value, tick, expert, key))
        if len(heap) > 4 * stack.num_experts + 64:
            # Mostly stale records (every use pushes one): keep the live ones.
            heap[:] = [r for r in heap if last.get(keys[r[2]] if len(r) == 3 else r[3]) == r[1]]
            heapq.heapify(heap)

    def decay(self, factor: float, frequency: dict, by_master: dict) -> None:
        self.scale *= factor
        if self.scale < 1e-100:
            # Records are frequency / scale: rebase them before they overflow.
            self.scale = 1.0
            for master_id, heap in self._heaps.items():
                keys = by_master[master_id].keys
                heap[:] = [(frequency.get(keys[r[2]] if len(r) == 3 else r[3], 0.0),) + r[1:] for r in heap]
                heapq.heapify(heap)

    @property
    def heaps(self) -> dict:
        """master id -> its heap of records, as kept (the native victim search reads them)."""
        return self._heaps

    def heap_of(self, stack: "Stack"):
        """``stack``'s heap of records, or None."""
        return self._heaps.get(stack.master_id)

    def coldest(self, stack: "Stack", cache, last: dict, needed, recent):
        """The stack's least used cached copy that is evictable (no users, not an unused prefetch),
        not among ``needed`` (keys, or None) nor ``recent`` (experts), or None."""
        heap = self._heaps.get(stack.master_id)
        if not heap:
            return None
        keys = stack.keys
        aside, found = [], None
        while heap:
            record = heap[0]
            key = keys[record[2]] if len(record) == 3 else record[3]
            entry = cache.get(key)
            if entry is None or last.get(key) != record[1]:
                heapq.heappop(heap)  # stale: evicted, or used or copied again since
                continue
            heapq.heappop(heap)
            aside.append(record)
            if not (entry.users or entry.prefetched or (needed is not None and key in needed) or record[2] in recent):
                found = entry
                break
        for record in aside:
            heapq.heappush(heap, record)
        return found
