"""Grouped GEMMs of tokens sorted by expert (``aten._grouped_mm``, transformers' own fallback op):
page only the experts that have tokens, through the expert cache, from one host read of the routing
offsets (or compute the uncached ones on the host: ``host_experts``); on meta (``ot.plan``) the
routing is planned instead."""

from __future__ import annotations

import weakref

import torch

from .. import cast_views
from ..pager import page_layout
from ..tensor import OffloadedTensor
from .expert_pool import pooled_grouped_mm, serving_pool
from .host_experts import host_grouped, split_groups
from .paging import Paged, run
from .planned import planned_ends
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
    pool = serving_pool(weight, x.shape[0]) if bias is None else None
    if pool is not None:  # the device-side expert pool: no host read of offs (ops/expert_pool.py)
        return pooled_grouped_mm(func, pool, weight, x, offs, out_dtype)
    routed = _routed_groups(weight, offs, x.shape[0])
    groups, sizes, covered = routed[:3]
    groups, on_host = split_groups(weight, groups)
    _announce(weight, groups, None if on_host else routed)
    # Host experts' activations go to the host before the device experts are issued (host_experts.py).
    host_run = host_grouped(func, x, weight, bias, out_dtype, offs.dtype, on_host) if on_host else None
    master = weight.__dict__["_master"]  # (one dict read, not a lookup through torch.Tensor's type)
    pager = master.pager
    recorder = pager.recorder
    page, cached = _expert_pager(weight)
    done = {}
    slots = cached(groups) if bias is None else None
    if slots is not None:
        # Every expert is a cache hit (or a copy the announce just issued): held together they take
        # no room, so one record holds them all and one release gives them back, one device mark for
        # the op instead of one per expert. Each expert still runs its own one-group kernel, recorded
        # on a timeline as a kernel of its own that waits for its own copy only.
        paged = Paged()
        try:
            if recorder is None:
                # ``page`` inlined, from the slots ``cached`` found (a call less per expert).
                held, page_slot = paged.entries, pager.page
                for (e, start, end), (host_slice, layout) in zip(groups, slots):
                    expert = page_slot(host_slice, master, weight, False, layout, held)[0]
                    done[e] = func(x[start:end], expert, sizes[e], None, out_dtype)
            else:
                for e, start, end in groups:
                    expert = page(paged, e)
                    with recorder.kernels():
                        done[e] = func(x[start:end], expert, sizes[e], None, out_dtype)
        finally:
            paged.release()
        groups = ()
    for e, start, end in groups:
        paged = Paged()
        try:
            expert = page(paged, e)
            expert_bias = None if bias is None else paged.arg(bias[e : e + 1])
            if recorder is None:
                done[e] = func(x[start:end], expert, sizes[e], expert_bias, out_dtype)
            else:
                with recorder.kernels():  # timeline: this expert's kernel waits for its copy only
                    done[e] = func(x[start:end], expert, sizes[e], expert_bias, out_dtype)
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
    pool = serving_pool(weight, x.shape[0])
    if pool is not None:
        return pooled_grouped_mm(func, pool, weight, x, offs, None, fallback=True)
    routed = _routed_groups(weight, offs, x.shape[0])
    groups, sizes = routed[:2]
    groups, on_host = split_groups(weight, groups)
    _announce(weight, groups, None if on_host else routed)
    host_run = host_grouped(func, x, weight, None, False, offs.dtype, on_host) if on_host else None
    starts = {e: (start, end) for e, start, end in on_host}
    recorder = weight._master.pager.recorder
    out = torch.zeros((x.shape[0], weight.shape[2]), dtype=x.dtype, device=x.device)  # as the op's own
    page, _ = _expert_pager(weight)
    for e, start, end in groups:
        paged = Paged()
        try:
            expert = page(paged, e)
            if recorder is None:
                out[start:end] = func(x[start:end], expert, sizes[e])
            else:
                with recorder.kernels():  # timeline: this expert's kernel waits for its copy only
                    out[start:end] = func(x[start:end], expert, sizes[e])
        finally:
            paged.release()
    if host_run is not None:
        for e, y in host_run().items():
            start, end = starts[e]
            out[start:end] = y
    return out


def grouped_mm_fallback_backward(func, types, args, kwargs):
    """The backward of transformers' grouped GEMM fallback (``transformers::grouped_mm_fallback_backward``,
    which autograd runs for it: a compiled training step's graph calls it). Its input's gradient
    needs each expert that has tokens, paged one at a time as the forward pages them; its weight's
    gradient needs no weight at all. Whole, the op would page the whole stack, which a budget that
    holds the routed experts need not hold. Each expert runs the op's own ``mm`` calls on the same
    rows and the same expert layout, so the gradients are the op's own, bit for bit."""
    call = dict(zip(("input", "weight", "offs", "grad_output"), args), **kwargs)
    x, weight, offs, grad = call["input"], call["weight"], call["offs"], call["grad_output"]
    if (
        not isinstance(weight, OffloadedTensor)
        or any(isinstance(t, OffloadedTensor) for t in (x, offs, grad))
        or x.dim() != 2
        or weight.dim() != 3
    ):
        return run(func, args, kwargs)
    routed = _routed_groups(weight, offs, x.shape[0])
    groups = routed[0]
    _announce(weight, groups, routed)
    grad_input = torch.zeros_like(x)
    # The weight's gradient is a plain device tensor, as any gradient of an offloaded weight is, in
    # the weight's layout, as the op's own zeros_like gives it (a compiled graph's fake kernel
    # says so: transformers passes the stack transposed).
    grad_weight = torch.zeros_like(weight.__dict__["_host"], device=x.device)
    page, _ = _expert_pager(weight)
    for e, start, end in groups:
        paged = Paged()
        try:
            torch.mm(grad[start:end], page(paged, e)[0].T, out=grad_input[start:end])
        finally:
            paged.release()
        torch.mm(x[start:end].T, grad[start:end], out=grad_weight[e])
    return grad_input, grad_weight


