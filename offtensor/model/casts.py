"""Casts and moves of a wrapped model (``module.to(dtype)``, ``.half()``, ``.to(device)``): an
offloaded weight is cast host master to host master, nothing paged, and the room is planned again
for what changed size."""

from __future__ import annotations

import torch
from torch import nn

from .. import leaves
from .. import placement
from ..pager import master_for, pins_host_memory
from ..tensor import OffloadedTensor, new_host_master
from .groups import Member, StorageGroup
from .moves import check_offloadable_quietly, offload_group, resident_storages_of, storage_bytes
from .room import replan_paging_room, reserve_paging_room
from .standins import has_offloaded_leaves
from .state import State, placing_target
from .wrapper_casts import cast_wrapper


def apply_to_wrapped(apply, module: nn.Module, fn, recurse: bool = True):
    """``module._apply(fn)`` for a module of a wrapped model: what ``module.to(dtype)``, ``.half()``,
    ``.float()``, ``.bfloat16()``, ``.to(device)`` and peft's ``module.to(weight.device)`` run.

    torch's own ``_apply`` would compute ``fn`` on each OffloadedTensor as an op, paging the whole
    weight onto the device (a BudgetError for one larger than the room) and keeping the result as a
    new host master the budget never planned for, then swap it in with ``swap_tensors``, which
    drops a Parameter subclass's class and attributes. Here an offloaded weight whose cast ``fn``
    asks for is converted host master to host master, nothing paged, and the same object re-pointed
    at it (``.data =``); one ``fn`` leaves as it is is left untouched. Plain tensors take torch's
    own path. Then the room is re-planned for what changed size: offloaded weights' working sets
    at the new dtype, and resident weights that grew past the budget are offloaded."""
    state, owner = placing_target(module)  # a shallow copy's tables are its original's
    if state is None or state.model_ref() is None:
        return apply(fn, recurse)
    grad = torch.is_grad_enabled()
    try:
        with state.pager.lock:  # another thread's op finishes first; the next one sees the new dtype
            _refuse_move(state, owner, fn)
            _apply_locked(state, apply, owner, fn, recurse)
            return module
    except BaseException:
        # A Ctrl-C inside a torch.no_grad()'s enter or exit here, or in torch's _apply, after grad
        # went off and before the with took hold, would leave grad off for the rest of the thread.
        torch.set_grad_enabled(grad)
        raise


def _refuse_move(state: State, module: nn.Module, fn) -> None:
    """``module.to(another device)`` of a wrapped model with offloaded weights: ``.cpu()`` of a
    model wrapped for a GPU (accelerate's model offloading, a pipeline's ``.to("cpu")``), ``.to("meta")``,
    ``.to("cuda:1")``. torch's path would turn each offloaded weight into a plain tensor on that
    device, made from a whole copy and no longer counted by the budget (for meta, each paged whole
    onto the device first: a BudgetError for one larger than the room, which names the budget as
    the problem), while the model stays wrapped for its device. Refused before anything moves."""
    offloaded = [name for name, t in (*module.named_parameters(), *module.named_buffers())
                 if any(isinstance(leaf, OffloadedTensor) for leaf in leaves.leaf_tensors(t))]
    if not offloaded:
        return
    device = _moved_to(state.pager.device, fn)
    if device is None or device == state.pager.device:
        return
    raise RuntimeError(
        f"offtensor: moving a wrapped model to the {device} device is not supported ({len(offloaded)} of its weights "
        f"are offloaded for {state.pager.device}, such as '{state.qualified_name(module, offloaded[0])}'): unwrap it "
        f"first with ot.unwrap_model(model), then move it with .to('{device}'). Nothing was moved.")


