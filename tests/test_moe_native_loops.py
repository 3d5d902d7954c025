"""Two of the expert policy's loops run in the native extension where it is built, a matter of
speed only: a guess's pass over its layer's cached copies (``speculation._cached_experts``) finds
the same experts, and the per-step decay of use counts (``ExpertEviction.decay``) leaves the same
counts, bit for bit and in the same order, as the interpreter's loops on the same state."""

from __future__ import annotations

import random
import struct
import types
from types import SimpleNamespace

import pytest
import torch

from offtensor.moe import eviction, speculation
from offtensor.pager import cache_key


def _interpreted(monkeypatch, module, name, fn, *args):
    with monkeypatch.context() as m:
        m.setattr(module, name, None)
        return fn(*args)


def _stack(master_id: int, dtype: torch.dtype, base: int, step: int, experts: int):
    keys = tuple(cache_key(master_id, dtype, base + e * step, base + (e + 1) * step) for e in range(experts))
    return SimpleNamespace(master_id=master_id, dtype=dtype, base=base, expert_bytes=step * dtype.itemsize,
                           num_experts=experts, keys=keys, experts={k: e for e, k in enumerate(keys)})


class _Copies:
    """A pager's cached copies as the guesses read them: master id -> its copies, each with its key."""

    def __init__(self, by_master: dict):
        self.by_master = types.MappingProxyType({m: [SimpleNamespace(key=k) for k in keys] for m, keys in by_master.items()})

    def cached_copies(self):
        return self.by_master


def test_the_native_pass_over_cached_copies_finds_the_interpreters_experts(monkeypatch):
    """Whole experts cached in every stack of the layer count; a copy of part of an expert, of two
    experts, of another dtype or at another offset does not, nor does an expert one stack lacks."""
    if speculation._NATIVE_CACHED is None:
        pytest.skip("the native extension is not built with the pass over cached copies")
    rng = random.Random(0)
    for trial in range(200):
        experts, step = rng.choice([4, 16, 256]), rng.choice([1, 8, 24])
        stacks = [_stack(10 + s, torch.bfloat16, rng.choice([0, 5 * step]), step, experts)
                  for s in range(rng.choice([1, 2, 3]))]
        by_master = {}
        for stack in stacks:
            keys = [k for k in stack.keys if rng.random() < 0.6]
            master, base = stack.master_id, stack.base
            e = rng.randrange(experts)
            odd = [cache_key(master, torch.bfloat16, base + e * step, base + e * step + max(step // 2, 1)),  # part
                   cache_key(master, torch.bfloat16, base + e * step, base + (e + 2) * step),  # two experts
                   cache_key(master, torch.float16, base + e * step, base + (e + 1) * step),  # another dtype
                   cache_key(master, torch.bfloat16, base + e * step + 1, base + (e + 1) * step + 1),  # shifted
                   cache_key(master, torch.bfloat16, base + experts * step, base + (experts + 1) * step)]  # past the end
            keys += rng.sample(odd, rng.randrange(len(odd) + 1)) + rng.sample(keys, min(len(keys), 2))  # (repeats)
            rng.shuffle(keys)
            by_master[master] = keys
        router = SimpleNamespace(stacks=stacks)
        got = speculation._cached_experts(_Copies(by_master), router)
        want = _interpreted(monkeypatch, speculation, "_NATIVE_CACHED", speculation._cached_experts,
                            _Copies(by_master), router)
        assert isinstance(got, frozenset) and got == want, trial
    lone = _stack(3, torch.float32, 0, 4, 8)
    assert speculation._cached_experts(_Copies({3: list(lone.keys[2:5])}), SimpleNamespace(stacks=[lone])) == {2, 3, 4}


def _bits(counts: dict) -> list:
    return [(k, struct.pack("<d", v)) for k, v in counts.items()]


def test_the_native_decay_leaves_the_interpreters_counts_bit_for_bit_in_order(monkeypatch):
    if eviction._NATIVE_DECAY is None:
        pytest.skip("the native extension is not built with the decay loop")
    rng = random.Random(1)
    keys = [cache_key(7, torch.float32, 16 * e, 16 * (e + 1)) for e in range(300)]
    native, interpreted = {}, {}
    for step in range(120):
        for key in rng.sample(keys, 12):  # uses add to a count, as ExpertEviction.used does
            share = rng.choice([1.0, rng.random(), 1])
            native[key] = native.get(key, 0.0) + share
            interpreted[key] = interpreted.get(key, 0.0) + share
        eviction._NATIVE_DECAY(native, eviction.FREQUENCY_DECAY, eviction.FREQUENCY_FLOOR)
        eviction._decay_counts(interpreted, eviction.FREQUENCY_DECAY, eviction.FREQUENCY_FLOOR)
        assert _bits(native) == _bits(interpreted), step
    assert 50 < len(native) < 300  # counts were dropped below the floor, others kept
    with pytest.raises(TypeError):
        eviction._NATIVE_DECAY({keys[0]: "many"}, 0.5, 0.01)


def test_the_native_decay_changes_in_place_only_the_counts_the_dict_alone_holds():
    """The per-step decay walks every count: a float only the dict holds is changed in place (no new
    float, no dict store), one held elsewhere too is replaced, its holder's value untouched."""
    if eviction._NATIVE_DECAY is None:
        pytest.skip("the native extension is not built with the decay loop")
    keys = [cache_key(7, torch.float32, 16 * e, 16 * (e + 1)) for e in range(4)]
    counts = {key: 1.0 + e / 3 for e, key in enumerate(keys)}  # (sums made at run time: only the dict holds them)
    held = counts[keys[1]]  # a reader that kept a count
    alone = id(counts[keys[2]])
    interpreted = {key: 1.0 + e / 3 for e, key in enumerate(keys)}  # (floats of their own)
    eviction._NATIVE_DECAY(counts, 0.5, 0.01)
    eviction._decay_counts(interpreted, 0.5, 0.01)
    assert _bits(counts) == _bits(interpreted)
    assert id(counts[keys[2]]) == alone  # changed in place
    assert held == 1.0 + 1 / 3 and counts[keys[1]] == held * 0.5  # the holder's float kept its value


def test_a_decoding_policy_decays_through_the_native_loop_as_through_the_interpreters(monkeypatch):
    """Over a decode at a quarter of the experts, each step's decay leaves the same counts either way."""
    pytest.importorskip("transformers")
    from test_moe_predictor import _decode, _qwen3, _wrap_quarter

    if eviction._NATIVE_DECAY is None:
        pytest.skip("the native extension is not built with the decay loop")
    decays, native = [], eviction._NATIVE_DECAY

    def both(counts, factor, floor):
        before = dict(counts)
        native(counts, factor, floor)
        eviction._decay_counts(before, factor, floor)
        decays.append((_bits(counts), _bits(before)))

    monkeypatch.setattr(eviction, "_NATIVE_DECAY", both)
    _decode(_wrap_quarter(_qwen3()), 12)
    assert len(decays) >= 12 and sum(len(a) for a, _ in decays) > 100
    assert all(a == b for a, b in decays)
