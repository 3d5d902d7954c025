"""Routed experts: which offloaded tensors are stacks of experts, how their cached copies are used,
and the guess of the next MoE layer's experts.

The pager already caches every paged byte range by (master, dtype, lo, hi); a routed expert is one
such range of a stacked-expert tensor (``experts.w1[e]``, ``gate_up_proj[e:e+1]``). This module adds
what that cache does not know about experts, as two small objects the pager composes:

- ``ExpertStacks``: the offloaded stacks by master, grouped by layer; per-stack counters (hits,
  misses, bytes copied, evictions); a decayed use frequency per cached expert (weighted by the
  expert's share of the layer's tokens where the op knows it); the layer order of the last pass.
  The pager's eviction asks it for a victim (``victim``), approximating Belady's furthest next use
  in the cyclic layer order: experts of layers that already ran in this step first (their next
  use is a step away), each such layer keeping what it routed (up to its fair share) so that it
  can swap in place at its next turn; then experts of layers still to run; coldest first within
  each, so hot experts stay. An op that knows its experts (``_grouped_mm``, the index ops)
  ``announce``s them: the layer's missing experts are issued at once, into room that no later
  layer of the step needs, and its unrouted ones become evictable;
- ``RoutingSpeculator``: forward hooks on the routers. The top-k of a router's output tells the
  cache which experts its layer will page (``expect``, for models that select experts one by one).
  Before layer i's router runs, layer i+1's router weight is applied to its input (the residual
  stream changes little from one layer to the next, which MoE-Infinity and Pre-gated MoE exploit):
  a guess of layer i+1's experts, always scored against what layer i+1 pages, and copied (its two
  most confident experts, behind layer i's own copies) only for a router whose recent guesses were
  at least 90% right. Which modules are routers and which stacks each one selects is learned from
  the access order of a pass (the stacks paged after a router fires, before the next one); before
  the first pass, from names (``<prefix>.gate`` selects ``<prefix>.experts.*``).

On a GPU nothing here adds a host sync: router outputs and guesses come back through pinned
buffers and events, and are used once the event has completed.

Nothing here reads model code: routers are found by their weight (``[num_experts, hidden]``, the
leading size of a registered stack) and their names (``gate``/``router``).
"""

from __future__ import annotations

import contextlib
import heapq
import weakref
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .pager import cache_key

# Per step an expert's use count decays by this factor: a frequency over roughly the last
# 1 / (1 - DECAY) steps, so an expert hot a hundred tokens ago does not stay pinned forever.
FREQUENCY_DECAY = 0.5
# How many evictable copies eviction compares, least recently used first (bounds its cost in a
# cache of thousands of experts; a copy it passes over is evicted later).
VICTIM_WINDOW = 512
# Probability of use given to an expert with no recorded use, so the cyclic distance still orders them.
UNSEEN_USE = 0.05
# Speculative copies are issued only for a router whose guesses were right at least this often
# (an exponential average over its layers' guesses). In a decode step the copy engine is the
# bottleneck (the bound is uncached routed bytes / H2D), so a wrong guess costs its full copy
# time; at 0.9 the wasted bytes stay under ~11% of the useful ones. Guesses are still made and
# scored below the bar, so a router whose guesses get better is speculated on again.
SPECULATE_PRECISION = 0.9
# The precision is correct / guessed over the router's recent guesses: both counts decay by this
# factor per scored guess, and at least SPECULATE_EVIDENCE guessed experts must stand behind it
# (a top-2 guess scores 0, 0.5 or 1: a few lucky layers prove nothing).
PRECISION_DECAY = 0.95
SPECULATE_EVIDENCE = 12.0
# How many guessed experts are copied ahead, the most confident first. The copy stream is idle only
# between a layer's last expert copy and the next layer's routing read (its attention and router:
# ~0.3 ms on the DeepSeek-style stack under the H200 profile, less than one 25 MB expert's 0.45 ms
# copy), so a couple of guesses fill that gap; more are copied at the price of every wrong one
# (the replay in benchmarks/moe_bench.py: all 8 at 80% accuracy is slower than none).
SPECULATE_EXPERTS = 2
ROUTER_NAMES = ("gate", "router")
# Victim score of a copy eviction must not take while anything else can go.
_KEEP = (4, 0.0)


def _distance(where, here: int, count: int) -> float:
    """Layers from the current one (at ``here``) to the layer at ``where`` in a cycle of ``count``:
    a whole cycle for the current layer itself, half a layer for one not yet placed."""
    return (where - here) % count or count if where is not None else 0.5


def _rank(record) -> tuple:
    return record[0], record[1]


