"""What each aten op does to an OffloadedTensor: the op table and its one fallback.

Every op lands in one of five handlers, chosen once per OpOverload from its schema unless the
table below names it explicitly:

- view ops (an output aliases an input): run on the host view, return OffloadedTensor aliases;
- in-place view ops (``t_``, ``squeeze_``...): change host and wrapper metadata;
- ops that write an OffloadedTensor (in-place, ``out=``): run on private device copies, write
  every mutated argument back to its host master, invalidate its cached copies;
- index ops on dim 0 (``embedding``, ``index_select``, ``index.Tensor``): page only the rows or
  experts selected;
- everything else: page what each argument covers, run the op on plain device tensors, return
  plain results.

``F.linear`` is intercepted at the ``__torch_function__`` level, because it otherwise arrives as
``t`` + ``addmm``: two Python dispatches for one page-in; so are ``matmul`` / ``mm`` with grad off
where that pages the same bytes (one Python pass instead of matmul's composite dispatching back).
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import torch
import torch.nn.functional as F
from torch.utils._mode_utils import no_dispatch

from . import compile as _compile
from .pager import BudgetError, host_layout, page_layout, pins_host_memory, upload_small
from .tensor import TRACED_ALIVE, OffloadedTensor, check_offloadable, new_host_master, new_view, wrap_host

aten = torch.ops.aten
_functionalize_unsafe_set = torch._functionalize_unsafe_set

# Rows (or experts) at least this large are paged one by one through the cache, so an expert used
# by consecutive tokens is copied once; smaller rows are gathered on the host and sent together.
CACHED_SLICE_BYTES = 1 << 20

_OP_TABLE: dict = {}


def implements(*ops):
    """Register a handler ``(func, types, args, kwargs)`` for OpOverloads; duplicates raise."""

    def register(handler):
        for op in ops:
            if not isinstance(op, torch._ops.OpOverload):
                raise TypeError(f"register OpOverloads such as aten.x.default, not {op!r}")
            if op in _OP_TABLE:
                raise RuntimeError(f"offtensor: {op} already has a handler ({_OP_TABLE[op].__name__})")
            _OP_TABLE[op] = handler
        return handler

    return register


def torch_dispatch(func, types, args, kwargs):
    handler = _OP_TABLE.get(func)
    if handler is None:
        handler = _OP_TABLE[func] = _in_pieces_when_short(func, _classify(func))
    if (handler in _UNTRACEABLE or type(handler) is _Mutation) and _traced(args, kwargs):
        # Under torch.compile: row-selective paging becomes one opaque op that pages at run time;
        # writes to a host master (and index ops it cannot express) run eagerly (compile.py).
        traced = _compile.traced_index_op(func, args, kwargs or {})
        if traced is not None:
            return traced
        _compile.graph_break(f"{func} on an OffloadedTensor")
    if handler in _COMPUTE_HANDLERS and TRACED_ALIVE[0] and _tracing() and _traced(args, kwargs):
        traced = _compile.traced_compute(func, args, kwargs)
        if traced is not None:
            return traced
    return handler(func, types, args, kwargs or {})


_get_dispatch_mode = torch._C._get_dispatch_mode
_FAKE_MODE = torch._C._TorchDispatchModeKey.FAKE


def _tracing() -> bool:
    """Whether a trace is running now: torch.compile, export and make_fx run ops on fake tensors
    under a FakeTensorMode. Asked only while traced OffloadedTensors are alive (a compiled model's
    guards keep its traced weights), so eager ops in a process that once compiled do not scan their
    arguments for traced ones."""
    return _get_dispatch_mode(_FAKE_MODE) is not None


def _traced(args, kwargs) -> bool:
    """Whether an OffloadedTensor argument is a tracing stand-in (torch.compile's fake tensors)."""
    for a in (*args, *(kwargs or {}).values()):
        if isinstance(a, OffloadedTensor):
            if _compile.is_traced(a._host):
                return True
        elif isinstance(a, (list, tuple)):
            if any(isinstance(x, OffloadedTensor) and _compile.is_traced(x._host) for x in a):
                return True
    return False


# ---------------------------------------------------------------------------- paging helpers


class _Paged:
    """Replaces OffloadedTensor arguments of one op by device tensors and releases their pages
    once the op is enqueued."""

    __slots__ = ("entries", "private")

    def __init__(self):
        self.entries = []  # (pager, entry)
        self.private = []  # (OffloadedTensor, its private device copy), for arguments the op writes

    def page(self, t: OffloadedTensor, private: bool = False) -> torch.Tensor:
        # Every compute op runs this once per offloaded argument: one __dict__ read instead of
        # three attribute lookups through torch.Tensor's type.
        own = t.__dict__
        host, master = own["_host"], own["_master"]
        pager = master.pager
        if type(host) is not torch.Tensor:  # compile.is_traced, inlined
            # Being traced by torch.compile: the graph calls the pager at run time through an
            # opaque op (compile.py) and owns its result, so there is no entry to release.
            return _compile.page(host, master.id, pager.device)
        layout = own.get("_layout")
        if layout is None:
            layout = own["_layout"] = page_layout(host, master.id)
        view, entry = pager.page(host, master, t, private, layout)  # t's repr names it in a BudgetError
        if entry is not None:
            self.entries.append((pager, entry))
        if private:
            self.private.append((t, view))
        return view

    def arg(self, a, written: bool = False):
        if isinstance(a, OffloadedTensor):
            return self.page(a, written)
        if isinstance(a, (list, tuple)) and any(isinstance(x, OffloadedTensor) for x in a):
            return type(a)(self.page(x, written) if isinstance(x, OffloadedTensor) else x for x in a)
        return a

    def release(self) -> None:
        entries, self.entries = self.entries, []
        if not entries:
            return
        if len(entries) == 1:  # most ops page one weight
            pager, entry = entries[0]
            pager.release((entry,))
            return
        first = entries[0][0]
        if all(pager is first for pager, _ in entries):
            first.release([entry for _, entry in entries])
            return
        by_pager = {}
        for pager, entry in entries:
            by_pager.setdefault(pager, []).append(entry)
        for pager, group in by_pager.items():
            pager.release(group)


def _describe(t: OffloadedTensor) -> str:
    name = t._master.name
    return f"an OffloadedTensor{'' if name is None else ' of ' + repr(name)} of shape {tuple(t.shape)} and dtype {t.dtype}"


def _run(func, args, kwargs, written=()):
    """Page every OffloadedTensor argument (privately where ``written``), run ``func`` on plain
    tensors, write mutated arguments back to their host masters."""
    paged = _Paged()
    try:
        if written:
            new_args = [paged.arg(a, i in written) for i, a in enumerate(args)]
            new_kwargs = {k: paged.arg(v, k in written) for k, v in kwargs.items()} if kwargs else kwargs
        else:  # the common case, without the per-argument membership tests
            arg = paged.arg
            new_args = [arg(a) for a in args]
            new_kwargs = {k: arg(v) for k, v in kwargs.items()} if kwargs else kwargs
        out = func(*new_args, **new_kwargs)
        for t, device_copy in paged.private:
            _write_back(t, device_copy)
    finally:
        paged.release()
    return out


def _write_back(t: OffloadedTensor, values: torch.Tensor) -> None:
    """Write ``values`` into ``t``'s bytes of its host master; every alias sees them and every
    cached device copy of the master is dropped."""
    if values.shape != t.shape and not _resize_within_master(t, values.shape):
        # An out= op resized its output beyond what the fixed-size host master holds.
        raise RuntimeError(
            f"offtensor: an op would resize {_describe(t)} to {tuple(values.shape)}: its host master is exactly "
            f"{t.host_nbytes} bytes. Pass an out= tensor of the result's shape, or assign a new tensor instead."
        )
    pager = t._master.pager
    with pager.lock:  # no other thread's op pages the master between the wait and the write
        pager.before_write(t._master)
        with no_dispatch():
            t._host.copy_(values)
        pager.count_write_back(t._host.numel() * t._host.element_size())


# ---------------------------------------------------------------------------- handlers by kind


def _view(func, types, args, kwargs):
    self = args[0]
    out = func(self._host, *args[1:], **kwargs)
    master = self._master
    if isinstance(out, torch.Tensor):
        return _alias_of(self, new_view(out, master))
    return type(out)(_alias_of(self, new_view(o, master)) for o in out)


def _alias_of(base: OffloadedTensor, view: OffloadedTensor) -> OffloadedTensor:
    # Give the view the base's wrapper storage too (what return_and_correct_aliasing does): C++
    # composites test aliasing with is_alias_of, e.g. matmul's out= path writes through
    # out.view(...) and copies back only when the view is not an alias of out.
    # _functionalize_unsafe_set is no dispatcher op (return_and_correct_aliasing calls it as is), so
    # no no_dispatch() guard: that would cost 0.5 µs per view op.
    _functionalize_unsafe_set(view, base)
    return view


def _inplace_view(func, types, args, kwargs):
    self = args[0]
    func(self._host, *args[1:], **kwargs)
    self.__dict__.pop("_layout", None)  # the memoized paging layout of the old metadata
    # Change the wrapper's own sizes/strides without dispatching back here (the trick that
    # torch.utils._python_dispatch.return_and_correct_aliasing uses).
    with no_dispatch():
        meta_in_tls = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            func(*args, **kwargs)
        finally:
            torch._C._set_meta_in_tls_dispatch_include(meta_in_tls)
    return self


def _resize_within_master(t: OffloadedTensor, size, memory_format=torch.contiguous_format) -> bool:
    """What ``resize_`` does to a tensor whose storage is large enough (``mm_out`` resizing a 1-D
    out= to (1, n) and squeezing it back, say): give ``t`` the layout of ``size`` in place at its
    storage offset. False when that needs bytes past the end of its host master, which never grows."""
    host = t._host
    layout = torch.empty(tuple(size), dtype=host.dtype, device="meta", memory_format=memory_format)
    offset = host.storage_offset()
    if (offset + layout.numel()) * host.element_size() > host.untyped_storage().nbytes():
        return False
    _inplace_view(aten.as_strided_.default, (), (t, layout.shape, layout.stride(), offset), {})
    return True


def _compute(func, types, args, kwargs):
    return _run(func, args, kwargs)


class _Mutation:
    """Handler for an op that writes some of its arguments (in-place and out= ops)."""

    def __init__(self, func):
        schema = func._schema
        self.positions = {}
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                self.positions[i] = arg.name
        # Which argument each return aliases (in-place ops return their input object).
        self.returns = []
        for ret in schema.returns:
            source = None
            if ret.alias_info is not None and ret.alias_info.is_write:
                for i, arg in enumerate(schema.arguments):
                    if arg.alias_info is not None and arg.alias_info.before_set == ret.alias_info.before_set:
                        source = (i, arg.name)
            self.returns.append(source)
        self.__name__ = f"mutation({func})"

    def __call__(self, func, types, args, kwargs, also_written=()):
        # also_written: arguments the op writes although its schema does not say so.
        written = set(also_written)
        for i, name in self.positions.items():
            value = args[i] if i < len(args) else kwargs.get(name)
            if _has_offloaded(value):
                written.add(i if i < len(args) else name)
        if not written:
            return _run(func, args, kwargs)
        out = _run(func, args, kwargs, written)
        if not self.returns:
            return out  # e.g. _foreach_add_ returns nothing; its writes are already written back
        results = []
        for ret, source in zip(_as_tuple(out, len(self.returns)), self.returns):
            if source is None:
                results.append(ret)
            else:
                i, name = source
                results.append(args[i] if i < len(args) else kwargs[name])
        return results[0] if len(self.returns) == 1 else tuple(results)


def _has_offloaded(value) -> bool:
    if isinstance(value, OffloadedTensor):
        return True
    return isinstance(value, (list, tuple)) and any(isinstance(x, OffloadedTensor) for x in value)


def _as_tuple(out, n):
    if n == 1:
        return (out,)
    return tuple(out)


def _classify(func):
    if func.name() == "transformers::grouped_mm_fallback":
        return _grouped_mm_fallback
    if func.namespace in _COLLECTIVE_NAMESPACES:
        return _Collective(func)
    schema = func._schema
    if torch.Tag.inplace_view in func.tags:
        return _inplace_view
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return _Mutation(func)
    if schema.returns and all(r.alias_info is not None for r in schema.returns):
        return _view
    return _compute


# ---------------------------------------------------------------------------- explicit table

# reshape() of a non-viewable tensor is clone + _unsafe_view; the clone is already a fresh
# OffloadedTensor, so keep the reshape on the host too instead of paging it.
implements(aten._unsafe_view.default)(_view)

# Real views whose schemas declare no alias ("unsafe": autograd does not track them as views):
# on plain tensors their results share the input's memory, so here they are host views too.
implements(aten.unsafe_split.Tensor, aten.unsafe_split_with_sizes.default)(_view)


_BATCH_NORM_MUTATIONS: dict = {}


@implements(
    aten.native_batch_norm.default,
    aten.native_batch_norm.out,
    aten.cudnn_batch_norm.default,
    aten.miopen_batch_norm.default,
)
def _batch_norm(func, types, args, kwargs):
    # These schemas do not mark running_mean/running_var as written, yet training updates them in
    # place: write offloaded running stats back like any in-place op (only then, so eval keeps
    # their cached copies).
    call = dict(zip(("input", "weight", "bias", "running_mean", "running_var", "training"), args), **kwargs)
    written = set()
    if call.get("training"):
        written = {i for i in (3, 4) if i < len(args) and isinstance(args[i], OffloadedTensor)}
    mutation = _BATCH_NORM_MUTATIONS.get(func)
    if mutation is None:
        mutation = _BATCH_NORM_MUTATIONS[func] = _Mutation(func)
    return mutation(func, types, args, kwargs, written)


@implements(aten.copy_.default)
def _copy_(func, types, args, kwargs):
    dst, src = args[0], args[1]
    if not isinstance(dst, OffloadedTensor):
        if isinstance(src, OffloadedTensor) and dst.device.type == "cpu":
            # Reading host values into a CPU tensor needs no trip through the device.
            return dst.copy_(src._host, **kwargs)
        return _run(func, args, kwargs)
    # Weight loaders write straight into the host master (param.data.copy_, narrow().copy_):
    # nothing is paged, and a copy from another OffloadedTensor stays on the host.
    source = src._host if isinstance(src, OffloadedTensor) else src
    pager = dst._master.pager
    with pager.lock:  # as in _write_back
        pager.before_write(dst._master)
        with no_dispatch():
            # Never non_blocking: a device->host copy still in flight would let .cpu() and the next
            # page-in (on the copy stream) read the master's old bytes.
            dst._host.copy_(source)
        if source.device.type != "cpu":
            pager.count_write_back(dst._host.numel() * dst._host.element_size())
    return dst


_INDEX_PUT_ON_DEVICE = _Mutation(aten.index_put_.default)


@implements(aten.index_put_.default)
def _index_put_(func, types, args, kwargs):
    # ``param.data[rows] = w`` (weight loaders) writes straight into the host master, as copy_ does;
    # the generic path would page the whole tensor to scatter a few rows into a private copy.
    self = args[0]
    if not isinstance(self, OffloadedTensor) or any(_has_offloaded(a) for a in (*args[1:], *kwargs.values())):
        return _INDEX_PUT_ON_DEVICE(func, types, args, kwargs)
    indices = [None if i is None else i.to("cpu") for i in args[1]]
    values = args[2].to("cpu")
    pager = self._master.pager
    with pager.lock:  # as in _write_back
        pager.before_write(self._master)
        with no_dispatch():
            self._host.index_put_(indices, values, *args[3:], **kwargs)
        if args[2].device.type != "cpu":
            pager.count_write_back(values.numel() * values.element_size())
    return self


@implements(aten.clone.default)
def _clone(func, types, args, kwargs):
    self = args[0]
    memory_format = kwargs.get("memory_format")
    host = self._host
    if memory_format not in (None, torch.preserve_format):
        host = host.contiguous(memory_format=memory_format)
    pager = self._master.pager
    return wrap_host(new_host_master(host, pin=pins_host_memory(pager.device)), pager)


@implements(aten._to_copy.default)
def _to_copy(func, types, args, kwargs):
    device = kwargs.get("device")
    if device is not None and torch.device(device).type == "cpu":
        # .cpu() / .to("cpu"): read the host master, no device round trip.
        return func(args[0]._host, *args[1:], **kwargs)
    return _run(func, args, kwargs)


@implements(aten._local_scalar_dense.default)
def _item(func, types, args, kwargs):
    return args[0]._host.item()


@implements(aten.is_pinned.default)
def _is_pinned(func, types, args, kwargs):
    return False  # a device tensor from the caller's point of view


@implements(aten.record_stream.default)
def _record_stream(func, types, args, kwargs):
    return None  # paged copies are freed by the pager's events, never by the caller's streams


@implements(aten.resize_.default)
def _resize_(func, types, args, kwargs):
    self, size = args[0], args[1]
    memory_format = kwargs.get("memory_format")
    if tuple(size) == tuple(self.shape) and memory_format is None:
        return self  # like resize_: same sizes and no memory format keep the strides
    if _resize_within_master(self, size, memory_format or torch.contiguous_format):
        return self
    raise RuntimeError(
        f"offtensor: cannot resize {_describe(self)} to {tuple(size)}: its host master is exactly "
        f"{self.host_nbytes} bytes. Assign a new tensor instead."
    )


@implements(aten.set_.source_Tensor, aten.set_.source_Storage, aten.set_.source_Storage_storage_offset, aten.set_.default)
def _set_(func, types, args, kwargs):
    raise RuntimeError(
        f"offtensor: {func} would repoint {_describe(args[0])} at other memory; "
        f"assign a new tensor (or use copy_ to write values) instead"
    )


@implements(aten._conj.default, aten._neg_view.default)
def _lazy_bit_view(func, types, args, kwargs):
    # A conjugate or negative *bit* on a host view would be ignored here: the Conjugate and
    # Negative fallbacks run above __torch_dispatch__, so paging and write-back would copy the raw
    # values. Resolve it instead: a plain device tensor with the conjugated or negated values.
    physical = aten.conj_physical.default if func is aten._conj.default else aten.neg.default
    return _run(physical, args, kwargs)


_SCHEMA_HANDLERS: dict = {}


@implements(
    aten.as_strided_copy.default,
    aten.as_strided_copy.out,
    aten.as_strided_scatter.default,
    aten.as_strided_scatter.out,
)
def _storage_addressing(func, types, args, kwargs):
    # These ops address self's *storage*: storage_offset is absolute and as_strided_scatter clones
    # the whole storage. A page of only the bytes self covers would move offset 0 to self's first
    # byte, so page self's whole master and view it at its true offset.
    self = args[0]
    handler = _SCHEMA_HANDLERS.get(func)
    if handler is None:
        handler = _SCHEMA_HANDLERS[func] = _classify(func)
    if not isinstance(self, OffloadedTensor):
        return handler(func, types, args, kwargs)
    host = self._host
    whole = host.as_strided((host.untyped_storage().nbytes() // host.element_size(),), (1,), 0)
    paged = _Paged()
    try:
        device_self = paged.page(OffloadedTensor(whole, self._master))
        device_self = device_self.as_strided(host.shape, host.stride(), host.storage_offset())
        return handler(func, types, (device_self,) + tuple(args[1:]), kwargs)
    finally:
        paged.release()


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
                layout = t.__dict__.get("_layout")  # memoized by _Paged.page: this runs per op
                if layout is None:
                    layout = t.__dict__["_layout"] = page_layout(t._host, t._master.id)
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
        return _run(func, args, kwargs)
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
        paged = _Paged()
        try:
            target.copy_(paged.page(t))  # one input on the device at a time
        finally:
            paged.release()
    return out


class _ForeachInPieces:
    """A ``_foreach_*`` op whose offloaded list elements do not fit the free room together: run it
    once per element (each call pages one element's tensors), which is what the op computes."""

    def __init__(self, func, handler):
        self.func, self.handler = func, handler
        self.__name__ = f"in_pieces({getattr(handler, '__name__', func)})"

    def __call__(self, func, types, args, kwargs):
        pager, need = _offloaded_bytes(list(args) + list(kwargs.values()))
        if not _short_of_room(pager, need):
            return self.handler(func, types, args, kwargs)
        n = len(args[0])
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
        if results and isinstance(results[0], (list, tuple)):
            return [r for result in results for r in result]
        return None  # in-place _foreach ops return nothing


def _in_pieces_when_short(func, handler):
    arguments = func._schema.arguments
    if func.name().startswith("aten::_foreach_") and arguments and isinstance(arguments[0].type, torch.ListType):
        return _ForeachInPieces(func, handler)
    return handler


# ---------------------------------------------------------------------------- collectives

_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")

# The arguments each c10d op writes. Their schemas declare no write alias (the ops return their
# tensors and a Work instead), so without this table a broadcast or all_reduce into an
# OffloadedTensor would run on a paged copy and be thrown away.
_C10D_WRITES = {
    "broadcast_": ("tensors",), "allreduce_": ("tensors",), "allreduce_coalesced_": ("tensors",),
    "reduce_": ("tensors",), "recv_": ("tensors",), "recv_any_source_": ("tensors",),
    "allgather_": ("output_tensors",), "_allgather_base_": ("output_tensor",), "allgather_coalesced_": ("output_lists",),
    "allgather_into_tensor_coalesced_": ("outputs",), "reduce_scatter_": ("output_tensors",),
    "_reduce_scatter_base_": ("output_tensor",), "reduce_scatter_tensor_coalesced_": ("outputs",),
    "gather_": ("output_tensors",), "scatter_": ("output_tensors",), "alltoall_": ("output_tensors",),
    "alltoall_base_": ("output",), "send": (), "barrier": (), "monitored_barrier_": (),
}


class _Collective:
    """A c10d or functional collective with OffloadedTensor arguments, at any list depth
    (``scatter_`` takes ``Tensor[][]``): each is paged (privately where the op writes it), the op
    runs and is waited for, so the paged copies and their host sources outlive the transfer, and
    written arguments go back to their host masters; the results name the OffloadedTensors again.

    An asynchronous collective (``async_op=True``) on an OffloadedTensor therefore completes before
    it returns: its write-back needs the transfer done, and no hook runs when a Work completes."""

    def __init__(self, func):
        self.func = func
        names = [a.name for a in func._schema.arguments]
        if func.namespace == "c10d":
            writes = _C10D_WRITES.get(func._opname)
        else:  # functional collectives declare their writes (all_reduce_, the out= variants)
            writes = tuple(a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write)
        self.written = None if writes is None else {i for i, n in enumerate(names) if n in writes} | set(writes)
        self.__name__ = f"collective({func})"

    def __call__(self, func, types, args, kwargs, run=None):
        """``run`` calls the op on the paged arguments (default ``func``; the nested-list kernel
        below passes a redispatch past itself)."""
        if self.written is None:
            raise NotImplementedError(
                f"offtensor: {func} with an OffloadedTensor argument is not supported: which of its arguments it "
                f"writes is not known. Run it on t.materialize() and copy_ the result back into the OffloadedTensor"
            )
        paged = _Paged()
        originals = {}  # id(paged copy of a written argument) -> its OffloadedTensor
        try:
            new_args = [_page_nested(paged, a, i in self.written, originals) for i, a in enumerate(args)]
            new_kwargs = {k: _page_nested(paged, v, k in self.written, originals) for k, v in kwargs.items()}
            out = (run or func)(*new_args, **new_kwargs)
            out = _wait_collective(out, func.namespace != "c10d")
            for t, device_copy in paged.private:
                _write_back(t, device_copy)
        finally:
            paged.release()
        return _restore_nested(out, originals)


# The c10d ops that take a ``Tensor[][]``. The dispatcher looks for tensor subclasses in tensor and
# tensor-list arguments only, so an OffloadedTensor passed only inside a nested list (``scatter_list``
# on the source rank, ``gather_list`` on the destination, an ``all_gather`` output list, with every
# flat argument plain) never reached ``__torch_dispatch__``, and gloo read its wrapper's null data
# pointer (EFAULT, or a segfault). A kernel at BackendSelect finds them: that key is in every call's
# key set (in inference mode too, where the autograd keys are not), and it sits below the Python key,
# so a call with a flat OffloadedTensor still takes ``__torch_dispatch__`` first and arrives here
# with plain tensors only. A call with no OffloadedTensor pays one scan of its lists (a few µs).
_NESTED_C10D = ("scatter_", "gather_", "allgather_", "reduce_scatter_", "allgather_coalesced_")


class _NestedCollective:
    def __init__(self, op):
        self.op = op
        self.collective = _Collective(op)
        self.below = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.BackendSelect)

    def __call__(self, keyset, *args, **kwargs):
        below = keyset & self.below
        if _has_offloaded_nested(args) or _has_offloaded_nested(kwargs.values()):
            run = lambda *a, **k: self.op.redispatch(below, *a, **k)  # noqa: E731 (past this kernel)
            return self.collective(self.op, (), args, kwargs, run=run)
        return self.op.redispatch(below, *args, **kwargs)


def _has_offloaded_nested(values) -> bool:
    for v in values:
        if isinstance(v, OffloadedTensor) or (isinstance(v, (list, tuple)) and _has_offloaded_nested(v)):
            return True
    return False


def _install_nested_collectives():
    """Registers the BackendSelect kernels; returns the Library that holds them (registrations
    last as long as it does), or None where torch has no c10d ops."""
    if not torch.distributed.is_available():
        return None
    lib = torch.library.Library("c10d", "IMPL")
    for name in _NESTED_C10D:
        packet = getattr(torch.ops.c10d, name, None)
        if packet is not None:
            lib.impl(name, _NestedCollective(packet.default), "BackendSelect", with_keyset=True)
    return lib


_NESTED_C10D_KERNELS = _install_nested_collectives()


def _page_nested(paged: _Paged, value, written: bool, originals: dict):
    if isinstance(value, OffloadedTensor):
        copy = paged.page(value, written)
        if written:
            originals[id(copy)] = value
        return copy
    if isinstance(value, (list, tuple)):
        return type(value)(_page_nested(paged, v, written, originals) for v in value)
    return value


def _restore_nested(value, originals: dict):
    if isinstance(value, torch.Tensor):
        return originals.get(id(value), value)
    if isinstance(value, (list, tuple)):
        return type(value)(_restore_nested(v, originals) for v in value)
    return value


def _wait_collective(out, functional: bool):
    """Block until a collective's transfer is done: its ``Work`` (c10d), or each tensor a
    functional collective returned (``wait_tensor``). Returns ``out`` with each Work replaced by
    a completed one: gloo's send/recv Work waits for a further transfer if waited on twice, and
    the caller (``dist.send``, the user's ``work.wait()``) waits again."""
    if isinstance(out, (list, tuple)):
        return type(out)(_wait_collective(v, functional) for v in out)
    if isinstance(out, torch.Tensor):
        if functional:
            torch.ops._c10d_functional.wait_tensor(out)
        return out
    if isinstance(out, torch.ScriptObject) and hasattr(out, "wait"):
        out.wait()
        from torch._C._distributed_c10d import _create_work_from_future

        done = torch.futures.Future()
        done.set_result([])
        return _create_work_from_future(done).boxed()
    return out


# ---------------------------------------------------------------------------- tiling past the budget

# A weight larger than the budget's free room is computed in output tiles that fit: rows of a
# linear weight (output features), columns of mm's second operand, output channels of a
# convolution, batches of bmm. Each tile is one call of the same op on a slice of the weight, and
# the tiles are concatenated. Every output element is computed from the same inputs with the same
# reduction length, so results are bit-identical where the kernel sums in the same order for a
# narrower output: on CPU (MKL/oneDNN) that held for every tile at least TILE_ALIGN wide in
# test_budget_and_tiling; tiles narrower than that (a budget with room for only a few rows) may
# make BLAS pick a matrix-vector kernel, which differs in the last bits (tested to a tolerance).
# Placement reserves room for tiles TILE_ALIGN wide (placement.tile_working_set), so a wrapped
# model's tiles stay bit-identical; narrower ones are its fallback, with a warning.

# Tiles are cut to multiples of this many outputs wide when the room allows (see _tiled).
TILE_ALIGN = 16


def _slice_bytes(t: OffloadedTensor, dim: int) -> int:
    return t.numel() // max(t.shape[dim], 1) * t.element_size()


def _page_slice(t, dim: int, start: int, stop: int, paged: _Paged):
    """Device tensor of ``t.narrow(dim, start, stop - start)``, paging only that slice (a strided
    slice whose covering range is much larger than its bytes is gathered on the host first)."""
    if not isinstance(t, OffloadedTensor):
        return t.narrow(dim, start, stop - start)
    host = t._host.narrow(dim, start, stop - start)
    lo, hi = host_layout(host)[:2]
    if (hi - lo) <= 2 * host.numel():
        return paged.page(OffloadedTensor(host, t._master))
    view, entry = t._master.pager.upload(host.contiguous(), _describe(t))
    paged.entries.append((t._master.pager, entry))
    return view


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
            f"offtensor: {what} cannot be tiled within the budget: one slice of {_describe(weight)} is {per_slice} "
            f"bytes and its other offloaded arguments {others} bytes, but only {room + others} of the budget's "
            f"{pager.budget_bytes} bytes are free. Raise budget_gb, or offload more weights so fewer stay resident."
        )
    return max(1, room // per_slice)


def _tiled(weight, dim, others, what, compute, out_dim, sliced=()):
    """``compute(start, stop, paged)`` for tiles of ``weight`` along ``dim``, concatenated along
    ``out_dim`` of the outputs. Each tile's pages are released before the next is paged."""
    n = weight.shape[dim]
    step = _tile_size(weight, dim, others, what, sliced)
    if TILE_ALIGN <= step < n:
        step -= step % TILE_ALIGN
    bounds = list(range(0, n, step)) + [n]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] < TILE_ALIGN <= step - TILE_ALIGN:
        # Every tile at least TILE_ALIGN wide where the room allows: a 1- or 2-wide output makes
        # BLAS pick a matrix-vector kernel that sums in another order.
        bounds[-2] = n - TILE_ALIGN
    outs = []
    for start, stop in zip(bounds, bounds[1:]):
        paged = _Paged()
        try:
            outs.append(compute(start, stop, paged))
        finally:
            paged.release()
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=out_dim)


