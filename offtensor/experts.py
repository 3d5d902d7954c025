"""Routed experts: which offloaded tensors are stacks of experts, how their cached copies are used,
and the guess of the next MoE layer's experts.

The pager already caches every paged byte range by (master, dtype, lo, hi); a routed expert is one
such range of a stacked-expert tensor (``experts.w1[e]``, ``gate_up_proj[e:e+1]``). This module adds
what that cache does not know about experts, as two small objects the pager composes:

- ``ExpertStacks``: the offloaded stacks by master, grouped by layer; per-stack counters (hits,
  misses, bytes copied, evictions); a decayed use frequency per cached expert (weighted by the
  expert's share of the layer's tokens where the op knows it); the layer order of the last pass.
  The pager's eviction asks it for a victim (``victim``), approximating Belady's furthest next use
  in the cyclic layer order with one score for every layer: an expert ``d`` layers ahead is next
  used after ``d + (1 - p) L / q`` layers, ``q`` its decayed use frequency and ``p`` its chance at
  its layer's next turn (``q``, or the layer's measured token-to-token reuse rate for an expert
  the layer routed at its last turn), so the cache goes to the layers whose tokens reuse experts.
  An op that knows its experts (``_grouped_mm``, the index ops) ``announce``s them: the layer's
  missing experts are issued at once and its unrouted ones become evictable;
- ``RoutingSpeculator``: forward hooks on the routers. The top-k of a router's output tells the
  cache which experts its layer will page (``expect``, for models that select experts one by one).
  Before layer i's router runs, layer i+1's router weight is applied to its input (the residual
  stream changes little from one layer to the next, which MoE-Infinity and Pre-gated MoE exploit):
  a guess of layer i+1's experts, always scored against what layer i+1 pages. Guesses of experts
  not cached when guessed (the only ones a copy can save) are scored apart per router and
  confidence bin. Such a guess is copied (the most confident one per layer, behind layer i's own
  copies, and only into the room of a copy expected to be read much later) when its bin's recent
  guesses were at least 70% right (the router's own record, or every router's until it has
  one); the guessed experts of layer i+1 are kept from eviction until it pages. A decode step's
  guess costs one kernel, the router matmul (softmax and top-k on the host). With
  ``SPECULATE_COPY`` off nothing is copied and a router is guessed for on a sample of the steps.
  Which modules are routers and which stacks each one selects is learned from
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
import math
import weakref
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .pager import cache_key

# Per step an expert's use count decays by this factor: a frequency over roughly the last
# 1 / (1 - DECAY) steps, so an expert hot a few hundred tokens ago does not stay pinned forever.
# (benchmarks/moe_sim.py on the trained test models: 0.5 to 0.95 moves the decode hit rate at 25%
# cached from 0.70 to 0.74; recency is carried by REUSE below, so the frequency can be long. An
# offline simulator of this policy over 12 windows of 256 held-out decode steps, 25% cached,
# tuned on windows 0-5 and checked on 6-11: 0.95 -> 0.98 gives Qwen3-MoE +0.3 / +0.3 points and
# Qwen2-MoE +0.5 / +0.3; 0.99 the same as 0.98.)
FREQUENCY_DECAY = 0.98
# Token-to-token locality: the share of a layer's experts at one token that its next token routes
# to again, measured per layer (an exponential average over decode steps, REUSE_DECAY per step),
# starting from REUSE_PRIOR (the trained test models: 0.31 to 0.48 by layer; chance is k / E).
REUSE_PRIOR = 0.4
REUSE_DECAY = 0.9
# How many evictable copies eviction compares, least recently used first (bounds its cost in a
# cache of thousands of experts; a copy it passes over is evicted later).
VICTIM_WINDOW = 512
# Probability of use given to an expert with no recorded use, so the cyclic distance still orders them.
UNSEEN_USE = 0.02
# Speculation is scored on what it can save: only a guess of an expert that is NOT cached when the
# guess is made costs a copy, so a router's guesses are scored apart by their confidence (the
# look-ahead probability of the guessed expert, in CONFIDENCE_BINS bins) on uncached experts only.
# An uncached guess is copied only when the guesses of its router and bin have been right at least
# SPECULATE_PRECISION of the time: its copy then saves a miss on the critical path more often than
# it spends the copy stream for nothing. Guesses are scored whether or not they were copied, so a
# bin earns (or loses) speculation by its record before any byte is spent on it.
# The gate is set by the H200 replay of benchmarks/moe_sim.py (experts of Qwen3-30B-A3B's bytes, 25%
# cached, ms per decode step, one guess a layer): at 0.6 Qwen3-MoE's step is 7% slower than the
# cache alone (each wrong copy delays the next layer's own copies by most of an expert's copy, a
# right one saves only the ~0.06 ms gap before that layer's routing read), at 0.7 it is within 1%
# and Qwen2-MoE's 2% faster; the coverage-against-waste curve of the gates is in
# benchmarks/results/moe_sim.json.
SPECULATE_PRECISION = 0.7
# Upper edges of the confidence bins (a guess's look-ahead probability; top-k of a softmax over
# E experts: 1 / E is chance).
CONFIDENCE_BINS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
# A bin's precision is correct / guessed over its recent uncached guesses: both counts decay by
# this factor per scored guess, and at least SPECULATE_EVIDENCE guesses must stand behind it.
PRECISION_DECAY = 0.98
SPECULATE_EVIDENCE = 8.0
# At most this many guessed experts per layer are copied ahead, the most confident first. The copy
# stream is idle only between a layer's last expert copy and the next layer's routing read (its
# attention and router: ~0.3 ms on the DeepSeek-style stack under the H200 profile, less than one
# 25 MB expert's 0.45 ms copy), so one guess fills that gap; more are copied at the price of every
# wrong one (the replay in benchmarks/moe_bench.py: all 8 at 80% accuracy is slower than none;
# benchmarks/moe_sim.py's H200 replay of the trained models: two a layer is slower than one).
SPECULATE_EXPERTS = 1
# A guess's copy may evict only a copy whose next use is expected at least this many cycles of
# layers away: one that is likelier to be read before the guess is never given up for it.
SPECULATE_VICTIM_CYCLES = 2.0
# Whether a guess that pays is copied at all. On: the trained test models' decode step is
# copy-bound at 25% cached (copy stream ~70% busy under the H200 profile), so copies ahead pay only
# with a strict gate (SPECULATE_PRECISION), one guess a layer (SPECULATE_EXPERTS) and one kernel a
# guess (GUESS_ON_HOST_TOKENS); with those the decode hit rate at 25% rises by 4-7 points over the
# cache alone and the replayed step is no slower than the cache alone was before them (figures in
# benchmarks/results/moe_sim.json and the README's MoE table). Off: guesses are still made, on a
# sample of the steps, and scored (``ot.stats(model).guesses``).
SPECULATE_COPY = True
# With SPECULATE_COPY off a router is guessed for at every SPECULATE_SAMPLE-th step only: enough to
# keep its score, while a guess's kernels (4 us each of launch on the compute stream) are not paid
# every layer of every step.
SPECULATE_SAMPLE = 8
# Up to this many tokens (decode steps) a guess's softmax and top-k are taken on the host from the
# router scores (E values a token, read back with the layer's routing); beyond it (a prefill) on the
# device. Each kernel is a launch ahead of the layer's routing read: the matmul, softmax and top-k
# of a guess on the device cost the trained models' H200 replay ~0.08 ms a decode step (5%).
GUESS_ON_HOST_TOKENS = 4
ROUTER_NAMES = ("gate", "router")


def _distance(where, here: int, count: int) -> float:
    """Layers from the current one (at ``here``) to the layer at ``where`` in a cycle of ``count``:
    a whole cycle for the current layer itself, half a layer for one not yet placed."""
    return (where - here) % count or count if where is not None else 0.5


class _Stack:
    """One offloaded stacked-expert tensor: experts along dim 0."""

    __slots__ = ("name", "group", "master_ref", "master_id", "dtype", "base", "expert_bytes", "num_experts",
                 "hits", "misses", "bytes_h2d", "prefetched_bytes", "evictions", "used", "last_used")

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

    def expert_of(self, key) -> int:
        return (key[2] - self.base) * key[1].itemsize // self.expert_bytes

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
                 "_stack_bytes", "_clock", "_last", "_coldest", "_scale", "_reuse", "_ahead_distance", "_guarded",
                 "announcing", "__weakref__")

    def __init__(self):
        self.by_master: dict = {}  # master id -> _Stack
        self.frequency: dict = {}  # cache key -> decayed use count (experts only)
        self.speculator: Optional[RoutingSpeculator] = None
        self.position: dict = {}  # stack group -> its place in the last pass's access order
        self._order: list = []  # stack groups in first-access order, this pass
        self._current = None  # the stack group paged last
        self._needed = None  # keys the current op said it pages (announce), None if it did not say
        self._issued_for_op = set()  # keys announce copied ahead of their op: misses, though found on the device
        self._announcing = False
        # Copying a guess ahead of its use: such a copy may only take a copy whose next use is
        # expected far away (ExpertStacks.victim).
        self._spare_room_only = False
        self._stack_bytes = 0  # bytes of every registered stack
        self._announced = None  # the key set the last announce issued
        self._shares = {}  # expert -> its share of the current layer's tokens (announce), most routed = 1
        # group -> keys its router's output says the layer will page (RoutingSpeculator.router_output),
        # for models that select experts one by one and so announce nothing
        self._expected = {}
        # group -> keys the guess for that layer (made when the layer before it routed) names: kept
        # from eviction until the layer pages (guard), as its own routed experts are once it does
        self._guarded = {}
        # Eviction's index (see victim): every cached copy's last use, as a tick of this clock
        # (the pager's LRU order), and per stack a heap of (frequency / _scale, tick, key) records
        # pushed at every use and copy, the coldest first. A record whose tick is not its key's
        # last one is stale and dropped when it surfaces. Frequencies decay alike every step, so
        # dividing by the common decay (_scale) keeps older records comparable with newer ones.
        self._clock = 0
        self._last: dict = {}  # cache key -> tick of its last use or copy
        self._coldest: dict = {}  # master id -> heap of records
        self._scale = 1.0
        self._reuse: dict = {}  # stack group -> its measured token-to-token locality (REUSE_PRIOR until measured)
        # A guess's copy may evict only a copy whose expected next use is this many layers away or
        # more (None: twice the cycle); set by the speculator per guess.
        self._ahead_distance = None
        # Stack groups whose op announces its experts (``_grouped_mm``, the index ops): their
        # routers' top-k need not be read back (RoutingSpeculator.router_output).
        self.announcing = set()

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
        self.announcing.add(stack.group)
        # The layer's own experts are paged right after anyway: they take the victims in-line paging
        # would (no _spare_room_only restriction), only sooner.
        self._announcing = True
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
            self._announcing = False
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
            self._guarded.pop(stack.group, None)  # its own routing says what it pages now
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

    def guard(self, stacks: list, experts) -> None:
        """The guess of ``stacks``' layer, the next to run, names these experts: no copy made before
        that layer pages may evict them (on the trained test models a guessed expert is routed
        0.72-0.77 of the time, one ranked in the next k 0.16-0.18, any other under 0.06)."""
        if stacks:
            self._guarded[stacks[0].group] = {s.key_of(int(e)) for s in stacks for e in experts}

    def copied(self, key, nbytes: int, prefetch: bool) -> None:
        self._clock += 1
        self._last[key] = self._clock
        stack = self.by_master.get(key[0])
        if stack is not None:
            stack.bytes_h2d += nbytes
            if prefetch and not self._announcing:
                stack.prefetched_bytes += nbytes
            self._push(key)

    def evicted(self, key) -> None:
        self._last.pop(key, None)
        stack = self.by_master.get(key[0])
        if stack is not None:
            stack.evictions += 1

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

    def victim(self, view, room: int, candidates):
        """The evictable copy to drop: a non-expert copy if one comes first in LRU order (dense
        weights are re-paged once per step whatever happens), else the expert whose next use is
        expected furthest away (Belady's rule, with the future estimated).

        Layers run in a cycle, so plain LRU evicts exactly the experts of the layer that runs next
        (the least recently used) and keeps those of the layers that just ran, whose next use is a
        whole step away. Here an expert of the layer ``d`` places ahead in the learned cyclic
        layer order (the layer being paged now: ``d = L``, a whole cycle) is used at its layer's
        next turn with probability ``p``, else at a later turn with probability ``q`` per turn:
        an expected next use ``d + (1 - p) L / q`` layers ahead (``_next_use``). ``q`` is its
        decayed use frequency; ``p`` is ``q``, or for an expert its layer routed at its last turn,
        the larger of ``q`` and the rate at which that layer reuses its last token's experts
        (token-to-token locality, measured per layer). One score for every layer: the cache is
        shared by need, not by equal parts, and a layer whose tokens reuse their experts keeps them.

        Experts the current op may still page and prefetched copies not yet used are kept while
        anything else can go. A copy made ahead of its use by a guess (``_spare_room_only``) takes
        only a copy whose expected next use is at least ``_ahead_distance`` layers away: it returns
        None rather than evict anything likelier to be read soon than the guess itself.

        The pager's eviction policy (``pager.cache``): ``view`` is its read-only view of the cached
        copies, ``candidates`` the evictable ones, least recently used first."""
        cache, cached = view.copies, view.by_master
        # Found through indexes rather than by comparing every cached copy: each stack's coldest
        # evictable copies come off its heap (the distance is the stack's), so a call costs a look
        # or two per stack with cached copies, not one per copy.
        plain = self._plain_victim(cached)
        if plain is not None:
            return plain
        position, count, here = self._cycle()
        current, needed = self._current, self._needed
        best, best_score = None, None
        for master_id, entries in cached.items():
            stack = self.by_master.get(master_id)
            if stack is None or not entries:
                continue
            if stack.group == current:
                if needed is None:
                    continue  # the op did not say what it pages: any of the layer's may be next
                distance = count
            else:
                distance = _distance(position.get(stack.group), here, count)
            keep = needed if stack.group == current else self._guarded.get(stack.group)
            for entry, recent in self._coldest_of(stack, cache, keep):
                score = (self._next_use(entry.key, stack, distance, count, recent), -self._last.get(entry.key, -1))
                if best is None or score > best_score:
                    best, best_score = entry, score
        if best is None:
            # Only copies to keep are left (prefetched, or the current layer's own): the scan
            # below ranks them, or refuses for a copy made ahead of its use.
            return self._victim_scan(candidates, cached, room)
        if self._spare_room_only and best_score[0] < self._ahead_limit(count):
            return None
        return best

    @contextlib.contextmanager
    def in_spare_room_only(self):
        """Copies issued inside (guesses) are ahead of their use: they take only room whose next use
        is expected far away (see ``victim``)."""
        self._spare_room_only = True
        try:
            yield
        finally:
            self._spare_room_only = False

    def _plain_victim(self, cached: dict):
        """The least recently used evictable copy that is not an expert, if any."""
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

    def _ahead_limit(self, count: int) -> float:
        """How far away (layers) a victim's expected next use must be for a copy ahead of use."""
        limit = self._ahead_distance
        return limit if limit is not None else SPECULATE_VICTIM_CYCLES * count

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
        """The chance per turn that ``key``'s layer routes to it, estimated from its decayed use."""
        return min(1.0, max(self.frequency.get(key, 0.0) * (1.0 - FREQUENCY_DECAY), UNSEEN_USE))

    def _recent(self, stack: _Stack) -> set:
        """The experts ``stack``'s layer routed at its last turn: this step's if it has run in it."""
        return stack.used if stack.group in self._order else stack.last_used

    def _next_use(self, key, stack: _Stack, distance: float, count: int, recent: bool) -> float:
        """Expected layers until ``key`` is next used (see victim)."""
        q = self._use(key)
        p = max(q, self._reuse.get(stack.group, REUSE_PRIOR)) if recent else q
        return distance + (1.0 - p) * count / q

    def _coldest_of(self, stack: _Stack, cache, needed):
        """``stack``'s candidates for eviction, as (entry, routed at its layer's last turn): the
        least used evictable copy its layer did not route at its last turn (off the heap) and the
        least used one it did (few: scanned). With ``needed`` (the current layer's), what its op
        pages is kept."""
        recent = self._recent(stack)
        out = []
        best = None
        for e in recent:
            key = stack.key_of(e)
            entry = cache.get(key)
            if entry is None or entry.users or entry.prefetched or (needed is not None and key in needed):
                continue
            if best is None or self.frequency.get(key, 0.0) < self.frequency.get(best.key, 0.0):
                best = entry
        if best is not None:
            out.append((best, True))
        heap = self._coldest.get(stack.master_id)
        if not heap:
            return out
        last = self._last
        aside = []
        while heap:
            _, tick, key = record = heap[0]
            entry = cache.get(key)
            if entry is None or last.get(key) != tick:
                heapq.heappop(heap)  # stale: evicted, or used or copied again since
                continue
            heapq.heappop(heap)
            aside.append(record)
            if entry.users or entry.prefetched or (needed is not None and key in needed) \
                    or stack.expert_of(key) in recent:
                continue
            out.append((entry, False))
            break
        for record in aside:
            heapq.heappush(heap, record)
        return out

    def _victim_scan(self, candidates, cached: dict, room: int):
        """``victim`` by comparing the evictable copies one by one, least recently used first: the
        fallback when the indexes offer nothing (copies the index has no record of, such as those
        cached before the registry was rebuilt, or only copies to keep). Copies to keep (unused
        prefetches, the current op's experts) rank below every other, the furthest expected first."""
        position, count, here = self._cycle()
        current, needed = self._current, self._needed
        best, best_score = None, None
        for seen, entry in enumerate(candidates):
            if seen >= VICTIM_WINDOW:
                break
            stack = self.by_master.get(entry.key[0])
            if stack is None:
                if not entry.prefetched:
                    return entry
                score = (0, 0.0)
            else:
                current_layer = stack.group == current
                guarded = self._guarded.get(stack.group, ())
                keep = entry.prefetched or (current_layer and (needed is None or entry.key in needed)) \
                    or entry.key in guarded
                distance = count if current_layer else _distance(position.get(stack.group), here, count)
                recent = stack.expert_of(entry.key) in self._recent(stack)
                score = (0 if keep else 1, self._next_use(entry.key, stack, distance, count, recent))
            if best is None or score > best_score:
                best, best_score = entry, score
        if self._spare_room_only and best is not None and (best_score[0] == 0 or best_score[1] < self._ahead_limit(count)):
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
        self._measure_reuse()
        for stack in self.by_master.values():
            stack.last_used, stack.used = stack.used, set()
        if self._order:
            self.position = {m: i for i, m in enumerate(self._order)}
        self._order, self._current, self._needed, self._announced = [], None, None, None
        self._issued_for_op = set()
        self._expected = {}
        self._guarded = {}

    def _measure_reuse(self) -> None:
        """Update each layer's token-to-token locality from the step that ended: the share of its
        last step's experts that it routed again. Only steps that routed as many experts as the one
        before count (one-token decode steps; a prefill routes to most experts of a layer)."""
        seen = set()
        for stack in self.by_master.values():
            if stack.group in seen or not stack.used or len(stack.used) != len(stack.last_used):
                continue
            seen.add(stack.group)
            share = len(stack.used & stack.last_used) / len(stack.used)
            self._reuse[stack.group] = REUSE_DECAY * self._reuse.get(stack.group, REUSE_PRIOR) + (1 - REUSE_DECAY) * share

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
    __slots__ = ("name", "module_ref", "stacks", "top_k", "bin_correct", "bin_guessed", "guessed", "correct",
                 "routed", "uncached_guessed", "uncached_correct", "misses", "copied_experts", "copied_correct",
                 "prefetched_bytes", "wasted_bytes", "tokens", "guess", "cached", "copied", "guess_tokens",
                 "unpaid_steps", "missed", "misses_seen")

    def __init__(self, name: str, module: nn.Module):
        self.name = name
        self.module_ref = weakref.ref(module)
        self.stacks: list = []  # _Stack objects this router selects experts of
        self.top_k = _attribute_top_k(module)
        # Decayed counts of its uncached guesses per confidence bin (their running precision).
        self.bin_correct = [0.0] * len(CONFIDENCE_BINS)
        self.bin_guessed = [0.0] * len(CONFIDENCE_BINS)
        self.guessed = self.correct = self.routed = self.prefetched_bytes = self.wasted_bytes = 0
        # Guesses of experts not cached when guessed, how many were routed, the routed experts not
        # cached at guess time (the misses a guess could cover), guesses copied and routed.
        self.uncached_guessed = self.uncached_correct = self.misses = self.copied_experts = self.copied_correct = 0
        self.tokens = 0  # tokens of its last real routing
        self.guess = None  # open guess: expert -> confidence bin, scored when the step ends
        self.cached = frozenset()  # experts cached (every stack) when the open guess was made
        self.copied = {}  # expert -> bytes the open guess copied for it
        self.guess_tokens = 0
        self.unpaid_steps = 0  # steps it could have been guessed for with copies off (every SPECULATE_SAMPLE-th is)
        self.missed = True  # whether its stacks missed in the last step (a guess could have saved a copy)
        self.misses_seen = 0  # its stacks' misses counted at the end of the last step

    def pays(self, confidence_bin: int, pool=None) -> bool:
        """Whether an uncached guess in this bin is right often enough to be worth its copy: by its
        own record once it has SPECULATE_EVIDENCE guesses, until then by ``pool`` (every router's
        record of that bin, (correct, guessed) lists), so a router need not wait for evidence of
        its own before its first copy (on the trained test models a bin took 20-40 decode steps)."""
        correct, guessed = self.bin_correct[confidence_bin], self.bin_guessed[confidence_bin]
        if guessed < SPECULATE_EVIDENCE and pool is not None:
            correct, guessed = pool[0][confidence_bin], pool[1][confidence_bin]
        return guessed >= SPECULATE_EVIDENCE and correct >= SPECULATE_PRECISION * guessed

    def speculating(self, pool=None) -> bool:
        return SPECULATE_COPY and any(self.pays(b, pool) for b in range(len(CONFIDENCE_BINS)))

    def report(self, pool=None) -> dict:
        return _guess_report(self.guessed, self.correct, self.routed, self.uncached_guessed, self.uncached_correct,
                             self.misses, self.copied_experts, self.copied_correct, self.prefetched_bytes,
                             self.wasted_bytes) | {"speculating": self.speculating(pool)}


def _ratio(a, b):
    return a / b if b else None


def _guess_report(guessed, correct, routed, uncached_guessed, uncached_correct, misses, copied, copied_correct,
                  prefetched_bytes, wasted_bytes) -> dict:
    """``accuracy``/``recall``: all guesses against the routed experts. What speculation can save:
    ``uncached_precision`` (guesses of experts not cached when guessed that were routed),
    ``miss_coverage`` (share of the misses, routed experts not cached at guess time, that those
    guesses named: what copying every guess would cover), ``covered_misses`` (share of the misses
    a copied guess covered), ``wasted_share`` (copied bytes no op read)."""
    return {
        "guessed": guessed, "correct": correct, "routed": routed,
        "accuracy": _ratio(correct, guessed), "recall": _ratio(correct, routed),
        "uncached_guessed": uncached_guessed, "uncached_correct": uncached_correct,
        "uncached_precision": _ratio(uncached_correct, uncached_guessed),
        "misses": misses, "miss_coverage": _ratio(uncached_correct, misses),
        "copied_experts": copied, "copied_correct": copied_correct, "covered_misses": _ratio(copied_correct, misses),
        "prefetched_bytes": prefetched_bytes, "wasted_bytes": wasted_bytes,
        "wasted_share": _ratio(wasted_bytes, prefetched_bytes),
    }


def _host_guess(scores: torch.Tensor, top_k: int) -> list:
    """(expert, softmax probability) of each row's ``top_k`` highest scores, computed on the host
    from a few rows of router scores (no kernel: see RoutingSpeculator.router_ran)."""
    rows = scores.reshape(-1, scores.shape[-1]).tolist()
    out = []
    for row in rows:
        top = max(row)
        total = sum(math.exp(v - top) for v in row)
        for e in heapq.nlargest(min(top_k, len(row)), range(len(row)), key=row.__getitem__):
            out.append((e, math.exp(row[e] - top) / total))
    return out


def _confidence_bin(p: float) -> int:
    for i, edge in enumerate(CONFIDENCE_BINS):
        if p <= edge:
            return i
    return len(CONFIDENCE_BINS) - 1


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
        self._pending = []  # (router, scores or (ids, confidences), event or None, tokens): guesses not yet issued
        self._expected = []  # GPU: (router, pinned ids, event) of router outputs read back without a sync
        self.hooks = []
        # Every router's uncached guesses per confidence bin, decayed alike (_Router.pays).
        self.pool = ([0.0] * len(CONFIDENCE_BINS), [0.0] * len(CONFIDENCE_BINS))

    # -------------------------------------------------------------- hooks

    def router_ran(self, router: _Router, x: torch.Tensor) -> None:
        self._order.append(router)
        self._current = router
        self._learned.setdefault(router, [])
        router.tokens = x.numel() // max(x.shape[-1], 1)
        nxt = self._next.get(router)
        if nxt is None or not nxt.stacks or nxt.top_k is None:
            return
        if not (SPECULATE_COPY and (nxt.missed or nxt.speculating(self.pool))):
            # Nothing for a copied guess to save (its layer missed nothing in the last step and no
            # bin pays): it is only scored, which needs a sample, not every step (a guess's kernel
            # is a cost on the compute stream: at 50% cached, where a layer rarely misses, guessing
            # every step made the trained Qwen2-MoE's H200 replay 7% slower than the cache alone).
            nxt.unpaid_steps += 1
            if (nxt.unpaid_steps - 1) % SPECULATE_SAMPLE:
                return  # the first step and every SPECULATE_SAMPLE-th after it are guessed
        module = nxt.module_ref()
        weight = getattr(module, "weight", None)
        if module is None or not isinstance(weight, torch.Tensor) or hasattr(weight, "_master") \
                or weight.device != x.device or weight.shape[-1] != x.shape[-1]:
            return  # an offloaded router would be paged for a guess: not worth it
        with torch.no_grad():
            scores = F.linear(x.reshape(-1, x.shape[-1]).to(weight.dtype), weight)
            bias = getattr(module, "e_score_correction_bias", None)
            biased = isinstance(bias, torch.Tensor) and not hasattr(bias, "_master")
            if router.tokens <= GUESS_ON_HOST_TOKENS and not biased:
                # A decode step: the router matmul is the guess's one kernel (on a GPU, plus the
                # read-back copy). Its softmax and top-k over a few rows of E scores are done on the
                # host (_host_guess): each kernel is a launch on the compute stream ahead of the
                # layer's routing read, paid every layer of every step (3 kernels a layer cost the
                # trained test models' H200 replay 0.08 ms a decode step, 5% of it).
                self._queue(nxt, scores, router.tokens)
                return
            # Many tokens (a prefill) or a biased router: top-k on the device, whose values are the
            # confidences (softmax keeps the order).
            k = min(nxt.top_k, scores.shape[-1])
            if biased:
                scores = scores.float().sigmoid()
                confidence = scores / scores.sum(-1, keepdim=True)
                top = (scores + bias.float()).topk(k, dim=-1).indices  # DeepSeek-V3 selects on biased sigmoid scores
                confidence = confidence.gather(-1, top)
            else:
                confidence, top = scores.softmax(-1, dtype=torch.float32).topk(k, dim=-1)
            # The guessed ids and each one's confidence, token-major, each token's experts by
            # descending score.
            self._queue(nxt, (top, confidence), router.tokens)
        # Issued from the pager once this layer's own experts are (ExpertStacks.announce), so the
        # guesses queue behind them on the copy stream.

    def _queue(self, router: _Router, packed, tokens: int) -> None:
        """A guess for ``router``'s layer: ``packed`` is its scores (a tensor: top-k taken on the
        host) or (ids, confidences). On a GPU they are read back without a host sync: pinned
        staging copies and an event; the copies are issued from the pager's next call once the
        event has completed (by then the layer's own routing read has waited for the router anyway)."""
        event = None
        tensors = packed if isinstance(packed, tuple) else (packed,)
        if tensors[0].device.type == "cuda":
            staged = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors)
            for host, t in zip(staged, tensors):
                host.copy_(t, non_blocking=True)
            packed = staged if isinstance(packed, tuple) else staged[0]
            event = torch.cuda.Event()
            event.record()
        self._pending.append((router, packed, event, tokens))

    def router_output(self, router: _Router, output) -> None:
        """The router ran: its top-k of its scores is what its layer will page (nearly: a model may
        correct the scores first), told to the expert cache before the layer pages anything."""
        if not router.stacks or router.top_k is None or router.stacks[0].group in self._stacks.announcing:
            return  # its layer's op announces what it pages (ExpertStacks.announce): no top-k needed
        num_experts = router.stacks[0].num_experts
        candidates = output if isinstance(output, (tuple, list)) else (output,)
        logits = next((t for t in candidates if isinstance(t, torch.Tensor) and t.dim() >= 1
                       and t.shape[-1] == num_experts and t.is_floating_point()), None)
        if logits is None or logits.is_meta:
            return
        with torch.no_grad():
            ids = logits.reshape(-1, num_experts).topk(min(router.top_k, num_experts), dim=-1).indices.reshape(-1)
            if ids.device.type == "cuda":
                host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
                host.copy_(ids, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                self._expected.append((router, host, event))
            else:
                self._stacks.expect(router.stacks, set(ids.tolist()))

    def expected_ready(self) -> None:
        """GPU: hand the router outputs that have reached the host to the expert cache."""
        if not self._expected:
            return
        keep = []
        for item in self._expected:
            router, host, event = item
            if event.query():
                self._stacks.expect(router.stacks, set(host.tolist()))
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
            router, packed, event, tokens = item
            if event is not None and not event.query():
                keep.append(item)
                continue
            if isinstance(packed, tuple):
                ids, conf = packed
                pairs = zip(ids.reshape(-1).tolist(), conf.reshape(-1).tolist())
            else:
                pairs = _host_guess(packed, router.top_k)
            confidence = {}  # expert -> its highest confidence over the tokens, most confident first
            for e, p in sorted(pairs, key=lambda ep: -ep[1]):
                confidence.setdefault(e, p)
            self._issue(pager, router, confidence, tokens)
        self._pending = keep

    def _cached_experts(self, pager, router: _Router) -> frozenset:
        """The experts of ``router``'s layer with every stack cached."""
        stacks = router.stacks
        if pager is None or not stacks:
            return frozenset()
        return frozenset(e for e in range(stacks[0].num_experts)
                         if all(pager.is_cached(s.key_of(e)) for s in stacks))

    def _issue(self, pager, router: _Router, confidence: dict, tokens: int) -> None:
        """Open ``router``'s guess (scored at the step's end) and copy the guessed experts that are
        not cached and whose confidence bin has paid (``_Router.pays``), the most confident first."""
        self._score(router)
        router.guess = {e: _confidence_bin(p) for e, p in confidence.items()}
        router.cached = self._cached_experts(pager, router)
        router.guess_tokens = tokens
        router.copied = {}
        if pager is None:
            return
        self._stacks.guard(router.stacks, router.guess)
        worth = [e for e, b in router.guess.items()
                 if SPECULATE_COPY and e not in router.cached and router.pays(b, self.pool)]
        with self._stacks.in_spare_room_only():
            for expert in worth[:SPECULATE_EXPERTS]:
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
        router.guessed += len(guess)
        router.correct += len(guess.keys() & used)
        router.routed += len(used)
        router.misses += len(used - router.cached)
        for e, b in guess.items():
            if e in router.cached:
                continue  # a guess of a cached expert costs nothing and saves nothing
            right = e in used
            router.uncached_guessed += 1
            router.uncached_correct += right
            router.bin_correct[b] = PRECISION_DECAY * router.bin_correct[b] + right
            router.bin_guessed[b] = PRECISION_DECAY * router.bin_guessed[b] + 1.0
            pool_correct, pool_guessed = self.pool
            pool_correct[b] = PRECISION_DECAY * pool_correct[b] + right
            pool_guessed[b] = PRECISION_DECAY * pool_guessed[b] + 1.0
        router.copied_experts += len(router.copied)
        router.copied_correct += len(router.copied.keys() & used)
        router.wasted_bytes += sum(b for e, b in router.copied.items() if e not in used)
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
            misses = sum(s.misses for s in router.stacks)
            router.missed = misses != router.misses_seen  # (a reset of the counters reads as a miss)
            router.misses_seen = misses
        for router, stacks in self._learned.items():
            if stacks:
                router.stacks = stacks
        if self._order:
            self._next = {a: b for a, b in zip(self._order, self._order[1:])}
        self._order, self._learned, self._current = [], {}, None

    def reset(self) -> None:
        for r in self.routers:
            r.guessed = r.correct = r.routed = r.prefetched_bytes = r.wasted_bytes = 0
            r.uncached_guessed = r.uncached_correct = r.misses = r.copied_experts = r.copied_correct = 0

    def report(self) -> dict:
        rs = self.routers
        total = _guess_report(*(sum(getattr(r, f) for r in rs) for f in (
            "guessed", "correct", "routed", "uncached_guessed", "uncached_correct", "misses", "copied_experts",
            "copied_correct", "prefetched_bytes", "wasted_bytes")))
        return total | {"routers": {r.name: r.report(self.pool) for r in rs if r.stacks}}

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []


def is_routed_stack(name: str, shape) -> bool:
    """Whether the tensor registered as ``name`` is a stack of routed experts: 3 dims or more under
    an ``experts`` module (``mlp.experts.gate_up_proj``). One rule for the cache, placement and plans."""
    return len(shape) >= 3 and "experts" in name.split(".")


def router_modules(model: nn.Module, sizes) -> list:
    """(name, module) of ``model``'s routers, in module order: a ``gate`` / ``router`` whose weight
    is [num_experts, hidden] for a ``num_experts`` in ``sizes``."""
    routers = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if (name.rpartition(".")[2] in ROUTER_NAMES and isinstance(weight, torch.Tensor) and weight.dim() == 2
                and weight.shape[0] in sizes):
            routers.append((name, module))
    return routers


def attach(model: nn.Module, pager, speculate: bool = True) -> Optional[ExpertStacks]:
    """Register ``model``'s offloaded stacked-expert tensors with ``pager`` and, with ``speculate``,
    hook its routers. Returns the pager's ``ExpertStacks`` (None when nothing routed is offloaded)."""
    stacks = ExpertStacks()
    seen = set()
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        master = getattr(t, "_master", None)
        if master is None or master.id in seen or not is_routed_stack(name, t.shape):
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
    for name, module in router_modules(model, sizes):
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

        speculator.hooks.append(module.register_forward_pre_hook(_RouterHook(router, speculator, False)))
        speculator.hooks.append(module.register_forward_hook(_RouterHook(router, speculator, True)))
    stacks.speculator = speculator
    return stacks


class _RouterHook:
    """A router's forward pre-hook (its input: guess the next layer's experts) or forward hook (its
    output: score the guesses), handing them to the speculator under the pager's lock (guesses and
    their scores are pager state, shared by threads' forwards).

    Under torch.compile it stands aside: it reads routing results on the host, which would break
    the graph at every router; compiled MoE layers page exactly as eager ones, without guesses.

    A copy of the model (``copy.deepcopy``, ``torch.save``) gets an inert hook: the copy is adopted
    on a pager of its own, which hooks its routers itself, and this one would feed the original's
    speculator (a function, which deepcopy shares and pickle refuses, did)."""

    __slots__ = ("router", "speculator_ref", "output")

    def __init__(self, router, speculator, output: bool):
        self.router, self.output = router, output
        self.speculator_ref = weakref.ref(speculator) if speculator is not None else None

    def __call__(self, module, args, output=None):
        if self.speculator_ref is None or torch.compiler.is_compiling():
            return None
        speculator = self.speculator_ref()
        pager = speculator._pager() if speculator is not None else None
        if pager is None:
            return None
        if self.output:
            with pager.lock:
                speculator.router_output(self.router, output)
        elif args and isinstance(args[0], torch.Tensor) and not args[0].is_meta:
            with pager.lock:
                speculator.router_ran(self.router, args[0])
        return None

    def __deepcopy__(self, memo):
        return _RouterHook(None, None, self.output)

    def __reduce__(self):
        return _RouterHook, (None, None, self.output)


def detach(pager) -> None:
    stacks = getattr(pager, "experts", None)
    if stacks is not None and stacks.speculator is not None:
        stacks.speculator.remove()
    pager.experts = None
