"""Collectives on OffloadedTensors: c10d and functional collectives with offloaded arguments at any
list depth are paged, waited for and written back, and a BackendSelect kernel finds offloaded tensors
that only a nested ``Tensor[][]`` argument carries."""

from __future__ import annotations

import torch

from ..tensor import OffloadedTensor
from .p2p import is_point_to_point, point_to_point, takes_async_path
from .paging import Paged, write_back


# ---------------------------------------------------------------------------- collectives

COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")

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


class Collective:
    """A c10d or functional collective with OffloadedTensor arguments, at any list depth
    (``scatter_`` takes ``Tensor[][]``): each is paged (privately where the op writes it), the op
    runs and is waited for, so the paged copies and their host sources outlive the transfer, and
    written arguments go back to their host masters; the results name the OffloadedTensors again.

    An asynchronous collective (``async_op=True``) on an OffloadedTensor therefore completes before
    it returns: its write-back needs the transfer done. Point-to-point sends and receives are the
    exception: they return at once (``p2p.py``), since an exchange whose ranks each send before
    they receive deadlocks if a send waits for its peer's receive."""

    def __init__(self, func):
        self.func = func
        names = [a.name for a in func._schema.arguments]
        if func.namespace == "c10d":
            writes = _C10D_WRITES.get(func._opname)
        else:  # functional collectives declare their writes (all_reduce_, the out= variants)
            writes = tuple(a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write)
        self.written = None if writes is None else {i for i, n in enumerate(names) if n in writes} | set(writes)
        self.point_to_point = is_point_to_point(func)
        self.__name__ = f"collective({func})"

    def __call__(self, func, types, args, kwargs, run=None):
        """``run`` calls the op on the paged arguments (default ``func``; the nested-list kernel
        below passes a redispatch past itself)."""
        if self.written is None:
            raise NotImplementedError(
                f"offtensor: {func} with an OffloadedTensor argument is not supported: which of its arguments it "
                f"writes is not known. Run it on t.materialize() and copy_ the result back into the OffloadedTensor"
            )
        if self.point_to_point and run is None and takes_async_path(args, kwargs):
            return point_to_point(func, args, kwargs)
        paged = Paged()
        originals = {}  # id(paged copy of a written argument) -> its OffloadedTensor
        try:
            new_args = [_page_nested(paged, a, i in self.written, originals) for i, a in enumerate(args)]
            new_kwargs = {k: _page_nested(paged, v, k in self.written, originals) for k, v in kwargs.items()}
            out = (run or func)(*new_args, **new_kwargs)
            out = _wait_collective(out, func.namespace != "c10d")
            for t, device_copy in paged.private:
                write_back(t, device_copy)
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
        self.collective = Collective(op)
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


def _page_nested(paged: Paged, value, written: bool, originals: dict):
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
