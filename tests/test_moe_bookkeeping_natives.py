"""The expert cache's bookkeeping of every expert the pager pages, copies or evicts, in the native
extension where it is built (csrc/bookkeeping.cpp: ``ExpertStacks.accessed``, ``copied``,
``evicted``), a matter of speed only: after any sequence of such events, with the layer paged now,
its op's keys, a guess's guarded keys, announced copies, token shares, decays and step ends between
them, every counter, tick, use count, heap record, stale mark and what the speculator learned is the
same, bit for bit and in the same order, as after the interpreter's steps; and a call the native
steps cannot finish changes nothing."""

from __future__ import annotations

import random
import sys

import pytest
import torch

from offtensor import _ext
from offtensor.moe import eviction as eviction_module
from offtensor.moe import stacks as stacks_module
from offtensor.moe.stack import Stack
from offtensor.moe.stacks import ExpertStacks
from offtensor.pager import cache_key

NATIVES = ("_NATIVE_ACCESSED", "_NATIVE_COPIED", "_NATIVE_EVICTED")  # (and eviction's _NATIVE_REUSE)
STEP = 8  # elements per expert


def _native_or_skip():
    if not _ext.NATIVE or stacks_module._NATIVE_ACCESSED is None:
        pytest.skip("the native extension is not built with the bookkeeping calls")


def _stack(name: str, master_id: int, experts: int) -> Stack:
    """A stack as ``Stack`` makes one from a stacked tensor, without the tensor."""
    stack = Stack.__new__(Stack)
    stack.name, stack.group, stack.master_ref, stack.master_id = name, name.rpartition(".")[0], None, master_id
    stack.dtype, stack.base, stack.expert_bytes, stack.num_experts = torch.bfloat16, 0, STEP * 2, experts
    stack.hits = stack.misses = stack.bytes_h2d = stack.prefetched_bytes = stack.evictions = 0
    stack.used, stack.last_used = set(), set()
    stack.keys = tuple(cache_key(master_id, torch.bfloat16, e * STEP, (e + 1) * STEP) for e in range(experts))
    stack.experts = {key: e for e, key in enumerate(stack.keys)}
    return stack


class _Speculator:
    """What ExpertStacks reads of a RoutingSpeculator: ``used``, a dict's setdefault once a router fired."""

    def __init__(self):
        self.learned = {}
        self.used = self.learned.setdefault

    def step(self) -> None:
        pass


def _expert_stacks(layers: int, experts: int, speculator: bool) -> ExpertStacks:
    stacks = ExpertStacks()
    for layer in range(layers):
        for s, name in enumerate(("gate_up_proj", "down_proj")):
            stack = _stack(f"model.layers.{layer}.mlp.experts.{name}", 100 + 2 * layer + s, experts)
            stacks.by_master[stack.master_id] = stack
    stacks.eviction.stack_groups()  # (the kept bests track the groups)
    if speculator:
        stacks.speculator = _Speculator()
    return stacks


