"""Routed experts under a budget: a one-token decode copies only the routed experts that
were not cached, hot experts stay cached, the statistics say so per stacked tensor, default
placement keeps everything but the routed experts resident, and the timeline shows the host sync an
MoE layer still costs. The next layer's guesses and prefetches are in test_moe_guesses.py."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import offtensor as ot
from offtensor.moe import ExpertStacks
from offtensor.moe import speculation as ot_speculation
from offtensor.models import DeepSeekConfig, DeepSeekForCausalLM, LatentCache, weight_bytes
from offtensor.model.copies import state_of

GiB = 1 << 30
transformers = pytest.importorskip("transformers")


# ------------------------------------------------------------------------------------ models


def _reference_config(**overrides) -> DeepSeekConfig:
    fields = dict(
        vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, q_lora_rank=0, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=16, n_shared_experts=1,
        num_experts_per_tok=2, moe_intermediate_size=64, intermediate_size=128, first_k_dense_replace=1,
    )
    fields.update(overrides)
    return DeepSeekConfig(**fields)


def _transformers_model(name: str, device) -> nn.Module:
    small = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, max_position_embeddings=64)
    if name == "deepseek_v3":
        config = transformers.DeepseekV3Config(
            **small, num_hidden_layers=3, num_key_value_heads=4, intermediate_size=256, moe_intermediate_size=64,
            q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
            n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1, first_k_dense_replace=1,
            n_group=1, topk_group=1, num_mtp_layers=0,
        )
    elif name == "mixtral":
        config = transformers.MixtralConfig(
            **small, num_hidden_layers=4, num_key_value_heads=2, intermediate_size=128, num_local_experts=8,
            num_experts_per_tok=2,
        )
    else:
        config = transformers.Qwen3MoeConfig(
            **small, num_hidden_layers=3, num_key_value_heads=2, head_dim=16, intermediate_size=256,
            moe_intermediate_size=64, num_experts=16, num_experts_per_tok=4, decoder_sparse_step=1, mlp_only_layers=[],
        )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    return model.to(device, torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32)


def _expert_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n and p.dim() == 3)


def _budget_gb(model: nn.Module, expert_fraction: float) -> float:
    """Everything but the routed experts, plus ``expert_fraction`` of the experts' bytes."""
    total = weight_bytes(model)
    experts = _expert_bytes(model)
    return (total - experts + expert_fraction * experts) / GiB


class _Decoder:
    """Prefill, then one token per step, for the reference model or a transformers model."""

    def __init__(self, model, reference: bool, ids):
        self.model, self.reference, self.ids = model, reference, ids
        self.cache = self.token = None

    def step(self) -> torch.Tensor:
        with torch.no_grad():
            if self.reference:
                if self.cache is None:
                    self.cache = LatentCache()
                    logits = self.model(self.ids, self.cache)
                else:
                    logits = self.model(self.token, self.cache)
            else:
                ids = self.ids if self.cache is None else self.token
                out = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True)
                self.cache, logits = out.past_key_values, out.logits
        self.token = logits[:, -1:].argmax(-1)
        return logits


def _build(name: str, device):
    if name == "reference":
        model = DeepSeekForCausalLM.empty(_reference_config()).init_weights(seed=0).to(device)
        ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(1)).to(device)
        return model, True, ids
    model = _transformers_model(name, device)
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(1)).to(device)
    return model, False, ids


# ------------------------------------------------------------------------------------ decode bytes


# Per model, the share of expert bytes the budget holds beyond the dense weights: enough that
# placement offloads routed experts only, small enough that a step must evict.
FRACTIONS = {"reference": 0.5, "deepseek_v3": 0.6, "mixtral": 0.5, "qwen3_moe": 0.5}
DECODE_STEPS = 8


