"""vLLM's building blocks, as its models use them: Parameter subclasses that demand a loader and keep
their state in ``__dict__``, ``set_weight_attrs``, weight loaders that load shards through
``param.data.narrow(...).copy_``, merged, packed and row-parallel linear layers, an int8 linear with a
per-channel scale, and a vocabulary embedding. Plain PyTorch; ``vllm_deepseek.py`` builds its decoder
from them."""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn


# ------------------------------------------------------------------------------------ parameters


def set_weight_attrs(weight: torch.Tensor, attrs: Optional[dict]) -> None:
    """Attach loader metadata to a Parameter, refusing to overwrite one already set."""
    for key, value in (attrs or {}).items():
        if hasattr(weight, key):
            raise AttributeError(f"{type(weight).__name__} of shape {tuple(weight.shape)} already has '{key}'")
        setattr(weight, key, value)


def check_shape(param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(
            f"{what}: checkpoint tensor of shape {tuple(loaded.shape)} ({loaded.numel() * loaded.element_size()} bytes) "
            f"does not fit the parameter slice of shape {tuple(param.shape)}"
        )


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Loader of weights that need no mapping (norms, embeddings): a whole-tensor copy."""
    check_shape(param, loaded, "default_weight_loader")
    param.data.copy_(loaded)


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
        check_shape(self.data, loaded, type(self).__name__)
        self.data.copy_(loaded)


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
        check_shape(shard, loaded, f"merged column shard at {shard_offset}")
        shard.copy_(loaded)

    def load_qkv_weight(self, loaded: torch.Tensor, shard_id: str, shard_offsets: Dict[str, Tuple[int, int]]) -> None:
        offset, size = shard_offsets[shard_id]
        shard = self.data.narrow(self.output_dim, offset, size)
        check_shape(shard, loaded, f"packed shard '{shard_id}'")
        shard.copy_(loaded)

    def load_row_parallel_weight(self, loaded: torch.Tensor) -> None:
        self.load_weight(loaded)  # one rank: the whole weight


class ChannelScaleParameter(BaseWeightParameter):
    """Per-output-channel dequantisation scales of a quantised weight."""

    def __init__(self, data: torch.Tensor, weight_loader: Callable, output_dim: int):
        super().__init__(data, weight_loader)
        self._output_dim = output_dim

    @property
    def output_dim(self) -> int:
        return self._output_dim


# ------------------------------------------------------------------------------------ linear layers


class ReplicatedLinear(nn.Module):
    """A linear layer whose weight is a plain Parameter carrying vLLM attributes (``set_weight_attrs``)."""

    def __init__(self, input_size: int, output_size: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": self.weight_loader, "output_dim": 0, "input_dim": 1})

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class MergedColumnLinear(nn.Module):
    """Several column projections of one input in one weight (``gate_up_proj``); a checkpoint holds
    them apart and the loader places shard ``i`` at ``sum(output_sizes[:i])``."""

    def __init__(self, input_size: int, output_sizes: list, dtype: torch.dtype):
        super().__init__()
        self.output_sizes = list(output_sizes)
        self.weight = ModelWeightParameter(
            data=torch.empty(sum(output_sizes), input_size, dtype=dtype), weight_loader=self.weight_loader,
            output_dim=0, input_dim=1,
        )

    def weight_loader(self, param: ModelWeightParameter, loaded: torch.Tensor, loaded_shard_id: int) -> None:
        offset = sum(self.output_sizes[:loaded_shard_id])
        param.load_merged_column_weight(loaded, shard_offset=offset, shard_size=self.output_sizes[loaded_shard_id])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class PackedQKVLinear(nn.Module):
    """Query and key/value projections packed along the output dim, loaded by named shard (MLA's
    ``fused_qkv_a_proj``: ``"q"`` the query latent, ``"kv"`` the kv latent plus the rotary key)."""

    def __init__(self, input_size: int, shard_sizes: Dict[str, int], dtype: torch.dtype):
        super().__init__()
        self.shard_offsets: Dict[str, Tuple[int, int]] = {}
        offset = 0
        for shard_id, size in shard_sizes.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size
        self.weight = ModelWeightParameter(
            data=torch.empty(offset, input_size, dtype=dtype), weight_loader=self.weight_loader, output_dim=0, input_dim=1,
        )

    def weight_loader(self, param: ModelWeightParameter, loaded: torch.Tensor, loaded_shard_id: str) -> None:
        param.load_qkv_weight(loaded, loaded_shard_id, self.shard_offsets)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class RowLinear(nn.Module):
    def __init__(self, input_size: int, output_size: int, dtype: torch.dtype):
        super().__init__()
        self.weight = ModelWeightParameter(
            data=torch.empty(output_size, input_size, dtype=dtype), weight_loader=self.weight_loader,
            output_dim=0, input_dim=1,
        )

    def weight_loader(self, param: ModelWeightParameter, loaded: torch.Tensor) -> None:
        param.load_row_parallel_weight(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Int8Linear(nn.Module):
    """An fp8-style quantised linear layer, with int8 standing in for float8 so that it runs on any
    CPU build: ``weight`` int8 [out, in] and ``weight_scale`` [out]. ``process_weights_after_loading``
    replaces both by one dequantised Parameter, as engines do for kernels that want a plain weight."""

    def __init__(self, input_size: int, output_size: int, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        self.weight = ModelWeightParameter(
            data=torch.empty(output_size, input_size, dtype=torch.int8), weight_loader=self.weight_loader,
            output_dim=0, input_dim=1,
        )
        self.weight_scale = ChannelScaleParameter(
            data=torch.empty(output_size, dtype=torch.float32), weight_loader=self.weight_loader, output_dim=0,
        )
        self.dequantized = False

    def weight_loader(self, param: BaseWeightParameter, loaded: torch.Tensor) -> None:
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
        return F.linear(x, self.weight if self.dequantized else self._dequantized_weight())


def quantize_int8(weight: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 quantisation: (int8 weight, float32 scale) with weight ~ q * scale."""
    scale = weight.float().abs().amax(dim=1).clamp(min=1e-8) / 127.0
    return torch.round(weight.float() / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


class VocabEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype), requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": default_weight_loader, "output_dim": 0})

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


# ------------------------------------------------------------------------------------ attention
