"""Elementwise ops on offloaded tensors larger than the budget's free room, run in slices: a
pointwise op (an optimizer's ``param.add_(grad)`` on a weight that forward tiles, ``weight * mask``),
the fills and casts that act like one, and a ``_foreach_*`` op or fused optimizer step whose list
elements do not fit together (run once per element, and an element larger than the room in slices).
Reached only when paging the whole op raised ``BudgetError`` (``torch_dispatch``'s except clause),
so ops that fit pay nothing for it."""

from __future__ import annotations

import math

import threading
import warnings

import torch
from torch.utils._mode_utils import no_dispatch

from ..pager import BudgetError, host_layout
from ..tensor import OffloadedTensor
from .overlaps import refuse_partial_overlap
from .paging import describe, write_back
from .tiling import _meta, _offloaded, _offloaded_bytes, _short_of_room


# ``_foreach_*`` ops whose element is not computed elementwise (a norm, a product of matrices):
# their one element is not cut into slices.
_NOT_ELEMENTWISE = frozenset({"aten::_foreach_norm", "aten::_foreach_max", "aten::_foreach_mm", "aten::_foreach_powsum"})


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
        if n == 1 and func.name() in _NOT_ELEMENTWISE:  # (its element whole: on the host, host_compute)
            raise BudgetError(f"offtensor: {func} cannot run within the budget: its one element needs {need} bytes of "
                              f"offloaded copies ({', '.join(describe(t) for t in _offloaded(args, kwargs))}), but "
                              f"the budget holds {pager.budget_bytes} bytes. Raise budget_gb.")
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


def _covering_bytes(t, dim: int) -> int:
    """Bytes a page of one slice of ``t`` along ``dim`` takes: the storage range it covers, which
    for a slice along an inner dim (a column of a row-major matrix, a row of a stack's matrices)
    spans nearly all of ``t``, where a slice along the outermost dim is its own elements."""
    host = t.__dict__["_host"]
    lo, hi = host_layout(host.narrow(dim, 0, 1))[:2]
    return max(hi - lo, 0) * host.element_size()


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
                per_slice += _covering_bytes(t, d)
        if free - fixed >= per_slice:
            return dim, free - fixed, per_slice
    # None fits: one slice at a time along the first dim every offloaded argument is cut along,
    # each slice cut again (pointwise_in_pieces).
    for dim in dims:
        if all(_aligned(t, dim, n, shape.shape[dim]) is not None for t in offloaded):
            return dim, 0, 1
    return None


# CPU kernels run an elementwise op as a vectorised loop over blocks of up to 64 elements (two
# AVX-512 vectors of a half-precision type) and a scalar loop over the rest, and the two can round
# otherwise (a bfloat16 ``add`` with ``alpha``: one element in a few hundred). Slices of whole blocks,
# each starting where a block of the whole tensor starts, meet the loops the whole op meets
# (single-threaded: more threads split the whole op's range where they please).
_VECTOR_BLOCK = 64
_HALF = (torch.bfloat16, torch.float16)


def _whole_blocks(shape: torch.Tensor, dim: int) -> int:
    """The fewest indices along ``dim`` whose slice of ``shape`` holds whole vector blocks."""
    inner = 1
    for size in shape.shape[dim + 1:]:
        inner *= size
    return _VECTOR_BLOCK // math.gcd(inner, _VECTOR_BLOCK)


def _warn_blocks_cut(func, t: OffloadedTensor) -> None:
    warnings.warn(f"offtensor: {func.__name__} of {describe(t)}, larger than the budget's room, runs in slices "
                  f"narrower than the CPU kernel's vector blocks: a half-precision result may differ from the "
                  f"unwrapped op's in the last bit. Raise budget_gb for bit-identical results.", stacklevel=6)


