"""A DeepSeek-V3-style decoder (multi-head latent attention + mixture of experts) in plain PyTorch.

This is the model offtensor is tested and demonstrated on, so it is written the way inference code
is written elsewhere and knows nothing about offloading: it never imports offtensor, never moves a
weight between devices and never asks where a tensor lives. Whatever runs it unwrapped must run it
wrapped, unchanged.

The parts that stress an offloading library on purpose:

- MLA keeps a KV cache of the compressed latent (``c_kv``) and the shared rotary key (``k_pe``).
  ``process_weights_after_loading()`` absorbs ``kv_b_proj`` into two new Parameters, ``W_UK`` and
  ``W_UV``, and deletes ``kv_b_proj``, as vLLM and DeepSeek's own inference code do: parameters are
  created and dropped after the weights were loaded.
- Routed experts are stacked Parameters (``experts.w1/w3 [E, I, H]``, ``experts.w2 [E, H, I]``) and
  only the experts the router picked are indexed, so only their slices are read.
- ``lm_head`` can be tied to ``embed_tokens``: one Parameter under two names.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass
class DeepSeekConfig:
    vocab_size: int = 1024
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    q_lora_rank: int = 0  # 0: queries come from a plain q_proj (DeepSeek-V2-Lite); else q_a -> norm -> q_b
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    n_routed_experts: int = 8  # 0: every layer is dense
    n_shared_experts: int = 1
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128
    intermediate_size: int = 512  # of the dense MLP in the first ``first_k_dense_replace`` layers
    first_k_dense_replace: int = 1
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    dtype: torch.dtype = torch.float32
    scoring_func: str = "softmax"  # "softmax" (DeepSeek-V2) or "sigmoid" (DeepSeek-V3)
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    routed_scaling_factor: float = 1.0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer_index: int) -> bool:
        return self.n_routed_experts > 0 and layer_index >= self.first_k_dense_replace

    def __post_init__(self):
        if self.scoring_func not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring_func must be 'softmax' or 'sigmoid', got {self.scoring_func!r}")
        if self.n_routed_experts and not 0 < self.num_experts_per_tok <= self.n_routed_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..n_routed_experts={self.n_routed_experts}"
            )
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even (rotary pairs), got {self.qk_rope_head_dim}")


# ------------------------------------------------------------------------------------ building blocks


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in float32: bf16 loses too much in the mean of squares.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


class RotaryEmbedding(nn.Module):
    """Rotary position embedding over ``dim`` features (rotate-half layout)."""

    def __init__(self, dim: int, theta: float):
        super().__init__()
        self.dim = dim
        self.theta = theta
        # Derived from the config, not loaded: non-persistent, so checkpoints do not carry it.
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self) -> torch.Tensor:
        return 1.0 / (self.theta ** (torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim))

    def reset_buffers(self) -> None:
        """Recompute ``inv_freq`` (after ``to_empty`` left it uninitialised)."""
        with torch.no_grad():
            self.inv_freq.copy_(self._inv_freq())

    def forward(self, positions: torch.Tensor):
        """cos and sin of shape [T, dim / 2] for integer positions [T]."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the last dim of ``x`` [..., T, d] by cos/sin [T, d / 2]; computed in float32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class LatentCache:
    """The MLA decode cache: per layer, the normalised latent ``c_kv`` [B, S, kv_lora_rank] and the
    rotated shared key ``k_pe`` [B, 1, S, qk_rope_head_dim] of every position seen so far.

    It holds kv_lora_rank + qk_rope_head_dim values per token and layer, instead of the
    heads * (qk_head_dim + v_head_dim) that a cache of expanded keys and values would need.
    """

    def __init__(self):
        self.c_kv: dict[int, torch.Tensor] = {}
        self.k_pe: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        """Positions cached so far (layer 0 is updated first, so this is read before a forward)."""
        first = self.c_kv.get(0)
        return 0 if first is None else first.shape[1]

    def update(self, layer_index: int, c_kv: torch.Tensor, k_pe: torch.Tensor):
        """Append this step's latents; returns the latents of every position so far."""
        if layer_index in self.c_kv:
            c_kv = torch.cat((self.c_kv[layer_index], c_kv), dim=1)
            k_pe = torch.cat((self.k_pe[layer_index], k_pe), dim=2)
        self.c_kv[layer_index] = c_kv
        self.k_pe[layer_index] = k_pe
        return c_kv, k_pe


