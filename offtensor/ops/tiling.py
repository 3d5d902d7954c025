"""Ops computed in pieces when the budget's free room is short: lists of offloaded inputs paged one at a
time (``cat``, ``stack``, ``_foreach_*``), and weights larger than the room computed in output tiles
(``linear``, ``mm``/``addmm``, ``mv``/``addmv``, ``bmm``/``baddbmm``; ``convolution`` in ``convolutions``
with the tiles cut here), ``TILE_ALIGN`` wide where the room allows."""

from __future__ import annotations

import threading

import torch

from .. import cast_views
from ..pager import BudgetError, host_layout
from ..tensor import OffloadedTensor
from .arguments import raise_torch_error
from .paging import Paged, describe, layout_of, run
from .table import implements

aten = torch.ops.aten


# ---------------------------------------------------------------------------- ops over lists

# An op reading several offloaded tensors at once needs all of them on the device together. Where
# the op allows, pieces are paged one at a time instead when the budget's free room is too small:
# ``cat``/``stack`` copy each input into its slice of the output, ``_foreach_*`` runs per element.
# Placement then only reserves room for the largest single input (placement.plan's working set).


def _offloaded_bytes(values) -> tuple:
    """(pager, bytes the OffloadedTensors among ``values`` cover) for an op's arguments."""
    pager, need = None, 0
    for v in values:
        for t in v if isinstance(v, (list, tuple)) else (v,):
            if isinstance(t, OffloadedTensor):
                pager = pager or t._master.pager
                layout = t.__dict__.get("_layout") or layout_of(t)  # memoized by Paged.page: this runs per op
                need += (layout[1] - layout[0]) * t._host.element_size()  # _host: no __torch_function__
    return pager, need


def _short_of_room(pager, need: int) -> bool:
    """Whether ``need`` bytes of copies cannot fit the budget beside the resident weights. This runs
    before every linear and mm, so it is O(1): it takes the copies of ops still running as none
    (true outside a handler that holds pages while it calls further ops; if it is wrong, the
    pager's BudgetError says so). The tile size itself is taken from ``free_bytes``."""
    return pager is not None and pager.budget_bytes is not None and need > pager.budget_bytes - pager.budget.resident_bytes


def _meta(t):
    if isinstance(t, torch.Tensor):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    return t


@implements(aten.cat.default, aten.stack.default)
def _cat_or_stack(func, types, args, kwargs):
    tensors = args[0]
    pager, need = _offloaded_bytes(tensors)
    if not _short_of_room(pager, need):
        return run(func, args, kwargs)
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    # The output's shape, dtype (type promotion) and memory format, without computing anything.
    shape = func([_meta(t) for t in tensors], dim)
    out = torch.empty_strided(shape.shape, shape.stride(), dtype=shape.dtype, device=pager.device)
    dim = dim % max(out.dim(), 1)
    start = 0
    for i, t in enumerate(tensors):
        if func is aten.cat.default:
            if t.dim() == 1 and t.shape[0] == 0:
                continue  # cat skips legacy empty 1-D inputs
            target = out.narrow(dim, start, t.shape[dim])
            start += t.shape[dim]
        else:
            target = out.select(dim, i)
        if not isinstance(t, OffloadedTensor):
            target.copy_(t)
            continue
        room = pager.free_bytes() or 0
        if t.dim() and _offloaded_bytes([t])[1] > room:
            # Larger than the free room (a weight placed in tiles; ``parameters_to_vector``'s flat
            # view of one): copied in slices of it.
            _copy_in_slices(t, target, room)
            continue
        paged = Paged()
        try:
            target.copy_(paged.page(t))  # one input on the device at a time
        finally:
            paged.release()
    return out


