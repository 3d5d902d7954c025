"""Ops over the whole of an offloaded tensor larger than the budget's free room, computed from its
host master: ``argmax()`` / ``argmin()`` / ``aminmax()`` / ``median()`` / ``var()`` / ``std()`` /
``prod()`` / ``count_nonzero()`` over every dim; ``sort``, ``topk``, ``cumsum``... of a flattened
weight; and ops whose result depends on every element at once (``unique``, ``histc``,
``histogram``, ``nonzero``, ``masked_select``, ``dot``, indexing that reads more than the room).

Such an op has no dim to cut across (``lines.py``) and no partial results that add up to the whole
op's bit for bit (``whole_reads.py`` sums in slices, and warns). But the host master holds the
tensor's values (every write reaches it before the op that wrote returns), and the op has a CPU
kernel: it runs there on the master's own bytes, with its other tensor arguments brought to the
host, and its results go to the device. No weight byte is copied to the device, so the op needs no
room; the device holds its results, as it would for the unwrapped tensor.

On the emulated device (``cpu``) that is the op's own kernel over the same bytes: bit for bit. On a
GPU it is the CPU's kernel, not the device's: ops that select or count (``argmax``, ``median()``,
``unique``, ``nonzero``, a stable sort...) give the device's result; ops that compute may round in
another order, and ops that pick among equal elements (``topk``, ``mode``, an unstable sort's
indices) may pick another. Those warn there, naming the tensor.

An in-place op that writes such a tensor by index, mask or position (``index_copy_``,
``masked_scatter_``, ``tril_``, ``cumsum_``) has no slices either: its out-of-place form runs on the
host and the result is written back into the master in one copy (``paging.write_back``, as every
write of a paged copy is), so an interrupt leaves the tensor as it was or as written. The ``out=``
forms of the ops above (``torch.cumsum(w, 0, out=o)``) run there as themselves, into host tensors
of their out= arguments' shapes, so torch's resize rules hold; an offloaded out= is written back so.

The cost is the host's CPU time over the tensor's bytes (a second or so for gigabytes, where paging
slices would take PCIe time). Such ops are rare on weights (a statistic logged, a histogram drawn),
and what they replace is a ``BudgetError``. That cost is not hidden: each op is counted in its
pager's stats (``host_ops``, the master bytes read, the bytes written back, the result bytes, the
measured seconds) and, while a timeline records, recorded on its host lane at its measured time.
Like the slices, this runs only after the op's own page raised ``BudgetError`` (``torch_dispatch``'s
except clause): an op whose arguments fit pays nothing. Beyond the ops named here (``ON_HOST``),
any op that reads its arguments and computes a new result comes here as a last resort, where no
slice or tile of it fits (``grid_sample``, a pooling, a convolution of a model's own tensor as its
input): a budget wrap accepted runs. So does one that also writes some of its arguments (a training
batch norm's offloaded running statistics), each written back in one copy, and any op whose only
writes are its out= arguments (``torch.mm(x, w.T, out=logits)``). Ops that draw random numbers do
not (the host's generator is not the device's), and an op with no CPU kernel keeps the room's error.
Under torch.compile the values are not known at trace time: Dynamo breaks the graph there and runs
the op eagerly (``compile.graph_break``)."""

from __future__ import annotations

import time
import warnings

import torch
from torch.utils import _pytree as pytree

from ..tensor import OffloadedTensor
from .arguments import raise_torch_error
from .compile import graph_break
from .lines import ALONG_LINES
from .overlaps import disjoint, refuse_partial_overlap
from .paging import describe, resize_error, write_back
from .views import fits_master
from .writes import written_arguments

aten = torch.ops.aten


def on_host(func, args, kwargs, error):
    """``func`` on the host masters of its offloaded arguments, its results on the device; ``error``
    where it cannot run there (a graph break where it is being traced)."""
    call = _host_call(func, args, kwargs, error)
    out = call.results()
    call.counted(func, 0, _nbytes(out))
    return out


