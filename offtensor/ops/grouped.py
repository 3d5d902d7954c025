"""Grouped GEMMs of tokens sorted by expert (``aten._grouped_mm``, transformers' own fallback op):
page only the experts that have tokens, through the expert cache, from one host read of the routing
offsets (or compute the uncached ones on the host: ``host_experts``); on meta (``ot.plan``) the
routing is planned instead."""

from __future__ import annotations

import contextlib
import threading
import weakref

import torch

from ..tensor import OffloadedTensor
from .host_experts import host_grouped, split_groups
from .paging import Paged, run
from .rows import host_sync, read_to_host
from .table import implements

aten = torch.ops.aten


@implements(aten._grouped_mm.default)
def grouped_mm(func, types, args, kwargs):
    """Grouped GEMM of tokens sorted by expert against a stacked expert weight (transformers v5's
    default MoE path): page only the experts that have tokens, one at a time through the cache,
    instead of the whole stack. Each expert runs as a one-group ``_grouped_mm`` on the stack's own
    layout, so every group computes exactly what the full call computes for it."""
    call = dict(zip(("self", "mat2", "offs", "bias", "out_dtype"), args), **kwargs)
    x, weight, offs, bias = call["self"], call["mat2"], call.get("offs"), call.get("bias")
    if (
        not isinstance(weight, OffloadedTensor)
        or isinstance(x, OffloadedTensor)
        or isinstance(offs, OffloadedTensor)
        or offs is None
        or x.dim() != 2
        or weight.dim() != 3
    ):
        return run(func, args, kwargs)
    out_dtype = call.get("out_dtype")
    groups, sizes, covered = _routed_groups(weight, offs, x.shape[0])
    groups, on_host = split_groups(weight, groups)
    _announce(weight, groups)
    # Host experts' activations go to the host before the device experts are issued (host_experts.py).
    host_run = host_grouped(func, x, weight, bias, out_dtype, offs.dtype, on_host) if on_host else None
    recorder = weight._master.pager.recorder
    done = {}
    for e, start, end in groups:
        paged = Paged()
        try:
            expert = paged.page(OffloadedTensor(weight._host[e : e + 1], weight._master))
            expert_bias = None if bias is None else paged.arg(bias[e : e + 1])
            if recorder is None:
                done[e] = func(x[start:end], expert, sizes[e : e + 1], expert_bias, out_dtype)
            else:
                with recorder.kernels():  # timeline: this expert's kernel waits for its copy only
                    done[e] = func(x[start:end], expert, sizes[e : e + 1], expert_bias, out_dtype)
        finally:
            paged.release()
    if host_run is not None:
        done.update(host_run())  # on the host while the device computes the experts issued above
    pieces = [done[e] for e in sorted(done)]
    if covered < x.shape[0] or not pieces:
        # Rows after the last group belong to no expert; _grouped_mm leaves them uninitialised too.
        rest = x.shape[0] - covered
        pieces.append(torch.empty((rest, weight.shape[-1]), dtype=out_dtype or x.dtype, device=x.device))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def grouped_mm_fallback(func, types, args, kwargs):
    """transformers' own grouped GEMM (``transformers::grouped_mm_fallback``, used under
    torch.compile and for dtypes ``aten._grouped_mm`` lacks): a custom op, so its per-expert
    ``torch.mm`` calls never reach this dispatch one by one and the whole stack would be paged.
    Page only the experts with tokens, as ``_grouped_mm`` does, running the op itself on one
    expert at a time: each group is the same ``mm`` on the same rows, so results are identical."""
    call = dict(zip(("input", "weight", "offs"), args), **kwargs)
    x, weight, offs = call["input"], call["weight"], call["offs"]
    if (
        not isinstance(weight, OffloadedTensor)
        or isinstance(x, OffloadedTensor)
        or isinstance(offs, OffloadedTensor)
        or x.dim() != 2
        or weight.dim() != 3
    ):
        return run(func, args, kwargs)
    groups, sizes, _ = _routed_groups(weight, offs, x.shape[0])
    groups, on_host = split_groups(weight, groups)
    _announce(weight, groups)
    host_run = host_grouped(func, x, weight, None, False, offs.dtype, on_host) if on_host else None
    starts = {e: (start, end) for e, start, end in on_host}
    recorder = weight._master.pager.recorder
    out = torch.zeros((x.shape[0], weight.shape[2]), dtype=x.dtype, device=x.device)  # as the op's own
    for e, start, end in groups:
        paged = Paged()
        try:
            expert = paged.page(OffloadedTensor(weight._host[e : e + 1], weight._master))
            if recorder is None:
                out[start:end] = func(x[start:end], expert, sizes[e : e + 1])
            else:
                with recorder.kernels():  # timeline: this expert's kernel waits for its copy only
                    out[start:end] = func(x[start:end], expert, sizes[e : e + 1])
        finally:
            paged.release()
    if host_run is not None:
        for e, y in host_run().items():
            start, end = starts[e]
            out[start:end] = y
    return out