# ------------------------------------------------------------------------------------ attention


class MLAttention(nn.Module):
    """Multi-head latent attention.

    Keys and values are compressed into one latent per token, ``c_kv = norm(kv_a(x))``, plus a
    rotary key ``k_pe`` shared by all heads. The naive path expands the latent back into per-head
    keys and values with ``kv_b_proj``. After ``process_weights_after_loading()`` the absorbed path
    never expands it: the key half of ``kv_b_proj`` (``W_UK``) is folded into the query and the value
    half (``W_UV``) is applied to the attention output, both in the latent space, which is what
    makes decode with a latent cache cheap.
    """

    def __init__(self, config: DeepSeekConfig, layer_index: int):
        super().__init__()
        c = config
        self.layer_index = layer_index
        self.num_heads = c.num_heads
        self.qk_nope_head_dim = c.qk_nope_head_dim
        self.qk_rope_head_dim = c.qk_rope_head_dim
        self.v_head_dim = c.v_head_dim
        self.kv_lora_rank = c.kv_lora_rank
        self.softmax_scale = c.qk_head_dim ** -0.5
        self.absorbed = False
        linear = dict(bias=False, dtype=c.dtype)
        if c.q_lora_rank:
            self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, **linear)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps, c.dtype)
            self.q_b_proj = nn.Linear(c.q_lora_rank, c.num_heads * c.qk_head_dim, **linear)
        else:
            self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.qk_head_dim, **linear)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, **linear)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps, c.dtype)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), **linear)
        self.o_proj = nn.Linear(c.num_heads * c.v_head_dim, c.hidden_size, **linear)
        self.rotary = RotaryEmbedding(c.qk_rope_head_dim, c.rope_theta)

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        """Split ``kv_b_proj`` into ``W_UK`` [heads, qk_nope, kv_lora] and ``W_UV`` [heads, kv_lora, v]
        and drop ``kv_b_proj``; idempotent."""
        if self.absorbed:
            return
        per_head = self.kv_b_proj.weight.view(
            self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank
        )
        w_uk, w_uv = per_head.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)
        # Contiguous copies, so the new Parameters own their memory and kv_b_proj's can be freed.
        self.W_UK = nn.Parameter(w_uk.contiguous(), requires_grad=False)
        self.W_UV = nn.Parameter(w_uv.transpose(1, 2).contiguous(), requires_grad=False)
        del per_head, w_uk, w_uv
        del self.kv_b_proj
        self.absorbed = True

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, cache: Optional[LatentCache]) -> torch.Tensor:
        batch, steps, _ = hidden.shape
        heads = self.num_heads
        if hasattr(self, "q_a_proj"):
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        else:
            q = self.q_proj(hidden)
        q = q.view(batch, steps, heads, -1).transpose(1, 2)  # [B, h, T, qk_head_dim]
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)

        c_kv, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)  # [B, T, kv_lora]
        k_pe = k_pe.unsqueeze(1)  # [B, 1, T, rope]: one rotary key shared by every head
        cos, sin = self.rotary(positions)
        q_pe = apply_rotary(q_pe, cos, sin)
        k_pe = apply_rotary(k_pe, cos, sin)
        if cache is not None:
            c_kv, k_pe = cache.update(self.layer_index, c_kv, k_pe)

        # Query t (at position positions[t]) may attend to every cached position up to its own.
        seen = c_kv.shape[1]
        future = torch.arange(seen, device=hidden.device)[None, :] > positions[:, None]
        if self.absorbed:
            out = self._attend_absorbed(q_nope, q_pe, c_kv, k_pe, future)
        else:
            out = self._attend_naive(q_nope, q_pe, c_kv, k_pe, future)
        return self.o_proj(out.transpose(1, 2).reshape(batch, steps, heads * self.v_head_dim))

    def _softmax(self, scores: torch.Tensor, future: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        scores = (scores.float() * self.softmax_scale).masked_fill(future, float("-inf"))
        return scores.softmax(dim=-1).to(dtype)

    def _attend_naive(self, q_nope, q_pe, c_kv, k_pe, future):
        batch, seen, _ = c_kv.shape
        kv = self.kv_b_proj(c_kv).view(batch, seen, self.num_heads, -1).transpose(1, 2)
        k_nope, value = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)  # [B, h, S, *]
        scores = q_nope @ k_nope.transpose(-1, -2) + q_pe @ k_pe.transpose(-1, -2)
        return self._softmax(scores, future, q_nope.dtype) @ value  # [B, h, T, v]

    def _attend_absorbed(self, q_nope, q_pe, c_kv, k_pe, future):
        batch, heads, steps, _ = q_nope.shape
        # Heads lead so each head's slice of W_UK / W_UV is one batched matmul operand as it is.
        q_nope_by_head = q_nope.transpose(0, 1).reshape(heads, batch * steps, self.qk_nope_head_dim)
        q_latent = torch.bmm(q_nope_by_head, self.W_UK).view(heads, batch, steps, -1).transpose(0, 1)
        latent = c_kv.unsqueeze(1)  # [B, 1, S, kv_lora]: keys and values of every head
        scores = q_latent @ latent.transpose(-1, -2) + q_pe @ k_pe.transpose(-1, -2)
        out_latent = self._softmax(scores, future, q_nope.dtype) @ latent  # [B, h, T, kv_lora]
        out_by_head = out_latent.transpose(0, 1).reshape(heads, batch * steps, self.kv_lora_rank)
        out = torch.bmm(out_by_head, self.W_UV)  # [h, B*T, v]
        return out.view(heads, batch, steps, self.v_head_dim).transpose(0, 1)


