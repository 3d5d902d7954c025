"""Placing one tensor assigned into a wrapped model after wrapping (a parameter, a buffer, a leaf
of a wrapper subclass, a plain tensor attribute): kept resident if it fits beside the resident
weights and the room paging needs, else offloaded, under the same budget."""

from __future__ import annotations

import torch
from torch import nn

from .. import leaves
from .. import placement
from ..pager import BudgetError
from ..tensor import OffloadedTensor
from .groups import Member, StorageGroup, leaf_is_tileable
from .moves import (
    Undo, as_param_like, check_offloadable_quietly, is_computed, offload_group, refit, resident_bytes,
    resident_storages, resident_storages_of, storage_bytes, swap, weight_tensors,
)
from .dtensor import refuse_offloading_an_fsdp2_parameter
from .room import replan_paging_room, reserve_paging_room, reserve_whole_read, warn_view_of_a_bigger_master
from .state import State


def place(state: State, module: nn.Module, name: str, t: torch.Tensor, is_buffer: bool, attaching=None):
    """Place a tensor being registered into a wrapped model, keeping its object: kept resident on
    the device if it fits beside the resident weights and the room paging needs, else offloaded.
    Returns the tensor to register, or None to register ``t`` as it is.

    ``attaching`` = (tensors placed so far, slots replaced) while a submodule is attached: the
    submodule's tensors already placed count as resident, those of the submodule it replaces do not."""
    pager = state.pager
    full_name = state.qualified_name(module, name)
    if not state.experts_stale and "experts" in full_name.split("."):
        state.experts_stale = True
    if isinstance(t, OffloadedTensor):
        reserve_whole_read(state, full_name, t, (module, name))
        Undo.note("moved", t._master, t._master.pager)  # an assignment undone gives it back to its pager
        t._master.move_to(pager)
        warn_view_of_a_bigger_master(full_name, t)
        return None
    if not leaves.is_leaf(t):
        _place_leaves(state, module, name, t, is_buffer, full_name, attaching)
        # The outer object stays registered, brought onto its leaves' device (as itself unless
        # torch refuses to swap it, then as the rebuilt object, to register instead).
        root = Member(t)
        root.slots.append((module, name, is_buffer))
        placed = refit(root)
        return None if placed is t else placed
    if t.is_meta or t.layout != torch.strided:
        return None
    member = Member(t)
    member.slots.append((module, name, is_buffer))
    return _place_member(state, member, full_name, attaching)


def _place_leaves(state: State, module: nn.Module, name: str, t: torch.Tensor, is_buffer: bool, full_name: str,
                  attaching=None) -> None:
    """Place each plain leaf of the wrapper subclass ``t`` (a DTensor's local shard, a quantised
    tensor's data and scales) registered as ``module.name``, replacing it inside its owner. The
    leaves placed first count as resident beside the later ones."""
    extra, skip = attaching or ((), frozenset())
    done = []
    for owner, attr, leaf in leaves.leaves(t, f"'{full_name}'"):
        if isinstance(leaf, OffloadedTensor):
            Undo.note("moved", leaf._master, leaf._master.pager)
            leaf._master.move_to(state.pager)
            warn_view_of_a_bigger_master(f"{full_name} (its leaf {attr})", leaf)
        elif not leaf.is_meta and leaf.layout == torch.strided:
            member = Member(leaf)
            member.slots.append((module, name, is_buffer))
            member.owners.append((owner, attr))
            _place_member(state, member, full_name, (tuple(extra) + tuple(done), skip))
            leaf = member.tensor
        done.append(leaf)


