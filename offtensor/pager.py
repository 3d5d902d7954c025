"""The pager: every byte of device memory that offloaded weights use is accounted for here.

A ``Pager`` owns one budget on one device. It knows how many bytes of resident (plain) weights
the model keeps on the device, keeps a bounded LRU cache of paged copies of host masters, copies
missing byte ranges host->device on a dedicated stream (or on the extension's worker thread on the
emulated device), and evicts a copy only once the device has finished every op that used it.

Everything stateful lives here: the cache, in-flight copies, events and statistics. The layers
above (dispatch) ask for "the device tensor for this OffloadedTensor" and say when the op that
used it has been enqueued; nothing below this module knows about modules or names.

The ``Pager`` composes three small objects, each owning one idea: ``_DeviceOps`` (the only place
the GPU and the emulated device differ: events vs copy-engine tickets), ``_SlotPool`` (the device
buffers every paged copy lives in) and ``_HostLifetimes`` (host sources kept until the copies
reading them have completed).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import os
import warnings
import weakref
from typing import Optional

import torch

from . import _ext

GiB = 1 << 30
# On the emulated device, copies this small that the caller waits for are done inline.
SMALL_COPY_BYTES = 1 << 20


@dataclasses.dataclass
class OffloadStats:
    """Counters of one pager. Byte counts are exact; ``peak_device_bytes`` is a high-water mark of
    resident + cached + in-flight bytes, i.e. what the budget limits."""

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
    # Device bytes held by the slot pool (in use + idle), now and at most; None without a budget.
    pool_bytes: Optional[int] = None
    peak_pool_bytes: Optional[int] = None
    # On a GPU, torch.cuda.max_memory_allocated / max_memory_reserved of the device (None on the
    # emulated device): the allocator's real figures beside the logical peak_device_bytes.
    max_memory_allocated: Optional[int] = None
    max_memory_reserved: Optional[int] = None
    # Part of resident_bytes held by plain tensor attributes of wrapped modules (not Parameters or
    # buffers: vLLM's W_UV); set by wrap.stats, 0 for a standalone pager.
    untracked_bytes: int = 0
    # Routed experts (offtensor.experts), when the model has offloaded stacked-expert tensors:
    # per stack name {hits, misses, hit_rate, bytes_h2d, prefetched_bytes, evictions}, and the
    # routing guesses {accuracy, recall, prefetched_bytes, wasted_bytes, routers: {name: {...}}}.
    experts: Optional[dict] = None
    guesses: Optional[dict] = None

    def __str__(self) -> str:
        size = format_bytes
        return (
            f"OffloadStats(h2d={size(self.bytes_h2d)}, d2h={size(self.bytes_d2h)}, page_ins={self.page_ins}, "
            f"hits={self.hits}, evictions={self.evictions}, prefetches={self.prefetches}, "
            f"prefetch_hits={self.prefetch_hits}, resident={size(self.resident_bytes)}, "
            f"offloaded={size(self.offloaded_bytes)}, cached={size(self.cached_bytes)}, "
            f"budget={size(self.budget_bytes)}, peak={size(self.peak_device_bytes)}"
            + (f", pool={size(self.pool_bytes)}" if self.pool_bytes is not None else "")
            + (f", max_allocated={size(self.max_memory_allocated)}, max_reserved={size(self.max_memory_reserved)}"
               if self.max_memory_reserved is not None else "")
            + ")"
        )


def format_bytes(n: Optional[float]) -> str:
    """Bytes for people: decimal units, two decimals; "-" for an unknown amount."""
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


class BudgetError(RuntimeError):
    """The budget cannot hold what an op needs at once."""


class _Master:
    """Identity of one host master allocation, shared by every OffloadedTensor aliasing it.

    Cache entries are keyed by ``master.id``; when the last OffloadedTensor referencing the master
    dies, this object dies with it and a finalizer drops its cached copies, so an address reused by
    a later allocation can never hit a stale copy.
    """

    __slots__ = ("id", "nbytes", "flat", "name", "_owner", "__weakref__")
    _ids = itertools.count(1)

    def __init__(self, pager: "Pager", nbytes: int):
        self.id = next(_Master._ids)
        self.nbytes = nbytes
        self.flat = None  # the master's whole storage as bytes, for prefetches (set by the tensor layer)
        # The weight's name in its model (set by wrap and load), so that errors name the tensor.
        self.name = None
        # A one-element list shared with the finalizer, so the finalizer always reaches the
        # current owner without holding a reference to this object.
        self._owner = [weakref.ref(pager)]
        pager.offloaded_bytes += nbytes
        weakref.finalize(self, _Master._died, self._owner, self.id, nbytes)

    @property
    def pager(self) -> "Pager":
        return self._owner[0]()

    def move_to(self, pager: "Pager") -> None:
        """Hand this master (and its accounting) to another pager, e.g. when wrap_model adopts an
        already offloaded tensor."""
        old = self.pager
        if pager is old:
            return
        if old is not None:
            old._drop_master(self.id)
            old.offloaded_bytes -= self.nbytes
        self._owner[0] = weakref.ref(pager)
        pager.offloaded_bytes += self.nbytes

    @staticmethod
    def _died(owner, master_id: int, nbytes: int) -> None:
        pager = owner[0]()
        if pager is not None:
            pager._drop_master(master_id)
            pager.offloaded_bytes -= nbytes


class _DeviceOps:
    """The only place the GPU and the emulated device differ: the copy primitive and the completion
    token. A token is a ``torch.cuda.Event`` on a GPU and a copy-engine ticket (int) on the
    emulated device; waiting, eviction, slot reuse and host lifetimes only ask ``done``,
    ``block`` and ``order_after`` about tokens. Owned by one pager; its pool and lifetime records
    hold this object, not the pager, so the pager's finalizer can run."""

    __slots__ = ("device", "cuda", "strict", "engine", "copy_stream", "stream")

    def __init__(self, device: torch.device, strict: bool):
        self.device = device
        self.cuda = device.type == "cuda"
        self.strict = strict and not self.cuda
        self.stream = None  # the compute stream of the op being paged: looked up once per op
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device=device)
            self.engine = None
        else:
            self.copy_stream = None
            self.engine = _ext.StrictCopyEngine() if self.strict else _ext.CopyEngine()

    def done(self, token) -> bool:
        if token is None:
            return True
        if isinstance(token, int):
            return self.engine.query(token)
        return token.query()

    def block(self, token) -> None:
        if token is None:
            return
        if isinstance(token, int):
            self.engine.wait(token)
        else:
            token.synchronize()

    def order_after(self, token, stream=None) -> None:
        """Work enqueued next on ``stream`` (a GPU stream; default the op's) runs after ``token``;
        on the emulated device, where ops run as they are called, the host waits."""
        if token is None:
            return
        if isinstance(token, int):
            self.engine.wait(token)
        else:
            (stream or self.current_stream()).wait_event(token)

    def current_stream(self):
        if self.stream is None:
            self.stream = torch.cuda.current_stream(self.device)
        return self.stream

    def allocate(self, nbytes: int) -> torch.Tensor:
        if self.cuda:
            # Every slot comes from the copy stream's pool of the caching allocator; reuse is
            # ordered by the slots' own events, not by the allocator.
            with torch.cuda.stream(self.copy_stream):
                return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def slot_token(self, slot: "_Slot", stream):
        """What work on ``stream`` must wait for before reusing ``slot``. A slot last used by
        transient copies on a compute stream has no event: on that same stream, order is enough;
        another stream gets an event recorded now, after everything enqueued there, the last use
        included. So events are made only where a slot crosses streams, not per op."""
        token, last = slot.free_after, slot.last_stream
        slot.free_after = slot.last_stream = None
        if token is None and last is not None and last != stream:
            token = torch.cuda.Event()
            token.record(last)
        return token

    def before_free(self, slot: "_Slot") -> None:
        """A slot's block goes back to the allocator, which may hand it to the next copy-stream
        allocation at once: that stream (or, emulated, the host) waits for its last use first."""
        token = self.slot_token(slot, self.copy_stream)
        if token is None:
            return
        if isinstance(token, int):
            self.engine.wait(token)
        else:
            self.copy_stream.wait_event(token)


