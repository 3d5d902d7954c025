"""Ops that read an offloaded tensor whole, run in slices of it when it does not fit the budget's
free room: ``gather``, a layer or group norm's elementwise weight and bias (and the layer norm's
backward), ``_trilinear`` (``F.bilinear`` and its backward) and the reductions that read each element once
(``max``, ``min``, ``amax``, ``amin``, ``any``, ``all``).

Placement counts a model's own tensor at the tile its usual consumers read (a matrix slice, one
kernel), so a budget wrap accepted may hold less than these ops' whole argument. They reach this
module only after their ordinary page raised ``BudgetError`` (``SHORT_OF_ROOM``, consulted by
``torch_dispatch`` in its except clause): an op whose arguments fit pays nothing for it.

Where the op's math allows, the slices give the whole op's result bit for bit: a gather, max, min,
any and all read each element once (a sum, mean or norm runs on the host master instead:
``host_compute``); a layer or group norm's weight and bias are applied elementwise
to the normalised input, in the steps and the precision its kernel takes (in float for a
half-precision input with float weights); a bilinear's output features are independent. Sums
over slices (a bilinear output feature whose inputs are cut) are added in another order than the
whole op adds them: a warning names the tensor, as convolutions' do."""

from __future__ import annotations

import warnings

import torch

from .. import cast_views
from ..tensor import OffloadedTensor
from .paging import Paged, describe
from .tiling import _page_slice, _slice_bytes

aten = torch.ops.aten


def _room(t: OffloadedTensor) -> int:
    return t._master.pager.free_bytes()


def _narrow(t, dim: int, start: int, length: int):
    if isinstance(t, OffloadedTensor):
        return cast_views.derived(t, t._host.narrow(dim, start, length))
    return t.narrow(dim, start, length)


def _nbytes(t: OffloadedTensor) -> int:
    return t.numel() * t.__dict__["_host"].element_size()


def _warn_inexact(t: OffloadedTensor, op: str, how: str = "is summed over slices of it") -> None:
    warnings.warn(
        f"offtensor: {op} of {describe(t)}, larger than the budget's room, {how}: "
        f"its result may differ from the unwrapped model's in the last bits. Raise budget_gb for bit-identical results.",
        stacklevel=5)


