"""Host masters: the identity of each host allocation that OffloadedTensors view, and the registry
that finds a master again from its storage or its id.

A ``Master`` is shared by every OffloadedTensor aliasing one host storage. Cache entries are keyed
by ``master.id``; when the last OffloadedTensor referencing the master dies, the master dies with
it and a finalizer drops its cached copies, so an address reused by a later allocation can never
hit a stale copy.

Lifetimes run one way: a master holds its pager only weakly (the pager's cache names masters by
id). So a wrapped model's pager (its cache, slots and budget) dies with the model, never kept by a
state-dict value or a view that outlives it, and no cycle through a master joins them. A master
whose pager has died is an orphan: the first use re-charges it to the uncached default pager of
the same device (``Pager.default``), so the tensors that outlive their model keep working, paging
each op's bytes from their host master and freeing them with the op.

The registry holds masters weakly: by storage address (tensors rebuilt from the same storage,
unpickled aliases, share one master and one set of cached copies) and by id (a compiled graph
names the master it pages from by id; ``__tensor_unflatten__`` rebuilds it).
"""

from __future__ import annotations

import functools
import itertools
import threading
import weakref
from typing import Optional

import torch

from .. import forking

_BY_STORAGE: "weakref.WeakValueDictionary[int, Master]" = weakref.WeakValueDictionary()
_BY_ID: "weakref.WeakValueDictionary[int, Master]" = weakref.WeakValueDictionary()
# The weak references whose callbacks count each master's death (a weak reference must live to call back).
_DEATHS: set = set()


class Master:
    """Identity of one host master allocation, charged to one pager at a time."""

    __slots__ = ("id", "nbytes", "flat", "name", "_owner", "__weakref__")
    _adopting = threading.Lock()  # two threads finding one orphan re-charge it once
    _ids = itertools.count(1)

    def __init__(self, pager, nbytes: int):
        self.id = next(Master._ids)
        self.nbytes = nbytes
        self.flat = None  # the master's whole storage as bytes, for prefetches (set by master_for)
        # The weight's name in its model (set by wrap and load), so that errors name the tensor.
        self.name = None
        # [weak owner, device, the owner's class] shared with the finalizer, so the finalizer always
        # reaches the current owner without holding a reference to this object, and an orphan
        # finds the default pager of its device (``_orphaned``). The owner is also the one pager
        # whose ``offloaded_bytes`` count this master, and a dead reference means none does: the
        # count and the owner change together, in two stores under the pager's lock with no point
        # between them where Python raises a Ctrl-C, so an interrupt anywhere neither counts a
        # master twice nor takes off bytes it never added.
        self._owner = [_UNCOUNTED, pager.device, type(pager)]
        # First, as it reads the owner. A weak reference's callback, not weakref.finalize: its
        # __call__ is Python code whose points before it calls the finalizer could take a Ctrl-C,
        # which Python ignores in a finalizer, the dead master's bytes counted for good. Now the
        # only such point is the finalizer's own entry.
        _DEATHS.add(weakref.ref(self, functools.partial(Master._died, self._owner, self.id, nbytes)))
        self._count_on(pager)

    @property
    def pager(self):
        # Every op on an offloaded weight reads this: one test more than the weak reference's call.
        pager = self._owner[0]()
        if pager is None:
            pager = self._orphaned()
        return pager

    def _count_on(self, pager) -> None:
        """``pager`` owns and counts this master, which no pager counts now."""
        owner = weakref.ref(pager)
        with pager.lock:  # counts change under the pager's lock: another thread may be paging
            pager.budget.offloaded_bytes += self.nbytes
            self._owner[0] = owner

    def _orphaned(self):
        """The pager died (its model was dropped) while tensors of this master live on: charge the
        master to the uncached default pager of its device, which the process keeps."""
        with Master._adopting:
            pager = self._owner[0]()
            if pager is None:
                pager = self._owner[2].default(self._owner[1])
                self._count_on(pager)
        return pager

    def move_to(self, pager) -> None:
        """Hand this master (and its accounting) to another pager, e.g. when wrap_model adopts an
        already offloaded tensor. Cut short between the two pagers, it is counted by neither and
        owned by none: its next use charges it to the default pager, as an orphan."""
        old = self._owner[0]()
        if pager is old:
            return
        if old is not None:
            with old.lock:
                old.forget_master(self.id)
                old.budget.offloaded_bytes -= self.nbytes
                self._owner[0] = _UNCOUNTED
        self._count_on(pager)

    @staticmethod
    def _died(owner, master_id: int, nbytes: int, ref) -> None:
        try:
            pager = owner[0]()
            if pager is not None:
                with pager.lock:
                    # The count first, in one store once the lock is held: a Ctrl-C in the drop of the
                    # cached copies (which Python ignores in a finalizer) cannot skip it. Copies it
                    # leaves are evicted as any unused copy; their master's id is never used again.
                    pager.budget.offloaded_bytes -= nbytes
                    pager.forget_master(master_id)
        finally:
            _DEATHS.discard(ref)


def _UNCOUNTED():
    """The owner of a master no pager counts: called as a dead weak reference is, it gives None."""
    return None


def master_for(host: torch.Tensor, pager) -> Master:
    """The master of ``host``'s storage, creating (and registering) one charged to ``pager`` if it
    has none yet."""
    storage = host.untyped_storage()
    ptr = storage.data_ptr()
    master = _BY_STORAGE.get(ptr) if ptr else None
    if master is not None and master.flat.untyped_storage().data_ptr() != ptr:
        # That master's storage has moved its bytes since (``share_memory_`` puts them in shared
        # memory and frees the old allocation): this address is another allocation's now, and
        # taking it for an alias would hand its ops the other master's cached copies.
        master = None
    if master is None:
        master = pager.new_master(storage.nbytes())
        master.flat = torch.empty(0, dtype=torch.uint8).set_(storage)
        if ptr:
            _BY_STORAGE[ptr] = master
        _BY_ID[master.id] = master
    return master


# Called with a master about to be written (``Pager.before_write``), before anything changes: the
# lazy casts of it (``offtensor.cast_views``) take a copy of its bytes then, as a cast made by torch
# would have them. Set once, by the module that keeps them; the pager knows nothing of tensors.
_BEFORE_WRITE = [None]


def observe_writes(observer) -> None:
    """``observer(master)`` runs before each write of a master."""
    _BEFORE_WRITE[0] = observer


def notify_write(master: Master) -> None:
    observer = _BEFORE_WRITE[0]
    if observer is not None:
        observer(master)


def registered_master(master_id: int) -> Optional[Master]:
    """The live master with this id, or None once it has died (or was never registered)."""
    return _BY_ID.get(master_id)


# A thread adopting an orphan holds ``_adopting`` while it waits for the default pager's lock, which
# an op of a third thread may hold through its compute; forked then, the child would find it held
# for good and hang on its first use of an orphaned tensor.
forking.at_fork_in_child(lambda: forking.renew_lock(Master._adopting))