def written_on_host(func, args, kwargs, error):
    """An in-place op on an offloaded tensor larger than the room (``w.index_copy_``, ``w.tril_``):
    its out-of-place form on the host masters, written back into the tensor's master as any write
    of a paged copy is (``paging.write_back``: one copy, every alias sees it, cached copies
    dropped). Returns the tensor itself, as the in-place op does."""
    t = args[0]
    if not isinstance(t, OffloadedTensor):
        raise error
    for a in pytree.tree_leaves((args[1:], kwargs)):
        if isinstance(a, OffloadedTensor) and a._master is t._master:
            # Another view of the written master: read before the write, which only disjoint
            # bytes allow (``w[:48].index_copy_(0, i, w[48:50])``). One that overlaps part of it is
            # refused as torch refuses it; the same bytes are left to the kernel's own order.
            refuse_partial_overlap(t._host, a._host)
            if not disjoint(t._host, a._host):
                raise error
    call = _host_call(functional_form(func), args, kwargs, error)
    call.write_back(t, call.out)
    call.counted(func, _nbytes(t), 0)
    return t


def out_on_host(func, args, kwargs, error):
    """An ``out=`` op that host computation runs (``torch.cumsum(w, 0, out=o)``,
    ``torch.index_select(t, 0, i, out=o)``) whose arguments do not fit the room: the op itself on
    the host, into host tensors of its out= arguments' shapes and strides, so torch's own resize
    rules apply (its warning or error for an out= of the wrong shape); then each offloaded out= is
    written back in one copy (``paging.write_back``: an interrupt leaves it as it was or as written;
    never resized past its host master, checked for every one before any is written), and each
    other one receives its values as torch's kernel would give them."""
    functional, names = out_form(func)
    outs = [kwargs[name] for name in names]
    inputs = pytree.tree_leaves((args, {k: v for k, v in kwargs.items() if k not in names}))
    # (Loops, not generators: an interrupt inside one would close it, reported as "ignored".)
    offloaded = [o for o in outs if isinstance(o, OffloadedTensor)]
    written = {id(o._master) for o in offloaded}
    read = [a for a in inputs if isinstance(a, OffloadedTensor)]
    if len(written) < len(offloaded) or [a for a in read if id(a._master) in written]:
        raise error  # (an out= sharing a master with another argument: torch's rules for overlap apply)
    if not read and not offloaded:
        raise error
    first = read[0] if read else offloaded[0]
    device_type = first._master.pager.device.type
    temps = [_host_out(o, device_type) for o in outs]
    call = _host_call(func, args, {**kwargs, **dict(zip(names, temps))}, error, first, functional,
                      host_made={id(temp) for temp in temps})
    pairs = list(zip(outs, temps))
    for o, temp in pairs:
        if isinstance(o, OffloadedTensor) and temp.shape != o.shape and not fits_master(o, temp.shape):
            raise resize_error(o, temp.shape)  # before any out= is written: none is left half done
    written = result = 0
    for o, temp in pairs:
        if isinstance(o, OffloadedTensor):
            call.write_back(o, temp)
            written += _nbytes(o)
            continue
        if temp is not o:  # a device tensor: the host's values, as the device's kernel would resize and write
            if o.shape != temp.shape:
                o.resize_(temp.shape)
            o.copy_(temp)
        result += _nbytes(o)
    call.counted(func, written, result)
    return outs[0] if len(outs) == 1 else tuple(outs)