@pytest.mark.parametrize("name", list(FRACTIONS))
def test_decode_moves_only_the_routed_experts_that_were_not_cached(name, device):
    model, reference, ids = _build(name, device)
    expected = copy.deepcopy(model)
    ot.wrap_model(model, budget_gb=_budget_gb(model, FRACTIONS[name]), device=device)
    offloaded = [n for n, p in model.named_parameters() if isinstance(p, ot.OffloadedTensor)]
    assert offloaded and all(".experts." in n for n in offloaded), offloaded  # routed experts go first
    pager = state_of(model).pager

    wrapped_run, reference_run = _Decoder(model, reference, ids), _Decoder(expected, reference, ids)
    moved = uncached = 0
    ratios = []
    for step in range(1 + DECODE_STEPS):
        cached = set(pager.cache.entries)
        before = ot.stats(model).bytes_h2d
        logits = wrapped_run.step()
        assert torch.equal(logits, reference_run.step())  # the same kernels on the same values
        if step == 0:
            continue  # the prefill: every expert some token picked
        step_bytes = ot.stats(model).bytes_h2d - before
        routed = pager.experts.routed_keys()
        assert routed, "a decode step routes to some experts"
        step_uncached = sum(b for k, b in routed.items() if k not in cached)
        moved += step_bytes
        uncached += step_uncached
        ratios.append(step_bytes / step_uncached if step_uncached else (1.0 if step_bytes == 0 else math.inf))
    # Bytes beyond the uncached routed experts are an expert cached at the step's start but
    # evicted for an earlier layer of the same step and paid twice, or a wrong guess of a router
    # that earned speculation. LRU in a cycle of layers pays twice whatever the next layers need
    # (every step, every layer); the expert cache evicts by expected next use, one score for every
    # layer, so a cold expert of a layer still to run can go before a warm one of a layer that ran,
    # and is paid twice only when its layer routes to it after all. That trade lifts the
    # decode hit rate on the trained test models (tests/test_moe_trained.py) by 6-8 points at 25%
    # cached; here it costs at most one expert of a few in the first decode after the prefill
    # (which routes to most experts of every layer) and a few percent over the decode.
    # The earlier bar (every step <= 1.1 x) was tried back with the cyclic-Belady constraint (never
    # evict an expert of a layer still to run in the step while one of a layer that ran is
    # evictable, then the frequency/reuse score; 2026-12-01): qwen3_moe here moved 1.034 x overall
    # with steps at 1.125 and 1.167 x (against 1.033 x, one step at 1.25 x, without it), and the
    # trained models' decode hit rate fell (benchmarks/moe_sim.py's replay, cache alone, 25% / 50%
    # cached: Qwen3-MoE 0.735 -> 0.716 / 0.960 -> 0.955, Qwen2-MoE 0.668 -> 0.638 / 0.941 -> 0.895).
    # At layer 0 of a step only its own unrouted experts have run, so any further room must come
    # from a layer still to run; the looser bar stays.
    assert moved <= 1.2 * uncached
    assert max(ratios) <= 1.5, ratios
    s = ot.stats(model)
    assert s.peak_device_bytes <= s.budget_bytes
    assert set(s.experts) == {n for n in offloaded}
    assert s.guesses is not None and s.guesses["routers"]


def test_expert_stats_count_hits_misses_and_bytes_per_stacked_tensor(device):
    model, reference, ids = _build("qwen3_moe", device)
    ot.wrap_model(model, budget_gb=_budget_gb(model, 0.5), device=device, prefetch=False)
    run = _Decoder(model, reference, ids)
    run.step()
    ot.reset_stats(model)
    for _ in range(4):
        run.step()
    s = ot.stats(model)
    pager = state_of(model).pager
    per_stack = s.experts
    stacks = {st.name: st for st in pager.experts.by_master.values()}
    assert set(per_stack) == set(stacks)
    # Only experts are offloaded and nothing is prefetched: every byte is a miss of some stack.
    assert sum(r["bytes_h2d"] for r in per_stack.values()) == s.bytes_h2d > 0
    for name, r in per_stack.items():
        assert r["bytes_h2d"] == r["misses"] * stacks[name].expert_bytes
        assert r["prefetched_bytes"] == 0
        assert r["hit_rate"] == pytest.approx(r["hits"] / (r["hits"] + r["misses"]))
    # A layer's missing experts are copied ahead of its op (announce), which the pager counts as
    # prefetches and their use as prefetch hits; the stacks count them as misses.
    assert sum(r["hits"] for r in per_stack.values()) == s.hits - s.prefetch_hits
    assert sum(r["misses"] for r in per_stack.values()) == s.page_ins - (s.prefetches - s.prefetch_hits)
    assert sum(r["evictions"] for r in per_stack.values()) == s.evictions


