"""View ops: they never page. A view of an OffloadedTensor is an OffloadedTensor aliasing the same host
master (the op runs on the host view); an in-place view op changes the host view's and the wrapper's
metadata together. The transposes model code takes of a weight at every call (``w.t()``,
``stack.transpose(-2, -1)``) are memoized on the weight: the same view object again while nothing
changed, instead of a new wrapper through the dispatcher each call."""

from __future__ import annotations

import math

import torch
from torch.utils._mode_utils import no_dispatch

from .. import cast_views
from ..tensor import OffloadedTensor, new_view
from .table import implements

aten = torch.ops.aten
_functionalize_unsafe_set = torch._functionalize_unsafe_set
_inference = torch.is_inference_mode_enabled
_COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd
_CASTS = cast_views.ALIVE


def view(func, types, args, kwargs):
    self = args[0]
    if not isinstance(self, OffloadedTensor) and func.has_kernel_for_dispatch_key(_COMPOSITE):
        # A composite view of a plain tensor shaped by an offloaded one (``x.expand_as(weight)`` in
        # F.normalize, ``x.view_as(weight)``), reached whole under inference_mode: it views ``self``,
        # the weight lends only its sizes; its decomposition is what a plain tensor runs.
        return func._op_dk(_COMPOSITE, *args, **kwargs)
    out = func(self._host, *args[1:], **kwargs)
    if _CASTS[0] and "_cast" in self.__dict__ and (out if isinstance(out, torch.Tensor) else out[0]).dtype != self._host.dtype:
        # A view that reinterprets a lazy cast's bytes (``view(dtype)``, ``view_as_real``): of
        # the cast values, which a master of its own holds first.
        cast_views.resolve(self)
        return view(func, types, args, kwargs)
    if _inference() and not (out if isinstance(out, torch.Tensor) else out[0]).is_inference():
        # In inference mode, most views of a normal tensor are normal tensors (autograd's view
        # kernel then gives them the base's version counter, which an inference tensor has none
        # of); the host view just made says whether this one is, and the wrapper is made to match.
        with torch.inference_mode(False):
            return _wrappers(self, out)
    return _wrappers(self, out)


def _wrappers(self: OffloadedTensor, out):
    """OffloadedTensor views of ``self``'s master over the host view(s) ``out``."""
    master = self._master
    if _CASTS[0] and "_cast" in self.__dict__:  # a view of a lazy cast is one too (cast_views)
        if isinstance(out, torch.Tensor):
            return _alias_of(self, cast_views.derived(self, out))
        return type(out)(_alias_of(self, cast_views.derived(self, o)) for o in out)
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


def inplace_view(func, types, args, kwargs):
    self = args[0]
    func(self._host, *args[1:], **kwargs)
    self.__dict__.pop("_layout", None)  # the memoized paging layout of the old metadata
    metadata_changed()
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


def resize_within_master(t: OffloadedTensor, size, memory_format=torch.contiguous_format) -> bool:
    """What ``resize_`` does to a tensor whose storage is large enough (``mm_out`` resizing a 1-D
    out= to (1, n) and squeezing it back, say): give ``t`` the layout of ``size`` in place at its
    storage offset. False when that needs bytes past the end of its host master, which never grows."""
    if not fits_master(t, size):
        return False
    layout = torch.empty(tuple(size), dtype=t._host.dtype, device="meta", memory_format=memory_format)
    inplace_view(aten.as_strided_.default, (), (t, layout.shape, layout.stride(), t._host.storage_offset()), {})
    return True


def fits_master(t: OffloadedTensor, size) -> bool:
    """Whether ``t`` resized to ``size`` at its storage offset stays within its host master."""
    host = t._host
    return (host.storage_offset() + math.prod(size)) * host.element_size() <= host.untyped_storage().nbytes()


# reshape() of a non-viewable tensor is clone + _unsafe_view; the clone is already a fresh
# OffloadedTensor, so keep the reshape on the host too instead of paging it.
implements(aten._unsafe_view.default)(view)

# Real views whose schemas declare no alias ("unsafe": autograd does not track them as views):
# on plain tensors their results share the input's memory, so here they are host views too.
implements(aten.unsafe_split.Tensor, aten.unsafe_split_with_sizes.default)(view)


# ---------------------------------------------------------------------------- memoized transposes

# Bumped whenever an OffloadedTensor's metadata changes in place (an in-place view op, the ``.data``
# setter): every memoized view made before is stale, whichever tensor changed (the weight or the
# view handed out). In-place metadata changes are rare, so one counter is cheaper than tracking
# which view came from which weight.
_EPOCH = [0]

_Tensor = torch.Tensor
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_modes = torch._C._is_torch_function_mode_enabled
_grad = torch.is_grad_enabled
# A torch.func transform would wrap the view's host view (ops/functions.py, under_transform).
_under_transform = torch._C._are_functorch_transforms_active
_GRAD = torch._C.TensorBase.grad.__get__
_VIEW_TYPES = (OffloadedTensor,)


def _grad_of(t: torch.Tensor):
    """``t.grad`` without the torch-function protocol (the C read, as tensor.py's metadata reads)."""
    return torch._C._disabled_torch_function_impl(_GRAD, _VIEW_TYPES, (t,), {})


def metadata_changed() -> None:
    _EPOCH[0] += 1


def memoized_view(function):
    """Whole-function handler for a transpose method (``Tensor.t``, ``Tensor.transpose``): the view
    made the last time with these arguments while no metadata changed in place, else a new one
    (kept for next time). Only with grad off (``torch.no_grad()``, as ``generate`` runs: no graph
    records the view, and it needs no gradient, as a plain view made there does not), for a tensor
    that is no tracing stand-in (its host view a fake tensor), with no torch function or dispatch
    mode on (FakeTensorMode, a tracer, a user's mode must see the op); else NotImplemented, and the
    op dispatches as before. Weights that need a gradient are memoized too (transformers' weights
    do, even in eval): their view needs a gradient as a plain one made under no_grad does (a leaf),
    and is made again once it holds one. The view is no autograd view of the weight (``_base`` is
    None), and it has a version counter of its own."""

    def handler(args, kwargs):
        self = args[0]
        if (kwargs or _grad() or type(self) is not OffloadedTensor or _inference() or _dispatch_modes()
                or _function_modes() or _under_transform()):
            return NotImplemented
        own = self.__dict__
        if type(own["_host"]) is not _Tensor or (_CASTS[0] and "_cast" in own):
            return NotImplemented
        key = (function, args[1:])
        memo = own.get("_views")
        if memo is None:
            memo = own["_views"] = {}
        else:
            hit = memo.get(key)
            if hit is not None and hit[0] == _EPOCH[0]:
                out = hit[1]
                needs_grad = self.requires_grad
                if out.requires_grad is needs_grad and (not needs_grad or _grad_of(out) is None):
                    return out
        # Made on the host view, as ``view`` makes it, but not through the dispatcher: that view
        # would hold its base (autograd's ``_base``), and the base holds the memo, a cycle through
        # C++ that no garbage collection breaks. Its wrapper storage is the base's.
        out = _alias_of(self, new_view(function(own["_host"], *args[1:]), own["_master"], self.requires_grad))
        memo[key] = (_EPOCH[0], out)
        return out

    return handler
