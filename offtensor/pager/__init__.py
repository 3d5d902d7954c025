"""The pager: every byte of device memory that offloaded weights use is accounted for here.

A ``Pager`` owns one budget on one device. It knows how many bytes of resident (plain) weights the
model keeps on the device, keeps a bounded cache of paged copies of host masters, copies missing
byte ranges host->device on a dedicated stream (or on the extension's worker thread on the emulated
device), and evicts a copy only once the device has finished every op that used it. All state of
paging lives in this package; the layers above (dispatch, compile) ask for "the device tensor for
this host view" and say when the op that used it has been enqueued; nothing here knows about
modules or names.

One owner per file. ``pager.py`` composes the others with two collaborators of its own, ``room.py``
and ``copies.py``; apart from those (and ``slots.py``, whose arena is ``arena.py``), none of them
imports another (the device operations reach
slots and lifetimes only as objects handed to them):

    stats.py      OffloadStats, the counters, and a snapshot of them; format_bytes
    budget.py     Budget: budget, resident, paged and offloaded bytes, the peak; BudgetError
    masters.py    Master (one host allocation's identity) and the registry by storage and by id
    device.py     per device kind (emulated, CUDA, meta): issuing copies, tokens, waits, streams,
                  events; whether host memory is pinned; resolve_device
    marks.py      Marks: a cached copy's last use on a GPU as (stream, count), events recorded
                  every few marks or on demand (pure bookkeeping; device.py records and queries)
    arena.py      Arena: one device buffer, ranges of it by offset (best fit), each free range
                  with the tokens of its last users; the rule for which copies open a range
    slots.py      SlotPool: the arena of a budgeted pager, its size, and overflow slots beside it
    lifetimes.py  HostLifetimes: host sources kept until the copies reading them complete
    cache.py      CacheKey, CachedCopy, DeviceCache and the eviction policy (LRU by default)
    observers.py  Observers: the expert cache, the prefetcher and the timeline recorder, in order
    room.py       Room: evicting unused copies until a copy or resident weights fit; dropping copies;
                  RoomCalls, the pager's calls into it
    copies.py     Copies: issuing copies (cached ahead of use, transient in line, the caller's own)
    pager.py      Pager, the façade that composes them, and the per-op path (page, upload, release)
    safety.py     exception safety's tools: lock depths, restoring them, the recount; Recovering,
                  the pager's side of them

Exceptions. An exception may strike wherever Python raises one: a signal handler's (Ctrl-C's
KeyboardInterrupt) on entering any function, after any call returns and at loop back edges, even
inside ``finally`` and ``except`` blocks; a hook's, an observer's or a dispatch mode's at calls.
No step here is made atomic one by one; one rule keeps the pager consistent instead:

1. An op's hold is committed last, into the op's record. The record (``ops/paging.py``'s ``Paged``)
   exists before anything is paged; ``page`` and ``upload`` append ``(pager, entry, depth)`` to it
   as their last step (one ``list.append``), so a hold is either in the record or still the step's
   own. A step cut short before its commit gives back what it took, by the before-states it read
   before touching them: the entry's ``users`` is set back, the lock is given back down to the
   ``depth`` (the thread's hold count) read before the lock was taken. Setting back to a state read
   before is right wherever the exception struck, and harmless when repeated.
2. The op gives back its record whatever happens: ``release`` in a ``finally``; if an exception cuts
   that short, the lock goes back to the depth the record kept; if one strikes on the very call
   into it, the dispatch entry (``torch_dispatch``, or ``__torch_function__`` for a whole function
   run in tiles) finds the record in the unwound frames and releases it. A step's undo that an
   interrupt cuts short at its call, after an exception that is routine there (a ``BudgetError``
   that slices or tiles answer), is run once more.
3. Counts are recounted, not repaired. Any exception that cuts a step short marks the pager; the
   next step that finds no op holding it (lock depth 0 on entry, or the cut-short op's own exit)
   recounts from the cache itself: ``users`` 0, paged bytes the cached copies', the arena's ranges
   from the cached copies' slots (a range an interrupted step took and never recorded is free again
   once every copy in flight has completed). Until then every count errs towards "in use": a copy
   pinned, bytes counted; never a copy in use counted free.

``with lock:`` is atomic for the exceptions above (its exit releases before any point where one can
strike), so sections that only take the lock for their duration need nothing more than to mark
the pager when they raise (``Pager._room``, ``prefetch``). The rule holds for one exception at any
point, and for several further apart than an op's cleanup takes; a second one inside that cleanup
may leave counts to the next recount.
"""

from .budget import GiB, Budget, BudgetError
from .cache import (
    CacheKey, CachedCopy, CacheView, LeastRecentlyUsed, cache_key, covering_range, host_layout, page_layout,
)
from .device import device_total_bytes, free_device_bytes, pins_host_memory, resolve_device, strict_from_env, upload_small
from .masters import Master, master_for, observe_writes, registered_master
from .pager import Pager, upload_compact
from .stats import OffloadStats, format_bytes

__all__ = [
    "GiB", "Budget", "BudgetError", "CacheKey", "CachedCopy", "CacheView", "LeastRecentlyUsed", "cache_key",
    "covering_range", "host_layout", "page_layout", "device_total_bytes", "free_device_bytes", "pins_host_memory", "resolve_device", "strict_from_env", "upload_small", "upload_compact",
    "Master", "master_for", "observe_writes", "registered_master", "Pager", "OffloadStats", "format_bytes",
]
