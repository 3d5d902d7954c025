"""Grouped GEMMs of routed experts served from a device-side expert pool (``moe.pool``) with no host
decision: the slots are assigned by LRU on the device (``offtensor::pool_admit``, one op that
decides, updates the tables and fetches only the missed experts), and the call runs as one grouped
GEMM against the pool.

Every step is a fixed-shape device op (no ``.item()``, ``.tolist()``, ``nonzero`` or host read, and
no value made on the host: no ``t[i] = v``, no tensor without ``device=``), so the path runs
unchanged inside a compiled graph and can be captured in a CUDA graph (tests/test_pool_capture.py
records every op of a pooled decode step to keep it so). The admit also
counts its fetches and hits on the device (``pool.counts``, read by ``ot.stats`` only). In a plan
on meta, whose tables hold no values, the same decisions are made on a host mirror of them
(``mirror_admit``) from the planned routing, and each fetch is recorded for the replay.

Bit-identical to the plain model: each expert's rows are the same rows, in the same order, against
the same bytes (a slot is a copy of the expert's host master), and ``_grouped_mm`` computes each
group on its own. On a GPU the rows are reordered by slot (stably) and the groups are the pool's
slots, read in place; on the emulated device, whose grouped GEMM costs per group even when empty,
the groups are the experts the call uses, each run against its slot in place by the extension's
``pool_grouped_mm_cpu`` (without the extension, against a gathered copy of those slots).
"""

from __future__ import annotations

import weakref

import torch

from .. import _ext
from .planned import planned_ends

_INT64_MAX = torch.iinfo(torch.int64).max


@torch.library.custom_op("offtensor::pool_admit",
                         mutates_args=("slot_of", "expert_in", "stamp", "clock", "counts", "buffers"))
def pool_admit(rows_expert: torch.Tensor, slot_of: torch.Tensor, expert_in: torch.Tensor, stamp: torch.Tensor,
               clock: torch.Tensor, counts: torch.Tensor, buffers: list[torch.Tensor], hosts: list[torch.Tensor],
               base: int, experts: int) -> torch.Tensor:
    """Admit the experts ``rows_expert`` routes to (one entry per routed row, in ``[0, experts]``,
    ``experts`` for a row of no expert) of the layer whose experts start at ``base`` in ``slot_of``:
    returns each row's slot (``S``, the sink, for a row of no expert). The op a traced graph would
    hold; eager callers run its body, ``admit``, without the custom op's dispatch."""
    return admit(rows_expert, slot_of, expert_in, stamp, clock, counts, buffers, hosts, base, experts)


@pool_admit.register_fake
def _pool_admit_fake(rows_expert, slot_of, expert_in, stamp, clock, counts, buffers, hosts, base, experts):
    return torch.empty_like(rows_expert)


