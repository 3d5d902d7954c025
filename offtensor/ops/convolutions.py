"""Convolutions whose weight is larger than the budget's free room, computed in tiles of the weight:
every form ``aten.convolution`` takes (1-, 2- and 3-D; strided, dilated, padded; grouped;
transposed) and its backward.

A weight is cut first by its output channels, along the dim that holds them (0; 1 when transposed):
whole groups of a grouped convolution where several fit (a grouped kernel over fewer groups computes
each as the whole op does), else the output channels of one group at a time. Those tiles are
bit-identical with the whole op on the CPU. Where not even one output channel fits, its input
channels are cut too and the tiles' partial sums added: placement plans a model's own tensor of
three or more dims as a stack of matrices, as ``bmm`` reads it, and counts a convolution's least
tile beside that (one input channel's kernel of one output channel), so every convolution of a
tensor that wrap accepted runs. Partial sums, and a grouped convolution run one group at a time (a
depthwise kernel on one channel is another kernel), may differ from the whole op in the last bits:
a warning names the weight."""

from __future__ import annotations

import warnings

import torch

from .. import cast_views
from ..tensor import OffloadedTensor
from .arguments import raise_torch_error
from .paging import Paged, describe, run
from .table import implements
from .tiling import TILE_ALIGN, _offloaded_bytes, _page_slice, _slice_bytes, _tile_size, _tiled, needs_tiling

aten = torch.ops.aten

_ARGUMENTS = ("input", "weight", "bias", "stride", "padding", "dilation", "transposed", "output_padding", "groups")


def _narrow(t, dim: int, start: int, length: int):
    """``t.narrow(dim, start, length)``; of an OffloadedTensor, a view of its host master (nothing
    paged); None stays None."""
    if t is None:
        return None
    if isinstance(t, OffloadedTensor):
        return cast_views.derived(t, t._host.narrow(dim, start, length))
    return t.narrow(dim, start, length)


def _offloaded_nbytes(t) -> int:
    return _offloaded_bytes([t])[1]


