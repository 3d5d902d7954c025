"""Ops computed in pieces when the budget's free room is short: lists of offloaded inputs paged one at a
time (``cat``, ``stack``; ``_foreach_*`` in ``pieces``), and weights larger than the room computed in output tiles
(``linear``, ``mm``/``addmm``, ``mv``/``addmv``, ``bmm``/``baddbmm``; ``convolution`` in ``convolutions``
with the tiles cut here), ``TILE_ALIGN`` wide where the room allows."""

from __future__ import annotations

import torch

from .. import cast_views
from ..pager import BudgetError, host_layout, upload_compact
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
# model's tiles stay bit-identical (a last tile left narrower by the output's size is computed
# TILE_ALIGN wide, reaching back into the one before); narrower ones are its fallback, with a warning.

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
    if (hi - lo) <= host.numel() or type(host) is not torch.Tensor:
        # (traced by torch.compile: the graph's page gathers a strided slice at run time)
        return paged.page(cast_views.derived(t, host))
    return cast_views.cast_of(t, upload_compact(t._master.pager, host, describe(t), paged.entries))


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


def _tiled(weight, dim, others, what, compute, out_dim, sliced=(), work: int = 0, reach_back: bool = False):
    """``compute(start, stop, paged)`` for tiles of ``weight`` along ``dim``, concatenated along
    ``out_dim`` of the outputs. Each tile's pages are released before the next is paged. Where the
    room allows, tiles are cut at multiples of ``TILE_ALIGN`` and are at least that wide, and at
    least as wide as keeps the whole product's CPU kernel (``work``: the product's multiply-adds per
    slice along ``dim``, 0 where no such kernel choice applies). ``reach_back``: each output depends
    on its own slice only, so a last tile narrower than ``TILE_ALIGN`` is computed ``TILE_ALIGN``
    wide, reaching back into the tile before, and keeps its own outputs."""
    n = weight.shape[dim]
    fits = _tile_size(weight, dim, others, what, sliced)
    step = fits - fits % TILE_ALIGN if TILE_ALIGN <= fits < n else fits
    bounds = list(range(0, n, step)) + [n]
    least = _same_kernel_width(weight, work, n)
    if least and min(b - a for a, b in zip(bounds, bounds[1:])) < least:
        bounds = _even_bounds(n, len(bounds) - 1, fits, least) or bounds
    if len(bounds) > 2 and bounds[-1] - bounds[-2] < TILE_ALIGN and step % TILE_ALIGN == 0:
        # A 1- or 2-wide output makes BLAS pick a matrix-vector kernel that sums in another order,
        # so the last tile takes TILE_ALIGN more outputs from the one before, where the room allows.
        # The cut stays at a multiple of TILE_ALIGN: for one row of input (a decode step's token)
        # MKL computes the outputs in blocks of 16 from the first, and an output of a tile that
        # starts elsewhere, or of a block a tile's end splits, is summed in another order.
        # Where tiles are only TILE_ALIGN wide, that empties the tile before: the last two merge.
        cut = bounds[-2] - TILE_ALIGN
        if n - cut <= fits:
            if cut > bounds[-3]:
                bounds[-2] = cut
            else:
                del bounds[-2]
    # A product narrower than TILE_ALIGN (the 8 outputs left of 200 in tiles of 16) makes MKL pick
    # another kernel for it, which sums in another order on some CPUs (an AVX-512 EPYC's float32 mm
    # of 24 rows did): the same outputs taken from a tile TILE_ALIGN wide keep the whole op's.
    widen = reach_back and len(bounds) > 2 and TILE_ALIGN <= min(fits, n)
    outs = []
    for start, stop in zip(bounds, bounds[1:]):
        first = stop - TILE_ALIGN if widen and stop - start < TILE_ALIGN else start
        paged = Paged()
        try:
            out = compute(first, stop, paged)
            outs.append(out if first == start else out.narrow(out_dim, start - first, stop - start))
        finally:
            paged.release()
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=out_dim)


# torch's CPU matmul of bfloat16 or float16 operands runs oneDNN's GEMM only where the product has
# more than 16**3 multiply-adds (its ``checksize``), and another kernel up to that, which rounds some
# sums otherwise (one product in a few hundred, in the last bit). A tile of a product above that
# size must stay above it too, or it differs from the whole op: a 3-beam decode step's (3, 32)
# input against a (96, 32) LM head in tiles of 64 and 32 rows did.
_ONEDNN_MIN_WORK = 16 ** 3
_ONEDNN_DTYPES = (torch.bfloat16, torch.float16)