def _needs_tiling(big, rest) -> bool:
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


def _linear_tiled(x, weight, bias):
    """F.linear with a weight larger than the free room: output features in tiles."""
    _, others = _offloaded_bytes([x])

    def compute(start, stop, paged):
        w = _as_linear_weight(x, weight, _page_slice(weight, 0, start, stop, paged))
        b = None if bias is None else _page_slice(bias, 0, start, stop, paged)
        return torch._C._nn.linear(paged.arg(x), w, b)

    return _tiled(weight, 0, others, "linear", compute, -1, [(bias, 0)])


def _bias_slice(bias, out_dim, start, stop, size, paged):
    """The part of addmm's broadcast ``bias`` that output tile [start, stop) of ``out_dim`` adds."""
    if not isinstance(bias, torch.Tensor) or bias.dim() == 0:
        return bias
    dim = out_dim - 2 + bias.dim()  # bias broadcasts against the 2-D output from the right
    if dim < 0 or bias.shape[dim] != size:
        return paged.arg(bias)
    return _page_slice(bias, dim, start, stop, paged)


@implements(aten.mm.default, aten.addmm.default)
def _mm(func, types, args, kwargs):
    addmm = func is aten.addmm.default
    bias, a, b = (args[0], args[1], args[2]) if addmm else (None, args[0], args[1])
    if _needs_tiling(b, [a, bias]) and b.dim() == 2:
        big, dim, other = b, 1, a  # columns of b -> columns of the output
    elif _needs_tiling(a, [b, bias]) and a.dim() == 2:
        big, dim, other = a, 0, b  # rows of a -> rows of the output
    else:
        return _run(func, args, kwargs)
    size = big.shape[dim]
    bias_dim = None
    if isinstance(bias, torch.Tensor) and bias.dim():
        bias_dim = dim - 2 + bias.dim()
        bias_dim = bias_dim if bias_dim >= 0 and bias.shape[bias_dim] == size else None
    _, others = _offloaded_bytes([other] + ([bias] if bias_dim is None else []))

    def compute(start, stop, paged):
        part = _page_slice(big, dim, start, stop, paged)
        left, right = (paged.arg(a), part) if dim == 1 else (part, paged.arg(b))
        if not addmm:
            return func(left, right, **kwargs)
        return func(_bias_slice(bias, dim, start, stop, size, paged), left, right, *args[3:], **kwargs)

    return _tiled(big, dim, others, str(func), compute, dim, [] if bias_dim is None else [(bias, bias_dim)])