def test_expert_stacks_assigned_after_wrapping_are_the_ones_the_cache_and_stats_track(device):
    # load_state_dict(assign=True) into a wrapped model places new stacks on new masters: the
    # expert registry must follow them, not keep naming the replaced (dead) masters.
    model, reference, ids = _build("qwen3_moe", device)
    state_dict = {k: v.clone() for k, v in model.state_dict().items()}
    ot.wrap_model(model, budget_gb=_budget_gb(model, 0.5), device=device, prefetch=False)
    before = set(state_of(model).pager.experts.by_master)
    model.load_state_dict(state_dict, assign=True)
    run = _Decoder(model, reference, ids)
    for _ in range(3):
        run.step()
    live = {n: p._master.id for n, p in model.named_parameters() if isinstance(p, ot.OffloadedTensor) and ".experts." in n}
    assert live and not before & set(live.values())  # new masters
    pager = state_of(model).pager
    assert set(pager.experts.by_master) == set(live.values())
    s = ot.stats(model)
    assert set(s.experts) == set(live)
    assert all(r["hits"] + r["misses"] > 0 for r in s.experts.values())


def test_an_experts_module_replaced_after_wrapping_is_tracked_and_the_old_one_forgotten(device):
    model, reference, ids = _build("qwen3_moe", device)
    expected = copy.deepcopy(model)
    ot.wrap_model(model, budget_gb=_budget_gb(model, 0.5), device=device, prefetch=False)
    layer = model.model.layers[0].mlp
    old = {id(p._master) for p in layer.experts.parameters() if isinstance(p, ot.OffloadedTensor)}
    layer.experts = copy.deepcopy(expected.model.layers[0].mlp.experts)  # placed on assignment
    logits = _Decoder(model, reference, ids).step()
    assert torch.equal(logits, _Decoder(expected, reference, ids).step())
    live = {n: p._master.id for n, p in model.named_parameters() if isinstance(p, ot.OffloadedTensor) and ".experts." in n}
    assert set(state_of(model).pager.experts.by_master) == set(live.values())
    assert not old & {id(p._master) for p in layer.experts.parameters() if isinstance(p, ot.OffloadedTensor)}
    assert set(ot.stats(model).experts) == set(live)


# ------------------------------------------------------------------------------------ the cache


class _Experts(nn.Module):
    """Stacked experts driven by a routing we choose: expert e maps x to x @ w[e]."""

    def __init__(self, layers: int, num_experts: int, size: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Module() for _ in range(layers))
        for layer in self.layers:
            layer.experts = nn.Module()
            layer.experts.w = nn.Parameter(torch.randn(num_experts, size, size) / size, requires_grad=False)

    def forward(self, x, routing):
        for layer, experts in zip(self.layers, routing):
            x = sum(x @ layer.experts.w[e] for e in experts)
        return x


@pytest.mark.parametrize("eviction", ["experts", "lru"])
def test_hot_experts_stay_cached_across_tokens(device, eviction, monkeypatch):
    torch.manual_seed(0)
    layers, num_experts, size = 4, 16, 32
    model = _Experts(layers, num_experts, size).to(device)
    reference = copy.deepcopy(model)
    slice_bytes = size * size * 4
    # The budget holds 8 expert slices (one op's working set as placement counts it), fewer than the
    # 12 a token reads: the hot expert of each layer (4) and four for the cold picks.
    ot.wrap_model(model, budget_gb=8 * slice_bytes / GiB, device=device, policy={"offload": ["*.experts.*"]},
                  prefetch=False)
    if eviction == "lru":  # what the pager did before: the least recently used copy goes
        monkeypatch.setattr(ExpertStacks, "victim", lambda self, *args: next(args[-1], None))
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(1, size, device=device)
    for token in range(24):
        # Expert 0 is routed every token, two more picks are random among the 15 others.
        routing = [[0] + (1 + torch.randperm(num_experts - 1, generator=generator)[:2]).tolist() for _ in range(layers)]
        if token == 4:
            ot.reset_stats(model)
        with torch.no_grad():
            assert torch.equal(model(x, routing), reference(x, routing))
    s = ot.stats(model)
    hits = sum(r["hits"] for r in s.experts.values())
    looked_up = hits + sum(r["misses"] for r in s.experts.values())
    assert looked_up == 20 * layers * 3
    if eviction == "experts":
        # Every lookup of the hot experts hits (20 tokens x 3 layers); the cold picks mostly miss.
        assert hits >= 20 * layers
    else:
        # LRU in a cycle of layers evicts the next layer's experts, the hot one included.
        assert hits < 20 * layers / 2