def _moved_to(device: torch.device, fn):
    """The device ``fn`` (the function ``module._apply`` is given) puts a tensor on ``device`` on,
    or None where it raises or makes no tensor. A move that cannot run here (off meta; to cuda
    on a machine without one) is read off a fake tensor, which holds no memory."""
    try:
        with torch.no_grad():
            probe = fn(torch.empty(2, device=device))
    except Exception:  # noqa: BLE001 - whatever fn does, the casts below do it (or raise)
        from torch._subclasses.fake_tensor import FakeTensorMode  # (a move that cannot run for real)

        try:
            with FakeTensorMode(), torch.no_grad():
                probe = fn(torch.empty(2, device=device))
        except Exception:  # noqa: BLE001 - as above
            return None
    return probe.device if isinstance(probe, torch.Tensor) else None


def _apply_locked(state: State, apply, module: nn.Module, fn, recurse: bool):
    if recurse:
        for child in module.children():
            child._apply(fn)
    handled = _cast_offloaded(state, module, fn)
    before = _own_resident_bytes(module, state.pager.device)
    counted = state.pager.budget.resident_bytes
    try:
        try:  # the hiding inside it: a Ctrl-C between two leaves no weight None
            for table, attr, _ in handled:
                table[attr] = None  # torch's _apply skips None: these are done
            apply(fn, False)
        finally:
            try:
                _unhide(module, handled)
            except BaseException:
                _unhide(module, handled)  # a Ctrl-C inside the first: once more, whole
                raise
    finally:
        # However torch's _apply ended, what it cast is counted and what grew past the room is
        # offloaded now: a later cast finds these tensors at their new size and re-plans nothing.
        try:
            _replan_resident_after_cast(state, module, before, counted)
        except BaseException:
            _replan_resident_after_cast(state, module, before, counted)  # cut short: once more, whole
            raise
    return module


def _unhide(module: nn.Module, handled: list) -> None:
    """Put back the tensors hidden from torch's ``_apply``; idempotent, so one cut short is
    finished by running it again."""
    for table, attr, t in handled:
        table[attr] = t
    if handled and isinstance(module, nn.RNNBase):
        module._init_flat_weights()  # it re-read its weights while they were hidden


def _cast_offloaded(state: State, module: nn.Module, fn) -> list:
    """Convert ``module``'s own offloaded tensors as ``fn`` asks, in place; returns the
    (table, attribute, tensor) of those done (converted, or left as they are because ``fn`` leaves
    them so). What ``fn`` does is read off a tiny stand-in of each tensor's dtype on its device: a
    cast is done here; a move to another memory format is left to torch (one to another device was
    refused before anything moved)."""
    handled = []
    for table in (module._parameters, module._buffers):
        for attr, t in table.items():
            wrapper = has_offloaded_leaves(t)
            if not isinstance(t, OffloadedTensor) and not wrapper:
                continue
            stand_in = torch.empty((2,) * t.dim(), dtype=t.dtype, device=t.device)
            stand_ptr = stand_in.untyped_storage().data_ptr()
            try:
                with torch.no_grad():
                    probe = fn(stand_in)
            except Exception:  # noqa: BLE001 - whatever fn does, torch's own path does it (or raises) below
                continue
            if probe is stand_in:
                if stand_in.untyped_storage().data_ptr() != stand_ptr:
                    _move_bytes(state, t, fn)
                handled.append((table, attr, t))
                continue
            if (not isinstance(probe, torch.Tensor) or type(probe) is not torch.Tensor or probe.device != t.device
                    or probe.shape != stand_in.shape or not probe.is_contiguous() or probe.dtype == t.dtype):
                continue  # not a plain cast: torch's path
            if wrapper:  # its leaves offloaded: the class's own cast, computed on their host masters
                cast_wrapper(state, module, attr, t, probe.dtype, fn)
                handled.append((table, attr, table[attr]))
                continue
            slot = (module, attr, table is module._buffers)
            _cast_master(state, state.qualified_name(module, attr), t, slot, probe.dtype)
            if t.grad is not None:
                t.grad = fn(t.grad)
            handled.append((table, attr, t))
    return handled


