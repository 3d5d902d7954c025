"""Whole ops intercepted at ``__torch_function__`` where that saves work: ``F.linear`` (one page-in
instead of ``t`` + ``addmm``), ``matmul``/``mm`` with grad off, ``.cpu()``, ``tolist``, the ``.data``
setter, ``tensor_split``'s host-read argument, and the memoized transposes of ``views``. ``FUNCTION_TABLE`` is what the class reads."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import cast_views
from ..pager import BudgetError, pins_host_memory
from ..tensor import OffloadedTensor, check_offloadable, new_host_master, wrap_host
from .expert_pool import pooled_grouped_mm, serving_pool
from .host_experts import expert_on_host, host_linear
from .paging import Paged, describe, reclaim
from .tiling import as_linear_weight, folds_without_copy, linear_tiled, needs_tiling
from .views import memoized_view, metadata_changed

aten = torch.ops.aten

# Whether a torch.func transform (jvp, grad, vmap, jacfwd...) is running. It sits between
# __torch_function__ and dispatch: ops a handler here runs are seen by it, and under jvp or grad
# every result, even of an op on a plain host view or pager buffer, comes back as a functorch
# TensorWrapper, which has no storage for the pager to copy from or keep alive. Handlers that page
# therefore step aside under a transform: the function decomposes as it would unwrapped, and its
# aten ops reach __torch_dispatch__ below the transform, on unwrapped arguments. (~0.1 us)
under_transform = torch._C._are_functorch_transforms_active


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
    if under_transform():
        return NotImplemented
    offloaded = isinstance(weight, OffloadedTensor)
    if offloaded:
        experts = weight._master.pager.experts
        if experts is not None and experts.compute != "device" and type(x) is torch.Tensor and x.dim():
            # One expert of a stack that a model selecting its experts one by one computes: from its
            # host master when it is not cached (host_experts.py).
            if expert_on_host(weight, x.numel() // max(x.shape[-1], 1)) is not None:
                return host_linear(x, weight, bias)
    try:
        if offloaded and weight._host.dim() == 2 and needs_tiling(weight, [x, bias]):
            return linear_tiled(x, weight, bias)
        paged = Paged()
        try:
            device_weight = paged.arg(weight)
            if offloaded:
                device_weight = as_linear_weight(x, weight, device_weight)
            return torch._C._nn.linear(paged.arg(x), device_weight, paged.arg(bias))
        finally:
            paged.release()
    except BaseException as error:  # torch_dispatch's net, for the ops intercepted here
        reclaim(error)
        if type(error) is BudgetError:
            # No tile of the weight fits beside its other arguments (an input larger than the
            # room): linear's aten ops, whose handlers run what does not fit on the host masters.
            return NotImplemented
        raise


def _grouped_mm(args, kwargs):
    """``torch._grouped_mm`` / ``F.grouped_mm`` of a stack an expert pool serves: straight to the
    pool (ops/expert_pool.py), without the dispatch of the aten op; anything else dispatches."""
    weight = args[1] if len(args) > 1 else kwargs.get("mat2", kwargs.get("mat_b"))
    if type(weight) is not OffloadedTensor:
        return NotImplemented
    x = args[0] if args else kwargs.get("self", kwargs.get("mat_a"))
    offs = args[2] if len(args) > 2 else kwargs.get("offs")
    if (type(x) is not torch.Tensor or type(offs) is not torch.Tensor or x.dim() != 2
            or weight.__dict__["_host"].dim() != 3 or (len(args) > 3 and args[3] is not None) or kwargs.get("bias") is not None
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)) or under_transform()):
        return NotImplemented
    pool = serving_pool(weight, x.shape[0])
    if pool is None:
        return NotImplemented
    return pooled_grouped_mm(None, pool, weight, x, offs, args[4] if len(args) > 4 else kwargs.get("out_dtype"))


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
        elif b_dim > 2 or (a_dim > 2 and (a is not hosts[0] or not folds_without_copy(a))):
            return NotImplemented
        if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad) or under_transform():
            return NotImplemented  # autograd (a transform) must see the OffloadedTensor (see _linear)
        if needs_tiling(b, [a]) or needs_tiling(a, [b]):
            return NotImplemented  # tiling.mm computes it in tiles
        paged = Paged()
        try:
            try:
                return product(paged.arg(a), paged.arg(b))
            finally:
                paged.release()
        except BaseException as error:  # torch_dispatch's net, for the ops intercepted here
            reclaim(error)
            raise

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
    if not isinstance(args[0], OffloadedTensor):
        return NotImplemented
    cast_views.resolve_args(args, kwargs)
    return args[0]._host.tolist()


def _named(t: OffloadedTensor) -> str:
    return f"{describe(t)} ({t.numel() * t.element_size()} bytes, in host memory paged to {t.device} per op)"


def _numpy(args, kwargs):
    """``Tensor.numpy`` (and ``np.asarray``, through ``__array__``), which torch refuses for every
    subclass. On the emulated device, where a plain tensor's array shares its memory, the array
    views the host master, read-only: a write into it would bypass the pager and leave cached
    device copies stale, so numpy refuses it instead of losing it. On a GPU, as for a plain device
    tensor, only ``force=True`` converts (a copy)."""
    self = args[0]
    if not isinstance(self, OffloadedTensor):
        return NotImplemented
    cast_views.resolve_args(args, kwargs)
    force = kwargs.get("force", False)
    if self.device.type != "cpu":
        if force:
            return self.detach().cpu().resolve_conj().resolve_neg().numpy()
        raise TypeError(
            f"offtensor: can't convert {_named(self)} to numpy: like any {self.device.type} tensor it needs a "
            f"copy in host memory first: .detach().cpu() (read from its host master, nothing paged) or "
            f".numpy(force=True); to change a wrapped model's weights on the host, use `with ot.on_host(model):`"
        )
    host = self._host
    if force:
        host = host.resolve_conj().resolve_neg()  # a copy where it has lazy bits, as for a plain tensor
    elif self.requires_grad:
        raise RuntimeError("Can't call numpy() on Tensor that requires grad. Use tensor.detach().numpy() instead.")
    array = host.numpy()
    if host is self._host:  # no copy was made: the array is the master's memory
        array.flags.writeable = False
    return array


def _python_elementwise(method):
    """``Tensor.apply_`` / ``map_`` / ``map2_``: a Python function over each element, which torch runs
    on CPU memory directly (a wrapper has none: "Cannot access data pointer"). On the emulated
    device the host master is the memory: the function runs there and the cached device copies are
    dropped first, as before any write. On a GPU, as for a plain device tensor, it is refused."""
    name = method.__name__

    def handler(args, kwargs):
        tensors = args[:-1]
        for t in tensors:
            if isinstance(t, OffloadedTensor) and t.device.type != "cpu":
                raise TypeError(f"offtensor: {name} runs a Python function over each element in host memory, which "
                                f"torch does only for CPU tensors, and {_named(t)} is a {t.device.type} tensor; "
                                f"to change a wrapped model's weights on the host, use `with ot.on_host(model):`")
        if any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors):
            raise RuntimeError(f"Can't call {name}() on Variable that requires grad. Use var.detach().{name}() instead.")
        cast_views.resolve_args(tensors, {})
        self = tensors[0]
        if isinstance(self, OffloadedTensor):
            self._master.pager.before_write(self._master)
        method(*(t._host if isinstance(t, OffloadedTensor) else t for t in tensors), args[-1], **kwargs)
        return self

    return handler


def _array(args, kwargs):
    """``Tensor.__array__`` (``np.asarray``), which calls ``numpy()`` with torch functions off."""
    if not isinstance(args[0], OffloadedTensor):
        return NotImplemented
    dtype = args[1] if len(args) > 1 else kwargs.get("dtype")
    array = _numpy(args[:1], {})
    return array if dtype is None else array.astype(dtype, copy=False)


def _dlpack(args, kwargs):
    """``Tensor.__dlpack__`` (``np.from_dlpack``, ``torch.from_dlpack``, JAX, CuPy): an
    OffloadedTensor has no memory of its own to share, so only an export that may copy
    (``copy=True``) is made, of a device copy (``materialize``); otherwise a ``BufferError``
    that names the tensor, where C++ would have refused its data pointer."""
    self = args[0]
    if not isinstance(self, OffloadedTensor):
        return NotImplemented
    if self.requires_grad:
        raise BufferError("Can't export tensors that require gradient, use tensor.detach()")
    if self.is_conj():
        raise BufferError("Can't export tensors with the conjugate bit set")
    if not kwargs.get("copy"):
        raise BufferError(
            f"offtensor: can't export {_named(self)} through DLPack without a copy: it has no memory of "
            f"its own to share. Export a copy: copy=True, .materialize() (on {self.device}) or .detach().cpu()"
        )
    return self.materialize().__dlpack__(**{**kwargs, "copy": None})


def _set_data(args, kwargs):
    """``x.data = value`` (``module.half()``, weight post-processing): torch would copy only the
    wrapper's metadata and leave ``_host`` behind, so dtype and shape would describe bytes the
    master does not hold. Re-point the wrapper at ``value``'s master instead, offloading a plain
    ``value`` to a new exact-size master first; the object (and every reference to it) stays."""
    self, value = args
    if not isinstance(self, OffloadedTensor) or not isinstance(value, torch.Tensor):
        return NotImplemented
    cast_views.resolve_args(args, kwargs)
    if not isinstance(value, OffloadedTensor):
        check_offloadable(value)
        pager = self._master.pager
        value = wrap_host(new_host_master(value, pin=pins_host_memory(pager.device)), pager)
    with torch._C.DisableTorchFunctionSubclass():
        torch.Tensor.data.__set__(self, value)  # the wrapper's sizes, strides and dtype
    self._host, self._master = value._host, value._master
    self.__dict__.pop("_layout", None)
    metadata_changed()
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
        cast_views.resolve_args((value,), {})
        if len(args) > position:
            args = args[:position] + (value._host,) + args[position + 1 :]
        else:
            kwargs = {**kwargs, name: value._host}
        return torch._C._disabled_torch_function_impl(function, (), args, kwargs)

    return {function: handler}


def _attention(args, kwargs):
    """``F.scaled_dot_product_attention`` with a query, key or value of the model's own larger than
    the free room. Its math path reads each by ops that cut a batch of matrices
    (``k.transpose(-2, -1) * scale`` one matrix at a time, then bmm's tiles); narrower cuts of one
    matrix sum in another order, so below one matrix the op is refused, naming the budget that
    runs it. Arguments that fit the room whole pass with one bound check each."""
    call = dict(zip(("query", "key", "value"), args), **kwargs)
    named = {}
    for role in ("query", "key", "value"):
        t = call.get(role)
        if isinstance(t, OffloadedTensor) and t.dim() > 1 and needs_tiling(t, ()):
            named.setdefault(id(t._master), [t, []])[1].append(role)
    for t, roles in named.values():
        pager = t._master.pager
        matrix = t.shape[-2] * t.shape[-1] * t.element_size()
        room = pager.free_bytes()
        if matrix > room:
            raise BudgetError(
                f"offtensor: scaled_dot_product_attention reads {describe(t)} ({t.numel() * t.element_size()} bytes) "
                f"as its {' and '.join(roles)}, larger than the budget's free room of {room} bytes; attention over it "
                f"runs where one matrix of it ({matrix} bytes) fits, from a budget of "
                f"{pager.budget_bytes - room + matrix} bytes. Raise budget_gb, or keep it resident (policy={{'keep': [...]}}).")
    return NotImplemented


FUNCTION_TABLE = {
    F.scaled_dot_product_attention: _attention,
    F.linear: _linear,
    torch._C._nn.linear: _linear,
    torch.matmul: _matrix_product(torch.matmul),
    torch.Tensor.matmul: _matrix_product(torch.matmul),  # also what `a @ b` arrives as
    torch.mm: _matrix_product(torch.mm),
    torch.Tensor.mm: _matrix_product(torch.mm),
    torch._grouped_mm: _grouped_mm,
    **({F.grouped_mm: _grouped_mm} if hasattr(F, "grouped_mm") else {}),
    torch.Tensor.cpu: _cpu,
    torch.Tensor.tolist: _tolist,
    torch.Tensor.numpy: _numpy,
    torch.Tensor.__array__: _array,
    torch.Tensor.__dlpack__: _dlpack,
    **{m: _python_elementwise(m) for m in (torch.Tensor.apply_, torch.Tensor.map_, torch.Tensor.map2_)},
    torch.Tensor.data.__set__: _set_data,
    torch.Tensor.t: memoized_view(torch.Tensor.t),
    torch.Tensor.transpose: memoized_view(torch.Tensor.transpose),
    **_host_read_argument(torch.tensor_split, 1, "indices_or_sections"),
    **_host_read_argument(torch.Tensor.tensor_split, 1, "indices_or_sections"),
}
