"""Weight normalisation of an offloaded weight larger than the budget's free room, run in slices:
``torch.nn.utils.parametrizations.weight_norm`` (and the hook-based ``weight_norm``) compute
``w = g * v / ||v||`` at every forward through ``_weight_norm_interface(v, g, dim)``, whose
backward is ``_weight_norm_interface_backward``, with the norms taken over every dim but ``dim``.
Registered after wrapping, on a weight that forward reads in tiles, they read ``v`` whole.

Each slice of ``dim`` is normalised by its own norms alone, so slices along ``dim`` (output
channels for the default ``dim=0``, kernel positions for wav2vec2's ``dim=2``) give that slice of
every result: the same kernel on the same elements, bit for bit (torch's CPU kernels reduce each
slice of ``dim`` alone, or, for the last dim, over the same partition of the other dims).

Like ``whole_reads``, these run only after the op's own page raised ``BudgetError``
(``torch_dispatch``'s except clause): an op whose arguments fit pays nothing."""

from __future__ import annotations

import torch

from ..tensor import OffloadedTensor
from .host_compute import on_host
from .lines import _bind, along_lines
from .paging import Paged
from .tiling import _meta, _page_slice, _slice_bytes

aten = torch.ops.aten


def weight_norm_in_slices(func, args, kwargs, error):
    """``func`` (the forward or its backward) over slices of ``dim`` that fit the free room together."""
    names = [a.name for a in func._schema.arguments]
    call = _bind(func, args, kwargs)
    tensors = [call[n] for n in names if isinstance(call.get(n), torch.Tensor)]
    offloaded = [t for t in tensors if isinstance(t, OffloadedTensor)]
    if not offloaded:
        raise error
    dim = call["dim"] % tensors[0].dim()
    length = tensors[0].shape[dim]
    # Every tensor argument and result is full along ``dim``: ``v`` and its gradient whole, ``g``
    # and the norms one element along each other dim.
    if any(t.dim() != tensors[0].dim() or t.shape[dim] != length for t in tensors):
        raise error
    pager = offloaded[0]._master.pager
    per_slice = sum(_slice_bytes(t, dim) for t in offloaded)
    step = pager.free_bytes() // max(per_slice, 1)
    if step < 1 or length < 2:
        raise error

    def sliced(start, stop, paged):
        # Contiguous, as torch hands them to these kernels (``_weight_norm`` and autograd call
        # ``contiguous()`` first): the CPU kernel for the last dim reads its arguments' memory as
        # if contiguous, so a slice of a gradient along that dim, a strided view, gave wrong values.
        return [_page_slice(v, dim, start, stop, paged).contiguous() if isinstance(v, torch.Tensor) else v
                for v in (call[n] for n in names)]

    results = func(*[_meta(v) for v in (call[n] for n in names)])
    single = isinstance(results, torch.Tensor)
    results = [results] if single else list(results)
    outs = [torch.empty_strided(r.shape, r.stride(), dtype=r.dtype, device=pager.device) for r in results]
    for start in range(0, length, step):
        stop = min(length, start + step)
        paged = Paged()
        try:
            pieces = func(*sliced(start, stop, paged))
            for out, piece in zip(outs, [pieces] if single else pieces):
                out.narrow(dim, start, stop - start).copy_(piece)
        finally:
            paged.release()
    return outs[0] if single else tuple(outs)


def norms_except_dim(func, args, kwargs, error):
    """The norms weight_norm's registration takes of each slice of its dim (``norm_except_dim``):
    for dim 0, ``w.view(n, -1).norm(2, 1)``, whole contiguous rows, cut across them
    (``lines.along_lines``), bit for bit; for the last dim (wav2vec2's ``dim=2``),
    ``w.view(-1, n).norm(2, 0)``, where a slice of columns is a narrower tensor whose kernel sums
    in another order than the whole one's: computed on the host master instead
    (``host_compute.on_host``), the same kernel over the same bytes on the emulated device."""
    call = _bind(func, args, kwargs)
    t, given = call.get("self"), call.get("dim")
    if isinstance(t, OffloadedTensor) and t.dim() and given is not None:
        dims = {d % t.dim() for d in (given if isinstance(given, (list, tuple)) else (given,))}
        if dims and not (t.is_contiguous() and min(dims) == t.dim() - len(dims)):
            return on_host(func, args, kwargs, error)
    return along_lines(func, args, kwargs, error)


WEIGHT_NORMS = {
    aten._weight_norm_interface.default: weight_norm_in_slices,
    aten._weight_norm_interface_backward.default: weight_norm_in_slices,
    # weight_norm's registration splits the weight with ``norm_except_dim(w, 2, dim)``, which
    # reaches dispatch as the norm of each slice of ``dim`` (``w.view(n, -1).norm(2, 1)`` for
    # dim 0): an op along lines, cut across them as ``lines`` cuts its ops where that is exact.
    aten.norm.ScalarOpt_dim: norms_except_dim,
}