def _same_kernel_width(weight, work: int, n: int) -> int:
    """The narrowest tile (slices along the tiled dim) that runs the whole product's CPU kernel, or
    0 where tiles of any width do."""
    if not work or work * n <= _ONEDNN_MIN_WORK or weight.dtype not in _ONEDNN_DTYPES \
            or weight._master.pager.device.type != "cpu":
        return 0
    return _ONEDNN_MIN_WORK // work + 1


def _with_rows(m: torch.Tensor, rows: int) -> torch.Tensor:
    """``m`` (rows x inner) with rows of zeros appended up to ``rows``: the input of a tile the room
    leaves too small for the whole product's CPU kernel (``_same_kernel_width``) grown past its
    threshold, so the tile runs that kernel. Its rows are summed as the whole product sums them:
    each output of oneDNN's GEMM depends on its own row and column only, whatever their number (on
    a CPU with AMX, a (2, 32) bfloat16 input against 48 of a (96, 32) LM head's rows differed from
    the whole product's, and matches it padded to 3 rows)."""
    if m.shape[0] >= rows:
        return m
    return torch.cat([m, m.new_zeros(rows - m.shape[0], m.shape[1])])


def _even_bounds(n: int, tiles: int, fits: int, least: int):
    """Cuts of ``n`` slices into ``tiles`` tiles at multiples of ``TILE_ALIGN``, as even as they
    go (the last takes the odd slices), each at least ``least`` and at most ``fits`` wide; None
    where no such cuts exist."""
    units, odd = divmod(n, TILE_ALIGN)
    if units < tiles:
        return None
    per, extra = divmod(units, tiles)
    widths = [(per + (i < extra)) * TILE_ALIGN for i in range(tiles)]
    widths[-1] += odd
    if min(widths) < least or max(widths) > fits:
        return None
    bounds = [0]
    for width in widths:
        bounds.append(bounds[-1] + width)
    return bounds


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

    rows = x.numel() // max(x.shape[-1], 1) if x.dim() else 1
    work = rows * x.shape[-1] if x.dim() else 0
    least = _same_kernel_width(weight, work, weight.shape[0])

    def compute(start, stop, paged):
        w = as_linear_weight(x, weight, _page_slice(weight, 0, start, stop, paged))
        b = None if bias is None else _page_slice(bias, 0, start, stop, paged)
        if stop - start < least:  # (a tile the room leaves below the whole product's kernel)
            flat = paged.arg(x).reshape(rows, x.shape[-1])
            out = torch._C._nn.linear(_with_rows(flat, _ONEDNN_MIN_WORK // (x.shape[-1] * (stop - start)) + 1), w, b)
            return out[:rows].reshape(*x.shape[:-1], stop - start)
        return torch._C._nn.linear(paged.arg(x), w, b)

    return _tiled(weight, 0, others, "linear", compute, -1, [(bias, 0)], work=work, reach_back=True)


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

    # (multiply-adds per slice: a's rows times the inner size for a column of b; the inner size
    # times b's columns for a row of a)
    work = 0 if inner is not None else (
        a.shape[lead] * a.shape[lead + 1] if columns else a.shape[lead + 1] * b.shape[lead + 1])
    # A column tile of mm / addmm too small for the whole product's CPU kernel runs it on a's rows
    # grown with zeros (``_with_rows``), where the bias, if any, does not have those rows.
    least = _same_kernel_width(big, work, size) if columns and not lead and (
        not isinstance(bias, torch.Tensor) or bias.dim() <= 1) else 0

    def compute(start, stop, paged):
        part = _page_slice(big, dim, start, stop, paged)
        left, right = (paged.arg(a) if inner is None else a, part) if columns else (part, paged.arg(b))
        rest = (_bias_slice(bias, dim, start, stop, size, paged, lead), *before[1:]) if before else ()
        if inner is not None:
            return _rows_tiled(func, left, right, rest, kwargs, lead)
        if stop - start < least:
            rows = _ONEDNN_MIN_WORK // (a.shape[1] * (stop - start)) + 1
            return func(*rest[:1], _with_rows(left, rows), right, *rest[1:], **kwargs)[: a.shape[0]]
        return func(*rest[:1], left, right, *rest[1:], **kwargs)

    return _tiled(big, dim, others, str(func), compute, dim, [] if bias_dim is None else [(bias, bias_dim)],
                  work=work, reach_back=True)


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

    return _tiled(a, lead, 0, str(func), compute, lead, reach_back=True)


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

    return _tiled(big, 0, 0, str(func), compute, 0, [(t, 0) for t in (a, b, bias if cut else None) if t is not big],
                  work=a.shape[1] * a.shape[2] * b.shape[2])


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

    return _tiled(a, 0, others, str(func), compute, 0, [(bias, 0)] if cut else [], reach_back=True)


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