def _routed_groups(weight: OffloadedTensor, offs: torch.Tensor, rows: int):
    """For a grouped GEMM of tokens sorted by expert: (expert, first row, end row) of each expert
    with tokens, each expert's group size as a one-element device tensor (a slice of one
    ``diff``, so no host->device copy), and the rows the groups cover. Read once per ``offs``:
    the layer's second grouped GEMM (down after gate_up) reuses it (``_group_ends``)."""
    return _group_ends(offs, weight.__dict__["_master"].pager, rows, _unchanged_since(offs, weight))


def _unchanged_since(offs: torch.Tensor, weight: OffloadedTensor):
    """What says ``offs`` is unchanged since an earlier read: its version counter, or for an
    inference tensor (``torch.inference_mode``, which keeps none) the MoE layer reading it: a
    layer's ``offs`` is made once and read by its grouped GEMMs, another layer's call reads again
    (None: no such layer known, read every time)."""
    if not offs.is_inference():
        return offs._version
    stacks = getattr(weight._master.pager, "experts", None)
    stack = stacks.by_master.get(weight._master.id) if stacks is not None else None
    return None if stack is None else ("layer", stack.group)


def _expert_pager(weight: OffloadedTensor):
    """``(page, cached)``: ``cached(groups)`` is each group's expert's (host slice, page_layout) where
    every one of them is in the cache, else None;
    ``page(paged, e)``: expert ``e`` of ``weight`` paged into the op record ``paged``, through
    the pager directly with a host slice and layout memoized per (stack layout, expert), so that no
    wrapper is built per expert and a cache hit gets the device view it got last time
    (``CachedCopy.view_of``). Memoized per master and view layout, not per tensor: transformers
    passes a fresh ``weight.transpose(-2, -1)`` to every call."""
    own = weight.__dict__
    host, master = own["_host"], own["_master"]
    if type(host) is not torch.Tensor or "_cast" in own:  # traced by torch.compile, or a lazy cast: Paged.page's own path
        return (lambda paged, e: paged.page(cast_views.derived(weight, host[e : e + 1]))), lambda groups: None
    by_layout = _EXPERT_LAYOUTS.get(master)
    if by_layout is None or by_layout[0] is not master.flat:  # a new master storage: memo anew
        by_layout = _EXPERT_LAYOUTS[master] = (master.flat, {})
    view = (host.dtype, host.storage_offset(), host.shape, host.stride())
    experts = by_layout[1].get(view)
    if experts is None:
        experts = by_layout[1][view] = [None] * host.shape[0]
    pager = master.pager

    def page(paged: Paged, e: int) -> torch.Tensor:
        slot = experts[e]
        if slot is None:
            expert = host[e : e + 1]
            slot = experts[e] = (expert, page_layout(expert, master.id))
        # weight's repr names the stack in a BudgetError
        return pager.page(slot[0], master, weight, False, slot[1], paged.entries)[0]

    def cached(groups):
        is_cached = pager.is_cached
        slots = [experts[e] for e, _, _ in groups]
        for slot in slots:
            if slot is None or not is_cached(slot[1][5]):
                return None
        return slots

    return page, cached


# master -> (its storage when memoized, view layout -> per expert (host slice, its page_layout) or None)
_EXPERT_LAYOUTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _announce(weight: OffloadedTensor, groups: list, routed=None) -> None:
    """The experts the device computes are announced to the expert cache, which issues the missing
    ones at once and may evict the layer's others for them. ``routed``: ``_group_ends``' answer
    where ``groups`` are all of its groups, whose lists of experts and tokens it made once for the
    layer's grouped GEMMs (the same lists also let the second GEMM's announce see a repeat at once)."""
    master = weight.__dict__["_master"]
    pager = master.pager
    if pager.experts is not None:
        experts, tokens = routed[3:5] if routed is not None else _experts_and_tokens(groups)
        with pager.lock:  # the expert cache is pager state
            pager.experts.announce(pager, master.id, experts, tokens)


def _group_ends(offs: torch.Tensor, pager, rows: int = 0, version=None) -> tuple:
    """``_routed_groups``' answer from ``offs`` on the host: one small device->host read (copying
    every expert would cost far more), shared by the calls of one MoE layer that pass the same
    unchanged ``offs`` (gate_up, down; ``version``: ``_unchanged_since``): the pager keeps the last
    answer (``Pager.routing_read``)."""
    ref, last, routed = pager.routing_read
    if ref is not None and ref() is offs and version is not None and version == last:
        return routed
    if offs.is_meta:
        host_sync(pager)  # the GPU reads the routing here
        ends = planned_ends(offs.numel(), rows)
    else:
        ends = read_to_host(offs, pager).tolist()
    starts = [0] + ends[:-1]
    groups = [(e, starts[e], ends[e]) for e in range(len(ends)) if ends[e] > starts[e]]
    diff = torch.diff(offs, prepend=offs.new_zeros(1))
    sizes = {e: diff[e : e + 1] for e, _, _ in groups}
    routed = (groups, sizes, ends[-1] if ends else 0, *_experts_and_tokens(groups))
    pager.routing_read = (weakref.ref(offs), version, routed)
    return routed


def _experts_and_tokens(groups: list) -> tuple:
    """The experts of ``groups`` and their token counts, as the expert cache's announce takes them."""
    return [e for e, _, _ in groups], [b - a for _, a, b in groups]
