"""The op table: each aten op on an OffloadedTensor meets one handler, registered per OpOverload with
``@implements`` or, for an op no module names, chosen once from its schema.

Unnamed ops land in one of five handlers by their schema:

- view ops (an output aliases an input): run on the host view, return OffloadedTensor aliases;
- in-place view ops (``t_``, ``squeeze_``...): change host and wrapper metadata;
- ops that write an OffloadedTensor (in-place, ``out=``): run on private device copies, write
  every mutated argument back to its host master, invalidate its cached copies;
- collectives (``c10d``, ``_c10d_functional``): paged, waited for, written back;
- everything else: page what each argument covers, run the op on plain device tensors, return
  plain results.

The ops that address their argument's whole storage (``as_strided_copy``, ``as_strided_scatter``)
take the same schema-chosen handler here, on a page of the whole master.

The modules beside this one name the ops that need more, by family: ``views``, ``reads``,
``writes``, ``tiling`` (products computed in tiles when the budget's free room is short),
``pieces`` (elementwise ops and ``_foreach_*`` elements in slices likewise),
``convolutions`` (every form of convolution in tiles the same way), ``distances`` (``cdist``),
``whole_reads`` (ops reading a tensor whole, in slices once their page fell short), ``lines``
(ops along a dim, in slices across it likewise), ``rows``
(index ops that page only the rows selected), ``grouped`` (grouped GEMMs of routed experts),
``collectives``, ``functions`` (whole ops intercepted at ``__torch_function__``: ``F.linear``,
``matmul``...), ``compile`` (the same paging inside torch.compile graphs) and ``forward_ad`` (a
forward-mode tangent for an offloaded weight, refused).

Registration: ``OffloadedTensor.set_op_handlers`` is the class's one entry point for what ops do;
the last line of this module calls it, once, with ``torch_dispatch``, the ``functions`` table and
``paging.reclaim``, so tensor.py imports nothing of this package (the import graph runs ops -> tensor -> pager).
"""

from __future__ import annotations

import warnings

import torch
from torch.utils import _pytree as pytree

from .. import cast_views
from ..pager import BudgetError
from ..tensor import TRACED_ALIVE, OffloadedTensor
from . import compile as _compile
from . import compiled_writes
from . import forward_ad  # noqa: F401  (refuses a forward-mode tangent for an offloaded weight)
from . import reads  # noqa: F401  (registers clone, _to_copy, item, is_pinned, record_stream, _conj)
from .distances import cdist
from .collectives import COLLECTIVE_NAMESPACES, Collective
from .functions import FUNCTION_TABLE
from .grouped import grouped_mm, grouped_mm_fallback, grouped_mm_fallback_backward
from .paging import Paged, decomposes, describe, native_kernel, reclaim, run, with_math_bits
from .planned import planned_routing
from .rows import CACHED_SLICE_BYTES, HOST_SYNCS, embedding, index, index_select
from .table import OP_TABLE, implements
from .convolutions import convolution, convolution_backward
from .pieces import ForeachInPieces, cutting, pointwise_in_pieces
from .tiling import TILE_ALIGN, bmm, mm, mv
from .views import inplace_view, view
from .host_compute import ON_HOST, functional_form, mutated_on_host, on_host, out_form, out_on_host, written_on_host
from .lines import ALONG_LINES
from .weight_norms import WEIGHT_NORMS
from .whole_reads import SHORT_OF_ROOM
from .writes import Mutation, batch_norm, copy_, resize_, set_, written_arguments

__all__ = [
    "implements",
    "torch_dispatch",
    "planned_routing",
    "CACHED_SLICE_BYTES",
    "HOST_SYNCS",
    "TILE_ALIGN",
    "FUNCTION_TABLE",
]

aten = torch.ops.aten


