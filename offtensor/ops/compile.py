"""Paging inside torch.compile graphs: the ``offtensor::page`` custom op and the tracing rules.

Under ``torch.compile`` an OffloadedTensor is traced as a subclass whose one inner tensor is its
host view (``__tensor_flatten__``). Dynamo and AOTAutograd run ``__torch_dispatch__`` on fake
tensors; there every page of an offloaded argument becomes a call of the opaque op
``offtensor::page(host, master_id, device)``, whose fake kernel only says "a device tensor of the
host view's shape". The compiled graph therefore takes the host views as inputs and calls the pager
at run time, every step: cache, prefetch, budget and statistics apply as in eager mode, and nothing
about paging is baked into the graph, so steps do not recompile.

An op whose arguments are all tensors (``addmm`` from ``F.linear``, ``mm``, ``mul``...) becomes one
``offtensor::compute`` op instead, which runs the eager op on the OffloadedTensors at run time.
``page`` returns a device tensor the graph owns (a copy of the pager's cached or freshly paged
copy), never the cached buffer itself: Inductor reuses a dead buffer's memory for later results
("buf7 = buf3; del buf3 # reuse") and would otherwise write activations into the cache. The extra
device-to-device copy runs at device bandwidth, about 50x PCIe.

Index ops that page only the rows (experts) they select are opaque ops of their own
(``offtensor::embedding``, ``index_select``, ``index``, ``grouped_mm``) that run the eager handler at
run time, with or without gradients (they run below autograd, see ``traced_index_op``). What cannot
be traced breaks the graph at that one op instead of crashing (``graph_break``): in-place and
``out=`` writes to an offloaded tensor. ``copy_`` into one is traced (compiled_writes.py).
Under CUDA graph capture ``page`` records a host->device copy from the pinned master into graph
memory, so a replay reads the master's current bytes without any Python running; row-selective
paging refuses to be captured.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from ..pager import host_layout, registered_master, upload_compact
from ..tensor import OffloadedTensor

# The extension's namespace: these ops sit beside offtensor::alloc_host and copy_async.
_LIB_NS = "offtensor"


# Renamed (with an "_or_false" for symbolic shapes) after torch 2.11.
_non_overlapping_and_dense = getattr(
    torch._prims_common, "is_non_overlapping_and_dense_or_false", None
) or getattr(torch._prims_common, "is_non_overlapping_and_dense")


def _output_strides(host: torch.Tensor):
    """Strides of ``page``'s output: the host view's own when they describe a dense,
    non-overlapping block (a weight or its transpose), else contiguous (an expanded or sliced view
    is copied compactly)."""
    if _non_overlapping_and_dense(host):
        return host.stride()
    return torch._prims_common.make_contiguous_strides_for(host.shape)


@torch.library.custom_op(f"{_LIB_NS}::page", mutates_args=())
def page(host: torch.Tensor, master_id: int, device: torch.device) -> torch.Tensor:
    """A device tensor with ``host``'s values, paged through its master's pager. A view whose
    storage range holds more elements than it has (a column slice of a row-major weight: the
    slices an op cut in pieces reads) is gathered on the host and uploaded compact, as eager's
    slices are, so it needs the room its own elements take."""
    master = _live_master(master_id, host)
    pager = master.pager
    out = torch.empty_strided(host.shape, _output_strides(host), dtype=host.dtype, device=pager.device)
    if host.numel() == 0:
        return out
    if capturing(pager):
        # A captured graph replays without Python: the pager's cache cannot be consulted at replay,
        # so the graph copies from the master itself into memory it owns (the static slot of this
        # weight). Pinned memory keeps a fixed address and the copy reads whatever the master
        # holds at replay time.
        pager.copy_into_graph(out, host)
        return out
    held = []  # the record the pager commits its hold to (pager/__init__.py, "Exceptions")
    try:
        lo, hi = host_layout(host)[:2]
        private = not in_master(host, master)
        if hi - lo > host.numel() and not private:
            out.copy_(upload_compact(pager, host, "a compiled graph's weight", held))
        else:
            out.copy_(pager.page(host, master, "a compiled graph's weight", private, held=held)[0])
    finally:
        if held:
            # On a GPU the release event is recorded after the copy above, so the cached block is
            # evicted only once the copy has read it.
            pager.release([held[0][1]])
    return out


def page_traced(t: OffloadedTensor, host: torch.Tensor, master, pager) -> torch.Tensor:
    """The graph's ``page`` of ``t``, refused at trace time with the BudgetError eager raises
    where its bytes can never fit (more than the budget less the resident weights): the op's
    handler then cuts it in slices, each a ``page`` of its own in the graph, as eager does (a
    softmax, a sum or ``w * 2`` of a weight larger than the room). A page that fits when nothing
    else is held is left to run time, whose pager makes room for it."""
    budget = pager.budget_bytes
    if budget is not None and host.numel():
        lo, hi = host_layout(host)[:2]
        need = min(hi - lo, host.numel()) * host.element_size()  # a strided view is gathered compact (page)
        if isinstance(need, int) and need > budget - pager.budget.resident_bytes:
            raise pager.budget.shortfall_error(repr(t), need, 0, pager.device)
    return page(host, master.id, pager.device)


def _live_master(master_id: int, host: torch.Tensor):
    """The master a graph traced ``host`` with, or a clear error when it has since been freed."""
    master = registered_master(master_id)
    if master is None or master.pager is None:
        raise RuntimeError(
            f"offtensor: a compiled graph reads host master {master_id} ({tuple(host.shape)}, {host.dtype}), which no "
            f"longer exists: the OffloadedTensor it was traced with was freed or unwrapped. Compile the model again."
        )
    return master


def in_master(host: torch.Tensor, master) -> bool:
    """Whether ``host`` is memory of ``master``. A value the graph wrote to the weight earlier is
    not: functionalisation hands the ops after a traced write the written value, a host tensor of
    the graph's own, which reaches the master only at the graph's end (compiled_writes.py). The
    pager caches by master and range, so such a value is paged privately, past the cache."""
    flat = master.flat
    return flat is None or host.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


def capturing(pager) -> bool:
    """Whether the op is being recorded into a CUDA graph on ``pager``'s device (tests set it on the
    emulated device to run the capture path)."""
    return pager.capturing()


def _refuse_under_capture(pager, what: str, host: torch.Tensor, name=None) -> None:
    if capturing(pager):
        raise RuntimeError(
            f"offtensor: {what} on an offloaded {tuple(host.shape)} {host.dtype} table"
            f"{'' if name is None else ' ' + repr(name)} cannot be captured in a CUDA "
            f"graph: it pages the rows its index selects, which are only known when the index is read on the host, "
            f"and a replay runs no Python. Keep this weight resident (wrap_model(..., policy={{'keep': "
            f"[{'...' if name is None else repr(name)}]}})) to "
            f"capture, or run this step without CUDA graphs."
        )


@page.register_fake
def _page_fake(host, master_id, device):
    keep_dynamo_out_of_dispatch()
    return torch.empty_strided(host.shape, _output_strides(host), dtype=host.dtype, device=device)


# ---------------------------------------------------------------------------- index ops
#
# Index ops page only the rows (experts) their index selects, which only the index values say. In a
# graph each is one opaque op that takes the host view and runs the eager handler (rows.py,
# grouped.py) at run time; its fake kernel is the aten op on a device tensor of the host view's layout.

aten = torch.ops.aten


def _offloaded(host: torch.Tensor, master_id: int, what: str, pooled_rows: Optional[int] = None):
    master = _live_master(master_id, host)
    # Routed experts and embedding rows under CUDA graph capture: excluded, with this error, except
    # the experts of a call that a device-side expert pool serves (``pooled_rows`` routed rows):
    # that path makes no host decision (ops/expert_pool.py).
    if pooled_rows is None or not _pool_serves(master, pooled_rows):
        _refuse_under_capture(master.pager, what, host, master.name)
    if type(host) is torch.nn.Parameter:
        # The program of torch.export's run_decompositions passes each host view as the Parameter
        # it lifted it into. Real memory: paged as a plain alias, through the cache and within the
        # budget, where a Parameter would read as a tracing stand-in (is_traced) and be copied whole.
        host = host.detach()
    if not in_master(host, master):
        return page(host, master_id, master.pager.device)  # a value this graph wrote: past the cache
    return OffloadedTensor(host, master)


def _pool_serves(master, rows: int) -> bool:
    pools = master.pager.expert_pool
    return pools is not None and pools.serving(master.id, rows) is not None


def _device_like(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    keep_dynamo_out_of_dispatch()  # fake kernels run only while tracing
    return torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)


@torch.library.custom_op(f"{_LIB_NS}::embedding", mutates_args=())
def embedding(
    host: torch.Tensor, master_id: int, device: torch.device, indices: torch.Tensor, padding_idx: int,
    scale_grad_by_freq: bool, sparse: bool,
) -> torch.Tensor:
    return aten.embedding.default(_offloaded(host, master_id, "embedding"), indices, padding_idx, scale_grad_by_freq, sparse)


@embedding.register_fake
def _embedding_fake(host, master_id, device, indices, padding_idx, scale_grad_by_freq, sparse):
    return aten.embedding.default(_device_like(host, device), indices, padding_idx, scale_grad_by_freq, sparse)


@torch.library.custom_op(f"{_LIB_NS}::index_select", mutates_args=())
def index_select(host: torch.Tensor, master_id: int, device: torch.device, dim: int, index: torch.Tensor) -> torch.Tensor:
    return aten.index_select.default(_offloaded(host, master_id, "index_select"), dim, index)


@index_select.register_fake
def _index_select_fake(host, master_id, device, dim, index):
    return aten.index_select.default(_device_like(host, device), dim, index)


@torch.library.custom_op(f"{_LIB_NS}::index", mutates_args=())
def index(
    host: torch.Tensor, master_id: int, device: torch.device, indices: list[Optional[torch.Tensor]]
) -> torch.Tensor:
    return aten.index.Tensor(_offloaded(host, master_id, "indexing by a tensor"), indices)


@index.register_fake
def _index_fake(host, master_id, device, indices):
    return aten.index.Tensor(_device_like(host, device), indices)


@torch.library.custom_op(f"{_LIB_NS}::grouped_mm", mutates_args=())
def grouped_mm(
    x: torch.Tensor, host: torch.Tensor, master_id: int, device: torch.device, offs: Optional[torch.Tensor],
    bias: Optional[torch.Tensor], out_dtype: Optional[torch.dtype],
) -> torch.Tensor:
    expert = _offloaded(host, master_id, "_grouped_mm (routed experts)", None if bias is not None else x.shape[0])
    return aten._grouped_mm.default(x, expert, offs, bias, out_dtype)


@grouped_mm.register_fake
def _grouped_mm_fake(x, host, master_id, device, offs, bias, out_dtype):
    return aten._grouped_mm.default(x, _device_like(host, device), offs, bias, out_dtype)


def _call(schema_names, defaults):
    def bind(args, kwargs):
        call = dict(defaults)
        call.update(zip(schema_names, args))
        call.update(kwargs)
        return call

    return bind


def _traced_embedding(call):
    w = call["weight"]
    return embedding(w._host, w._master.id, w.device, call["indices"], call["padding_idx"],
                     call["scale_grad_by_freq"], call["sparse"])


def _traced_index_select(call):
    t = call["self"]
    return index_select(t._host, t._master.id, t.device, call["dim"], call["index"])


def _traced_index(call):
    t = call["self"]
    return index(t._host, t._master.id, t.device, list(call["indices"]))


def _traced_grouped_mm(call):
    w = call["mat2"]
    return grouped_mm(call["self"], w._host, w._master.id, w.device, call["offs"], call["bias"], call["out_dtype"])


# op -> (argument binder, the one argument that may be offloaded, traced call)
_TRACED_INDEX_OPS = {
    aten.embedding.default: (
        _call(("weight", "indices", "padding_idx", "scale_grad_by_freq", "sparse"),
              {"padding_idx": -1, "scale_grad_by_freq": False, "sparse": False}),
        "weight", _traced_embedding,
    ),
    aten.index_select.default: (_call(("self", "dim", "index"), {}), "self", _traced_index_select),
    aten.index.Tensor: (_call(("self", "indices"), {}), "self", _traced_index),
    aten._grouped_mm.default: (
        _call(("self", "mat2", "offs", "bias", "out_dtype"), {"offs": None, "bias": None, "out_dtype": None}),
        "mat2", _traced_grouped_mm,
    ),
}


def traced_index_op(func, args, kwargs):
    """The graph's opaque op for an index op whose one offloaded argument is its table (weight,
    expert stack); None when the call does not have that shape (the caller graph-breaks).

    An argument that needs a gradient (a trained embedding table, an MoE's input) does not keep the
    op out of the graph: ``__torch_dispatch__`` runs below autograd, which has already recorded the
    aten op's own formula on the OffloadedTensor (embedding's backward scatters gradient rows and
    reads no weight; ``_grouped_mm``'s pages the experts again through this dispatch), so the opaque
    op needs no formula of its own. torch.export, which traces with gradients on and has no graph to
    break, depends on this."""
    entry = _TRACED_INDEX_OPS.get(func)
    if entry is None:
        return None
    bind, table, traced = entry
    call = bind(args, kwargs)
    for name, value in call.items():
        values = value if isinstance(value, (list, tuple)) else (value,)
        for v in values:
            if isinstance(v, OffloadedTensor) and name != table:
                return None
    if not isinstance(call[table], OffloadedTensor):
        return None
    return traced(call)


# ---------------------------------------------------------------------------- whole compute ops
#
# A compute op whose arguments are all tensors (mm, addmm with default scalars, bmm, mul, ...) runs
# as one opaque op: at run time it is the eager op on the OffloadedTensors (page, compute, release),
# so the graph gets the op's result without first copying each paged weight into memory of its own.

_OPS_BY_NAME: dict = {}


def _op_named(name: str):
    op = _OPS_BY_NAME.get(name)
    if op is None:
        qualified, overload = name.rsplit(".", 1)
        namespace, op_name = qualified.split("::")
        op = _OPS_BY_NAME[name] = getattr(getattr(getattr(torch.ops, namespace), op_name), overload)
    return op


@torch.library.custom_op(f"{_LIB_NS}::compute", mutates_args=())
def compute(op: str, device: torch.device, tensors: list[Optional[torch.Tensor]], master_ids: list[int]) -> torch.Tensor:
    """``op`` on ``tensors``, those with a master id as the OffloadedTensors they are host views of."""
    return _compute_now(op, device, tensors, master_ids)


# The same for an op that returns several tensors (a backward op giving its input's and its
# weight's gradients: transformers' grouped_mm_fallback_backward).
@torch.library.custom_op(f"{_LIB_NS}::compute_tensors", mutates_args=())
def compute_tensors(
    op: str, device: torch.device, tensors: list[Optional[torch.Tensor]], master_ids: list[int]
) -> list[torch.Tensor]:
    return list(_compute_now(op, device, tensors, master_ids))


def _compute_now(op: str, device: torch.device, tensors, master_ids):
    pooled = tensors[0].shape[0] if _pooled_call(op, tensors, master_ids) else None
    if pooled is None and _capturing_any(master_ids):
        # Under CUDA graph capture each weight is copied from its master into graph memory (page).
        args = [t if m < 0 else page(t, m, device) for t, m in zip(tensors, master_ids)]
    else:
        args = [t if m < 0 else _offloaded(t, m, op, pooled) for t, m in zip(tensors, master_ids)]
    return _op_named(op)(*args)


def _pooled_call(op: str, tensors, master_ids) -> bool:
    """transformers' grouped GEMM fallback on a stack that an expert pool serves: under capture it
    runs from the pool (no host decision) instead of copying the whole stack into the graph."""
    if op != "transformers::grouped_mm_fallback.default" or len(master_ids) < 2 or master_ids[1] < 0:
        return False
    master = registered_master(master_ids[1])
    return master is not None and master.pager is not None and _pool_serves(master, tensors[0].shape[0])


def _capturing_any(master_ids) -> bool:
    for m in master_ids:
        master = registered_master(m) if m >= 0 else None
        if master is not None and master.pager is not None and capturing(master.pager):
            return True
    return False


@compute.register_fake
def _compute_fake(op, device, tensors, master_ids):
    args = [t if m < 0 else _device_like(t, device) for t, m in zip(tensors, master_ids)]
    return _op_named(op)(*args)


@compute_tensors.register_fake
def _compute_tensors_fake(op, device, tensors, master_ids):
    return list(_compute_fake(op, device, tensors, master_ids))


def traced_compute(func, args, kwargs):
    """The graph's opaque op for a compute op on traced OffloadedTensors, or None when its arguments
    are not all tensors (the caller then pages each argument through ``page``)."""
    returns = func._schema.returns
    if kwargs or not returns or any(str(r.type) != "Tensor" for r in returns):
        return None
    device = None
    tensors, master_ids = [], []
    for a in args:
        if isinstance(a, OffloadedTensor):
            device = a.device
            tensors.append(a._host)
            master_ids.append(a._master.id)
        elif a is None or isinstance(a, torch.Tensor):
            tensors.append(a)
            master_ids.append(-1)
        else:
            return None
    if device is None:
        return None
    name = f"{func._schema.name}.{func._overloadname}"
    if len(returns) > 1:
        return tuple(compute_tensors(name, device, tensors, master_ids))
    return compute(name, device, tensors, master_ids)


# ---------------------------------------------------------------------------- prefetch step marks

# Pagers whose prefetch schedule a compiled graph marks steps of, by a key the graph holds as a constant.
_PAGERS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()


def register_pager(pager) -> int:
    """The key a compiled graph marks ``pager``'s steps by (an int: Dynamo keeps it as a constant)."""
    _PAGERS[id(pager)] = pager
    return id(pager)


# ``anchor``, an empty tensor on the pager's device, is read by nothing: it gives the op a device.
# Inductor flushes its pending fused kernels before an op on a device only; before one on none it
# freed a fused kernel's inputs first, and the kernel, emitted after, read freed names (a compiled
# conv with weights that need gradients raised UnboundLocalError on torch 2.13).
@torch.library.custom_op(f"{_LIB_NS}::new_step", mutates_args=())
def _new_step_op(anchor: torch.Tensor, pager_key: int) -> None:
    pager = _PAGERS.get(pager_key)
    if pager is not None:
        pager.new_step()


@_new_step_op.register_fake
def _new_step_fake(anchor, pager_key):
    return None


# The op returns nothing: without this, dead-code elimination would drop it from the graph.
torch.fx.node.has_side_effect(torch.ops.offtensor.new_step.default)


_dispatch_frames_skipped = False


def keep_dynamo_out_of_dispatch() -> None:
    """Tell Dynamo never to compile OffloadedTensor's ``__torch_dispatch__``/``__torch_function__``
    frames, nor anything they call.

    After a graph break an op on an OffloadedTensor runs eagerly, but Dynamo still intercepts the
    Python frames that op enters and would try to compile the pager as user code. Called (once) from
    code that only runs while Dynamo is tracing, so importing offtensor does not import Dynamo.
    Dynamo still inlines ``__torch_function__`` symbolically when it traces user code; this only
    concerns frames that actually run.
    """
    global _dispatch_frames_skipped
    if _dispatch_frames_skipped:
        return
    _dispatch_frames_skipped = True
    methods = ("__torch_dispatch__", "__torch_function__")
    try:
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy
    except ImportError:  # an older or newer Dynamo: the public (slower) route
        for name in methods:
            method = getattr(OffloadedTensor, name).__func__
            setattr(OffloadedTensor, name, classmethod(torch.compiler.disable(method)))
        return
    for name in methods:
        code = getattr(OffloadedTensor, name).__func__.__code__
        set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))