def _chunks(t: OffloadedTensor, dim: int, room: int):
    """(start, stop) slices of ``t`` along ``dim`` that fit ``room`` bytes; None where not one does."""
    per = _slice_bytes(t, dim)
    if per > room:
        return None
    return _chunks_of(t.shape[dim], max(1, room // max(per, 1)))


def _chunks_of(n: int, step: int):
    """(start, stop) slices of ``n`` items, ``step`` at a time."""
    return [(s, min(n, s + step)) for s in range(0, n, step)]


def _paged_call(compute, t: OffloadedTensor, dim: int, start: int, stop: int):
    paged = Paged()
    try:
        return compute(_page_slice(t, dim, start, stop, paged))
    finally:
        paged.release()


# ---------------------------------------------------------------------------- gather


def gather(func, args, kwargs, error):
    call = dict(zip(("self", "dim", "index"), args), **kwargs)
    w, index = call["self"], call["index"]
    if not isinstance(w, OffloadedTensor) or isinstance(index, OffloadedTensor) or w.dim() == 0 or index.dim() != w.dim():
        raise error
    dim = call["dim"] % w.dim()
    rest = {k: v for k, v in call.items() if k not in ("self", "dim", "index")}
    for d in range(w.dim()):  # index may be smaller than w along the other dims: only that part is read
        if d != dim and index.shape[d] < w.shape[d]:
            w = _narrow(w, d, 0, index.shape[d])
    return _gather(func, w, dim, index, rest, _room(w))


def _gather(func, w: OffloadedTensor, dim: int, index: torch.Tensor, rest: dict, room: int):
    if _nbytes(w) <= room:
        return _paged_call(lambda part: func(part, dim, index, **rest), w, 0, 0, w.shape[0])
    cut = next((d for d in range(w.dim()) if d != dim and w.shape[d] > 1), None)
    if cut is None:
        # One line along ``dim`` larger than the room: its selected elements are index rows.
        line = cast_views.derived(w, w._host.reshape(-1))
        return aten.index_select.default(line, 0, index.reshape(-1)).reshape(index.shape)
    chunks = _chunks(w, cut, room) or [(i, i + 1) for i in range(w.shape[cut])]
    outs = [_gather(func, _narrow(w, cut, s, e - s), dim, index.narrow(cut, s, e - s), rest, room) for s, e in chunks]
    return torch.cat(outs, dim=cut)


# ---------------------------------------------------------------------------- layer norm


def layer_norm(func, args, kwargs, error):
    call = dict(zip(("input", "normalized_shape", "weight", "bias", "eps"), args), **kwargs)
    x, weight, bias = call["input"], call.get("weight"), call.get("bias")
    big = weight if isinstance(weight, OffloadedTensor) else bias
    if isinstance(x, OffloadedTensor) or not isinstance(big, OffloadedTensor) or big.dim() == 0:
        raise error
    if big.dtype != x.dtype:
        return _layer_norm_mixed(func, x, call["normalized_shape"], weight, bias, call["eps"])
    # The kernel computes fma(x * rstd - mean * rstd, weight, bias); without weight and bias it
    # stops at the first term: the same values, then the weight's slices. Without a weight, its
    # bias is added in another rounding.
    if weight is None:
        _warn_inexact(big, "a layer norm's bias", "is added after the normalisation")
    normalised, mean, rstd = func(x, call["normalized_shape"], None, None, call["eps"])
    out = torch.empty_like(normalised)
    _affine(out, normalised, weight, bias, x.dim() - big.dim(), _room(big))
    return out, mean, rstd


def _layer_norm_mixed(func, x, shape, weight, bias, eps):
    """A layer norm of a reduced-precision input (bfloat16, float16) with float weight and bias, as
    the mixed-dtype kernel computes it: mean and rstd in float, ``fma(fma(x, rstd, -mean * rstd),
    weight, bias)`` in float, rounded to the input's dtype once at the end. Normalising apart in
    the input's dtype would round twice. The statistics come from the kernel itself, given a
    plain weight of ones (it reads the input alone for them); the rest, in slices of weight and
    bias, with ``addcmul`` (one rounding, as the kernel's fused multiply-add): bit for bit with the
    kernel on the CPU, with a weight and bias, either alone, and multi-dim ones."""
    big = weight if weight is not None else bias
    ones = torch.ones(big.shape, dtype=big.dtype, device=x.device)
    _, mean, rstd = func(x, shape, ones, None, eps)
    del ones
    normalised = torch.addcmul(-(mean * rstd), x.to(mean.dtype), rstd)
    out = torch.empty_like(x)
    _affine(out, normalised, weight, bias, x.dim() - big.dim(), _room(big))
    return out, mean, rstd


def layer_norm_backward(func, args, kwargs, error):
    names = ("grad_out", "input", "normalized_shape", "mean", "rstd", "weight", "bias", "output_mask")
    call = dict(zip(names, args), **kwargs)
    weight, bias, mask = call["weight"], call["bias"], list(call["output_mask"])
    big = weight if isinstance(weight, OffloadedTensor) else bias
    if not isinstance(big, OffloadedTensor) or any(isinstance(call[n], OffloadedTensor) for n in names[:5]):
        raise error
    grad_out, shape = call["grad_out"], call["normalized_shape"]
    # The weight's and bias's gradients do not read their values: the kernel with plain stand-ins
    # sums them as it does with the weight.
    ones = torch.ones(big.shape, dtype=big.dtype, device=grad_out.device)
    zeros = torch.zeros_like(ones)
    rest = (call["input"], shape, call["mean"], call["rstd"])
    if weight is None and bias.dtype != call["input"].dtype:
        # torch's kernel refuses a float bias without a weight beside a half-precision input, which
        # the stand-in weight would hide: its own error, as the unwrapped model raises it.
        func(grad_out, *rest, None, zeros, mask)
    _, grad_weight, grad_bias = func(grad_out, *rest, ones, zeros, [False, mask[1], mask[2]])
    grad_input = None
    if mask[0]:
        if weight is not None:
            # The kernel multiplies by the weight inside its sums: the product first rounds apart.
            _warn_inexact(big, "a layer norm's input gradient", "is multiplied by slices of it apart from its sums")
            scaled = torch.empty_like(grad_out)
            _affine(scaled, grad_out, weight, None, grad_out.dim() - big.dim(), _room(big))
            grad_out = scaled
        grad_input = func(grad_out, *rest, ones, zeros, [True, False, False])[0]
    return grad_input, grad_weight if weight is not None else None, grad_bias if bias is not None else None


def group_norm(func, args, kwargs, error):
    names = ("input", "weight", "bias", "N", "C", "HxW", "group", "eps")
    call = dict(zip(names, args), **kwargs)
    x, weight, bias = call["input"], call.get("weight"), call.get("bias")
    big = weight if isinstance(weight, OffloadedTensor) else bias
    if isinstance(x, OffloadedTensor) or not isinstance(big, OffloadedTensor) or big.dim() != 1:
        raise error
    # Its kernel folds rstd and the weight into one scale and one shift per channel and applies them
    # in one fused multiply-add each: per channel, scale = rstd * weight, shift = fma(-scale, mean,
    # bias), y = fma(x, scale, shift), in float for a half-precision input (rounded once at the
    # end). The same steps on slices of the channels give its result bit for bit. Its statistics
    # come from the kernel itself, given a plain weight of ones (it reads the input alone for them).
    n, channels, group = call["N"], call["C"], call["group"]
    ones = torch.ones(channels, dtype=big.dtype, device=x.device)
    _, mean, rstd = func(x, ones, None, n, channels, call["HxW"], group, call["eps"])
    del ones
    per_group = channels // group
    means, rstds = (t.repeat_interleave(per_group, 1) for t in (mean, rstd))  # (N, C): one per channel
    out = torch.empty_like(x)
    per = sum(_slice_bytes(t, 0) for t in (weight, bias) if isinstance(t, OffloadedTensor))
    for start, stop in _chunks_of(channels, max(1, _room(big) // max(per, 1))):
        paged = Paged()
        try:
            w, b = (None if t is None else _upload_slice(t, start, stop, paged) for t in (weight, bias))
            scale = rstds[:, start:stop] * w if w is not None else rstds[:, start:stop]
            shift = torch.addcmul(b if b is not None else torch.zeros_like(scale), -scale, means[:, start:stop])
            x_part = x.narrow(1, start, stop - start)
            trailing = (1,) * (x.dim() - 2)
            y = torch.addcmul(shift.view(n, -1, *trailing), x_part.to(scale.dtype), scale.view(n, -1, *trailing))
            out.narrow(1, start, stop - start).copy_(y)
        finally:
            paged.release()
    return out, mean, rstd


def _affine(out, normalised, weight, bias, lead: int, room: int, trailing: int = 0) -> None:
    """``out = normalised * weight + bias`` (either may be None) in slices of weight and bias along
    their dim 0, which is ``lead`` of ``normalised`` (``trailing`` more dims of it follow theirs);
    each slice in slices again where one does not fit."""
    big = weight if weight is not None else bias
    per = sum(_slice_bytes(t, 0) for t in (weight, bias) if isinstance(t, OffloadedTensor))
    if per > room and big.dim() > 1:
        for i in range(big.shape[0]):
            _affine(out.select(lead, i), normalised.select(lead, i), None if weight is None else weight[i],
                    None if bias is None else bias[i], lead, room, trailing)
        return
    step, s = max(1, room // max(per, 1)), 0
    while s < big.shape[0]:  # (a loop, not a range: ``s = e`` below)
        e = min(big.shape[0], s + step)
        paged = Paged()
        try:
            y = normalised.narrow(lead, s, e - s)
            w, b = (None if t is None else _upload_slice(t, s, e, paged) for t in (weight, bias))
            w, b = (None if t is None else t.reshape(t.shape + (1,) * trailing) for t in (w, b))
            # The kernel's last step is one fused multiply-add: addcmul rounds as it does.
            y = y * w if b is None else y + b if w is None else torch.addcmul(b, y, w)
            out.narrow(lead, s, e - s).copy_(y)
        finally:
            paged.release()
        s = e


def _upload_slice(t, start: int, stop: int, paged: Paged) -> torch.Tensor:
    """Rows ``start:stop`` of ``t`` on the device, an offloaded one copied for this op alone: a
    cached copy of all of it (its page before this op fell short) would serve the slice and be held
    whole beside the other tensor's slice."""
    if not isinstance(t, OffloadedTensor):
        return t.narrow(0, start, stop - start)
    return cast_views.cast_of(t, t._master.pager.upload(t._host.narrow(0, start, stop - start), describe(t), paged.entries)[0])


# ---------------------------------------------------------------------------- bilinear


def _position(t_dims: int, expand, rank: int):
    """Each dim of a ``_trilinear`` input: its position among the op's ``rank`` dims."""
    return [p for p in range(rank) if p not in expand][:t_dims]


def trilinear(func, args, kwargs, error):
    names = ("i1", "i2", "i3", "expand1", "expand2", "expand3", "sumdim", "unroll_dim")
    call = dict(zip(names, args), **kwargs)
    call.setdefault("unroll_dim", 1)
    inputs, expands = [call["i1"], call["i2"], call["i3"]], [call["expand1"], call["expand2"], call["expand3"]]
    big = [i for i, t in enumerate(inputs) if isinstance(t, OffloadedTensor)]
    if len(big) != 1 or inputs[big[0]].dim() == 0:
        raise error
    k = big[0]
    w, sumdim = inputs[k], list(call["sumdim"])
    rank = w.dim() + len(expands[k])
    where = _position(w.dim(), expands[k], rank)
    room = _room(w)

    def run(cuts):
        """The op over the narrowing ``cuts``: {position: (start, stop)} applied to every input."""
        paged = Paged()
        try:
            parts = []
            for t, e in zip(inputs, expands):
                pos = _position(t.dim(), e, rank)
                for p, (s, stop) in cuts.items():
                    if p in pos:
                        t = _narrow(t, pos.index(p), s, stop - s)
                parts.append(paged.page(t) if isinstance(t, OffloadedTensor) else t)
            return func(*parts, *(call[n] for n in names[3:]))
        finally:
            paged.release()

    pieces = _pieces(w, room)
    if pieces is None:
        raise error
    summed = [p for d, p in enumerate(where) if p in sumdim and any(c[d] != (0, w.shape[d]) for c in pieces)]
    if summed:
        # A summed dim of the tensor is cut (one output feature does not fit, or a backward sums
        # over the features): partial results added in another order.
        _warn_inexact(w, "a bilinear product")
    meta = [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in inputs]
    shape = func(*meta, *(call[n] for n in names[3:])).shape
    out = torch.zeros(shape, dtype=w.dtype, device=w._master.pager.device)
    for cut in pieces:
        cuts = {p: cut[d] for d, p in enumerate(where) if cut[d] != (0, w.shape[d])}
        target = out
        for p, (a, b) in cuts.items():
            if p not in sumdim:
                target = target.narrow(p - sum(1 for q in sumdim if q < p), a, b - a)
        target.add_(run(cuts))
    return out


def _pieces(t: OffloadedTensor, room: int, dim: int = 0, prefix=()):
    """Cuts of ``t`` that fit ``room`` bytes, each a (start, stop) per dim: chunks along dim 0, and
    where one slice does not fit, one index of it at a time, cut along the next dim; None if not
    even one element fits."""
    rest = [(0, n) for n in t.shape[dim + 1:]]
    view = t
    for d, (a, b) in enumerate(prefix):
        view = _narrow(view, d, a, b - a)
    per = _slice_bytes(view, dim) if view.shape[dim] else 0
    if per <= room:
        step = max(1, room // max(per, 1))
        return [(*prefix, (s, min(view.shape[dim], s + step)), *rest) for s in range(0, view.shape[dim], step)]
    if dim + 1 >= t.dim():
        return None
    out = []
    for i in range(view.shape[dim]):
        more = _pieces(t, room, dim + 1, (*prefix, (i, i + 1)))
        if more is None:
            return None
        out += more
    return out


# ---------------------------------------------------------------------------- reductions

# op: (kind, names of its arguments after self). Each reads every element once, so slices give the
# whole op's result bit for bit. The sums (``sum``, ``mean``, ``linalg.vector_norm``) would add
# partial sums in another order, and round a half-precision result once per slice: they run on the
# host master, in one kernel, instead (host_compute).
_REDUCTIONS = {
    aten.max.default: ("amax", ()),
    aten.min.default: ("amin", ()),
    aten.amax.default: ("amax", ("dim", "keepdim")),
    aten.amin.default: ("amin", ("dim", "keepdim")),
    aten.any.default: ("any", ()),
    aten.all.default: ("all", ()),
    aten.any.dims: ("any", ("dim", "keepdim")),
    aten.all.dims: ("all", ("dim", "keepdim")),
}


def reduction(func, args, kwargs, error):
    kind, names = _REDUCTIONS[func]
    call = dict(zip(("self", *names), args), **kwargs)
    t = call["self"]
    if not isinstance(t, OffloadedTensor) or t.dim() == 0:
        raise error
    given = call.get("dim")
    dims = list(range(t.dim())) if given is None or len(given) == 0 else sorted({d % t.dim() for d in given})
    keep = bool(call.get("keepdim", False))
    room = _room(t)
    free = next((d for d in range(t.dim()) if d not in dims and t.shape[d] > 1), None)
    if free is not None:
        # Every output reads its own slice of the tensor: the op itself on slices along a dim it keeps.
        at = free if keep else free - sum(1 for d in dims if d < free)
        chunks = _chunks(t, free, room) or [(i, i + 1) for i in range(t.shape[free])]
        outs = []
        for s, e in chunks:
            part = _narrow(t, free, s, e - s)
            if _nbytes(part) <= room:
                outs.append(_paged_call(lambda p: func(p, *args[1:], **kwargs), part, free, 0, e - s))
            else:
                outs.append(func(part, *args[1:], **kwargs))  # dispatched again: cut further
        return torch.cat(outs, dim=at)
    total = _reduced(kind, t, dims, room)
    if not keep:
        total = total.reshape([n for d, n in enumerate(t.shape) if d not in dims])
    return total


def _reduced(kind: str, t: OffloadedTensor, dims: list, room: int) -> torch.Tensor:
    """``t`` reduced over every one of its ``dims`` (kept), in slices that fit ``room``."""
    op = getattr(torch, kind)
    if _nbytes(t) <= room:
        return _paged_call(lambda p: op(p, dim=tuple(dims), keepdim=True), t, 0, 0, t.shape[0])
    cut = next(d for d in dims if t.shape[d] > 1)
    chunks = _chunks(t, cut, room) or [(i, i + 1) for i in range(t.shape[cut])]
    parts = [_reduced(kind, _narrow(t, cut, s, e - s), dims, room) for s, e in chunks]
    return op(torch.cat(parts, dim=cut), dim=cut, keepdim=True)


SHORT_OF_ROOM = {
    aten.gather.default: gather,
    aten.native_layer_norm.default: layer_norm,
    aten.native_group_norm.default: group_norm,
    aten.native_layer_norm_backward.default: layer_norm_backward,
    aten._trilinear.default: trilinear,
    **{op: reduction for op in _REDUCTIONS},
}