class _Stack:
    """One offloaded stacked-expert tensor: experts along dim 0."""

    __slots__ = ("name", "group", "master_ref", "master_id", "dtype", "base", "expert_bytes", "num_experts",
                 "hits", "misses", "bytes_h2d", "prefetched_bytes", "evictions", "used")

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

    def expert_of(self, key) -> int:
        return (key.lo - self.base) * key.dtype.itemsize // self.expert_bytes

    def key_of(self, expert: int):
        step = self.expert_bytes // self.dtype.itemsize
        lo = self.base + expert * step
        return cache_key(self.master_id, self.dtype, lo, lo + step)

    def report(self) -> dict:
        looked_up = self.hits + self.misses
        return {
            "hits": self.hits, "misses": self.misses, "hit_rate": self.hits / looked_up if looked_up else None,
            "bytes_h2d": self.bytes_h2d, "prefetched_bytes": self.prefetched_bytes, "evictions": self.evictions,
        }


class ExpertStacks:
    """The pager's view of routed experts: stacks by master, counters, use frequency, eviction choice."""

    __slots__ = ("by_master", "frequency", "speculator", "position", "_order", "_current", "_needed",
                 "_issued_for_op", "_announcing", "_spare_room_only", "_announced", "_expected", "_shares",
                 "_stack_bytes", "_clock", "_last", "_coldest", "_scale", "_ranked", "_ranked_sig",
                 "_ranked_masters", "_dirty", "__weakref__")

    def __init__(self):
        self.by_master: dict = {}  # master id -> _Stack
        self.frequency: dict = {}  # cache key -> decayed use count (experts only)
        self.speculator: Optional[RoutingSpeculator] = None
        self.position: dict = {}  # stack group -> its place in the last pass's access order
        self._order: list = []  # stack groups in first-access order, this pass
        self._current = None  # the stack group paged last
        self._needed = None  # keys the current op said it pages (announce), None if it did not say
        # keys announce copied ahead of their op: misses, though found on the device
        self._issued_for_op = set()
        self._announcing = False  # announce is issuing its layer's copies: no prefetched bytes
        # Copying ahead of use (announce, guesses): such a copy may only take room that no op of
        # this step will miss, tier 0 (ExpertStacks.victim).
        self._spare_room_only = False
        self._stack_bytes = 0  # bytes of every registered stack, for each one's fair share of the cache
        self._announced = None  # the key set the last announce issued
        self._shares = {}  # expert -> its share of the current layer's tokens (announce), most routed = 1
        # group -> keys its router's output says the layer will page (RoutingSpeculator.router_output),
        # for models that select experts one by one and so announce nothing
        self._expected = {}
        # Eviction's index (see victim): every cached copy's last use, as a tick of this clock
        # (the pager's LRU order), and per stack a heap of (frequency / _scale, tick, key) records
        # pushed at every use and copy, the coldest first. A record whose tick is not its key's
        # last one is stale and dropped when it surfaces. Frequencies decay alike every step, so
        # dividing by the common decay (_scale) keeps older records comparable with newer ones.
        self._clock = 0
        self._last: dict = {}  # cache key -> tick of its last use or copy
        self._coldest: dict = {}  # master id -> heap of records
        self._scale = 1.0
        # victim's ranking of the stacks, reused while the layer, its announced experts, the cycle
        # and the set of stacks with copies stay the same; stacks that gained or lost a copy since
        # (_dirty) have their tier recomputed.
        self._ranked: list = []
        self._ranked_sig = None
        self._ranked_masters: set = set()
        self._dirty: set = set()

    def register(self, name: str, t: torch.Tensor) -> None:
        # Experts are whole contiguous slices along dim 0, so an expert's cache key is computable
        # from its index; a stack viewed with other strides is left to the plain cache.
        if t.dim() >= 2 and t.shape[0] > 1 and t._host.is_contiguous():
            stack = self.by_master[t._master.id] = _Stack(name, t)
            self._stack_bytes += stack.expert_bytes * stack.num_experts

    def is_stack(self, master_id: int) -> bool:
        return master_id in self.by_master

    # -------------------------------------------------------------- the pager's call sites

    def accessed(self, key, hit: bool) -> None:
        """An op paged ``key`` (of a stack, or a dense weight's copy): a cache hit or a copy it waited for."""
        self._clock += 1
        self._last[key] = self._clock
        stack = self.by_master.get(key[0])
        if stack is None:
            return
        if key in self._issued_for_op:
            self._issued_for_op.discard(key)
            hit = False  # copied for this op by announce: a miss the op did not wait for in line
        if hit:
            stack.hits += 1
        else:
            stack.misses += 1
        expert = stack.expert_of(key)
        share = self._shares.get(expert, 1.0) if stack.group == self._current else 1.0
        self.frequency[key] = self.frequency.get(key, 0.0) + share
        self._push(key)
        stack.used.add(expert)
        if self.speculator is not None:
            self.speculator.used(stack, expert)

    def announce(self, pager, master_id: int, experts, tokens=None) -> None:
        """The op about to run pages these experts of ``master_id``'s layer (every stack of it),
        ``tokens[i]`` tokens routed to ``experts[i]`` where the op knows the counts.

        A use counts towards an expert's frequency in proportion to its tokens (the most routed
        expert of the op counts 1): after a prefill, which routes its tokens to most experts of a
        layer, the experts that took many tokens are the likelier picks of the next token, and
        the frequency should say so rather than rank them all alike.

        Eviction may then take the layer's other experts, whose next use is a step away. The
        layer's missing experts are all issued now, every stack of the layer, before the op pages
        them one at a time: the copy stream gets the whole layer at once, and the guess for the
        next layer (issued right after) queues behind them instead of ahead of them."""
        stack = self.by_master.get(master_id)
        if stack is None:
            return
        self.paging(master_id, issue_guesses=False)  # guesses go behind this layer's copies, below
        group = [s for s in self.by_master.values() if s.group == stack.group]
        experts = [int(e) for e in experts]
        if tokens is not None and len(tokens) == len(experts) and max(tokens, default=0) > 0:
            most = max(tokens)
            self._shares = {e: n / most for e, n in zip(experts, tokens)}
        else:
            self._shares = {}
        needed = {s.key_of(e) for s in group for e in experts}
        if needed == self._announced:
            return  # the layer's second stack (down after gate_up): already issued
        self._needed = self._announced = needed
        self._announcing = self._spare_room_only = True
        try:
            for s in group:
                master = s.master_ref()
                if master is None or master.flat is None:
                    continue
                for e in experts:
                    key = s.key_of(e)
                    if pager.is_cached(key):
                        continue
                    if not pager.prefetch(master, *key[1:]):
                        break  # the budget holds no more at once: the rest is paged in line
                    self._issued_for_op.add(key)
        finally:
            self._announcing = self._spare_room_only = False
        if self.speculator is not None:
            self.speculator.issue_ready()

    def paging(self, master_id: int, issue_guesses: bool = True) -> None:
        """An op is about to page from ``master_id``: before its lookup, so that eviction for this
        very copy knows which layer's stacks are current. Where no op of the layer announced its
        experts (a model that selects them one by one), guesses whose ids have reached the host
        are issued here."""
        stack = self.by_master.get(master_id)
        speculator = self.speculator
        if stack is not None and stack.group != self._current:
            if speculator is not None:
                speculator.expected_ready()
            self._current = stack.group
            self._shares = {}
            self._needed = self._expected.pop(stack.group, None)
            self._announced = None
            if stack.group not in self._order:
                self._order.append(stack.group)
        if issue_guesses and speculator is not None and self._announced is None:
            speculator.issue_ready()

    def expect(self, stacks: list, experts) -> None:
        """A router's output says its layer will page these experts of ``stacks``: once the layer
        starts paging, eviction may take the layer's other experts (as after ``announce``), but
        nothing is copied ahead, since the model's own routing may differ (bias, groups)."""
        if stacks:
            self._expected[stacks[0].group] = {s.key_of(int(e)) for s in stacks for e in experts}

    def copied(self, key, nbytes: int, prefetch: bool) -> None:
        self._clock += 1
        self._last[key] = self._clock
        stack = self.by_master.get(key[0])
        if stack is not None:
            stack.bytes_h2d += nbytes
            if prefetch and not self._announcing:
                stack.prefetched_bytes += nbytes
            self._push(key)
            self._dirty.add(key[0])

    def evicted(self, key) -> None:
        self._last.pop(key, None)
        stack = self.by_master.get(key[0])
        if stack is not None:
            stack.evictions += 1
            self._dirty.add(key[0])

    def _push(self, key) -> None:
        heap = self._coldest.get(key[0])
        if heap is None:
            heap = self._coldest[key[0]] = []
        heapq.heappush(heap, (self.frequency.get(key, 0.0) / self._scale, self._last[key], key))
        if len(heap) > 4 * self.by_master[key[0]].num_experts + 64:
            # Mostly stale records (every use pushes one): keep the live ones.
            last = self._last
            heap[:] = [r for r in heap if last.get(r[2]) == r[1]]
            heapq.heapify(heap)

    def victim(self, cache, room: int, candidates):
        """The evictable copy to drop: a non-expert copy if one comes first in LRU order (dense
        weights are re-paged once per step whatever happens), else the expert whose next use is
        expected furthest away (Belady's rule, with the future estimated), in three tiers.

        Layers run in a cycle, so plain LRU evicts exactly the experts of the layer that runs next
        (the least recently used) and keeps those of the layers that just ran, whose next use is a
        whole step away: a decode step would copy experts again that were cached when it began.
        Here, an expert of the layer ``d`` places ahead in the learned cyclic layer order (the
        layer being paged now: ``d = L``, a whole cycle; the layer that ran last: ``L - 1``) is
        next needed after ``d`` layers if its layer routes to it at its next turn, which it does
        with probability ``p`` (its decayed use frequency), else a cycle later, and so on: an
        expected next use ``d + L (1 - p) / p`` layers ahead, the largest evicted first within a
        tier (so cold experts go before hot ones, which stay across tokens). The tiers:

        0. experts of the current layer that its op does not page, and those a layer that already
           ran in this step holds beyond its floor: their next use is a step away;
        1. a ran layer's floor, and the current layer's experts its op has paged already. The floor
           is what the layer routed in this step, at most its fair share of the cache (``room``
           bytes, shared in proportion to the stacks' sizes): keeping it lets the layer swap its
           own unrouted experts for new picks at its next turn. The first layer of a step has no
           layer that ran before it to take from, so without floors (or after a prefill that
           filled the cache with the last layer's experts) it would take from layers still to
           run, which may be routed to them and pay them twice in one step;
        2. experts of layers still to run in this step.

        Experts the current op may still page and prefetched copies not yet used are kept while
        anything else can go. A copy made ahead of its use (``announce``'s, a guess's) takes tier-0
        room only: it returns None rather than evict anything this step may still read.

        The pager's eviction policy (``pager.cache``): ``cache`` is its read-only view of the cached
        copies, ``candidates`` the evictable ones, least recently used first."""
        # Found through indexes rather than by comparing every cached copy: each stack's coldest
        # evictable copy comes off its heap (its tier and distance are the stack's), so a call
        # costs one look per stack with cached copies, not one per copy (with thousands of experts
        # cached, a scan cost 1.6 ms per eviction). Ties go to the least recently used, as in LRU.
        copies, cached = cache.copies, cache.by_master
        plain = self._least_recent_plain(cached)
        if plain is not None:
            return plain
        position, count, here = self._cycle()
        fair = room / self._stack_bytes if self._stack_bytes else 0.0  # share of each stack's experts
        ranked = self._ranked_stacks(cached, position, count, here, fair, room)
        best, best_score = self._coldest_expert(ranked, copies, count)
        if best is None:
            # Only copies to keep are left (prefetched, or the current layer's own): the scan
            # below ranks them, or refuses for a copy made ahead of its use.
            return self._victim_scan(candidates, cached, room)
        if self._spare_room_only and best_score[0] > 0:
            return None
        return best

    def _least_recent_plain(self, cached):
        """The least recently used evictable copy that is no expert (dense weights are re-paged once
        per step whatever happens), or None."""
        by_master, last = self.by_master, self._last
        plain, plain_tick = None, None
        for master_id, entries in cached.items():
            if master_id in by_master:
                continue
            for entry in entries:
                if entry.users or entry.prefetched:
                    continue
                tick = last.get(entry.key, -1)
                if plain is None or tick < plain_tick:
                    plain, plain_tick = entry, tick
        return plain

    def _ranked_stacks(self, cached, position, count: int, here: int, fair: float, room: int) -> list:
        """(tier, -distance, master id, stack) of every stack with cached copies, the most promising
        victims first (the current layer's tier is its best case, 0). Reused while the layer, its
        announced experts, the cycle and the set of stacks with copies stay the same; stacks that
        gained or lost a copy since (``_dirty``) have their tier recomputed."""
        ran, current, needed = self._order, self._current, self._needed
        by_master = self.by_master
        sig = (current, id(needed), len(ran), id(position), count, room)
        ranked = self._ranked
        if sig != self._ranked_sig or cached.keys() != self._ranked_masters:
            ranked = []
            for master_id, entries in cached.items():
                stack = by_master.get(master_id)
                if stack is None or not entries:
                    continue
                group = stack.group
                if group == current:
                    if needed is None:
                        continue  # the op did not say what it pages: any of the layer's may be next
                    tier, distance = 0, count
                else:
                    distance = _distance(position.get(group), here, count)
                    tier = self._tier(stack, entries, ran, fair)
                ranked.append((tier, -distance, master_id, stack))
            ranked.sort(key=_rank)
            self._ranked, self._ranked_sig, self._ranked_masters = ranked, sig, set(cached)
        elif self._dirty:
            dirty = self._dirty
            changed = False
            for i, (tier, minus_distance, master_id, stack) in enumerate(ranked):
                if master_id in dirty and stack.group != current:
                    new_tier = self._tier(stack, cached[master_id], ran, fair)
                    if new_tier != tier:
                        ranked[i] = (new_tier, minus_distance, master_id, stack)
                        changed = True
            if changed:
                ranked.sort(key=_rank)
        self._dirty = set()
        return ranked

    def _coldest_expert(self, ranked: list, copies, count: int):
        """(the expert copy with the best victim score, that score) over the ``ranked`` stacks, or
        (None, None). A stack's best possible score is its coldest copy at UNSEEN_USE, so once the
        best found beats the next stack's best possible, no later stack can win."""
        current, needed, last = self._current, self._needed, self._last
        coldest = count * (1.0 - UNSEEN_USE) / UNSEEN_USE
        best, best_score = None, None
        for tier, minus_distance, _, stack in ranked:
            if best is not None and (tier, minus_distance - coldest) > best_score[:2]:
                break
            if stack.group == current:
                entry, tier = self._coldest_of(stack, copies, needed)
            else:
                entry, _ = self._coldest_of(stack, copies, None)
            if entry is None:
                continue
            use = self._use(entry.key)
            score = (tier, minus_distance - count * (1.0 - use) / use, last.get(entry.key, -1))
            if best is None or score < best_score:
                best, best_score = entry, score
        return best, best_score

    @contextlib.contextmanager
    def in_spare_room_only(self):
        """Copies issued inside (guesses) are ahead of their use: they take tier-0 room only."""
        self._spare_room_only = True
        try:
            yield
        finally:
            self._spare_room_only = False

    def _cycle(self):
        """(group -> place in the cyclic layer order, the cycle's length, the current layer's place)."""
        position = self.position
        here = position.get(self._current)
        if here is not None:
            return position, len(position), here
        # The first pass (or a layer new to it): no cycle learned yet. Layers seen in this pass
        # are placed in their order, the current one last, unseen ones just ahead.
        ran = self._order
        count = max(len(ran), 1)
        position = {group: i for i, group in enumerate(ran)}
        return position, count, position.get(self._current, count - 1)

    def _use(self, key) -> float:
        """The chance ``key``'s layer routes to it at its next turn, estimated from its decayed use."""
        return min(1.0, max(self.frequency.get(key, 0.0) * (1.0 - FREQUENCY_DECAY), UNSEEN_USE))

    @staticmethod
    def _tier(stack: _Stack, entries, ran, fair: float) -> int:
        """A stack's tier for eviction when its layer is not the current one (see victim)."""
        if stack.group not in ran:
            return 2
        floor = min(len(stack.used), int(fair * stack.num_experts))
        return 0 if len(entries) > floor else 1

    def _coldest_of(self, stack: _Stack, cache, needed):
        """(``stack``'s least used evictable copy, its tier): with ``needed`` (the current layer's),
        the coldest not needed (tier 0), else the coldest needed one its op has paged (tier 1)."""
        heap = self._coldest.get(stack.master_id)
        if not heap:
            return None, None
        last = self._last
        aside = []
        found, tier, paged = None, None, None
        while heap:
            _, tick, key = record = heap[0]
            entry = cache.get(key)
            if entry is None or last.get(key) != tick:
                heapq.heappop(heap)  # stale: evicted, or used or copied again since
                continue
            heapq.heappop(heap)
            aside.append(record)
            if entry.users or entry.prefetched:
                continue
            if needed is not None and key in needed:
                if paged is None and stack.expert_of(key) in stack.used:
                    paged = entry
                continue
            found, tier = entry, 0
            break
        for record in aside:
            heapq.heappush(heap, record)
        if found is None and paged is not None:
            found, tier = paged, 1
        return found, tier

    def _victim_scan(self, candidates, cached: dict, room: int):
        """``victim`` by comparing the evictable copies one by one, least recently used first: the
        fallback when the indexes offer nothing (copies the index has no record of, such as those
        cached before the registry was rebuilt, or only copies to keep)."""
        position, count, here = self._cycle()
        ran, current, needed = self._order, self._current, self._needed
        fair = room / self._stack_bytes if self._stack_bytes else 0.0
        best, best_score = None, None
        for seen, entry in enumerate(candidates):
            if seen >= VICTIM_WINDOW:
                break
            stack = self.by_master.get(entry.key[0])
            if stack is None:
                if not entry.prefetched:
                    return entry
                score = _KEEP
            else:
                group = stack.group
                if entry.prefetched:
                    score = _KEEP
                else:
                    if group == current:
                        distance = count
                        if needed is None:
                            tier = 3  # the op did not say what it pages: any of the layer's may be next
                        elif entry.key not in needed:
                            tier = 0
                        else:
                            tier = 1 if stack.expert_of(entry.key) in stack.used else 3
                    else:
                        distance = _distance(position.get(group), here, count)
                        tier = self._tier(stack, cached.get(entry.key[0], ()), ran, fair)
                    if tier == 3:
                        score = _KEEP
                    else:
                        use = self._use(entry.key)
                        score = (tier, -(distance + count * (1.0 - use) / use))
            if best is None or score < best_score:
                best, best_score = entry, score
        if self._spare_room_only and best is not None and best_score[0] > 0:
            return None
        return best

    def step(self) -> None:
        """A forward begins: decay use frequencies, close the last step's guesses."""
        frequency = self.frequency
        for key in list(frequency):
            value = frequency[key] * FREQUENCY_DECAY
            if value < 0.01:
                del frequency[key]
            else:
                frequency[key] = value
        self._scale *= FREQUENCY_DECAY
        if self._scale < 1e-100:
            # Records are frequency / scale: rebase them before they overflow.
            self._scale = 1.0
            for heap in self._coldest.values():
                heap[:] = [(frequency.get(k, 0.0), tick, k) for _, tick, k in heap]
                heapq.heapify(heap)
        if self.speculator is not None:
            self.speculator.step()
        for stack in self.by_master.values():
            stack.used = set()
        if self._order:
            self.position = {m: i for i, m in enumerate(self._order)}
        self._order, self._current, self._needed, self._announced = [], None, None, None
        self._issued_for_op = set()
        self._expected = {}

    def routed_keys(self) -> dict:
        """Cache key -> bytes of every expert slice paged since the step began (for the measure
        "bytes moved vs routed experts that were not cached" in tests and benchmarks)."""
        return {stack.key_of(e): stack.expert_bytes for stack in self.by_master.values() for e in stack.used}

    def reset(self) -> None:
        for stack in self.by_master.values():
            stack.hits = stack.misses = stack.bytes_h2d = stack.prefetched_bytes = stack.evictions = 0
        if self.speculator is not None:
            self.speculator.reset()

    def report(self) -> dict:
        return {s.name: s.report() for s in self.by_master.values()}