def _copy_in_slices(t: OffloadedTensor, out: torch.Tensor, room: int) -> None:
    """Copy ``t`` into the device tensor ``out`` in slices along its first dim that fit ``room``
    bytes (each slice of them in slices again where one does not)."""
    per_slice = _slice_bytes(t, 0)
    if per_slice > room and t.dim() > 1:
        for i in range(t.shape[0]):
            _copy_in_slices(cast_views.derived(t, t._host[i]), out[i], room)
        return
    step = max(1, room // max(per_slice, 1))
    for start in range(0, t.shape[0], step):
        stop = min(t.shape[0], start + step)
        paged = Paged()
        try:
            out[start:stop].copy_(_page_slice(t, 0, start, stop, paged))
        finally:
            paged.release()


def _offloaded(args, kwargs) -> list:
    return [t for v in (*args, *kwargs.values()) for t in (v if isinstance(v, (list, tuple)) else (v,))
            if isinstance(t, OffloadedTensor)]


class ForeachInPieces:
    """A ``_foreach_*`` op (or a fused optimizer step) whose offloaded list elements do not fit the
    free room together: run it once per element (each call pages one element's tensors), which is
    what the op computes."""

    def __init__(self, func, handler):
        self.func, self.handler = func, handler
        self.__name__ = f"in_pieces({getattr(handler, '__name__', func)})"

    def __call__(self, func, types, args, kwargs):
        pager, need = _offloaded_bytes(list(args) + list(kwargs.values()))
        if not _short_of_room(pager, need):
            return self.handler(func, types, args, kwargs)
        n = len(args[0])
        if n == 1:  # one element that does not fit: slices of it may (pointwise_in_pieces)
            error = BudgetError(
                f"offtensor: {func} cannot run within the budget: its one element needs {need} bytes of "
                f"offloaded copies ({', '.join(describe(t) for t in _offloaded(args, kwargs))}), but only "
                f"{pager.budget_bytes - pager.budget.resident_bytes} of the budget's {pager.budget_bytes} bytes are "
                f"not resident weights. Raise budget_gb, or offload more weights so fewer stay resident.")
            if cutting():  # already a slice: the caller retries a smaller one
                raise error
            return pointwise_in_pieces(func, self.handler, args, kwargs, error)
        names = [a.name for a in func._schema.arguments]

        def piece(v, i, name):
            if isinstance(v, (list, tuple)) and len(v) == n:
                return v[i : i + 1]
            if name == "scalars" and isinstance(v, torch.Tensor) and v.dim() == 1 and v.shape[0] == n:
                return v[i : i + 1]  # _foreach_addcmul.Tensor's one scalar per element, as a tensor
            return v

        results = [
            func(*(piece(a, i, name) for a, name in zip(args, names)), **{k: piece(v, i, k) for k, v in kwargs.items()})
            for i in range(n)
        ]
        if len(func._schema.returns) > 1:  # lists, one per return (the functional _fused_adam): joined per return
            return tuple([r for result in results for r in result[j]] for j in range(len(func._schema.returns)))
        if results and isinstance(results[0], (list, tuple)):
            return [r for result in results for r in result]
        return None  # in-place ops return nothing


# ---------------------------------------------------------------------------- tiling past the budget

# A weight larger than the budget's free room is computed in output tiles that fit: rows of a
# linear weight (output features), columns of mm's second operand, output channels of a
# convolution, batches of bmm (columns and rows of each batch where one does not fit). Each tile is one call of the same op on a slice of the weight, and
# the tiles are concatenated. Every output element is computed from the same inputs with the same
# reduction length, so results are bit-identical where the kernel sums in the same order for a
# narrower output: on CPU (MKL/oneDNN) that held for every tile at least TILE_ALIGN wide and cut at
# multiples of TILE_ALIGN in test_budget_and_tiling; tiles narrower than that (a budget with room for only a few rows) may
# make BLAS pick a matrix-vector kernel, which differs in the last bits (tested to a tolerance).
# Placement reserves room for tiles TILE_ALIGN wide (placement.tile_working_set), so a wrapped
# model's tiles stay bit-identical; narrower ones are its fallback, with a warning.

# Tiles are cut to multiples of this many outputs wide when the room allows (see _tiled).
TILE_ALIGN = 16


def _slice_bytes(t: OffloadedTensor, dim: int) -> int:
    # The host view's element size: a lazy cast (cast_views) pages its master's dtype.
    return t.numel() // max(t.shape[dim], 1) * t.__dict__["_host"].element_size()


def _page_slice(t, dim: int, start: int, stop: int, paged: Paged):
    """Device tensor of ``t.narrow(dim, start, stop - start)``, paging only that slice's own
    elements: tiles are sized by them (``_tile_size``, ``placement.tile_working_set``), so a strided
    slice whose covering range holds more (a column tile of a row-major weight covers nearly all of
    its rows) is gathered on the host first and uploaded compact, in its own memory order: rows of
    a transposed weight stay column-major, so that a kernel whose order of summing follows the
    layout (mv's) sums each output as it does for the whole weight."""
    if not isinstance(t, OffloadedTensor):
        return t.narrow(dim, start, stop - start)
    host = t._host.narrow(dim, start, stop - start)
    lo, hi = host_layout(host)[:2]
    if (hi - lo) <= host.numel():
        return paged.page(cast_views.derived(t, host))
    order = sorted(range(host.dim()), key=lambda d: -host.stride(d))  # outermost first
    gathered = cast_views.cast_of(t, t._master.pager.upload(host.permute(order).contiguous(), describe(t), paged.entries)[0])
    return gathered.permute(sorted(range(host.dim()), key=order.__getitem__))


def _tile_size(weight: OffloadedTensor, dim: int, others: int, what: str, sliced=()) -> int:
    """How many slices of ``weight`` along ``dim`` fit in the free room beside ``others`` bytes of
    the op's other offloaded arguments (``sliced``: (tensor, dim) cut into the same tiles, like a
    bias); a clear BudgetError when not even one does."""
    pager = weight._master.pager
    room = pager.free_bytes() - others
    per_slice = _slice_bytes(weight, dim)
    per_slice += sum(_slice_bytes(t, d) for t, d in sliced if isinstance(t, OffloadedTensor))
    if room < per_slice:
        raise BudgetError(
            f"offtensor: {what} cannot be tiled within the budget: one slice of {describe(weight)} is {per_slice} "
            f"bytes and its other offloaded arguments {others} bytes, but only {room + others} of the budget's "
            f"{pager.budget_bytes} bytes are free. Raise budget_gb, or offload more weights so fewer stay resident."
        )
    return max(1, room // per_slice)


def _tiled(weight, dim, others, what, compute, out_dim, sliced=()):
    """``compute(start, stop, paged)`` for tiles of ``weight`` along ``dim``, concatenated along
    ``out_dim`` of the outputs. Each tile's pages are released before the next is paged. Where the
    room allows, tiles are cut at multiples of ``TILE_ALIGN`` and are at least that wide."""
    n = weight.shape[dim]
    fits = _tile_size(weight, dim, others, what, sliced)
    step = fits - fits % TILE_ALIGN if TILE_ALIGN <= fits < n else fits
    bounds = list(range(0, n, step)) + [n]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] < TILE_ALIGN and step % TILE_ALIGN == 0:
        # A 1- or 2-wide output makes BLAS pick a matrix-vector kernel that sums in another order,
        # so the last tile takes TILE_ALIGN more outputs from the one before, where the room allows.
        # The cut stays at a multiple of TILE_ALIGN: for one row of input (a decode step's token)
        # MKL computes the outputs in blocks of 16 from the first, and an output of a tile that
        # starts elsewhere, or of a block a tile's end splits, is summed in another order.
        cut = bounds[-2] - TILE_ALIGN
        if cut > bounds[-3] and n - cut <= fits:
            bounds[-2] = cut
    outs = []
    for start, stop in zip(bounds, bounds[1:]):
        paged = Paged()
        try:
            outs.append(compute(start, stop, paged))
        finally:
            paged.release()
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=out_dim)