def is_traced(t: torch.Tensor) -> bool:
    """Whether ``t`` (an OffloadedTensor's host view) is a tracing stand-in (fake or functional
    tensor) rather than real host memory. In eager mode ``_host`` is always a plain tensor."""
    return type(t) is not torch.Tensor


def graph_break(what: str) -> None:
    """Make Dynamo run the current op eagerly (a graph break) instead of tracing it.

    Raised while Dynamo computes the op's example value, ``Unsupported`` ends the graph before the
    op, which then runs in eager mode, with its real paging, and tracing resumes after it. Past
    Dynamo (AOTAutograd, export, make_fx) there is no graph to break, so the error says what to do.
    """
    from torch._dynamo.exc import Unsupported

    keep_dynamo_out_of_dispatch()
    if _may_not_break():
        raise Unsupported(
            f"offtensor: {what} cannot be traced, and this graph may not break (torch.compile(..., fullgraph=True)), "
            f"so the op cannot run eagerly either. Write an offloaded weight with copy_ (traced: torchao's low-bit "
            f"optimizers step offloaded weights so), keep the offloaded weights this code writes resident "
            f"(ot.wrap_model(..., policy={{'keep': [...]}})), or run it uncompiled")
    raise Unsupported(
        f"offtensor: {what} cannot be traced; it runs eagerly. To avoid the break, keep offloaded weights out of "
        f"this op or wrap the code around it in torch.compiler.disable"
    )


def _may_not_break() -> bool:
    """Whether the frame Dynamo is tracing may not break its graph (``fullgraph=True``): there the
    break ``graph_break`` asks for is an error, and "it runs eagerly" would not be true. Read from
    Dynamo's own translator; where this Dynamo has none to read, False."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except (ImportError, AttributeError):
        return False
    return bool(getattr(tx, "one_graph", False) or getattr(tx, "error_on_graph_break", False))
