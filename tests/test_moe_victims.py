"""The expert cache's victim search keeps each stack's candidates from one search to the next
(``eviction_index.KeptBest``) only while they are what a search from scratch would find: a decode
evicts exactly the same experts, in the same order, with them as without them. Each stack's
coldest copy comes off a heap of use records (``eviction_index.ColdHeaps``) that holds no copy a search
may not take and no record the garbage collector walks. The search's loop over the layers and each
stack's ranking run in the native extension where it is built, deciding as the interpreter's."""

from __future__ import annotations

import pytest
import torch

from offtensor.moe import eviction

pytest.importorskip("transformers")
from test_moe_predictor import _decode, _qwen3, _wrap_quarter  # noqa: E402  (a tiny Qwen3-MoE, a quarter of its experts cached)


def _victims(monkeypatch, kept: bool) -> list:
    chosen = []
    search = eviction.ExpertEviction.victim

    def victim(self, view, room, candidates):
        if not kept:
            self._kept.renew()  # every layer ranked anew: a search from scratch
        entry = search(self, view, room, candidates)
        chosen.append(None if entry is None else entry.key)
        return entry

    with monkeypatch.context() as m:
        m.setattr(eviction.ExpertEviction, "victim", victim)
        model = _wrap_quarter(_qwen3())
        logits = _decode(model, 12)
    return chosen, logits


def test_kept_candidates_evict_what_a_search_from_scratch_evicts(monkeypatch):
    fresh, fresh_logits = _victims(monkeypatch, kept=False)
    kept, kept_logits = _victims(monkeypatch, kept=True)
    assert len(fresh) > 20  # the budget makes the decode evict
    assert _relative(kept) == _relative(fresh)
    assert all(a.equal(b) for a, b in zip(kept_logits, fresh_logits))


def _relative(keys: list) -> list:
    """Victim keys with master ids numbered by first appearance (each run wraps its own model)."""
    ids = {}
    out = []
    for k in keys:
        if k is None:
            out.append(None)
            continue
        out.append((ids.setdefault(k[0], len(ids)),) + tuple(k[1:]))
    return out


def _heap_stack():
    from types import SimpleNamespace

    from offtensor.pager import cache_key

    keys = tuple(cache_key(7, torch.float32, 16 * e, 16 * (e + 1)) for e in range(4))
    return SimpleNamespace(master_id=7, keys=keys, num_experts=4)


def test_the_coldest_copy_is_the_least_used_one_a_search_may_take():
    from types import SimpleNamespace

    stack, heaps, last = _heap_stack(), eviction.ColdHeaps(), {}
    cache = {k: SimpleNamespace(key=k, users=0, prefetched=False) for k in stack.keys}
    for tick, (e, frequency) in enumerate([(0, 3.0), (1, 0.5), (2, 1.0), (3, 2.0)]):
        last[stack.keys[e]] = tick
        heaps.push(stack, stack.keys[e], e, frequency, tick, last)
    assert heaps.coldest(stack, cache, last, None, set()) is cache[stack.keys[1]]
    assert heaps.coldest(stack, cache, last, None, {1}) is cache[stack.keys[2]]  # routed at its last turn
    assert heaps.coldest(stack, cache, last, {stack.keys[1], stack.keys[2]}, set()) is cache[stack.keys[3]]  # the op's
    cache[stack.keys[3]].users = 1
    cache[stack.keys[0]].prefetched = True
    assert heaps.coldest(stack, cache, last, None, {1, 2}) is None  # in use, or copied ahead and unused
    last[stack.keys[1]] = 9  # used again since its record: the record is stale
    assert heaps.coldest(stack, cache, last, None, set()) is cache[stack.keys[2]]


def test_a_copy_of_part_of_an_expert_is_found_by_its_own_key():
    from types import SimpleNamespace

    from offtensor.pager import cache_key

    stack, heaps = _heap_stack(), eviction.ColdHeaps()
    half = cache_key(7, torch.float32, 32, 40)  # the first half of expert 2
    cache = {half: SimpleNamespace(key=half, users=0, prefetched=False)}
    last = {half: 0}
    heaps.push(stack, half, 2, 1.0, 0, last)
    assert heaps.coldest(stack, cache, last, None, set()) is cache[half]
    assert heaps.coldest(stack, cache, last, None, {2}) is None  # its expert, routed at its last turn


