"""Routing guesses under a budget: the next layer's experts are guessed and prefetched only where
copies are on, a guess counts what every stack of its layer holds whole as cached, unreliable
guesses are scored but cost no bytes, a wrong guess holds its room no longer than its layer's turn;
the waste budget, which bins pay, a router sampled when its own record says its look-ahead does not
pay, and how a guess is ranked and binned. The models are test_moe.py's."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import nn

import offtensor as ot
from offtensor.moe import guesses as ot_guesses
from offtensor.moe import speculation as ot_speculation
from offtensor.models import DeepSeekForCausalLM
from offtensor.model.copies import state_of

from test_moe import DECODE_STEPS, FRACTIONS, _Decoder, _budget_gb, _build, _decode, _reference_config


# ------------------------------------------------------------------------------------ routing guesses


def _same_routing_everywhere(model: DeepSeekForCausalLM) -> None:
    """Every MoE layer's router is layer 1's, and no layer changes the residual stream, so layer
    i+1 routes exactly as layer i's router input predicts: guesses are exact."""
    gates = [layer.mlp.gate for layer in model.layers if hasattr(layer.mlp, "gate")]
    with torch.no_grad():
        for gate in gates[1:]:
            gate.weight.copy_(gates[0].weight)
        for layer in model.layers:
            layer.self_attn.o_proj.weight.zero_()
            mlp = layer.mlp
            if hasattr(mlp, "experts"):
                mlp.experts.w2.zero_()
                mlp.shared_experts.down_proj.weight.zero_()
            else:
                mlp.down_proj.weight.zero_()


@pytest.mark.parametrize("copies", [True, False])
def test_next_layer_experts_are_guessed_and_prefetched_only_where_copies_are_on(device, monkeypatch, copies):
    # Copying guesses is off by default (ot_speculation.SPECULATE_COPY: in the copy-bound decode of the
    # trained test models it costs more than it saves); exact guesses are then still scored, on a
    # sample of the steps, and copy nothing.
    monkeypatch.setattr(ot_speculation, "SPECULATE_COPY", copies)
    config = _reference_config(num_layers=5)
    reference = DeepSeekForCausalLM.empty(config).init_weights(seed=0).to(device)
    _same_routing_everywhere(reference)
    model = copy.deepcopy(reference)
    ot.wrap_model(model, budget_gb=_budget_gb(model, 0.5), device=device)
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(1)).to(device)
    speculator = state_of(model).pager.experts.speculator
    # Routers found by name and weight shape, stacks learned from the access order of a pass.
    assert [r.name for r in speculator.routers] == [f"layers.{i}.mlp.gate" for i in range(1, 5)]

    got = _decode(model, ids, 14)
    expected = _decode(reference, ids, 14)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    for router in speculator.routers:
        assert [s.name for s in router.stacks] == [
            f"{router.name.rpartition('.')[0]}.experts.{w}" for w in ("w1", "w3", "w2")
            if f"{router.name.rpartition('.')[0]}.experts.{w}" in {s.name for s in router.stacks}
        ] and router.stacks
    assert speculator._next[speculator.routers[0]] is speculator.routers[1]
    g = ot.stats(model).guesses
    assert g["accuracy"] == 1.0 and g["recall"] == 1.0
    if copies:
        assert g["prefetched_bytes"] > 0 and g["wasted_bytes"] == 0
        assert ot.stats(model).prefetch_hits > 0
    else:
        assert g["prefetched_bytes"] == 0 and g["wasted_bytes"] == 0
        assert not any(r["speculating"] for r in g["routers"].values())
        # Scored on every SPECULATE_SAMPLE-th step, not all 14: one guess per sampled step and router.
        per_router = [r["guessed"] for r in g["routers"].values() if r["guessed"]]
        assert per_router and all(n <= config.num_experts_per_tok * -(-14 // ot_speculation.SPECULATE_SAMPLE) for n in per_router), g


def test_a_guess_counts_as_cached_the_experts_every_stack_of_its_layer_holds_whole(device, monkeypatch):
    # (found from the pager's copies of each stack, not by looking up every expert's key)
    monkeypatch.setattr(ot_speculation, "SPECULATE_COPY", True)
    model = DeepSeekForCausalLM.empty(_reference_config(num_layers=5)).init_weights(seed=0).to(device)
    _same_routing_everywhere(model)
    ot.wrap_model(model, budget_gb=_budget_gb(model, 0.5), device=device)
    found = ot_speculation._cached_experts
    checked = []

    def cached_experts(pager, router):
        experts = found(pager, router)
        whole = [e for e in range(router.stacks[0].num_experts) if all(pager.is_cached(s.key_of(e)) for s in router.stacks)]
        checked.append(experts == frozenset(whole))
        return experts

    monkeypatch.setattr(ot_speculation, "_cached_experts", cached_experts)
    _decode(model, torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(1)).to(device), 8)
    assert checked and all(checked)


def test_unreliable_guesses_are_scored_but_cost_no_bytes(device):
    # Random weights: each layer moves the residual stream, so next-layer guesses are often wrong.
    config = _reference_config(num_layers=5)
    reference = DeepSeekForCausalLM.empty(config).init_weights(seed=0).to(device)
    model = copy.deepcopy(reference)
    ot.wrap_model(model, budget_gb=_budget_gb(model, 0.5), device=device)
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(1)).to(device)
    for a, b in zip(_decode(model, ids, 8), _decode(reference, ids, 8)):
        assert torch.equal(a, b)
    g = ot.stats(model).guesses
    assert g["guessed"] and g["accuracy"] is not None
    # Only guesses of experts not cached cost a copy: those are scored apart, and stay below the bar.
    assert g["uncached_guessed"] and g["uncached_precision"] < ot_guesses.SPECULATE_PRECISION, g
    assert g["prefetched_bytes"] == 0 and g["wasted_bytes"] == 0  # never earned speculation
    assert not any(r["speculating"] for r in g["routers"].values())


