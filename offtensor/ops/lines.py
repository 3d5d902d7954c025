"""Ops along a dim of an offloaded tensor larger than the budget's free room, run in slices across
that dim: ``softmax`` / ``log_softmax``, scans (``cumsum``, ``cumprod``, ``logcumsumexp``,
``cummax``, ``cummin``), ``sort`` / ``argsort``, ``topk``, ``kthvalue``, ``median`` and ``mode``
along a dim, and reductions over some dims that keep others (``argmax`` / ``argmin`` / ``max`` /
``min`` with a dim, ``var``, ``std``, ``prod``, ``logsumexp``, ``count_nonzero``...).

Each line along the op's dim is computed from its own elements alone, so a slice of the tensor
across that dim (rows of a row-wise softmax, columns of ``cumsum(0)``) gives that slice of the
result: the same kernel over the same elements. Ops that select or compare (``sort``, ``topk``,
``argmax``...) give it bit for bit; ops that compute do where each slice holds whole contiguous
lines along the last dims (a softmax over rows), and otherwise warn, naming the tensor, that a
kernel vectorising a narrower slice may round in another order. The slices are cut along the
dim outermost in the tensor's memory that the op does not work along, so each is one contiguous
range of the master, and where one slice does not fit it is cut again along the next.

Like ``whole_reads``, these run only after the op's own page raised ``BudgetError``
(``torch_dispatch``'s except clause): an op whose argument fits pays nothing. An op over the whole
tensor (``sort`` of a flattened weight, ``argmax()`` without a dim) has no line to cut across: it
runs on the host master instead (``host_compute.py``)."""

from __future__ import annotations

import torch

from ..tensor import OffloadedTensor
from .tiling import _meta
from .whole_reads import _chunks, _narrow, _nbytes, _paged_call, _room, _warn_inexact

aten = torch.ops.aten


def along_lines(func, args, kwargs, error):
    call = _bind(func, args, kwargs)
    t = call.get("self")
    if not isinstance(t, OffloadedTensor) or t.dim() == 0:
        raise error
    if any(isinstance(v, OffloadedTensor) for v in (*args[1:], *kwargs.values())):
        raise error  # another offloaded argument: not cut alongside (none of these ops takes one)
    given = call.get("dim")
    if given is None or (isinstance(given, (list, tuple)) and len(given) == 0):
        raise error  # over the whole tensor: no line to cut across
    dims = {d % t.dim() for d in (given if isinstance(given, (list, tuple)) else (given,))}
    across = sorted((d for d in range(t.dim()) if d not in dims and t.shape[d] > 1), key=lambda d: -t.stride(d))
    if not across:
        raise error  # one line larger than the room
    cut = across[0]
    try:
        shapes = func(_meta(t), *args[1:], **kwargs)
    except NotImplementedError:  # no meta kernel: the result's shape cannot be known
        raise error from None
    results = list(shapes) if isinstance(shapes, (tuple, list)) else [shapes]
    at = cut - sum(1 for d in dims if d < cut) if results[0].dim() < t.dim() else cut
    if any(r.dim() <= at or r.shape[at] != t.shape[cut] for r in results):
        raise error
    if func not in _SELECTIONS and not (t.is_contiguous() and min(dims) == t.dim() - len(dims)):
        _warn_inexact(t, func.__name__, "is computed in slices across the lines it works along")
    device = t._master.pager.device
    outs = [torch.empty_strided(r.shape, r.stride(), dtype=r.dtype, device=device) for r in results]
    room = _room(t)
    for start, stop in _chunks(t, cut, room) or [(i, i + 1) for i in range(t.shape[cut])]:
        part = _narrow(t, cut, start, stop - start)
        if _nbytes(part) <= room:  # its own elements, gathered on the host where they are strided
            piece = _paged_call(lambda p: func(p, *args[1:], **kwargs), part, cut, 0, stop - start)
        else:  # one index along ``cut`` larger than the room: dispatched again, cut along the next dim
            piece = func(part, *args[1:], **kwargs)
        pieces = piece if isinstance(piece, (tuple, list)) else (piece,)
        for out, p in zip(outs, pieces):
            out.narrow(at, start, stop - start).copy_(p)
    return type(shapes)(outs) if isinstance(shapes, (tuple, list)) else outs[0]


def _bind(func, args, kwargs) -> dict:
    """The op's arguments by name, defaults included (``sort``'s ``dim`` is keyword-only)."""
    call = {}
    for i, a in enumerate(func._schema.arguments):
        if i < len(args) and not a.kwarg_only:
            call[a.name] = args[i]
        elif a.name in kwargs:
            call[a.name] = kwargs[a.name]
        elif a.has_default_value():
            call[a.name] = a.default_value
    return call


_OPS = (
    aten._softmax.default, aten._log_softmax.default,
    aten.cumsum.default, aten.cumprod.default, aten.logcumsumexp.default, aten.cummax.default, aten.cummin.default,
    aten.sort.default, aten.sort.stable, aten.topk.default, aten.kthvalue.default, aten.median.dim,
    aten.nanmedian.dim, aten.mode.default,
    aten.argmax.default, aten.argmin.default, aten.max.dim, aten.min.dim, aten.aminmax.default,
    aten.var.correction, aten.std.correction, aten.var_mean.correction, aten.std_mean.correction,
    aten.prod.dim_int, aten.logsumexp.default, aten.count_nonzero.dim_IntList, aten.nansum.default,
)
ALONG_LINES = {op: along_lines for op in _OPS}
# Ops that pick elements or compare them: a slice gives its part of the result bit for bit. The
# others compute, and a kernel may vectorise a narrower slice otherwise (a softmax along a dim that
# is not the last, a sum down columns), rounding in another order: unless each slice holds whole
# contiguous lines along the tensor's last dims, they warn, naming the tensor.
_SELECTIONS = frozenset({
    aten.cummax.default, aten.cummin.default, aten.sort.default, aten.sort.stable, aten.topk.default,
    aten.kthvalue.default, aten.median.dim, aten.nanmedian.dim, aten.mode.default, aten.argmax.default,
    aten.argmin.default, aten.max.dim, aten.min.dim, aten.aminmax.default, aten.count_nonzero.dim_IntList,
})