def _place_member(state: State, member: Member, full_name: str, attaching=None):
    """``place`` for one plain tensor (``member.tensor``, in the slot ``member.slots[0]``)."""
    pager = state.pager
    t = member.tensor
    module, name, _ = member.slots[0]
    placed = state.placement_of(t)
    if placed is not None:
        view = placed.offloaded_view(t)
        if view is not None:
            swap(member, as_param_like(t, view))
            return member.tensor
        target = placed.resident()
        if (target is not None and placed.view == (tuple(t.shape), t.stride(), t.storage_offset())
                and target.device == pager.device):
            with torch.no_grad():
                t.data = target.detach()
            return None
    model = state.model_ref()
    if model is None:
        return None  # the wrapped model is gone; nothing left to account against
    extra, skip = attaching or ((), frozenset())
    skip = skip | {(module, name)} | state.lent_slots
    storages = resident_storages(model, pager.device, skip, extra)
    resident = sum(storages.values())
    nbytes = t.numel() * t.element_size()
    moves = t.device != pager.device
    if moves:
        with_t = resident + nbytes
    else:
        # Already on the device: it may share storage with resident weights (a re-assigned tie).
        key, nbytes_of_storage = storage_bytes(t)
        with_t = resident + (0 if key in storages else nbytes_of_storage)
    choice = placement.policy_choice(state.config.policy, [full_name])
    keep = choice == "keep" or (choice != "offload" and with_t + state.working_set_bytes <= pager.budget_bytes)
    if keep:
        if with_t > pager.budget_bytes:
            raise BudgetError(
                f"offtensor: keeping {full_name} ({nbytes} bytes) resident would put {with_t} bytes of "
                f"resident weights over the budget of {pager.budget_bytes} bytes; let the policy offload it "
                f"or raise budget_gb"
            )
        if with_t + state.working_set_bytes > pager.budget_bytes:  # only a weight the policy keeps
            replan_paging_room(state, with_t, f"keeping {full_name} ({nbytes} bytes) resident, as the policy says,")
        if moves:
            source = t.detach()
            pager.room_for_resident(with_t)  # cached copies go before the new bytes are allocated
            Undo.note("data", t, t.data)  # a submodule refused later in its attachment gets its tensors back
            with torch.no_grad():
                t.data = t.data.to(pager.device)
            state.remember(source, t, module, name)
        state.resident_ptrs.add(t.untyped_storage().data_ptr())
        pager.hold_resident(with_t)
        return None
    refuse_offloading_an_fsdp2_parameter(state, module, name, t, resident)
    reserve_paging_room(state, full_name, t, member.slots[0], resident, tileable=leaf_is_tileable(t, member.owners))
    member.names.append(full_name)
    source = t.detach()
    offload_group(StorageGroup([member]), pager)
    state.remember(source, member.tensor, module, name)
    pager.recount_resident(resident)
    return member.tensor


def place_attribute(state: State, module: nn.Module, name: str, t: torch.Tensor) -> None:
    """A tensor assigned to a wrapped module as a plain attribute (``self.W_UV = ...`` after
    loading): counted as resident when it is on the device and fits beside the resident weights and
    the room paging needs, else offloaded in place (the object stays; its device memory is freed)
    like a parameter that does not fit. Tensors elsewhere (a CPU mask on a GPU run) hold no device
    bytes and are left alone; one autograd computed (``moves.is_computed``: prune's masked weight)
    is counted as activations are."""
    pager = state.pager
    model = state.model_ref()
    if model is None:
        return
    if isinstance(t, OffloadedTensor):
        t._master.move_to(pager)
        return
    nbytes = t.numel() * t.element_size()
    if t.device != pager.device or nbytes < placement.SMALL_BYTES or is_computed(t):
        # Small attributes (often set during forward) are counted by the next recount (ot.stats,
        # a registration) rather than walking the model on every assignment.
        return
    resident = resident_bytes(model, pager.device)  # with t counted, once per storage
    full_name = state.qualified_name(module, name)
    choice = placement.policy_choice(state.config.policy, [full_name])
    keep = choice == "keep" or (
        choice != "offload" and resident + state.working_set_bytes <= pager.budget_bytes
    )
    shares_a_weight = storage_bytes(t)[0] in resident_storages_of(weight_tensors(model), pager.device)
    if keep or shares_a_weight or not check_offloadable_quietly(t):
        pager.hold_resident(resident)
        return
    without_t = resident - storage_bytes(t)[1]
    reserve_paging_room(state, full_name, t, (module, name, None), without_t, kind="the attribute ")
    member = Member(t)
    member.slots.append((module, name, None))
    member.names.append(full_name)
    offload_group(StorageGroup([member]), pager)
    pager.recount_resident(resident_bytes(model, pager.device))
