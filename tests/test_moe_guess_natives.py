"""The guess path's host work in the native extension (csrc/guesses.cpp, csrc/guess_records.cpp and
the tensor read of csrc/offtensor.cpp) decides as the interpreter's steps, a matter of speed only: a
guess's ranked bins and a next-token map's chances read from the scores' tensor are the same as
from its ``tolist()`` rows, bit for bit, for every dtype and layout; (expert, confidence) pairs are
ranked and binned, and a layer's likeliest experts picked, alike; the gate, the copy candidates, the
scoring of open guesses and a step's close leave every record of a router and the shared pool the
same, bit for bit; a guess guards the same keys; and a decode with guesses reads none of its scores
through ``tolist()``, with the interpreter's logits and statistics. Besides, the speculator's per-page
and per-step bookkeeping does only what changed: each expert paged is a call into C, and the maps
made from a pass's firing order are made again only when it changes."""

from __future__ import annotations

import copy
import random
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from offtensor import _ext
from offtensor.moe import eviction, eviction_index, guesses, prefetch, speculation

NATIVES = ((guesses, "_NATIVE_GUESS"), (guesses, "_NATIVE_CHANCES"), (guesses, "_NATIVE_BINS"), (guesses, "_NATIVE_RANKED"),
           (guesses, "_NATIVE_PAYING"), (guesses, "_NATIVE_WORTH"), (guesses, "_NATIVE_SCORE"), (guesses, "_NATIVE_CLOSE"),
           (speculation, "_NATIVE_CACHED"), (eviction, "_NATIVE_KEYS"), (eviction_index, "_NATIVE_LIKELIEST"),
           (guesses, "_NATIVE_OPEN"), (prefetch, "_NATIVE_KEYS"))


def _native_or_skip():
    if not _ext.NATIVE:
        pytest.skip("the native extension is not built")


def _interpreted(monkeypatch, fn, *args):
    """``fn(*args)`` with every loop of the guess path the interpreter's."""
    with monkeypatch.context() as m:
        for module, name in NATIVES:
            m.setattr(module, name, None, raising=False)
        return fn(*args)