class _Shape:
    """Where a convolution's weight keeps its channels: per group, ``rows`` of its dim 0, ``outs``
    output channels along ``out_dim`` and ``ins`` input channels along ``in_dim``."""

    def __init__(self, weight, groups: int, transposed: bool):
        self.groups, self.transposed = groups, transposed
        self.rows = weight.shape[0] // groups
        self.out_dim, self.in_dim = (1, 0) if transposed else (0, 1)
        self.outs = weight.shape[1] if transposed else self.rows
        self.ins = self.rows if transposed else weight.shape[1]

    def whole_groups(self, weight, bias, room: int) -> int:
        """How many whole groups fit ``room`` at once (their weight rows and bias); 0 if not one."""
        one = (_offloaded_nbytes(weight) + _offloaded_nbytes(bias)) // self.groups
        return min(self.groups, room // one) if one else self.groups


def _warn_inexact(weight: OffloadedTensor, how: str, what: str = "outputs") -> None:
    warnings.warn(
        f"offtensor: a convolution with {describe(weight)}, larger than the budget's room, runs {how}: its {what} "
        f"may differ from the unwrapped model's in the last bits. Raise budget_gb for bit-identical results.",
        stacklevel=3)


# ---------------------------------------------------------------------------- forward


@implements(aten.convolution.default)
def convolution(func, types, args, kwargs):
    call = dict(zip(_ARGUMENTS, args), **kwargs)
    weight, bias, x = call["weight"], call.get("bias"), call["input"]
    if not needs_tiling(weight, [x, bias]):
        return run(func, args, kwargs)
    raise_torch_error(func, args, kwargs, weight._master.pager.device)
    shape = _Shape(weight, call.get("groups", 1), bool(call.get("transposed", False)))
    rest = {k: v for k, v in call.items() if k not in ("input", "weight", "bias", "groups")}
    _, others = _offloaded_bytes([x])
    room = weight._master.pager.free_bytes() - others
    if shape.groups > 1:
        # A grouped kernel over fewer groups, or one group run ungrouped, may pick another algorithm.
        count = shape.whole_groups(weight, bias, room)
        _warn_inexact(weight, "a few groups at a time" if count > 1 else "one group at a time")
        if count > 1:
            return _whole_groups(func, x, weight, bias, shape, count, rest)
    outs = []
    for g in range(shape.groups):
        x_g = _narrow(x, 1, g * shape.ins, shape.ins) if shape.groups > 1 else x
        w_g = _narrow(weight, 0, g * shape.rows, shape.rows) if shape.groups > 1 else weight
        b_g = _narrow(bias, 0, g * shape.outs, shape.outs) if shape.groups > 1 else bias
        outs.append(_one_group(func, x_g, w_g, b_g, shape, rest, others, weight))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def _whole_groups(func, x, weight, bias, shape: _Shape, count: int, rest: dict):
    """A grouped convolution ``count`` whole groups at a time, each call a grouped kernel."""
    outs = []
    for g0 in range(0, shape.groups, count):
        n = min(count, shape.groups - g0)
        paged = Paged()
        try:
            outs.append(func(paged.arg(_narrow(x, 1, g0 * shape.ins, n * shape.ins)),
                             _page_slice(weight, 0, g0 * shape.rows, (g0 + n) * shape.rows, paged),
                             None if bias is None else _page_slice(bias, 0, g0 * shape.outs, (g0 + n) * shape.outs, paged),
                             groups=n, **rest))
        finally:
            paged.release()
    return torch.cat(outs, dim=1)


def _one_group(func, x, weight, bias, shape: _Shape, rest: dict, others: int, named: OffloadedTensor):
    """An ungrouped convolution (or one group of a grouped one, of the weight ``named``): tiles of its
    output channels, or of an output channel's input channels where not even one output channel fits."""
    per_output = _slice_bytes(weight, shape.out_dim) + (_slice_bytes(bias, 0) if isinstance(bias, OffloadedTensor) else 0)
    if per_output <= weight._master.pager.free_bytes() - others:
        def compute(start, stop, paged):
            b = None if bias is None else _page_slice(bias, 0, start, stop, paged)
            return func(paged.arg(x), _page_slice(weight, shape.out_dim, start, stop, paged), b, groups=1, **rest)

        return _tiled(weight, shape.out_dim, others, "convolution", compute, 1, [(bias, 0)], reach_back=True)
    _warn_inexact(named, "in tiles of its input channels, summed")
    outs = []
    for j in range(weight.shape[shape.out_dim]):
        w_j, b_j = _narrow(weight, shape.out_dim, j, 1), _narrow(bias, 0, j, 1)
        step = _tile_size(w_j, shape.in_dim, others + _offloaded_nbytes(b_j), "convolution")
        total = None
        for start in range(0, shape.ins, step):
            stop = min(shape.ins, start + step)
            paged = Paged()
            try:
                part = func(paged.arg(_narrow(x, 1, start, stop - start)),
                            _page_slice(w_j, shape.in_dim, start, stop, paged), None, groups=1, **rest)
            finally:
                paged.release()
            total = part if total is None else total + part
        if b_j is not None:
            paged = Paged()
            try:
                total = total + paged.arg(b_j).reshape(1, 1, *[1] * (total.dim() - 2))
            finally:
                paged.release()
        outs.append(total)
    return torch.cat(outs, dim=1)


# ---------------------------------------------------------------------------- backward


@implements(aten.convolution_backward.default)
def convolution_backward(func, types, args, kwargs):
    """The backward of a convolution whose weight is larger than the room, in the forward's tiles.
    The weight's and bias's gradients are the tiles' gradients put together; the input's gradient
    sums over every output channel of its group, so where output channels are cut it is the sum of
    the tiles' and may differ from the whole op's in the last bits (warned, naming the weight)."""
    grad, x, weight = args[0], args[1], args[2]
    rest = list(args[3:]) + [kwargs[k] for k in list(kwargs)]
    bias_sizes, stride, padding, dilation, transposed, output_padding, groups, mask = rest
    if not needs_tiling(weight, [grad, x]):
        return run(func, args, kwargs)
    shape = _Shape(weight, groups, bool(transposed))
    _, others = _offloaded_bytes([grad, x])
    common = (stride, padding, dilation, transposed, output_padding)
    grads = _Grads(grad, x, weight, list(mask), bias_sizes is not None)
    count = shape.whole_groups(weight, None, weight._master.pager.free_bytes() - others) if groups > 1 else 0
    if count > 1:
        _warn_inexact(weight, "a few groups at a time", "gradients")
        for g0 in range(0, groups, count):
            n = min(count, groups - g0)
            paged = Paged()
            try:
                part = func(paged.arg(_narrow(grad, 1, g0 * shape.outs, n * shape.outs)),
                            paged.arg(_narrow(x, 1, g0 * shape.ins, n * shape.ins)),
                            _page_slice(weight, 0, g0 * shape.rows, (g0 + n) * shape.rows, paged),
                            grads.bias_sizes(n * shape.outs), *common, n, grads.mask)
            finally:
                paged.release()
            grads.put(part, (g0 * shape.ins, n * shape.ins), [(0, g0 * shape.rows, n * shape.rows)],
                      (g0 * shape.outs, n * shape.outs))
        return grads.result()
    if groups > 1:
        _warn_inexact(weight, "one group at a time", "gradients")
    elif mask[0]:
        warnings.warn(f"offtensor: the backward of a convolution with {describe(weight)}, larger than the budget's room, "
                      "runs in output-channel tiles: its input gradient is the sum of the tiles' and may differ from "
                      "the unwrapped model's in the last bits. Raise budget_gb for bit-identical gradients.", stacklevel=2)
    for g in range(groups):
        _group_backward(func, grad, x, weight, g, shape, common, grads, others)
    return grads.result()


class _Grads:
    """A convolution backward's three gradients, put together from its tiles': the input's summed
    over the tiles that read each input channel, the weight's and the bias's placed where each
    tile's slices lie."""

    def __init__(self, grad, x, weight, mask: list, bias: bool):
        device = weight._master.pager.device
        self.has_bias = bias
        self.mask = [mask[0], mask[1], mask[2] and bias]
        self.input = torch.zeros(x.shape, dtype=x.dtype, device=device) if mask[0] else None
        self.weight = torch.empty(weight.shape, dtype=weight.dtype, device=device) if mask[1] else None
        outputs = grad.shape[1]
        self.bias = torch.empty(outputs, dtype=grad.dtype, device=device) if self.mask[2] else None

    def bias_sizes(self, n: int):
        return [n] if self.has_bias else None

    def put(self, part, inputs: tuple, weight_slices: list, outputs) -> None:
        """A tile's gradients: its input's, added at channels ``inputs`` (start, length); its
        weight's, at ``weight_slices`` ((dim, start, length) each); its bias's at ``outputs``."""
        if self.input is not None and part[0] is not None:
            self.input.narrow(1, *inputs).add_(part[0])
        if self.weight is not None and part[1] is not None:
            target = self.weight
            for dim, start, length in weight_slices:
                target = target.narrow(dim, start, length)
            target.copy_(part[1])
        if self.bias is not None and outputs is not None and part[2] is not None:
            self.bias.narrow(0, *outputs).copy_(part[2])

    def result(self) -> tuple:
        return self.input, self.weight, self.bias


def _group_backward(func, grad, x, weight, g: int, shape: _Shape, common: tuple, grads: _Grads, others: int) -> None:
    """The backward of group ``g`` (of an ungrouped convolution: all of it) in tiles of its output
    channels, or of an output channel's input channels where not even one output channel fits."""
    ins, outs, rows = (g * shape.ins, shape.ins), (g * shape.outs, shape.outs), (0, g * shape.rows, shape.rows)
    grad_g, x_g, w_g = _narrow(grad, 1, *outs), _narrow(x, 1, *ins), _narrow(weight, *rows)
    fits = (weight._master.pager.free_bytes() - others) // max(_slice_bytes(w_g, shape.out_dim), 1)
    if fits >= 1:
        if fits < min(TILE_ALIGN, shape.outs):  # the weight's and bias's gradients sum each tile's outputs apart
            _warn_inexact(weight, f"in output-channel tiles {fits} wide", "gradients")

        def compute(start, stop, paged):
            part = func(paged.arg(_narrow(grad_g, 1, start, stop - start)), paged.arg(x_g),
                        _page_slice(w_g, shape.out_dim, start, stop, paged), grads.bias_sizes(stop - start),
                        *common, 1, grads.mask)
            grads.put(part, ins, [rows, (shape.out_dim, start, stop - start)], (outs[0] + start, stop - start))
            return torch.empty(0)

        _tiled(w_g, shape.out_dim, others, "convolution_backward", compute, 0)
        return
    _warn_inexact(weight, "in tiles of its input channels", "gradients")
    for j in range(shape.outs):
        w_j = _narrow(w_g, shape.out_dim, j, 1)
        step = _tile_size(w_j, shape.in_dim, others, "convolution_backward")
        for start in range(0, shape.ins, step):
            n = min(step, shape.ins - start)
            first = start == 0  # the bias's gradient once per output channel
            paged = Paged()
            try:
                part = func(paged.arg(_narrow(grad_g, 1, j, 1)), paged.arg(_narrow(x_g, 1, start, n)),
                            _page_slice(w_j, shape.in_dim, start, start + n, paged),
                            grads.bias_sizes(1) if first else None, *common, 1,
                            [grads.mask[0], grads.mask[1], grads.mask[2] and first])
            finally:
                paged.release()
            grads.put(part, (ins[0] + start, n), [rows, (shape.out_dim, j, 1), (shape.in_dim, start, n)],
                      (outs[0] + j, 1) if first else None)