def mutated_on_host(func, args, kwargs, error):
    """An op that writes some of its arguments and returns new tensors (a training batch norm's
    running statistics: ``_native_batch_norm_legit``, ``_batch_norm_with_update``) whose arguments
    do not fit the room: the op on the host masters, each written argument given as a host copy of
    its own, then each offloaded one written back in one copy (an interrupt leaves each as it was or
    as written) and each other one given its values; its results go to the device."""
    positions = written_arguments(func._schema)
    written = [(i, name, args[i] if i < len(args) else kwargs.get(name)) for i, name in positions.items()]
    written = [(i, name, t) for i, name, t in written if t is not None]
    masters = [id(t._master) for _, _, t in written if isinstance(t, OffloadedTensor)]
    read = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, OffloadedTensor)]
    if len(set(masters)) < len(masters) or sum(id(a._master) in masters for a in read) > len(masters):
        raise error  # (a written argument sharing a master with another: the kernel's own order would decide)
    first = read[0]
    device_type = first._master.pager.device.type
    args, kwargs, temps = list(args), dict(kwargs), []
    for i, name, t in written:
        if isinstance(t, OffloadedTensor):
            if type(t.__dict__["_host"]) is not torch.Tensor or "_cast" in t.__dict__:
                raise error  # (a torch.compile stand-in, or a lazy cast: neither holds the values written)
            temp = t._host.clone()
        else:
            temp = _host_out(t, device_type)
            if temp is not t:
                temp.copy_(t)
        temps.append(temp)
        if i < len(args):
            args[i] = temp
        else:
            kwargs[name] = temp
    own = {id(temp) for (_, _, t), temp in zip(written, temps) if isinstance(t, OffloadedTensor)}
    call = _host_call(func, tuple(args), kwargs, error, first, host_made=own)
    out = call.results()
    nbytes = 0
    for (_, _, t), temp in zip(written, temps):
        if isinstance(t, OffloadedTensor):
            call.write_back(t, temp)
            nbytes += _nbytes(t)
        elif temp is not t:
            t.copy_(temp)
    call.counted(func, nbytes, _nbytes(out))
    return out


def _host_out(o: torch.Tensor, device_type: str) -> torch.Tensor:
    """The host tensor an out= argument ``o`` is computed into: ``o`` itself where it is a plain
    tensor of the host (the emulated device's), else a new one of its shape, strides and dtype."""
    if not isinstance(o, OffloadedTensor) and o.device.type == "cpu" and device_type == "cpu":
        return o
    return torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device="cpu")


def _nbytes(out) -> int:
    total = 0
    for t in pytree.tree_leaves(out):
        if isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
    return total


class _HostCall:
    """One op computed on the host: its result, its first offloaded argument, the masters' storages,
    the bytes of the masters it read, the host's seconds for it (its kernel, its write-backs) and
    whether it read tensors of the device's (brought to the host: a wait for the device's ops)."""

    __slots__ = ("out", "first", "masters", "read", "seconds", "synced")

    def __init__(self, out, first, masters, read, seconds, synced):
        self.out, self.first, self.masters, self.read, self.seconds = out, first, masters, read, seconds
        self.synced = synced

    def results(self):
        """The op's results on the device: on the emulated device the host's own, apart from
        every master's memory; on a GPU, copied there."""
        device = self.first._master.pager.device
        if device.type == "cpu":
            return pytree.tree_map_only(torch.Tensor, lambda t: _apart(t, self.masters), self.out)
        return pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), self.out)

    def write_back(self, t: OffloadedTensor, values: torch.Tensor) -> None:
        start = time.perf_counter()
        write_back(t, values, from_host=True)
        self.seconds += time.perf_counter() - start

    def counted(self, func, written: int, result: int) -> None:
        """Counted in the pager's stats (``host_ops``...) and, while a timeline records, recorded
        on its host lane at the time measured here (none on meta, where a plan computes nothing)."""
        pager = self.first._master.pager
        with pager.lock:  # (as every counter of the pager changes)
            pager.stats.count_host_op(self.read, written, result, self.seconds)
        recorder = pager.recorder
        if recorder is not None:
            measured = None if pager.device.type == "meta" else self.seconds * 1e3
            recorder.host_op(f"host {func.overloadpacket.__name__}", self.read + written, self.first.dtype, measured,
                             result, self.synced)


