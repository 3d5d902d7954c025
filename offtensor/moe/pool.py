"""The device-side expert pool (``expert_pool=True``): one pool of device slots per kind of MoE layer
(the expert shapes and dtype of its stacks), shared by every layer of that kind, with its LRU tables
on the device, so that a decode step decides which experts to copy without reading anything on the
host.

A pool holds, per stack role of the layer (``gate_up_proj``, ``down_proj``; ``w1``, ``w2``, ``w3``),
``S`` slots of one expert each. Its tables are device tensors, each with one sink entry at the end
(index ``S`` of a slot table) that takes what no row needs:

- ``slot_of`` [experts of all its layers + 1]: the slot holding each expert, -1 when absent; the
  last entry is the sink of rows that belong to no expert (always -1);
- ``expert_in`` [S + 1]: the expert each slot holds, -1 when empty;
- ``stamp`` [S + 1]: the clock value of each slot's last use, -1 for an empty slot;
- ``clock`` [1]: the step counter;
- ``counts`` [2]: the experts fetched into a slot and the experts found in one, summed over the
  admits (the pool's own statistics: device-side, so the decode path never reads them; ``report``
  reads them, which on a GPU waits for the device).

The decisions and the copies of one call are one op (``ops/expert_pool.py``, ``offtensor::pool_admit``).
The slots are device copies of the immutable host masters: the masters stay the one source of the
bytes, a write to a pooled stack empties its pool (``invalidate``), and the pager's own cache still
serves the calls the pool does not cover (a prefill that routes more distinct experts than it has
slots).

The slot count is decided here, at wrap time, from the room the budget leaves beside the resident
weights and what the pager needs for its largest other op; the pool's bytes are taken from the
budget, and a budget whose room cannot hold one decode step's experts of a layer (``top_k`` slots)
is refused with a ``BudgetError``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..pager import BudgetError

# The pools' account of the budget (``Pager.hold_outside``).
POOL_ACCOUNT = "expert pools"


def slot_bytes_of(key) -> int:
    """The bytes of one slot of a pool of ``key`` ((expert shape, dtype) per stack role)."""
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in key)


class ExpertPool:
    """One shared pool: its slot buffers per stack role, its tables, and the layers it serves."""

    __slots__ = ("key", "slots", "experts", "buffers", "slot_of", "expert_in", "stamp", "clock", "counts",
                 "layers", "calls", "plan", "scratch", "mirror", "ids", "slot_ids", "sink", "absent", "views",
                 "__weakref__")

    def __init__(self, key, slots: int, layers: list, device: torch.device):
        self.key = key  # ((expert shape, dtype) per role, ...)
        self.slots = slots
        self.experts = sum(n for _, n, _ in layers)
        self.buffers = [torch.empty((slots,) + tuple(shape), dtype=dtype, device=device) for shape, dtype in key]
        self.slot_of = torch.full((self.experts + 1,), -1, dtype=torch.int64, device=device)
        self.expert_in = torch.full((slots + 1,), -1, dtype=torch.int64, device=device)
        self.stamp = torch.full((slots + 1,), -1, dtype=torch.int64, device=device)
        self.clock = torch.zeros(1, dtype=torch.int64, device=device)
        self.counts = torch.zeros(2, dtype=torch.int64, device=device)  # (fetches, hits)
        self.layers = {}  # master id -> (role, first expert of its layer in slot_of, experts, host masters by role)
        # Constants of the admit and its plan, made here once so that a decode step makes no index
        # (ops/expert_pool.py): each layer's entries in slot_of (by its first), the slots' indices,
        # the sink's index and -1 (no expert, no slot) as one-element tensors. Device tensors: nothing
        # is copied from the host.
        every = torch.arange(self.experts + 1, dtype=torch.int64, device=device)
        self.ids = {}
        base = 0
        for masters, count, hosts in layers:
            for role, master_id in enumerate(masters):
                self.layers[master_id] = (role, base, count, hosts)
            self.ids[base] = every[base : base + count]
            base += count
        self.slot_ids = torch.arange(slots, dtype=torch.int64, device=device)
        self.sink = torch.full((1,), slots, dtype=torch.int64, device=device)
        self.absent = torch.full((1,), -1, dtype=torch.int64, device=device)
        self.views = {}  # (master id, layout of the op's view of its stack) -> that view of the pool's buffer
        self.calls = 0  # admits so far (host side): a plan is reused only while no other admit ran
        self.plan = None  # (offs ref, offs version, first expert, calls, the rows' plan) of the last admit
        self.scratch = {}  # (role, slot count) -> the emulated device's gather buffer (ops/expert_pool.py)
        # On meta (ot.plan) the tables hold no values: ops/expert_pool.py keeps their host mirror here
        # (slot_of, expert_in, stamp, clock, fetches, hits).
        self.mirror = None

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    @property
    def slot_bytes(self) -> int:
        """The bytes of one slot: one expert of each stack of a layer, what one fetch copies."""
        return slot_bytes_of(self.key)

    def covers(self, master_id: int, rows: int) -> bool:
        """Whether a call of ``rows`` routed rows on ``master_id``'s stack is served from the pool:
        it cannot route more distinct experts than the pool has slots (a static test of shapes)."""
        layer = self.layers.get(master_id)
        return layer is not None and min(rows, layer[2]) <= self.slots

    def invalidate(self) -> None:
        """Empty every slot (a pooled master is about to change): the next calls fetch again."""
        self.slot_of.fill_(-1)
        self.expert_in.fill_(-1)
        self.stamp.fill_(-1)
        self.plan = None
        if self.mirror is not None:
            self.mirror.update(slot_of={}, expert_in=[-1] * self.slots, stamp=[-1] * self.slots)

    def reset_counts(self) -> None:
        self.counts.zero_()
        if self.mirror is not None:
            self.mirror.update(fetches=0, hits=0)

    def report(self) -> dict:
        """The pool's size and its counters: ``fetches`` (experts copied into a slot), ``hits``
        (experts a call needed and found in a slot) and ``bytes_h2d`` (the bytes of the fetches).
        Reads the device counters: on a GPU this waits for the work queued so far (on meta, a
        plan's, the host mirror's)."""
        if self.counts.is_meta:  # a plan: the host mirror's counts
            fetches, hits = (self.mirror["fetches"], self.mirror["hits"]) if self.mirror is not None else (0, 0)
        else:
            fetches, hits = self.counts.tolist()
        return {"slots": self.slots, "experts": self.experts, "bytes": self.nbytes, "fetches": fetches, "hits": hits,
                "bytes_h2d": fetches * self.slot_bytes,
                "stacks": [str(tuple(shape)) + " " + str(dtype).replace("torch.", "") for shape, dtype in self.key]}


class ExpertPools:
    """The pager's pools (``pager.expert_pool``): by master id of a pooled stack."""

    __slots__ = ("pools", "by_master", "nbytes", "__weakref__")

    def __init__(self, pools: list):
        self.pools = pools
        self.by_master = {m: p for p in pools for m in p.layers}
        self.nbytes = sum(p.nbytes for p in pools)

    def serving(self, master_id: int, rows: int) -> Optional[ExpertPool]:
        """The pool that serves a call of ``rows`` routed rows on ``master_id``'s stack, or None
        (not pooled, or more rows than the pool has slots: a prefill, the expert cache's path)."""
        pool = self.by_master.get(master_id)
        return pool if pool is not None and pool.covers(master_id, rows) else None

    def invalidate(self, master_id: int) -> None:
        pool = self.by_master.get(master_id)
        if pool is not None:
            pool.invalidate()

    def reset_counts(self) -> None:
        for p in self.pools:
            p.reset_counts()

    def report(self) -> dict:
        """The pools' counters summed (``fetches``, ``hits``, ``bytes_h2d``), their ``slots`` and
        ``bytes``, and each pool's own report under ``pools``. Reads device counters (a sync on a GPU)."""
        pools = [p.report() for p in self.pools]
        total = {k: sum(p[k] for p in pools) for k in ("fetches", "hits", "bytes_h2d", "slots", "bytes")}
        return dict(total, pools=pools)