def _move_bytes(state: State, t: torch.Tensor, fn) -> None:
    """``fn`` moved its argument's bytes (``share_memory_``, which ``module.share_memory()`` runs for
    Hogwild): so must ``t``'s host masters, or another process's writes to the weight are lost. A
    wrapper subclass's leaves each (its own storage holds no bytes: torch's ``share_memory_`` of a
    TwoTensor crashes the process)."""
    for leaf in leaves.leaf_tensors(t):
        fn(leaf)
        if isinstance(leaf, OffloadedTensor):
            state.shared_masters.add(leaf._master.id)


def _cast_master(state: State, full_name: str, t: OffloadedTensor, slot: tuple, dtype: torch.dtype) -> None:
    """Re-point the offloaded ``t`` (in ``slot``) at a new host master holding its values cast to
    ``dtype``, after reserving the room to page it at that size beside its module's other offloaded
    tensors (a BudgetError leaves ``t`` as it was)."""
    pager = state.pager
    host = t._host
    at_new_size = torch.empty_strided(host.shape, host.stride(), dtype=dtype, device="meta")
    reserve_paging_room(state, full_name, at_new_size, slot, pager.budget.resident_bytes, beside=())
    new_host = new_host_master(host, pin=pins_host_memory(pager.device), dtype=dtype)
    master = master_for(new_host, pager)
    master.name = full_name
    with torch.no_grad():
        t.data = OffloadedTensor(new_host, master)  # ops' .data setter: same object, new master
    if "experts" in full_name.split("."):
        state.experts_stale = True  # the registry names the old master


def _own_resident_bytes(module: nn.Module, device: torch.device) -> int:
    """Device bytes of ``module``'s own plain parameters and buffers (not its children's)."""
    tensors = (t for table in (module._parameters, module._buffers) for t in table.values() if t is not None)
    return sum(resident_storages_of(tensors, device).values())


def _replan_resident_after_cast(state: State, module: nn.Module, before: int, counted: int) -> None:
    """After torch's ``_apply`` cast ``module``'s plain device tensors from ``before`` bytes, when
    the pager counted ``counted`` resident bytes: count the difference as resident, and offload the
    ones that grew past the budget's room, largest first, as a weight assigned after wrapping that
    does not fit is offloaded. Run again after it was cut short, it finishes what is left."""
    pager = state.pager
    after = _own_resident_bytes(module, pager.device)
    if after == before:
        return
    resident = max(0, counted + after - before)
    for table in (module._parameters, module._buffers):
        for t in table.values():
            for leaf in leaves.leaf_tensors(t) if t is not None else ():  # a wrapper subclass: its leaves
                if not isinstance(leaf, OffloadedTensor) and leaf.device == pager.device:
                    state.resident_ptrs.add(leaf.untyped_storage().data_ptr())
    if after < before or resident + state.working_set_bytes <= pager.budget_bytes:
        pager.recount_resident(resident)
        return
    plain = [
        (table, attr, is_buffer, t)
        for table, is_buffer in ((module._parameters, False), (module._buffers, True))
        for attr, t in table.items()
        if t is not None and not isinstance(t, OffloadedTensor) and t.device == pager.device
        and check_offloadable_quietly(t)
    ]
    plain.sort(key=lambda entry: -entry[3].numel() * entry[3].element_size())
    for table, attr, is_buffer, t in plain:
        if resident + state.working_set_bytes <= pager.budget_bytes:
            break
        full_name = state.qualified_name(module, attr)
        if placement.policy_choice(state.config.policy, [full_name]) == "keep":
            continue
        resident -= storage_bytes(t)[1]
        reserve_paging_room(state, full_name, t, (module, attr, is_buffer), resident)
        member = Member(t)
        member.slots.append((module, attr, is_buffer))
        member.names.append(full_name)
        offload_group(StorageGroup([member]), pager)
        table[attr] = member.tensor
    if resident + state.working_set_bytes > pager.budget_bytes:  # what is left is what the policy keeps
        replan_paging_room(state, resident, f"casting {type(module).__name__} kept {resident} bytes resident and")
    pager.recount_resident(resident)