@pytest.mark.parametrize("name", ["reference", "mixtral"])
def test_a_wrong_guess_holds_its_room_no_longer_than_its_layers_turn(name, device, monkeypatch):
    # Every guess is copied (no gate) on random weights, where many are wrong. A copy made ahead of
    # its use is kept from eviction until used; once its layer has said what it pages (announced,
    # or its router's output) a wrong guess's copy must become evictable like any cached expert,
    # else wrong guesses pile up in the budget and evict the experts the next steps need.
    monkeypatch.setattr(ot_guesses, "SPECULATE_PRECISION", 0.0)
    monkeypatch.setattr(ot_guesses, "SPECULATE_EVIDENCE", 0.0)
    reference, is_reference, ids = _build(name, device)
    model = copy.deepcopy(reference)
    ot.wrap_model(model, budget_gb=_budget_gb(model, FRACTIONS[name]), device=device)
    pager = state_of(model).pager
    got, want = _Decoder(model, is_reference, ids), _Decoder(reference, is_reference, ids)
    held_after = []
    for _ in range(DECODE_STEPS):
        assert torch.equal(got.step(), want.step())
        # Every guessed layer has run: no copy of a routed expert may still wait for its use.
        held_after.append([k for k, e in pager._entries.items() if e.prefetched and pager.experts.is_stack(k[0])])
    g = ot.stats(model).guesses
    assert g["wasted_bytes"] > 0, g  # wrong guesses were copied
    assert not any(held_after), held_after


def test_with_the_waste_budget_a_bin_without_evidence_takes_the_record_of_a_less_confident_one(monkeypatch):
    router = ot_guesses.Router("gate", nn.Linear(4, 4))
    router.bin_guessed[3], router.bin_correct[3] = 10.0, 9.0  # confidence 0.3-0.4: 90% right
    # Confidence 0.7-0.8 has no record: the fixed gate waits for evidence of that bin itself.
    assert not router.pays(7) and router.precision(7) == 0.0
    monkeypatch.setattr(ot_guesses, "SPECULATE_WASTE", 0.25)
    # The waste budget takes bin 3's: a more confident guess is right at least as often.
    assert router.pays(7) and router.precision(7) == 0.9
    assert not router.pays(2)  # nothing less confident has a record
    router.bin_guessed[1], router.bin_correct[1] = 10.0, 4.0  # 40%: under SPECULATE_PRECISION_FLOOR
    assert not router.pays(2) and router.precision(2) == 0.4