def build_pools(pager, stacks, top_k: Optional[int], tensors: dict, other_bytes: int) -> Optional[ExpertPools]:
    """The pools of ``stacks`` (``ExpertStacks``) sized from ``pager``'s budget; ``tensors``: the
    registered stacks by master id; ``other_bytes``: the largest offloaded tensor that is not a
    routed stack (room is kept for the pager to page it).
    Raises ``BudgetError`` when the room left cannot hold ``top_k`` experts of a layer."""
    if pager.budget_bytes is None:
        raise BudgetError("offtensor: expert_pool=True needs a device budget (budget_gb or offload_gb): the pool's "
                          "slots are taken from it")
    groups: dict = {}
    for stack in stacks.by_master.values():
        t = tensors.get(stack.master_id)
        if t is not None:
            groups.setdefault(stack.group, []).append((stack.name, stack, t._host))
    kinds: dict = {}  # key -> [(master ids, experts, hosts, names)]
    for group, members in groups.items():
        members.sort(key=lambda m: m[0])
        counts = {s.num_experts for _, s, _ in members}
        if len(counts) != 1:
            continue  # stacks of one layer with different expert counts: left to the cache
        key = tuple((tuple(h.shape[1:]), s.dtype) for _, s, h in members)
        kinds.setdefault(key, []).append(([s.master_id for _, s, _ in members], counts.pop(),
                                          [h for _, _, h in members], [n for n, _, _ in members]))
    if not kinds:
        return None
    slot_bytes = {key: slot_bytes_of(key) for key in kinds}
    reserve = max([other_bytes] + list(slot_bytes.values()))  # the pager's largest other op, or one paged expert set
    room = pager.budget_bytes - pager.resident_bytes - reserve
    total = sum(slot_bytes[k] * sum(n for _, n, _, _ in layers) for k, layers in kinds.items())
    need = max(top_k or 1, 1)
    pools = []
    for key, layers in kinds.items():
        experts = sum(n for _, n, _, _ in layers)
        share = room * slot_bytes[key] * experts // max(total, 1)
        slots = min(experts, max(share, 0) // slot_bytes[key])
        if slots < min(need, experts):
            names = ", ".join(layers[0][3]) + (f" and {len(layers) - 1} more layers" if len(layers) > 1 else "")
            raise BudgetError(
                f"offtensor: the expert pool for {names} needs {min(need, experts)} slots of {slot_bytes[key]} bytes "
                f"({min(need, experts) * slot_bytes[key]} bytes: the top-{need} experts of one decode step), but the "
                f"budget of {pager.budget_bytes} bytes holds {pager.resident_bytes} bytes of resident weights and keeps "
                f"{reserve} bytes for the largest other paged op, leaving {max(share, 0)} bytes for it. Raise "
                f"budget_gb, offload more weights, or wrap without expert_pool.")
        pools.append(ExpertPool(key, slots, [(ids, n, hosts) for ids, n, hosts, _ in layers], pager.device))
    return ExpertPools(pools)