def admit(rows_expert, slot_of, expert_in, stamp, clock, counts, buffers, hosts, base: int, experts: int,
          ids=None, sink=None, absent=None) -> torch.Tensor:
    """``pool_admit``'s body. ``ids`` (the layer's experts' entries in ``slot_of``, ``arange(base,
    base + experts)``), ``sink`` (a one-element ``S``) and ``absent`` (a one-element -1): the pool's
    own copies of them (``ExpertPool.ids``, ``.sink``, ``.absent``), made once, or made here (a
    Python number where a tensor goes is made into a tensor by every op that takes it).

    LRU on the device: the slots of experts this call needs and holds are protected; each missed
    expert, ranked by a cumsum, takes the next of the other slots in (empty first, then oldest
    stamp) order. The tables change in an order that keeps them consistent if the op stops
    between any two steps: a slot is first taken from the expert that had it, then filled, and only
    then given to its new expert, so ``slot_of[e] == s`` always means slot ``s`` holds ``e``'s bytes.
    ``counts`` (fetches, hits) gains the call's missed and held experts, on the device, once the
    call is done.

    Every value is made on the device: no Python scalar is written into a table by indexing (on a
    GPU ``t[i] = v`` makes ``v`` on the host and copies it, a blocking copy that CUDA graph capture
    refuses), and the sink entries are kept by the writes themselves: ``expert_in[S]`` and
    ``stamp[S]`` stay -1, ``slot_of``'s last entry stays -1."""
    slots = expert_in.numel() - 1
    device = slot_of.device
    if ids is None:
        ids = torch.arange(base, base + experts, device=device)
    if sink is None:
        sink = slot_of.new_full((1,), slots)
    if absent is None:
        absent = slot_of.new_full((1,), -1)
    local = slot_of[base : base + experts]  # a view: this layer's experts
    needed = torch.zeros(experts + 1, dtype=torch.bool, device=device).index_fill_(0, rows_expert, True)[:experts]
    hit = needed & (local >= 0)
    miss = needed ^ hit
    # The held experts' slots take the largest stamp, and so does the sink whenever an expert is not
    # held (any miss): a stable sort puts the free slots first, empty ones (-1) before the oldest.
    order = torch.argsort(stamp.index_fill(0, torch.where(hit, local, sink), _INT64_MAX), stable=True)
    # The k-th missed expert (its cumsum is k) takes order[k - 1]: order rolled by one, indexed by k.
    dest = torch.where(miss, order.roll(1).index_select(0, torch.cumsum(miss, 0)), sink)
    # 1. the taken slots leave their old experts (slot_of first, so no expert points at a slot in
    # change); an empty slot's -1, and the sink's (expert_in[S] is -1), fill slot_of[-1], the sink
    slot_of.index_fill_(0, expert_in.index_select(0, dest), -1)
    expert_in.index_fill_(0, dest, -1)
    # 2. the missed experts' bytes into their slots; rows whose slot is the sink copy nothing
    for buffer, host in zip(buffers, hosts):
        masked_row_gather(buffer, host, dest)
    # 3. the slots are given to their new experts (the sink gets -1 only), then the experts to their slots
    expert_in.index_copy_(0, dest, torch.where(miss, ids, absent))
    after = torch.where(miss, dest, local)
    local.copy_(after)
    stamp.index_copy_(0, torch.where(needed, after, sink), torch.where(needed, clock, absent))
    clock.add_(1)
    counts.add_(torch.stack((miss, hit)).sum(1))
    return torch.cat((after, sink)).index_select(0, rows_expert)


def masked_row_gather(dst: torch.Tensor, host: torch.Tensor, dest: torch.Tensor) -> None:
    """``dst[dest[e]] = host[e]`` for every expert ``e`` whose ``dest[e]`` is a slot (below
    ``dst.shape[0]``, the sink); the others copy nothing. On a GPU the rows are read from pinned host
    memory through its device address (a kernel of the native extension); on the emulated device
    the extension's CPU kernel does the same copies."""
    if _HAVE_GATHER:
        stream = torch.cuda.current_stream(dst.device).cuda_stream if dst.is_cuda else 0
        torch.ops.offtensor.masked_row_gather(dst, host, dest, stream)
        return
    # Without the native extension: a fixed-shape form that rewrites every slot (correct, but it
    # moves a pool's worth of bytes): each slot's new expert, -1 to keep what it holds. On a GPU it
    # copies the whole host stack with a blocking copy, which CUDA graph capture cannot record.
    if capturing_on(dst.device):
        raise RuntimeError(
            f"offtensor: the expert pool's fetch from a {tuple(host.shape)} {host.dtype} host stack "
            f"({host.numel() * host.element_size()} bytes) cannot be captured in a CUDA graph without the native "
            f"extension's masked gather kernel (offtensor._C built with CUDA), which reads the pinned stack "
            f"through its device address; without it every fetch would copy the whole stack from the host. Build "
            f"the extension ({_ext._BUILD_HINT}) or run this step without CUDA graphs.")
    slots = dst.shape[0]
    source = torch.full((slots + 1,), -1, dtype=torch.int64, device=dest.device)
    source = source.index_copy_(0, dest, torch.arange(dest.numel(), device=dest.device))[:slots]
    rows = host.to(dst.device).index_select(0, source.clamp(min=0))
    dst.copy_(torch.where((source >= 0).view((slots,) + (1,) * (dst.dim() - 1)), rows, dst))


_HAVE_GATHER = _ext.NATIVE and hasattr(torch.ops.offtensor, "masked_row_gather")


