"""The pager: every byte of device memory that offloaded weights use is accounted for here.

A ``Pager`` owns one budget on one device. It knows how many bytes of resident (plain) weights the
model keeps on the device, keeps a bounded cache of paged copies of host masters, copies missing
byte ranges host->device on a dedicated stream (or on the extension's worker thread on the emulated
device), and evicts a copy only once the device has finished every op that used it. All state of
paging lives in this package; the layers above (dispatch, compile) ask for "the device tensor for
this host view" and say when the op that used it has been enqueued; nothing here knows about
modules or names.

One owner per file. ``pager.py`` composes the others with two collaborators of its own, ``room.py``
and ``copies.py``; apart from those, none of them imports another (the device operations reach
slots and lifetimes only as objects handed to them):

    stats.py      OffloadStats, the counters, and a snapshot of them; format_bytes
    budget.py     Budget: budget, resident, paged and offloaded bytes, the peak; BudgetError
    masters.py    Master (one host allocation's identity) and the registry by storage and by id
    device.py     per device kind (emulated, CUDA, meta): issuing copies, tokens, waits, streams,
                  events; whether host memory is pinned; resolve_device
    slots.py      SlotPool: the device buffers copies live in, reused by size
    lifetimes.py  HostLifetimes: host sources kept until the copies reading them complete
    cache.py      CacheKey, CachedCopy, DeviceCache and the eviction policy (LRU by default)
    observers.py  Observers: the expert cache, the prefetcher and the timeline recorder, in order
    room.py       Room: evicting unused copies until a copy or resident weights fit; dropping copies
    copies.py     Copies: issuing copies (cached ahead of use, transient in line, the caller's own)
    pager.py      Pager, the façade that composes them, and the per-op path (page, upload, release)
"""

from .budget import GiB, Budget, BudgetError
from .cache import (
    CacheKey, CachedCopy, CacheView, LeastRecentlyUsed, cache_key, covering_range, host_layout, page_layout,
)
from .device import pins_host_memory, resolve_device, strict_from_env, upload_small
from .masters import Master, master_for, registered_master
from .pager import Pager
from .stats import OffloadStats, format_bytes

__all__ = [
    "GiB", "Budget", "BudgetError", "CacheKey", "CachedCopy", "CacheView", "LeastRecentlyUsed", "cache_key",
    "covering_range", "host_layout", "page_layout", "pins_host_memory", "resolve_device", "strict_from_env", "upload_small",
    "Master", "master_for", "registered_master", "Pager", "OffloadStats", "format_bytes",
]
