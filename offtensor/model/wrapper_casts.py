"""A cast (``module.half()``, ``.to(torch.bfloat16)``, ``.float()``) of a wrapped model's
wrapper-subclass weight whose leaves are offloaded (a torchao tensor, a TwoTensor, a DTensor): the
class's own cast computed on its leaves' host masters, nothing paged; each leaf the cast changed
offloaded again at its new size (or kept resident where it was resident and still fits), a leaf it
left as it was kept as it is, and the same outer object swapped onto the result.

torch's own path would run the class's cast as an op on the device: every leaf paged in whole, the
results kept as plain device tensors the budget never planned for."""

from __future__ import annotations

import torch
from torch import nn

from .. import leaves
from ..pager import master_for, pins_host_memory
from ..tensor import OffloadedTensor, new_host_master
from .groups import Member
from .moves import resident_storages, storage_bytes, swap
from .room import reserve_paging_room
from .standins import HostStandIn, dressed_like
from .state import State


def cast_wrapper(state: State, module: nn.Module, attr: str, t: torch.Tensor, dtype: torch.dtype, fn) -> None:
    """Cast the wrapper ``t`` registered as ``module.attr`` to ``dtype`` as its class does, in
    place (``t`` stays the registered object). Everything that can fail (the class's cast on the
    host, the room to page each new leaf) happens before ``t`` changes: an error leaves it as it was."""
    full_name = state.qualified_name(module, attr)
    stand_in = HostStandIn(t)
    result = _host_result(full_name, t, stand_in, dtype, fn, state.pager.budget_bytes)
    new_leaves = leaves.leaves(result)
    pairs = stand_in.pairs if len(stand_in.pairs) == len(new_leaves) else None  # else: a new structure
    olds = [pair[0] for pair in pairs] if pairs is not None else [None] * len(new_leaves)
    if pairs is not None and result.dtype == t.dtype and all(
            _same(new, host) for (_, _, new), (_, host) in zip(new_leaves, pairs)):
        return  # the class's cast leaves this weight as it is (torchao's Int8Tensor under .half())
    slots = _slots_of(state, t)
    plan, resident = _plan(state, frozenset((m, a) for m, a, _ in slots), new_leaves, pairs)
    room = state.working_set_bytes
    slot = next((s for s in slots if s[0] is module and s[1] == attr), (module, attr, attr in module._buffers))
    # What the slot holds offloaded after the cast: each leaf to offload, at its new size, and the
    # offloaded leaves the cast leaves as they are; each is paged with the others (and the module's).
    after = [(torch.empty_strided(new.shape, new.stride(), dtype=new.dtype, device="meta"),
              new.dtype == result.dtype)
             if isinstance(step, tuple) and step[0] == "offload"
             else (step, step.dtype == result.dtype) if isinstance(step, OffloadedTensor) else None
             for (_, _, new), step in zip(new_leaves, plan)]
    try:
        for (_, leaf_attr, _), step, placing in zip(new_leaves, plan, after):
            if isinstance(step, tuple) and step[0] == "offload":
                reserve_paging_room(state, f"{full_name} (its leaf {leaf_attr})", placing[0], slot, resident,
                                    tileable=placing[1], beside=[o for o in after if o is not None and o is not placing])
    except BaseException:
        state.working_set_bytes = room  # nothing changed
        raise
    placed = {id(new): _placed(state, full_name, step, old, resident)
              for (_, _, new), step, old in zip(new_leaves, plan, olds)}
    grad = t.grad
    with torch.no_grad():
        final = dressed_like(t, leaves.rebuild(result, lambda leaf: placed[id(leaf)]))
    root = Member(t)
    root.slots.extend(slots)
    swap(root, final)
    if grad is not None:
        root.tensor.grad = fn(grad)
    if "experts" in full_name.split("."):
        state.experts_stale = True  # the registry names the old masters
    state.pager.recount_resident(resident)