class _Slot:
    """One device buffer of the slot pool: ``nbytes`` bytes, reused for any copy of that size.

    ``free_after`` is the completion token (a ``torch.cuda.Event``, or a copy-engine ticket on the
    emulated device) after which nothing reads or writes the buffer's current contents any more;
    whoever takes the slot next orders itself after it."""

    __slots__ = ("buf", "nbytes", "free_after", "last_stream")

    def __init__(self, buf: torch.Tensor, nbytes: int):
        self.buf = buf
        self.nbytes = nbytes
        self.free_after = None
        self.last_stream = None  # GPU: the compute stream of its last (transient) use, when free_after is None


class _SlotPool:
    """Every paged copy of a budgeted pager lives in a slot of this pool, reused by byte size.

    Why a pool rather than fresh ``torch.empty`` per copy:
    - on a GPU, the caching allocator keeps one pool of blocks per stream, so blocks freed after a
      copy-stream allocation cannot serve the compute stream (and the reverse): reserved memory
      grows past the budget. Here every slot is allocated on the copy stream once and reused in
      an order the pager's own events enforce, so the pool's bytes are what is reserved for paging;
    - stable addresses per size (the door to CUDA graphs) and no first-touch of fresh pages on the
      emulated device.
    The pool holds at most ``cap`` (budget minus resident) bytes of slots, in use or idle, unless
    the slots in use alone need more (they never do: the budget bounds them). Idle slots of other
    sizes are freed, least recently used first, to make room for a new size; exact sizes keep
    the bound exact, at the price of reallocating when sizes alternate under a tight budget.

    Stated slack of real (reserved) memory over the budget on a GPU: the caching allocator's
    rounding of each slot (to 2 MiB for large blocks, so at most 2 MiB per slot) plus what ops
    allocate themselves (activations, gathered-row results), which the budget never counted.
    ``test_reserved_memory_stays_within_the_budget_plus_slack`` checks budget + 64 MiB on a GPU.
    """

    __slots__ = ("_ops", "_idle", "live_bytes", "idle_bytes", "peak_bytes", "allocations")

    def __init__(self, ops: _DeviceOps):
        self._ops = ops
        # nbytes -> idle slots of that size; the dict's order is least recently given back first
        self._idle: "collections.OrderedDict[int, list[_Slot]]" = collections.OrderedDict()
        self.live_bytes = 0
        self.idle_bytes = 0
        self.peak_bytes = 0
        self.allocations = 0  # slots ever allocated: page_ins minus this is how often a slot was reused

    def take(self, nbytes: int, cap: int, stream=None) -> _Slot:
        """A slot of ``nbytes``, the pool holding at most ``cap`` bytes; its previous contents are
        dead for work enqueued on ``stream`` (the stream that will write it) or, emulated, now."""
        idle = self._idle.get(nbytes)
        if idle:
            slot = idle.pop()
            if not idle:
                del self._idle[nbytes]
            self.idle_bytes -= nbytes
            self._ops.order_after(self._ops.slot_token(slot, stream), stream)
            if self._ops.strict:
                slot.buf.fill_(0xFF)
        else:
            self._trim(cap - self.live_bytes - nbytes)
            slot = _Slot(self._ops.allocate(nbytes), nbytes)
            self.allocations += 1
        self.live_bytes += nbytes
        total = self.live_bytes + self.idle_bytes
        if total > self.peak_bytes:
            self.peak_bytes = total
        return slot

    def give(self, slot: _Slot, free_after, cap: int, last_stream=None) -> None:
        """``slot`` is no longer used once ``free_after`` has completed, or (GPU, ``free_after``
        None) once the work enqueued so far on ``last_stream`` has."""
        self.live_bytes -= slot.nbytes
        slot.free_after = free_after
        slot.last_stream = last_stream if free_after is None else None
        if self._ops.strict and self._ops.done(free_after):
            # A reader that outlives its release (an op result aliasing a paged copy) now sees
            # NaN / -1 instead of plausible stale weights. Never waited for here: the wait would
            # hide the very races strict mode is for; a slot still being copied into is poisoned
            # when it is taken again.
            slot.free_after = None
            slot.buf.fill_(0xFF)
        self._idle.setdefault(slot.nbytes, []).append(slot)
        self._idle.move_to_end(slot.nbytes)
        self.idle_bytes += slot.nbytes
        self._trim(cap - self.live_bytes)

    def _trim(self, room: int) -> None:
        """Free idle slots, least recently given back first, until idle bytes fit ``room``."""
        while self.idle_bytes > max(room, 0) and self._idle:
            nbytes, slots = next(iter(self._idle.items()))
            slot = slots.pop(0)
            if not slots:
                del self._idle[nbytes]
            self.idle_bytes -= nbytes
            self._ops.before_free(slot)

    def clear(self) -> None:
        self._trim(0)

    def tokens(self):
        return [self._ops.slot_token(s, None) for slots in self._idle.values() for s in slots]


