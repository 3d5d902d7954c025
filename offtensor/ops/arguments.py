"""torch's own error for an op whose arguments are wrong, before the op is cut into pieces.

An op computed in tiles or slices (``tiling``, ``convolutions``, ``distances``, ``whole_reads``)
runs the kernel on parts of its offloaded arguments: a bias of the wrong length, an input with the
wrong inner size or a weight of another dtype then fails inside a tile, with the tile's sizes in
torch's message ("64" output features where the weight has 256), or as a tiling error. The model
author must see what the unwrapped model raises. Only the paths that cut an op call this; an op
paged whole runs the kernel on the whole arguments and raises torch's error itself."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

from ..tensor import OffloadedTensor


# The signatures (op, and each argument's shape, strides and dtype, or value) whose meta call
# passed: a model's tiled ops repeat theirs every forward, and a meta call of a product runs
# torch's Python meta functions (about a millisecond), a lookup here a few microseconds.
_PASSED: dict = {}
_PASSED_MAX = 4096


def _dtype(v: OffloadedTensor) -> torch.dtype:
    """The wrapper's dtype, read without a trip through __torch_function__. A lazy cast's host view
    holds its weight's bytes, in the weight's dtype: the op reads the cast's (autocast's bmm of a
    float32 stack larger than the room was refused as float32 against a bfloat16 input)."""
    own = v.__dict__
    cast = own.get("_cast")
    return own["_host"].dtype if cast is None else cast.dtype


def _meta(v):
    if isinstance(v, OffloadedTensor):
        host = v.__dict__["_host"]  # the wrapper's own metadata, without a trip through __torch_function__
        return torch.empty_strided(host.shape, host.stride(), dtype=_dtype(v), device="meta")
    if isinstance(v, torch.Tensor):
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
    return v


def _signature(v):
    if isinstance(v, OffloadedTensor):
        host = v.__dict__["_host"]
        return host.shape, host.stride(), _dtype(v)
    if isinstance(v, torch.Tensor):
        # (a sparse tensor has no strides: its layout stands in)
        return v.shape, v.stride() if v.layout is torch.strided else v.layout, v.dtype
    if isinstance(v, (list, tuple)):
        return type(v), tuple(map(_signature, v))
    return v


def raise_torch_error(func, args, kwargs, device) -> None:
    """Raise what ``func(*args, **kwargs)`` raises on plain tensors where its arguments' shapes or
    dtypes are wrong for it; return where they are right. A meta call checks them (no data, no
    device work), once per signature. Where it raises, the op runs on ``device`` with each
    offloaded argument standing in as one element expanded to its shape, so nothing is paged: the
    kernel checks its arguments before it reads them and raises its own message, which the meta
    kernel words differently. Should the kernel accept what its meta function refused, that
    call's result is dropped and the op goes on."""
    key = (func, _signature(args), _signature(tuple(kwargs.items())))
    try:
        if key in _PASSED:
            return
    except TypeError:  # an unhashable argument: checked every time
        key = None
    if not _meta_refuses(func, args, kwargs):
        _passed(key)
        return
    stand_in = lambda v: _stand_in(v, device)  # noqa: E731
    func(*tree_map(stand_in, args), **tree_map(stand_in, kwargs))  # raises torch's own error, as a rule
    _passed(key)  # the kernel accepted what its meta function refused: once is enough


def _meta_refuses(func, args, kwargs) -> bool:
    try:
        func(*tree_map(_meta, args), **tree_map(_meta, kwargs))
    except Exception:  # noqa: BLE001  (any refusal: the kernel's own call words it)
        return True
    return False


def _stand_in(v, device):
    """An offloaded argument as one element of its dtype on ``device``, expanded to its shape."""
    if isinstance(v, OffloadedTensor):
        return torch.zeros((), dtype=_dtype(v), device=device).expand(v.__dict__["_host"].shape)
    return v


def _passed(key) -> None:
    if key is None:
        return
    if len(_PASSED) >= _PASSED_MAX:
        _PASSED.clear()
    _PASSED[key] = True
