"""The reference DeepSeek (``deepseek.py``) tensor-parallel and FP8, built per rank the way vLLM
builds DeepSeek-R1 for ``tensor_parallel_size``: each rank holds only its slices, and its weight
loaders narrow each checkpoint tensor to that rank's slice before reading it.

- Attention (``q_proj``, ``kv_b_proj`` by output columns, ``o_proj`` by input rows: a rank runs
  ``num_heads / world`` heads), the dense MLP and the shared experts (gate/up by columns, down by
  rows) and the routed experts (every expert's intermediate dim split across ranks) are
  Megatron-style: one ``all_reduce`` after each row-parallel product.
- Those weights are stored ``float8_e4m3fn`` with ``weight_scale_inv`` block scales (128 x 128 in
  DeepSeek-R1's checkpoint; ``BLOCK`` here) and dequantised in forward, as a GPU without FP8
  kernels runs them.
- ``process_weights_after_loading`` absorbs the dequantised ``kv_b_proj`` into ``W_UK``/``W_UV``
  (MLA) and drops it; the embedding stays tied to the LM head, replicated.

Plain PyTorch plus ``torch.distributed``; it knows nothing about offloading.
"""

from __future__ import annotations

import functools
from typing import Dict, Iterable, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import deepseek
from .deepseek import DeepSeekConfig