def torch_dispatch(func, types, args, kwargs):
    handler = OP_TABLE.get(func)
    if handler is None:
        handler = OP_TABLE[func] = _in_pieces_when_short(func, _classify(func))
    if (handler in _UNTRACEABLE or type(handler) is Mutation) and _traced(args, kwargs):
        # Under torch.compile: row-selective paging becomes one opaque op that pages at run time,
        # copy_ into an offloaded tensor one that writes its master (compiled_writes.py); other
        # writes to a host master (and index ops it cannot express) run eagerly (compile.py).
        traced = _compile.traced_index_op(func, args, kwargs or {})
        if traced is None:
            traced = compiled_writes.traced_copy(func, args, kwargs or {})
        if traced is not None:
            return traced
        t = next((t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, OffloadedTensor)), None)
        _compile.graph_break(f"{func} on " + (f"{describe(t)} ({t.numel() * t.element_size()} bytes)" if t is not None
                                              else "an OffloadedTensor"))
    if handler in _COMPUTE_HANDLERS and TRACED_ALIVE[0] and _tracing() and _traced(args, kwargs):
        traced = _compile.traced_compute(func, args, kwargs)
        if traced is not None:
            return traced
    if _CASTS[0] and handler not in _CAST_AWARE:
        # A lazy cast (cast_views) is paged and cast by the handlers that page; any other reads its
        # host bytes as they are, or writes it: a master of its own holds its values first.
        cast_views.resolve_args(args, kwargs or {})
    try:
        return handler(func, types, args, kwargs or {})
    except BaseException as error:
        # An exception that struck on the way into a handler's ``paged.release()`` left its record
        # holding the pager: release it here (pager/__init__.py, "Exceptions").
        reclaim(error)
        if type(error) is not BudgetError or cutting():
            raise
        in_slices = _in_slices(func, handler, args, kwargs)
        if in_slices is None:
            raise
        try:
            return in_slices(func, handler, args, kwargs or {}, error)
        except BaseException as late:
            reclaim(late)  # the slices' own records, as for the handler's
            if type(late) is not BudgetError or not (func in ON_HOST or _last_resort(func, handler, args, kwargs) is _on_host):
                raise
            # No slice fits (an op over the whole tensor, a line larger than the room): its host master.
            return on_host(func, args, kwargs or {}, late)


def _in_slices(func, handler, args, kwargs):
    """How ``func`` runs in slices when its page raised ``BudgetError``, or None."""
    if handler in _PLAIN_COMPUTE and func in _SHORT_OF_ROOM:
        # An op that reads a tensor whole, larger than the free room: slices of it (whole_reads.py, lines.py).
        return _short_of_room
    if (handler in _PLAIN_COMPUTE or type(handler) is Mutation or func in _ELEMENTWISE) \
            and (func in _ELEMENTWISE or _pointwise_op(func)):
        # Its arguments do not fit the free room together: slices of them do (pieces.py).
        return _pointwise
    if handler is _compute_composite:
        # A composite of other ops (``allclose``) whose arguments do not fit whole: its parts, each
        # of which runs in slices where it can, as for a plain tensor.
        return _decompose
    if func in ON_HOST:
        # Reads the whole tensor with no slices to cut (``unique``, ``nonzero``): on its host master (host_compute.py).
        return _on_host
    if functional_form(func) is not None:
        # Writes it by index or mask (``index_copy_``, ``tril_``), or any in-place op with an
        # out-of-place form (``addmm_``), whatever its handler: that form there, written back.
        return _written_on_host
    if type(handler) is Mutation and out_form(func) is not None:
        # An out= form (``torch.cumsum(w, 0, out=o)``, ``torch.mm(a, w, out=o)``): the op there, each
        # out= given its values.
        return _out_on_host
    # Any other op that computes a new result (``grid_sample``, a pooling, an interpolation, a loss
    # or a convolution of a model's own tensor as its input; a training batch norm, which also
    # writes its running statistics), where no slice or tile fits: on its host masters too, where
    # it has a CPU kernel. wrap accepted the budget, so it runs.
    return _last_resort(func, handler, args, kwargs)


