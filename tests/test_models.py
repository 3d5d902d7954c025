"""The reference DeepSeek-style model (MLA + MoE, plain PyTorch) wrapped under a budget behaves
exactly like the unwrapped model: same logits, same greedy tokens, through load_state_dict and MLA
weight absorption, with only routed experts paged and tied embeddings kept tied."""

from __future__ import annotations

import copy
import dataclasses
import gc
import weakref

import pytest
import torch

import offtensor as ot
from offtensor import _ext
from offtensor.models import CONFIGS, DeepSeekConfig, DeepSeekForCausalLM, LatentCache, weight_bytes

GiB = 1 << 30


def tiny_config(**overrides) -> DeepSeekConfig:
    return dataclasses.replace(CONFIGS["tiny"], **{"q_lora_rank": 0, **overrides})


def reference_model(config: DeepSeekConfig, device) -> DeepSeekForCausalLM:
    return DeepSeekForCausalLM.empty(config).init_weights(seed=0).to(device)


def prompt(config: DeepSeekConfig, device, batch: int = 2, length: int = 7) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, config.vocab_size, (batch, length), generator=generator).to(device)


def budget_gb(model, fraction: float) -> float:
    return fraction * weight_bytes(model) / GiB


def assert_same_logits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # The same kernels run on the same values, so the emulated device gives bit-identical logits; a
    # GPU may pick another GEMM algorithm for a differently aligned paged copy (default tolerances).
    if actual.device.type == "cpu":
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    else:
        torch.testing.assert_close(actual, expected)


def is_plain_device_tensor(t: torch.Tensor, device) -> bool:
    return not isinstance(t, ot.OffloadedTensor) and t.device.type == torch.device(device).type


def offloaded_names(model) -> list:
    return [name for name, p in model.named_parameters() if isinstance(p, ot.OffloadedTensor)]


# ------------------------------------------------------------------------------------ equivalence


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("q_lora_rank", [0, 24], ids=["q_proj", "q_lora"])
def test_wrapped_model_gives_unwrapped_logits_and_tokens(device, moe, tied, q_lora_rank):
    config = tiny_config(
        tie_word_embeddings=tied, q_lora_rank=q_lora_rank, n_routed_experts=8 if moe else 0,
        # Both routers get covered without doubling the matrix.
        scoring_func="sigmoid" if tied else "softmax", norm_topk_prob=tied,
    )
    reference = reference_model(config, device)
    budget = budget_gb(reference, 0.3)
    wrapped = ot.wrap_model(copy.deepcopy(reference), budget_gb=budget, device=device)
    assert offloaded_names(wrapped), "a 30% budget must offload something"
    ids = prompt(config, device)
    with torch.no_grad():
        assert_same_logits(wrapped(ids), reference(ids))
    assert torch.equal(wrapped.generate(ids, max_new_tokens=6), reference.generate(ids, max_new_tokens=6))
    s = ot.stats(wrapped)
    assert s.bytes_h2d > 0
    assert s.peak_device_bytes <= s.budget_bytes == int(budget * GiB)


def test_wrapped_bfloat16_model_with_sigmoid_router_gives_unwrapped_tokens(device):
    # The dtype and router the GPU demo uses (DeepSeek-V3's): bf16 weights, float32 routing.
    config = tiny_config(dtype=torch.bfloat16, q_lora_rank=24, scoring_func="sigmoid", norm_topk_prob=True,
                         routed_scaling_factor=2.5)
    reference = reference_model(config, device)
    wrapped = ot.wrap_model(copy.deepcopy(reference), budget_gb=budget_gb(reference, 0.3), device=device)
    wrapped.process_weights_after_loading()
    reference.process_weights_after_loading()
    ids = prompt(config, device)
    with torch.no_grad():
        assert_same_logits(wrapped(ids), reference(ids))
    assert torch.equal(wrapped.generate(ids, max_new_tokens=6), reference.generate(ids, max_new_tokens=6))


# ------------------------------------------------------------------------------------ MLA absorption


