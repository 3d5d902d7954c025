"""A DeepSeek-V2/V3-style decoder laid out the way vLLM lays its models out, with vLLM's way of
loading a checkpoint: Parameter subclasses, attributes set on Parameters, one ``weight_loader`` per
weight, and a ``load_weights`` loop mapping checkpoint names onto fused parameters.

Like ``deepseek.py`` it is plain PyTorch (its vLLM building blocks are in ``vllm_layers.py``) and knows nothing about offloading. It is what offtensor must
load into after ``wrap_model`` has already placed the weights (vLLM's ``cpu_offload_gb`` order), so
every way vLLM's loaders write a weight appears here once:

- ``ModelWeightParameter`` and ``ChannelScaleParameter``: ``nn.Parameter`` subclasses whose
  constructors demand a loader, whose state (``output_dim``...) lives in ``__dict__`` behind
  properties, and whose own methods load shards through ``self.data.narrow(...).copy_``;
- plain Parameters carrying ``weight_loader``/``output_dim``/``input_dim`` set with ``set_weight_attrs``;
- merged gate/up (``gate_up_proj``, shard ids 0 and 1) and a packed q/kv projection
  (``fused_qkv_a_proj``, shard ids ``"q"`` and ``"kv"``) filled from separate checkpoint tensors;
- fused MoE stacks ``w13_weight [E, 2I, H]`` and ``w2_weight [E, H, I]`` filled expert by expert and
  shard by shard through ``param.data[expert]``;
- an fp8-like quantised ``o_proj``: an int8 weight plus a per-channel scale, replaced by a dequantised
  Parameter in ``process_weights_after_loading``;
- MLA's ``process_weights_after_loading`` keeping ``W_UK_T``/``W_UV`` as plain attributes (views of
  ``kv_b_proj.weight``), not Parameters.

Names and checkpoint format follow the HF DeepSeek-V2 layout (``model.layers.N.mlp.experts.E.gate_proj.weight``).
"""

from __future__ import annotations

import json
import os
from typing import Dict, Iterable, Iterator, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..safetensors_paths import checkpoint_tensors
from .deepseek import DeepSeekConfig, LatentCache, RMSNorm, RotaryEmbedding, apply_rotary, route
from .vllm_layers import (Int8Linear, MergedColumnLinear, PackedQKVLinear, ReplicatedLinear, RowLinear, VocabEmbedding,
                          check_shape, default_weight_loader, quantize_int8, set_weight_attrs)