def capturing_on(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is being captured into a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


# On the emulated device the admit is one native call (``offtensor::pool_admit_cpu``: the same
# decisions and copies as ``pool_admit`` followed by ``_compact_plan``, in loops; the tensor-op form
# costs a few microseconds per op there). False: ``pool_admit`` everywhere (tests run the GPU's
# form with it). An extension built before the pool's counters (no ``counts`` argument) is not
# used: the tensor-op form counts.
NATIVE_ADMIT = True
_NATIVE_ADMIT = (torch.ops.offtensor.pool_admit_cpu.default
                 if _ext.NATIVE and hasattr(torch.ops.offtensor, "pool_admit_cpu")
                 and "counts" in str(torch.ops.offtensor.pool_admit_cpu.default._schema) else None)
if _NATIVE_ADMIT is not None:
    @torch.library.register_fake("offtensor::pool_admit_cpu")
    def _pool_admit_cpu_fake(offs, rows, slot_of, expert_in, stamp, clock, counts, buffers, hosts, base, experts):
        groups = min(rows, experts)
        return slot_of.new_empty((groups,)), offs.new_empty((groups,))


def _row_expert_of(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """Each routed row's expert, from the cumulative group ends ``offs`` (``len(offs)`` past the
    last group: a row of no expert)."""
    return torch.searchsorted(offs, _positions(rows, offs.device, offs.dtype), right=True)


def _positions(rows: int, device, dtype=torch.int64) -> torch.Tensor:
    """``arange(rows)`` on ``device``, made once per shape (not per call)."""
    positions = _ARANGES.get((rows, device, dtype))
    if positions is None:
        positions = _ARANGES[(rows, device, dtype)] = torch.arange(rows, device=device, dtype=dtype)
    return positions


_ARANGES: dict = {}

# The emulated device's grouped GEMM against the pool's slots in place (``pool_grouped_mm_cpu``: per
# group the ``mm_out`` aten's CPU kernel runs, on the group's slot), instead of gathering the
# call's slots into a scratch buffer first: a copy of every expert the call uses, which a GPU's
# grouped GEMM (reading its slots in place) never makes. Without the extension: the gather.
_NATIVE_GMM = (torch.ops.offtensor.pool_grouped_mm_cpu.default
               if _ext.NATIVE and hasattr(torch.ops.offtensor, "pool_grouped_mm_cpu") else None)
if _NATIVE_GMM is not None:
    @torch.library.register_fake("offtensor::pool_grouped_mm_cpu")
    def _pool_grouped_mm_cpu_fake(x, pool, group_slot, group_ends):
        return x.new_empty((x.shape[0], pool.shape[2]))


def pooled_plan(pool, master_id: int, offs: torch.Tensor, rows: int, recorder=None):
    """The plan of a call on ``master_id``'s layer routed by ``offs`` (``_slot_plan`` on a GPU,
    ``_compact_plan`` on the emulated device, ``("meta",)`` in a plan), admitted once per ``offs``:
    the layer's second grouped GEMM (down after gate_up) reuses the first's while no other admit ran
    in between. ``recorder``: the pager's timeline recorder, told of a plan's fetches."""
    _, base, experts, hosts = pool.layers[master_id]
    last = pool.plan
    if (last is not None and last[0]() is offs and last[1] == offs._version and last[2] == base
            and last[3] == pool.calls):
        return last[4]
    slot_groups = offs.device.type in SLOT_GROUPS
    if offs.is_meta:
        for _ in mirror_admit(pool, base, experts, planned_ends(experts, rows), rows):
            if recorder is not None:
                recorder.pool_fetched(pool.slot_bytes)
        plan = ("meta",)
    elif NATIVE_ADMIT and _NATIVE_ADMIT is not None and not slot_groups and offs.device.type == "cpu" \
            and offs.dtype == torch.int32 and offs.is_contiguous():
        plan = ("compact",) + tuple(_NATIVE_ADMIT(offs, rows, pool.slot_of, pool.expert_in, pool.stamp, pool.clock,
                                                  pool.counts, pool.buffers, hosts, base, experts))
    else:
        row_expert = _row_expert_of(offs, rows)
        row_slot = admit(row_expert, pool.slot_of, pool.expert_in, pool.stamp, pool.clock, pool.counts, pool.buffers,
                         hosts, base, experts, pool.ids[base], pool.sink, pool.absent)
        plan = (_slot_plan if slot_groups else _compact_plan)(pool, row_expert, row_slot, experts)
    pool.calls += 1
    pool.plan = (weakref.ref(offs), offs._version, base, pool.calls, plan)
    return plan


def mirror_admit(pool, base: int, experts: int, ends: list, rows: int) -> list:
    """``pool_admit``'s decisions on a host mirror of the pool's tables (``pool.mirror``), for a plan
    on meta, whose tables hold no values: the routing's cumulative group ``ends`` (planned), the
    same LRU (the held experts' slots protected; each missed one, in expert order, takes the next
    free slot, empty ones first, then the oldest stamp, lowest index on ties). Returns the slots
    filled, one per fetch."""
    m = pool.mirror
    if m is None:
        m = pool.mirror = {"slot_of": {}, "expert_in": [-1] * pool.slots, "stamp": [-1] * pool.slots, "clock": 0,
                           "fetches": 0, "hits": 0}
    slot_of, expert_in, stamp = m["slot_of"], m["expert_in"], m["stamp"]
    needed, previous = [], 0
    for e in range(experts):
        end = min(ends[e], rows)
        if end > previous:
            needed.append(base + e)
        previous = max(previous, end)
    held = {slot_of[e] for e in needed if e in slot_of}
    free = sorted((s for s in range(pool.slots) if s not in held), key=stamp.__getitem__)  # stable
    filled = []
    for e in needed:
        if e not in slot_of:
            s = free[len(filled)]
            if expert_in[s] >= 0:
                del slot_of[expert_in[s]]
            expert_in[s], slot_of[e] = e, s
            filled.append(s)
    for e in needed:
        stamp[slot_of[e]] = m["clock"]
    m["clock"] += 1
    m["fetches"] += len(filled)
    m["hits"] += len(needed) - len(filled)
    return filled


# Device types whose pooled grouped GEMM has one group per slot (the others: one per expert used).
SLOT_GROUPS = ("cuda",)


def _slot_plan(pool, row_expert, row_slot, experts):
    """One group per slot of the pool: (the rows in slot order, the slots' group ends, where each
    row's result is in slot order). The GPU's grouped GEMM reads the pool in place and skips empty
    groups at little cost. Slot ``s``'s group ends after the rows of slots up to ``s`` (a search of
    the sorted slots); rows of no expert (the sink, ``S``) come last, past every group."""
    sorted_slots, order = torch.sort(row_slot, stable=True)
    ends = torch.searchsorted(sorted_slots, pool.slot_ids, right=True, out_int32=True)
    return ("slots", order, ends, torch.argsort(order))


def _compact_plan(pool, row_expert, row_slot, experts):
    """One group per distinct expert of the call, at most ``min(rows, experts)`` (a static count):
    (each group's slot, the groups' ends). The rows are already in group order (sorted by expert),
    and each group runs against its slot: the emulated device's grouped GEMM costs per group, empty
    or not, so a group per slot of a large pool would cost more than the plain model's call."""
    rows = row_expert.numel()
    groups = min(rows, experts)
    device = row_expert.device
    first = torch.ones(rows, dtype=torch.bool, device=device)
    first[1:] = row_expert[1:] != row_expert[:-1]
    group = torch.where(row_expert < experts, torch.cumsum(first, 0) - 1, groups)
    counts = torch.zeros(groups + 1, dtype=torch.int32, device=device).index_add_(0, group, _ones(rows, device))
    group_slot = torch.zeros(groups + 1, dtype=torch.int64, device=device).index_copy_(0, group, row_slot)[:groups]
    return ("compact", group_slot.clamp_(max=pool.slots - 1), torch.cumsum(counts[:groups], 0, dtype=torch.int32))


def _ones(rows: int, device) -> torch.Tensor:
    ones = _ONES.get((rows, device))
    if ones is None:
        ones = _ONES[(rows, device)] = torch.ones(rows, dtype=torch.int32, device=device)
    return ones


_ONES: dict = {}


def pool_view(pool, master_id: int, host: torch.Tensor, buffer=None) -> torch.Tensor:
    """The pool's slots of ``master_id``'s role (or ``buffer``, slots gathered from them) in the
    layout the op passed the stack in (``host``: the op's view of the stack, e.g.
    ``stack.transpose(-2, -1)``), so the grouped GEMM takes the plain model's kernel path. A view
    of the pool's own buffer is made once per layout (the buffers live as long as the pool)."""
    key = (master_id, host.shape, host.stride(), host.storage_offset()) if buffer is None else None
    view = pool.views.get(key) if key is not None else None
    if view is None:
        role, _, _, hosts = pool.layers[master_id]
        source = pool.buffers[role] if buffer is None else buffer
        view = source.as_strided((source.shape[0],) + tuple(host.shape[1:]), host.stride(),
                                 source.storage_offset() + host.storage_offset() - hosts[role].storage_offset())
        if key is not None:
            pool.views[key] = view
    return view


def _gather_slots(pool, role: int, index: torch.Tensor) -> torch.Tensor:
    """The slots ``index`` of the pool's buffer for ``role``, copied into a scratch buffer kept per
    (role, count): a fresh allocation of that size is a page-faulting ``mmap`` on the host each call.
    Used only while the pager's lock is held, and only until the GEMM that reads it returns (the
    emulated device computes synchronously)."""
    buffer = pool.buffers[role]
    key = (role, index.numel())
    scratch = pool.scratch.get(key)
    if scratch is None:
        scratch = pool.scratch[key] = buffer.new_empty((index.numel(),) + tuple(buffer.shape[1:]))
    return torch.index_select(buffer, 0, index, out=scratch)


def serving_pool(weight, rows: int):
    """The expert pool that serves a grouped GEMM of ``rows`` routed rows on ``weight`` (a stack of
    a model wrapped with ``expert_pool=True``), or None: no pool, or more rows than it has slots (a
    prefill: the expert cache's path), or a stack being traced by torch.compile."""
    own = weight.__dict__
    master = own["_master"]
    pools = master.pager.expert_pool
    if pools is None or type(own["_host"]) is not torch.Tensor:
        return None
    return pools.serving(master.id, rows)


def pooled_grouped_mm(func, pool, weight, x, offs, out_dtype, fallback: bool = False) -> torch.Tensor:
    """``func(x, weight, offs)`` computed from the pool as one grouped GEMM, on a GPU of the rows
    in slot order against the pool's slots (the result put back in the rows' order), on the
    emulated device of the rows as they are against the slots of their experts. ``fallback``:
    transformers' ``grouped_mm_fallback`` (its result is zeros past the routed rows;
    ``aten._grouped_mm`` computes each group as it does, with no host read of ``offs``)."""
    own = weight.__dict__
    master, host = own["_master"], own["_host"]
    master_id = master.id
    # The admit and the GEMM that reads its slots under the pager's lock: another thread's admit
    # in between could give those slots to other experts (pool state is pager state).
    with master.pager.lock:
        plan = pooled_plan(pool, master_id, offs, x.shape[0], master.pager.recorder)
        if plan[0] == "meta":  # a plan: shapes only, the GEMM's cost is recorded on the op
            if master.pager.recorder is not None:
                master.pager.recorder.pool_called()
            return x.new_empty((x.shape[0], host.shape[-1]), dtype=out_dtype or x.dtype)
        kind, index, group_ends = plan[:3]
        if kind == "slots":
            y = torch._grouped_mm(x.index_select(0, index), pool_view(pool, master_id, host), group_ends,
                                  out_dtype=out_dtype)
        elif _NATIVE_GMM is not None and x.dtype == host.dtype and (out_dtype is None or out_dtype == x.dtype):
            y = _NATIVE_GMM(x, pool_view(pool, master_id, host), index, group_ends)
        else:
            gathered = _gather_slots(pool, pool.layers[master_id][0], index)
            y = torch._grouped_mm(x, pool_view(pool, master_id, host, gathered), group_ends, out_dtype=out_dtype)
    if fallback:  # rows past the routed ones are zeros in the fallback's result
        y = y.masked_fill_((_positions(y.shape[0], y.device) >= group_ends[-1]).unsqueeze(1), 0)
    return y.index_select(0, plan[3]) if kind == "slots" else y  # back in the rows' order