def _decode(model, ids, steps: int):
    run = _Decoder(model, True, ids)
    return [run.step() for _ in range(steps)]


# ------------------------------------------------------------------------------------ placement


def test_default_placement_offloads_routed_experts_first_and_policy_overrides(device):
    model = DeepSeekForCausalLM.empty(_reference_config()).init_weights(seed=0)
    budget = _budget_gb(model, 0.5)
    wrapped = ot.wrap_model(copy.deepcopy(model), budget_gb=budget, device=device)
    offloaded = {n for n, p in wrapped.named_parameters() if isinstance(p, ot.OffloadedTensor)}
    assert offloaded and all(".mlp.experts." in n for n in offloaded)
    resident = {n for n, p in wrapped.named_parameters() if not isinstance(p, ot.OffloadedTensor)}
    for part in ("embed_tokens", "self_attn", ".mlp.gate.", "shared_experts", "lm_head"):
        assert any(part in n for n in resident), part

    # A policy keeps the experts and offloads attention instead; another offloads a router.
    kept = ot.wrap_model(copy.deepcopy(model), budget_gb=0.95 * weight_bytes(model) / GiB, device=device,
                         policy={"keep": ["*.experts.*"], "offload": ["*.self_attn.*"]})
    offloaded = {n for n, p in kept.named_parameters() if isinstance(p, ot.OffloadedTensor)}
    assert offloaded and not any(".experts." in n for n in offloaded)
    assert any(".self_attn." in n for n in offloaded)
    router = ot.wrap_model(copy.deepcopy(model), budget_gb=budget, device=device, policy=["layers.1.mlp.gate.*"])
    assert isinstance(router.layers[1].mlp.gate.weight, ot.OffloadedTensor)


# ------------------------------------------------------------------------------------ host syncs


def test_timeline_shows_one_host_sync_per_moe_layer(device):
    model, _, ids = _build("qwen3_moe", device)
    ot.wrap_model(model, budget_gb=_budget_gb(model, 0.5), device=device)
    moe_layers = len({n.rsplit(".", 2)[0] for n, p in model.named_parameters()
                      if isinstance(p, ot.OffloadedTensor)})
    run = _Decoder(model, False, ids)
    run.step()
    with ot.timeline(model) as tl:
        run.step()
    syncs = [r for r in tl.records if r.kind == "sync"]
    assert len(syncs) == moe_layers  # grouped_mm reads its routing offsets once per layer
    r = tl.replay("h200")
    assert r.step_ms > 0
    trace = tl.trace("h200")
    assert sum(e.get("cat") == "sync" for e in trace["traceEvents"]) == moe_layers


def test_replay_holds_back_work_issued_after_a_host_sync():
    tl = ot.Timeline()
    op = tl.add_op(flops=2e12, nbytes=0, dtype="bfloat16")  # ~3 ms of compute
    tl.add_sync()
    copy_id = tl.add_copy(55_300_000)  # 1 ms at 55.3 GB/s, issued only once the host has the routing
    r = tl.replay("h200")
    assert r.starts[copy_id] >= r.ends[op]
    free = ot.Timeline()
    op = free.add_op(flops=2e12, nbytes=0, dtype="bfloat16")
    copy_id = free.add_copy(55_300_000)
    assert free.replay("h200").starts[copy_id] < free.replay("h200").ends[op]


def test_detach_removes_router_hooks(device):
    model = DeepSeekForCausalLM.empty(_reference_config()).init_weights(seed=0).to(device)
    ot.wrap_model(model, budget_gb=_budget_gb(model, 0.5), device=device)
    gate = model.layers[1].mlp.gate
    pager = state_of(model).pager
    assert isinstance(pager.experts, ExpertStacks) and gate._forward_pre_hooks
    ot.unwrap_model(model)
    assert not gate._forward_pre_hooks
    assert pager.experts is None