@implements(aten.bmm.default)
def _bmm(func, types, args, kwargs):
    a, b = args[0], args[1]
    big = b if _needs_tiling(b, [a]) else a if _needs_tiling(a, [b]) else None
    if big is None:
        return _run(func, args, kwargs)
    other = a if big is b else b

    def compute(start, stop, paged):
        return func(_page_slice(a, 0, start, stop, paged), _page_slice(b, 0, start, stop, paged), **kwargs)

    return _tiled(big, 0, 0, str(func), compute, 0, [(other, 0)])


@implements(aten.convolution.default)
def _convolution(func, types, args, kwargs):
    call = dict(zip(("input", "weight", "bias", "stride", "padding", "dilation", "transposed", "output_padding", "groups"), args), **kwargs)
    weight, bias, x = call["weight"], call.get("bias"), call["input"]
    if call.get("transposed") or call.get("groups", 1) != 1 or not _needs_tiling(weight, [x, bias]):
        return _run(func, args, kwargs)
    _, others = _offloaded_bytes([x])
    rest = {k: v for k, v in call.items() if k not in ("input", "weight", "bias")}

    def compute(start, stop, paged):
        b = None if bias is None else _page_slice(bias, 0, start, stop, paged)
        return func(paged.arg(x), _page_slice(weight, 0, start, stop, paged), b, **rest)

    return _tiled(weight, 0, others, "convolution", compute, 1, [(bias, 0)])


