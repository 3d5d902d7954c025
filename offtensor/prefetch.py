"""Access-order recording and the prefetch schedule.

A model pages its offloaded weights in the same order every step. The prefetcher records that
order during one pass and, from then on, whenever an entry is paged it asks the pager to start
copying the next entries of the recorded order, so the copies run while the device computes. How
far ahead is a number of bytes, not of entries: as many as the budget holds beside the resident
weights and the copy in use (the pager refuses a prefetch that would evict a copy still to be used,
which stops the walk). The order is a cycle, so the tail of one step prefetches the head of the
next. A pass is one forward of the wrapped model (wrap_model calls ``step()`` from a forward
pre-hook); without those marks a pass ends when its first entry is paged again, which is wrong
when that entry is a routed expert: a "pass" then spans several steps and every expert looks
used in every pass (on benchmarks/wrap_overhead.py's MoE at 40% this wasted more than half of the
prefetches and raised host->device bytes per token by ~75%).

Only entries used in (nearly) every recent pass are prefetched: routed experts change from step
to step, and copying an expert the router will not pick wastes exactly the bandwidth that MoE
offloading saves. Each entry's use is a moving average over passes: dense weights sit at 1, an
expert drops below the bar after one pass without it, a hot expert stays above it.
"""

from __future__ import annotations

import weakref
from typing import Optional

# Per pass, an entry's use frequency moves this far towards 1 (used) or 0 (not used).
FREQUENCY_STEP = 0.5
# Prefetched from this frequency on: three passes in a row from first sight, or one miss after
# long use (1 -> 0.5) until it is used twice again.
STABLE_FREQUENCY = 0.85
FORGET_FREQUENCY = 0.05  # below this an entry is forgotten, so the table holds recent entries only
# The walk ahead visits at most this many prefetchable entries: when the budget holds every offloaded
# weight the byte bound never stops it, and a walk over the whole order on every page would cost
# O(entries^2) per step (thousands of expert slices in an MoE).
MAX_WALK = 256


class Prefetcher:
    def __init__(self, max_entries: Optional[int] = None):
        self.max_entries = max_entries  # an optional cap on entries ahead; bytes are the bound
        self._order = []  # keys of the last complete pass, in access order
        self._index = {}  # key -> position in _order
        self._stable_order = []  # the stable keys of _order, in order: what the walk visits
        self._next_stable = []  # position in _order -> index in _stable_order of the first stable key after it
        self._stable = set()  # keys used often enough in recent passes to prefetch
        self._frequency = {}  # key -> moving average of "used in this pass"
        self._recording = []
        self._recorded = set()
        self._masters = {}  # master id -> weakref to the master
        self._marked = False  # passes are delimited by step() calls

    def accessed(self, pager, master, key) -> None:
        """``pager`` paged ``key`` (a ``pager.CacheKey``) of ``master`` for an op: record it and copy
        the next entries of the recorded order ahead."""
        if pager.experts is not None and pager.experts.is_stack(key.master_id):
            # Routed experts are the expert cache's and the routing guess's (offtensor/moe): a hot
            # expert stays cached there, and one copied ahead from history alone is often wasted.
            return
        self._record(master, key)
        position = self._index.get(key)
        if position is None:
            return
        ahead_keys = self._stable_order
        budget = pager.budget_bytes
        if budget is None or not ahead_keys:
            return
        # Bytes in flight the budget can hold: what resident weights and this op's copy leave.
        room = budget - pager.budget.resident_bytes - key.nbytes
        ahead = 0
        start = self._next_stable[position]
        limit = min(len(ahead_keys), MAX_WALK if self.max_entries is None else self.max_entries)
        for step in range(limit):
            nxt = ahead_keys[(start + step) % len(ahead_keys)]
            if nxt == key:
                break  # round the whole cycle
            ahead += nxt.nbytes
            if ahead > room:
                break
            ref = self._masters.get(nxt.master_id)
            target = ref() if ref is not None else None
            if target is None or target.flat is None:
                continue
            if not pager.prefetch(target, *nxt[1:], key=nxt):
                break

    def step(self) -> None:
        """A step (a forward of the wrapped model) begins: what was paged since the last one is a pass.

        Without these marks the first entry of a pass paged again ends it, which misplaces the
        boundary when that entry is a routed expert: a "pass" then spans several steps and
        every expert looks used in every pass."""
        self._marked = True
        if self._recording:
            self._complete_pass()

    def _complete_pass(self) -> None:
        self._stable = self._pass_done(self._recorded)
        self._order = self._recording
        self._index = {k: i for i, k in enumerate(self._order)}
        self._stable_order = [k for k in self._order if k in self._stable]
        count, self._next_stable = 0, []
        for k in self._order:
            count += k in self._stable
            self._next_stable.append(count)
        self._recording = []
        self._recorded = set()
        live = {k.master_id for k in self._order}
        self._masters = {i: r for i, r in self._masters.items() if i in live}

    def _record(self, master, key) -> None:
        if not self._marked and self._recording and key == self._recording[0]:
            self._complete_pass()  # the first weight of the pass is paged again
        recording = self._recording
        if key not in self._recorded:
            recording.append(key)
            self._recorded.add(key)
            if master.id not in self._masters:
                self._masters[master.id] = weakref.ref(master)

    def _pass_done(self, used: set) -> set:
        """Update every tracked entry's use frequency with one pass; the entries now stable."""
        frequency = self._frequency
        for key in used:
            frequency.setdefault(key, 0.0)
        stable = set()
        for key, value in list(frequency.items()):
            value = (1 - FREQUENCY_STEP) * value + (FREQUENCY_STEP if key in used else 0.0)
            if value < FORGET_FREQUENCY:
                del frequency[key]
                continue
            frequency[key] = value
            if value >= STABLE_FREQUENCY:
                stable.add(key)
        return stable