def _host_result(full_name: str, t: torch.Tensor, stand_in: HostStandIn, dtype: torch.dtype, fn,
                 budget: int) -> torch.Tensor:
    """The class's cast of ``t`` computed on its host stand-in; a clear error when it cannot be."""
    try:
        with torch.no_grad():
            return _cast_on_host(stand_in.tensor, dtype, fn)
    except Exception as error:  # noqa: BLE001 - any class's failure, named with the weight it is for
        nbytes = sum(leaf.numel() * leaf.element_size() for leaf in leaves.leaf_tensors(t))
        offloaded = sum(leaf.numel() * leaf.element_size() for leaf in leaves.leaf_tensors(t)
                        if isinstance(leaf, OffloadedTensor))
        raise RuntimeError(
            f"offtensor: cannot cast '{full_name}' (a {type(t).__name__} of {nbytes} bytes in its leaves, {offloaded} "
            f"of them offloaded) to {dtype}: its class's cast does not run on its leaves' host memory "
            f"({type(error).__name__}: {error}). Offloaded leaves are cast on the host only: on the device the "
            f"class's cast would hold every leaf of the weight and its cast copy at once, outside the budget of "
            f"{budget} bytes. Nothing was cast. Cast the model before ot.wrap_model, or unwrap it, cast, and wrap "
            f"again.") from error


def _plan(state: State, skip: frozenset, new_leaves: list, pairs) -> tuple:
    """Where each leaf of the cast goes: the old leaf itself where the cast left it as it was, else
    ``("resident", host tensor)`` for one that was resident and still fits beside the resident
    weights and the paging room, else ``("offload", host tensor)``. Returns (plan, resident bytes
    of the model afterwards)."""
    pager = state.pager
    storages = resident_storages(state.model_ref(), pager.device, skip | state.lent_slots)
    resident = sum(storages.values())
    plan = []
    for i, (_, _, new) in enumerate(new_leaves):
        old, host = pairs[i] if pairs is not None else (None, None)
        nbytes = new.numel() * new.element_size()
        if old is not None and _same(new, host):
            plan.append(old)
            if not isinstance(old, OffloadedTensor) and old.device == pager.device:
                key, old_bytes = storage_bytes(old)
                resident += 0 if key in storages else old_bytes
                storages[key] = old_bytes
        elif (old is not None and not isinstance(old, OffloadedTensor)
              and resident + state.working_set_bytes + nbytes <= pager.budget_bytes):
            plan.append(("resident", new))
            resident += nbytes
        else:
            plan.append(("offload", new))
    return plan, resident


def _placed(state: State, full_name: str, step, old, resident: int) -> torch.Tensor:
    """The leaf ``step`` of the plan becomes: offloaded into a new host master, or on the device."""
    if not isinstance(step, tuple):
        return step
    pager = state.pager
    kind, new = step
    if kind == "offload":
        host = new_host_master(new, pin=pins_host_memory(pager.device))
        master = master_for(host, pager)
        master.name = full_name
        leaf = OffloadedTensor(host, master)
    else:
        pager.room_for_resident(resident)  # cached copies go before the new bytes are allocated
        leaf = new.to(pager.device)
        state.resident_ptrs.add(leaf.untyped_storage().data_ptr())
    if old is not None and leaf.requires_grad != old.requires_grad:
        leaf.requires_grad_(old.requires_grad)  # DTensor keeps its local shard's flag equal to its own
    return leaf


def _cast_on_host(stand_in: torch.Tensor, dtype: torch.dtype, fn) -> torch.Tensor:
    """What ``fn`` makes of the weight, computed on its host stand-in: ``fn`` itself when it keeps
    a host tensor on the host (``.half()``: a class may cast under ``.to(dtype)`` and not under
    ``.half()``, as torchao's do, and the unwrapped model's cast is what ``fn`` does), else
    ``Tensor.to(dtype)``, what ``module.to(device, dtype)`` runs, without the move onto the device."""
    if fn(torch.empty(2, dtype=stand_in.dtype)).device.type == "cpu":
        return fn(stand_in)
    return stand_in.to(dtype)


def _same(new: torch.Tensor, host: torch.Tensor) -> bool:
    """The class's cast left this leaf as it was: ``new`` views the same memory as ``host``."""
    if new is host:
        return True
    if new.is_meta or host.is_meta:
        return False
    return (new.dtype == host.dtype and new.shape == host.shape and new.stride() == host.stride()
            and new.data_ptr() == host.data_ptr())


def _slots_of(state: State, t: torch.Tensor) -> list:
    """Every (module, attribute, is_buffer) slot of the wrapped model that holds ``t`` (a tie)."""
    return [(m, a, is_buffer) for m in state.model_ref().modules()
            for table, is_buffer in ((m._parameters, False), (m._buffers, True))
            for a, v in table.items() if v is t]
