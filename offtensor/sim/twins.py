"""What a plan of a model that has values starts from: its meta twin (same shapes and dtypes, nothing
allocated), kept in step with the model, the inputs of one planned decode step."""

from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import nn


def meta_twin(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters, buffers and tensor attributes are meta tensors of the
    same shapes and dtypes (nothing allocated): what ``plan`` replays for a model that has values.
    Parameters tied by identity stay tied. Taken before wrapping, so none of offtensor's classes
    come with it, and without the modules' hooks: a user's hook (one that logs outputs, say) would
    otherwise run on the plan's meta tensors, and its closure is the user's, shared, not copied."""
    memo = {}
    for module in model.modules():
        for attr, value in module.__dict__.items():
            if isinstance(value, dict) and attr.startswith("_") and "_hooks" in attr:
                memo[id(value)] = type(value)()
        tensors = [*module._parameters.values(), *module._buffers.values(),
                   *(t for t in module.__dict__.values() if isinstance(t, torch.Tensor))]
        for t in tensors:
            if t is not None and id(t) not in memo:
                memo[id(t)] = _meta_like(t)
    return copy.deepcopy(model, memo)


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
    return nn.Parameter(meta, requires_grad=False) if isinstance(t, nn.Parameter) else meta


def sync_twin(twin: nn.Module, model: nn.Module) -> None:
    """Give ``twin`` (``meta_twin`` of ``model``) the shapes and dtypes ``model`` has now (a cast
    after wrapping halves the bytes a plan must count)."""
    now = dict(model.named_parameters(remove_duplicate=False))
    now.update(model.named_buffers(remove_duplicate=False))
    for table_of, named in ((lambda m: m._parameters, twin.named_parameters), (lambda m: m._buffers, twin.named_buffers)):
        for name, t in list(named(remove_duplicate=False)):
            current = now.get(name)
            if current is not None and (current.dtype != t.dtype or current.shape != t.shape):
                owner, _, attr = name.rpartition(".")
                table_of(twin.get_submodule(owner))[attr] = _meta_like(current)


def decode_example(model: nn.Module, args=(), kwargs=None) -> Optional[tuple]:
    """The inputs of one planned decode step of ``model`` on meta: a token for a transformers
    language model; else the tensors of a forward's positional ``args`` as meta tensors, token ids
    ([batch, tokens] integers) cut to the last token and objects (a KV cache) left out, so the
    plan starts without them. None when there is nothing to plan from."""
    if getattr(model, "main_input_name", None) == "input_ids":
        return (torch.zeros(1, 1, dtype=torch.long, device="meta"),)
    example = []
    for a in args:
        if isinstance(a, torch.Tensor):
            shape = (*a.shape[:-1], 1) if a.dim() == 2 and not a.is_floating_point() and a.shape[-1] else a.shape
            example.append(torch.empty(shape, dtype=a.dtype, device="meta"))
        else:
            example.append(a if a is None or isinstance(a, (bool, int, float, str)) else None)
    return tuple(example) if any(isinstance(a, torch.Tensor) for a in example) else None
