"""The room a wrapped model's budget keeps for paging: reserved before a weight is offloaded after
wrapping, and planned again when resident weights grow (a weight the policy keeps, a cast)."""

from __future__ import annotations

import dataclasses
import warnings

import torch

from .. import callers, leaves
from .. import placement
from .. import working_sets
from ..pager import BudgetError, covering_range
from ..tensor import OffloadedTensor
from .moves import resident_bytes
from .groups import (
    Member, StorageGroup, collect_groups, leaf_is_tileable, module_groups, read_whole_after, tensor_bytes,
)
from .state import State


def reserve_paging_room(state: State, full_name: str, t: torch.Tensor, slot: tuple, resident: int, kind: str = "",
                        tileable: bool = True, beside=None) -> None:
    """Before ``t`` is offloaded into ``slot`` = (module, attribute, is_buffer; None for a plain
    attribute) beside ``resident`` bytes of resident weights: make sure the budget can page it
    together with the module's other offloaded tensors, as wrap-time placement counts a module
    (``working_sets.module_working_set``: a torch.nn module reads them all in one op, a model's own
    module may multiply two of them), whole or in tiles, and reserve that working set. Raises a
    BudgetError, before anything changes, where it cannot. ``tileable=False``: a leaf of a wrapper
    subclass, read whole by the subclass's kernels (``placement.Weight.tileable``). ``beside``:
    (tensor, tileable) of the other tensors the slot will hold offloaded with ``t`` (a wrapper's
    other leaves); by default the slot's offloaded leaves but ``t``."""
    pager = state.pager
    module, attr, is_buffer = slot
    name_of = lambda a: state.qualified_name(module, a)  # noqa: E731
    loading = {a: (new, b) for (m, a), (old, new, b) in state.loading.items()
               if m is module and a != attr and _slot_value(m, a) is old}  # neighbours a load replaces next
    # A parametrization being registered (or a new original assigned): torch has taken the weight
    # off its module before its originals are placed here, so a refusal would leave the module
    # without it. One of the user's own (which wrap counts whole) is planned in tiles here, as
    # torch's own are: an op it applies that runs neither in slices, in tiles nor on the host
    # raises BudgetError naming the weight where it runs, the module whole.
    tiles = isinstance(module, torch.nn.utils.parametrize.ParametrizationList)
    others = [_tiled_if(g.weight(), tiles and all(leaf_is_tileable(m.tensor, m.owners) for m in g))
              for g in module_groups(module, name_of, skip={attr, *loading}) if g.is_offloaded]
    others += [_weight(name_of(a), new, (module, a, b), True) for a, (new, b) in loading.items()]
    placing = [(t, tileable), *(_offloaded_beside(slot, t, full_name) if beside is None else beside)]
    weights = others + [_tiled_if(_weight(full_name, tensor, slot, can_tile), tiles and can_tile)
                        for tensor, can_tile in placing]
    # A fused parent's kernel (LinearCrossEntropyLoss) reads this module's tensors whole with its
    # own: as wrap-time placement counts them (groups.Member.read_whole), none is tiled and ``t``
    # needs the room for all of them at once. The parent may be attaching with ``module``, not
    # yet in the model: the names of its modules are known already.
    whole, parent = _fused_parent_read(state, module, attr, t)
    if whole:
        weights = [dataclasses.replace(w, tileable=False, working_set=max(w.working_set, whole) if i == len(others)
                                       else w.working_set) for i, w in enumerate(weights)]
    plan = working_sets.modules_room(weights, pager.budget_bytes - resident)[0]
    nbytes = tensor_bytes(t)  # offloading keeps an expanded tensor's stride-0 layout
    if resident + max(plan.need, state.working_set_bytes) > pager.budget_bytes:
        together = (f" with the other offloaded tensors of its module '{plan.module}' ({len(plan.weights)} in all)"
                    if len(plan.weights) > 1 else "")
        if whole:
            together += (f", read whole ({whole} bytes with the other offloaded tensors of '{state.prefixes.get(parent)}')"
                         f" by the one kernel of the {type(parent).__name__} around it")
        if state.working_set_bytes > plan.need:  # the room the model's largest op needs is what does not fit
            together += f", and the room must still hold the {state.working_set_bytes} bytes the model's largest op pages"
        raise BudgetError(
            f"offtensor: {kind}{full_name} ({nbytes} bytes) needs {plan.need} bytes on the device to be paged"
            f"{together}, but only {pager.budget_bytes - resident} of the budget's {pager.budget_bytes} bytes are "
            f"not resident weights; raise budget_gb or offload more"
        )
    _warn_tiles([plan], pager.budget_bytes, f"{kind}{full_name}", stacklevel=3)
    state.working_set_bytes = max(state.working_set_bytes, plan.need)


