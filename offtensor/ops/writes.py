"""Ops that write an OffloadedTensor: in-place and ``out=`` ops run on private device copies and write
back to the host master (``Mutation``); loaders' ``copy_`` and ``index_put_`` write the host master
directly; batch norm's running stats, ``resize_`` within the master and ``set_`` (refused)."""

from __future__ import annotations

import torch
from torch.utils._mode_utils import no_dispatch

from ..tensor import OffloadedTensor
from .paging import decomposes, describe, run, write_master
from .row_writes import ROW_WRITES
from .table import implements
from .views import resize_within_master

aten = torch.ops.aten


def written_arguments(schema) -> dict:
    """The arguments an op's schema says it writes: position -> name."""
    return {i: a.name for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write}


class Mutation:
    """Handler for an op that writes some of its arguments (in-place and out= ops)."""

    def __init__(self, func):
        schema = func._schema
        self.positions = written_arguments(schema)
        self.outs = {i for i in self.positions if schema.arguments[i].is_out}  # the out= arguments among them
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
        # A composite (``fft_hfft2.out`` under inference mode, ``linalg_pinv.out``) is decomposed
        # inside the handler: with the lazy-bit fallbacks on (paging.with_math_bits).
        self.composite = decomposes(func)
        # ``param.add_(sparse_grad)``, ``embedding_renorm_``: only the rows another argument names
        # change (row_writes.py).
        self.rows = ROW_WRITES.get(func)

    def __call__(self, func, types, args, kwargs, also_written=()):
        if self.rows is not None and self.rows[0](args):
            return self.rows[1](func, args, kwargs)
        # also_written: arguments the op writes although its schema does not say so.
        written = set(also_written)
        outs = set()
        for i, name in self.positions.items():
            value = args[i] if i < len(args) else kwargs.get(name)
            if _has_offloaded(value):
                key = i if i < len(args) else name
                written.add(key)
                if i in self.outs:
                    outs.add(key)
        if not written:
            return run(func, args, kwargs)
        out = run(func, args, kwargs, written, outs, self.composite)
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


_BATCH_NORM_MUTATIONS: dict = {}


@implements(
    aten.native_batch_norm.default,
    aten.native_batch_norm.out,
    aten.cudnn_batch_norm.default,
    aten.miopen_batch_norm.default,
)
def batch_norm(func, types, args, kwargs):
    # These schemas do not mark running_mean/running_var as written, yet training updates them in
    # place: write offloaded running stats back like any in-place op (only then, so eval keeps
    # their cached copies).
    call = dict(zip(("input", "weight", "bias", "running_mean", "running_var", "training"), args), **kwargs)
    written = set()
    if call.get("training"):
        written = {i for i in (3, 4) if i < len(args) and isinstance(args[i], OffloadedTensor)}
    mutation = _BATCH_NORM_MUTATIONS.get(func)
    if mutation is None:
        mutation = _BATCH_NORM_MUTATIONS[func] = Mutation(func)
    return mutation(func, types, args, kwargs, written)


@implements(aten.copy_.default)
def copy_(func, types, args, kwargs):
    dst, src = args[0], args[1]
    if not isinstance(dst, OffloadedTensor):
        if isinstance(src, OffloadedTensor) and dst.device.type == "cpu":
            # Reading host values into a CPU tensor needs no trip through the device.
            return dst.copy_(src._host, **kwargs)
        return run(func, args, kwargs)
    # Weight loaders write straight into the host master (param.data.copy_, narrow().copy_):
    # nothing is paged, and a copy from another OffloadedTensor stays on the host.
    source = src._host if isinstance(src, OffloadedTensor) else src
    write_master(dst._master, dst._host, source, source.device.type != "cpu")
    return dst


_INDEX_PUT_ON_DEVICE = Mutation(aten.index_put_.default)


@implements(aten.index_put_.default)
def _index_put_(func, types, args, kwargs):
    # ``param.data[rows] = w`` (weight loaders) writes straight into the host master, as copy_ does;
    # the generic path would page the whole tensor to scatter a few rows into a private copy.
    # Offloaded values are read from their host views, as copy_ reads an offloaded source: nothing
    # is paged, and ``w[idx] = w[:2]`` meets torch's own overlap check on the host views instead
    # of a refusal to page ``w`` whole.
    self, value = args[0], args[2]
    if not isinstance(self, OffloadedTensor) or any(_has_offloaded(a) for a in (args[1], *args[3:], *kwargs.values())):
        return _INDEX_PUT_ON_DEVICE(func, types, args, kwargs)
    indices = [None if i is None else i.to("cpu") for i in args[1]]
    values = value._host if isinstance(value, OffloadedTensor) else value.to("cpu")
    pager = self._master.pager
    with pager.lock:  # as in paging.write_back
        pager.before_write(self._master)
        with no_dispatch():
            # The aten op, not Tensor.index_put_, whose binding refuses the None that stands for
            # a whole dimension before an index (``w[:, cols] = v``).
            func(self._host, indices, values, *args[3:], **kwargs)
        if value.device.type != "cpu" and not isinstance(value, OffloadedTensor):
            pager.count_write_back(values.numel() * values.element_size())
    return self


@implements(aten.resize_.default)
def resize_(func, types, args, kwargs):
    self, size = args[0], args[1]
    memory_format = kwargs.get("memory_format")
    if tuple(size) == tuple(self.shape) and memory_format is None:
        return self  # like resize_: same sizes and no memory format keep the strides
    if resize_within_master(self, size, memory_format or torch.contiguous_format):
        return self
    raise RuntimeError(
        f"offtensor: cannot resize {describe(self)} to {tuple(size)}: its host master is exactly "
        f"{self.host_nbytes} bytes. Assign a new tensor instead."
    )


@implements(aten.resize_as_.default)
def resize_as_(func, types, args, kwargs):
    # An in-place view op by its tags, so the host view's own resize_as_ would refuse a master
    # too small with torch's "storage that is not resizable": resize_ names the tensor and bytes.
    return resize_(aten.resize_.default, types, (args[0], args[1].shape), kwargs)


@implements(aten.set_.source_Tensor, aten.set_.source_Storage, aten.set_.source_Storage_storage_offset, aten.set_.default)
def set_(func, types, args, kwargs):
    if isinstance(args[0], OffloadedTensor):
        raise RuntimeError(
            f"offtensor: {func} would repoint {describe(args[0])} at other memory; "
            f"assign a new tensor (or use copy_ to write values) instead"
        )
    # A plain tensor pointed at an offloaded one: the offloaded tensor has no device memory to
    # share, and an alias of a paged copy would miss later writes to the master.
    raise RuntimeError(
        f"offtensor: {func} would point a plain tensor at {describe(args[1])}, which has no memory of its "
        f"own on {args[1].device} (its host master is paged per op); take a copy with .clone(), or its host "
        f"memory with .untyped_storage()"
    )