def _host_call(func, args, kwargs, error, first=None, exact=None, host_made=()) -> _HostCall:
    """``func`` run on the host: its offloaded arguments' host masters, its other tensors brought
    to the host; ``first``: the offloaded tensor whose pager runs it where no argument is offloaded
    (an out= one, set apart by the caller); ``exact``: the op whose exactness on a GPU it has
    (``func``'s out-of-place form); ``host_made``: the ids of tensors the caller gave it that are
    not the device's to wait for (out= buffers, copies of offloaded values it writes)."""
    flat, spec = pytree.tree_flatten((args, kwargs))
    masters, read, synced = set(), 0, False
    for i, a in enumerate(flat):
        if isinstance(a, OffloadedTensor):
            own = a.__dict__
            host = own["_host"]
            if type(host) is not torch.Tensor:  # a torch.compile stand-in: no values until the graph runs,
                graph_break(f"{func} of {describe(a)}, larger than the room, computed on the host")  # so eagerly
            cast = own.get("_cast")  # a lazy cast (cast_views) reads its weight's bytes in the cast's dtype
            flat[i] = host.to(cast.dtype) if cast is not None else host
            masters.add(host.untyped_storage().data_ptr())
            read += host.numel() * host.element_size()
            first = a if first is None else first
        elif isinstance(a, torch.Tensor) and id(a) not in host_made:
            synced = True  # (the emulated device's tensors are the host's: recorded as a GPU's would be)
            if a.device.type != "cpu":
                flat[i] = a.cpu()
    if first is None:
        raise error
    pager = first._master.pager
    if pager.capturing():
        raise error  # a CUDA graph replays device work only: a host kernel would not rerun
    if pager.device.type != "cpu" and torch.Tag.nondeterministic_seeded in func.tags:
        raise error  # (``multinomial``) the host's generator is not the device's: another draw than the device's
    host_args, host_kwargs = pytree.tree_unflatten(flat, spec)
    start = time.perf_counter()
    if pager.device.type == "cpu":  # the emulated device: the host's kernel is the device's, errors and all
        out = func(*host_args, **host_kwargs)
        return _HostCall(out, first, masters, read, time.perf_counter() - start, synced)
    try:
        out = func(*host_args, **host_kwargs)
    except (RuntimeError, NotImplementedError) as host_error:
        raise_torch_error(func, args, kwargs, pager.device)  # wrong arguments: torch's own error, as the device gives it
        raise error from host_error  # no CPU kernel for it (a dtype only the GPU computes): the room's error stands
    seconds = time.perf_counter() - start
    if not _exact_anywhere(exact or func, args, kwargs):
        warnings.warn(
            f"offtensor: {func.__name__} of {describe(first)}, larger than the budget's room, is computed on the host "
            f"from its master: the CPU's kernel may round in another order than the device's, or pick another of "
            f"equal elements. Raise budget_gb for bit-identical results.", stacklevel=6)
    return _HostCall(out, first, masters, read, seconds, synced)


def _exact_anywhere(func, args, kwargs) -> bool:
    if func is aten.sort.stable:
        return bool(kwargs.get("stable"))  # (keyword-only) equal elements keep their order on every device
    if func is aten._unique2.default:
        # A GPU sorts the unique elements whatever ``sorted`` says; the CPU keeps them unsorted if asked.
        return bool(kwargs.get("sorted", args[1] if len(args) > 1 else True))
    return func in _EXACT_ANYWHERE


def _apart(t: torch.Tensor, masters: set) -> torch.Tensor:
    """A result never shares a master's memory: a write to it would change the weight unseen. (A
    sparse result, ``to_sparse``'s, has no storage of its own to share: its values were copied.)"""
    if t.layout is not torch.strided:
        return t
    return t.clone() if t.untyped_storage().data_ptr() in masters else t