# ---------------------------------------------------------------------------- index ops


def _gather_rows(t: OffloadedTensor, rows: torch.Tensor, paged: _Paged) -> torch.Tensor:
    """Device tensor of ``t[rows]`` for unique CPU indices ``rows``, paging only those rows.

    When the rows do not fit the budget's free room at once (a prefill routes tokens to every
    expert), they are paged a chunk at a time into the result, so the copies alive stay within the
    budget; the result itself is the op's output, like any activation."""
    host = t._host
    row_bytes = (host.numel() // max(host.shape[0], 1)) * host.element_size()
    pager = t._master.pager
    need = rows.numel() * row_bytes
    # Scanning the cache for evictable bytes (free_bytes) only when the unclaimed room falls short.
    room = None
    if rows.numel() > 1 and pager.budget_bytes is not None:
        if need > pager.budget_bytes - pager.budget.resident_bytes - pager.budget.paged_bytes:
            room = pager.free_bytes()
    if room is not None and need > room:
        per_chunk = max(1, room // max(row_bytes, 1))
        out = torch.empty((rows.numel(),) + tuple(host.shape[1:]), dtype=host.dtype, device=pager.device)
        for start in range(0, rows.numel(), per_chunk):
            chunk = _Paged()
            try:
                out[start : start + per_chunk].copy_(_gather_rows(t, rows[start : start + per_chunk], chunk))
            finally:
                chunk.release()
        return out
    # Routed experts of a registered stack go through the cache at any size, so hot experts stay
    # on the device across tokens and the per-stack counters see every lookup.
    per_expert = pager.experts is not None and pager.experts.is_stack(t._master.id) and pager.budget_bytes is not None
    if (row_bytes >= CACHED_SLICE_BYTES or per_expert) and pager.budget_bytes is not None and rows.numel() > 1:
        # Experts: each one through the cache, then packed on the device (device bandwidth is
        # ~50x PCIe, so the pack costs little next to the copies it saves).
        rows = rows.tolist()
        if per_expert:
            with pager.lock:  # the expert cache is pager state
                pager.experts.announce(pager, t._master.id, rows)
        parts = [paged.page(OffloadedTensor(host[i], t._master)) for i in rows]
        return torch.stack(parts)
    if rows.numel() == 1 and (row_bytes >= CACHED_SLICE_BYTES or per_expert):
        return paged.page(OffloadedTensor(host[int(rows[0])], t._master)).unsqueeze(0)
    gathered = pager.device_ops.gather_rows(host, rows)  # into pinned memory on a GPU: an async upload
    view, entry = pager.upload(gathered, _describe(t))
    paged.entries.append((pager, entry))
    return view


# Device->host reads made by the index ops below. On a GPU each one is a host sync: the CPU stops
# queuing work until the device has caught up, which costs the overlap of copies with compute at
# that layer. Counted on the emulated device too (where the same reads happen, without a wait),
# so tests and benchmarks measure the count the GPU would pay.
#
# Measured (tests/test_pager.py::test_an_moe_layer_costs_one_host_sync, transformers Qwen3-MoE
# layer on the grouped_mm path, offloaded experts): 1 sync per MoE layer, the read of the routing
# offsets that says which experts to page (gate_up and down share it); 1 per embedding lookup of
# offloaded rows (which rows to page). No other sync: indices go back to the device from pinned
# memory without blocking, gathered rows are uploaded from pinned memory, group sizes stay on the
# device.
#
# Why the one per MoE layer stays (issue 8): the pager's cache, budget and eviction are host state,
# and a host->device copy is issued by the host with host addresses, so the host must know which
# experts to page. Removing the read would take a device-side expert->slot table plus a UVA gather
# kernel that reads the missing experts from pinned memory, but a UVA read (55.2 GB/s, 5.2 ms for
# 8 x 25 MB on the H200) is 1.4x slower than DMA copies of the same experts (3.68 ms), and in a
# decode step those copies are the bound. What the sync costs instead is covered by speculation:
# the next layer's guessed experts are already copying while the host waits (offtensor/moe).
# The timeline records each read as a host sync (``Timeline.add_sync``), so replays show the gap.
HOST_SYNCS = [0]


def _read_to_host(t: torch.Tensor, pager=None) -> torch.Tensor:
    _host_sync(pager)
    return t.detach().to("cpu")


def _host_sync(pager=None) -> None:
    HOST_SYNCS[0] += 1
    if pager is not None and pager.recorder is not None:
        pager.recorder.host_sync()


def _unique_rows(index: torch.Tensor, size: int, pager=None):
    """Unique row ids (CPU, for the host) and every index's position among them (on index's device)."""
    if index.is_meta:
        # Planning on meta (ot.plan): the values are unknown, so every index is taken to select a
        # row of its own, the most a lookup can page. The GPU would read the index here: the host
        # sync is recorded all the same.
        _host_sync(pager)
        return torch.arange(min(index.numel(), size)), torch.empty(index.shape, dtype=torch.int64, device="meta")
    cpu = _read_to_host(index, pager).to(torch.int64).reshape(-1)
    cpu = torch.where(cpu < 0, cpu + size, cpu)
    rows, inverse = torch.unique(cpu, return_inverse=True)
    if rows.numel() and (int(rows[0]) < 0 or int(rows[-1]) >= size):
        raise IndexError(f"index {int(rows[-1]) if int(rows[-1]) >= size else int(rows[0])} is out of bounds for dimension 0 with size {size}")
    return rows, upload_small(inverse.reshape(index.shape), index.device)


@implements(aten.embedding.default)
def _embedding(func, types, args, kwargs):
    weight, indices = args[0], args[1]
    if not isinstance(weight, OffloadedTensor) or isinstance(indices, OffloadedTensor):
        return _run(func, args, kwargs)
    rows, inverse = _unique_rows(indices, weight.shape[0], weight._master.pager)
    paged = _Paged()
    try:
        selected = _gather_rows(weight, rows, paged)
        return func(selected, inverse.to(selected.device))
    finally:
        paged.release()


@implements(aten.index_select.default)
def _index_select(func, types, args, kwargs):
    self, dim, index = args[0], args[1], args[2]
    if not isinstance(self, OffloadedTensor) or isinstance(index, OffloadedTensor) or dim % max(self.dim(), 1) != 0 or self.dim() == 0:
        return _run(func, args, kwargs)
    rows, inverse = _unique_rows(index, self.shape[0], self._master.pager)
    paged = _Paged()
    try:
        selected = _gather_rows(self, rows, paged)
        return selected.index_select(0, inverse.to(selected.device))
    finally:
        paged.release()


@implements(aten.index.Tensor)
def _index(func, types, args, kwargs):
    self, indices = args[0], args[1]
    first = indices[0] if len(indices) else None
    if (
        not isinstance(self, OffloadedTensor)
        or self.dim() == 0
        or first is None
        or isinstance(first, OffloadedTensor)
        or first.dtype not in (torch.int64, torch.int32)
        or any(i is not None for i in indices[1:])
    ):
        return _run(func, args, kwargs)
    rows, inverse = _unique_rows(first, self.shape[0], self._master.pager)
    paged = _Paged()
    try:
        selected = _gather_rows(self, rows, paged)
        return func(selected, [inverse.to(selected.device)])
    finally:
        paged.release()


@implements(aten._grouped_mm.default)
def _grouped_mm(func, types, args, kwargs):
    """Grouped GEMM of tokens sorted by expert against a stacked expert weight (transformers v5's
    default MoE path): page only the experts that have tokens, one at a time through the cache,
    instead of the whole stack. Each expert runs as a one-group ``_grouped_mm`` on the stack's own
    layout, so every group computes exactly what the full call computes for it."""
    call = dict(zip(("self", "mat2", "offs", "bias", "out_dtype"), args), **kwargs)
    x, weight, offs, bias = call["self"], call["mat2"], call.get("offs"), call.get("bias")
    if (
        not isinstance(weight, OffloadedTensor)
        or isinstance(x, OffloadedTensor)
        or isinstance(offs, OffloadedTensor)
        or offs is None
        or x.dim() != 2
        or weight.dim() != 3
    ):
        return _run(func, args, kwargs)
    out_dtype = call.get("out_dtype")
    groups, sizes, covered = _routed_groups(weight, offs, x.shape[0])
    recorder = weight._master.pager.recorder
    pieces = []
    for e, start, end in groups:
        paged = _Paged()
        try:
            expert = paged.page(OffloadedTensor(weight._host[e : e + 1], weight._master))
            expert_bias = None if bias is None else paged.arg(bias[e : e + 1])
            if recorder is None:
                pieces.append(func(x[start:end], expert, sizes[e : e + 1], expert_bias, out_dtype))
            else:
                with recorder.kernels():  # timeline: this expert's kernel waits for its copy only
                    pieces.append(func(x[start:end], expert, sizes[e : e + 1], expert_bias, out_dtype))
        finally:
            paged.release()
    if covered < x.shape[0] or not pieces:
        # Rows after the last group belong to no expert; _grouped_mm leaves them uninitialised too.
        rest = x.shape[0] - covered
        pieces.append(torch.empty((rest, weight.shape[-1]), dtype=out_dtype or x.dtype, device=x.device))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _grouped_mm_fallback(func, types, args, kwargs):
    """transformers' own grouped GEMM (``transformers::grouped_mm_fallback``, used under
    torch.compile and for dtypes ``aten._grouped_mm`` lacks): a custom op, so its per-expert
    ``torch.mm`` calls never reach this dispatch one by one and the whole stack would be paged.
    Page only the experts with tokens, as ``_grouped_mm`` does, running the op itself on one
    expert at a time: each group is the same ``mm`` on the same rows, so results are identical."""
    call = dict(zip(("input", "weight", "offs"), args), **kwargs)
    x, weight, offs = call["input"], call["weight"], call["offs"]
    if (
        not isinstance(weight, OffloadedTensor)
        or isinstance(x, OffloadedTensor)
        or isinstance(offs, OffloadedTensor)
        or x.dim() != 2
        or weight.dim() != 3
    ):
        return _run(func, args, kwargs)
    groups, sizes, _ = _routed_groups(weight, offs, x.shape[0])
    recorder = weight._master.pager.recorder
    out = torch.zeros((x.shape[0], weight.shape[2]), dtype=x.dtype, device=x.device)  # as the op's own
    for e, start, end in groups:
        paged = _Paged()
        try:
            expert = paged.page(OffloadedTensor(weight._host[e : e + 1], weight._master))
            if recorder is None:
                out[start:end] = func(x[start:end], expert, sizes[e : e + 1])
            else:
                with recorder.kernels():  # timeline: this expert's kernel waits for its copy only
                    out[start:end] = func(x[start:end], expert, sizes[e : e + 1])
        finally:
            paged.release()
    return out


def _routed_groups(weight: OffloadedTensor, offs: torch.Tensor, rows: int):
    """For a grouped GEMM of tokens sorted by expert: (expert, first row, end row) of each expert
    with tokens, every group's size as a device tensor (sliced per expert, so no host->device copy),
    and the rows the groups cover. The layer's experts are announced to the expert cache, which
    issues the missing ones at once and may evict the layer's others for them."""
    pager = weight._master.pager
    ends = _group_ends(offs, pager, rows)
    starts = [0] + ends[:-1]
    groups = [(e, starts[e], ends[e]) for e in range(len(ends)) if ends[e] > starts[e]]
    if pager.experts is not None:
        with pager.lock:  # the expert cache is pager state
            pager.experts.announce(pager, weight._master.id, [e for e, _, _ in groups], [b - a for _, a, b in groups])
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    return groups, sizes, ends[-1] if ends else 0


def _group_ends(offs: torch.Tensor, pager, rows: int = 0) -> list:
    """``offs`` on the host: one small device->host read (copying every expert would cost far more),
    shared by the calls of one MoE layer that pass the same unchanged ``offs`` (gate_up, down): the
    pager keeps the last read (``Pager.routing_read``)."""
    ref, version, ends = pager.routing_read
    if ref is not None and ref() is offs and version == offs._version:
        return ends
    if offs.is_meta:
        _host_sync(pager)  # the GPU reads the routing here
        ends = (getattr(_planning, "ends", None) or _planned_ends)(offs.numel(), rows)
    else:
        ends = _read_to_host(offs, pager).tolist()
    pager.routing_read = (weakref.ref(offs), offs._version, ends)
    return ends


_PLANNED_ROUTING = torch.Generator().manual_seed(0)
_planning = threading.local()  # .ends: the routing of a plan with measured routing, in this thread


@contextlib.contextmanager
def planned_routing(ends):
    """While ``ot.plan`` replays with measured routing (``moe.RoutingStats``), a meta grouped
    GEMM's routing comes from ``ends(experts, rows)`` instead of ``_planned_ends``; per thread, so a
    plan in one thread changes no other thread's."""
    saved = getattr(_planning, "ends", None)
    _planning.ends = ends
    try:
        yield
    finally:
        _planning.ends = saved


def _planned_ends(experts: int, rows: int) -> list:
    """Planning on meta (ot.plan): routing has no values, so ``rows`` routed rows go to
    min(experts, rows) distinct experts drawn uniformly at random (no locality: what an expert
    cache gains from skewed routing is not assumed), as evenly as they divide. Seeded once per
    process, so a plan is reproducible within it."""
    chosen = sorted(torch.randperm(experts, generator=_PLANNED_ROUTING)[: min(experts, rows)].tolist())
    counts = [0] * experts
    for i, e in enumerate(chosen):
        counts[e] = rows // len(chosen) + (i < rows % len(chosen))
    ends, total = [], 0
    for c in counts:
        total += c
        ends.append(total)
    return ends


# ---------------------------------------------------------------------------- whole-op intercepts


def _as_linear_weight(x, weight: OffloadedTensor, device_weight: torch.Tensor) -> torch.Tensor:
    """The paged copy (or tile) of ``weight`` that ``F.linear`` gets. aten::matmul folds a 3-D
    input into one mm when the weight requires grad (even under no_grad), and otherwise only when
    the fold needs no copy; else it runs bmm: another kernel, other bits. The unwrapped model's
    weight requires grad, so its paged copy must say so too wherever that changes the kernel."""
    if x.dim() >= 3 and weight.requires_grad and not _folds_without_copy(x):
        return device_weight.detach().requires_grad_()
    return device_weight


def _folds_without_copy(x: torch.Tensor) -> bool:
    """aten::matmul's ``should_fold`` for an input whose weight does not require grad:
    ``x.view(-1, x.size(-1))`` needs no copy. Not ``is_contiguous()``: a size-1 dimension with any
    stride is contiguous, but its stride still decides the fold (fsmt's (2, 1, 32) decoder state
    with strides (32, 64, 1) runs bmm unless the weight requires grad)."""
    if x.numel() == 0:
        return True
    sizes, strides = x.shape, x.stride()
    return all(strides[i] == strides[i + 1] * sizes[i + 1] for i in range(x.dim() - 2))


def _linear(args, kwargs):
    x = args[0] if args else kwargs["input"]
    weight = args[1] if len(args) > 1 else kwargs["weight"]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    if kwargs.get("out") is not None:
        return NotImplemented  # linear.out: the normal dispatch writes out= back to its master
    if torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        # Let autograd see t + addmm so it saves the OffloadedTensor, not a device copy, and
        # backward pages the weight again.
        return NotImplemented
    if isinstance(weight, OffloadedTensor) and weight._host.dim() == 2 and _needs_tiling(weight, [x, bias]):
        return _linear_tiled(x, weight, bias)
    paged = _Paged()
    try:
        device_weight = paged.arg(weight)
        if isinstance(weight, OffloadedTensor):
            device_weight = _as_linear_weight(x, weight, device_weight)
        return torch._C._nn.linear(paged.arg(x), device_weight, paged.arg(bias))
    finally:
        paged.release()


def _matrix_product(product):
    """Handler for ``torch.matmul`` / ``torch.mm`` (and their Tensor methods; ``a @ b`` arrives as
    ``Tensor.matmul``) of an OffloadedTensor with grad off: page once and run ``product`` on plain
    tensors, instead of matmul's composite dispatching mm (or mv, dot) back into Python through
    ``__torch_dispatch__``. ``x @ w.t()`` in a decode step is this.

    Taken only where the dispatch path would page exactly the same bytes in one op, so paging,
    stats and results stay those of that path: both operands at most 2-D, or a plain first operand
    of 3 or more dims that folds without a copy times a second of at most 2, which matmul folds into
    one mm whether or not the second requires grad (aten::matmul's should_fold), and mm of two
    matrices.
    Everything else (broadcast batches, out=, tiling, autograd, torch.compile's tracing, a
    timeline being recorded) takes the normal dispatch."""
    is_mm = product is torch.mm

    def handler(args, kwargs):
        if kwargs or len(args) != 2:
            return NotImplemented
        a, b = args
        offloaded = [t for t in args if isinstance(t, OffloadedTensor)]
        if len(offloaded) + sum(type(t) is torch.Tensor for t in args) != 2:
            return NotImplemented  # another subclass, or not a tensor: its own rules apply
        # Metadata from the host views: a wrapper's dim() would cost a __torch_function__ call.
        hosts = [t.__dict__["_host"] if isinstance(t, OffloadedTensor) else t for t in args]
        for t in offloaded:
            own = t.__dict__
            if own["_master"].pager.recorder is not None or type(own["_host"]) is not torch.Tensor:
                return NotImplemented  # timeline records and traced graphs stay as they were
        a_dim, b_dim = hosts[0].dim(), hosts[1].dim()
        if is_mm:
            if a_dim != 2 or b_dim != 2:
                return NotImplemented  # mm's own error
        elif b_dim > 2 or (a_dim > 2 and (a is not hosts[0] or not _folds_without_copy(a))):
            return NotImplemented
        if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
            return NotImplemented  # autograd must see the OffloadedTensor (see _linear)
        if _needs_tiling(b, [a]) or _needs_tiling(a, [b]):
            return NotImplemented  # _mm computes it in tiles
        paged = _Paged()
        try:
            return product(paged.arg(a), paged.arg(b))
        finally:
            paged.release()

    return handler


def _cpu(args, kwargs):
    self = args[0]
    if not isinstance(self, OffloadedTensor) or self.device.type != "cpu":
        return NotImplemented  # on a GPU .cpu() arrives as _to_copy, which reads the host master
    # On the emulated device .cpu() would be a no-op returning the OffloadedTensor itself; give a
    # plain CPU tensor read from the host master, as on a GPU (callers go on to .numpy() etc.).
    # Through aten._to_copy, so autograd records it like any device->host copy.
    memory_format = kwargs.get("memory_format", torch.preserve_format)
    return aten._to_copy.default(self, device=torch.device("cpu"), memory_format=memory_format)


def _tolist(args, kwargs):
    # Tensor.tolist refuses every subclass; the values are all in the host master.
    return args[0]._host.tolist() if isinstance(args[0], OffloadedTensor) else NotImplemented


def _set_data(args, kwargs):
    """``x.data = value`` (``module.half()``, weight post-processing): torch would copy only the
    wrapper's metadata and leave ``_host`` behind, so dtype and shape would describe bytes the
    master does not hold. Re-point the wrapper at ``value``'s master instead, offloading a plain
    ``value`` to a new exact-size master first; the object (and every reference to it) stays."""
    self, value = args
    if not isinstance(self, OffloadedTensor) or not isinstance(value, torch.Tensor):
        return NotImplemented
    if not isinstance(value, OffloadedTensor):
        check_offloadable(value)
        pager = self._master.pager
        value = wrap_host(new_host_master(value, pin=pins_host_memory(pager.device)), pager)
    with torch._C.DisableTorchFunctionSubclass():
        torch.Tensor.data.__set__(self, value)  # the wrapper's sizes, strides and dtype
    self._host, self._master = value._host, value._master
    self.__dict__.pop("_layout", None)
    return None


def _host_read_argument(function, position: int, name: str):
    """Handler for a function whose C++ composite reads argument ``position`` straight from CPU
    memory before any dispatch (``tensor_split``'s split points). A wrapper has no such memory, so
    on the emulated device that argument is given as its host view; on a GPU the function refuses
    a device tensor there, as it does for plain tensors."""

    def handler(args, kwargs):
        value = args[position] if len(args) > position else kwargs.get(name)
        if not isinstance(value, OffloadedTensor) or value.device.type != "cpu":
            return NotImplemented
        if len(args) > position:
            args = args[:position] + (value._host,) + args[position + 1 :]
        else:
            kwargs = {**kwargs, name: value._host}
        return torch._C._disabled_torch_function_impl(function, (), args, kwargs)

    return {function: handler}


_FUNCTION_TABLE = {
    F.linear: _linear,
    torch._C._nn.linear: _linear,
    torch.matmul: _matrix_product(torch.matmul),
    torch.Tensor.matmul: _matrix_product(torch.matmul),  # also what `a @ b` arrives as
    torch.mm: _matrix_product(torch.mm),
    torch.Tensor.mm: _matrix_product(torch.mm),
    torch.Tensor.cpu: _cpu,
    torch.Tensor.tolist: _tolist,
    torch.Tensor.data.__set__: _set_data,
    **_host_read_argument(torch.tensor_split, 1, "indices_or_sections"),
    **_host_read_argument(torch.Tensor.tensor_split, 1, "indices_or_sections"),
}


# Handlers that page their arguments and compute (tiling when the room is short): under
# torch.compile they run inside one opaque offtensor::compute op, which calls them at run time.
_COMPUTE_HANDLERS = {_compute, _mm, _bmm, _convolution, _grouped_mm_fallback}

# Handlers that write host masters or page rows chosen by index values: a graph break under
# torch.compile (see torch_dispatch).
_UNTRACEABLE = {
    _batch_norm, _copy_, _resize_, _set_, _embedding, _index_select, _index, _grouped_mm,
}


OffloadedTensor.set_op_handlers(torch_dispatch, _FUNCTION_TABLE)
