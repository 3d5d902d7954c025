"""The pager's counters (``OffloadStats``), a snapshot of them beside the figures of the moment, and
how bytes are printed for people."""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass
class OffloadStats:
    """Counters of one pager. Byte counts are exact; ``peak_device_bytes`` is a high-water mark of
    resident + cached + in-flight bytes and the device memory the expert pools and the learned
    look-ahead's maps hold, i.e. what the budget limits; ``budget_bytes`` is the budget as given."""

    bytes_h2d: int = 0
    bytes_d2h: int = 0
    page_ins: int = 0
    hits: int = 0
    evictions: int = 0
    prefetches: int = 0
    prefetch_hits: int = 0
    resident_bytes: int = 0
    offloaded_bytes: int = 0
    cached_bytes: int = 0
    budget_bytes: Optional[int] = None
    peak_device_bytes: int = 0
    # Device bytes reserved for paged copies (the arena, and overflow slots in use), now and at most;
    # None without a budget.
    pool_bytes: Optional[int] = None
    peak_pool_bytes: Optional[int] = None
    # Copies that found no range of the arena that moving or evicting the copies no op holds could
    # free (ranges held by the current op split it), and were given a plain
    # allocation outside it: how many, and their bytes (summed over all of them).
    arena_overflows: int = 0
    arena_overflow_bytes: int = 0
    # Cached copies moved within the arena to open a range for another (a device-to-device copy
    # instead of an eviction): how many, and their bytes.
    arena_moves: int = 0
    arena_moved_bytes: int = 0
    # On a GPU, torch.cuda.max_memory_allocated / max_memory_reserved of the device (None on the
    # emulated device): the allocator's real figures beside the logical peak_device_bytes.
    max_memory_allocated: Optional[int] = None
    max_memory_reserved: Optional[int] = None
    # Part of resident_bytes held by plain tensor attributes of wrapped modules (not Parameters or
    # buffers: vLLM's W_UV); set by wrap.stats, 0 for a standalone pager.
    untracked_bytes: int = 0
    # Routed experts (offtensor.moe), when the model has offloaded stacked-expert tensors:
    # per stack name {hits, misses, hit_rate, bytes_h2d, prefetched_bytes, evictions}, and the
    # routing guesses {accuracy, recall, prefetched_bytes, wasted_bytes, routers: {name: {...}}}.
    experts: Optional[dict] = None
    guesses: Optional[dict] = None
    # A wrapped MoE model's expert placement (set by wrap.stats): {"chosen": "default" | "all_paged" |
    # "policy", "why", and when replayed: "decided", "default_step_ms", "all_paged_step_ms", "profile",
    # "routing"}; None for a model without routed expert stacks or a standalone pager.
    expert_placement: Optional[dict] = None
    # Routed experts computed on the host (expert_compute "host" / "auto"): expert GEMMs run from
    # their host masters, and the activation bytes those moved (to the host and back); no weight
    # byte of theirs is copied.
    host_experts: int = 0
    host_activation_bytes: int = 0
    # Ops over an offloaded tensor larger than the free room computed from its host master
    # (ops/host_compute.py: ``argmax()``, ``unique``, ``w.tril_()``, an ``out=`` of them): how many,
    # the host bytes they read (their offloaded arguments' bytes of the masters), the bytes they
    # wrote back into masters (a host copy: not in bytes_d2h), the bytes of their results sent to
    # the device, and the host's time for them, measured (its kernels and write-backs). No weight
    # byte of theirs is copied: none of this is in bytes_h2d or page_ins.
    host_ops: int = 0
    host_read_bytes: int = 0
    host_written_bytes: int = 0
    host_result_bytes: int = 0
    host_seconds: float = 0.0
    # The device-side expert pool of a model wrapped with expert_pool=True (None without one): its
    # fetches (experts copied into a slot), hits (experts a call found in a slot), bytes_h2d (the
    # fetches' bytes, also counted in the top-level bytes_h2d), slots and bytes, summed over its
    # pools, and each pool's own figures under "pools". Its fetches are not page_ins.
    expert_pool: Optional[dict] = None

    def count_host_op(self, read: int, written: int, result: int, seconds: float) -> None:
        """An op computed from host masters (``ops/host_compute.py``): ``read`` bytes of them read,
        ``written`` bytes written back into them, ``result`` bytes sent to the device, in ``seconds``
        of the host's time. (Here, not on the pager: its counters are this object's.)"""
        self.host_ops += 1
        self.host_read_bytes += read
        self.host_written_bytes += written
        self.host_result_bytes += result
        self.host_seconds += seconds

    def __str__(self) -> str:
        # Each figure under its field's name (stats.bytes_h2d prints as bytes_h2d=...), byte counts
        # for people; the expert dictionaries are left to repr and the fields themselves.
        size = format_bytes
        return (
            f"OffloadStats(bytes_h2d={size(self.bytes_h2d)}, bytes_d2h={size(self.bytes_d2h)}, "
            f"page_ins={self.page_ins}, hits={self.hits}, evictions={self.evictions}, prefetches={self.prefetches}, "
            f"prefetch_hits={self.prefetch_hits}, resident_bytes={size(self.resident_bytes)}, "
            f"offloaded_bytes={size(self.offloaded_bytes)}, cached_bytes={size(self.cached_bytes)}, "
            f"budget_bytes={size(self.budget_bytes)}, peak_device_bytes={size(self.peak_device_bytes)}"
            + (f", pool_bytes={size(self.pool_bytes)}" if self.pool_bytes is not None else "")
            + (f", arena_overflows={self.arena_overflows} ({size(self.arena_overflow_bytes)})"
               if self.arena_overflows else "")
            + (f", host_ops={self.host_ops}, host_read_bytes={size(self.host_read_bytes)}, "
               f"host_written_bytes={size(self.host_written_bytes)}, host_result_bytes={size(self.host_result_bytes)}, "
               f"host_seconds={self.host_seconds:.3g}" if self.host_ops else "")
            + (f", expert_pool_fetches={self.expert_pool['fetches']}, expert_pool_hits={self.expert_pool['hits']}"
               if self.expert_pool is not None else "")
            + (f", max_memory_allocated={size(self.max_memory_allocated)}, "
               f"max_memory_reserved={size(self.max_memory_reserved)}" if self.max_memory_reserved is not None else "")
            + ")"
        )