def test_the_native_ranking_finds_a_copy_of_part_of_an_expert_by_its_own_key():
    from types import SimpleNamespace

    from offtensor.pager import cache_key

    native = eviction._NATIVE_STACK_BEST
    if native is None:
        pytest.skip("the native extension is not built with the stack ranking")
    stack, heaps = _heap_stack(), eviction.ColdHeaps()
    half = cache_key(7, torch.float32, 32, 40)  # the first half of expert 2
    cache = {half: SimpleNamespace(key=half, users=0, prefetched=False)}
    last, frequency = {half: 5}, {half: 50.0}
    heaps.push(stack, half, 2, 50.0, 5, last)
    rank = lambda recent, chances=None: native(  # noqa: E731
        heaps.heap_of(stack), stack.keys, cache, last, frequency, None, recent, chances, 4, 0.4, 0.02, 0.02)
    # Used 50 times: a chance of 1 a turn, so its next use is its layer's next turn (distance 0 here).
    assert rank(set()) == (0.0, -5, cache[half])
    assert rank({2}) is None  # its expert, routed at its last turn: kept
    chances = [0.0, 0.0, 0.25, 0.0]  # a next-token map: expert 2 (its expert) a quarter likely
    assert rank(set(), chances) == (0.75 * 4, -5, cache[half])
    assert len(heaps.heap_of(stack)) == 1  # the record went back


def test_the_records_of_whole_experts_are_not_tracked_by_the_garbage_collector():
    # One record is pushed per use of an expert, thousands alive at a time: records the cyclic
    # collector tracked would be walked at every collection and bring full collections sooner.
    import gc

    stack, heaps, last = _heap_stack(), eviction.ColdHeaps(), {}
    for e in range(4):
        last[stack.keys[e]] = e
        heaps.push(stack, stack.keys[e], e, 1.0 + e, e, last)
    gc.collect()
    assert not any(gc.is_tracked(record) for record in heaps._heaps[7])


def test_a_pass_that_has_paged_no_layer_yet_is_placed_in_the_last_passs_cycle():
    """A copy made before a pass's first layer pages (the first layer guessed from the step's
    tokens) ranks the cached experts in the last pass's cycle of layers, its last layer the one that
    ran last: the first layer runs next, the last is a whole cycle away, and a copy ahead of use
    takes only room SPECULATE_VICTIM_CYCLES cycles away (not a cycle of one layer)."""
    from offtensor.moe.stack import LayerOrder

    order = LayerOrder()
    assert order.cycle()[1:] == (1, 0)  # the first pass: no cycle learned yet
    for group in ("a", "b", "c"):
        order.enter(group)
    order.step()
    position, count, here = order.cycle()
    assert (count, here) == (3, 2)
    assert eviction._distance(position["a"], here, count) == 1
    assert eviction._distance(position["c"], here, count) == 3
    policy = eviction.ExpertEviction({}, order)
    with policy.in_spare_room_only():
        assert policy._ahead_limit(count) == eviction.SPECULATE_VICTIM_CYCLES * 3
    order.enter("a")
    assert order.cycle()[1:] == (3, 0)


def _decode_a_quarter(predicted: bool) -> None:
    """16 decode steps of the tiny Qwen3-MoE with a quarter of its experts cached, ranked by use, or
    (``predicted``) by a next-token map's chances."""
    from test_moe_next_turn import _decode as _decode_tokens
    from test_moe_next_turn import _predicting
    from test_moe_next_turn import _wrap_quarter as _wrap_experts

    from offtensor.model.state import pager_of
    from offtensor.moe.predictor import install

    model = _wrap_experts(_qwen3())
    if predicted:
        install(pager_of(model), _predicting([1, 2]))
    _decode_tokens(model, 16)


@pytest.mark.parametrize("predicted", [False, True], ids=["by use", "next-token map"])
def test_the_native_stack_ranking_finds_the_interpreters_candidate(monkeypatch, predicted):
    """Which steps rank a stack in a victim search is a matter of speed only: over a decode at a
    quarter of the experts (ranked by use frequency and reuse, or by a next-token map's chances),
    every ranking in the native extension finds the same copy, with the same expected wait and
    tie-break, as the interpreter's steps on the same state."""
    native = eviction._NATIVE_STACK_BEST
    if native is None:
        pytest.skip("the native extension is not built with the stack ranking")
    monkeypatch.setattr(eviction, "_NATIVE_VICTIM", None)  # the interpreter's loop over the layers ranks each stack here
    rankings, real = [], eviction.ExpertEviction._stack_best

    def both(self, stack, cache, cached, keep, count):
        got = real(self, stack, cache, cached, keep, count)
        monkeypatch.setattr(eviction, "_NATIVE_STACK_BEST", None)
        want = real(self, stack, cache, cached, keep, count)
        monkeypatch.setattr(eviction, "_NATIVE_STACK_BEST", native)
        rankings.append((got, want, self.next_turn.of(stack.group) is not None))
        return got

    monkeypatch.setattr(eviction.ExpertEviction, "_stack_best", both)
    _decode_a_quarter(predicted)
    found = [(got, want) for got, want, _ in rankings if got is not None or want is not None]
    assert len(found) > 50 and (not predicted or sum(p for *_, p in rankings) > 20)
    assert all(got is not None and want is not None and got[:2] == want[:2] and got[2] is want[2] for got, want in found)


