"""The pager: every byte of device memory that offloaded weights use is accounted for here.

A ``Pager`` owns one budget on one device. It knows how many bytes of resident (plain) weights
the model keeps on the device, keeps a bounded LRU cache of paged copies of host masters, copies
missing byte ranges host->device on a dedicated stream (or on the extension's worker thread on the
emulated device), and evicts a copy only once the device has finished every op that used it.

Everything stateful lives here: the cache, in-flight copies, events and statistics. The layers
above (dispatch) ask for "the device tensor for this OffloadedTensor" and say when the op that
used it has been enqueued; nothing below this module knows about modules or names.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
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
    # Part of resident_bytes held by plain tensor attributes of wrapped modules (not Parameters or
    # buffers: vLLM's W_UV); set by wrap.stats, 0 for a standalone pager.
    untracked_bytes: int = 0

    def __str__(self) -> str:
        size = format_bytes
        return (
            f"OffloadStats(h2d={size(self.bytes_h2d)}, d2h={size(self.bytes_d2h)}, page_ins={self.page_ins}, "
            f"hits={self.hits}, evictions={self.evictions}, prefetches={self.prefetches}, "
            f"prefetch_hits={self.prefetch_hits}, resident={size(self.resident_bytes)}, "
            f"offloaded={size(self.offloaded_bytes)}, cached={size(self.cached_bytes)}, "
            f"budget={size(self.budget_bytes)}, peak={size(self.peak_device_bytes)})"
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

    __slots__ = ("id", "nbytes", "flat", "_owner", "__weakref__")
    _ids = itertools.count(1)

    def __init__(self, pager: "Pager", nbytes: int):
        self.id = next(_Master._ids)
        self.nbytes = nbytes
        self.flat = None  # the master's whole storage as bytes, for prefetches (set by the tensor layer)
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


class _Entry:
    """One paged copy: the byte range [lo, hi) (in elements of ``dtype``) of a master on the device."""

    __slots__ = ("key", "buf", "nbytes", "ready", "last_use", "users", "prefetched")

    def __init__(self, key, buf, nbytes, ready):
        self.key = key
        self.buf = buf
        self.nbytes = nbytes
        self.ready = ready  # copy-engine ticket (emulated) or torch.cuda.Event, None once known done
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
    cached (LRU) as long as resident + cached + in-flight bytes fit.
    """

    _defaults: dict = {}

    def __init__(self, device: torch.device, budget_bytes: Optional[int] = None):
        self.device = device
        self.budget_bytes = budget_bytes
        self.resident_bytes = 0
        self.offloaded_bytes = 0
        self.paged_bytes = 0
        self.stats = OffloadStats()
        self._cache: "collections.OrderedDict[tuple, _Entry]" = collections.OrderedDict()
        self._by_master: dict[int, list[_Entry]] = {}
        self._cuda = device.type == "cuda"
        if self._cuda:
            self._copy_stream = torch.cuda.Stream(device=device)
        else:
            self._engine = _ext.CopyEngine()
        self.prefetcher = None  # set by wrap_model when prefetch=True

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
        return s

    def reset_stats(self) -> None:
        self.stats = OffloadStats()
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
        nbytes = (hi - lo) * host.element_size()
        if private or self.budget_bytes is None:
            entry = self._transient(host.as_strided((hi - lo,), (1,), lo), nbytes, name)
            base = lo
        else:
            key = (master.id, host.dtype, lo, hi)
            entry = self._cache.get(key) or self._find_containing(master.id, host.dtype, lo, hi)
            if entry is not None:
                self._cache.move_to_end(entry.key)
                self.stats.hits += 1
                if entry.prefetched:
                    entry.prefetched = False
                    self.stats.prefetch_hits += 1
            else:
                entry = self._insert(key, host.as_strided((hi - lo,), (1,), lo), nbytes, name)
            base = entry.key[2]
            # Held before prefetching: a prefetch makes room by evicting unused entries, and this
            # one must survive until its op is enqueued (on a GPU its block would be reused).
            entry.users += 1
            if self.prefetcher is not None:
                self.prefetcher.accessed(self, master, key)
            self._wait_ready(entry)
            return entry.buf.as_strided(shape, stride, offset - base), entry
        self._wait_ready(entry)
        entry.users += 1
        return entry.buf.as_strided(shape, stride, offset - base), entry

    def upload(self, src: torch.Tensor, name="tensor"):
        """Copy a host tensor (e.g. gathered rows) to the device for one op; accounted like a page."""
        src = src.contiguous()
        entry = self._transient(src.view(-1), src.numel() * src.element_size(), name)
        self._wait_ready(entry)
        entry.users += 1
        return entry.buf.view(src.shape), entry

    def copy_out(self, host: torch.Tensor) -> torch.Tensor:
        """A device copy owned by the caller (``materialize``): never cached, outside the budget."""
        if host.numel() == 0:
            return torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=self.device)
        lo, hi = _covering_range(host)
        buf = torch.empty(hi - lo, dtype=host.dtype, device=self.device)
        self._copy_now(buf, host.as_strided((hi - lo,), (1,), lo))
        self.stats.page_ins += 1
        self.stats.bytes_h2d += (hi - lo) * host.element_size()
        return buf.as_strided(host.shape, host.stride(), host.storage_offset() - lo)

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
        """The op that used ``entries`` has been enqueued: mark when the device is done with them."""
        event = None
        if self._cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        for entry in entries:
            entry.users -= 1
            if entry.key is None:
                # A transient copy dies with its op. On a GPU it was allocated on the compute stream,
                # so the allocator only hands its block out again after the op has run.
                self.paged_bytes -= entry.nbytes
            elif event is not None:
                entry.last_use = event

    def before_write(self, master: _Master) -> None:
        """The host master is about to change: wait until no copy can still be reading it, and
        drop its cached copies, which would be stale."""
        if self._cuda:
            # Host->device copies of pinned memory run asynchronously, on the copy stream
            # (prefetches) or the compute stream (transient pages of ops already enqueued); writes
            # to weights are rare (loading, optimizer steps), so one full wait is the simple answer.
            torch.cuda.synchronize(self.device)
        self._drop_master(master.id)

    def clear(self) -> None:
        """Drop every cached copy (e.g. before unwrapping)."""
        for master_id in list(self._by_master):
            self._drop_master(master_id)

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
            with torch.cuda.stream(self._copy_stream):
                # Allocated on the copy stream so the allocator only reuses this block in copy-stream
                # order; eviction makes that stream wait for the last op that read it.
                buf = torch.empty(src.numel(), dtype=src.dtype, device=self.device)
                buf.copy_(src, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(self._copy_stream)
        else:
            buf = torch.empty(src.numel(), dtype=src.dtype, device=self.device)
            ready = self._engine.submit(buf, src)
        entry = _Entry(key, buf, nbytes, ready)
        self._cache[key] = entry
        self._by_master.setdefault(key[0], []).append(entry)
        self.paged_bytes += nbytes
        self.stats.page_ins += 1
        self.stats.bytes_h2d += nbytes
        self._note_peak()
        return entry

    def _transient(self, src: torch.Tensor, nbytes: int, name) -> _Entry:
        self._make_room(nbytes, strict=True, name=name)
        buf = torch.empty(src.numel(), dtype=src.dtype, device=self.device)
        self._copy_now(buf, src)
        self.paged_bytes += nbytes
        self.stats.page_ins += 1
        self.stats.bytes_h2d += nbytes
        self._note_peak()
        return _Entry(None, buf, nbytes, None)

    def _copy_now(self, buf: torch.Tensor, src: torch.Tensor) -> None:
        if self._cuda:
            buf.copy_(src, non_blocking=src.is_pinned())
        elif buf.numel() * buf.element_size() < SMALL_COPY_BYTES:
            buf.copy_(src)  # handing a copy we wait for anyway to the worker thread costs more than it
        else:
            self._engine.wait(self._engine.submit(buf, src))

    def _wait_ready(self, entry: _Entry) -> None:
        ready = entry.ready
        if ready is None:
            return
        if self._cuda:
            torch.cuda.current_stream(self.device).wait_event(ready)
        else:
            self._engine.wait(ready)
            entry.ready = None

    def _make_room(self, nbytes: int, strict: bool, name="tensor", keep_prefetched: bool = False) -> bool:
        """Evict unused copies until ``nbytes`` more fit the budget. ``name`` (a string, or any
        object whose repr describes the tensor: formatted only for the error) says what is paged.
        A prefetch passes ``keep_prefetched``: evicting an earlier prefetch that is still to be used
        would throw away a copy to make room for one needed later."""
        budget = self.budget_bytes
        if budget is None or self.resident_bytes + self.paged_bytes + nbytes <= budget:
            return True
        while True:
            # Least recently used first; the few entries the current op holds are skipped.
            victim = next((e for e in self._cache.values() if not e.users and not (keep_prefetched and e.prefetched)), None)
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
        self._remove(entry)
        self.stats.evictions += 1

    def _remove(self, entry: _Entry) -> None:
        """Drop a cached copy once nothing can still touch its block: its copy must have finished
        and, on a GPU, the copy stream (which reuses the block) waits for the last op that read it."""
        if self._cuda:
            if entry.ready is not None:
                self._copy_stream.wait_event(entry.ready)
            if entry.last_use is not None:
                self._copy_stream.wait_event(entry.last_use)
        elif entry.ready is not None:
            self._engine.wait(entry.ready)
        del self._cache[entry.key]
        siblings = self._by_master[entry.key[0]]
        siblings.remove(entry)
        if not siblings:
            del self._by_master[entry.key[0]]
        self.paged_bytes -= entry.nbytes

    def _drop_master(self, master_id: int) -> None:
        for entry in list(self._by_master.get(master_id, ())):
            self._remove(entry)


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