def needs_tiling(big, rest) -> bool:
    """Whether offloaded ``big`` (plus the offloaded tensors among ``rest``) cannot fit the budget
    beside the resident weights. Runs before every linear and mm: O(1) unless the whole masters
    involved are larger than that room."""
    if not isinstance(big, OffloadedTensor):
        return False
    master = big._master
    pager = master.pager
    if pager.budget_bytes is None:
        return False
    room = pager.budget_bytes - pager.budget.resident_bytes
    bound = master.nbytes  # covers every view of it
    for t in rest:
        if isinstance(t, OffloadedTensor):
            bound += t._master.nbytes
    if bound <= room:
        return False
    host = big._host  # metadata of the plain host view: a wrapper method call costs a __torch_function__
    if host.dim() == 0 or host.shape[0] == 0:
        return False
    return _short_of_room(pager, _offloaded_bytes([big, *rest])[1])


def linear_tiled(x, weight, bias):
    """F.linear with a weight larger than the free room: output features in tiles."""
    raise_torch_error(torch._C._nn.linear, (x, weight, bias), {}, weight._master.pager.device)
    _, others = _offloaded_bytes([x])

    def compute(start, stop, paged):
        w = as_linear_weight(x, weight, _page_slice(weight, 0, start, stop, paged))
        b = None if bias is None else _page_slice(bias, 0, start, stop, paged)
        return torch._C._nn.linear(paged.arg(x), w, b)

    return _tiled(weight, 0, others, "linear", compute, -1, [(bias, 0)])


