"""Ops that read an OffloadedTensor without paging it through the general rule: copies, casts and
values read from the host master (``clone``, ``.to(dtype)``, ``.to("cpu")``, ``item``), factories
that read only metadata (``zeros_like``, ``new_empty``...), questions about memory and shape
(``is_set_to``, ``is_same_size``, ``is_pinned``, ``record_stream``), and lazy conjugate/negative
bits resolved."""

from __future__ import annotations

import torch

from .. import cast_views
from ..pager import pins_host_memory
from ..tensor import OffloadedTensor, new_host_master, wrap_host
from .paging import run
from .views import view
from .table import implements

aten = torch.ops.aten


@implements(aten.clone.default)
def _clone(func, types, args, kwargs):
    self = args[0]
    host = self._host
    # The strides a plain clone gets, empty_like's: a layout with gaps keeps its order of dims
    # (``w.t()[::2].clone()`` is no contiguous tensor); the master's own rule would make it one.
    layout = torch.empty_like(host, device="meta", memory_format=kwargs.get("memory_format") or torch.preserve_format)
    pager = self._master.pager
    return wrap_host(new_host_master(host, pin=pins_host_memory(pager.device), strides=layout.stride()), pager)


@implements(aten._to_copy.default)
def _to_copy(func, types, args, kwargs):
    self = args[0]
    device = kwargs.get("device")
    if device is not None and torch.device(device).type == "cpu":
        # .cpu() / .to("cpu"): read the host master, no device round trip (a lazy cast's values
        # are its master's, cast).
        cast = self.__dict__.get("_cast")
        return func(self._host if cast is None else self._host.to(cast.dtype), *args[1:], **kwargs)
    if device is not None and torch.device(device).type == "meta":
        # .to("meta") (a module skeleton for torch.func's functional_call): metadata only, nothing
        # paged, as for a plain tensor.
        stand_in = torch.empty_strided(self.shape, self.stride(), dtype=self.dtype, device="meta")
        return func(stand_in, *args[1:], **kwargs)
    if cast_views.lazily(self, kwargs):
        # Autocast's cast of a weight it keeps (cache, autograd): a lazy cast, paged and cast per op.
        return cast_views.cast_view(self, kwargs["dtype"])
    return run(func, args, kwargs)


@implements(aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.to.other)
def _to(func, types, args, kwargs):
    # Its schema returns an alias (``Tensor(a)``), which would make it a view here; but a cast is a
    # new tensor. It reaches __torch_dispatch__ from inside another subclass's __torch_dispatch__
    # (torchao's dequantise calls ``qdata.to(float32)``): run torch's own composite, which returns
    # ``self`` for a no-op and otherwise calls ``_to_copy`` (a plain tensor, paged at its own size).
    return func.decompose(*args, **kwargs)


def _overloads(*packets, names=None):
    return [getattr(p, o) for p in packets for o in p.overloads() if o in (names or p.overloads())]


# Factories shaped like their argument: its shape, strides, dtype and device, never its values.
_LIKE = _overloads(aten.empty_like, aten.zeros_like, aten.ones_like, aten.full_like, aten.rand_like,
                   aten.randn_like, aten.randint_like, names=("default", "generator", "Tensor", "low_dtype",
                                                               "Tensor_generator", "low_generator_dtype"))
# Factories that take only their argument's dtype and device.
_NEW = _overloads(aten.new_empty, aten.new_zeros, aten.new_ones, aten.new_full, aten.new_empty_strided,
                  names=("default",))


@implements(*_LIKE, *_NEW)
def _factory(func, types, args, kwargs):
    # An optimizer's ``zeros_like(param)`` would otherwise page the whole weight only to read its
    # metadata, and fail for one larger than the budget's free room. A device tensor of the same
    # layout stands in (uninitialised: the op reads none of its values).
    self = args[0]
    if not isinstance(self, OffloadedTensor) or any(isinstance(a, OffloadedTensor) for a in args[1:]):
        return run(func, args, kwargs)
    host = self._host
    # (the wrapper's dtype: a lazy cast's host view holds its weight's)
    if func in _NEW_SET:
        stand_in = torch.empty(0, dtype=self.dtype, device=self.device)
    else:
        stand_in = torch.empty_strided(host.shape, host.stride(), dtype=self.dtype, device=self.device)
    return func(stand_in, *args[1:], **kwargs)


_NEW_SET = frozenset(_NEW)


@implements(aten._local_scalar_dense.default)
def _item(func, types, args, kwargs):
    return args[0]._host.item()


@implements(aten.is_set_to.default)
def _is_set_to(func, types, args, kwargs):
    # A question about memory: the general rule would page both arguments and compare two fresh
    # device copies, never the same memory (``w.is_set_to(w)`` was False). The host views answer
    # it; a plain tensor never views a host master.
    self, other = args
    if isinstance(self, OffloadedTensor) and isinstance(other, OffloadedTensor):
        return self._host.is_set_to(other._host)
    return False


@implements(aten.is_same_size.default)
def _is_same_size(func, types, args, kwargs):
    # A question about shapes (forward AD asks it of a primal and its tangent): the general rule
    # would page both arguments whole, and raise BudgetError for a weight larger than the room.
    return tuple(args[0].shape) == tuple(args[1].shape)


@implements(aten.is_pinned.default)
def _is_pinned(func, types, args, kwargs):
    return False  # a device tensor from the caller's point of view


@implements(aten.record_stream.default)
def _record_stream(func, types, args, kwargs):
    return None  # paged copies are freed by the pager's events, never by the caller's streams


@implements(aten._conj.default, aten._neg_view.default)
def _lazy_bit_view(func, types, args, kwargs):
    # A real view, as on a plain tensor: the host view and the wrapper carry the conjugate or
    # negative bit (tensor._wrapper), so a write through it (``w.conj().mul_(2)``) reaches the
    # master through torch's own fallback, and it is made in inference mode as other views are.
    # Paging gives the device view the same bit over the master's raw bytes (paging.Paged.page).
    return view(func, types, args, kwargs)


@implements(aten.resolve_conj.default, aten.resolve_neg.default)
def _resolve_bit(func, types, args, kwargs):
    # Its schema says it returns an alias, which it is only when there is no bit to resolve;
    # otherwise it is a new tensor with the values, as for a plain tensor (on the device).
    self = args[0]
    bit = self._host.is_conj() if func is aten.resolve_conj.default else self._host.is_neg()
    return run(func, args, kwargs) if bit else self
