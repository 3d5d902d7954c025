"""Pairwise distances (``torch.cdist``: ``_cdist_forward``, and ``_euclidean_dist``, its matrix
product form) of an operand larger than the budget's free room: in tiles of that operand's rows,
which are columns (or rows) of the output, as ``tiling`` computes mm. Each output element is the
distance of one row of each operand, so a tile computes it from the same elements as the whole op:
``_cdist_forward`` exactly; ``_euclidean_dist`` through a matrix product, exact where BLAS sums a
narrower output in the same order (tiles ``TILE_ALIGN`` wide, as for mm)."""

from __future__ import annotations

import torch

from ..tensor import OffloadedTensor
from .arguments import raise_torch_error
from .paging import run
from .table import implements
from .tiling import TILE_ALIGN, _batch, _offloaded_bytes, _page_slice, _slice_bytes, _tiled, needs_tiling

aten = torch.ops.aten


@implements(aten._cdist_forward.default, aten._euclidean_dist.default)
def cdist(func, types, args, kwargs):
    x1, x2, rest = args[0], args[1], args[2:]
    big = x2 if needs_tiling(x2, [x1]) else x1 if needs_tiling(x1, [x2]) else None
    if big is None or big.dim() < 2:
        return run(func, args, kwargs)
    raise_torch_error(func, args, kwargs, big._master.pager.device)
    other = x1 if big is x2 else x2
    dim = big.dim() - 2  # its rows
    _, others = _offloaded_bytes([other])
    leading = big.dim() > 2 and big.shape[0] > 1 and other.dim() == big.dim() and other.shape[0] == big.shape[0]
    rows = min(TILE_ALIGN, big.shape[dim])
    if leading and others + rows * _slice_bytes(big, dim) > big._master.pager.free_bytes():
        # Not TILE_ALIGN rows of every batch fit: batch by batch, each again in tiles of its rows, so
        # a stack of matrices needs room for rows of one of them, as bmm does, and its tiles are
        # TILE_ALIGN wide where rows of one batch fit (narrower ones may sum in another order).
        outs = [func(_batch(x1, i), _batch(x2, i), *rest, **kwargs) for i in range(big.shape[0])]
        return torch.cat(outs)

    def compute(start, stop, paged):
        part = _page_slice(big, dim, start, stop, paged)
        return func(*((paged.arg(x1), part) if big is x2 else (part, paged.arg(x2))), *rest, **kwargs)

    return _tiled(big, dim, others, str(func), compute, -1 if big is x2 else -2, reach_back=True)
