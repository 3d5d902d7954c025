"""A DeepSeek-V2/V3-style decoder laid out the way vLLM lays its models out, with vLLM's way of
loading a checkpoint: Parameter subclasses, attributes set on Parameters, one ``weight_loader`` per
weight, and a ``load_weights`` loop mapping checkpoint names onto fused parameters.

Like ``deepseek.py`` it is plain PyTorch and knows nothing about offloading. It is what offtensor must
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

With ``Parallel(rank, size, fp8_block=b)`` it is also the seed's own layout (DeepSeek-R1 under vLLM at
``tensor_parallel_size=8``), one rank's part of it:
- tensor parallelism as vLLM's linear layers do it: attention heads, MLP and expert intermediate
  rows, and the vocabulary are split across ranks; row-parallel outputs, the embedding and the MoE
  are summed with ``all_reduce``, the vocabulary-parallel logits gathered;
- FP8 as DeepSeek-R1's checkpoint stores it: attention and expert weights ``float8_e4m3fn`` with
  ``weight_scale_inv`` scales per ``b x b`` block, dequantised in forward (what a GPU without FP8
  kernels does); ``kv_b_proj`` is dequantised once in ``process_weights_after_loading`` for MLA's
  absorbed weights;
- sharded reads: ``iterate_checkpoint(path, lazy=True)`` yields ``CheckpointSlice``s that read only
  the part a loader narrows to, so each rank reads its own shard of the file;
- tied embeddings (``tie_word_embeddings``): ``lm_head`` is ``embed_tokens``.

Names and checkpoint format follow the HF DeepSeek-V2 layout (``model.layers.N.mlp.experts.E.gate_proj.weight``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable, Dict, Iterable, Iterator, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .deepseek import DeepSeekConfig, LatentCache, RMSNorm, RotaryEmbedding, apply_rotary, route


# ------------------------------------------------------------------------------------ one rank's part

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class Parallel:
    """Which part of the model this process holds (vLLM's tensor-parallel rank and size) and how its
    weights are stored (``fp8_block``: 0 for ``config.dtype``, else attention and expert weights in
    float8 with one ``weight_scale_inv`` per ``fp8_block x fp8_block`` block)."""

    rank: int = 0
    size: int = 1
    group: object = None  # a torch.distributed process group; None: the default one
    fp8_block: int = 0

    def split(self, n: int, what: str) -> int:
        """This rank's share of ``n`` rows; refuses a split that would not be even."""
        if n % self.size:
            raise ValueError(f"{what}: {n} does not split evenly over tensor_parallel_size={self.size}")
        return n // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' ``x`` side by side along the last dim (vocabulary-parallel logits)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = Parallel()


class CheckpointSlice:
    """A checkpoint tensor not read yet: its shape, and reads of the part a loader narrows to
    (safetensors' ``get_slice``), so a rank reads only its shard. ``log`` (a dict) counts the bytes
    read under ``"bytes"``."""

    __slots__ = ("name", "shape", "_slice", "_log")

    def __init__(self, name: str, piece, log: Optional[dict] = None):
        self.name, self._slice, self._log = name, piece, log
        self.shape = torch.Size(piece.get_shape())

    def _read(self, index) -> torch.Tensor:
        t = self._slice[index]
        if self._log is not None:
            self._log["bytes"] = self._log.get("bytes", 0) + t.numel() * t.element_size()
        return t

    def narrow(self, dim: int, start: int, size: int) -> torch.Tensor:
        return self._read((slice(None),) * dim + (slice(start, start + size),))

    def read(self) -> torch.Tensor:
        return self._read((slice(None),) * len(self.shape))

    def nbytes(self) -> int:
        return self.shape.numel() * _SAFETENSORS_ITEMSIZE.get(self._slice.get_dtype(), 1)


_SAFETENSORS_ITEMSIZE = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2, "F8_E4M3": 1,
                         "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}


def nbytes(loaded) -> int:
    """Bytes of a loaded tensor, read or not (for error messages)."""
    return loaded.nbytes() if isinstance(loaded, CheckpointSlice) else loaded.numel() * loaded.element_size()


def read(loaded) -> torch.Tensor:
    """The whole of a loaded tensor (a torch.Tensor, or a ``CheckpointSlice`` read now)."""
    return loaded.read() if isinstance(loaded, CheckpointSlice) else loaded


def rank_part(loaded, dim: int, size: int, par: Parallel):
    """This rank's ``size`` rows of ``loaded`` along ``dim``: vLLM's ``narrow(dim, rank * size, size)``,
    reading only those rows of a ``CheckpointSlice``."""
    if par.size == 1:
        return read(loaded)
    if loaded.shape[dim] != size * par.size:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} cannot give {par.size} ranks "
                         f"{size} rows each along dim {dim}")
    return loaded.narrow(dim, par.rank * size, size)