def _bias_slice(bias, out_dim, start, stop, size, paged, lead: int = 0):
    """The part of addmm's (baddbmm's: ``lead`` 1) broadcast ``bias`` that output tile [start, stop)
    of ``out_dim`` adds."""
    if not isinstance(bias, torch.Tensor) or bias.dim() == 0:
        return bias
    dim = out_dim - 2 - lead + bias.dim()  # bias broadcasts against the output from the right
    if dim < 0 or bias.shape[dim] != size:
        return paged.arg(bias)
    return _page_slice(bias, dim, start, stop, paged)


@implements(aten.mm.default, aten.addmm.default)
def mm(func, types, args, kwargs):
    addmm = func is aten.addmm.default
    bias, a, b = (args[0], args[1], args[2]) if addmm else (None, args[0], args[1])
    if needs_tiling(b, [a, bias]) and b.dim() == 2:
        columns = True  # columns of b -> columns of the output
    elif needs_tiling(a, [b, bias]) and a.dim() == 2:
        columns = False  # rows of a -> rows of the output
    else:
        return run(func, args, kwargs)
    raise_torch_error(func, args, kwargs, (b if columns else a)._master.pager.device)
    return _product_tiled(func, a, b, columns, (bias, *args[3:]) if addmm else (), kwargs)


def _product_tiled(func, a, b, columns: bool, before: tuple, kwargs, lead: int = 0):
    """mm / addmm of ``a`` and ``b`` (``lead`` 0), or bmm / baddbmm of one batch of them (``lead`` 1:
    each of batch size 1), in tiles of ``b``'s columns (``columns``) or of ``a``'s rows; ``before``:
    addmm's bias, beta and alpha, or baddbmm's bias (empty for mm and bmm)."""
    bias = before[0] if before else None
    big, dim, other = (b, lead + 1, a) if columns else (a, lead, b)
    size = big.shape[dim]
    bias_dim = None
    if isinstance(bias, torch.Tensor) and bias.dim():
        bias_dim = dim - 2 - lead + bias.dim()
        bias_dim = bias_dim if bias_dim >= 0 and bias.shape[bias_dim] == size else None
    _, others = _offloaded_bytes([other] + ([bias] if bias_dim is None else []))
    inner = _inner_tiles(big, dim - lead, other, bias, others, lead)
    if inner is not None:
        others += inner - _offloaded_bytes([other])[1]

    def compute(start, stop, paged):
        part = _page_slice(big, dim, start, stop, paged)
        left, right = (paged.arg(a) if inner is None else a, part) if columns else (part, paged.arg(b))
        rest = (_bias_slice(bias, dim, start, stop, size, paged, lead), *before[1:]) if before else ()
        if inner is not None:
            return _rows_tiled(func, left, right, rest, kwargs, lead)
        return func(*rest[:1], left, right, *rest[1:], **kwargs)

    return _tiled(big, dim, others, str(func), compute, dim, [] if bias_dim is None else [(bias, bias_dim)])


def _inner_tiles(big, dim: int, other, bias, others: int, lead: int = 0):
    """Room to keep for ``a`` when mm's operands are both offloaded and ``a`` cannot be paged whole
    beside ``TILE_ALIGN`` columns of ``b``: ``TILE_ALIGN`` of its rows, which each column tile then
    computes in row tiles (``_rows_tiled``). Paging ``a`` whole beside every column tile raised
    BudgetError, or cut the columns narrower than TILE_ALIGN, silently, at a budget that holds a
    tile of each, as an op of two weights of different modules (``a.weight @ b.weight``) needs.
    None: ``a`` is paged whole (it fits, it is not offloaded, or a 2-D bias would need row tiles too).
    ``dim`` counts from ``lead`` (1 for one batch of a bmm)."""
    if (dim != 1 or not isinstance(other, OffloadedTensor) or other.shape[lead] == 0
            or (isinstance(bias, torch.Tensor) and bias.dim() > 1)):
        return None
    free, column = big._master.pager.free_bytes(), _slice_bytes(big, lead + dim)
    if others + TILE_ALIGN * column <= free:
        return None
    rows = min(_offloaded_bytes([other])[1], TILE_ALIGN * _slice_bytes(other, lead))
    return rows if rows + TILE_ALIGN * column <= free else _slice_bytes(other, lead)  # else narrow tiles of both