@pytest.mark.parametrize("kv_b_placement", ["offload", "keep"])
def test_mla_absorption_after_load_state_dict_replaces_kv_b_proj_under_budget(device, kv_b_placement):
    config = tiny_config(q_lora_rank=24)
    reference = reference_model(config, device)
    state_dict = reference.state_dict()
    budget = budget_gb(reference, 0.3)

    # As an engine loads: build without values, wrap, then load the checkpoint into the host masters.
    model = DeepSeekForCausalLM.empty(config)
    ot.wrap_model(model, budget_gb=budget, device=device, policy={kv_b_placement: ["*.kv_b_proj.weight"]})
    model.load_state_dict(state_dict)
    old_weights = [layer.self_attn.kv_b_proj.weight for layer in model.layers]
    assert all(isinstance(w, ot.OffloadedTensor) == (kv_b_placement == "offload") for w in old_weights)
    weight_refs = [weakref.ref(w) for w in old_weights]
    master_refs = [weakref.ref(w._master) for w in old_weights if isinstance(w, ot.OffloadedTensor)]
    del old_weights

    gc.disable()  # what is freed must be freed by reference counting alone, as vLLM needed gc.collect
    try:
        host_bytes_before = _ext.live_host_bytes()
        model.process_weights_after_loading()
        assert all(r() is None for r in weight_refs), "kv_b_proj's weight outlived its deletion"
        assert all(r() is None for r in master_refs), "kv_b_proj's host master outlived its deletion"
        if kv_b_placement == "offload":
            # W_UK and W_UV hold exactly kv_b_proj's values, and their masters are exact-size.
            assert _ext.live_host_bytes() == host_bytes_before
    finally:
        gc.enable()

    for layer in model.layers:
        attn = layer.self_attn
        assert not hasattr(attn, "kv_b_proj")
        for new in (attn.W_UK, attn.W_UV):
            assert isinstance(new, torch.nn.Parameter)
            # Placed by wrap_model's registration hook: paged, or resident on the device.
            assert new.device.type == torch.device(device).type
            assert isinstance(new, ot.OffloadedTensor) or is_plain_device_tensor(new, device)
    s = ot.stats(model)
    assert s.peak_device_bytes <= s.budget_bytes

    reference.process_weights_after_loading()
    ids = prompt(config, device)
    with torch.no_grad():
        assert_same_logits(model(ids), reference(ids))
    assert torch.equal(model.generate(ids, max_new_tokens=6), reference.generate(ids, max_new_tokens=6))
    assert ot.stats(model).peak_device_bytes <= s.budget_bytes


def test_absorbed_path_matches_naive_path(device):
    config = tiny_config(q_lora_rank=24)
    model = reference_model(config, device)
    ids = prompt(config, device)
    with torch.no_grad():
        naive = model(ids)
        naive_tokens = model.generate(ids, max_new_tokens=6)
        model.process_weights_after_loading()
        torch.testing.assert_close(model(ids), naive, rtol=1e-4, atol=1e-4)
    assert torch.equal(model.generate(ids, max_new_tokens=6), naive_tokens)


# ------------------------------------------------------------------------------------ routed experts


def test_decode_step_pages_only_the_routed_experts(device):
    config = tiny_config(n_routed_experts=16, num_experts_per_tok=2, moe_intermediate_size=64)
    reference = reference_model(config, device)
    experts = [layer.mlp.experts for i, layer in enumerate(reference.layers) if config.is_moe_layer(i)]
    expert_bytes = sum(weight_bytes(e) for e in experts)
    slice_bytes = config.moe_intermediate_size * config.hidden_size * 4  # one expert of w1, w3 or w2 (float32)
    # Everything but the experts stays resident; the cache holds 8 expert slices, fewer than one
    # decode step reads, so the step must page some.
    budget = (weight_bytes(reference) - expert_bytes + 8 * slice_bytes) / GiB
    wrapped = ot.wrap_model(copy.deepcopy(reference), budget_gb=budget, device=device,
                            policy={"offload": ["*.experts.*"]}, prefetch=False)
    assert sorted(offloaded_names(wrapped)) == sorted(
        f"layers.{i}.mlp.experts.{w}" for i in range(config.num_layers) if config.is_moe_layer(i) for w in ("w1", "w2", "w3")
    )

    ids = prompt(config, device, batch=1)
    with torch.no_grad():
        cache = LatentCache()
        next_token = wrapped(ids, cache)[:, -1:].argmax(-1)
        ot.reset_stats(wrapped)
        wrapped(next_token, cache)
    s = ot.stats(wrapped)

    moe_layers = len(experts)
    slices_read = moe_layers * config.num_experts_per_tok * 3  # one token: top_k experts x (w1, w3, w2)
    assert s.page_ins + s.hits == slices_read
    assert s.bytes_h2d == s.page_ins * slice_bytes
    assert 0 < s.bytes_h2d <= slices_read * slice_bytes < expert_bytes
    assert s.peak_device_bytes <= s.budget_bytes
    assert torch.equal(wrapped.generate(ids, max_new_tokens=6), reference.generate(ids, max_new_tokens=6))


# ------------------------------------------------------------------------------------ tied embeddings


def test_tied_embeddings_stay_one_parameter_through_wrap_load_absorb_unwrap(device):
    config = tiny_config(tie_word_embeddings=True)
    reference = reference_model(config, device)
    model = DeepSeekForCausalLM.empty(config)
    embedding = model.embed_tokens.weight
    assert model.lm_head.weight is embedding

    def assert_tied():
        assert model.embed_tokens.weight is embedding and model.lm_head.weight is embedding

    ot.wrap_model(model, budget_gb=budget_gb(reference, 0.3), device=device,
                  policy={"offload": ["embed_tokens.weight"]})
    assert_tied()
    assert isinstance(embedding, ot.OffloadedTensor) and isinstance(embedding, torch.nn.Parameter)
    model.load_state_dict(reference.state_dict())
    assert_tied()
    assert torch.equal(embedding.cpu(), reference.embed_tokens.weight.cpu())
    model.process_weights_after_loading()
    assert_tied()
    reference.process_weights_after_loading()
    ids = prompt(config, device)
    with torch.no_grad():
        assert_same_logits(model(ids), reference(ids))
    ot.unwrap_model(model)
    assert_tied()
    assert is_plain_device_tensor(embedding, device)
    assert torch.equal(embedding, reference.embed_tokens.weight)