def _fused_parent_read(state: State, module: torch.nn.Module, attr: str, t: torch.Tensor) -> tuple:
    """``groups.read_whole_after`` among the model's modules and those attaching with ``module``."""
    model = state.model_ref()
    return read_whole_after(module, attr, t, [*state.prefixes.keys(), *(model.modules() if model is not None else ())])


def reserve_whole_read(state: State, full_name: str, t: OffloadedTensor, slot: tuple) -> None:
    """Before ``t``, offloaded already (a tie made after wrapping: ``loss.linear.weight =
    embed.weight``), is registered into ``slot`` = (module, attribute): where a fused parent's
    kernel reads it whole (the table an embedding pages by rows, read whole by the loss), make
    sure the room holds that read, and reserve it. Raises a BudgetError, before anything changes,
    where it cannot."""
    module, attr = slot
    whole, parent = _fused_parent_read(state, module, attr, t)
    model = state.model_ref()
    if not whole or model is None:
        return
    pager = state.pager
    resident = resident_bytes(model, pager.device)
    if resident + whole > pager.budget_bytes:
        raise BudgetError(
            f"offtensor: {full_name} ({tensor_bytes(t)} bytes, offloaded as {t._master.name!r}) would be read whole "
            f"({whole} bytes with the other offloaded tensors of '{state.prefixes.get(parent)}') by the one kernel of "
            f"the {type(parent).__name__} around it, but only {pager.budget_bytes - resident} of the budget's "
            f"{pager.budget_bytes} bytes are not resident weights; raise budget_gb or keep a plain copy there")
    state.working_set_bytes = max(state.working_set_bytes, whole)


def check_assigned_load(state: State, root: torch.nn.Module, state_dict) -> dict:
    """Before ``root.load_state_dict(state_dict, assign=True)`` changes anything: each module's
    offloaded tensors as the load leaves them (its incoming tensors at their new sizes, beside
    those it keeps) must be pageable together in the room the resident weights leave, as
    ``reserve_paging_room`` counts them. Raises a BudgetError naming the module and the bytes
    where they cannot, so the load is refused whole. Returns what ``State.loading`` holds while
    the keys are placed one by one: (module, attribute) -> (offloaded tensor, incoming, is_buffer)."""
    incoming, by_module = {}, {}
    for path, module in root.named_modules():
        for table, is_buffer in ((module._parameters, False), (module._buffers, True)):
            for attr, old in table.items():
                new = state_dict.get(f"{path}.{attr}" if path else attr)
                if (isinstance(old, OffloadedTensor) and isinstance(new, torch.Tensor) and leaves.is_leaf(new)
                        and new is not old and not isinstance(new, OffloadedTensor) and new.shape == old.shape
                        and attr not in module._non_persistent_buffers_set):
                    incoming[(module, attr)] = (old, new, is_buffer)
                    by_module.setdefault(module, []).append(attr)
    if not incoming:
        return incoming
    pager, model = state.pager, state.model_ref()
    room = pager.budget_bytes - resident_bytes(model, pager.device)
    for module, attrs in by_module.items():
        name_of = lambda a, module=module: state.qualified_name(module, a)  # noqa: E731
        kept = [g.weight() for g in module_groups(module, name_of, skip=set(attrs)) if g.is_offloaded]
        new = [_weight(name_of(a), incoming[(module, a)][1], (module, a, incoming[(module, a)][2]), True) for a in attrs]
        plan = working_sets.module_room(name_of(attrs[0]).rpartition(".")[0], kept + new, room)
        if plan.need > room:
            names = ", ".join(f"'{w.name}' ({w.nbytes} bytes)" for w in new)
            raise BudgetError(
                f"offtensor: load_state_dict(assign=True) of {names} into module '{plan.module}' needs {plan.need} "
                f"bytes on the device to page the module's {len(plan.weights)} offloaded tensors together"
                f"{' even in tiles of one slice' if plan.slices == 1 else ''}, but only {max(room, 0)} of the budget's "
                f"{pager.budget_bytes} bytes are not resident weights. Nothing was loaded; raise budget_gb or load "
                f"smaller tensors")
    return incoming


def _slot_value(module: torch.nn.Module, attr: str):
    return module._parameters.get(attr, module._buffers.get(attr))