def _rows_tiled(func, a: OffloadedTensor, right: torch.Tensor, before: tuple, kwargs, lead: int = 0):
    """mm / addmm (or bmm of one batch) of offloaded ``a`` and a device column tile ``right`` in
    tiles of ``a``'s rows, in the room the column tile leaves (``before``: addmm's bias slice, then
    its beta and alpha)."""
    def compute(start, stop, paged):
        rows = _page_slice(a, lead, start, stop, paged)
        return func(*before[:1], rows, right, *before[1:], **kwargs)

    return _tiled(a, lead, 0, str(func), compute, lead)


@implements(aten.bmm.default, aten.baddbmm.default)
def bmm(func, types, args, kwargs):
    """bmm, or baddbmm (its bias cut with the batches and columns it adds to), of an operand larger
    than the room: in tiles of batches, or of each batch's columns and rows where one does not fit."""
    bias, a, b = (args[0], args[1], args[2]) if func is aten.baddbmm.default else (None, args[0], args[1])
    cut = isinstance(bias, torch.Tensor) and bias.dim() == 3 and bias.shape[0] == a.shape[0] > 1  # else broadcast
    big = b if needs_tiling(b, [a, bias]) else a if needs_tiling(a, [b, bias]) else None
    if big is None and cut and needs_tiling(bias, [a, b]):
        big = bias  # peft's LoRA on a stacked expert weight: baddbmm(W, A, B) over the whole stack
    if big is None:
        return run(func, args, kwargs)
    raise_torch_error(func, args, kwargs, big._master.pager.device)
    batch = sum(_slice_bytes(t, 0) for t in (a, b, bias if cut else None) if isinstance(t, OffloadedTensor))
    if batch > big._master.pager.free_bytes() and big.shape[0] > 0 and big is not bias:
        # Not even one batch of the offloaded operands fits (einsum of weights runs bmm on a batch
        # of one): each batch in tiles of its columns and rows, as mm is.
        outs = [_product_tiled(func, _batch(a, i), _batch(b, i), big is b,
                               () if bias is None else (_batch(bias, i) if cut else bias,), kwargs, lead=1)
                for i in range(big.shape[0])]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def compute(start, stop, paged):
        part = () if bias is None else (_page_slice(bias, 0, start, stop, paged) if cut else paged.arg(bias),)
        return func(*part, _page_slice(a, 0, start, stop, paged), _page_slice(b, 0, start, stop, paged), **kwargs)

    return _tiled(big, 0, 0, str(func), compute, 0, [(t, 0) for t in (a, b, bias if cut else None) if t is not big])


def _batch(t, i: int):
    """Batch ``i`` of a bmm operand, as a batch of one: an OffloadedTensor view of its host master."""
    if isinstance(t, OffloadedTensor):
        return cast_views.derived(t, t._host.narrow(0, i, 1))
    return t.narrow(0, i, 1)


@implements(aten.mv.default, aten.addmv.default)
def mv(func, types, args, kwargs):
    """A matrix larger than the room times a vector (``weight @ v``): rows of the matrix in tiles,
    as mm's rows (addmv's bias cut with them)."""
    addmv = func is aten.addmv.default
    bias, a, v = (args[0], args[1], args[2]) if addmv else (None, args[0], args[1])
    if not needs_tiling(a, [v, bias]):
        return run(func, args, kwargs)
    raise_torch_error(func, args, kwargs, a._master.pager.device)
    cut = isinstance(bias, torch.Tensor) and bias.dim() == 1 and bias.shape[0] == a.shape[0] and a.shape[0] > 1
    _, others = _offloaded_bytes([v] + ([] if cut else [bias]))

    def compute(start, stop, paged):
        rows = _page_slice(a, 0, start, stop, paged)
        if not addmv:
            return func(rows, paged.arg(v), **kwargs)
        part = _page_slice(bias, 0, start, stop, paged) if cut else paged.arg(bias)
        return func(part, rows, paged.arg(v), *args[3:], **kwargs)

    return _tiled(a, 0, others, str(func), compute, 0, [(bias, 0)] if cut else [])


