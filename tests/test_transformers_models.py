"""Real models: tiny random-initialised transformers models wrapped at 30% of their weight bytes
give the same logits and the same greedy tokens as an unwrapped copy, within the budget.

Configs are sized so that 30% is reachable: the largest tensor an op must page at once (a stacked
expert tensor's working set, the tied embedding as lm_head) is well under 30% of the model.
"""

from __future__ import annotations

import copy

import pytest
import torch

import offtensor as ot

transformers = pytest.importorskip("transformers")

GiB = 1 << 30
BUDGET_FRACTION = 0.3
VOCAB = 128


def _config(name: str):
    small = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, max_position_embeddings=64)
    if name == "deepseek_v3":
        return transformers.DeepseekV3Config(
            **small, num_hidden_layers=2, num_key_value_heads=4, intermediate_size=256, moe_intermediate_size=64,
            q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
            n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1, first_k_dense_replace=1,
            n_group=1, topk_group=1, num_mtp_layers=0,
        )
    if name == "mixtral":
        # 8 experts of which 8 count as one op's working set: 4 layers keep one stack under 30%.
        return transformers.MixtralConfig(
            **small, num_hidden_layers=4, num_key_value_heads=2, intermediate_size=128,
            num_local_experts=8, num_experts_per_tok=2,
        )
    if name.startswith("qwen3_moe"):
        return transformers.Qwen3MoeConfig(
            **small, num_hidden_layers=2, num_key_value_heads=2, head_dim=16, intermediate_size=256,
            moe_intermediate_size=64, num_experts=16, num_experts_per_tok=4, decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    if name == "llama_tied":
        return transformers.LlamaConfig(
            **small, num_hidden_layers=2, num_key_value_heads=2, intermediate_size=512, tie_word_embeddings=True,
        )
    raise KeyError(name)


# transformers v5 runs stacked experts through grouped_mm by default; the other two kernels page
# experts through index ops (batched_mm) and per-expert select + linear (eager).
MODELS = {
    "deepseek_v3": None,
    "mixtral": None,
    "qwen3_moe": None,
    "qwen3_moe_batched_mm": "batched_mm",
    "qwen3_moe_eager": "eager",
    "llama_tied": None,
}


def _build(name: str, device) -> torch.nn.Module:
    config = _config(name)
    if MODELS[name] is not None:
        config._experts_implementation = MODELS[name]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    # grouped_mm, transformers' default MoE kernel, takes only bfloat16 on CUDA.
    return model.to(torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32)


def _weight_bytes(model: torch.nn.Module) -> int:
    seen = {}
    for t in list(model.parameters()) + list(model.buffers()):
        seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def _prompt(device) -> tuple:
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1)).to(device)
    return ids, torch.ones_like(ids)


@pytest.mark.parametrize("name", list(MODELS))
def test_model_wrapped_at_30_percent_matches_unwrapped(name, device):
    model = _build(name, device)
    reference = copy.deepcopy(model).to(device)
    if name == "llama_tied":
        assert model.lm_head.weight is model.model.embed_tokens.weight
    total = _weight_bytes(model)

    ot.wrap_model(model, budget_gb=BUDGET_FRACTION * total / GiB, device=device)
    s = ot.stats(model)
    budget = s.budget_bytes
    assert budget <= BUDGET_FRACTION * total
    assert s.resident_bytes + s.offloaded_bytes == total
    if name == "llama_tied":
        assert model.lm_head.weight is model.model.embed_tokens.weight
    if MODELS[name] is not None or name in ("deepseek_v3", "mixtral", "qwen3_moe"):
        assert any(isinstance(p, ot.OffloadedTensor) for n, p in model.named_parameters() if ".experts." in n)

    ids, mask = _prompt(device)
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).logits
        logits = model(input_ids=ids, attention_mask=mask).logits
    # Paging copies bytes and every op runs the same kernel on the same values (stacked experts
    # run as one-group grouped_mm calls, which compute each group exactly as the full call does).
    assert torch.equal(logits, expected)

    first_pass = ot.stats(model).bytes_h2d
    assert first_pass > 0
    with torch.no_grad():
        again = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(again, expected)
    assert ot.stats(model).bytes_h2d > first_pass  # the budget cannot keep everything it paged

    generate = dict(attention_mask=mask, do_sample=False, max_new_tokens=8, min_new_tokens=8, pad_token_id=0)
    expected_tokens = reference.generate(ids, **generate)
    tokens = model.generate(ids, **generate)
    assert torch.equal(tokens, expected_tokens)

    s = ot.stats(model)
    assert s.peak_device_bytes <= budget
    assert s.cached_bytes <= budget - s.resident_bytes


def test_transformers_grouped_mm_fallback_pages_only_the_experts_with_tokens(device):
    # transformers' compile-friendly grouped GEMM is one custom op: without its own handler the
    # whole stack would be paged (and refused by a budget that holds one expert).
    from transformers.integrations import moe  # noqa: F401  (registers transformers::grouped_mm_fallback)

    experts, d_in, d_out = 8, 32, 16
    weight = torch.randn(experts, d_in, d_out)
    x = torch.randn(10, d_in, device=device)
    offs = torch.tensor([0, 0, 4, 4, 4, 10, 10, 10], device=device)  # tokens for experts 2 and 5 only
    expected = torch.ops.transformers.grouped_mm_fallback(x, weight.to(device), offs)

    pager = ot.pager.Pager(torch.device(device), budget_bytes=weight[0].nbytes)
    offloaded = ot.offload(weight, device, pager=pager)
    result = torch.ops.transformers.grouped_mm_fallback(x, offloaded, offs)
    assert torch.equal(result, expected)
    assert pager.stats.bytes_h2d == 2 * weight[0].nbytes