class _HostLifetimes:
    """Host sources of copies that may still be running, each kept with its completion token.

    DESIGN.md's host-lifetime rule: a master, a gathered-rows buffer or a temporary must outlive
    every asynchronous copy reading it, on a GPU (where freeing would ``cudaHostUnregister`` and
    unmap memory under a DMA) exactly as on the emulated device. A record is
    ``[storage_ptr, token, src, stream]``. A transient copy on a GPU's compute stream gets no
    event of its own (``token`` None): once ``SEAL_EVERY`` such records are pending, one event
    recorded on their stream, after all of them, completes them together.
    """

    SEAL_EVERY = 32
    __slots__ = ("_ops", "_records", "_unsealed")

    def __init__(self, ops: _DeviceOps):
        self._ops = ops
        self._records: "collections.deque[list]" = collections.deque()
        self._unsealed = 0

    def keep(self, src: torch.Tensor, token, stream=None) -> list:
        if _TEST_DROP_SOURCES:
            src = None  # test-only: forget the source, as the code did before (a premature free)
        record = [_storage_ptr(src), token, src, stream]
        self._records.append(record)
        if token is None:
            self._unsealed += 1
            if self._unsealed >= self.SEAL_EVERY:
                self._seal()
        self.collect()
        return record

    def _seal(self) -> None:
        events = {}
        for record in self._records:
            if record[1] is None:
                event = events.get(record[3])
                if event is None:
                    event = events[record[3]] = torch.cuda.Event()
                    event.record(record[3])
                record[1] = event
        self._unsealed = 0

    def collect(self) -> None:
        """Drop the records of finished copies, oldest first (copies mostly finish in order)."""
        records, done = self._records, self._ops.done
        while records and records[0][1] is not None and done(records[0][1]):
            records.popleft()

    def wait_for(self, storage_ptr: Optional[int]) -> None:
        """Block until no copy reads the host storage at ``storage_ptr`` (every storage if None)."""
        kept = collections.deque()
        for record in self._records:
            if storage_ptr is None or record[0] == storage_ptr:
                if record[1] is None:
                    record[3].synchronize()  # a transient copy without an event: its stream
                    self._unsealed -= 1
                else:
                    self._ops.block(record[1])
            else:
                kept.append(record)
        self._records = kept

    def __len__(self) -> int:
        return len(self._records)