def as_linear_weight(x, weight: OffloadedTensor, device_weight: torch.Tensor) -> torch.Tensor:
    """The paged copy (or tile) of ``weight`` that ``F.linear`` gets. aten::matmul folds a 3-D
    input into one mm when the weight requires grad (even under no_grad), and otherwise only when
    the fold needs no copy; else it runs bmm: another kernel, other bits. The unwrapped model's
    weight requires grad, so its paged copy must say so too wherever that changes the kernel."""
    if x.dim() >= 3 and weight.requires_grad and not folds_without_copy(x):
        return device_weight.detach().requires_grad_()
    return device_weight


def folds_without_copy(x: torch.Tensor) -> bool:
    """aten::matmul's ``should_fold`` for an input whose weight does not require grad:
    ``x.view(-1, x.size(-1))`` needs no copy. Not ``is_contiguous()``: a size-1 dimension with any
    stride is contiguous, but its stride still decides the fold (fsmt's (2, 1, 32) decoder state
    with strides (32, 64, 1) runs bmm unless the weight requires grad)."""
    if x.numel() == 0:
        return True
    sizes, strides = x.shape, x.stride()
    return all(strides[i] == strides[i + 1] * sizes[i + 1] for i in range(x.dim() - 2))


# ---------------------------------------------------------------------------- pointwise ops in pieces

# A pointwise op reading or writing an offloaded tensor larger than the free room (an optimizer's
# ``param.add_(grad)`` on a weight that forward tiles, ``weight * mask``) runs on slices along one
# dimension instead: every output element is the same function of the same input elements, so the
# result is bit-identical. Reached only when paging the whole op raised BudgetError (ops/__init__),
# so ops that fit pay nothing for it.


_cutting = threading.local()  # .depth: pointwise_in_pieces calls running in this thread


def cutting() -> bool:
    """Whether this thread is inside ``pointwise_in_pieces``: a piece that does not fit is its
    caller's to retry smaller, not cut again."""
    return getattr(_cutting, "depth", 0) > 0


def _result_shape(func, args, kwargs, listed: bool, in_place: bool, equal: bool, error: BudgetError):
    """The meta tensor shaped as what ``pointwise_in_pieces`` cuts: its one result, or the element
    written in place or compared (the fused optimizer steps and ``equal`` have no meta kernel)."""
    if in_place:
        return _meta(args[0][0])
    if equal:
        return _meta(args[0])

    def meta(v):
        return [_meta(x) for x in v] if isinstance(v, (list, tuple)) else _meta(v)

    try:
        shape = func(*(meta(a) for a in args), **{k: meta(v) for k, v in kwargs.items()})
    except NotImplementedError:  # no meta kernel: its slices' shapes cannot be known
        raise error from None
    return shape[0] if listed else shape


def _aligned(v, dim: int, n: int, length: int):
    """``v``'s dim that broadcasts along dim ``dim`` of an ``n``-dim output ``length`` long, or None
    if ``v`` is not cut along it."""
    if isinstance(v, torch.Tensor) and v.dim() > 0:
        d = dim - (n - v.dim())
        if d >= 0 and v.shape[d] == length:
            return d
    return None


def _outermost_first(shape: torch.Tensor, offloaded: list) -> list:
    """The output dims longer than 1, outermost in the offloaded arguments' memory first (ties in
    index order): a slice along the outermost dim is one contiguous range of each master, where a
    row of a transposed weight spans nearly all of it. Slices in memory order also draw a random
    fill's values in the order one draw does."""
    n = shape.dim()

    def stride(dim):
        length = shape.shape[dim]
        return max((t.stride(d) for t in offloaded if (d := _aligned(t, dim, n, length)) is not None), default=0)

    return sorted((d for d in range(n) if shape.shape[d] > 1), key=lambda d: -stride(d))