def _routed_groups(weight: OffloadedTensor, offs: torch.Tensor, rows: int):
    """For a grouped GEMM of tokens sorted by expert: (expert, first row, end row) of each expert
    with tokens, every group's size as a device tensor (sliced per expert, so no host->device copy),
    and the rows the groups cover."""
    ends = _group_ends(offs, weight._master.pager, rows)
    starts = [0] + ends[:-1]
    groups = [(e, starts[e], ends[e]) for e in range(len(ends)) if ends[e] > starts[e]]
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    return groups, sizes, ends[-1] if ends else 0


def _announce(weight: OffloadedTensor, groups: list) -> None:
    """The experts the device computes are announced to the expert cache, which issues the missing
    ones at once and may evict the layer's others for them."""
    pager = weight._master.pager
    if pager.experts is not None:
        with pager.lock:  # the expert cache is pager state
            pager.experts.announce(pager, weight._master.id, [e for e, _, _ in groups], [b - a for _, a, b in groups])


def _group_ends(offs: torch.Tensor, pager, rows: int = 0) -> list:
    """``offs`` on the host: one small device->host read (copying every expert would cost far more),
    shared by the calls of one MoE layer that pass the same unchanged ``offs`` (gate_up, down): the
    pager keeps the last read (``Pager.routing_read``)."""
    ref, version, ends = pager.routing_read
    if ref is not None and ref() is offs and version == offs._version:
        return ends
    if offs.is_meta:
        host_sync(pager)  # the GPU reads the routing here
        ends = (getattr(_planning, "ends", None) or _planned_ends)(offs.numel(), rows)
    else:
        ends = read_to_host(offs, pager).tolist()
    pager.routing_read = (weakref.ref(offs), offs._version, ends)
    return ends


_PLANNED_ROUTING = torch.Generator().manual_seed(0)
_planning = threading.local()  # .ends: the routing of a plan with measured routing, in this thread


@contextlib.contextmanager
def planned_routing(ends):
    """While ``ot.plan`` replays with measured routing (``moe.RoutingStats``), a meta grouped
    GEMM's routing comes from ``ends(experts, rows)`` instead of ``_planned_ends``; per thread, so a
    plan in one thread changes no other thread's."""
    saved = getattr(_planning, "ends", None)
    _planning.ends = ends
    try:
        yield
    finally:
        _planning.ends = saved


def _planned_ends(experts: int, rows: int) -> list:
    """Planning on meta (ot.plan): routing has no values, so ``rows`` routed rows go to
    min(experts, rows) distinct experts drawn uniformly at random (no locality: what an expert
    cache gains from skewed routing is not assumed), as evenly as they divide. Seeded once per
    process, so a plan is reproducible within it."""
    chosen = sorted(torch.randperm(experts, generator=_PLANNED_ROUTING)[: min(experts, rows)].tolist())
    counts = [0] * experts
    for i, e in enumerate(chosen):
        counts[e] = rows // len(chosen) + (i < rows % len(chosen))
    ends, total = [], 0
    for c in counts:
        total += c
        ends.append(total)
    return ends