def _storage_ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.untyped_storage().data_ptr()


# Test-only switches that undo the host-lifetime fix and the wait for a copy, so a test can show
# that the strict emulated device turns either mistake into a failure (tests/test_pager.py).
_TEST_DROP_SOURCES = False
_TEST_SKIP_WAITS = False


def strict_from_env() -> bool:
    """``OFFTENSOR_STRICT=1``: emulated-device pagers use the strict copy engine (late, out-of-order
    copies into poisoned buffers; see ``_ext.StrictCopyEngine``)."""
    return os.environ.get("OFFTENSOR_STRICT", "").strip().lower() not in ("", "0", "false", "no")


class _Entry:
    """One paged copy: the byte range [lo, hi) (in elements of ``dtype``) of a master on the device."""

    __slots__ = ("key", "slot", "buf", "nbytes", "ready", "last_use", "users", "prefetched")

    def __init__(self, key, slot, buf, nbytes, ready):
        self.key = key
        self.slot = slot  # the pool slot holding buf; None for a copy outside the pool
        self.buf = buf
        self.nbytes = nbytes
        self.ready = ready  # copy-engine ticket or torch.cuda.Event; None once known complete
        self.last_use = None  # torch.cuda.Event recorded after the last op that read buf
        self.users = 0  # ops currently holding this entry; never evicted while > 0
        self.prefetched = False


def host_layout(host: torch.Tensor):
    """(lo, hi, shape, stride, offset) of a host view: the element range [lo, hi) of its storage
    that it covers, and its layout inside that storage."""
    lo = offset = host.storage_offset()
    shape, stride = host.shape, host.stride()
    hi = lo + 1
    for size, step in zip(shape, stride):
        hi += (size - 1) * step
    return lo, hi, shape, stride, offset


def _covering_range(host: torch.Tensor):
    """Elements [lo, hi) of the master storage that a (possibly strided) view touches."""
    return host_layout(host)[:2]