def _cut_dim(shape: torch.Tensor, offloaded: list, free: int):
    """(dim, room, bytes a slice pages) for the outermost output dim longer than 1 whose slices
    fit ``free`` bytes beside the arguments not cut along it; None if none does. An argument
    broadcast along that dim (a norm's 2-D weight times its input) is read whole beside each slice
    of it, so a dim along which that argument is cut too may fit where the first does not."""
    n = shape.dim()
    dims = _outermost_first(shape, offloaded)
    for dim in dims:
        per_slice = fixed = 0
        for t in offloaded:
            d = _aligned(t, dim, n, shape.shape[dim])
            if d is None:
                fixed += t.numel() * t.__dict__["_host"].element_size()
            else:
                per_slice += _slice_bytes(t, d)
        if free - fixed >= per_slice:
            return dim, free - fixed, per_slice
    # None fits: one slice at a time along the first dim every offloaded argument is cut along,
    # each slice cut again (pointwise_in_pieces).
    for dim in dims:
        if all(_aligned(t, dim, n, shape.shape[dim]) is not None for t in offloaded):
            return dim, 0, 1
    return None


def pointwise_in_pieces(func, handler, args, kwargs, error: BudgetError):
    """Run pointwise ``func`` (or a ``_foreach_*`` op of one element) in slices along the outermost
    output dimension longer than 1 whose slices fit the free room (``_cut_dim``); re-raise ``error`` where no slicing helps
    (one slice does not fit, a multi-output op, a write whose returns are not its arguments)."""
    listed = isinstance(args[0], (list, tuple))  # a _foreach_* op of one element (ForeachInPieces)
    in_place = listed and func._schema.name.endswith("_")
    equal = func is torch.ops.aten.equal.default  # a bool, true where every slice's is (no meta kernel)
    if equal and args[0].shape != args[1].shape:
        return False
    shape = _result_shape(func, args, kwargs, listed, in_place, equal, error)
    offloaded = _offloaded(args, kwargs)
    mutation = getattr(handler, "returns", None)  # a Mutation: in-place / out= (ops/writes.py)
    if (not isinstance(shape, torch.Tensor) or not offloaded
            or (mutation is not None and not listed and (not mutation or None in mutation))):
        raise error
    if mutation and not listed:
        for i, name in mutation:
            written = args[i] if i < len(args) else kwargs[name]
            if written.shape != shape.shape:
                if written.numel() or isinstance(written, OffloadedTensor):
                    raise error  # an out= tensor of another shape: the op's own resize and warning
                written.resize_(shape.shape)  # an empty out= (a composite's result), sized as the op would
    n = shape.dim()
    pager = offloaded[0]._master.pager
    chosen = _cut_dim(shape, offloaded, pager.free_bytes() or 0)
    if chosen is None:
        raise error
    dim, room, per_slice = chosen
    length = shape.shape[dim]

    def aligned(v):
        return _aligned(v, dim, n, length)

    step = max(1, room // max(per_slice, 1))

    def cut(v, start, stop):
        if isinstance(v, (list, tuple)):
            return [cut(x, start, stop) for x in v]
        d = aligned(v)
        return v if d is None else v.narrow(d, start, stop - start)

    writes = mutation is not None or in_place
    out = None if writes or equal else torch.empty_strided(shape.shape, shape.stride(), dtype=shape.dtype, device=pager.device)
    start = 0
    _cutting.depth = getattr(_cutting, "depth", 0) + 1
    try:
        while start < length:
            stop = min(length, start + step)
            try:
                piece = func(*(cut(a, start, stop) for a in args), **{k: cut(v, start, stop) for k, v in kwargs.items()})
            except BudgetError:
                # Paging failed before the piece computed anything (a cached copy of a whole
                # argument covers its slice and stays in use beside the other, or one slice's
                # covering range is larger than its elements): halve and retry, and cut one
                # slice again along another dim.
                if step > 1:
                    step //= 2
                    continue
                if out is None:
                    raise error from None
                piece = pointwise_in_pieces(func, handler, [cut(a, start, stop) for a in args],
                                            {k: cut(v, start, stop) for k, v in kwargs.items()}, error)
            if equal and not piece:
                return False
            if out is not None:
                out.narrow(dim, start, stop - start).copy_(piece[0] if listed else piece)
            start = stop
    finally:
        _cutting.depth -= 1
    if out is not None:
        return [out] if listed else out
    if equal:
        return True
    if listed:
        return None  # in-place _foreach ops return nothing
    results = [args[i] if i < len(args) else kwargs[name] for i, name in mutation]
    return results[0] if len(results) == 1 else tuple(results)
