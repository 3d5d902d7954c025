"""View ops: they never page. A view of an OffloadedTensor is an OffloadedTensor aliasing the same host
master (the op runs on the host view); an in-place view op changes the host view's and the wrapper's
metadata together."""

from __future__ import annotations

import torch
from torch.utils._mode_utils import no_dispatch

from ..tensor import OffloadedTensor, new_view
from .table import implements

aten = torch.ops.aten
_functionalize_unsafe_set = torch._functionalize_unsafe_set


def view(func, types, args, kwargs):
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


def inplace_view(func, types, args, kwargs):
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


def resize_within_master(t: OffloadedTensor, size, memory_format=torch.contiguous_format) -> bool:
    """What ``resize_`` does to a tensor whose storage is large enough (``mm_out`` resizing a 1-D
    out= to (1, n) and squeezing it back, say): give ``t`` the layout of ``size`` in place at its
    storage offset. False when that needs bytes past the end of its host master, which never grows."""
    host = t._host
    layout = torch.empty(tuple(size), dtype=host.dtype, device="meta", memory_format=memory_format)
    offset = host.storage_offset()
    if (offset + layout.numel()) * host.element_size() > host.untyped_storage().nbytes():
        return False
    inplace_view(aten.as_strided_.default, (), (t, layout.shape, layout.stride(), offset), {})
    return True


# reshape() of a non-viewable tensor is clone + _unsafe_view; the clone is already a fresh
# OffloadedTensor, so keep the reshape on the host too instead of paging it.
implements(aten._unsafe_view.default)(view)

# Real views whose schemas declare no alias ("unsafe": autograd does not track them as views):
# on plain tensors their results share the input's memory, so here they are host views too.
implements(aten.unsafe_split.Tensor, aten.unsafe_split_with_sizes.default)(view)
