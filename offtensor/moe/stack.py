"""One offloaded stack of routed experts (``Stack``: its master, expert size and counters) and the
layer order of a pass (``LayerOrder``): the records that ``ExpertStacks`` and its parts (eviction,
issuer, speculation) share."""

from __future__ import annotations

import weakref

import torch

from ..pager import cache_key


class Stack:
    """One offloaded stacked-expert tensor: experts along dim 0."""

    __slots__ = ("name", "group", "master_ref", "master_id", "dtype", "base", "expert_bytes", "num_experts",
                 "hits", "misses", "bytes_h2d", "prefetched_bytes", "evictions", "used", "last_used", "keys", "experts")

    def __init__(self, name: str, t: torch.Tensor):
        host = t._host
        self.name = name
        # The stacks of one MoE layer (w1/w3/w2, gate_up/down) share their module: one group,
        # paged interleaved, expert by expert.
        self.group = name.rpartition(".")[0]
        self.master_ref = weakref.ref(t._master)
        self.master_id = t._master.id
        self.dtype = host.dtype
        self.base = host.storage_offset()
        self.expert_bytes = host.stride(0) * host.element_size()
        self.num_experts = host.shape[0]
        self.hits = self.misses = self.bytes_h2d = self.prefetched_bytes = self.evictions = 0
        self.used = set()  # experts paged in the current step
        self.last_used = set()  # experts paged in the step before
        # Every expert's cache key, made once: eviction and speculation look keys up by the
        # hundred per decode step (a key built per call was most of a victim search's time).
        step = self.expert_bytes // self.dtype.itemsize
        self.keys = tuple(cache_key(self.master_id, self.dtype, self.base + e * step, self.base + (e + 1) * step)
                          for e in range(self.num_experts))
        self.experts = {key: e for e, key in enumerate(self.keys)}

    def expert_of(self, key) -> int:
        expert = self.experts.get(key)
        return expert if expert is not None else (key[2] - self.base) * key[1].itemsize // self.expert_bytes

    def key_of(self, expert: int):
        return self.keys[expert]

    def report(self) -> dict:
        looked_up = self.hits + self.misses
        return {
            "hits": self.hits, "misses": self.misses, "hit_rate": self.hits / looked_up if looked_up else None,
            "bytes_h2d": self.bytes_h2d, "prefetched_bytes": self.prefetched_bytes, "evictions": self.evictions,
        }




class LayerOrder:
    """Where a pass is: the stack group paged now and what its op said it pages, the groups in
    first-access order this pass, and each group's place in the last pass's cyclic order."""

    __slots__ = ("position", "order", "ran", "current", "needed")

    def __init__(self):
        self.position: dict = {}  # stack group -> its place in the last pass's access order
        self.order: list = []  # stack groups in first-access order, this pass
        self.ran: set = set()  # the same groups, looked up per candidate by eviction
        self.current = None  # the stack group paged last
        self.needed = None  # keys the current op said it pages (announce), None if it did not say

    def enter(self, group) -> None:
        self.current = group
        if group not in self.ran:
            self.ran.add(group)
            self.order.append(group)

    def cycle(self):
        """(group -> place in the cyclic layer order, the cycle's length, the current layer's place)."""
        position = self.position
        here = position.get(self.current)
        if here is not None:
            return position, len(position), here
        if position and not self.order:
            # A pass that has paged no layer yet (a copy ahead of its first layer, guessed from its
            # tokens): the last pass's cycle, its last layer the one that ran last.
            return position, len(position), len(position) - 1
        # The first pass (or a layer new to it): no cycle learned yet. Layers seen in this pass
        # are placed in their order, the current one last, unseen ones just ahead.
        ran = self.order
        count = max(len(ran), 1)
        position = {group: i for i, group in enumerate(ran)}
        return position, count, position.get(self.current, count - 1)

    def step(self) -> None:
        """A pass ended: its order is the cycle the next one is placed in."""
        if self.order:
            self.position = {m: i for i, m in enumerate(self.order)}
        self.order, self.ran, self.current, self.needed = [], set(), None, None
