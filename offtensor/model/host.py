"""``ot.on_host(model)``: a wrapped model's offloaded weights read as their host masters inside the
block (a wrapper subclass whose leaves are offloaded as its class rebuilt over them), so a
transform that reads whole weights (quantisation, repacking) computes from host memory."""

from __future__ import annotations

import inspect
import sys
import threading

from torch import nn

from .. import leaves
from ..pager.safety import lock_depth, restore_depth
from ..tensor import OffloadedTensor
from .copies import state_of
from .moves import as_param_like, resident_bytes
from .standins import HostStandIn, has_offloaded_leaves
from .state import State

# Give-backs of one loan that raise (a second Ctrl-C, each) before leaving gives up and raises.
ATTEMPTS = 4


def on_host(model: nn.Module) -> "HostLoan":
    """``with ot.on_host(model): quantize_(model, Int8WeightOnlyConfig())``: inside, each
    offloaded parameter and buffer of the wrapped ``model`` reads as its host master (a plain CPU
    tensor viewing the master's memory, dressed as the same Parameter class, no copy), and each
    wrapper-subclass weight whose leaves are offloaded (a torchao tensor, a DTensor) reads as its
    class rebuilt over its leaves' host masters (``HostStandIn``), so a
    transform that reads whole weights to replace them (quantisation, repacking) computes from host
    memory instead of paging each weight whole onto the device, which a weight larger than the room
    cannot be. What the transform assigns is placed as usual: offloaded straight from host memory,
    or moved to the device when it fits. On leaving, also when the block raises, each slot the
    transform did not replace gets its own tensor back (a wrapper its own object, with its
    offloaded leaves); masters written in place are seen by the next forward (their cached device
    copies are dropped). Not for forwards: on a GPU the weights are host tensors inside."""
    return HostLoan(model)


class HostLoan:
    """The ``with`` block of ``on_host``. The pager's lock is held throughout: another thread's
    forward must not read the host stand-ins.

    A class rather than a ``contextlib`` generator, for Ctrl-C: a generator's ``__enter__`` cut
    short after its ``yield`` (or its ``__exit__`` at its entry) left the stand-ins in the model
    and the lock held by a suspended generator, for as long as the traceback kept it (a REPL keeps
    the last one); and one cut short while it lent or gave back left some slots lent. Here
    ``__enter__`` either lends every slot and holds the lock or, whatever cut it short, gives back
    what it lent and the lock (to the hold count read before taking it); ``__exit__`` gives back
    again where an interrupt cut its give-back short (every step can run twice), then the lock.

    Python can still raise at ``__exit__``'s very entry, before any of its code (CPython calls no
    ``with`` exit atomically). So the loan is bound to the frame that entered it and recorded on
    the model's state (``State.loans``): once that frame has ended with the loan still recorded,
    whoever touches the model next in the lending thread (its forward, ``ot.stats``, ``on_host``,
    ``unwrap_model``, an assignment, a cast, a load) gives it back first (``settle``), its one hold
    of the lock included. A loan entered in a generator or coroutine, whose frame may be suspended
    rather than ended, is never taken for ended."""

    __slots__ = ("model", "state", "depth", "depth_of", "lent", "wrappers", "frame", "thread", "held")

    def __init__(self, model: nn.Module):
        self.model = model
        self.state = self.depth = self.depth_of = self.frame = self.thread = None
        self.held = False  # this loan's one hold of the pager's lock is still to give back
        self.lent = []  # (module, table, attr, registered tensor, host stand-in)
        self.wrappers = []  # the HostStandIn of each wrapper subclass lent

    def __enter__(self) -> nn.Module:
        state = state_of(self.model)
        lock = state.pager.lock
        depth_of = lock_depth(lock)
        depth = depth_of()
        # Recorded before anything changes: the undo below and ``__exit__`` read them.
        self.state, self.depth, self.depth_of, self.lent, self.wrappers = state, depth, depth_of, [], []
        self.frame, self.thread = sys._getframe(1), threading.get_ident()
        try:
            state.loans = state.loans + (self,)
            lock.acquire()
            self.held = True  # (no point between the acquire's return and this store)
            _collect(state, self.model, self.lent, self.wrappers)
            state.lent_slots = frozenset((module, attr) for module, _, attr, _, _ in self.lent)
            for _, table, attr, _, stand_in in self.lent:
                table[attr] = stand_in
            return self.model  # (no point between this return and the block where Python raises)
        except BaseException:
            try:
                _put_back(state, self.lent)
            finally:
                self.held = False
                restore_depth(lock, depth_of, depth)
                _drop(state, self)
            raise

    def __exit__(self, *exc) -> bool:
        # Every call inside the ``try``: one that an interrupt cuts short runs again (each step can),
        # and the loop's back edge, a point where Python raises too, is reached only after one did.
        pending, attempts, given = None, 0, False
        while True:
            try:
                if not given and attempts < ATTEMPTS:
                    _give_back(self.state, self.model, self.lent, self.wrappers)
                given = True
                self.held = False
                restore_depth(self.state.pager.lock, self.depth_of, self.depth)
                _drop(self.state, self)
                break
            except BaseException as error:
                pending = error if pending is None else pending
                attempts += 1
        if pending is not None:
            try:
                raise pending
            finally:
                pending = None  # no cycle through this frame
        return False

    def ended(self) -> bool:
        """Whether the frame that entered this loan has ended without giving it back (an interrupt at
        the entry of ``__exit__``): asked in the lending thread only, which holds the lock for it."""
        if self.thread != threading.get_ident() or self.frame.f_code.co_flags & _SUSPENDABLE:
            return False
        f = sys._getframe(1)
        while f is not None:
            if f is self.frame:
                return False
            f = f.f_back
        return True

    def settle(self) -> None:
        """Give back an ended loan (``State.settle_loans``): its slots, then its one hold of the
        lock, which the caller's own holds are above or below. Each step can run again."""
        _give_back(self.state, self.model, self.lent, self.wrappers)
        if self.held:
            self.held = False  # (no point between this store and the release)
            self.state.pager.lock.release()
        _drop(self.state, self)
        self.frame = None