# ------------------------------------------------------------------------------------ feed-forward


class MLP(nn.Module):
    """SwiGLU feed-forward: the dense layers and the shared experts."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class RoutedExperts(nn.Module):
    """``num_experts`` SwiGLU experts stacked into three Parameters, as checkpoints converted for
    fused MoE kernels store them: w1 (gate) and w3 (up) [E, I, H], w2 (down) [E, H, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype):
        super().__init__()
        # Left uninitialised: init_weights() or load_state_dict() fills them.
        self.w1 = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size, dtype=dtype))
        self.w3 = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype))

    def forward(self, x: torch.Tensor, selected: torch.Tensor, routing_weights: torch.Tensor) -> torch.Tensor:
        """x [N, H]; selected and routing_weights [N, top_k]: token n goes to experts selected[n]."""
        out = torch.zeros_like(x)
        # Only experts some token was routed to are read, so an unrouted expert's weights are untouched.
        for expert in selected.unique().tolist():
            token, slot = torch.where(selected == expert)
            x_e = x[token]
            h = F.silu(F.linear(x_e, self.w1[expert])) * F.linear(x_e, self.w3[expert])
            y = F.linear(h, self.w2[expert]) * routing_weights[token, slot, None]
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
        self.gate = nn.Linear(c.hidden_size, c.n_routed_experts, bias=False, dtype=c.dtype)
        self.experts = RoutedExperts(c.n_routed_experts, c.hidden_size, c.moe_intermediate_size, c.dtype)
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


def route(moe: nn.Module, router_logits: torch.Tensor, dtype: torch.dtype):
    """(routing weights in ``dtype``, selected experts) of DeepSeek's router for ``moe``'s settings
    (``scoring_func``, ``top_k``, ``norm_topk_prob``, ``routed_scaling_factor``), decided in float32
    as DeepSeek does."""
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if moe.scoring_func == "softmax" else logits.sigmoid()
    routing_weights, selected = scores.topk(moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        routing_weights = routing_weights / routing_weights.sum(dim=-1, keepdim=True)
    return (routing_weights * moe.routed_scaling_factor).to(dtype), selected


class DecoderLayer(nn.Module):
    def __init__(self, config: DeepSeekConfig, layer_index: int):
        super().__init__()
        c = config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.dtype)
        self.self_attn = MLAttention(c, layer_index)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.dtype)
        self.mlp = MoE(c) if c.is_moe_layer(layer_index) else MLP(c.hidden_size, c.intermediate_size, c.dtype)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, cache: Optional[LatentCache]) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), positions, cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


# ------------------------------------------------------------------------------------ the model