class Pager:
    """Budget, device cache and copies for one device.

    ``budget_bytes=None`` means "no cache": every op pages what it needs and the copy dies with the
    op. That is what a standalone ``offload()`` tensor uses. With a budget, paged copies stay
    cached (LRU) as long as resident + cached + in-flight bytes fit, in slots of one pool.

    One code path for both devices: a copy's completion token is a ``torch.cuda.Event`` on a GPU and
    a copy-engine ticket on the emulated device, and only ``_DeviceOps`` tells them apart.
    ``strict`` (default: the
    ``OFFTENSOR_STRICT`` environment variable) makes the emulated device complete copies late
    and out of order into poisoned buffers, so a missing wait or a premature free gives wrong
    values or an error instead of passing by luck.
    """

    _defaults: dict = {}

    def __init__(self, device: torch.device, budget_bytes: Optional[int] = None, strict: Optional[bool] = None):
        self.device = device
        self.budget_bytes = budget_bytes
        self.resident_bytes = 0
        self.offloaded_bytes = 0
        self.paged_bytes = 0
        self.stats = OffloadStats()
        self._cache: "collections.OrderedDict[tuple, _Entry]" = collections.OrderedDict()
        self._by_master: dict[int, list[_Entry]] = {}
        self._ops = ops = _DeviceOps(device, bool(strict_from_env() if strict is None else strict))
        self._cuda = ops.cuda
        self.strict = ops.strict
        self._copy_stream = ops.copy_stream
        self._engine = ops.engine
        self._pool = _SlotPool(ops) if budget_bytes is not None else None
        self._lifetimes = _HostLifetimes(ops)
        self.prefetcher = None  # set by wrap_model when prefetch=True
        # experts.ExpertStacks when the model has offloaded stacked experts (experts.attach): per-stack
        # counters, the frequency-aware choice of which expert to evict, routing speculation.
        self.experts = None
        # timeline.Recorder while ot.timeline/ot.plan records; told of copies, uses, releases, frees.
        self.recorder = None
        # Teardown waits for the last use of every slot and the last copy from every host source
        # before the slots and sources go (the finalizer holds them, not the pager).
        weakref.finalize(self, _teardown, self._cache, self._pool, self._lifetimes)

    # ------------------------------------------------------------------ construction helpers

    @classmethod
    def default(cls, device: torch.device) -> "Pager":
        """The uncached pager that standalone ``offload()`` tensors on ``device`` share."""
        pager = cls._defaults.get(device)
        if pager is None:
            pager = cls._defaults[device] = cls(device, None)
        return pager

    def new_master(self, nbytes: int) -> _Master:
        return _Master(self, nbytes)

    # ------------------------------------------------------------------ accounting

    def free_bytes(self) -> Optional[int]:
        """Bytes an op could page right now, evicting every cached copy no op is using; None
        without a budget. Lets an op that selects many slices (all experts of a prefill) page
        them a chunk at a time instead of failing."""
        if self.budget_bytes is None:
            return None
        evictable = sum(e.nbytes for e in self._cache.values() if not e.users)
        return self.budget_bytes - self.resident_bytes - (self.paged_bytes - evictable)

    def _note_peak(self) -> None:
        used = self.resident_bytes + self.paged_bytes
        if used > self.stats.peak_device_bytes:
            self.stats.peak_device_bytes = used

    def snapshot(self) -> OffloadStats:
        s = dataclasses.replace(self.stats)
        s.resident_bytes = self.resident_bytes
        s.offloaded_bytes = self.offloaded_bytes
        s.cached_bytes = self.paged_bytes
        s.budget_bytes = self.budget_bytes
        if self._pool is not None:
            s.pool_bytes = self._pool.live_bytes + self._pool.idle_bytes
            s.peak_pool_bytes = self._pool.peak_bytes
        if self._cuda:
            # The real figures beside the logical ones: the whole device's, since the caching
            # allocator does not tell one pager's blocks from anyone else's.
            s.max_memory_allocated = torch.cuda.max_memory_allocated(self.device)
            s.max_memory_reserved = torch.cuda.max_memory_reserved(self.device)
        if self.experts is not None:
            s.experts = self.experts.report()
            if self.experts.speculator is not None:
                s.guesses = self.experts.speculator.report()
        return s

    def reset_stats(self) -> None:
        self.stats = OffloadStats()
        if self.experts is not None:
            self.experts.reset()
        if self._pool is not None:
            self._pool.peak_bytes = self._pool.live_bytes + self._pool.idle_bytes
        self._note_peak()

    # ------------------------------------------------------------------ paging

    def page(self, host: torch.Tensor, master: _Master, name="tensor", private: bool = False, layout=None):
        """Device tensor with ``host``'s values, shape and strides, and the entry backing it.

        The copy comes from the cache, an in-flight prefetch, or a new host->device copy. With
        ``private=True`` (the op will write to it) the copy bypasses the cache. The caller must
        ``release`` the entry once its op is enqueued; until then the entry cannot be evicted.
        ``layout`` is ``host_layout(host)`` if the caller has it already (it memoizes it per tensor).
        """
        if host.numel() == 0:
            return torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=self.device), None
        lo, hi, shape, stride, offset = layout or host_layout(host)
        if private or self.budget_bytes is None:
            entry = self._transient(host.as_strided((hi - lo,), (1,), lo), (hi - lo) * host.element_size(), name)
            base = lo
        else:
            dtype = host.dtype
            key = (master.id, dtype, lo, hi)
            experts = self.experts
            if experts is not None:
                experts.paging(master.id)  # before the lookup: eviction for this copy knows the layer
            entry = self._cache.get(key) or self._find_containing(master.id, dtype, lo, hi)
            hit = entry is not None
            if hit:
                self._cache.move_to_end(entry.key)
                self.stats.hits += 1
                if entry.prefetched:
                    entry.prefetched = False
                    self.stats.prefetch_hits += 1
            else:
                nbytes = (hi - lo) * host.element_size()
                entry = self._insert(key, host.as_strided((hi - lo,), (1,), lo), nbytes, name)
            if experts is not None:
                experts.accessed(entry.key, hit)
            base = entry.key[2]
            # Held before prefetching: a prefetch makes room by evicting unused entries, and this
            # one must survive until its op is enqueued (on a GPU its block would be reused).
            entry.users += 1
            if self.prefetcher is not None:
                self.prefetcher.accessed(self, master, key)
            if self.recorder is not None:  # timeline: the op about to run reads this copy
                self.recorder.used(entry)
            if entry.ready is not None:  # a cache hit on a completed copy skips the call
                self._wait_ready(entry)
            return entry.buf.as_strided(shape, stride, offset - base), entry
        if self.recorder is not None:  # timeline: the op about to run reads this copy
            self.recorder.used(entry)
        self._wait_ready(entry)
        entry.users += 1
        return entry.buf.as_strided(shape, stride, offset - base), entry

    def upload(self, src: torch.Tensor, name="tensor"):
        """Copy a host tensor (e.g. gathered rows) to the device for one op; accounted like a page.
        ``src`` is kept alive until the copy has completed, so the caller may drop it at once."""
        src = src.contiguous()
        entry = self._transient(src.view(-1), src.numel() * src.element_size(), name)
        if self.recorder is not None:  # timeline: the op about to run reads this copy
            self.recorder.used(entry)
        self._wait_ready(entry)
        entry.users += 1
        return entry.buf.view(src.shape), entry

    def copy_out(self, host: torch.Tensor) -> torch.Tensor:
        """A device copy owned by the caller (``materialize``, ``unwrap_model``): never cached,
        outside the budget. The host bytes stay alive until the copy has completed, even if the
        caller drops the master right after (unwrap swaps the copy in at once)."""
        if host.numel() == 0:
            return torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=self.device)
        lo, hi = _covering_range(host)
        src = host.as_strided((hi - lo,), (1,), lo)
        buf = torch.empty(hi - lo, dtype=host.dtype, device=self.device)
        if self._cuda:
            stream = torch.cuda.current_stream(self.device)
            buf.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
            self._lifetimes.keep(src, done)
        else:
            ticket = self._engine.submit(buf, src)
            self._lifetimes.keep(src, ticket)
            if not _TEST_SKIP_WAITS:
                self._engine.wait(ticket)  # no streams here: the caller's next op reads buf
                self._lifetimes.collect()  # the source may be the last reference to its master
        self.stats.page_ins += 1
        self.stats.bytes_h2d += (hi - lo) * host.element_size()
        return buf.as_strided(host.shape, host.stride(), host.storage_offset() - lo)

    def new_step(self) -> None:
        """A forward of the wrapped model begins: one pass of the prefetch schedule and of the
        expert statistics ends."""
        if self.prefetcher is not None:
            self.prefetcher.step()
        if self.experts is not None:
            self.experts.step()

    def is_cached(self, key) -> bool:
        return key in self._cache

    def prefetch(self, master: _Master, dtype: torch.dtype, lo: int, hi: int) -> bool:
        """Start copying elements [lo, hi) of ``master`` unless cached; never evicts an entry that
        is in use and never exceeds the budget. Returns whether a copy is cached or started."""
        key = (master.id, dtype, lo, hi)
        if key in self._cache:
            return True
        if self.budget_bytes is None or master.flat is None:
            return False
        itemsize = dtype.itemsize
        nbytes = (hi - lo) * itemsize
        if not self._make_room(nbytes, strict=False, keep_prefetched=True):
            return False
        src = master.flat[lo * itemsize : hi * itemsize].view(dtype)
        entry = self._insert(key, src, nbytes, "prefetch", room_made=True)
        entry.prefetched = True
        self.stats.prefetches += 1
        return True

    def release(self, entries) -> None:
        """The op that used ``entries`` has been enqueued: mark when the device is done with them.

        On a GPU an event is recorded on the op's stream, after the op, only when a cached copy was
        used: it is that copy's last use, which eviction waits for. Transient copies need none:
        their slots are reused in the op stream's order (``_DeviceOps.slot_token``) and their
        host sources are released in batches (``_HostLifetimes``)."""
        stream = self._ops.stream
        self._ops.stream = None
        event = None
        if self._cuda:
            stream = stream or torch.cuda.current_stream(self.device)
            for entry in entries:
                if entry.key is not None:
                    event = torch.cuda.Event()
                    event.record(stream)
                    break
        if self.recorder is not None:  # timeline: the op just enqueued is these entries' last reader
            self.recorder.released(entries)
        for entry in entries:
            entry.users -= 1
            if entry.key is None:
                self.paged_bytes -= entry.nbytes
                if entry.slot is not None:
                    if self._cuda:
                        self._pool.give(entry.slot, None, self._cap(), stream)
                    else:
                        self._pool.give(entry.slot, entry.ready, self._cap())
                    entry.slot = None
            elif event is not None:
                entry.last_use = event

    def before_write(self, master: _Master) -> None:
        """The host master is about to change: wait until no copy still reads it (its own copies
        only, not the whole device), and drop its cached copies, which would be stale."""
        self._lifetimes.wait_for(_storage_ptr(master.flat))
        self._drop_master(master.id)

    def clear(self) -> None:
        """Drop every cached copy (e.g. before unwrapping) and the pool's idle slots."""
        for master_id in list(self._by_master):
            self._drop_master(master_id)
        if self._pool is not None:
            self._pool.clear()

    def wait_copies(self) -> None:
        """Block until every copy this pager started has completed (and release their sources)."""
        self._lifetimes.wait_for(None)

    def _cap(self) -> int:
        return max(0, self.budget_bytes - self.resident_bytes)

    # ------------------------------------------------------------------ internals

    def _find_containing(self, master_id, dtype, lo, hi) -> Optional[_Entry]:
        for entry in self._by_master.get(master_id, ()):
            _, edtype, elo, ehi = entry.key
            if edtype == dtype and elo <= lo and hi <= ehi:
                return entry
        return None

    def _insert(self, key, src: torch.Tensor, nbytes: int, name, room_made: bool = False) -> _Entry:
        if not room_made:
            self._make_room(nbytes, strict=True, name=name)
        if self._cuda:
            slot = self._pool.take(nbytes, self._cap(), self._copy_stream)
            buf = slot.buf.view(src.dtype)
            with torch.cuda.stream(self._copy_stream):
                buf.copy_(src, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(self._copy_stream)
        else:
            slot = self._pool.take(nbytes, self._cap())
            buf = slot.buf.view(src.dtype)
            ready = self._engine.submit(buf, src)
        self._lifetimes.keep(src, ready)
        entry = _Entry(key, slot, buf, nbytes, ready)
        if self.recorder is not None:  # timeline: a copy on the copy stream
            self.recorder.copied(self, entry, nbytes, "copy", prefetch=name == "prefetch")
        self._cache[key] = entry
        self._by_master.setdefault(key[0], []).append(entry)
        if self.experts is not None:
            self.experts.copied(key, nbytes, prefetch=name == "prefetch")
        self.paged_bytes += nbytes
        self.stats.page_ins += 1
        self.stats.bytes_h2d += nbytes
        self._note_peak()
        return entry

    def _transient(self, src: torch.Tensor, nbytes: int, name) -> _Entry:
        self._make_room(nbytes, strict=True, name=name)
        stream = self._ops.current_stream() if self._cuda else None
        if self._pool is not None:
            slot = self._pool.take(nbytes, self._cap(), stream)
            buf = slot.buf.view(src.dtype)
        else:
            # No budget, no pool: on a GPU the block is allocated on the compute stream, so the
            # allocator reuses it only after the op that reads it.
            slot, buf = None, torch.empty(src.numel(), dtype=src.dtype, device=self.device)
        ready = None
        if self._cuda:
            buf.copy_(src, non_blocking=True)  # on the compute stream, before the op that reads it
            self._lifetimes.keep(src, None, stream)
        elif nbytes < SMALL_COPY_BYTES and not self.strict:
            buf.copy_(src)  # handing a copy we wait for anyway to the worker thread costs more than it
        else:
            ready = self._engine.submit(buf, src)
            self._lifetimes.keep(src, ready)
        self.paged_bytes += nbytes
        self.stats.page_ins += 1
        self.stats.bytes_h2d += nbytes
        self._note_peak()
        entry = _Entry(None, slot, buf, nbytes, ready)
        if self.recorder is not None:  # timeline: a copy in line, on the compute stream
            self.recorder.copied(self, entry, nbytes, "compute", prefetch=False)
        return entry

    def _wait_ready(self, entry: _Entry) -> None:
        ready = entry.ready
        if ready is None or _TEST_SKIP_WAITS:
            return
        if self._cuda:
            if ready.query():
                entry.ready = None  # completed: later hits skip the wait
            else:
                self._ops.current_stream().wait_event(ready)
        else:
            self._engine.wait(ready)
            entry.ready = None
            if self._lifetimes:
                self._lifetimes.collect()  # a waited-for source need not outlive its op

    def _make_room(self, nbytes: int, strict: bool, name="tensor", keep_prefetched: bool = False) -> bool:
        """Evict unused copies until ``nbytes`` more fit the budget. ``name`` (a string, or any
        object whose repr describes the tensor: formatted only for the error) says what is paged.
        A prefetch passes ``keep_prefetched``: evicting an earlier prefetch that is still to be used
        would throw away a copy to make room for one needed later."""
        budget = self.budget_bytes
        if budget is None or self.resident_bytes + self.paged_bytes + nbytes <= budget:
            return True
        while True:
            # Least recently used first; the few entries the current op holds are skipped. Routed
            # experts go by layer order and use frequency (experts.ExpertStacks.victim).
            candidates = (e for e in self._cache.values() if not e.users and not (keep_prefetched and e.prefetched))
            victim = next(candidates, None) if self.experts is None else self.experts.victim(self._cache, self._by_master, self._cap(), candidates)
            if victim is None:
                break
            self._evict(victim)
            if self.resident_bytes + self.paged_bytes + nbytes <= budget:
                return True
        if not strict:
            return False
        in_use = self.paged_bytes - sum(e.nbytes for e in self._cache.values() if not e.users)
        what = name if isinstance(name, str) else repr(name)
        raise BudgetError(
            f"offtensor: paging {what} needs {nbytes} bytes on {self.device}, but the budget of {budget} bytes "
            f"holds {self.resident_bytes} bytes of resident weights and {in_use} bytes of copies that the "
            f"current op is using, leaving {budget - self.resident_bytes - in_use} bytes. "
            f"Raise budget_gb, or offload more weights so fewer stay resident."
        )

    def _evict(self, entry: _Entry) -> None:
        if self.experts is not None:
            self.experts.evicted(entry.key)
        self._remove(entry)
        self.stats.evictions += 1

    def _remove(self, entry: _Entry) -> None:
        """Drop a cached copy without waiting: its slot goes back to the pool, to be reused only
        after the last op that read it (or, if none did, its copy) has completed. Its host source
        stays with the lifetime records until the copy has completed."""
        if self.recorder is not None:  # timeline: the next copy reuses this block after its last reader
            self.recorder.freed(entry)
        del self._cache[entry.key]
        siblings = self._by_master[entry.key[0]]
        siblings.remove(entry)
        if not siblings:
            del self._by_master[entry.key[0]]
        self.paged_bytes -= entry.nbytes
        if entry.slot is not None:
            self._pool.give(entry.slot, entry.last_use or entry.ready, self._cap())
            entry.slot = None

    def _drop_master(self, master_id: int) -> None:
        for entry in list(self._by_master.get(master_id, ())):
            self._remove(entry)


def _teardown(cache, pool, lifetimes) -> None:
    """A pager died: wait for the last use of each cached copy and slot and for each copy still
    reading a host source, then let them go. Runs from a finalizer, so it must not raise."""
    try:
        for entry in cache.values():
            for token in (entry.ready, entry.last_use):
                if token is not None and not isinstance(token, int):
                    token.synchronize()
        if pool is not None:
            for token in pool.tokens():
                if token is not None and not isinstance(token, int):
                    token.synchronize()
        lifetimes.wait_for(None)
    except Exception as error:  # e.g. at interpreter exit, after CUDA has shut down
        warnings.warn(f"offtensor: a pager's teardown could not wait for its copies: {error}", RuntimeWarning)


def resolve_device(device) -> torch.device:
    """``None`` -> the current CUDA device when there is one, else the emulated device (cpu)."""
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"offtensor: {device!r} is not a device: {e}") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise ValueError(
            f"offtensor: device {device} is not supported; offload to 'cuda' (or 'cpu', the emulated device)"
        )
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = torch.cuda.current_device() if device.index is None and count else device.index or 0
    if index >= count:
        raise ValueError(
            f"offtensor: device {device} does not exist: this machine has {count} CUDA device(s). "
            f"Use device='cpu' for the emulated device."
        )
    return torch.device("cuda", index)