def test_the_look_ahead_builds_no_autograd_graph_when_the_caller_has_grad_on(device, monkeypatch):
    model = DeepSeekForCausalLM.empty(_reference_config()).init_weights(seed=0).to(device)
    ot.wrap_model(model, budget_gb=_budget_gb(model, 0.5), device=device)
    grad_on, real = [], ot_speculation.lookahead_scores

    def scores(*args):
        grad_on.append(torch.is_grad_enabled())
        return real(*args)

    monkeypatch.setattr(ot_speculation, "lookahead_scores", scores)
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(1)).to(device)
    cache = LatentCache()
    model(ids, cache)  # no torch.no_grad here: the router hooks take it themselves
    with torch.no_grad():
        model(ids[:, -1:], cache)
    assert grad_on and not any(grad_on)


# ------------------------------------------------------------------------------------ the H200 replay


def test_deepseek_style_stack_replays_every_decode_step_near_its_bound_without_guesses():
    """benchmarks/moe_bench.py's stack (64 experts x 25 MB, top-8, experts run by
    ``torch._grouped_mm``), 4 layers, planned on meta with no guesses at all: every replayed
    decode step stays within 1.12 x its own bound (uncached routed bytes / H2D; offtensor runs one
    expert's kernel as soon as its copy lands, so the copy stream idles only while the next
    layer's attention and router run and while the host issues the layer's first copy: the H200's
    measured host time, 51 us per copied expert, is what takes the steps from 1.08 to 1.11), and copying every offloaded expert at the same budget is
    7 x slower or more. The variant with guesses of an assumed accuracy is reported beside it."""
    import argparse
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "moe_bench.py")
    spec = importlib.util.spec_from_file_location("moe_bench", path)
    moe_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(moe_bench)
    args = argparse.Namespace(layers=4, cache_gb=2.0, zipf=1.0, guess_accuracy=0.9)
    result = moe_bench.replay_deepseek_stack(args, None)
    honest = result["variants"]["offtensor"]
    assert len(honest["ratio_to_bound_per_step"]) == 6
    assert max(honest["ratio_to_bound_per_step"]) <= 1.12, honest["ratio_to_bound_per_step"]
    assert honest["wasted_copy_bytes_per_step"] == 0  # no guesses: every copy is read
    assert honest["host_syncs_per_step"] == 4  # one routing read per MoE layer
    assert result["speedup_vs_copy_all"] >= 7
    assumed = result["variants"][f"offtensor+assumed-guesses-{args.guess_accuracy:.0%}"]
    assert assumed["issued_guesses_routed"] == pytest.approx(args.guess_accuracy, abs=0.1)
    assert result["guess_accuracy_measured"] is None  # meta has no router values to guess from
    # Without the cache every routed expert is copied: more bytes than with it.
    nocache = result["variants"]["offtensor-nocache"]
    assert nocache["routed_bytes_not_cached_per_step"] > honest["routed_bytes_not_cached_per_step"]


def test_a_wrapped_moe_model_pickles_and_copies_with_routers_feeding_only_their_own_pager(device, tmp_path):
    # On main torch.save failed ("Can't pickle local object 'attach.<locals>.output_hook'"), and a
    # deepcopy's routers kept the original's hooks: the copy's forwards fed the original's guesses.
    config = _reference_config(num_layers=4)
    reference = DeepSeekForCausalLM.empty(config).init_weights(seed=0).to(device)
    model = copy.deepcopy(reference)
    ot.wrap_model(model, budget_gb=_budget_gb(model, 0.5), device=device)
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(1)).to(device)
    expected = _decode(reference, ids, 9)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    duplicate = copy.deepcopy(model)
    for copy_ in (loaded, duplicate):
        assert all(torch.equal(a, b) for a, b in zip(_decode(copy_, ids, 9), expected))
        assert ot.stats(copy_).guesses["guessed"] > 0 and ot.stats(copy_).offloaded_bytes > 0
    assert ot.stats(model).guesses["guessed"] == 0  # the original never ran
    assert all(torch.equal(a, b) for a, b in zip(_decode(model, ids, 9), expected))