def test_a_malformed_coldness_record_is_an_error_that_leaves_the_heap_whole():
    # The native ranking walks the heap as ColdHeaps.coldest does: records of copies in use are
    # set aside, and go back however the walk ends (here: a record with no expert under them).
    import heapq
    from types import SimpleNamespace

    native = eviction._NATIVE_STACK_BEST
    if native is None:
        pytest.skip("the native extension is not built with the stack ranking")
    stack, heaps, last = _heap_stack(), eviction.ColdHeaps(), {}
    cache = {k: SimpleNamespace(key=k, users=1, prefetched=False) for k in stack.keys}  # every copy in use
    for tick, e in enumerate(range(4)):
        last[stack.keys[e]] = tick
        heaps.push(stack, stack.keys[e], e, float(e), tick, last)
    heap = heaps.heap_of(stack)
    heapq.heappush(heap, (9.0, 99))  # the coldest-last record, and no expert in it
    before = sorted(heap)
    with pytest.raises(TypeError, match="coldness record"):
        native(heap, stack.keys, cache, last, {}, None, set(), None, 4, 0.4, 0.02, 0.02)
    assert sorted(heap) == before
    cache[stack.keys[2]].users = 0  # one copy may go now: found before the bad record surfaces
    assert native(heap, stack.keys, cache, last, {}, None, set(), None, 4, 0.4, 0.02, 0.02)[2] is cache[stack.keys[2]]
    assert sorted(heap) == before


def _kept_state(kept):
    return (list(kept.best), list(kept.stale), set(kept.dirty), dict(kept.of_stack), kept.current, kept.count)


def _restore(kept, state):
    kept.best[:], kept.stale[:] = state[0], state[1]
    kept.dirty, kept.of_stack, kept.current, kept.count = set(state[2]), dict(state[3]), state[4], state[5]


def _same_kept(a, b) -> bool:
    def bests(state):
        return [None if x is None else (x[0], x[1], id(x[2])) for x in state[0]]

    return (bests(a) == bests(b) and a[1] == b[1] and a[2] == b[2]
            and {s: None if x is None else (x[0], x[1], id(x[2])) for s, x in a[3].items()}
            == {s: None if x is None else (x[0], x[1], id(x[2])) for s, x in b[3].items()} and a[4:] == b[4:])


@pytest.mark.parametrize("predicted", [False, True], ids=["by use", "next-token map"])
def test_the_native_victim_search_evicts_what_the_interpreters_does(monkeypatch, predicted):
    """The victim search's loop over the layers in the native extension: over a decode (by use, or
    with a next-token map's chances), every search picks the same copy as the interpreter's loop on
    the same state and leaves the same kept candidates; so does a search whose kept pick is in use
    without its layer marked stale (ranked anew there, as here)."""
    native = eviction._NATIVE_VICTIM
    if native is None or eviction._NATIVE_STACK_BEST is None:
        pytest.skip("the native extension is not built with the victim search")
    real, compared, retried = eviction.ExpertEviction.victim, [], []

    def interpreted(self, view, room, candidates):
        monkeypatch.setattr(eviction, "_NATIVE_VICTIM", None)
        try:
            return real(self, view, room, candidates)
        finally:
            monkeypatch.setattr(eviction, "_NATIVE_VICTIM", native)

    def both(self, view, room, candidates):
        candidates, kept = list(candidates), self._kept
        before = _kept_state(kept)
        got, after_native = real(self, view, room, candidates), _kept_state(kept)
        _restore(kept, before)
        want = interpreted(self, view, room, candidates)
        compared.append((got is want, _same_kept(after_native, _kept_state(kept))))
        if want is not None and self.by_master.get(want.key[0]) is not None and len(compared) % 5 == 0:
            _restore(kept, before)  # the same search with its pick in use, its layer not marked stale
            want.users += 1
            try:
                got_busy = real(self, view, room, candidates)
                after_native = _kept_state(kept)
                _restore(kept, before)
                want_busy = interpreted(self, view, room, candidates)
                retried.append((got_busy is want_busy and got_busy is not want, _same_kept(after_native, _kept_state(kept))))
            finally:
                want.users -= 1
            _restore(kept, before)
            want = real(self, view, room, candidates)
        return want

    monkeypatch.setattr(eviction.ExpertEviction, "victim", both)
    _decode_a_quarter(predicted)
    assert len(compared) > 20 and len(retried) > 3
    assert all(same and kept_same for same, kept_same in compared)
    assert all(same and kept_same for same, kept_same in retried)