class _Router:
    __slots__ = ("name", "module_ref", "stacks", "top_k", "recent_correct", "recent_guessed", "guessed", "correct", "routed",
                 "prefetched_bytes", "wasted_bytes", "tokens", "guess", "copied", "guess_tokens")

    def __init__(self, name: str, module: nn.Module):
        self.name = name
        self.module_ref = weakref.ref(module)
        self.stacks: list = []  # _Stack objects this router selects experts of
        self.top_k = _attribute_top_k(module)
        self.recent_correct = 0.0  # decayed counts behind its running precision
        self.recent_guessed = 0.0
        self.guessed = self.correct = self.routed = self.prefetched_bytes = self.wasted_bytes = 0
        self.tokens = 0  # tokens of its last real routing
        self.guess = None  # open guess: set of experts, scored when the step ends
        self.copied = {}  # expert -> bytes the open guess copied for it
        self.guess_tokens = 0

    def speculating(self) -> bool:
        # Guesses are scored whether or not their copies were issued, so a router earns
        # speculation by its record before any byte is spent on it.
        return (self.recent_guessed >= SPECULATE_EVIDENCE
                and self.recent_correct >= SPECULATE_PRECISION * self.recent_guessed)

    def report(self) -> dict:
        return {
            "guessed": self.guessed, "correct": self.correct, "routed": self.routed,
            "accuracy": self.correct / self.guessed if self.guessed else None,
            "recall": self.correct / self.routed if self.routed else None,
            "prefetched_bytes": self.prefetched_bytes, "wasted_bytes": self.wasted_bytes,
            "speculating": self.speculating(),
        }


