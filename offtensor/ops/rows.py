"""Index ops on dim 0 (``embedding``, ``index_select``, ``index.Tensor``; ``embedding_bag`` over a table
larger than the room) that page only the rows or experts their index selects, and the device->host
reads (host syncs) that tell them which."""

from __future__ import annotations

import torch

from .. import cast_views
from ..pager import upload_small
from ..tensor import OffloadedTensor
from .paging import Paged, describe, layout_of, run
from .table import implements
from .tiling import _copy_in_slices, _page_slice, _slice_bytes, needs_tiling

aten = torch.ops.aten


# Rows (or experts) at least this large are paged one by one through the cache, so an expert used
# by consecutive tokens is copied once; smaller rows are gathered on the host and sent together.
CACHED_SLICE_BYTES = 1 << 20


def _gather_rows(t: OffloadedTensor, rows: torch.Tensor, paged: Paged) -> torch.Tensor:
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
    if rows.numel() and pager.budget_bytes is not None:
        budget = pager.budget
        if need > pager.budget_bytes - budget.resident_bytes - budget.paged_bytes and (
                rows.numel() > 1 or row_bytes > pager.budget_bytes - budget.resident_bytes):  # (a decode's one row: no scan)
            room = pager.free_bytes()
    if room is not None and row_bytes > room and host.dim() > 1:
        # Not even one row fits (a row of a model's own stack of matrices, planned as bmm reads it,
        # a slice of one matrix at a time): each row is copied into the result in slices that fit.
        out = torch.empty((rows.numel(),) + tuple(host.shape[1:]), dtype=t.dtype, device=pager.device)
        for k, i in enumerate(rows.tolist()):
            _copy_in_slices(cast_views.derived(t, host[i]), out[k], room)
        return out
    if room is not None and need > room and rows.numel() > 1:
        per_chunk = max(1, room // max(row_bytes, 1))
        out = torch.empty((rows.numel(),) + tuple(host.shape[1:]), dtype=t.dtype, device=pager.device)
        for start in range(0, rows.numel(), per_chunk):
            chunk = Paged()
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
        parts = [paged.page(cast_views.derived(t, host[i])) for i in rows]
        return torch.stack(parts)
    if rows.numel() == 1 and (row_bytes >= CACHED_SLICE_BYTES or per_expert):
        return paged.page(cast_views.derived(t, host[int(rows[0])])).unsqueeze(0)
    gathered = pager.device_ops.gather_rows(host, rows)  # into pinned memory on a GPU: an async upload
    return cast_views.cast_of(t, pager.upload(gathered, describe(t), paged.entries)[0])


# Device->host reads made by the index ops below and by grouped.py's read of the routing. On a GPU
# each one is a host sync: the CPU stops queuing work until the device has caught up, which costs
# the overlap of copies with compute at that layer. Counted on the emulated device too (where the
# same reads happen, without a wait), so tests and benchmarks measure the count the GPU would pay.
#
# Measured (tests/test_pager.py::test_an_moe_layer_costs_one_host_sync, transformers Qwen3-MoE
# layer on the grouped_mm path, offloaded experts): 1 sync per MoE layer, the read of the routing
# offsets that says which experts to page (gate_up and down share it); 1 per embedding lookup of
# offloaded rows (which rows to page). No other sync: indices go back to the device from pinned
# memory without blocking, gathered rows are uploaded from pinned memory, group sizes stay on the
# device.
#
# Why the one per MoE layer stays: the pager's cache, budget and eviction are host state,
# and a host->device copy is issued by the host with host addresses, so the host must know which
# experts to page. Removing the read would take a device-side expert->slot table plus a UVA gather
# kernel that reads the missing experts from pinned memory, but a UVA read (55.2 GB/s, 5.2 ms for
# 8 x 25 MB on the H200) is 1.4x slower than DMA copies of the same experts (3.68 ms), and in a
# decode step those copies are the bound. What the sync costs instead is covered by speculation:
# the next layer's guessed experts are already copying while the host waits (offtensor/moe).
# The timeline records each read as a host sync (``Timeline.add_sync``), so replays show the gap.
HOST_SYNCS = [0]


def read_to_host(t: torch.Tensor, pager=None) -> torch.Tensor:
    host_sync(pager)
    return t.detach().to("cpu")


def host_sync(pager=None) -> None:
    HOST_SYNCS[0] += 1
    if pager is not None and pager.recorder is not None:
        pager.recorder.host_sync()


def _unique_rows(index: torch.Tensor, size: int, pager=None):
    """Unique row ids (CPU, for the host) and every index's position among them (on index's device)."""
    if index.is_meta:
        # Planning on meta (ot.plan): the values are unknown, so every index is taken to select a
        # row of its own, the most a lookup can page. The GPU would read the index here: the host
        # sync is recorded all the same.
        host_sync(pager)
        return torch.arange(min(index.numel(), size)), torch.empty(index.shape, dtype=torch.int64, device="meta")
    cpu = read_to_host(index, pager).to(torch.int64).reshape(-1)
    cpu = torch.where(cpu < 0, cpu + size, cpu)
    rows, inverse = torch.unique(cpu, return_inverse=True)
    if rows.numel() and (int(rows[0]) < 0 or int(rows[-1]) >= size):
        raise IndexError(f"index {int(rows[-1]) if int(rows[-1]) >= size else int(rows[0])} is out of bounds for dimension 0 with size {size}")
    return rows, upload_small(inverse.reshape(index.shape), index.device)


def _whole_copy_cached(t: OffloadedTensor) -> bool:
    """Whether a cached device copy of all that ``t`` covers is there already (a tied output
    projection, a linear over the same weight, paged it): then an index op reads it like any cache
    hit, with no host read of its index (no host sync), no gather and no upload. Routed expert
    stacks keep their per-expert paging (the expert cache counts every lookup)."""
    own = t.__dict__
    master = own["_master"]
    pager = master.pager
    if pager.budget_bytes is None or (pager.experts is not None and pager.experts.is_stack(master.id)):
        return False
    layout = own.get("_layout")
    if layout is None:
        if type(own["_host"]) is not torch.Tensor:  # traced by torch.compile: the row path decides
            return False
        layout = layout_of(t)
    return pager.is_cached(layout[5])


def _host_index(index):
    """An index that is itself offloaded (a model's ``position_ids`` buffer, offloaded at a tight
    budget) read from its host view, whose values are the tensor's: the rows it selects are found on
    the host anyway, and paging it would hold room beside the rows. Anything else as it is; None for
    one being traced by torch.compile (its values are not known until the graph runs)."""
    if not isinstance(index, OffloadedTensor):
        return index
    host = index.__dict__["_host"]
    return host if type(host) is torch.Tensor and "_cast" not in index.__dict__ else None


@implements(aten.embedding.default)
def embedding(func, types, args, kwargs):
    weight, indices = args[0], _host_index(args[1])
    if not isinstance(weight, OffloadedTensor) or indices is None or _whole_copy_cached(weight):
        return run(func, args, kwargs)
    rows, inverse = _unique_rows(indices, weight.shape[0], weight._master.pager)
    paged = Paged()
    try:
        selected = _gather_rows(weight, rows, paged)
        return func(selected, inverse.to(selected.device))
    finally:
        paged.release()


@implements(aten.index_select.default)
def index_select(func, types, args, kwargs):
    self, dim, index = args[0], args[1], _host_index(args[2])
    if (not isinstance(self, OffloadedTensor) or index is None or dim % max(self.dim(), 1) != 0
            or self.dim() == 0 or _whole_copy_cached(self)):
        return run(func, args, kwargs)
    rows, inverse = _unique_rows(index, self.shape[0], self._master.pager)
    paged = Paged()
    try:
        selected = _gather_rows(self, rows, paged)
        return selected.index_select(0, inverse.to(selected.device))
    finally:
        paged.release()


@implements(aten.index.Tensor)
def index(func, types, args, kwargs):
    self, indices = args[0], args[1]
    first = _host_index(indices[0]) if len(indices) else None
    if _row_mask(self, first, indices):
        # ``t[mask]`` with a boolean mask over dim 0 (textual inversion's ``orig[keep]``) selects the
        # rows its true entries name, in order: the same rows as ``t[mask.nonzero()]``.
        first = first.nonzero().reshape(-1)
    if (
        not isinstance(self, OffloadedTensor)
        or self.dim() == 0
        or first is None
        or first.dtype not in (torch.int64, torch.int32)
        or any(i is not None for i in indices[1:])
        or _whole_copy_cached(self)
    ):
        return run(func, args, kwargs)
    rows, inverse = _unique_rows(first, self.shape[0], self._master.pager)
    paged = Paged()
    try:
        selected = _gather_rows(self, rows, paged)
        return func(selected, [inverse.to(selected.device)])
    finally:
        paged.release()


def _row_mask(self, first, indices) -> bool:
    """``first`` is a plain boolean mask over all of ``self``'s dim 0 and the only index."""
    return (isinstance(self, OffloadedTensor) and isinstance(first, torch.Tensor) and not isinstance(first, OffloadedTensor)
            and first.dtype == torch.bool and first.dim() == 1 and self.dim() > 0 and first.shape[0] == self.shape[0]
            and not any(i is not None for i in indices[1:]))


_BAG_ARGUMENTS = ("weight", "indices", "offsets", "scale_grad_by_freq", "mode", "sparse", "per_sample_weights",
                  "include_last_offset", "padding_idx")


@implements(aten._embedding_bag.default, aten._embedding_bag_forward_only.default)
def embedding_bag(func, types, args, kwargs):
    """``F.embedding_bag`` over a table larger than the room (a model's own tensor, planned in slices):
    run on a table of the rows its indices select, paged as ``embedding`` pages them, so every bag
    reduces the same rows in the same order. Its padding index and the rows a max bag picked are
    translated between the two tables."""
    call = dict(zip(_BAG_ARGUMENTS, args), **kwargs)
    weight = call["weight"]
    if not _by_rows(weight, call):
        return run(func, args, kwargs)
    out, rows = _on_selected_rows(func, call)
    if call.get("mode", 0) == 2:  # max: the row each output element came from, in the whole table's ids
        picked = out[3]
        ids = rows.to(picked.device)[picked.clamp(min=0)]
        out = (*out[:3], torch.where(picked >= 0, ids, picked))
    return out


@implements(aten._embedding_bag_per_sample_weights_backward.default)
def embedding_bag_per_sample_weights_backward(func, types, args, kwargs):
    """The gradient of ``embedding_bag``'s per-sample weights reads the table's rows its indices
    select (each weight's gradient is its bag's output gradient times its row): run on a table of
    those rows, as the forward is, over a table larger than the room."""
    names = ("grad", "weight", "indices", "offsets", "offset2bag", "mode", "padding_idx")
    call = dict(zip(names, args), **kwargs)
    weight = call["weight"]
    if not _by_rows(weight, call):
        return run(func, args, kwargs)
    return _on_selected_rows(func, call)[0]


def _by_rows(weight, call: dict) -> bool:
    """Whether a bag op over ``weight`` runs on a table of the rows it selects: the table offloaded
    and larger than its tile (not cached whole), nothing else of the call offloaded, not traced by
    torch.compile (paged whole in its graph, as before)."""
    return (isinstance(weight, OffloadedTensor) and type(weight._host) is torch.Tensor
            and not any(isinstance(v, OffloadedTensor) for k, v in call.items() if k != "weight")
            and needs_tiling(weight, []) and not _whole_copy_cached(weight))


def _on_selected_rows(func, call: dict):
    """(``func`` of ``call`` on a table of the rows of its weight that its indices select, those rows)."""
    weight = call["weight"]
    rows = _select_rows(weight, call)
    paged = Paged()
    try:
        return func(**{**call, "weight": _gather_rows(weight, rows, paged)}), rows
    finally:
        paged.release()


def _select_rows(weight: OffloadedTensor, call: dict) -> torch.Tensor:
    """The rows of ``weight`` that ``call``'s indices select, in order; ``call``'s indices and padding
    index become positions in a table of those rows."""
    indices = call["indices"]
    rows, inverse = _unique_rows(indices, weight.shape[0], weight._master.pager)
    padding = call.get("padding_idx", -1)
    if padding is not None and padding >= 0:
        found = (rows == padding).nonzero()
        call["padding_idx"] = int(found[0]) if found.numel() else -1
    call["indices"] = inverse.to(indices.dtype)
    return rows