def _guarded_policy():
    """An ExpertEviction over one stack of 4 experts (group "g"), its kept bests all found."""
    from offtensor.moe.stack import LayerOrder

    class Stack:  # (hashable: kept bests are by stack)
        pass

    stack = Stack()
    stack.__dict__.update(vars(_heap_stack()), group="g")
    stack.key_of = stack.keys.__getitem__
    policy = eviction.ExpertEviction({stack.master_id: stack}, LayerOrder())
    policy.stack_groups()
    return policy, stack


def test_a_copy_of_an_expert_its_layers_guess_names_ranks_no_stack_anew():
    """The experts a layer's guess names are kept from eviction (guard), so the guess's own copies
    of them change nothing the layer is ranked by: its stack's kept best stands. A copy of any
    other expert marks the stack to be ranked anew at the next search."""
    policy, stack = _guarded_policy()
    policy.guard([stack], [1])
    policy._kept.dirty.clear()
    policy.copied(stack.keys[1], stack, 1, False)  # (its layer is not the one paged now)
    assert stack not in policy._kept.dirty
    policy.copied(stack.keys[2], stack, 2, False)
    assert stack in policy._kept.dirty


def test_with_only_experts_cached_no_masters_copies_are_walked_for_a_plain_victim():
    """A victim search first looks for a cached copy that is no expert's; where every cached master
    is an expert stack (dense weights resident) that is one comparison of the masters, not a walk
    over them."""
    from types import SimpleNamespace

    policy, stack = _guarded_policy()

    class NoWalk(dict):
        def items(self):
            raise AssertionError("walked the cached masters")

    assert policy._plain_victim(NoWalk({stack.master_id: [SimpleNamespace(key=stack.keys[0])]})) is None
    plain = SimpleNamespace(key=(8, torch.float32, 0, 4), users=0, prefetched=False)
    assert policy._plain_victim({stack.master_id: [], 8: [plain]}) is plain


def test_the_native_ranking_leaves_the_heap_arranged_as_heapqs_steps_do():
    """The native ranking pops and pushes a stack's heap of use records in C, comparing records as
    Python compares tuples: after a walk that sets copies in use aside and drops stale records, the
    list is in the very order ColdHeaps.coldest's heapq steps leave it, with records whose values tie
    (the tick decides), are ints or big ints (compared by the interpreter)."""
    import heapq
    from types import SimpleNamespace

    from offtensor.pager import cache_key

    native = eviction._NATIVE_STACK_BEST
    if native is None:
        pytest.skip("the native extension is not built with the stack ranking")
    keys = tuple(cache_key(7, torch.float32, 16 * e, 16 * (e + 1)) for e in range(40))
    stack = SimpleNamespace(master_id=7, keys=keys, num_experts=40)
    cache = {k: SimpleNamespace(key=k, users=0, prefetched=False) for k in keys}
    last, heap = {}, []
    for tick in range(120):
        e = (tick * 7) % 40
        last[keys[e]] = tick
        value = [float(tick % 5), tick % 3, 2 ** 70 + tick % 4][tick % 3] if tick % 11 else 0.5
        heapq.heappush(heap, (value, tick, e))
    for e in range(0, 40, 3):
        cache[keys[e]].users = 1  # in use: set aside and pushed back
    del cache[keys[5]]  # evicted: its records are stale
    ours = list(heap)
    heaps = eviction.ColdHeaps()
    heaps._heaps[7] = theirs = list(heap)
    found = native(ours, keys, cache, last, {}, None, {1, 2}, None, 4, 0.4, 0.02, 0.02)
    assert found[2] is heaps.coldest(stack, cache, last, None, {1, 2})
    assert ours == theirs


def test_the_native_ranking_reads_a_changed_class_anew():
    """The native ranking reads a copy's users and prefetched at their slots once it knows the
    class keeps them there; an attribute of the class set since (its version renewed) is read as
    the interpreter reads it."""
    native = eviction._NATIVE_STACK_BEST
    if native is None:
        pytest.skip("the native extension is not built with the stack ranking")

    class Copy:
        __slots__ = ("key", "users", "prefetched")

        def __init__(self, key):
            self.key, self.users, self.prefetched = key, 0, False

    stack, heaps, last = _heap_stack(), eviction.ColdHeaps(), {}
    cache = {k: Copy(k) for k in stack.keys}
    for e in range(4):
        last[stack.keys[e]] = e
        heaps.push(stack, stack.keys[e], e, float(e), e, last)
    rank = lambda: native(heaps.heap_of(stack), stack.keys, cache, last, {}, None, set(), None, 4, 0.4, 0.02, 0.02)  # noqa: E731
    assert rank()[2] is cache[stack.keys[0]]
    Copy.users = property(lambda self: 1)  # every copy in use now
    assert rank() is None