# Ops that read their arguments only, with a CPU kernel. Those along a dim (ALONG_LINES) come here
# where no slice across their dim fits: over the whole tensor, or one line larger than the room.
_OPS = (
    *ALONG_LINES,
    aten.median.default, aten.nanmedian.default, aten.prod.default, aten.count_nonzero.default,
    aten.histc.default, aten.histogram.bin_ct, aten.histogram.bins_tensor,
    aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
    aten.nonzero.default, aten.masked_select.default, aten.take.default,
    aten.gather.default, aten.index.Tensor, aten.index_select.default, aten.embedding.default,
    aten.dot.default, aten.vdot.default, aten.bincount.default,
    aten.searchsorted.Tensor, aten.bucketize.Tensor, aten.isin.Tensor_Tensor, aten.isin.Tensor_Scalar,
    aten.isin.Scalar_Tensor, aten.equal.default,
    # Out-of-place copies and updates of a whole tensor (a ``torch.cat`` of a weight's slices, as
    # ``prod``'s backward makes; peft's ``index_copy`` of a trainable token's rows into the table):
    # their result is the size of the tensor, so the device receives what a page would have carried.
    aten.cat.default, aten.flip.default, aten.roll.default, aten.repeat.default, aten.tril.default,
    aten.triu.default, aten.constant_pad_nd.default, aten.narrow_copy.default, aten.index_copy.default,
    aten.index_put.default, aten.index_add.default, aten.scatter.src, aten.scatter.value,
    aten.scatter_add.default, aten.scatter_reduce.two, aten.masked_scatter.default,
)
# Linear algebra, FFTs and the rest whose result every element of the tensor feeds (a weight's
# singular values, its spectral norm, ``torch.trace``), and products whose tiles cannot be cut any
# narrower (a ``cdist`` row, a bilinear's one output feature) or whose backward reads the weight
# whole (``cdist``'s); named so that an op a torch version lacks is left out.
_NAMED = (
    "sum.default", "sum.dim_IntList", "mean.default", "mean.dim", "linalg_vector_norm.default", "norm.Scalar",
    "nansum.default",
    "_cdist_forward.default", "_cdist_backward.default", "_trilinear.default", "addbmm.default",
    "trace.default", "renorm.default", "frexp.Tensor", "addr.default", "linalg_cross.default", "as_strided_copy.default",
    "multinomial.default", "_pdist_forward.default", "_linalg_svd.default", "linalg_qr.default",
    "_linalg_eigh.default", "linalg_eig.default", "_linalg_eigvals.default", "_linalg_det.default",
    "_linalg_slogdet.default", "linalg_inv_ex.default", "linalg_cholesky_ex.default", "cholesky.default",
    "linalg_lu_factor_ex.default", "linalg_lu.default", "lu_unpack.default", "linalg_householder_product.default",
    "_linalg_solve_ex.default", "linalg_solve_triangular.default", "triangular_solve.default",
    "linalg_ldl_factor_ex.default", "linalg_ldl_solve.default", "geqrf.default", "ormqr.default",
    "cholesky_solve.default", "cholesky_inverse.default", "linalg_matrix_exp.default",
    "_fft_r2c.default", "_fft_c2c.default", "_fft_c2r.default", "_histogramdd_bin_edges.default",
    "_histogramdd_from_bin_cts.default", "_histogramdd_from_bin_tensors.default",
    "_foreach_norm.Scalar", "_foreach_max.default", "_foreach_mm.default", "_foreach_powsum.Scalar",
    # A weight quantised whole (``quantize_dynamic``'s ``quantize_per_tensor`` of each Linear's weight):
    # its result is a quantised tensor, which slices of the weight cannot be put together into.
    "quantize_per_tensor.default", "quantize_per_channel.default",
)


def _named(name: str):
    packet, _, overload = name.partition(".")
    return getattr(getattr(aten, packet, None), overload, None)


ON_HOST = frozenset(_OPS) | frozenset(op for op in map(_named, _NAMED) if op is not None)

# In-place ops whose out-of-place form runs on the host (``written_on_host``): the index and mask
# writes a model makes into a weight (``index_copy_``, ``index_put_``, ``masked_scatter_``,
# ``scatter_``), and in-place forms of ops above (``tril_``, ``cumsum_``, ``renorm_``).
_IN_PLACE = (
    "index_copy_.default", "index_put_.default", "index_add_.default", "index_fill_.int_Scalar",
    "index_fill_.int_Tensor", "masked_scatter_.default", "scatter_.src", "scatter_.value", "scatter_.reduce",
    "scatter_.value_reduce", "scatter_add_.default", "scatter_reduce_.two", "put_.default", "tril_.default",
    "triu_.default", "cumsum_.default", "cumprod_.default", "renorm_.default", "addr_.default",
)
_FUNCTIONAL = {}
for _name in _IN_PLACE:
    _op, _functional = _named(_name), _named(_name.replace("_.", ".", 1))
    if _op is not None and _functional is not None:
        _FUNCTIONAL[_op] = _functional


def functional_form(func):
    """The out-of-place form ``written_on_host`` runs for the in-place ``func``: the table's above,
    or, for any other in-place op that writes its first argument alone (``addmv_``, ``baddbmm_``),
    torch's op of the same name without the underscore and the same arguments. None where there is
    none, or where the op draws random numbers (the host's generator is not the device's)."""
    form = _FUNCTIONAL.get(func, _UNKNOWN)
    if form is _UNKNOWN:
        form = _FUNCTIONAL[func] = _form_by_name(func)
    return form


