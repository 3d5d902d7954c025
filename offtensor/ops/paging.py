"""Paging for one op: OffloadedTensor arguments in, device tensors out, pages released once the op is
enqueued, and what the op wrote back in its host masters. Every handler pages through ``Paged``."""

from __future__ import annotations

import torch
from torch.utils._mode_utils import no_dispatch

from ..pager import page_layout
from ..tensor import OffloadedTensor
from . import compile as _compile
from .views import resize_within_master


class Paged:
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


def describe(t: OffloadedTensor) -> str:
    name = t._master.name
    return f"an OffloadedTensor{'' if name is None else ' of ' + repr(name)} of shape {tuple(t.shape)} and dtype {t.dtype}"


def run(func, args, kwargs, written=()):
    """Page every OffloadedTensor argument (privately where ``written``), run ``func`` on plain
    tensors, write mutated arguments back to their host masters."""
    paged = Paged()
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
            write_back(t, device_copy)
    finally:
        paged.release()
    return out


def write_back(t: OffloadedTensor, values: torch.Tensor) -> None:
    """Write ``values`` into ``t``'s bytes of its host master; every alias sees them and every
    cached device copy of the master is dropped."""
    if values.shape != t.shape and not resize_within_master(t, values.shape):
        # An out= op resized its output beyond what the fixed-size host master holds.
        raise RuntimeError(
            f"offtensor: an op would resize {describe(t)} to {tuple(values.shape)}: its host master is exactly "
            f"{t.host_nbytes} bytes. Pass an out= tensor of the result's shape, or assign a new tensor instead."
        )
    pager = t._master.pager
    with pager.lock:  # no other thread's op pages the master between the wait and the write
        pager.before_write(t._master)
        with no_dispatch():
            t._host.copy_(values)
        pager.count_write_back(t._host.numel() * t._host.element_size())