def _attribute_top_k(module: nn.Module) -> Optional[int]:
    for name in ("top_k", "num_experts_per_tok"):
        value = getattr(module, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


class RoutingSpeculator:
    """Guesses layer i+1's experts when layer i's router runs, and prefetches them."""

    def __init__(self, pager, stacks: ExpertStacks, routers: list):
        self._pager = weakref.ref(pager)
        self._stacks = stacks
        self.routers = routers  # _Router, in module order
        self._next = {}  # router -> the router that ran after it in the last pass
        self._order = []  # routers in firing order, this pass
        self._current = None  # the router that fired last: stacks paged now are its
        self._learned = {}  # router -> stacks paged after it this pass
        self._pending = []  # (router, device ids, host ids or None, event): guesses not yet issued
        self._expected = []  # GPU: (router, pinned ids, event) of router outputs read back without a sync
        self.hooks = []

    # -------------------------------------------------------------- hooks

    def router_ran(self, router: _Router, x: torch.Tensor) -> None:
        self._order.append(router)
        self._current = router
        self._learned.setdefault(router, [])
        router.tokens = x.numel() // max(x.shape[-1], 1)
        nxt = self._next.get(router)
        if nxt is None or not nxt.stacks or nxt.top_k is None:
            return
        module = nxt.module_ref()
        weight = getattr(module, "weight", None)
        if module is None or not isinstance(weight, torch.Tensor) or hasattr(weight, "_master") \
                or weight.device != x.device or weight.shape[-1] != x.shape[-1]:
            return  # an offloaded router would be paged for a guess: not worth it
        with torch.no_grad():
            scores = F.linear(x.reshape(-1, x.shape[-1]).to(weight.dtype), weight).float()
            bias = getattr(module, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor) and not hasattr(bias, "_master"):
                scores = scores.sigmoid() + bias.float()  # DeepSeek-V3 selects on biased sigmoid scores
            ids = scores.topk(min(nxt.top_k, scores.shape[-1]), dim=-1).indices.reshape(-1)
            if ids.device.type == "cuda":
                # Read back without a host sync: a pinned staging copy and an event; the copies are
                # issued from the pager's next call once the event has completed (by then the
                # layer's own routing read has waited for the router anyway).
                host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
                host.copy_(ids, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                self._pending.append((nxt, host, event, router.tokens))
            else:
                self._pending.append((nxt, ids, None, router.tokens))
        # Issued from the pager once this layer's own experts are (ExpertStacks.announce), so the
        # guesses queue behind them on the copy stream.

    def router_output(self, router: _Router, output) -> None:
        """The router ran: its top-k of its scores is what its layer will page (nearly: a model may
        correct the scores first), told to the expert cache before the layer pages anything."""
        if not router.stacks or router.top_k is None:
            return
        num_experts = router.stacks[0].num_experts
        candidates = output if isinstance(output, (tuple, list)) else (output,)
        logits = next((t for t in candidates if isinstance(t, torch.Tensor) and t.dim() >= 1
                       and t.shape[-1] == num_experts and t.is_floating_point()), None)
        if logits is None or logits.is_meta:
            return
        with torch.no_grad():
            ids = logits.reshape(-1, num_experts).float().topk(min(router.top_k, num_experts), dim=-1).indices.reshape(-1)
            if ids.device.type == "cuda":
                host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
                host.copy_(ids, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                self._expected.append((router, host, event))
            else:
                self._stacks.expect(router.stacks, ids.unique().tolist())

    def expected_ready(self) -> None:
        """GPU: hand the router outputs that have reached the host to the expert cache."""
        if not self._expected:
            return
        keep = []
        for item in self._expected:
            router, host, event = item
            if event.query():
                self._stacks.expect(router.stacks, host.unique().tolist())
            else:
                keep.append(item)
        self._expected = keep

    def used(self, stack: _Stack, expert: int) -> None:
        current = self._current
        if current is not None:
            learned = self._learned.setdefault(current, [])
            if stack not in learned:
                learned.append(stack)

    # -------------------------------------------------------------- issuing and scoring

    def issue_ready(self) -> None:
        """Start the copies of every guess whose ids have reached the host."""
        if not self._pending:
            return
        pager = self._pager()
        keep = []
        for item in self._pending:
            router, ids, event, tokens = item
            if event is not None and not event.query():
                keep.append(item)
                continue
            # Token-major, each token's experts by descending score: the most confident first.
            self._issue(pager, router, list(dict.fromkeys(ids.tolist())), tokens)
        self._pending = keep

    def _issue(self, pager, router: _Router, experts: list, tokens: int) -> None:
        self._score(router)
        router.guess = set(experts)
        router.guess_tokens = tokens
        router.copied = {}
        if pager is None or not router.speculating():
            return
        with self._stacks.in_spare_room_only():
            for expert in experts[:SPECULATE_EXPERTS]:
                for stack in router.stacks:
                    master = stack.master_ref()
                    if master is None or master.flat is None:
                        continue
                    key = stack.key_of(expert)
                    cached = pager.is_cached(key)
                    if not pager.prefetch(master, *key[1:]):
                        return  # no room without evicting copies this step may still read
                    if not cached:
                        nbytes = stack.expert_bytes
                        router.copied[expert] = router.copied.get(expert, 0) + nbytes
                        router.prefetched_bytes += nbytes

    def _score(self, router: _Router) -> None:
        """Close ``router``'s open guess against the experts its stacks actually paged."""
        guess = router.guess
        if guess is None:
            return
        router.guess = None
        used = set()
        for stack in router.stacks:
            used |= stack.used
        if not used:
            return  # its layer has not run yet (a forward cut short): nothing to score against
        correct = len(guess & used)
        router.guessed += len(guess)
        router.correct += correct
        router.routed += len(used)
        router.wasted_bytes += sum(b for e, b in router.copied.items() if e not in used)
        router.recent_correct = PRECISION_DECAY * router.recent_correct + correct
        router.recent_guessed = PRECISION_DECAY * router.recent_guessed + len(guess)
        if router.guess_tokens == 1 and len(used) and router.top_k is None:
            router.top_k = len(used)

    def step(self) -> None:
        """A pass ended: score open guesses, learn the router order and which stacks each selects."""
        self.issue_ready()
        for router in self.routers:
            if router.tokens == 1 and router.stacks:
                used = set()
                for stack in router.stacks:
                    used |= stack.used
                if used:
                    router.top_k = len(used)  # one token picks exactly top_k experts
            self._score(router)
        for router, stacks in self._learned.items():
            if stacks:
                router.stacks = stacks
        if self._order:
            self._next = {a: b for a, b in zip(self._order, self._order[1:])}
        self._order, self._learned, self._current = [], {}, None

    def reset(self) -> None:
        for r in self.routers:
            r.guessed = r.correct = r.routed = r.prefetched_bytes = r.wasted_bytes = 0

    def report(self) -> dict:
        reports = {r.name: r.report() for r in self.routers if r.stacks}
        guessed = sum(r.guessed for r in self.routers)
        correct = sum(r.correct for r in self.routers)
        routed = sum(r.routed for r in self.routers)
        return {
            "accuracy": correct / guessed if guessed else None,
            "recall": correct / routed if routed else None,
            "prefetched_bytes": sum(r.prefetched_bytes for r in self.routers),
            "wasted_bytes": sum(r.wasted_bytes for r in self.routers),
            "routers": reports,
        }

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []


def attach(model: nn.Module, pager, speculate: bool = True) -> Optional[ExpertStacks]:
    """Register ``model``'s offloaded stacked-expert tensors with ``pager`` and, with ``speculate``,
    hook its routers. Returns the pager's ``ExpertStacks`` (None when nothing routed is offloaded)."""
    stacks = ExpertStacks()
    seen = set()
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        master = getattr(t, "_master", None)
        if master is None or master.id in seen or "experts" not in name.split(".") or t.dim() < 3:
            continue
        seen.add(master.id)
        stacks.register(name, t)
    if not stacks.by_master:
        return None
    pager.experts = stacks
    if not speculate:
        return stacks
    sizes = {s.num_experts for s in stacks.by_master.values()}
    routers = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        leaf = name.rpartition(".")[2]
        if leaf in ROUTER_NAMES and isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[0] in sizes:
            router = _Router(name, module)
            if router.top_k is None:
                parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
                router.top_k = _attribute_top_k(parent)
            # Name fallback until a pass has been recorded: <prefix>.gate selects <prefix>.experts.*.
            prefix = name.rpartition(".")[0] + "."
            router.stacks = [s for s in stacks.by_master.values() if s.name.startswith(prefix)]
            routers.append(router)
    if not routers:
        return stacks
    speculator = RoutingSpeculator(pager, stacks, routers)
    for router in routers:
        module = router.module_ref()

        # Under torch.compile the hooks stand aside: they read routing results on the host, which
        # would break the graph at every router; compiled MoE layers page exactly as eager ones,
        # without guesses.
        def hook(module, args, router=router, speculator_ref=weakref.ref(speculator)):
            if torch.compiler.is_compiling():
                return
            speculator = speculator_ref()
            if speculator is not None and args and isinstance(args[0], torch.Tensor) and not args[0].is_meta:
                speculator.router_ran(router, args[0])

        def output_hook(module, args, output, router=router, speculator_ref=weakref.ref(speculator)):
            if torch.compiler.is_compiling():
                return
            speculator = speculator_ref()
            if speculator is not None:
                speculator.router_output(router, output)

        speculator.hooks.append(module.register_forward_pre_hook(hook))
        speculator.hooks.append(module.register_forward_hook(output_hook))
    stacks.speculator = speculator
    return stacks


def detach(pager) -> None:
    stacks = getattr(pager, "experts", None)
    if stacks is not None and stacks.speculator is not None:
        stacks.speculator.remove()
    pager.experts = None