def _scores(g, dtype, rows, width, layout):
    s = (torch.randn(rows, width + 4, generator=g) * 4).to(dtype)
    s[:, : width // 4] = s[:, : width // 4].round()  # (ties among a row's scores)
    if layout == "slice":
        return s[:, 2 : 2 + width]  # (a column slice: rows strided past their width)
    if layout == "transposed":
        return s[:, :width].t().contiguous().t()  # (columns strided)
    if layout == "flat":
        return s[0, :width].contiguous()  # (one row, 1-D)
    return s[:, :width].contiguous()


def test_a_guess_read_from_its_tensor_gives_the_interpreters_bins_and_chances_bit_for_bit(monkeypatch):
    """Each dtype a look-ahead's scores come in, each layout, columns and top-k: the native pass over
    the tensor's own memory ranks and bins the same experts in the same order as the interpreter's
    steps over its ``tolist()`` rows, and its next-token chances are the same floats."""
    _native_or_skip()
    g = torch.Generator().manual_seed(0)
    cases = 0
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for layout in ("contiguous", "slice", "transposed", "flat"):
            for rows in (1, 3):
                scores = _scores(g, dtype, rows, 48, layout)
                for lo, hi in ((None, 16), (16, 32), (32, None), (0, 48)):
                    for top_k in (0, 1, 4, 8, None, 300, -2):
                        native = guesses.guess_bins(scores, lo, hi, top_k)
                        assert isinstance(native, dict)
                        want = _interpreted(monkeypatch, guesses.guess_bins, scores, lo, hi, top_k)
                        assert list(native.items()) == list(want.items()), (dtype, layout, rows, lo, hi, top_k)
                        assert list(guesses.guess_bins(guesses.host_rows(scores), lo, hi, top_k).items()) == list(want.items())
                        cases += 1
                for lo in (0, 16, 32):
                    native = guesses.host_chances(scores, lo)
                    want = _interpreted(monkeypatch, guesses.host_chances, scores, lo)
                    assert [v.hex() for v in native] == [v.hex() for v in want], (dtype, layout, lo)
    assert cases == 4 * 4 * 2 * 4 * 7


def test_scores_the_native_read_leaves_alone_take_the_interpreters_steps():
    """A tensor the native read does not cover (three dims, integers) is read through ``tolist()``
    as before; a row whose probabilities are NaN, whose order only the interpreter's sort defines,
    is left to the interpreter's steps."""
    _native_or_skip()
    wide = torch.randn(1, 1, 12, generator=torch.Generator().manual_seed(1))
    assert guesses._NATIVE_BINS(wide, None, None, 4, guesses._EDGES) is None
    assert guesses.guess_bins(wide, None, None, 4) == guesses.guess_bins(guesses.host_rows(wide), None, None, 4)
    assert guesses._NATIVE_CHANCES(wide, 0) is None
    assert guesses.host_chances(wide) == guesses.host_chances(guesses.host_rows(wide))
    ints = torch.tensor([[3, 1, 2, 0]])
    assert list(guesses.guess_bins(ints, None, None, 2)) == [0, 2]
    nan = torch.tensor([[0.5, float("nan"), 1.0, 2.0]])
    assert guesses._NATIVE_BINS(nan, None, None, 2, guesses._EDGES) is None
    assert len(guesses.guess_bins(nan, None, None, 2)) == 2


def test_the_native_ranking_of_pairs_and_of_a_layers_likeliest_experts_is_the_interpreters(monkeypatch):
    """A token table's (expert, confidence) pairs, with ties and repeated experts, get the same bins
    in the same order; a next-token map's likeliest experts are the same set, ties at the edge
    going to the higher expert as the interpreter's stable sort leaves them."""
    _native_or_skip()
    rng = random.Random(2)
    for trial in range(300):
        pairs = [(rng.randrange(12), rng.choice([0.05, 0.1, 0.35, 0.5, 0.9, 1.0, rng.random()]))
                 for _ in range(rng.randrange(20))]
        native = guesses.ranked_bins(pairs)
        assert list(native.items()) == list(_interpreted(monkeypatch, guesses.ranked_bins, pairs).items()), trial
    assert guesses._NATIVE_RANKED([(1, float("nan"))], guesses._EDGES) is None  # (the interpreter's sort)
    assert guesses._NATIVE_RANKED([(1, 1)], guesses._EDGES) is None  # (an int confidence: compared as Python does)

    def likely(chances, top_k):
        turn = eviction_index.NextTurn(eviction_index.KeptBest())
        turn.predict([SimpleNamespace(group="layer")], chances, top_k)
        return turn.likely("layer")

    for trial in range(300):
        chances = [rng.choice([0.0, 0.25, 0.5, 1.0, rng.random()]) for _ in range(rng.choice([1, 5, 16, 64]))]
        top_k = rng.choice([None, 1, 2, 4, 8, 40])
        assert likely(chances, top_k) == _interpreted(monkeypatch, likely, chances, top_k), trial


def _router(rng) -> guesses.Router:
    """A router with random records, open guesses and copies, as a decode leaves them."""
    router = guesses.Router("layer", nn.Linear(2, 2))
    bins = len(guesses.CONFIDENCE_BINS)
    for correct, guessed in (("bin_correct", "bin_guessed"), ("bin2_correct", "bin2_guessed")):
        made = [rng.choice([0.0, rng.random() * 12, 8.0, 3]) for _ in range(bins)]
        setattr(router, guessed, made)
        setattr(router, correct, [m * rng.choice([0.0, 0.5, 0.7, 0.69999, 1.0, rng.random()]) for m in made])
    router.evidence = rng.choice([guesses.SPECULATE_EVIDENCE, guesses.SPECULATE_EVIDENCE_LEARNED, 0.0, 3])
    experts = list(range(16))
    router.guess = {e: rng.randrange(bins) for e in rng.sample(experts, rng.randrange(6))} if rng.random() < 0.8 else None
    router.guess2 = {e: rng.randrange(bins) for e in rng.sample(experts, rng.randrange(6))} if rng.random() < 0.5 else None
    router.cached = frozenset(rng.sample(experts, rng.randrange(8)))
    router.cached2 = frozenset(rng.sample(experts, rng.randrange(8)))
    router.copied = {e: rng.choice([64, 128]) for e in rng.sample(experts, rng.randrange(4))}
    router.copied2 = set(rng.sample(experts, rng.randrange(3)))
    router.guess_tokens, router.tokens = rng.choice([1, 2]), rng.choice([1, 3])
    router.top_k = rng.choice([None, 4])
    router.next_pass = rng.random() < 0.2
    router.misses_seen = rng.randrange(3)
    router.stacks = [SimpleNamespace(used=set(rng.sample(experts, rng.randrange(6))), misses=rng.randrange(3))
                     for _ in range(rng.choice([1, 2]))]
    return router


def _pool(rng):
    return tuple([rng.choice([0.0, rng.random() * 20, 9.0]) for _ in guesses.CONFIDENCE_BINS] for _ in range(4))


def _state(router, pool) -> tuple:
    """Every record of a router and the pool, floats by their bits."""
    def bits(value):
        if isinstance(value, float):
            return value.hex()
        if isinstance(value, list):
            return [bits(v) for v in value]
        if isinstance(value, dict):
            return list(value.items())
        return value
    slots = [(name, bits(getattr(router, name))) for name in guesses.Router.__slots__ if name not in ("module_ref", "stacks")]
    return slots, [bits(record) for record in pool]


def test_the_native_gate_and_copy_candidates_are_the_interpreters(monkeypatch):
    """Which bins pay (each bin's own record, or the pool's while its own lacks evidence; no pool:
    none), ``pays_any``, and which experts of a guess are worth a copy (uncached, not yet copied,
    in a paying bin, in the guess's order), one and two layers ahead, native as interpreted."""
    _native_or_skip()
    rng = random.Random(3)
    for trial in range(400):
        router, pool, ahead = _router(rng), rng.choice([None, _pool(rng)]), rng.choice([1, 2])
        bins = {e: rng.randrange(len(guesses.CONFIDENCE_BINS)) for e in rng.sample(range(16), rng.randrange(8))}
        cached = frozenset(rng.sample(range(16), rng.randrange(6)))
        want = _interpreted(monkeypatch, lambda: (router.paying(pool, ahead), router.pays_any(pool, ahead),
                                                  router.worth(bins, cached, pool, ahead)))
        assert (router.paying(pool, ahead), router.pays_any(pool, ahead), router.worth(bins, cached, pool, ahead)) == want
        assert want[0] == sum(1 << b for b in range(len(guesses.CONFIDENCE_BINS)) if router.pays(b, pool, ahead))


def test_the_native_scoring_and_a_steps_close_leave_the_interpreters_records_bit_for_bit(monkeypatch):
    """Scoring a router's open guesses against what its layer paged, and a step's close (the experts
    paged, top-k from one token, the guesses scored unless made for the next pass, whether it
    missed): every count, decayed bin record (its own and the pool's) and copy, bit for bit, and
    the same wrong copies back."""
    _native_or_skip()
    rng = random.Random(4)
    for trial in range(400):
        router, pool = _router(rng), _pool(rng)
        twin, twin_pool = copy.deepcopy(router), copy.deepcopy(pool)
        used = set(rng.sample(range(16), rng.randrange(6))) if trial % 2 else None
        if trial % 3:
            got = guesses.close_step(router, pool)
            want = _interpreted(monkeypatch, guesses.close_step, twin, twin_pool)
        else:
            got = guesses.score(router, pool, used)
            want = _interpreted(monkeypatch, guesses.score, twin, twin_pool, used)
        assert got == want and _state(router, pool) == _state(twin, twin_pool), trial


def test_opening_a_guess_in_one_native_call_leaves_the_interpreters_records_and_copy_candidates(monkeypatch):
    """A guess opened one or two layers ahead, copying or not: the router's open guesses, the
    experts cached then, its copies and the experts worth a copy, bit for bit as the interpreter's
    stores and ``Router.worth``; and where a guess is still open (one left by a pass that did not
    end), nothing changed and None back, so that it is scored first."""
    _native_or_skip()
    assert guesses._NATIVE_OPEN is not None
    rng = random.Random(6)
    for trial in range(400):
        router, pool, ahead = _router(rng), rng.choice([None, _pool(rng)]), rng.choice([1, 2])
        twin, twin_pool = copy.deepcopy(router), copy.deepcopy(pool)
        bins = {e: rng.randrange(len(guesses.CONFIDENCE_BINS)) for e in rng.sample(range(16), rng.randrange(8))}
        cached, tokens, copying = frozenset(rng.sample(range(16), rng.randrange(6))), rng.choice([1, 3]), rng.random() < 0.7
        got = guesses.open_guess(router, bins, cached, tokens, ahead, pool, copying)
        want = _interpreted(monkeypatch, guesses.open_guess, twin, bins, cached, tokens, ahead, twin_pool, copying)
        assert got == want and _state(router, pool or ()) == _state(twin, twin_pool or ()), trial


def test_an_announce_issues_the_same_copies_with_its_key_set_made_natively(monkeypatch):
    """A layer's announce: the key set it hands on, the copies it issues in order (cached keys
    skipped, a stack given up at the first copy the budget refuses) and the keys it marks as issued
    for its op, native as interpreted; the layer's second stack with the same experts issues nothing."""
    _native_or_skip()
    rng = random.Random(7)

    def announce(group, experts, cached, refuse):
        issued = []
        pager = SimpleNamespace(is_cached=lambda key: key in cached,
                                prefetch=lambda master, dtype, lo, hi, key: issued.append(key) or key not in refuse)
        issuer = prefetch.ExpertIssuer(SimpleNamespace(needed=None))
        known = []
        first = issuer.announce(pager, group[0], group, experts, None, lambda g, keys: known.append(set(keys)))
        second = issuer.announce(pager, group[-1], group, experts, None)
        return first, second, known, issued, set(issuer.issued_for_op), issuer.layers.needed

    for trial in range(100):
        group = []
        for s in range(rng.choice([1, 2, 3])):
            keys = tuple((10 + s, torch.float32, 8 * e, 8 * (e + 1)) for e in range(16))
            master = SimpleNamespace(flat=object())
            group.append(SimpleNamespace(group="layer", keys=keys, key_of=keys.__getitem__, master_ref=lambda m=master: m))
        experts = rng.sample(range(16), rng.randrange(1, 9))
        every = [key for stack in group for key in stack.keys]
        cached, refuse = set(rng.sample(every, rng.randrange(8))), set(rng.sample(every, rng.randrange(3)))
        got = announce(group, experts, cached, refuse)
        assert got == _interpreted(monkeypatch, announce, group, experts, cached, refuse), trial
        assert got[0] and not got[1]


def test_a_guess_guards_the_same_keys_through_the_native_builder(monkeypatch):
    _native_or_skip()
    rng = random.Random(5)
    for trial in range(100):
        stacks = []
        for s in range(rng.choice([1, 2, 3])):
            keys = tuple((10 + s, torch.float32, 8 * e, 8 * (e + 1)) for e in range(16))
            stacks.append(SimpleNamespace(group="layer", keys=keys, key_of=keys.__getitem__))
        experts = {e: 0 for e in rng.sample(range(16), rng.randrange(6))}
        policy = eviction.ExpertEviction({}, SimpleNamespace())
        policy.guard(stacks, experts)
        interpreted = eviction.ExpertEviction({}, SimpleNamespace())
        _interpreted(monkeypatch, interpreted.guard, stacks, experts)
        assert policy._guarded == interpreted._guarded, trial


def test_a_decode_with_guesses_reads_no_score_through_tolist_and_decides_as_the_interpreter(monkeypatch):
    """A decode of a tiny Qwen3-MoE at a quarter of its experts, its routers guessing the next layer:
    the guesses' scores are read from their tensors (no float ``tolist()`` from the expert policy,
    which made a Python float per score every layer of every step), with the same logits and the
    same guess and expert statistics as with every loop the interpreter's."""
    _native_or_skip()
    pytest.importorskip("transformers")
    import offtensor as ot
    from test_moe_predictor import _decode, _qwen3, _wrap_quarter

    read, real = [], torch.Tensor.tolist

    def counted(self):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.startswith("offtensor.moe") and self.is_floating_point():
            read.append(caller)
        return real(self)

    def run():
        model = _wrap_quarter(_qwen3())
        logits = _decode(model, 10)
        stats = ot.stats(model)
        return logits, stats.guesses, stats.experts

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    logits, guessed, experts = run()
    assert guessed["guessed"] > 0 and read == []
    want = _interpreted(monkeypatch, run)
    assert all(torch.equal(a, b) for a, b in zip(logits, want[0]))
    assert (guessed, experts) == want[1:]
    assert read  # (the interpreter's steps read them through tolist())


def test_a_decode_learns_its_routers_stacks_through_c_calls_and_keeps_its_maps_while_the_order_holds(monkeypatch):
    """Every expert paged tells the speculator which stacks follow the router that fired last: a call
    into C (a dict's setdefault), not an interpreter frame; and the firing cycle and the stack
    groups' routers, the same step after step, are made again only when the pass changes them."""
    pytest.importorskip("transformers")
    import inspect

    from offtensor.moe.stacks import ExpertStacks
    from offtensor.model.state import pager_of
    from test_moe_predictor import _decode, _qwen3, _wrap_quarter

    told, real = [], ExpertStacks.accessed

    def accessed(self, key, hit):
        if self.speculator is not None:
            told.append(self.speculator.used)
        return real(self, key, hit)

    monkeypatch.setattr(ExpertStacks, "accessed", accessed)
    model = _wrap_quarter(_qwen3())
    _decode(model, 4)
    speculator = pager_of(model).experts.speculator
    cycle, groups = speculator._next, speculator._by_group
    assert len(cycle) == 4 and len(groups) == 4
    _decode(model, 3)
    assert speculator._next is cycle and speculator._by_group is groups
    assert told and all(inspect.isbuiltin(used) for used in told)
    assert [[s.name for s in r.stacks] for r in speculator.routers] == [
        [f"model.layers.{i}.mlp.experts.gate_up_proj", f"model.layers.{i}.mlp.experts.down_proj"] for i in range(4)]