class MLAttention(nn.Module):
    """Multi-head latent attention in vLLM's layout. Before ``process_weights_after_loading`` keys and
    values are expanded by ``kv_b_proj``; after it, ``W_UK_T`` [heads, qk_nope, kv_lora] and ``W_UV``
    [heads, kv_lora, v] (plain attributes viewing ``kv_b_proj.weight``) absorb it."""

    def __init__(self, config: DeepSeekConfig, layer_index: int):
        super().__init__()
        c = config
        self.layer_index = layer_index
        self.num_heads = c.num_heads
        self.qk_nope_head_dim = c.qk_nope_head_dim
        self.qk_rope_head_dim = c.qk_rope_head_dim
        self.v_head_dim = c.v_head_dim
        self.kv_lora_rank = c.kv_lora_rank
        self.q_lora_rank = c.q_lora_rank
        self.softmax_scale = c.qk_head_dim ** -0.5
        kv_a_size = c.kv_lora_rank + c.qk_rope_head_dim
        if c.q_lora_rank:
            self.fused_qkv_a_proj = PackedQKVLinear(c.hidden_size, {"q": c.q_lora_rank, "kv": kv_a_size}, c.dtype)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps, c.dtype)
            self.q_b_proj = ReplicatedLinear(c.q_lora_rank, c.num_heads * c.qk_head_dim, c.dtype)
        else:
            self.q_proj = ReplicatedLinear(c.hidden_size, c.num_heads * c.qk_head_dim, c.dtype)
            self.kv_a_proj_with_mqa = ReplicatedLinear(c.hidden_size, kv_a_size, c.dtype)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps, c.dtype)
        self.kv_b_proj = ReplicatedLinear(c.kv_lora_rank, c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), c.dtype)
        self.o_proj = Int8Linear(c.num_heads * c.v_head_dim, c.hidden_size, c.dtype)
        self.rotary_emb = RotaryEmbedding(c.qk_rope_head_dim, c.rope_theta)
        self.W_UK_T: Optional[torch.Tensor] = None
        self.W_UV: Optional[torch.Tensor] = None

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        # [heads * (nope + v), kv_lora] -> [kv_lora, heads, nope + v], split per head into the key and
        # value halves; views, so no second copy of kv_b_proj exists.
        kv_b = self.kv_b_proj.weight.T.view(self.kv_lora_rank, self.num_heads, self.qk_nope_head_dim + self.v_head_dim)
        w_uk, w_uv = kv_b.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        self.W_UK_T = w_uk.permute(1, 2, 0)  # [heads, nope, kv_lora]
        self.W_UV = w_uv.transpose(0, 1)  # [heads, kv_lora, v]
        self.o_proj.process_weights_after_loading()

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, cache: Optional[LatentCache]) -> torch.Tensor:
        batch, steps, _ = hidden.shape
        heads = self.num_heads
        if self.q_lora_rank:
            q_a, kv_a = self.fused_qkv_a_proj(hidden).split(
                [self.q_lora_rank, self.kv_lora_rank + self.qk_rope_head_dim], dim=-1
            )
            q = self.q_b_proj(self.q_a_layernorm(q_a))
        else:
            q = self.q_proj(hidden)
            kv_a = self.kv_a_proj_with_mqa(hidden)
        q = q.view(batch, steps, heads, -1).transpose(1, 2)  # [B, h, T, qk_head_dim]
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = kv_a.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        k_pe = k_pe.unsqueeze(1)
        cos, sin = self.rotary_emb(positions)
        q_pe = apply_rotary(q_pe, cos, sin)
        k_pe = apply_rotary(k_pe, cos, sin)
        if cache is not None:
            c_kv, k_pe = cache.update(self.layer_index, c_kv, k_pe)
        future = torch.arange(c_kv.shape[1], device=hidden.device)[None, :] > positions[:, None]
        if self.W_UV is None:
            out = self._attend_naive(q_nope, q_pe, c_kv, k_pe, future)
        else:
            out = self._attend_absorbed(q_nope, q_pe, c_kv, k_pe, future)
        return self.o_proj(out.transpose(1, 2).reshape(batch, steps, heads * self.v_head_dim))

    def _softmax(self, scores, future, dtype):
        scores = (scores.float() * self.softmax_scale).masked_fill(future, float("-inf"))
        return scores.softmax(dim=-1).to(dtype)

    def _attend_naive(self, q_nope, q_pe, c_kv, k_pe, future):
        batch, seen, _ = c_kv.shape
        kv = self.kv_b_proj(c_kv).view(batch, seen, self.num_heads, -1).transpose(1, 2)
        k_nope, value = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        scores = q_nope @ k_nope.transpose(-1, -2) + q_pe @ k_pe.transpose(-1, -2)
        return self._softmax(scores, future, q_nope.dtype) @ value

    def _attend_absorbed(self, q_nope, q_pe, c_kv, k_pe, future):
        batch, heads, steps, _ = q_nope.shape
        q_by_head = q_nope.transpose(0, 1).reshape(heads, batch * steps, self.qk_nope_head_dim)
        q_latent = torch.bmm(q_by_head, self.W_UK_T).view(heads, batch, steps, -1).transpose(0, 1)
        latent = c_kv.unsqueeze(1)
        scores = q_latent @ latent.transpose(-1, -2) + q_pe @ k_pe.transpose(-1, -2)
        out_latent = self._softmax(scores, future, q_nope.dtype) @ latent
        out_by_head = out_latent.transpose(0, 1).reshape(heads, batch * steps, self.kv_lora_rank)
        out = torch.bmm(out_by_head, self.W_UV)
        return out.view(heads, batch, steps, self.v_head_dim).transpose(0, 1)