BLOCK = 16  # the FP8 scale block (DeepSeek-R1: 128); checkpoints' dims are multiples of it per rank
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def quantize_fp8(weight: torch.Tensor, block: int = BLOCK) -> Tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [..., O, I] as (fp8 values, ``weight_scale_inv`` [..., O/block, I/block]): each
    block's max magnitude maps to the FP8 maximum, as DeepSeek's checkpoints are made."""
    *lead, o, i = weight.shape
    blocks = weight.float().reshape(*lead, o // block, block, i // block, block)
    scale_inv = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale_inv[..., :, None, :, None]).to(FP8).reshape(weight.shape)
    return q, scale_inv


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The dense weight of an FP8 ``weight`` and its block ``scale_inv``."""
    *lead, o, i = weight.shape
    bo, bi = o // scale_inv.shape[-2], i // scale_inv.shape[-1]
    blocks = weight.float().reshape(*lead, o // bo, bo, i // bi, bi) * scale_inv[..., :, None, :, None]
    return blocks.reshape(weight.shape).to(dtype)


class _Rank:
    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world

    def narrow(self, loaded, dim: int, size: int):
        """This rank's ``size`` slices of ``loaded`` along ``dim``: a tensor, or a safetensors slice
        (``safe_open(...).get_slice(name)``), whose bytes outside the slice are never read."""
        if isinstance(loaded, torch.Tensor):
            return loaded.narrow(dim, self.rank * size, size)
        index = [slice(None)] * len(loaded.get_shape())
        index[dim] = slice(self.rank * size, (self.rank + 1) * size)
        return loaded[tuple(index)]


def _load_slice(tp: _Rank, dim: int, param: nn.Parameter, loaded) -> None:
    """vLLM's ``weight_loader(param, loaded)`` for a split weight: this rank's slice along ``dim``."""
    param.data.copy_(tp.narrow(loaded, dim, param.shape[dim]))


class Fp8ParallelLinear(nn.Module):
    """A linear layer whose FP8 weight is split across ranks: by output rows (``parallel="column"``)
    or by input columns (``"row"``, its partial products summed with ``all_reduce``)."""

    def __init__(self, in_features: int, out_features: int, parallel: str, tp: _Rank, dtype: torch.dtype):
        super().__init__()
        if parallel not in ("column", "row"):
            raise ValueError(f"parallel must be 'column' or 'row', got {parallel!r}")
        self.parallel, self.tp, self.dtype = parallel, tp, dtype
        out_local = out_features // tp.world if parallel == "column" else out_features
        in_local = in_features // tp.world if parallel == "row" else in_features
        self.weight = nn.Parameter(torch.empty(out_local, in_local, dtype=FP8), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.empty(out_local // BLOCK, in_local // BLOCK), requires_grad=False)
        self.attach_loaders()

    def attach_loaders(self) -> None:
        """Give each Parameter its ``weight_loader`` (again after ``to_empty``, which makes new ones).
        Not a bound method: a Parameter holding its module would be a reference cycle that keeps a
        deleted layer's weights (kv_b_proj after absorption) alive until the garbage collector runs."""
        loader = functools.partial(_load_slice, self.tp, 0 if self.parallel == "column" else 1)
        for p in (self.weight, self.weight_scale_inv):
            p.weight_loader = loader

    def dense_weight(self) -> torch.Tensor:
        return dequantize_fp8(self.weight, self.weight_scale_inv, self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.dense_weight())
        if self.parallel == "row" and self.tp.world > 1:
            dist.all_reduce(y)
        return y


class Fp8ParallelExperts(nn.Module):
    """Stacked routed experts in FP8, each expert's intermediate dim split across ranks (w1/w3 by
    rows, w2 by columns); only the routed experts are read and dequantised."""

    def __init__(self, experts: int, hidden: int, intermediate: int, tp: _Rank, dtype: torch.dtype):
        super().__init__()
        self.tp, self.dtype = tp, dtype
        local = intermediate // tp.world
        shapes = {"w1": (experts, local, hidden), "w3": (experts, local, hidden), "w2": (experts, hidden, local)}
        for name, shape in shapes.items():
            setattr(self, name, nn.Parameter(torch.empty(shape, dtype=FP8), requires_grad=False))
            setattr(self, f"{name}_scale_inv",
                    nn.Parameter(torch.empty(experts, shape[1] // BLOCK, shape[2] // BLOCK), requires_grad=False))
        self.attach_loaders()

    def attach_loaders(self) -> None:
        for name in ("w1", "w3", "w2"):
            split = 2 if name == "w2" else 1  # the intermediate dim, of the weight and of its scales
            loader = functools.partial(_load_slice, self.tp, split)
            getattr(self, name).weight_loader = getattr(self, f"{name}_scale_inv").weight_loader = loader

    def _expert(self, name: str, e: int) -> torch.Tensor:
        return dequantize_fp8(getattr(self, name)[e], getattr(self, f"{name}_scale_inv")[e], self.dtype)

    def forward(self, x: torch.Tensor, selected: torch.Tensor, routing_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for expert in selected.unique().tolist():
            token, slot = torch.where(selected == expert)
            x_e = x[token]
            h = F.silu(F.linear(x_e, self._expert("w1", expert))) * F.linear(x_e, self._expert("w3", expert))
            out.index_add_(0, token, F.linear(h, self._expert("w2", expert)) * routing_weights[token, slot, None])
        if self.tp.world > 1:
            dist.all_reduce(out)
        return out


class _Fp8MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, tp: _Rank, dtype: torch.dtype):
        super().__init__()
        self.gate_proj = Fp8ParallelLinear(hidden, intermediate, "column", tp, dtype)
        self.up_proj = Fp8ParallelLinear(hidden, intermediate, "column", tp, dtype)
        self.down_proj = Fp8ParallelLinear(intermediate, hidden, "row", tp, dtype)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _absorb(attn: deepseek.MLAttention) -> None:
    """MLA absorption of the FP8 ``kv_b_proj``: dequantised, split per (local) head into W_UK and W_UV."""
    if attn.absorbed:
        return
    per_head = attn.kv_b_proj.dense_weight().view(attn.num_heads, attn.qk_nope_head_dim + attn.v_head_dim,
                                                  attn.kv_lora_rank)
    w_uk, w_uv = per_head.split([attn.qk_nope_head_dim, attn.v_head_dim], dim=1)
    attn.W_UK = nn.Parameter(w_uk.contiguous(), requires_grad=False)
    attn.W_UV = nn.Parameter(w_uv.transpose(1, 2).contiguous(), requires_grad=False)
    del attn.kv_b_proj
    attn.absorbed = True


def build(config: DeepSeekConfig, rank: int, world: int) -> deepseek.DeepSeekForCausalLM:
    """This rank's model, weights uninitialised (``load_weights`` fills them)."""
    c, tp = config, _Rank(rank, world)
    if c.q_lora_rank or c.num_heads % world:
        raise ValueError(f"build: q_lora_rank must be 0 and num_heads ({c.num_heads}) a multiple of world ({world})")
    with torch.device("meta"):  # this rank's slices replace the full layers before any memory is taken
        model = deepseek.DeepSeekForCausalLM(c)
        _split_layers(model, c, tp)
    model.to_empty(device="cpu")
    model.lm_head.weight = model.embed_tokens.weight  # tied, replicated
    model.reset_buffers()
    for module in model.modules():
        if isinstance(module, (Fp8ParallelLinear, Fp8ParallelExperts)):
            module.attach_loaders()
    return model


def _split_layers(model: deepseek.DeepSeekForCausalLM, c: DeepSeekConfig, tp: _Rank) -> None:
    world = tp.world
    heads = c.num_heads * c.qk_head_dim
    for layer in model.layers:
        attn = layer.self_attn
        attn.q_proj = Fp8ParallelLinear(c.hidden_size, heads, "column", tp, c.dtype)
        attn.kv_b_proj = Fp8ParallelLinear(c.kv_lora_rank, c.num_heads * (c.qk_nope_head_dim + c.v_head_dim),
                                           "column", tp, c.dtype)
        attn.o_proj = Fp8ParallelLinear(c.num_heads * c.v_head_dim, c.hidden_size, "row", tp, c.dtype)
        attn.num_heads //= world
        if isinstance(layer.mlp, deepseek.MoE):
            layer.mlp.experts = Fp8ParallelExperts(c.n_routed_experts, c.hidden_size, c.moe_intermediate_size, tp,
                                                   c.dtype)
            layer.mlp.shared_experts = _Fp8MLP(c.hidden_size, c.moe_intermediate_size * c.n_shared_experts, tp,
                                               c.dtype)
        else:
            layer.mlp = _Fp8MLP(c.hidden_size, c.intermediate_size, tp, c.dtype)


def load_weights(model: nn.Module, weights: Iterable[Tuple[str, object]]) -> set:
    """vLLM's loop: each checkpoint tensor (or safetensors slice) goes to its parameter's
    ``weight_loader``, or is copied whole (replicated weights). Returns the names loaded."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = set()
    for name, value in weights:
        param = params.get(name)
        if param is None:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else tuple(value.get_shape())
            raise KeyError(f"checkpoint tensor '{name}' of shape {shape} matches no parameter of "
                           f"{type(model).__name__}")
        loader = getattr(param, "weight_loader", None)
        if loader is not None:
            loader(param, value)
        else:
            param.data.copy_(value if isinstance(value, torch.Tensor) else value[:])
        loaded.add(name)
    return loaded


class CountingSlice:
    """A safetensors slice (``safe_open(...).get_slice(name)``) that adds the bytes a loader reads
    through it to ``counter[0]``: how the test and the benchmark show that a rank reads only its
    slices of the file."""

    def __init__(self, inner, counter: list):
        self.inner, self.counter = inner, counter

    def get_shape(self):
        return self.inner.get_shape()

    def __getitem__(self, index):
        t = self.inner[index]
        self.counter[0] += t.numel() * t.element_size()
        return t


def process_weights_after_loading(model: deepseek.DeepSeekForCausalLM) -> None:
    for layer in model.layers:
        _absorb(layer.self_attn)


def checkpoint(config: DeepSeekConfig, seed: int = 0) -> Dict[str, torch.Tensor]:
    """A full (unsharded) FP8 checkpoint of the reference model's random weights, with the names
    ``build`` uses: attention, MLP and expert weights FP8 plus ``*_scale_inv``, the rest as is."""
    full = deepseek.DeepSeekForCausalLM(config).init_weights(seed)
    out = {}
    for name, t in full.state_dict().items():
        if name.endswith("inv_freq") or name == "lm_head.weight":
            continue
        quantised = t.dim() >= 2 and (".self_attn." in name and "kv_a_proj" not in name or ".mlp." in name) \
            and ".gate." not in name
        if quantised:
            q, s = quantize_fp8(t)
            base = name[:-len(".weight")] if name.endswith(".weight") else name
            out[name], out[f"{base}.weight_scale_inv" if name.endswith(".weight") else f"{name}_scale_inv"] = q, s
        else:
            out[name] = t.contiguous()
    return out
