"""Access-order recording and the prefetch schedule.

A model pages its offloaded weights in the same order every step. The prefetcher records that
order during one pass and, from then on, whenever an entry is paged it asks the pager to start
copying the next ``depth`` entries of the recorded order, so the copies run while the device
computes. Only entries seen in two consecutive passes are prefetched: routed experts change from
step to step, and copying an expert the router will not pick wastes exactly the bandwidth that
MoE offloading saves.
"""

from __future__ import annotations

import weakref


class Prefetcher:
    def __init__(self, depth: int = 2):
        self.depth = depth
        self._order = []  # keys of the last complete pass, in access order
        self._index = {}  # key -> position in _order
        self._stable = set()  # keys seen in the last two passes
        self._recording = []
        self._recorded = set()
        self._masters = {}  # master id -> weakref to the master

    def accessed(self, pager, master, key) -> None:
        self._record(master, key)
        position = self._index.get(key)
        if position is None:
            return
        order = self._order
        for step in range(1, self.depth + 1):
            nxt = order[(position + step) % len(order)]
            if nxt not in self._stable:
                continue
            ref = self._masters.get(nxt[0])
            target = ref() if ref is not None else None
            if target is None or target.flat is None:
                continue
            if not pager.prefetch(target, *nxt[1:]):
                break

    def _record(self, master, key) -> None:
        recording = self._recording
        if recording and key == recording[0]:
            # The first weight of the pass is paged again: one pass is complete.
            self._stable = self._recorded & set(self._order)
            self._order = recording
            self._index = {k: i for i, k in enumerate(recording)}
            self._recording = recording = []
            self._recorded = set()
            live = {k[0] for k in self._order}
            self._masters = {i: r for i, r in self._masters.items() if i in live}
        if key not in self._recorded:
            recording.append(key)
            self._recorded.add(key)
            if master.id not in self._masters:
                self._masters[master.id] = weakref.ref(master)