class DeepSeekForCausalLM(nn.Module):
    def __init__(self, config: DeepSeekConfig):
        super().__init__()
        c = self.config = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, dtype=c.dtype)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.dtype)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False, dtype=c.dtype)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @classmethod
    def empty(cls, config: DeepSeekConfig, device="cpu") -> "DeepSeekForCausalLM":
        """A model with uninitialised weights on ``device``, to load a state dict into; skips the
        default initialisation, which costs seconds per GB on a CPU."""
        with torch.device("meta"):
            model = cls(config)
        model.to_empty(device=device)
        if config.tie_word_embeddings:
            # to_empty() gives each module its own new Parameter; tie them again.
            model.lm_head.weight = model.embed_tokens.weight
        model.reset_buffers()
        return model

    def reset_buffers(self) -> None:
        """Recompute the buffers derived from the config (they are not in the state dict)."""
        for module in self.modules():
            if isinstance(module, RotaryEmbedding):
                module.reset_buffers()

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> "DeepSeekForCausalLM":
        """Random weights scaled so that activations stay O(1) through the layers and greedy decoding
        does not collapse onto one token. Deterministic for a seed, whatever the device."""
        generator = torch.Generator().manual_seed(seed)
        for name, param in self.named_parameters():  # a tied Parameter is listed once
            if param.dim() == 1:
                values = torch.ones(param.shape, dtype=param.dtype)  # norm scales
            else:
                # std 1/sqrt(fan_in) keeps each projection's output O(1). The embedding gets the same
                # scale (fan_in = hidden), so a tied lm_head gives O(1) logits instead of always
                # predicting the input token back.
                std = param.shape[-1] ** -0.5
                values = torch.empty(param.shape, dtype=param.dtype).normal_(0.0, std, generator=generator)
            param.copy_(values)
        return self

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        """Post-load weight rewrites (MLA absorption), as inference engines run them once after loading."""
        for layer in self.layers:
            layer.self_attn.process_weights_after_loading()

    def forward(self, input_ids: torch.Tensor, cache: Optional[LatentCache] = None) -> torch.Tensor:
        """Logits [B, T, vocab] for token ids [B, T] that follow the ``len(cache)`` cached positions."""
        start = len(cache) if cache is not None else 0
        positions = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(hidden, positions, cache)
        return self.lm_head(self.norm(hidden))

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int,
                 on_token: Optional[Callable[[int, torch.Tensor], None]] = None) -> torch.Tensor:
        """Greedy decoding with the latent cache; returns input_ids followed by the new tokens.
        ``on_token(count, tokens)`` is called after each new token (for progress output)."""
        cache = LatentCache()
        logits = self(input_ids, cache)
        new_tokens = []
        for count in range(1, max_new_tokens + 1):
            next_token = logits[:, -1].argmax(dim=-1, keepdim=True)
            new_tokens.append(next_token)
            if on_token is not None:
                on_token(count, next_token)
            if count < max_new_tokens:
                logits = self(next_token, cache)
        return torch.cat([input_ids, *new_tokens], dim=1)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each tensor counted once (tied weights once)."""
    seen = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


# Sizes for tests and the demo. Parameter counts (and bytes) are printed by the demo.
CONFIGS = {
    # ~0.5 MB in float32: unit tests (MLA with q_lora, shared and routed experts, one dense layer).
    "tiny": DeepSeekConfig(
        vocab_size=256, hidden_size=64, num_layers=3, num_heads=4, q_lora_rank=24, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=128, first_k_dense_replace=1,
    ),
    # ~190 MB in float32: a quick look.
    "small": DeepSeekConfig(
        vocab_size=8192, hidden_size=512, num_layers=6, num_heads=8, q_lora_rank=256, kv_lora_rank=128,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=16, n_shared_experts=1,
        num_experts_per_tok=2, moe_intermediate_size=256, intermediate_size=1408, first_k_dense_replace=1,
    ),
    # ~530 MB in float32: the default on the emulated device (seconds on 2 cores).
    "medium": DeepSeekConfig(
        vocab_size=8192, hidden_size=1024, num_layers=8, num_heads=8, q_lora_rank=384, kv_lora_rank=256,
        qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=16, n_shared_experts=1,
        num_experts_per_tok=2, moe_intermediate_size=256, intermediate_size=2816, first_k_dense_replace=1,
    ),
    # ~6.8 GB in bfloat16: the default on a GPU.
    "large": DeepSeekConfig(
        vocab_size=32000, hidden_size=2048, num_layers=12, num_heads=16, q_lora_rank=768, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, n_shared_experts=1,
        num_experts_per_tok=6, moe_intermediate_size=704, intermediate_size=5632, first_k_dense_replace=1,
        scoring_func="sigmoid", norm_topk_prob=True,
    ),
}