def _key(rng: random.Random, stacks: ExpertStacks):
    """A whole expert's key mostly; a dense weight's, a copy of part of an expert, or another dtype's sometimes."""
    stack = rng.choice(list(stacks.by_master.values()))
    e = rng.randrange(stack.num_experts)
    roll = rng.random()
    if roll < 0.08:
        return cache_key(7, torch.float32, 0, 64)  # (no stack's)
    if roll < 0.14:
        return cache_key(stack.master_id, torch.bfloat16, e * STEP, e * STEP + STEP // 2)  # (part of an expert)
    return stack.keys[e]


def _events(seed: int, stacks: ExpertStacks) -> None:
    """A random sequence of the pager's events and of the state they read, the same for a seed."""
    rng = random.Random(seed)
    groups = list(stacks.eviction.stack_groups())
    for _ in range(700):
        roll = rng.random()
        key = _key(rng, stacks)
        if roll < 0.45:
            stacks.accessed(key, rng.random() < 0.6)
        elif roll < 0.65:
            stacks.issuer.issuing = rng.random() < 0.3
            stacks.copied(key, rng.choice([STEP * 2, 4096]), rng.random() < 0.5)
            stacks.issuer.issuing = False
        elif roll < 0.8:
            stacks.evicted(key)
        elif roll < 0.86:  # the layer paged now, and what its op pages (or did not say)
            stacks.layers.current = rng.choice(groups + [None])
            keys = [s.keys[e] for s in stacks.by_master.values() for e in range(s.num_experts) if rng.random() < 0.3]
            stacks.layers.needed = rng.choice([None, set(keys)])
            stacks.issuer.shares = {e: rng.choice([0.25, 0.5, 1.0]) for e in range(8) if rng.random() < 0.5}
        elif roll < 0.9:  # a guess's keys guarded, copies announced for the op
            group = rng.choice(groups)
            stacks.eviction._guarded[group] = {key, _key(rng, stacks)}
            stacks.issuer.issued_for_op.add(_key(rng, stacks))
        elif roll < 0.93:
            stacks.eviction._kept.stale = [False] * len(stacks.eviction._kept.stale)
            stacks.eviction._kept.dirty = set()
        elif roll < 0.96:
            stacks.eviction.decay()
        elif roll < 0.98:
            for stack in stacks.by_master.values():  # (a step that routed as many experts as the last: measured)
                if rng.random() < 0.5 and len(stack.last_used) <= stack.num_experts // 2:
                    stack.used = set(rng.sample(range(stack.num_experts), len(stack.last_used)))
            stacks.step()
        elif stacks.speculator is not None:
            stacks.speculator.used = rng.choice([stacks.speculator.learned.setdefault, lambda stack, expert: None])


def _state(stacks: ExpertStacks) -> dict:
    """Everything the bookkeeping writes, floats as their bits, orders as kept."""
    def exact(value):
        return value.hex() if isinstance(value, float) else value

    eviction = stacks.eviction
    kept = eviction._kept
    return {
        "stacks": [(s.name, s.hits, s.misses, s.bytes_h2d, s.prefetched_bytes, s.evictions, list(s.used), list(s.last_used))
                   for s in stacks.by_master.values()],
        "clock": eviction._clock, "last": list(eviction._last.items()),
        "frequency": [(k, exact(v)) for k, v in eviction.frequency.items()],
        "heaps": {m: [tuple(exact(x) for x in r) for r in heap] for m, heap in eviction._coldest.heaps.items()},
        "stale": list(kept.stale), "dirty": sorted(s.name for s in kept.dirty),
        "issued": sorted(map(repr, stacks.issuer.issued_for_op)),
        "reuse": [(g, exact(v)) for g, v in eviction._reuse.items()],
        "learned": None if stacks.speculator is None else [(s.name, e) for s, e in stacks.speculator.learned.items()],
    }


def _interpreted(monkeypatch, fn, *args):
    with monkeypatch.context() as m:
        for name in NATIVES:
            m.setattr(stacks_module, name, None)
        m.setattr(eviction_module, "_NATIVE_REUSE", None)
        return fn(*args)


@pytest.mark.parametrize("experts", [4, 16])
@pytest.mark.parametrize("speculator", [False, True])
def test_the_native_bookkeeping_of_pages_copies_and_evictions_leaves_the_interpreters_state(monkeypatch, experts, speculator):
    """Uses (hits, misses, announced copies, token shares), copies (ahead of use or the op's own),
    evictions, keys of no stack or of part of an expert, guarded and needed keys, decays (heap
    records scaled) and step ends: the same state after every sequence, heaps compacted too."""
    _native_or_skip()
    compacted = False
    for seed in range(12):
        native, interpreted = _expert_stacks(3, experts, speculator), _expert_stacks(3, experts, speculator)
        _events(seed, native)
        _interpreted(monkeypatch, _events, seed, interpreted)
        assert _state(native) == _state(interpreted), seed
        compacted |= any(len(heap) < native.eviction._clock // 2 for heap in native.eviction._coldest.heaps.values())
    assert compacted or experts > 4


def test_a_native_bookkeeping_call_that_cannot_finish_changes_nothing():
    """A use whose layer's token shares cannot be read fails before anything changes: not the
    announced copy's mark, the stack's count, the tick, the use count or the heap (the
    interpreter's steps had changed the first two by then)."""
    _native_or_skip()
    stacks = _expert_stacks(1, 4, True)
    stack = next(iter(stacks.by_master.values()))
    key = stack.keys[2]
    stacks.layers.current, stacks.issuer.shares = stack.group, None  # (None has no get)
    stacks.issuer.issued_for_op.add(key)
    before = _state(stacks)
    with pytest.raises(AttributeError):
        stacks.accessed(key, True)
    assert _state(stacks) == before
    stacks.issuer.shares = {2: 0.5}
    stacks.accessed(key, True)
    assert (stack.hits, stack.misses, stacks.eviction.frequency[key]) == (0, 1, 0.5) and not stacks.issuer.issued_for_op


def test_each_expert_paged_copied_or_evicted_is_one_call_into_c():
    """The pager's bookkeeping of an expert runs no interpreter frame of the policy's parts (the
    issuer's ``seen``, the eviction's ``used`` / ``copied`` / ``_keeps`` / ``push``, the kept bests',
    the heaps'): the method the pager calls hands it to the extension whole."""
    if not _ext.NATIVE:
        pytest.skip("the native extension is not built")
    stacks = _expert_stacks(2, 8, True)
    stack = next(iter(stacks.by_master.values()))
    stacks.layers.current, stacks.layers.needed = stack.group, {stack.keys[1]}
    stacks.issuer.issued_for_op.add(stack.keys[3])
    frames = []

    def profile(frame, event, arg):
        if event == "call":
            frames.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        for e in range(4):
            stacks.copied(stack.keys[e], STEP * 2, e % 2 == 0)
            stacks.accessed(stack.keys[e], e % 2 == 1)
            stacks.evicted(stack.keys[e])
    finally:
        sys.setprofile(None)
    assert frames == ["copied", "accessed", "evicted"] * 4
    assert (stack.hits, stack.misses, stack.evictions, stack.bytes_h2d) == (1, 3, 4, 4 * STEP * 2)


def test_the_native_step_end_measures_each_layers_reuse_and_turns_every_stack_as_the_interpreter(monkeypatch):
    """A step's end (``ExpertEviction.measure_reuse``, with ``turn`` as ``ExpertStacks.step`` calls it):
    each layer's reuse rate from its first stack that routed as many experts as at its last turn,
    the same floats in the same order, and every stack's experts used this step its last step's
    (the same set), a new empty set its used ones."""
    if not _ext.NATIVE or eviction_module._NATIVE_REUSE is None:
        pytest.skip("the native extension is not built with the step's end")
    for seed in range(60):
        def build() -> ExpertStacks:
            rng = random.Random(seed)
            stacks = _expert_stacks(4, 16, False)
            for stack in stacks.by_master.values():
                k = rng.choice([0, 2, 5])
                stack.used = set(rng.sample(range(16), k))
                stack.last_used = set(rng.sample(range(16), rng.choice([k, k, 3])))
            groups = list(stacks.eviction.stack_groups())
            stacks.eviction._reuse = {group: rng.random() for group in rng.sample(groups, 2)}
            return stacks

        native, interpreted = build(), build()
        turn = seed % 3 != 0
        used = [stack.used for stack in native.by_master.values()]
        native.eviction.measure_reuse(turn=turn)
        _interpreted(monkeypatch, interpreted.eviction.measure_reuse, turn)
        assert _state(native) == _state(interpreted), seed
        if turn:
            assert [stack.last_used for stack in native.by_master.values()] == used
            assert all(a.last_used is b for a, b in zip(native.by_master.values(), used))
            assert all(stack.used == set() for stack in native.by_master.values())
