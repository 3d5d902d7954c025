"""The eviction policy the pager consults for routed experts: which cached expert copy to drop.

Every cached expert keeps a decayed use frequency (weighted by the expert's share of its layer's
tokens where the op knows it) and every MoE layer a measured token-to-token reuse rate. The pager's
eviction asks for a victim (``ExpertEviction.victim``), approximating Belady's furthest next use in
the cyclic layer order with one score for every layer: an expert ``d`` layers ahead is next used
after ``d + (1 - p) L / q`` layers, ``q`` its decayed use frequency and ``p`` its chance at its
layer's next turn (``q``, or the layer's measured token-to-token reuse rate for an expert the layer
routed at its last turn), so the cache goes to the layers whose tokens reuse experts. The experts a
guess names for the next layer (``guard``) are kept until that layer pages; a copy made ahead of
its use by a guess (``in_spare_room_only``) never takes the room of a copy expected to be used sooner than the
guess itself (nor sooner than SPECULATE_VICTIM_CYCLES cycles of layers). Where a learned map
predicts a layer's experts at its next turn (``moe.predictor``'s next-token map, through the
speculator: ``NextTurn``), its chances replace ``p`` for that layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import _ext
from .eviction_index import ColdHeaps, KeptBest, NextTurn

if TYPE_CHECKING:
    from .stack import Stack

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
# A use count below this is dropped (its expert counts as unseen).
FREQUENCY_FLOOR = 0.01
# The native extension's loops (csrc/eviction.cpp, csrc/policy.cpp), where built: a stack's ranking, the
# victim search's loop over the layers (which ranks stacks as the first does), the decay (in place
# where it may: every step walks every count, a few hundred to tens of thousands).
_NATIVE_STACK_BEST = _ext.native_function("stack_best")
_NATIVE_DECAY = _ext.native_function("decay_counts_in_place") or _ext.native_function("decay_counts")
_NATIVE_VICTIM = _ext.native_function("victim_search")
# A guess's experts' cache keys in every stack of its layer (csrc/policy.cpp), every layer of every
# decode step: one call where the interpreter took a step per key.
_NATIVE_KEYS = _ext.native_function("expert_keys")
# The step's end in one walk of the stacks (csrc/bookkeeping.cpp): each layer's reuse rate measured,
# and every stack's experts used this step made its last step's.
_NATIVE_REUSE = _ext.native_function("measure_reuse")
# Probability of use given to an expert with no recorded use, so the cyclic distance still orders them.
UNSEEN_USE = 0.02
# A guess's copy may evict only a copy whose next use is expected at least this many cycles of
# layers away: one that is likelier to be read before the guess is never given up for it.
SPECULATE_VICTIM_CYCLES = 2.0


def _distance(where, here: int, count: int) -> float:
    """Layers from the current one (at ``here``) to the layer at ``where`` in a cycle of ``count``:
    a whole cycle for the current layer itself, half a layer for one not yet placed."""
    return (where - here) % count or count if where is not None else 0.5


class _SpareRoomOnly:
    """``ExpertEviction.in_spare_room_only``: the mode in which copies issued take only spare room,
    for the duration of ``run(copy, *args)`` (the speculator's guesses) or of a ``with`` block.

    ``run`` sets and resets the mode with plain stores around a ``try``, never in a call of its own:
    Python raises a Ctrl-C where it checks for signals (a function's entry, the return of a call, a
    loop's back edge), so one that lands before the reset lands inside the ``try``. As a
    ``contextlib`` generator the block could be cut in its ``__enter__`` after the mode was set, or
    at its ``__exit__``'s entry before the reset; the mode then stayed on (for as long as the
    traceback lived, or for good), every later eviction spare-room-only, and an op's own page
    failed with a ``BudgetError``. (``__exit__`` still has that entry: ``with`` is for tests.)"""

    __slots__ = ("eviction", "next_use")

    def __init__(self, eviction: "ExpertEviction", next_use):
        self.eviction, self.next_use = eviction, next_use

    def run(self, copy, *args):
        eviction = self.eviction
        eviction._spare_room_only, eviction._ahead_distance = True, self.next_use
        try:
            return copy(*args)
        finally:
            eviction._spare_room_only, eviction._ahead_distance = False, None

    def __enter__(self) -> None:
        self.eviction._spare_room_only, self.eviction._ahead_distance = True, self.next_use

    def __exit__(self, *exc) -> None:
        self.eviction._spare_room_only, self.eviction._ahead_distance = False, None


class ExpertEviction:
    """Use frequencies, per-layer reuse and the index of cached experts by coldness: the victim."""

    __slots__ = ("by_master", "layers", "frequency", "_spare_room_only", "_guarded", "_clock", "_last", "_coldest",
                 "_reuse", "_ahead_distance", "next_turn", "_kept", "_groups", "_grouped")

    def __init__(self, by_master: dict, layers):
        self.by_master = by_master  # master id -> Stack (ExpertStacks' own dict)
        self.layers = layers  # ExpertStacks' LayerOrder: the layer paged now, what its op pages, the cycle
        self.frequency: dict = {}  # cache key -> decayed use count (experts only)
        # Copying a guess ahead of its use: such a copy may only take a copy whose next use is
        # expected far away (victim).
        self._spare_room_only = False
        # group -> keys the guess for that layer (made when the layer before it routed) names: kept
        # from eviction until the layer pages (guard), as its own routed experts are once it does
        self._guarded = {}
        # Eviction's index (see victim): every cached copy's last use, as a tick of this clock
        # (the pager's LRU order), and per stack its copies by use frequency.
        self._clock = 0
        self._last: dict = {}  # cache key -> tick of its last use or copy
        self._coldest = ColdHeaps()
        self._reuse: dict = {}  # stack group -> its measured token-to-token locality (REUSE_PRIOR until measured)
        self._kept = KeptBest()  # each layer's best victim candidate from the last search
        self.next_turn = NextTurn(self._kept)  # predicted chances at a layer's next turn, where a learned map gives them
        # A guess's copy may evict only a copy whose expected next use is this many layers away or
        # more (None: twice the cycle); set by the speculator per guess.
        self._ahead_distance = None
        self._groups: dict = {}  # stack group -> its stacks (made from by_master as it grows)
        self._grouped = 0  # len(by_master) when _groups was made

    def touch(self, key) -> int:
        """``key`` was used or copied: its tick in the LRU order (returned)."""
        tick = self._clock = self._clock + 1
        self._last[key] = tick
        return tick

    def used(self, key, share: float, stack: "Stack", expert: int, current: bool) -> None:
        """An op paged ``expert`` of ``stack`` (``key``), ``share`` of its layer's tokens routed to it
        (1: the most); ``current``: whether ``stack``'s layer is the one paged now. Its tick in the
        LRU order, its use frequency and its record in the coldness index, in one call (``touch``
        and ``push`` inlined: the pager makes it for every expert it pages)."""
        tick = self._clock + 1
        self._clock = tick
        self._last[key] = tick
        frequency = self.frequency
        value = frequency[key] = frequency.get(key, 0.0) + share
        if not self._keeps(key, stack, current):  # (push, inlined)
            self._kept.changed_stack(stack)
        self._coldest.push(stack, key, expert, value, tick, self._last)

    def copied(self, key, stack: "Stack", expert: int, current: bool) -> None:
        """``expert`` of ``stack`` (``key``) was copied: ``touch`` and ``push`` in one call."""
        self.push(key, stack, expert, self.frequency.get(key, 0.0), self.touch(key), current)

    def push(self, key, stack: "Stack", expert: int, value: float, tick: int, current: bool) -> None:
        """``key`` (``expert`` of ``stack``) was used or copied: its record in the coldness index, with
        what the caller knows already (its frequency ``value``, its ``tick``, and whether its layer is
        the ``current`` one)."""
        if not self._keeps(key, stack, current):
            self._kept.changed_stack(stack)
        self._coldest.push(stack, key, expert, value, tick, self._last)

    def _keeps(self, key, stack: "Stack", current: bool) -> bool:
        """Whether ``stack``'s layer's ranking keeps ``key`` (no candidate of it, and no tie depends
        on it), so that a use or copy of it leaves the layer's kept best standing: the current
        layer's keeps the keys its op pages; another's, those its guess names (guard: the guess's
        own copies follow it, each a stack ranked anew for nothing otherwise)."""
        if current:
            needed = self.layers.needed
            return needed is not None and key in needed
        return key in self._guarded.get(stack.group, ())

    def evicted(self, key) -> None:
        self._last.pop(key, None)
        stack = self.by_master.get(key[0])
        if stack is not None:
            self._kept.changed_stack(stack)

    def entered(self, group) -> None:
        """``group``'s layer starts paging: its own routing says what it pages now."""
        self._guarded.pop(group, None)
        self._kept.changed(group)  # (its experts routed at its last turn are this turn's now)
        self._kept.changed(self.layers.current)  # (ranked keeping its op's experts, which it no longer pages)

    def guard(self, stacks: list, experts) -> None:
        """The guess of ``stacks``' layer, the next to run, names these experts: no copy made before
        that layer pages may evict them (on the trained test models a guessed expert is routed
        0.72-0.77 of the time, one ranked in the next k 0.16-0.18, any other under 0.06)."""
        if stacks:
            if _NATIVE_KEYS is not None and type(stacks) is list:
                self._guarded[stacks[0].group] = _NATIVE_KEYS(stacks, experts)
            else:
                self._guarded[stacks[0].group] = {s.key_of(int(e)) for s in stacks for e in experts}
            self._kept.changed(stacks[0].group)

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

        The pager's eviction policy (``pager.cache``, through ``ExpertStacks.victim``): ``view`` is
        its read-only view of the cached copies, ``candidates`` the evictable ones, least recently used first."""
        cache, cached = view.copies, view.by_master
        # Found through indexes rather than by comparing every cached copy: each stack's coldest
        # evictable copies come off its heap (the distance is the stack's), so a call costs a look
        # or two per stack with cached copies, not one per copy.
        plain = self._plain_victim(cached)
        if plain is not None:
            return plain
        position, count, here = self.layers.cycle()
        kept = self._kept
        self.stack_groups()  # (tracked by kept)
        if count != kept.count:
            kept.count = count
            kept.renew()
        if _NATIVE_VICTIM is not None:  # the same steps in the extension
            found = _NATIVE_VICTIM(kept, cache, cached, self.layers.current, self.layers.needed,
                                   *self.next_turn.tables(), self._guarded, position, here, count, self._coldest.heaps,
                                   self._last, self.frequency, self._reuse, REUSE_PRIOR, self.layers.ran,
                                   1.0 - FREQUENCY_DECAY, UNSEEN_USE)
        else:
            found = _search(self, cache, cached, position, count, here)
        if found is None:
            # Only copies to keep are left (prefetched, or the current layer's own): the scan
            # below ranks them, or refuses for a copy made ahead of its use.
            return _victim_scan(self, candidates)
        best, best_wait = found
        if self._spare_room_only and best_wait < self._ahead_limit(count):
            return None
        return best

    def in_spare_room_only(self, next_use=None) -> "_SpareRoomOnly":
        """Copies issued inside (guesses) are ahead of their use: they take only room whose next use
        is expected later than ``next_use`` layers (the guess's own, ``expected_next_use``) and at
        least SPECULATE_VICTIM_CYCLES cycles away (see ``victim``): ``.run(copy, *args)``, or ``with``."""
        return _SpareRoomOnly(self, next_use)

    def expected_next_use(self, stack: Stack, expert: int, chance: float) -> float:
        """Expected layers until a guessed ``expert`` of ``stack``'s layer is used: at that layer's
        next turn with ``chance`` (its guess's measured precision), else as any of the layer's
        experts is (the same estimate ``victim`` ranks cached copies by)."""
        position, count, here = self.layers.cycle()
        distance = _distance(position.get(stack.group), here, count)
        return distance + (1.0 - chance) * count / self._use(stack.key_of(expert))

    def _plain_victim(self, cached: dict):
        """The least recently used evictable copy that is not an expert, if any."""
        by_master, last = self.by_master, self._last
        if cached.keys() <= by_master.keys():
            return None  # every cached copy an expert's (dense weights resident): one pass in C, not a loop
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
        """How far away (layers) a victim's expected next use must be for a copy ahead of use: later
        than the guess's own, and at least SPECULATE_VICTIM_CYCLES cycles."""
        floor = SPECULATE_VICTIM_CYCLES * count
        return floor if self._ahead_distance is None else max(self._ahead_distance, floor)

    def _use(self, key) -> float:
        """The chance per turn that ``key``'s layer routes to it, estimated from its decayed use."""
        return min(1.0, max(self.frequency.get(key, 0.0) * (1.0 - FREQUENCY_DECAY), UNSEEN_USE))

    def _recent(self, stack: Stack) -> set:
        """The experts ``stack``'s layer routed at its last turn: this step's if it has run in it."""
        return stack.used if stack.group in self.layers.ran else stack.last_used

    def _ranked_by(self, stack: Stack):
        """(the chances ``stack``'s layer's next turn is predicted with, or None; the experts of it
        ranked one by one: its likeliest few, or those its layer routed at its last turn)."""
        chances = self.next_turn.of(stack.group)
        return chances, self._recent(stack) if chances is None else self.next_turn.likely(stack.group)

    def _next_use(self, key, stack: Stack, distance: float, count: int, recent: bool) -> float:
        """Expected layers until ``key`` is next used (see victim)."""
        q = self._use(key)
        chances = self.next_turn.of(stack.group)
        if chances is not None:
            p = chances[stack.expert_of(key)]
        else:
            p = max(q, self._reuse.get(stack.group, REUSE_PRIOR)) if recent else q
        return distance + (1.0 - p) * count / q

    def expected_use_of(self, key) -> float:
        """Expected layers from now until the cached expert ``key`` is used (what ``victim`` ranks by)."""
        stack = self.by_master[key[0]]
        position, count, here = self.layers.cycle()
        current = stack.group == self.layers.current
        distance = count if current else _distance(position.get(stack.group), here, count)
        recent = stack.expert_of(key) in self._recent(stack)
        return self._next_use(key, stack, distance, count, recent)

    def stack_groups(self) -> dict:
        """Stack group -> its stacks, in registration order (kept, not built per call)."""
        if self._grouped != len(self.by_master):
            groups = {}
            for stack in self.by_master.values():
                groups.setdefault(stack.group, []).append(stack)
            self._groups, self._grouped = groups, len(self.by_master)
            self._kept.track(groups)
        return self._groups

    def _best_of(self, stacks: list, cache, cached, keep, count: int):
        """The layer's best victim among ``_coldest_of``'s candidates of its stacks with cached
        copies: (its expected next use less its layer's distance, minus its last use's tick (the
        tie-break), the copy), or None. Each stack's own best is kept until it changes
        (``KeptBest.of_stack``)."""
        best = None
        of_stack, dirty = self._kept.of_stack, self._kept.dirty
        for stack in stacks:
            if stack in dirty:
                found = of_stack[stack] = self._stack_best(stack, cache, cached, keep, count)
                dirty.discard(stack)
            else:
                found = of_stack[stack]
            if found is not None and (best is None or found[:2] > best[:2]):
                best = found
        return best

    def _stack_best(self, stack: Stack, cache, cached, keep, count: int):
        """``_best_of`` for one stack: the native extension's steps where built (the same), else these."""
        if not cached.get(stack.master_id):
            return None
        if _NATIVE_STACK_BEST is not None:
            chances, recent = self._ranked_by(stack)
            reuse = self._reuse.get(stack.group, REUSE_PRIOR)
            return _NATIVE_STACK_BEST(self._coldest.heap_of(stack), stack.keys, cache, self._last, self.frequency, keep,
                                      recent, chances, count, reuse, 1.0 - FREQUENCY_DECAY, UNSEEN_USE)
        best = None
        for entry, recent in _coldest_of(self, stack, cache, keep):
            found = (self._next_use(entry.key, stack, 0.0, count, recent), -self._last.get(entry.key, -1), entry)
            if best is None or found[:2] > best[:2]:
                best = found
        return best

    def decay(self) -> None:
        """A forward begins: decay use frequencies (a loop over every expert used in the last few
        hundred steps: the native extension's where built, the same arithmetic)."""
        self._kept.renew()
        (_NATIVE_DECAY or _decay_counts)(self.frequency, FREQUENCY_DECAY, FREQUENCY_FLOOR)
        self._coldest.decay(FREQUENCY_DECAY, self.frequency, self.by_master)

    def measure_reuse(self, turn: bool = False) -> None:
        """Update each layer's token-to-token locality from the step that ended: the share of its
        last step's experts that it routed again. Only steps that routed as many experts as the one
        before count (one-token decode steps; a prefill routes to most experts of a layer). With
        ``turn`` (``ExpertStacks.step``), every stack's experts used this step then become its last
        step's, in the same walk (the native extension's where built: the same rates, bit for bit)."""
        if _NATIVE_REUSE is not None:
            _NATIVE_REUSE(self.by_master, self._reuse, REUSE_DECAY, REUSE_PRIOR, turn)
            return
        seen = set()
        for stack in self.by_master.values():
            if stack.group in seen or not stack.used or len(stack.used) != len(stack.last_used):
                continue
            seen.add(stack.group)
            share = len(stack.used & stack.last_used) / len(stack.used)
            self._reuse[stack.group] = REUSE_DECAY * self._reuse.get(stack.group, REUSE_PRIOR) + (1 - REUSE_DECAY) * share
        if turn:
            for stack in self.by_master.values():
                stack.last_used, stack.used = stack.used, set()

    def step(self) -> None:
        """A step ended: the guards of its guesses lapse with it (and every stack's candidates)."""
        self._guarded = {}
        self._kept.renew()


def _search(eviction: "ExpertEviction", cache, cached, position: dict, count: int, here: int):
    """``victim``'s loop over the layers: each stale layer's best found anew, the layers' bests
    compared; (the copy, its expected wait) or None."""
    current, needed = eviction.layers.current, eviction.layers.needed
    kept, guarded = eviction._kept, eviction._guarded
    bests, stale, stacks_of = kept.best, kept.stale, kept.stacks
    while True:
        best, best_wait, best_tie, best_i = None, None, None, -1
        for i, group in enumerate(kept.groups):
            if group == current:
                if needed is None:
                    continue  # the op did not say what it pages: any of the layer's may be next
                chances = eviction.next_turn.of(group)
                with_ = kept.current
                ranked_with = with_ is not None and with_[0] == group and with_[1] is needed and with_[2] is chances
                if not ranked_with:
                    kept.dirty.update(stacks_of[i])  # ranked keeping other keys, or other chances: anew
                if stale[i] or not ranked_with:
                    bests[i], stale[i] = eviction._best_of(stacks_of[i], cache, cached, needed, count), False
                    kept.current = (group, needed, chances)
                distance = count
            else:
                if stale[i]:
                    bests[i] = eviction._best_of(stacks_of[i], cache, cached, guarded.get(group), count)
                    stale[i] = False
                distance = _distance(position.get(group), here, count)
            found = bests[i]
            if found is not None:
                wait = distance + found[0]
                if best is None or wait > best_wait or (wait == best_wait and found[1] > best_tie):
                    best, best_wait, best_tie, best_i = found[2], wait, found[1], i
        if best is None:
            return None
        if cache.get(best.key) is best and not best.users and not best.prefetched:
            return best, best_wait
        kept.changed(kept.groups[best_i])  # its kept best left the cache or is in use: rank the layer anew


def _decay_counts(counts: dict, factor: float, floor: float) -> None:
    """Every count times ``factor``; those below ``floor`` dropped."""
    for key in list(counts):
        value = counts[key] * factor
        if value < floor:
            del counts[key]
        else:
            counts[key] = value


def _coldest_of(eviction: "ExpertEviction", stack: "Stack", cache, needed):
    """``stack``'s candidates for eviction, as (entry, routed at its layer's last turn): the
    least used evictable copy its layer did not route at its last turn (off the heap) and the
    least used one it did (few: scanned). Where its next turn is predicted, the likeliest few
    take the place of the last turn's (the one whose use is expected latest). With ``needed``
    (the current layer's), what its op pages is kept."""
    chances, recent = eviction._ranked_by(stack)
    out = []
    best, best_rank = None, None
    keys, frequency, last, per_turn = stack.keys, eviction.frequency, eviction._last, 1.0 - FREQUENCY_DECAY
    for e in recent:  # (a victim search runs this for every stack: _use inlined)
        key = keys[e]
        entry = cache.get(key)
        if entry is None or entry.users or entry.prefetched or (needed is not None and key in needed):
            continue
        rank = frequency.get(key, 0.0)
        if chances is not None:
            rank *= per_turn
            rank = (chances[e] - 1.0) / (UNSEEN_USE if rank < UNSEEN_USE else 1.0 if rank > 1.0 else rank)
        # (ties to the older use, as _best_of breaks them: not to the set's order, which an
        # expert added to it may change)
        if best is None or rank < best_rank or (rank == best_rank and last.get(key, -1) < last.get(best.key, -1)):
            best, best_rank = entry, rank
    if best is not None:
        out.append((best, chances is None))

    coldest = eviction._coldest.coldest(stack, cache, eviction._last, needed, recent)
    if coldest is not None:
        out.append((coldest, False))
    return out


def _victim_scan(eviction: "ExpertEviction", candidates):
    """``ExpertEviction.victim`` by comparing the evictable copies one by one, least recently used
    first: the fallback when the indexes offer nothing (copies the index has no record of, such as
    those cached before the registry was rebuilt, or only copies to keep). Copies to keep (unused
    prefetches, the current op's experts) rank below every other, the furthest expected first."""
    layers = eviction.layers
    position, count, here = layers.cycle()
    current, needed = layers.current, layers.needed
    best, best_score = None, None
    for seen, entry in enumerate(candidates):
        if seen >= VICTIM_WINDOW:
            break
        stack = eviction.by_master.get(entry.key[0])
        if stack is None:
            if not entry.prefetched:
                return entry
            score = (0, 0.0)
        else:
            current_layer = stack.group == current
            guarded = eviction._guarded.get(stack.group, ())
            keep = entry.prefetched or (current_layer and (needed is None or entry.key in needed)) \
                or entry.key in guarded
            distance = count if current_layer else _distance(position.get(stack.group), here, count)
            recent = stack.expert_of(entry.key) in eviction._recent(stack)
            score = (0 if keep else 1, eviction._next_use(entry.key, stack, distance, count, recent))
        if best is None or score > best_score:
            best, best_score = entry, score
    if eviction._spare_room_only and best is not None and (best_score[0] == 0 or best_score[1] < eviction._ahead_limit(count)):
        return None
    return best


def order(eviction: ExpertEviction, view, candidates) -> list:
    """Every evictable copy, the first to evict first, as ``eviction.victim`` ranks them: copies
    that are no expert first (least recently used first), then experts by expected next use,
    furthest first, copies to keep (unused prefetches, the current op's experts, guarded ones)
    last. The pager ranks runs of the arena's ranges by it when a copy needs one free range. For a
    copy made ahead of its use (``in_spare_room_only``) only the copies ``victim`` would give it
    are listed: the others are as good as in use."""
    position, count, here = eviction.layers.cycle()
    current, needed = eviction.layers.current, eviction.layers.needed
    limit = eviction._ahead_limit(count) if eviction._spare_room_only else None
    scored = []
    for lru, entry in enumerate(candidates):
        stack = eviction.by_master.get(entry.key[0])
        if stack is None:
            score = (0, 0.0) if entry.prefetched else (2, -lru)
        else:
            current_layer = stack.group == current
            keep = entry.prefetched or (current_layer and (needed is None or entry.key in needed)) \
                or entry.key in eviction._guarded.get(stack.group, ())
            distance = count if current_layer else _distance(position.get(stack.group), here, count)
            recent = stack.expert_of(entry.key) in eviction._recent(stack)
            score = (0 if keep else 1, eviction._next_use(entry.key, stack, distance, count, recent))
            if limit is not None and (keep or score[1] < limit):
                continue
        scored.append((score, entry))
    scored.sort(key=lambda pair: pair[0], reverse=True)
    return [entry for _, entry in scored]