_UNKNOWN = object()


def _form_by_name(func):
    name, schema = func.overloadpacket.__name__, func._schema
    if not name.endswith("_") or name.startswith(("_foreach", "_fused")) or list(written_arguments(schema)) != [0] \
            or torch.Tag.nondeterministic_seeded in func.tags:
        return None
    form = getattr(getattr(aten, name[:-1], None), func._overloadname, None)
    if form is None or len(form._schema.returns) != 1 or _signature(form._schema.arguments) != _signature(schema.arguments):
        return None
    return form


def _signature(arguments) -> list:
    """Arguments' names and types, without their alias annotations: an op's and another form's compare."""
    return [(a.name, str(a.type)) for a in arguments]


# Those whose result on a GPU is the CPU's, bit for bit: they select, count or compare, and where
# elements are equal torch defines which one they give (the first maximum, the lower median).
_EXACT_ANYWHERE = frozenset({
    aten.argmax.default, aten.argmin.default, aten.aminmax.default, aten.count_nonzero.default,
    aten.count_nonzero.dim_IntList, aten.median.default, aten.nanmedian.default, aten.cummax.default,
    aten.cummin.default, aten._unique2.default, aten.unique_dim.default,
    aten.unique_consecutive.default, aten.nonzero.default, aten.masked_select.default, aten.take.default,
    aten.gather.default, aten.index.Tensor, aten.index_select.default, aten.embedding.default,
    aten.searchsorted.Tensor, aten.bucketize.Tensor, aten.isin.Tensor_Tensor, aten.isin.Tensor_Scalar,
    aten.isin.Scalar_Tensor, aten.equal.default, aten.cat.default, aten.flip.default, aten.roll.default,
    aten.repeat.default, aten.tril.default, aten.triu.default, aten.constant_pad_nd.default, aten.narrow_copy.default,
    # (where an index repeats, which write lands is undefined on every device)
    aten.index_copy.default, aten.scatter.src, aten.scatter.value, aten.masked_scatter.default,
    aten.index_fill.int_Scalar, aten.index_fill.int_Tensor,
})


def _out_forms() -> dict:
    """out= overload -> (its out-of-place form among ``ON_HOST``, the names of its out= arguments):
    the overloads of each op's packet whose other arguments are the form's own (``cumsum.out`` of
    ``cumsum.default``, ``sort.values_stable`` of ``sort.stable``), with Tensor out= arguments."""
    forms = {}
    for op in ON_HOST:
        own = _signature(op._schema.arguments)
        for name in op.overloadpacket.overloads():
            overload = getattr(op.overloadpacket, name)
            arguments = overload._schema.arguments
            outs = [a for a in arguments if a.is_out]
            if outs and all(str(a.type) == "Tensor" for a in outs) \
                    and _signature(a for a in arguments if not a.is_out) == own:
                forms[overload] = (op, tuple(a.name for a in outs))
    return forms


_OUT_FORMS = _out_forms()


def out_form(func):
    """``(the out-of-place form, the names of the out= arguments)`` of an out= overload that
    ``out_on_host`` runs: the table's for the ops named here; for any other op whose only written
    arguments are Tensor out= ones and that draws no random numbers (``mm.out``, as
    ``linear_cross_entropy``'s backward calls it), the overload of its packet with its other
    arguments, or itself where there is none. None for any other op."""
    form = _OUT_FORMS.get(func, _UNKNOWN)
    if form is _UNKNOWN:
        form = _OUT_FORMS[func] = _out_form_by_schema(func)
    return form


def _out_form_by_schema(func):
    schema = func._schema
    outs = [i for i, a in enumerate(schema.arguments) if a.is_out]
    if not outs or sorted(written_arguments(schema)) != outs or torch.Tag.nondeterministic_seeded in func.tags \
            or any(str(schema.arguments[i].type) != "Tensor" for i in outs):
        return None
    names = tuple(schema.arguments[i].name for i in outs)
    own = _signature(a for a in schema.arguments if not a.is_out)
    for name in func.overloadpacket.overloads():
        overload = getattr(func.overloadpacket, name)
        if not any(a.is_out for a in overload._schema.arguments) and _signature(overload._schema.arguments) == own:
            return overload, names
    return func, names
