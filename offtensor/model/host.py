"""``ot.on_host(model)``: a wrapped model's offloaded weights read as their host masters inside the
block (a wrapper subclass whose leaves are offloaded as its class rebuilt over them), so a
transform that reads whole weights (quantisation, repacking) computes from host memory."""

from __future__ import annotations

import contextlib

from torch import nn

from .. import leaves
from ..tensor import OffloadedTensor
from .copies import state_of
from .moves import as_param_like, resident_bytes
from .standins import HostStandIn, has_offloaded_leaves
from .state import State


@contextlib.contextmanager
def on_host(model: nn.Module):
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
    state = state_of(model)
    # Held throughout: another thread's forward must not read the host stand-ins.
    with state.pager.lock:
        yield from _lend_host_masters(state, model)


def _lend_host_masters(state: State, model: nn.Module):
    pager = state.pager
    lent = []  # (module, table, attr, registered tensor, host stand-in)
    stand_ins = {}  # id(registered tensor) -> its stand-in: a tensor in two slots (a tie) lends one
    wrappers = []  # the HostStandIn of each wrapper subclass lent
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
    state.lent_slots = frozenset((module, attr) for module, _, attr, _, _ in lent)
    for _, table, attr, _, stand_in in lent:
        table[attr] = stand_in
    try:
        yield model
    finally:
        state.lent_slots = frozenset()
        for _, table, attr, t, stand_in in lent:
            if table.get(attr) is stand_in:
                table[attr] = t
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