def _slice_of(v, dim: int, n: int, length: int, start: int, stop: int):
    """``v``'s part of the result's slice ``start:stop`` along ``dim`` (of ``n`` dims, ``length``
    long): a view of its aligned dim, the argument itself where it broadcasts, lists element-wise."""
    if isinstance(v, (list, tuple)):
        return [_slice_of(x, dim, n, length, start, stop) for x in v]
    d = _aligned(v, dim, n, length)
    if d is None:
        return v
    # A sparse COO argument (an embedding's sparse gradient added to its table) has no strided
    # views: its entries in the slice, in their order.
    return v.narrow_copy(d, start, stop - start) if v.layout is torch.sparse_coo else v.narrow(d, start, stop - start)


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
        _size_outs(args, kwargs, mutation, shape, error)
    n = shape.dim()
    pager = offloaded[0]._master.pager
    chosen = _cut_dim(shape, offloaded, pager.free_bytes() or 0)
    if chosen is None:
        raise error
    dim, room, per_slice = chosen
    length = shape.shape[dim]

    step = max(1, room // max(per_slice, 1))
    block = _whole_blocks(shape, dim)
    if step < min(block, length) and shape.dtype in _HALF and pager.device.type == "cpu":
        _warn_blocks_cut(func, offloaded[0])

    def cut(v, start, stop):
        return _slice_of(v, dim, n, length, start, stop)

    writes = mutation is not None or in_place
    out = None if writes or equal else torch.empty_strided(shape.shape, shape.stride(), dtype=shape.dtype, device=pager.device)
    # Each slice is written back as it is computed: an exception between two (a Ctrl-C) puts the
    # written tensors back as they were, all or nothing like one kernel (a slice cut again below: once).
    saved = _before_writing(args, kwargs, mutation, in_place) if writes and not cutting() else ()
    start = 0
    _cutting.depth = getattr(_cutting, "depth", 0) + 1
    try:
        while start < length:
            step = step - step % block if step > block else step
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
                # (a write too: nothing of this slice was written, and its sub-slices write it all)
                piece = pointwise_in_pieces(func, handler, [cut(a, start, stop) for a in args],
                                            {k: cut(v, start, stop) for k, v in kwargs.items()}, error)
            if equal and not piece:
                return False
            if out is not None:
                out.narrow(dim, start, stop - start).copy_(piece[0] if listed else piece)
            start = stop
    except BaseException:
        if saved:
            try:
                _put_back(saved)
            except BaseException:
                _put_back(saved)  # a second exception on the way in (a Ctrl-C): once more, whole
                raise
        raise
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


def _size_outs(args, kwargs, mutation, shape: torch.Tensor, error: BudgetError) -> None:
    for i, name in mutation:
        written = args[i] if i < len(args) else kwargs[name]
        if written.shape != shape.shape:
            if written.numel() or isinstance(written, OffloadedTensor):
                raise error  # an out= tensor of another shape: the op's own resize and warning
            written.resize_(shape.shape)  # an empty out= (a composite's result), sized as the op would


def _before_writing(args, kwargs, mutation, in_place: bool) -> list:
    """Check the offloaded tensors the op writes against its other arguments as torch would, then
    keep a host copy of every tensor it writes (``_saved``)."""
    if in_place:  # a _foreach_*_ op of one element
        written = [args[0][0]]
    else:
        written = [args[i] if i < len(args) else kwargs[name] for i, name in mutation]
    _refuse_partial_overlap([t for t in written if isinstance(t, OffloadedTensor)], args, kwargs)
    return _saved([t for t in written if isinstance(t, torch.Tensor)])


def _refuse_partial_overlap(written: list, args, kwargs) -> None:
    """Torch's check before a kernel writes, over the host views: an argument that covers some of
    the written tensor's bytes, but not as the same view (``w.add_(w.t())``), is refused as torch
    refuses it. Slices of the two would read elements an earlier slice wrote (``overlaps.py``)."""
    for w in written:
        for a in _offloaded(args, kwargs):
            if a is not w and a._master is w._master:
                refuse_partial_overlap(w._host, a._host)


def _saved(written: list) -> list:
    """Each tensor the op writes, with a host copy of its values before the op: an offloaded one's
    from its master, a plain one's (``ema.add_(w)``, an ``out=``) copied from the device, so that
    neither takes device memory."""
    saved = []
    for t in written:
        try:
            saved.append((t, _host_copy(t)))
        except RuntimeError as error:  # the host is out of memory: the op runs, but is not undone
            what = describe(t) if isinstance(t, OffloadedTensor) else f"a {tuple(t.shape)} {t.dtype} tensor"
            warnings.warn(f"offtensor: {what} ({t.numel() * t.element_size()} bytes) is written in slices "
                          f"without a host copy to put back ({error}): an exception between two slices, such as "
                          f"a Ctrl-C, would leave it part written.", RuntimeWarning, stacklevel=2)
    return saved


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, OffloadedTensor):
        return t.detach().to("cpu", copy=True)
    with no_dispatch():
        return t._host.clone()


def _put_back(saved: list) -> None:
    """Write each saved tensor's values back (an offloaded one's with ``write_back``: one copy each,
    cached copies dropped); idempotent, so a put-back cut short is finished by running it again."""
    for t, values in reversed(saved):
        if isinstance(t, OffloadedTensor):
            write_back(t, values, from_host=True)  # host values: no device->host copy (not counted)
        else:
            t.copy_(values)