# A generator's or coroutine's frame leaves the stack at each ``yield`` or ``await`` and comes back.
_SUSPENDABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE


def _drop(state: State, loan: HostLoan) -> None:
    """``loan`` no longer recorded on ``state``; idempotent."""
    state.loans = tuple(other for other in state.loans if other is not loan)


def _collect(state: State, model: nn.Module, lent: list, wrappers: list) -> None:
    """What ``model`` lends, into ``lent`` and ``wrappers``; changes no slot (only drops the cached
    copies of the masters lent, which the transform may write)."""
    pager = state.pager
    stand_ins = {}  # id(registered tensor) -> its stand-in: a tensor in two slots (a tie) lends one
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for attr, t in table.items():
                if isinstance(t, OffloadedTensor):
                    masters = (t._master,)
                elif has_offloaded_leaves(t):
                    masters = None
                else:
                    continue
                stand_in = stand_ins.get(id(t))
                if stand_in is None:
                    if masters is None:
                        wrappers.append(HostStandIn(t))
                        stand_in = wrappers[-1].tensor
                        masters = wrappers[-1].offloaded_masters()
                    else:
                        stand_in = as_param_like(t, t._host)
                    stand_ins[id(t)] = stand_in
                    for master in masters:
                        pager.before_write(master)  # no copy may still read a master the transform writes
                lent.append((module, table, attr, t, stand_in))


def _put_back(state: State, lent: list) -> None:
    """Each slot that still holds its stand-in gets its own tensor back (a slot the transform
    replaced keeps the new one); a no-op for slots not lent yet or already given back. Where the
    transform gave the stand-in other data instead (``weight.data = new``, as transformers'
    ``resize_token_embeddings`` resizes an embedding in place), the tensor given back takes that
    data, placed at its size as ``weight.data = new`` of an offloaded weight is: given back as it
    was, the resize was undone at the block's end (the module resized, its weight not)."""
    state.lent_slots = frozenset()
    taken = set()  # tensors lent to two slots (a tie): their data taken once
    for _, table, attr, t, stand_in in lent:
        if table.get(attr) is stand_in:
            if id(t) not in taken and isinstance(t, OffloadedTensor) and _data_replaced(t, stand_in):
                t.data = stand_in.data
            taken.add(id(t))
            table[attr] = t


def _data_replaced(t: OffloadedTensor, stand_in) -> bool:
    """Whether ``stand_in`` no longer views ``t``'s host master as it was lent (its ``.data`` was
    set to another tensor). Asked again after ``t`` took that data, it answers True again (``t``
    views a new master): taking the same data twice gives the same values."""
    host = t._host
    return (stand_in.untyped_storage().data_ptr() != host.untyped_storage().data_ptr() or stand_in.dtype != host.dtype
            or stand_in.shape != host.shape or stand_in.stride() != host.stride()
            or stand_in.storage_offset() != host.storage_offset())


def _give_back(state: State, model: nn.Module, lent: list, wrappers: list) -> None:
    """The end of the loan; every step can run again."""
    pager = state.pager
    _put_back(state, lent)
    for t in {id(t): t for _, _, _, t, _ in lent}.values():
        for master in _masters_of(t):
            pager.before_write(master)  # written in place through the stand-in: cached copies are stale
    for wrapper in wrappers:
        wrapper.write_back()
    if pager.experts is not None:
        state.experts_stale = True
    pager.recount_resident(resident_bytes(model, pager.device))


def _masters_of(t) -> list:
    if isinstance(t, OffloadedTensor):
        return [t._master]
    return [leaf._master for leaf in leaves.leaf_tensors(t) if isinstance(leaf, OffloadedTensor)]