def test_pays_any_is_any_bin_paying_by_its_own_record_or_the_pools_until_it_has_evidence():
    rng = random.Random(0)
    for _ in range(300):
        router = ot_guesses.Router("gate", nn.Linear(4, 4))
        router.evidence = rng.choice((4.0, 8.0))
        records = [router.bin_correct, router.bin_guessed, router.bin2_correct, router.bin2_guessed]
        pool = tuple([0.0] * len(ot_guesses.CONFIDENCE_BINS) for _ in range(4))
        for correct, guessed in ((records[0], records[1]), (records[2], records[3]), (pool[0], pool[1]), (pool[2], pool[3])):
            for b in range(len(guessed)):
                guessed[b] = rng.choice((0.0, 3.0, 8.0, 20.0))
                correct[b] = guessed[b] * rng.choice((0.0, 0.5, 0.7, 0.9, 1.0))
        for shared in (pool, None):
            for ahead in (1, 2):
                want = any(router.pays(b, shared, ahead) for b in range(len(ot_guesses.CONFIDENCE_BINS)))
                assert router.pays_any(shared, ahead) == want


def test_a_router_whose_own_record_says_its_look_ahead_does_not_pay_is_guessed_for_on_a_sample_of_steps():
    router, after = ot_guesses.Router("gate", nn.Linear(4, 4)), ot_guesses.Router("next", nn.Linear(4, 4))
    pool = tuple([0.0] * len(ot_guesses.CONFIDENCE_BINS) for _ in range(4))
    router.missed = True
    # No record yet: guessed every step while its layer misses (its bins earn their record).
    assert all(ot_speculation._guessed_now(router, after, pool) for _ in range(8))
    router.bin_guessed[0], router.bin_correct[0] = 20.0, 2.0  # its most guessed bin: right 10 % of the time
    made = [ot_speculation._guessed_now(router, after, pool) for _ in range(12)]
    assert made == [n % ot_speculation.SPECULATE_SAMPLE_UNPAID == 0 for n in range(12)] and any(not m for m in made)
    # Any bin that pays brings every step back: its own, the pool's where its own lacks evidence,
    # or a two-ahead bin of the layer after it (guessed by the same matmul).
    for record in ((router.bin_correct, router.bin_guessed), (pool[0], pool[1]), (after.bin2_correct, after.bin2_guessed)):
        record[0][8], record[1][8] = 9.0, 10.0
        assert all(ot_speculation._guessed_now(router, after, pool) for _ in range(8))
        record[0][8] = record[1][8] = 0.0
    assert not all(ot_speculation._guessed_now(router, after, pool) for _ in range(8))


def _ranked_then_binned(pairs) -> dict:
    """A guess's ranking, then its bins, as two plain steps (what ``ranked_bins`` does in one pass)."""
    from bisect import bisect_left

    confidence = {}
    for e, p in sorted(pairs, key=lambda pair: pair[1], reverse=True):
        confidence.setdefault(e, p)
    last = len(ot_guesses.CONFIDENCE_BINS) - 1
    return {e: min(bisect_left(ot_guesses.CONFIDENCE_BINS, p), last) for e, p in confidence.items()}


def test_a_guess_is_binned_by_the_first_upper_edge_at_least_its_confidence_and_ranked_ties_in_order():
    bins = ot_guesses.ranked_bins([(0, 0.05), (1, 0.1), (2, 0.1000001), (3, 0.7), (4, 1.0), (5, 1.5), (6, float("nan")), (7, 0.0)])
    assert bins == {0: 0, 1: 0, 2: 1, 3: 6, 4: 9, 5: 9, 6: 0, 7: 0}
    # The most confident first; an expert's highest confidence; equal confidences in the order given.
    got = ot_guesses.ranked_bins([(3, 0.2), (1, 0.5), (4, 0.2), (1, 0.1), (2, 0.5)])
    assert list(got.items()) == [(1, 4), (2, 4), (3, 1), (4, 1)]
    # In one pass: the same experts in the same order in the same bins as the two plain steps.
    for pairs in ([(3, 0.2), (1, 0.5), (4, 0.2), (1, 0.1), (2, 0.5)], [(0, 1.5), (5, float("nan")), (6, 0.1000001),
                                                                        (7, 0.1), (8, 0.95), (0, 0.05)]):
        assert list(ot_guesses.ranked_bins(pairs).items()) == list(_ranked_then_binned(pairs).items())
