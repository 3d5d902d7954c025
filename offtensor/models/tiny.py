"""Tiny random-initialised transformers models for tests and benchmarks (transformers needed)."""

from __future__ import annotations

import torch


def tiny_transformers(name: str):
    """A two-layer ``"llama"`` (tied embeddings) or ``"qwen3_moe"`` (16 experts, top-4) causal LM
    with a 128-token vocabulary, seeded, in eval mode."""
    import transformers

    small = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, max_position_embeddings=64)
    if name == "llama":
        config = transformers.LlamaConfig(**small, num_hidden_layers=2, num_key_value_heads=2, intermediate_size=256,
                                          tie_word_embeddings=True)
    elif name == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**small, num_hidden_layers=2, num_key_value_heads=2, head_dim=16,
                                             intermediate_size=256, moe_intermediate_size=64, num_experts=16,
                                             num_experts_per_tok=4, decoder_sparse_step=1, mlp_only_layers=[])
    else:
        raise ValueError(f"tiny_transformers: unknown model {name!r}; 'llama' or 'qwen3_moe'")
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()