# ------------------------------------------------------------------------------------ feed-forward


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = MergedColumnLinear(hidden_size, [intermediate_size] * 2, dtype)
        self.down_proj = RowLinear(intermediate_size, hidden_size, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class FusedMoE(nn.Module):
    """Routed experts as two stacks: ``w13_weight`` [E, 2I, H] (gate rows, then up rows) and
    ``w2_weight`` [E, H, I]. The checkpoint holds one tensor per expert and projection."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.w13_weight = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype), requires_grad=False
        )
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype), requires_grad=False)
        for weight in (self.w13_weight, self.w2_weight):
            set_weight_attrs(weight, {"weight_loader": self.weight_loader})

    @staticmethod
    def make_expert_params_mapping(num_experts: int) -> list:
        """(parameter name part, checkpoint name part, expert id, shard id) for every expert tensor."""
        return [
            ("experts.w13_weight" if shard_id in ("w1", "w3") else "experts.w2_weight",
             f"experts.{expert_id}.{projection}.weight", expert_id, shard_id)
            for expert_id in range(num_experts)
            for shard_id, projection in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))
        ]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, weight_name: str, shard_id: str,
                      expert_id: int) -> None:
        expert = param.data[expert_id]
        if shard_id == "w2":
            target = expert
        elif shard_id in ("w1", "w3"):
            size = self.intermediate_size
            target = expert.narrow(0, 0 if shard_id == "w1" else size, size)
        else:
            raise ValueError(f"{weight_name}: shard id must be 'w1', 'w2' or 'w3', got {shard_id!r}")
        check_shape(target, loaded, f"{weight_name} expert {expert_id} shard {shard_id}")
        target.copy_(loaded)

    def forward(self, x: torch.Tensor, selected: torch.Tensor, routing_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for expert in selected.unique().tolist():
            token, slot = torch.where(selected == expert)
            gate, up = F.linear(x[token], self.w13_weight[expert]).split(self.intermediate_size, dim=-1)
            y = F.linear(F.silu(gate) * up, self.w2_weight[expert]) * routing_weights[token, slot, None]
            out.index_add_(0, token, y)
        return out


class MoE(nn.Module):
    def __init__(self, config: DeepSeekConfig):
        super().__init__()
        c = config
        self.top_k = c.num_experts_per_tok
        self.scoring_func = c.scoring_func
        self.norm_topk_prob = c.norm_topk_prob
        self.routed_scaling_factor = c.routed_scaling_factor
        self.gate = ReplicatedLinear(c.hidden_size, c.n_routed_experts, c.dtype)
        self.experts = FusedMoE(c.n_routed_experts, c.hidden_size, c.moe_intermediate_size, c.dtype)
        self.shared_experts = (
            MLP(c.hidden_size, c.moe_intermediate_size * c.n_shared_experts, c.dtype) if c.n_shared_experts else None
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        routing_weights, selected = route(self, self.gate(x), x.dtype)
        out = self.experts(x, selected, routing_weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(shape)


# ------------------------------------------------------------------------------------ the model


class DecoderLayer(nn.Module):
    def __init__(self, config: DeepSeekConfig, layer_index: int):
        super().__init__()
        c = config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.dtype)
        self.self_attn = MLAttention(c, layer_index)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.dtype)
        self.mlp = MoE(c) if c.is_moe_layer(layer_index) else MLP(c.hidden_size, c.intermediate_size, c.dtype)

    def forward(self, hidden, positions, cache):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), positions, cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DeepseekModel(nn.Module):
    def __init__(self, config: DeepSeekConfig):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, config.dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)

    def forward(self, input_ids, positions, cache):
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(hidden, positions, cache)
        return self.norm(hidden)


class DeepseekForCausalLM(nn.Module):
    """Build with uninitialised weights (on the current default device), then ``load_weights``."""

    # (parameter name part, checkpoint name part, shard id): checkpoint tensors that are shards of one
    # fused parameter.
    stacked_params_mapping = [
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
        ("fused_qkv_a_proj", "q_a_proj", "q"),
        ("fused_qkv_a_proj", "kv_a_proj_with_mqa", "kv"),
    ]

    def __init__(self, config: DeepSeekConfig):
        super().__init__()
        if config.tie_word_embeddings:
            raise ValueError("this vLLM-style reference model has an untied lm_head")
        self.config = config
        self.model = DeepseekModel(config)
        self.lm_head = VocabEmbedding(config.vocab_size, config.hidden_size, config.dtype)

    def forward(self, input_ids: torch.Tensor, cache: Optional[LatentCache] = None) -> torch.Tensor:
        start = len(cache) if cache is not None else 0
        positions = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
        return F.linear(self.model(input_ids, positions, cache), self.lm_head.weight)

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> set:
        """Load checkpoint tensors (name, tensor) through each parameter's ``weight_loader``; returns
        the parameter names loaded. Unknown names raise, naming the checkpoint tensor."""
        params = dict(self.named_parameters())
        expert_mapping = FusedMoE.make_expert_params_mapping(self.config.n_routed_experts)
        loaded_params = set()
        for name, loaded in weights:
            target = None
            for param_part, ckpt_part, shard_id in self.stacked_params_mapping:
                # Routed experts have gate_proj/up_proj too; they go to the fused MoE stacks below.
                if ckpt_part not in name or "mlp.experts." in name:
                    continue
                candidate = name.replace(ckpt_part, param_part)
                if candidate not in params:
                    continue  # e.g. kv_a_proj_with_mqa is its own layer when q_lora_rank == 0
                target = candidate
                param = params[target]
                param.weight_loader(param, loaded, shard_id)
                break
            else:
                for param_part, ckpt_part, expert_id, shard_id in expert_mapping:
                    if ckpt_part not in name:
                        continue
                    target = name.replace(ckpt_part, param_part)
                    param = params[target]
                    param.weight_loader(param, loaded, target, shard_id=shard_id, expert_id=expert_id)
                    break
                else:
                    if name not in params:
                        raise KeyError(
                            f"checkpoint tensor '{name}' of shape {tuple(loaded.shape)} "
                            f"({loaded.numel() * loaded.element_size()} bytes) matches no parameter of {type(self).__name__}"
                        )
                    target = name
                    param = params[target]
                    getattr(param, "weight_loader", default_weight_loader)(param, loaded)
            loaded_params.add(target)
        return loaded_params

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        for layer in self.model.layers:
            layer.self_attn.process_weights_after_loading()

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy decoding with the latent cache; returns input_ids followed by the new tokens."""
        cache = LatentCache()
        logits = self(input_ids, cache)
        new_tokens = []
        for count in range(max_new_tokens):
            next_token = logits[:, -1].argmax(dim=-1, keepdim=True)
            new_tokens.append(next_token)
            if count + 1 < max_new_tokens:
                logits = self(next_token, cache)
        return torch.cat([input_ids, *new_tokens], dim=1)


# ------------------------------------------------------------------------------------ checkpoints


def random_checkpoint(config: DeepSeekConfig, seed: int = 0) -> Dict[str, torch.Tensor]:
    """HF-layout checkpoint tensors with random values (std 1/sqrt(fan_in), norms 1), ``o_proj``
    stored as int8 + ``weight_scale``. Deterministic for a seed."""
    c = config
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.empty(shape, dtype=torch.float32).normal_(0.0, shape[-1] ** -0.5, generator=generator).to(c.dtype)

    def ones(n):
        return torch.ones(n, dtype=c.dtype)

    tensors = {"model.embed_tokens.weight": randn(c.vocab_size, c.hidden_size)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = ones(c.hidden_size)
        tensors[p + "post_attention_layernorm.weight"] = ones(c.hidden_size)
        a = p + "self_attn."
        if c.q_lora_rank:
            tensors[a + "q_a_proj.weight"] = randn(c.q_lora_rank, c.hidden_size)
            tensors[a + "q_a_layernorm.weight"] = ones(c.q_lora_rank)
            tensors[a + "q_b_proj.weight"] = randn(c.num_heads * c.qk_head_dim, c.q_lora_rank)
        else:
            tensors[a + "q_proj.weight"] = randn(c.num_heads * c.qk_head_dim, c.hidden_size)
        tensors[a + "kv_a_proj_with_mqa.weight"] = randn(c.kv_lora_rank + c.qk_rope_head_dim, c.hidden_size)
        tensors[a + "kv_a_layernorm.weight"] = ones(c.kv_lora_rank)
        tensors[a + "kv_b_proj.weight"] = randn(c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
        tensors[a + "o_proj.weight"], tensors[a + "o_proj.weight_scale"] = quantize_int8(
            randn(c.hidden_size, c.num_heads * c.v_head_dim)
        )
        m = p + "mlp."
        if c.is_moe_layer(i):
            tensors[m + "gate.weight"] = randn(c.n_routed_experts, c.hidden_size)
            for e in range(c.n_routed_experts):
                tensors[m + f"experts.{e}.gate_proj.weight"] = randn(c.moe_intermediate_size, c.hidden_size)
                tensors[m + f"experts.{e}.up_proj.weight"] = randn(c.moe_intermediate_size, c.hidden_size)
                tensors[m + f"experts.{e}.down_proj.weight"] = randn(c.hidden_size, c.moe_intermediate_size)
            inter, prefix = c.moe_intermediate_size * c.n_shared_experts, m + "shared_experts."
            if not c.n_shared_experts:
                continue
        else:
            inter, prefix = c.intermediate_size, m
        tensors[prefix + "gate_proj.weight"] = randn(inter, c.hidden_size)
        tensors[prefix + "up_proj.weight"] = randn(inter, c.hidden_size)
        tensors[prefix + "down_proj.weight"] = randn(c.hidden_size, inter)
    tensors["model.norm.weight"] = ones(c.hidden_size)
    tensors["lm_head.weight"] = randn(c.vocab_size, c.hidden_size)
    return tensors


def iterate_checkpoint(path: str, allow_outside_paths: bool = False) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor of a safetensors file, or of every shard named by a
    directory's ``*.safetensors.index.json`` (else its ``*.safetensors`` files), one tensor in memory
    at a time. Every shard's header is checked as ``ot.load_safetensors`` checks it before any tensor
    is given, and the tensors are read, not memory-mapped (``safetensors_files.tensors`` says why), so
    a damaged or hostile checkpoint is an ``ot.CheckpointError`` naming the file. ``allow_outside_paths``:
    as for ``ot.load_safetensors``."""
    return checkpoint_tensors(path, allow_outside_paths)


def write_sharded_checkpoint(tensors: dict, directory, shard_bytes: int) -> int:
    """safetensors shards of about ``shard_bytes`` each plus the index.json naming them, the layout
    ``iterate_checkpoint`` (and vLLM, and ``ot.load_safetensors``) read; returns the shard count."""
    from safetensors.torch import save_file

    shards, current, size = [], {}, 0
    for name, t in tensors.items():
        if current and size + t.numel() * t.element_size() > shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = t.contiguous()
        size += t.numel() * t.element_size()
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(directory, file))
        weight_map.update({name: file for name in shard})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return len(shards)