def replan_paging_room(state: State, resident: int, why: str) -> None:
    """Resident weights grow to ``resident`` bytes and leave less room than the paging planned for
    (a weight the policy keeps, a cast that the policy keeps resident): plan the room again, each
    module's offloaded tensors together (``working_sets.modules_room``) whole if they fit, else in
    tiles as placement would have chosen at that room, so ``working_set_bytes`` says what paging
    needs now. Raises a BudgetError, before anything changes, if some module's offloaded tensors
    cannot be paged in the room left even one slice at a time."""
    pager, model = state.pager, state.model_ref()
    room = pager.budget_bytes - resident
    weights = [g.weight() for g in collect_groups(model) if g.is_offloaded] if model is not None else []
    plans = working_sets.modules_room(weights, room)
    if plans and plans[0].need > room:
        plan = plans[0]
        w = max(plan.weights, key=lambda w: w.nbytes)
        together = (f" (one op of module '{plan.module}', {len(plan.weights)} offloaded tensors)"
                    if len(plan.weights) > 1 else "")
        raise BudgetError(
            f"offtensor: {why} leaves {max(room, 0)} of the budget's {pager.budget_bytes} bytes for paging, but the "
            f"offloaded '{w.name}' ({w.nbytes} bytes){together} needs {plan.need} bytes on the device at once"
            f"{' even in tiles of one slice' if plan.tiled else ''}; raise budget_gb or let the policy offload more"
        )
    _warn_tiles(plans, pager.budget_bytes, None, stacklevel=3)
    state.working_set_bytes = plans[0].need if plans else 0


def _warn_tiles(plans, budget_bytes: int, what, stacklevel: int) -> None:
    """The warnings wrap-time placement gives for what ``plans`` compute in tiles: tiles narrower than
    ``TILE_ALIGN``, and tiles of a dtype that may not sum as the whole op does."""
    narrow = next((p for p in plans if p.slices == 1), None)
    if narrow is not None:
        placement.warn_narrow_tiles(budget_bytes, what or f"'{max(narrow.weights, key=lambda w: w.nbytes).name}'",
                                    stacklevel=stacklevel + 1)
    tiled = [w for plan in plans for w in plan.tiled]
    if tiled:
        placement.warn_inexact_tiles(tiled, stacklevel=stacklevel + 1)


def _tiled_if(w: placement.Weight, tiles: bool) -> placement.Weight:
    return dataclasses.replace(w, tileable=True) if tiles and not w.tileable else w


def _weight(full_name: str, t: torch.Tensor, slot: tuple, tileable: bool) -> placement.Weight:
    """``t``, to be offloaded into ``slot`` as ``full_name``, as placement sees it (a torch.nn
    module's tensor reads with its others, a tensor of a module dispatch cannot tile is read whole)."""
    member = Member(t)
    member.slots.append(slot)
    member.names.append(full_name)
    w = StorageGroup([member]).weight()
    return w if tileable or not w.tileable else dataclasses.replace(w, tileable=False)


def _offloaded_beside(slot: tuple, t: torch.Tensor, full_name: str) -> list:
    """(leaf, tileable) for each offloaded leaf but ``t`` of the wrapper subclass ``slot`` holds."""
    module, attr, is_buffer = slot
    table = module.__dict__ if is_buffer is None else module._buffers if is_buffer else module._parameters
    value = table.get(attr)
    if not isinstance(value, torch.Tensor) or leaves.is_leaf(value):
        return []
    return [(leaf, leaf_is_tileable(leaf, [(owner, name)]))
            for owner, name, leaf in leaves.leaves(value, f"'{full_name}'")
            if isinstance(leaf, OffloadedTensor) and leaf is not t]


def warn_view_of_a_bigger_master(full_name: str, t: OffloadedTensor) -> None:
    """``t``, assigned as ``full_name``, is a view of an offloaded weight whose host master holds
    more than it covers (a shard taken after wrapping: quantise -> wrap -> shard; a slice of a
    clone, as transformers' ``resize_position_embeddings`` cuts a table): the master stays whole, as
    a plain view keeps its whole storage, so this process keeps every byte of it. Say so, naming the
    weight, the bytes and both ways to hold only the view's bytes."""
    lo, hi = covering_range(t._host)
    covered = (hi - lo) * t._host.element_size()
    if covered < t._master.nbytes:
        warnings.warn(
            f"offtensor: {full_name} is assigned a view of {t._host.numel() * t._host.element_size()} bytes (paging "
            f"covers {covered}) of an offloaded host master of "
            f"{t._master.nbytes} bytes (a shard or slice taken of a weight that was already offloaded); the master "
            f"stays whole, so host memory keeps all {t._master.nbytes} bytes. To hold only the slice, assign a "
            f".clone() of it; to hold only a shard, shard (or parallelize) first and call ot.wrap_model "
            f"afterwards, on each rank.", UserWarning, stacklevel=callers.stacklevel())