def _last_resort(func, handler, args, kwargs):
    """How ``func``, beyond the ops host_compute names, runs on the host masters as a last resort,
    or None: an op that returns new tensors (no view) and writes none of its arguments (any it
    would write absent: a batch norm without running statistics) runs there as it is (``_on_host``);
    one that also writes some, each a tensor (not a list), with each written back
    (``_mutated_on_host``). Not one that draws random numbers (the host's generator is not the
    device's) or a collective (its peers wait on the device)."""
    if torch.Tag.nondeterministic_seeded in func.tags or type(handler) is Collective:
        return None
    schema = func._schema
    if any(r.alias_info is not None for r in schema.returns):
        return None
    written = [args[i] if i < len(args) else kwargs.get(name) for i, name in written_arguments(schema).items()]
    written = [t for t in written if t is not None]
    if not written:
        return _on_host
    return _mutated_on_host if all(isinstance(t, torch.Tensor) for t in written) else None


def _short_of_room(func, handler, args, kwargs, error):
    return _SHORT_OF_ROOM[func](func, args, kwargs, error)


def _on_host(func, handler, args, kwargs, error):
    return on_host(func, args, kwargs, error)


def _written_on_host(func, handler, args, kwargs, error):
    return written_on_host(func, args, kwargs, error)


def _out_on_host(func, handler, args, kwargs, error):
    return out_on_host(func, args, kwargs, error)


def _mutated_on_host(func, handler, args, kwargs, error):
    return mutated_on_host(func, args, kwargs, error)


def _pointwise(func, handler, args, kwargs, error):
    if func in _RANDOM_FILLS:
        _warn_random_in_slices(func, args[0])
    return pointwise_in_pieces(func, handler, args, kwargs, error)


_SHORT_OF_ROOM = {**SHORT_OF_ROOM, **ALONG_LINES, **WEIGHT_NORMS}
_POINTWISE = torch.Tag.pointwise


def _pointwise_op(func) -> bool:
    """Whether ``func`` is tagged pointwise, or is the in-place form of an op that is: torch tags
    ``add_`` but not ``abs_``, ``eq_``, ``threshold_`` or ``copysign_``, which compute each element
    as their out-of-place forms do."""
    if _POINTWISE in func.tags:
        return True
    name = func._schema.name.split("::")[-1]
    if not name.endswith("_") or torch.Tag.inplace not in func.tags:
        return False
    packet = getattr(aten, name[:-1], None)
    functional = getattr(packet, func._overloadname, None) if packet is not None else None
    return functional is not None and _POINTWISE in functional.tags
# Ops that compute each element from the same element of their arguments, as pointwise ones do,
# without torch's pointwise tag: fills (``zero_``, ``fill_``: ``nn.init.zeros_``, a head reset), a
# masked fill in place, a cast (``.to(dtype)``, ``.half()``), the random fills ``nn.init`` runs
# (``uniform_``, ``normal_``...), and ``1 - w`` (rsub), ``floor_divide``, ``torch.complex`` and
# ``torch.polar``. A weight larger than the free room is written or read in slices.
_RANDOM_FILLS = frozenset({aten.uniform_.default, aten.normal_.default, aten.bernoulli_.float, aten.exponential_.default,
                           aten.log_normal_.default, aten.cauchy_.default, aten.geometric_.default,
                           aten.random_.default, aten.random_.to, getattr(aten.random_, "from")})
_ELEMENTWISE = frozenset({aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default, aten.masked_fill_.Scalar,
                          aten.masked_fill_.Tensor, aten._to_copy.default, aten.rsub.Tensor, aten.rsub.Scalar,
                          aten.floor_divide.default, aten.floor_divide.Scalar, aten.floor_divide_.Tensor,
                          aten.floor_divide_.Scalar, aten.polar.default,
                          aten.complex.default}) | _RANDOM_FILLS