def snapshot(stats: OffloadStats, budget, pool, figures, experts, expert_pool=None) -> OffloadStats:
    """A copy of a pager's ``stats`` with the amounts of the moment: its ``budget``'s counts, its slot
    ``pool``'s bytes (None without a budget), the device's ``figures`` (max allocated, max reserved;
    None on the emulated device), its ``experts``' report (None without routed experts) and its
    ``expert_pool``'s report, whose fetched bytes join ``bytes_h2d`` (reading the pool's device
    counters: on a GPU a wait for the work queued so far)."""
    s = dataclasses.replace(stats)
    s.resident_bytes = budget.resident_bytes
    s.offloaded_bytes = budget.offloaded_bytes
    s.cached_bytes = budget.paged_bytes
    s.budget_bytes = budget.whole()
    if pool is not None:
        s.pool_bytes = pool.reserved_bytes
        s.peak_pool_bytes = pool.peak_bytes
    if figures is not None:  # the real figures beside the logical ones
        s.max_memory_allocated, s.max_memory_reserved = figures
    if experts is not None:
        s.experts = experts.report()
        if experts.speculator is not None:
            s.guesses = experts.speculator.report()
    if expert_pool is not None:
        s.expert_pool = expert_pool.report()
        s.bytes_h2d += s.expert_pool["bytes_h2d"]
    return s


def format_bytes(n: Optional[float]) -> str:
    """Bytes for people: decimal units, two decimals; "-" for an unknown amount."""
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"