def quantize_fp8_block(weight: torch.Tensor, block: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-R1's FP8 format: (float8_e4m3fn weight, float32 ``weight_scale_inv`` [out/b, in/b])
    with weight ~ q * scale_inv per ``block x block`` block."""
    rows, cols = weight.shape
    blocks = weight.float().view(rows // block, block, cols // block, block)
    scale_inv = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale_inv[:, None, :, None]).view(rows, cols).to(FP8)
    return q, scale_inv


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: int, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` (float8, [..., out, in]) times its block scales, in ``dtype``."""
    scale = scale_inv.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return (weight.to(torch.float32) * scale).to(dtype)


# ------------------------------------------------------------------------------------ parameters


def set_weight_attrs(weight: torch.Tensor, attrs: Optional[dict]) -> None:
    """Attach loader metadata to a Parameter, refusing to overwrite one already set."""
    for key, value in (attrs or {}).items():
        if hasattr(weight, key):
            raise AttributeError(f"{type(weight).__name__} of shape {tuple(weight.shape)} already has '{key}'")
        setattr(weight, key, value)


def _check_shape(param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(
            f"{what}: checkpoint tensor of shape {tuple(loaded.shape)} ({nbytes(loaded)} bytes) "
            f"does not fit the parameter slice of shape {tuple(param.shape)}"
        )


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Loader of weights that need no mapping (norms, embeddings): a whole-tensor copy."""
    _check_shape(param, loaded, "default_weight_loader")
    param.data.copy_(read(loaded))


class BaseWeightParameter(nn.Parameter):
    """A frozen weight that knows its loader. Constructed as ``Cls(data=..., weight_loader=...)``."""

    def __new__(cls, data: torch.Tensor, **kwargs):
        return super().__new__(cls, data, requires_grad=False)

    def __init__(self, data: torch.Tensor, weight_loader: Callable):
        self._weight_loader = weight_loader

    @property
    def weight_loader(self) -> Callable:
        return self._weight_loader

    def load_weight(self, loaded: torch.Tensor) -> None:
        _check_shape(self.data, loaded, type(self).__name__)
        self.data.copy_(read(loaded))


class ModelWeightParameter(BaseWeightParameter):
    """A linear layer's weight: rows along ``output_dim``, columns along ``input_dim``."""

    def __init__(self, data: torch.Tensor, weight_loader: Callable, output_dim: int, input_dim: int):
        super().__init__(data, weight_loader)
        self._output_dim = output_dim
        self._input_dim = input_dim

    @property
    def output_dim(self) -> int:
        return self._output_dim

    @property
    def input_dim(self) -> int:
        return self._input_dim

    def load_merged_column_weight(self, loaded: torch.Tensor, shard_offset: int, shard_size: int) -> None:
        shard = self.data.narrow(self.output_dim, shard_offset, shard_size)
        _check_shape(shard, loaded, f"merged column shard at {shard_offset}")
        shard.copy_(read(loaded))

    def load_qkv_weight(self, loaded: torch.Tensor, shard_id: str, shard_offsets: Dict[str, Tuple[int, int]]) -> None:
        offset, size = shard_offsets[shard_id]
        shard = self.data.narrow(self.output_dim, offset, size)
        _check_shape(shard, loaded, f"packed shard '{shard_id}'")
        shard.copy_(read(loaded))

    def load_row_parallel_weight(self, loaded, par: Parallel = SINGLE) -> None:
        self.load_weight(rank_part(loaded, self.input_dim, self.data.shape[self.input_dim], par))


class ChannelScaleParameter(BaseWeightParameter):
    """Per-output-channel dequantisation scales of a quantised weight."""

    def __init__(self, data: torch.Tensor, weight_loader: Callable, output_dim: int):
        super().__init__(data, weight_loader)
        self._output_dim = output_dim

    @property
    def output_dim(self) -> int:
        return self._output_dim


# ------------------------------------------------------------------------------------ linear layers


class _Linear(nn.Module):
    """What the linear layers share: a weight [out, in] in ``dtype``, or in float8 with block scales
    ``weight_scale_inv`` (``block`` > 0), each Parameter given by ``make``; a forward through the
    (dequantised) weight; ``dequantize`` replacing an FP8 pair by one dense Parameter."""

    def _init_weight(self, rows: int, cols: int, dtype: torch.dtype, block: int, make: Callable) -> None:
        self.dtype, self.block = dtype, block
        if block and (rows % block or cols % block):
            raise ValueError(f"{type(self).__name__}: an FP8 weight [{rows}, {cols}] does not tile into {block}-blocks")
        self.weight = make(torch.empty(rows, cols, dtype=FP8 if block else dtype))
        if block:
            self.weight_scale_inv = make(torch.empty(rows // block, cols // block, dtype=torch.float32))

    def unit(self, param: torch.Tensor) -> int:
        """Rows of the weight per row of ``param``: ``block`` for the scales, else 1."""
        return self.block if self.block and param is self.weight_scale_inv else 1

    def dense_weight(self) -> torch.Tensor:
        if not self.block:
            return self.weight
        return dequantize_fp8_block(self.weight, self.weight_scale_inv, self.block, self.dtype)

    @torch.no_grad()
    def dequantize(self) -> None:
        if self.block:
            weight = self.dense_weight()
            del self.weight_scale_inv
            self.block = 0
            self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dense_weight())


class ReplicatedLinear(_Linear):
    """A linear layer whose weight is a plain Parameter carrying vLLM attributes (``set_weight_attrs``),
    whole on every rank."""

    def __init__(self, input_size: int, output_size: int, dtype: torch.dtype, block: int = 0):
        super().__init__()
        self._init_weight(output_size, input_size, dtype, block, self._parameter)

    def _parameter(self, data: torch.Tensor) -> nn.Parameter:
        param = nn.Parameter(data, requires_grad=False)
        set_weight_attrs(param, {"weight_loader": self.weight_loader, "output_dim": 0, "input_dim": 1})
        return param

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        default_weight_loader(param, loaded)


class ColumnLinear(ReplicatedLinear):
    """Output rows split across ranks (vLLM's ``ColumnParallelLinear`` without the gather): each rank
    holds and reads rows ``[rank * out / tp, (rank + 1) * out / tp)``; its output is this rank's
    heads."""

    def __init__(self, input_size: int, output_size: int, dtype: torch.dtype, par: Parallel, block: int = 0):
        nn.Module.__init__(self)
        self.par = par
        self._init_weight(par.split(output_size, type(self).__name__), input_size, dtype, block, self._parameter)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        default_weight_loader(param, rank_part(loaded, 0, param.shape[0], self.par))


class MergedColumnLinear(_Linear):
    """Several column projections of one input in one weight (``gate_up_proj``); a checkpoint holds
    them apart and the loader places this rank's rows of shard ``i`` at ``sum(local sizes[:i])``."""

    def __init__(self, input_size: int, output_sizes: list, dtype: torch.dtype, par: Parallel = SINGLE):
        super().__init__()
        self.par = par
        self.output_sizes = [par.split(size, type(self).__name__) for size in output_sizes]
        self._init_weight(sum(self.output_sizes), input_size, dtype, 0, lambda data: ModelWeightParameter(
            data=data, weight_loader=self.weight_loader, output_dim=0, input_dim=1))

    def weight_loader(self, param: ModelWeightParameter, loaded: torch.Tensor, loaded_shard_id: int) -> None:
        offset, size = sum(self.output_sizes[:loaded_shard_id]), self.output_sizes[loaded_shard_id]
        param.load_merged_column_weight(rank_part(loaded, 0, size, self.par), shard_offset=offset, shard_size=size)


class PackedQKVLinear(_Linear):
    """Query and key/value projections packed along the output dim, loaded by named shard (MLA's
    ``fused_qkv_a_proj``: ``"q"`` the query latent, ``"kv"`` the kv latent plus the rotary key);
    latents are whole on every rank."""

    def __init__(self, input_size: int, shard_sizes: Dict[str, int], dtype: torch.dtype, block: int = 0):
        super().__init__()
        self.shard_offsets: Dict[str, Tuple[int, int]] = {}
        offset = 0
        for shard_id, size in shard_sizes.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size
        self._init_weight(offset, input_size, dtype, block, lambda data: ModelWeightParameter(
            data=data, weight_loader=self.weight_loader, output_dim=0, input_dim=1))

    def weight_loader(self, param: ModelWeightParameter, loaded: torch.Tensor, loaded_shard_id: str) -> None:
        unit = self.unit(param)
        offsets = {shard: (offset // unit, size // unit) for shard, (offset, size) in self.shard_offsets.items()}
        param.load_qkv_weight(loaded, loaded_shard_id, offsets)


class RowLinear(_Linear):
    """Input columns split across ranks (vLLM's ``RowParallelLinear``): each rank multiplies its
    columns, and ``reduce`` sums the ranks' partial outputs (off where the caller sums several)."""

    def __init__(self, input_size: int, output_size: int, dtype: torch.dtype, par: Parallel = SINGLE,
                 block: int = 0, reduce: bool = True):
        super().__init__()
        self.par, self.reduce = par, reduce
        self._init_weight(output_size, par.split(input_size, type(self).__name__), dtype, block,
                          lambda data: ModelWeightParameter(data=data, weight_loader=self.weight_loader,
                                                            output_dim=0, input_dim=1))

    def weight_loader(self, param: ModelWeightParameter, loaded: torch.Tensor) -> None:
        param.load_row_parallel_weight(loaded, self.par)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.dense_weight())
        return self.par.all_reduce(out) if self.reduce else out


class Int8Linear(nn.Module):
    """An fp8-style quantised linear layer, with int8 standing in for float8 so that it runs on any
    CPU build: ``weight`` int8 [out, in] and ``weight_scale`` [out]. ``process_weights_after_loading``
    replaces both by one dequantised Parameter, as engines do for kernels that want a plain weight.
    Row-parallel under tensor parallelism (``o_proj``): columns split, scales whole."""

    def __init__(self, input_size: int, output_size: int, dtype: torch.dtype, par: Parallel = SINGLE):
        super().__init__()
        self.dtype = dtype
        self.par = par
        self.weight = ModelWeightParameter(
            data=torch.empty(output_size, par.split(input_size, "Int8Linear"), dtype=torch.int8),
            weight_loader=self.weight_loader, output_dim=0, input_dim=1,
        )
        self.weight_scale = ChannelScaleParameter(
            data=torch.empty(output_size, dtype=torch.float32), weight_loader=self.weight_loader, output_dim=0,
        )
        self.dequantized = False

    def weight_loader(self, param: BaseWeightParameter, loaded: torch.Tensor) -> None:
        if isinstance(param, ModelWeightParameter):
            param.load_row_parallel_weight(loaded, self.par)
        else:
            param.load_weight(loaded)

    def _dequantized_weight(self) -> torch.Tensor:
        return (self.weight.to(torch.float32) * self.weight_scale[:, None]).to(self.dtype)

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        if self.dequantized:
            return
        weight = self._dequantized_weight()
        del self.weight_scale
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.dequantized = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.par.all_reduce(F.linear(x, self.weight if self.dequantized else self._dequantized_weight()))


def quantize_int8(weight: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 quantisation: (int8 weight, float32 scale) with weight ~ q * scale."""
    scale = weight.float().abs().amax(dim=1).clamp(min=1e-8) / 127.0
    return torch.round(weight.float() / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


class VocabEmbedding(nn.Module):
    """The token embedding, and the LM head: vocabulary rows split across ranks (vLLM's
    ``VocabParallelEmbedding``). A rank looks up the ids in its rows, zeros the rest, and the ranks'
    rows are summed; as a head, each rank's logits cover its rows and are gathered."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, par: Parallel = SINGLE):
        super().__init__()
        self.par = par
        rows = par.split(num_embeddings, "VocabEmbedding")
        self.first_row = par.rank * rows
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim, dtype=dtype), requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": self.weight_loader, "output_dim": 0})

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        default_weight_loader(param, rank_part(loaded, 0, param.shape[0], self.par))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.par.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.first_row
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[..., None], 0)
        return self.par.all_reduce(out)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.par.all_gather_last(F.linear(hidden, self.weight))


# ------------------------------------------------------------------------------------ attention


class MLAttention(nn.Module):
    """Multi-head latent attention in vLLM's layout. Before ``process_weights_after_loading`` keys and
    values are expanded by ``kv_b_proj``; after it, ``W_UK_T`` [heads, qk_nope, kv_lora] and ``W_UV``
    [heads, kv_lora, v] (plain attributes viewing ``kv_b_proj.weight``) absorb it."""

    def __init__(self, config: DeepSeekConfig, layer_index: int, par: Parallel = SINGLE):
        super().__init__()
        c = config
        block = par.fp8_block
        self.layer_index = layer_index
        self.num_heads = par.split(c.num_heads, "attention heads")  # this rank's heads
        self.qk_nope_head_dim = c.qk_nope_head_dim
        self.qk_rope_head_dim = c.qk_rope_head_dim
        self.v_head_dim = c.v_head_dim
        self.kv_lora_rank = c.kv_lora_rank
        self.q_lora_rank = c.q_lora_rank
        self.softmax_scale = c.qk_head_dim ** -0.5
        kv_a_size = c.kv_lora_rank + c.qk_rope_head_dim
        # Latent projections are whole on every rank; per-head ones are split by heads.
        if c.q_lora_rank:
            self.fused_qkv_a_proj = PackedQKVLinear(c.hidden_size, {"q": c.q_lora_rank, "kv": kv_a_size}, c.dtype, block)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps, c.dtype)
            self.q_b_proj = ColumnLinear(c.q_lora_rank, c.num_heads * c.qk_head_dim, c.dtype, par, block)
        else:
            self.q_proj = ColumnLinear(c.hidden_size, c.num_heads * c.qk_head_dim, c.dtype, par, block)
            self.kv_a_proj_with_mqa = ReplicatedLinear(c.hidden_size, kv_a_size, c.dtype, block)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps, c.dtype)
        self.kv_b_proj = ColumnLinear(c.kv_lora_rank, c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), c.dtype, par,
                                      block)
        if block:
            self.o_proj = RowLinear(c.num_heads * c.v_head_dim, c.hidden_size, c.dtype, par, block)
        else:
            self.o_proj = Int8Linear(c.num_heads * c.v_head_dim, c.hidden_size, c.dtype, par)
        self.rotary_emb = RotaryEmbedding(c.qk_rope_head_dim, c.rope_theta)
        self.W_UK_T: Optional[torch.Tensor] = None
        self.W_UV: Optional[torch.Tensor] = None

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        # MLA absorption needs kv_b_proj dense: an FP8 one is dequantised once, as vLLM does.
        self.kv_b_proj.dequantize()
        # [heads * (nope + v), kv_lora] -> [kv_lora, heads, nope + v], split per head into the key and
        # value halves; views, so no second copy of kv_b_proj exists.
        kv_b = self.kv_b_proj.weight.T.view(self.kv_lora_rank, self.num_heads, self.qk_nope_head_dim + self.v_head_dim)
        w_uk, w_uv = kv_b.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        self.W_UK_T = w_uk.permute(1, 2, 0)  # [heads, nope, kv_lora]
        self.W_UV = w_uv.transpose(0, 1)  # [heads, kv_lora, v]
        if isinstance(self.o_proj, Int8Linear):
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
    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype, par: Parallel = SINGLE,
                 reduce: bool = True):
        super().__init__()
        self.intermediate_size = par.split(intermediate_size, "MLP intermediate size")
        self.gate_up_proj = MergedColumnLinear(hidden_size, [intermediate_size] * 2, dtype, par)
        self.down_proj = RowLinear(intermediate_size, hidden_size, dtype, par, reduce=reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class FusedMoE(nn.Module):
    """Routed experts as two stacks: ``w13_weight`` [E, 2I, H] (gate rows, then up rows) and
    ``w2_weight`` [E, H, I]. The checkpoint holds one tensor per expert and projection. Under tensor
    parallelism each rank holds every expert's ``I / tp`` intermediate rows (vLLM's default, no
    expert parallelism) and its output is a partial sum; with FP8, ``w13_weight_scale_inv`` and
    ``w2_weight_scale_inv`` hold the block scales."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 par: Parallel = SINGLE):
        super().__init__()
        self.par, self.dtype, self.block = par, dtype, par.fp8_block
        inter = self.intermediate_size = par.split(intermediate_size, "expert intermediate size")
        shapes = {"w13_weight": (num_experts, 2 * inter, hidden_size), "w2_weight": (num_experts, hidden_size, inter)}
        for name, shape in shapes.items():
            self._stack(name, shape, FP8 if self.block else dtype)
            if self.block:
                if shape[1] % self.block or shape[2] % self.block:
                    raise ValueError(f"FusedMoE: FP8 {name} {list(shape)} does not tile into {self.block}-blocks")
                self._stack(name + "_scale_inv", (num_experts, shape[1] // self.block, shape[2] // self.block),
                            torch.float32)

    def _stack(self, name: str, shape: tuple, dtype: torch.dtype) -> None:
        weight = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        set_weight_attrs(weight, {"weight_loader": self.weight_loader})
        setattr(self, name, weight)

    def expert_weights(self, expert: int):
        """(gate+up [2I, H], down [H, I]) of ``expert``, dense."""
        if not self.block:
            return self.w13_weight[expert], self.w2_weight[expert]
        return (dequantize_fp8_block(self.w13_weight[expert], self.w13_weight_scale_inv[expert], self.block, self.dtype),
                dequantize_fp8_block(self.w2_weight[expert], self.w2_weight_scale_inv[expert], self.block, self.dtype))

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
        # Rows of the weight per row of param: a scale row covers a block of them.
        size = self.intermediate_size // (self.block if weight_name.endswith("_scale_inv") else 1)
        if shard_id == "w2":
            target, loaded = expert, rank_part(loaded, 1, size, self.par)
        elif shard_id in ("w1", "w3"):
            target = expert.narrow(0, 0 if shard_id == "w1" else size, size)
            loaded = rank_part(loaded, 0, size, self.par)
        else:
            raise ValueError(f"{weight_name}: shard id must be 'w1', 'w2' or 'w3', got {shard_id!r}")
        _check_shape(target, loaded, f"{weight_name} expert {expert_id} shard {shard_id}")
        target.copy_(read(loaded))

    def forward(self, x: torch.Tensor, selected: torch.Tensor, routing_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for expert in selected.unique().tolist():
            token, slot = torch.where(selected == expert)
            w13, w2 = self.expert_weights(expert)
            gate, up = F.linear(x[token], w13).split(self.intermediate_size, dim=-1)
            y = F.linear(F.silu(gate) * up, w2) * routing_weights[token, slot, None]
            out.index_add_(0, token, y)
        return out


class MoE(nn.Module):
    def __init__(self, config: DeepSeekConfig, par: Parallel = SINGLE):
        super().__init__()
        c = config
        self.par = par
        self.top_k = c.num_experts_per_tok
        self.scoring_func = c.scoring_func
        self.norm_topk_prob = c.norm_topk_prob
        self.routed_scaling_factor = c.routed_scaling_factor
        self.gate = ReplicatedLinear(c.hidden_size, c.n_routed_experts, c.dtype)
        self.experts = FusedMoE(c.n_routed_experts, c.hidden_size, c.moe_intermediate_size, c.dtype, par)
        # Partial sums on each rank, reduced once for routed and shared experts together (as vLLM does).
        self.shared_experts = (
            MLP(c.hidden_size, c.moe_intermediate_size * c.n_shared_experts, c.dtype, par, reduce=False)
            if c.n_shared_experts else None
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        routing_weights, selected = route(self, self.gate(x), x.dtype)
        out = self.experts(x, selected, routing_weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.par.all_reduce(out).view(shape)


# ------------------------------------------------------------------------------------ the model


class DecoderLayer(nn.Module):
    def __init__(self, config: DeepSeekConfig, layer_index: int, par: Parallel = SINGLE):
        super().__init__()
        c = config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.dtype)
        self.self_attn = MLAttention(c, layer_index, par)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.dtype)
        self.mlp = MoE(c, par) if c.is_moe_layer(layer_index) else MLP(c.hidden_size, c.intermediate_size, c.dtype, par)

    def forward(self, hidden, positions, cache):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), positions, cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DeepseekModel(nn.Module):
    def __init__(self, config: DeepSeekConfig, par: Parallel = SINGLE):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, config.dtype, par)
        self.layers = nn.ModuleList(DecoderLayer(config, i, par) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)

    def forward(self, input_ids, positions, cache):
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(hidden, positions, cache)
        return self.norm(hidden)


class DeepseekForCausalLM(nn.Module):
    """Build with uninitialised weights (on the current default device), then ``load_weights``.
    ``par`` says which rank's part to build and whether weights are stored FP8 (``Parallel``)."""

    # (parameter name part, checkpoint name part, shard id): checkpoint tensors that are shards of one
    # fused parameter.
    stacked_params_mapping = [
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
        ("fused_qkv_a_proj", "q_a_proj", "q"),
        ("fused_qkv_a_proj", "kv_a_proj_with_mqa", "kv"),
    ]

    def __init__(self, config: DeepSeekConfig, par: Parallel = SINGLE):
        super().__init__()
        self.config = config
        self.par = par
        self.model = DeepseekModel(config, par)
        # Tied: the head is the embedding module itself, so there is one Parameter (vLLM ties the same way).
        self.lm_head = (self.model.embed_tokens if config.tie_word_embeddings
                        else VocabEmbedding(config.vocab_size, config.hidden_size, config.dtype, par))

    def forward(self, input_ids: torch.Tensor, cache: Optional[LatentCache] = None) -> torch.Tensor:
        start = len(cache) if cache is not None else 0
        positions = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
        return self.lm_head.logits(self.model(input_ids, positions, cache))

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
                            f"({nbytes(loaded)} bytes) matches no parameter of {type(self).__name__}"
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


def random_checkpoint(config: DeepSeekConfig, seed: int = 0, fp8_block: int = 0) -> Dict[str, torch.Tensor]:
    """HF-layout checkpoint tensors with random values (std 1/sqrt(fan_in), norms 1), ``o_proj``
    stored as int8 + ``weight_scale``; with ``fp8_block``, attention and expert weights stored as
    DeepSeek-R1 stores them (float8 + ``weight_scale_inv`` per block) instead. No ``lm_head`` when the
    embeddings are tied. Deterministic for a seed."""
    c = config
    generator = torch.Generator().manual_seed(seed)
    tensors = {}

    def randn(*shape):
        return torch.empty(shape, dtype=torch.float32).normal_(0.0, shape[-1] ** -0.5, generator=generator).to(c.dtype)

    def ones(n):
        return torch.ones(n, dtype=c.dtype)

    def quantized(name, *shape):  # an attention or expert weight, FP8 when asked
        if fp8_block:
            tensors[name + ".weight"], tensors[name + ".weight_scale_inv"] = quantize_fp8_block(randn(*shape), fp8_block)
        else:
            tensors[name + ".weight"] = randn(*shape)

    tensors["model.embed_tokens.weight"] = randn(c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = ones(c.hidden_size)
        tensors[p + "post_attention_layernorm.weight"] = ones(c.hidden_size)
        a = p + "self_attn."
        if c.q_lora_rank:
            quantized(a + "q_a_proj", c.q_lora_rank, c.hidden_size)
            tensors[a + "q_a_layernorm.weight"] = ones(c.q_lora_rank)
            quantized(a + "q_b_proj", c.num_heads * c.qk_head_dim, c.q_lora_rank)
        else:
            quantized(a + "q_proj", c.num_heads * c.qk_head_dim, c.hidden_size)
        quantized(a + "kv_a_proj_with_mqa", c.kv_lora_rank + c.qk_rope_head_dim, c.hidden_size)
        tensors[a + "kv_a_layernorm.weight"] = ones(c.kv_lora_rank)
        quantized(a + "kv_b_proj", c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
        if fp8_block:
            quantized(a + "o_proj", c.hidden_size, c.num_heads * c.v_head_dim)
        else:
            tensors[a + "o_proj.weight"], tensors[a + "o_proj.weight_scale"] = quantize_int8(
                randn(c.hidden_size, c.num_heads * c.v_head_dim)
            )
        m = p + "mlp."
        if c.is_moe_layer(i):
            tensors[m + "gate.weight"] = randn(c.n_routed_experts, c.hidden_size)
            for e in range(c.n_routed_experts):
                quantized(m + f"experts.{e}.gate_proj", c.moe_intermediate_size, c.hidden_size)
                quantized(m + f"experts.{e}.up_proj", c.moe_intermediate_size, c.hidden_size)
                quantized(m + f"experts.{e}.down_proj", c.hidden_size, c.moe_intermediate_size)
            inter, prefix = c.moe_intermediate_size * c.n_shared_experts, m + "shared_experts."
            if not c.n_shared_experts:
                continue
        else:
            inter, prefix = c.intermediate_size, m
        tensors[prefix + "gate_proj.weight"] = randn(inter, c.hidden_size)
        tensors[prefix + "up_proj.weight"] = randn(inter, c.hidden_size)
        tensors[prefix + "down_proj.weight"] = randn(c.hidden_size, inter)
    tensors["model.norm.weight"] = ones(c.hidden_size)
    if not c.tie_word_embeddings:
        tensors["lm_head.weight"] = randn(c.vocab_size, c.hidden_size)
    return tensors


def iterate_checkpoint(path: str, lazy: bool = False, log: Optional[dict] = None) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor of a safetensors file, or of every shard named by a
    directory's ``*.safetensors.index.json`` (else its ``*.safetensors`` files), one shard open at a time.
    ``lazy``: (name, ``CheckpointSlice``) instead, read only as far as the loader narrows it (a
    tensor-parallel rank reads its own rows), counting the bytes read into ``log["bytes"]``."""
    from safetensors import safe_open

    if os.path.isdir(path):
        indexes = sorted(f for f in os.listdir(path) if f.endswith(".safetensors.index.json"))
        if indexes:
            with open(os.path.join(path, indexes[0])) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        files = [os.path.join(path, f) for f in files]
    else:
        files = [path]
    for file in files:
        with safe_open(file, framework="pt") as shard:
            for name in shard.keys():
                yield name, CheckpointSlice(name, shard.get_slice(name), log) if lazy else shard.get_tensor(name)


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