def _warn_random_in_slices(func, t) -> None:
    """A random fill drawn slice by slice: the distribution of one draw of the whole tensor, and on
    the CPU's generator (each element in turn) its values, but for ``normal_``, which the CPU draws
    in blocks of 16 values (a slice's last block is drawn apart); a GPU's generator gives each
    launch its own stream, so there the values differ from one draw's for the same seed."""
    warnings.warn(f"offtensor: {func.__name__.split('.')[0]} of {describe(t)}, larger than the budget's room, "
                  f"draws its values slice by slice: on a GPU (and for normal_ on the CPU) they are not the values "
                  f"one draw of the whole tensor gives for the same seed (the same distribution). Raise budget_gb "
                  f"for the same values.", stacklevel=5)


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


def _compute(func, types, args, kwargs):
    return run(func, args, kwargs)


def _compute_composite(func, types, args, kwargs):
    # A C++ composite of other ops (``linalg_pinv``, ``linalg_lstsq``), run on the paged arguments
    # with the lazy-bit fallbacks on (paging.with_math_bits).
    return run(func, args, kwargs, composite=True)


def _compute_kept(func, types, args, kwargs):
    """An op whose result is an object that keeps its tensor arguments (a custom class, such as
    ``quantized::linear_prepack``'s packed weight, which holds its bias): each offloaded argument
    goes in as a device copy of its own (``materialize``, outside the budget like the op's
    result), never a page, whose memory the pager reuses for the next copy once the op is done,
    which changed the kept bias under the packed weight. Such ops pack a weight once (quantising a
    model), not per forward."""
    args, kwargs = pytree.tree_map_only(OffloadedTensor, OffloadedTensor.materialize, (args, kwargs))
    return func(*args, **kwargs)


_PLAIN_COMPUTE = (_compute, _compute_composite)


def _decompose(func, handler, args, kwargs, error):
    """``func``'s C++ composite kernel on the offloaded arguments themselves, so that its parts
    meet their handlers (a pointwise part in slices, a reduction in slices) instead of one page of
    every argument whole; ``error`` where it has none."""
    key = next((k for k in _COMPOSITE_KEYS if native_kernel(func, k)), None)
    if key is None:
        raise error
    return with_math_bits(func._op_dk, (key, *args), kwargs)


def _classify(func):
    if func.name() == "transformers::grouped_mm_fallback":
        return grouped_mm_fallback
    if func.name() == "transformers::grouped_mm_fallback_backward":
        return grouped_mm_fallback_backward
    if func.namespace in COLLECTIVE_NAMESPACES:
        return Collective(func)
    schema = func._schema
    if torch.Tag.inplace_view in func.tags:
        return inplace_view
    if written_arguments(schema):
        return Mutation(func)
    if schema.returns and all(r.alias_info is not None for r in schema.returns):
        return view
    if any(isinstance(r.type, torch._C.ClassType) for r in schema.returns):
        return _compute_kept
    if native_kernel(func, _COMPOSITE) and not any(native_kernel(func, k) for k in _BACKENDS):
        return _decomposed  # a composite a plain tensor decomposes too (one with a kernel of its own runs that)
    return _compute_composite if decomposes(func) else _compute


def _decomposed(func, types, args, kwargs):
    """A composite op (``conv2d``, ``matmul``, ``linear``...) reaches ``__torch_dispatch__`` whole
    only where autograd's keys are off (``torch.inference_mode``, another subclass's dispatch);
    elsewhere it is decomposed before it gets here. Run its decomposition, as a plain tensor does, so
    its parts meet their handlers (``convolution`` and ``mm`` tile a weight larger than the room)
    instead of one page of every argument whole, which a budget that wrap accepted may not hold.

    The C++ kernel, not ``func.decompose``, which prefers torch._decomp's Python version where one
    is registered (its ``matmul`` broadcasts a weight into a bmm), which a plain tensor never runs.
    In inference mode a plain tensor runs it with autograd's view kernel on, which gives a view
    (``weight.t()``) its base's requires_grad, and ``matmul`` folds a 3-D input into one mm only
    for a weight that requires grad; inside ``__torch_dispatch__`` that kernel is off, so it is
    turned on again for the decomposition, else the weight would be broadcast into a bmm.

    The decomposition runs with the lazy-bit fallbacks on (``paging.with_math_bits``)."""
    if not _inference():
        return with_math_bits(func._op_dk, (_COMPOSITE, *args), kwargs)
    excluded = _is_excluded(_AD_INPLACE_OR_VIEW)
    _set_excluded(_AD_INPLACE_OR_VIEW, False)
    try:
        return with_math_bits(func._op_dk, (_COMPOSITE, *args), kwargs)
    finally:
        _set_excluded(_AD_INPLACE_OR_VIEW, excluded)


_COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd
_COMPOSITE_KEYS = (_COMPOSITE, torch._C.DispatchKey.CompositeExplicitAutograd,
                   torch._C.DispatchKey.CompositeExplicitAutogradNonFunctional)
_BACKENDS = (torch._C.DispatchKey.CPU, torch._C.DispatchKey.CUDA)
_AD_INPLACE_OR_VIEW = torch._C.DispatchKey.ADInplaceOrView
_inference = torch.is_inference_mode_enabled
_is_excluded = torch._C._dispatch_tls_is_dispatch_key_excluded
_set_excluded = torch._C._dispatch_tls_set_dispatch_key_excluded


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
    # byte, so page self's whole master and view it at its true offset, in a storage of its own: a
    # paged copy is a range of the pager's arena, whose storage is the whole arena.
    self = args[0]
    handler = _SCHEMA_HANDLERS.get(func)
    if handler is None:
        handler = _SCHEMA_HANDLERS[func] = _classify(func)
    if not isinstance(self, OffloadedTensor):
        return handler(func, types, args, kwargs)
    host = self._host
    whole = host.as_strided((host.untyped_storage().nbytes() // host.element_size(),), (1,), 0)
    paged = Paged()
    try:
        device_self = paged.page(OffloadedTensor(whole, self._master)).clone()
        device_self = device_self.as_strided(host.shape, host.stride(), host.storage_offset())
        return handler(func, types, (device_self,) + tuple(args[1:]), kwargs)
    finally:
        paged.release()


def _in_pieces_when_short(func, handler):
    arguments = func._schema.arguments
    # The fused optimizer steps (``_fused_adamw_`` and kin, what ``torch.optim`` runs with
    # ``fused=True`` and transformers' Trainer by default) are per-parameter like ``_foreach_*``.
    if func.name().startswith(("aten::_foreach_", "aten::_fused_")) and arguments and \
            isinstance(arguments[0].type, torch.ListType):
        return ForeachInPieces(func, handler)
    return handler


# Handlers that page their arguments and compute (tiling when the room is short): under
# torch.compile they run inside one opaque offtensor::compute op, which calls them at run time.
_COMPUTE_HANDLERS = {_compute, _compute_composite, mm, mv, bmm, cdist, convolution, convolution_backward, grouped_mm_fallback,
                     grouped_mm_fallback_backward}

# Handlers that page a lazy cast (cast_views) and cast what they page, or view it as such.
_CAST_AWARE = {_compute, _compute_composite, _decomposed, view, inplace_view, mm, mv, bmm, cdist, convolution,
               convolution_backward, grouped_mm, grouped_mm_fallback, grouped_mm_fallback_backward, embedding,
               index_select, index, reads._to_copy, reads._factory, OP_TABLE[aten.cat.default]}
_CASTS = cast_views.ALIVE

# Handlers that write host masters or page rows chosen by index values: an opaque op of their own
# or a graph break under torch.compile (see torch_dispatch).
_UNTRACEABLE = {
    batch_norm, copy_, resize_, set_, embedding, index_select, index, grouped_mm,
}


OffloadedTensor.set_op_handlers(torch_dispatch, FUNCTION_TABLE, reclaim)
