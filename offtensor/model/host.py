"""``ot.on_host(model)``: a wrapped model's offloaded weights read as their host masters inside the
block, so a transform that reads whole weights (quantisation, repacking) computes from host memory."""

from __future__ import annotations

import contextlib

from torch import nn

from ..tensor import OffloadedTensor
from .copies import state_of
from .moves import as_param_like, resident_bytes
from .state import State


@contextlib.contextmanager
def on_host(model: nn.Module):
    """``with ot.on_host(model): quantize_(model, Int8WeightOnlyConfig())``: inside, each
    offloaded parameter and buffer of the wrapped ``model`` reads as its host master (a plain CPU
    tensor viewing the master's memory, dressed as the same Parameter class, no copy), so a
    transform that reads whole weights to replace them (quantisation, repacking) computes from host
    memory instead of paging each weight whole onto the device, which a weight larger than the room
    cannot be. What the transform assigns is placed as usual: offloaded straight from host memory,
    or moved to the device when it fits. On leaving, each slot the transform did not replace gets
    its OffloadedTensor back; masters written in place are seen by the next forward (their cached
    device copies are dropped). Not for forwards: on a GPU the weights are host tensors inside."""
    state = state_of(model)
    # Held throughout: another thread's forward must not read the host stand-ins.
    with state.pager.lock:
        yield from _lend_host_masters(state, model)


def _lend_host_masters(state: State, model: nn.Module):
    pager = state.pager
    lent = []  # (table, attr, offloaded tensor, host stand-in)
    stand_ins = {}  # id(offloaded tensor) -> its stand-in: a tensor in two slots (a tie) lends one
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for attr, t in table.items():
                if isinstance(t, OffloadedTensor):
                    pager.before_write(t._master)  # no copy may still read a master the transform writes
                    stand_in = stand_ins.get(id(t))
                    if stand_in is None:
                        stand_in = stand_ins[id(t)] = as_param_like(t, t._host)
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
            pager.before_write(t._master)  # written in place through the stand-in: cached copies are stale
        if pager.experts is not None:
            state.experts_stale = True
        pager.recount_resident(resident_bytes(model, pager.device))
