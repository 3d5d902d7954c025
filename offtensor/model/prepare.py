"""The one pipeline that ``wrap_model``, the loader and ``ot.plan`` run (``prepare``): check ->
collect -> choose -> experts -> (read) -> apply. ``apply_placement`` carries the choice out on a
pager and marks the model wrapped, atomically; ``unwrap`` and ``re_place_experts`` are its reverse
and its one later change."""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
from torch import nn

from .. import moe
from .. import leaves
from .. import placement
from ..config import OffloadConfig
from ..pager import Pager
from ..prefetch import Prefetcher
from ..tensor import OffloadedTensor, check_offloadable
from .copies import StepHook, model_state, register_wrapped, take_over_copies, unregister_wrapped
from .dtensor import refuse_offloading_what_fsdp2_manages
from .engines import refuse_dispatched_elsewhere, refuse_other_offloaders
from .groups import collect_groups
from .moves import Undo, as_param_like, make_resident, offload_group, refit_wrappers, resident_bytes, swap
from .state import State, refuse_wrapped_elsewhere, withdraw, wrapped_state


class Prepared(NamedTuple):
    """What ``prepare`` chose and the pager it applied it on."""

    placed: placement.ModelPlacement
    pager: Pager


def prepare(model: nn.Module, config: OffloadConfig, device: torch.device, *,
            check: Optional[Callable] = None, choose_experts: Optional[Callable] = None,
            read: Optional[Callable] = None) -> Prepared:
    """Place ``model``'s weights under ``config`` on ``device`` and mark it wrapped:

    1. collect its tensors by storage (``collect_groups``) and ``check(groups)``, which raises for
       what the caller cannot take, before anything is chosen or moves;
    2. choose which groups to offload (``placement.choose_model_placement``);
    3. ``choose_experts(model, groups, placed, config, device)`` -> (placed, config, report, watch):
       the expert placement, decided by the caller (wrap_model and the loader pass theirs; a plan
       passes None and places by the policy it was given);
    4. ``read(groups, placed, pager, config)`` -> the loaded tensors (``apply_placement``'s
       ``loaded``), for a loader, between choosing and applying;
    5. ``apply_placement`` on a new pager with the chosen budget (a meta pager for a meta device).

    The caller's grad mode is the same after a failure as before: an interrupt that lands inside a
    step's ``torch.no_grad()`` enter or exit (after grad went off, before the ``with`` took hold)
    would otherwise leave it off for the rest of the thread.

    Under ``torch.inference_mode`` the masters and wrappers are made as normal tensors all the
    same: the model's own parameters are, and inference tensors could never be written outside it
    (an optimizer step, ``load_state_dict``)."""
    grad = torch.is_grad_enabled()
    try:
        with torch.inference_mode(False):  # (outside inference mode, a no-op)
            if device.type != "meta":  # (a plan runs on meta whatever the model was dispatched to)
                refuse_dispatched_elsewhere(model, device)
            groups = collect_groups(model, device)
            if check is not None:
                check(groups)
            placed = placement.choose_model_placement(groups, config, device)
            expert = None
            if choose_experts is not None:
                placed, config, report, watch = choose_experts(model, groups, placed, config, device)
                expert = (report, watch)
            pager = Pager(device, placed.budget_bytes, strict=config.strict)
            loaded = read(groups, placed, pager, config) if read is not None else None
            apply_placement(model, placed, pager, config, loaded, expert=expert)
    except BaseException:
        torch.set_grad_enabled(grad)
        raise
    return Prepared(placed, pager)


def check_wrappable(model) -> None:
    """Refuse what ``wrap_model`` and ``load_safetensors`` cannot take: not a module, wrapped already,
    or moved by another offloader's hooks (accelerate's, diffusers' group offloading)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"offtensor: expected an nn.Module, got {type(model).__name__}")
    state = wrapped_state(model)
    if state is not None:
        owner = state.model_ref()
        if owner is not None and owner is not model:
            raise RuntimeError(
                f"offtensor: this {type(model).__name__} is a module of a wrapped {type(owner).__name__} (budget "
                f"{state.pager.budget_bytes} bytes on {state.pager.device}), whose budget holds its weights; call "
                f"ot.unwrap_model on that {type(owner).__name__} before wrapping this module on its own")
        raise RuntimeError(
            f"offtensor: {type(model).__name__} is already wrapped (budget {state.pager.budget_bytes} bytes on "
            f"{state.pager.device}); call ot.unwrap_model(model) before wrapping it again"
        )
    state = model_state(model)
    if state is not None:
        raise RuntimeError(
            f"offtensor: this {type(model).__name__} is a copy.copy of a wrapped {type(state.model_ref()).__name__} "
            f"and shares its modules, weights and wrap (budget {state.pager.budget_bytes} bytes on "
            f"{state.pager.device}); call ot.unwrap_model on either of them before wrapping it again")
    refuse_wrapped_elsewhere(model, f"wrapping this {type(model).__name__} around it")
    refuse_other_offloaders(model)


def apply_placement(model: nn.Module, placed: placement.ModelPlacement, pager: Pager, config: OffloadConfig,
                    loaded: Optional[dict] = None, expert: Optional[tuple] = None) -> nn.Module:
    """Make ``model``'s tensors what ``placed`` chose, on ``pager``, and mark the model wrapped.

    ``loaded``: id(member) -> the tensor a loader already filled for it (a view of a host master on
    ``pager``, or a device tensor), for every member of the groups it read: those members become
    these tensors (same Parameter objects); the other groups are offloaded or moved to the device.

    Atomic: what cannot be offloaded is refused before anything moves, and a failure at any later
    step (an allocation, a read, a registration) undoes every step before it (``Undo``) and frees
    what they allocated, so the model is exactly as it was and not registered as wrapped.

    ``expert``: the (report, watch) of the caller's expert choice, which chose ``placed``'s expert
    placement (wrap_model and the loaders decide before anything is placed or read)."""
    loaded = loaded if loaded is not None else {}
    planning = pager.device.type == "meta"  # ot.plan: a meta model's groups become meta masters
    for group in placed.offloaded:
        t = group[0].tensor
        if id(group[0]) not in loaded and not isinstance(t, OffloadedTensor) and not (planning and t.is_meta):
            for member in group:
                check_offloadable(member.tensor, f"'{member.names[0]}'")
    refuse_offloading_what_fsdp2_manages(model, [g for g in placed.offloaded if id(g[0]) not in loaded])
    try:
        Undo.run(_place, model, placed, pager, config, loaded, expert)
    except BaseException:
        loaded.clear()  # the loader's destinations: freed now, not when the traceback goes
        raise
    return model


def _place(model: nn.Module, placed: placement.ModelPlacement, pager: Pager, config: OffloadConfig, loaded: dict,
           expert: Optional[tuple]) -> None:
    """``apply_placement``'s steps, inside its undo record."""
    take_over_copies(model)
    for group in placed.offloaded + placed.resident:
        if id(group[0]) in loaded:
            for member in group:
                swap(member, as_param_like(member.tensor, loaded[id(member)]))
        elif placed.offloads(group):
            offload_group(group, pager)  # for a load: not in the files, has values (a buffer made at init)
        else:
            make_resident(group, pager.device)
    refit_wrappers(m for group in placed.offloaded + placed.resident for m in group)
    register_wrapped(model, pager, placed.choice, config)
    if expert is not None:
        _start_expert_placement(model, *expert)


def _start_expert_placement(model: nn.Module, report: Optional[dict], watch) -> None:
    state = wrapped_state(model)
    state.expert_placement = report
    if watch is not None:
        Undo.note("call", watch.stop)
        watch.start(state, model)


def unwrap(model: nn.Module, state: State) -> nn.Module:
    """Every weight of the wrapped ``model`` back to a plain tensor on the device, its modules back
    to their own classes, its hooks gone (``unwrap_model``, under the pager's lock; the end of a plan).

    Cut short (a Ctrl-C) before every weight is plain, the model stays wrapped and whole: the moves
    are undone as a failed wrap's are, the prefetcher is put back, and the next step registers its
    experts again. A weight's swap cut short half-way (``swap_tensors`` exchanges class, attributes
    and C++ tensor one by one) left before a Parameter of one class over the other's tensor, which
    no forward or unwrap could use again.

    ``model`` may be a ``copy.copy`` of the wrapped model (``copies.model_state``): the modules they
    share are unwrapped through the original, which leaves last as it does unwrapped by its own name
    (so a cut-short unwrap is found again through either name), and both names end plain."""
    original = state.model_ref()
    if original is not None and original is not model:
        unwrap(original, state)
        withdraw(model)  # the original's member, which the copy carried as it is: no module of it now
        return model
    pager = state.pager
    prefetcher = pager.prefetcher
    try:
        state.experts_stale = True  # (for a model still wrapped after all)
        pager.prefetcher = None
        moe.detach(pager)
        pager.clear()
        offloaded = [group for group in collect_groups(model) if group.is_offloaded]
        Undo.run(_make_resident, offloaded, pager.device)
    except BaseException:
        pager.prefetcher = prefetcher
        raise
    # The model's weights are no longer this pager's: what it still pages (a view of a master taken
    # before unwrapping, an op of another thread's forward dispatched before the swap) pages within
    # the budget beside no resident weights, instead of failing beside weights it no longer holds.
    pager.recount_resident(0)
    unregister_wrapped(model, state)  # last: until it ends, an unwrap cut short is retried in full
    return model


def pinned(config: OffloadConfig, budget_bytes: int) -> OffloadConfig:
    """``config`` at exactly ``budget_bytes`` (the default placement's budget; exact: a power-of-2 division)."""
    return config.replace(budget_gb=budget_bytes / placement.GiB, offload_gb=None)


def re_place_experts(state: State, model: nn.Module, policy) -> None:
    """Offload the expert stacks that the placement under ``policy`` offloads and that are still
    resident, between two forwards, under the pager's lock. Only offloading: groups offloaded now
    stay offloaded (``choose_model_placement``), so device bytes only fall and the budget holds
    throughout; values are the same bytes, so logits do not change. Atomic, as ``apply_placement``:
    the state's record of the placement (its config, the resident bytes counted) changes inside the
    same ``Undo``, so a Ctrl-C leaves either the old placement or the new one, never the stacks
    offloaded beside a count of resident bytes that still holds them."""
    pager = state.pager
    config = state.config.replace(policy=policy)
    placed = placement.choose_model_placement(collect_groups(model, pager.device), pinned(config, pager.budget_bytes),
                                              pager.device)
    moving = [g for g in placed.offloaded if not g.is_offloaded]
    ptrs = {m.tensor.untyped_storage().data_ptr() for g in moving for m in g if leaves.is_leaf(m.tensor)}
    Undo.run(_offload_experts, state, model, moving, config, placed.choice, ptrs)
    state.refresh_experts()  # the new stacks join the expert cache and its router hooks (stale until done)


def _make_resident(offloaded: list, device: torch.device) -> None:
    """``unwrap``'s moves, inside its undo record."""
    for group in offloaded:
        make_resident(group, device)
    refit_wrappers(m for group in offloaded for m in group)


def _offload_experts(state: State, model: nn.Module, moving: list, config: OffloadConfig,
                     choice: placement.Placement, ptrs: set) -> None:
    """``re_place_experts``' steps, inside its undo record."""
    for group in moving:
        offload_group(group, state.pager)
    _take_placement(state, model, config, choice, ptrs)


def _take_placement(state: State, model: nn.Module, config: OffloadConfig, choice: placement.Placement,
                    ptrs: set) -> None:
    """``state`` records the placement under ``config`` (``re_place_experts``), its undo noted first."""
    pager = state.pager
    hook = model._forward_pre_hooks.get(state.step_hook.id) if state.step_hook is not None else None
    hook = hook if isinstance(hook, StepHook) else None
    Undo.note("call", _put_back, state, hook, (state.resident_ptrs, state.config, state.choice,
                                               state.working_set_bytes, hook and hook.config,
                                               pager.resident_bytes, pager.prefetcher))
    state.experts_stale = True
    state.resident_ptrs = state.resident_ptrs - ptrs  # a new set: the undo keeps the old one
    state.config, state.choice = config, choice
    state.working_set_bytes = max(state.working_set_bytes, choice.working_set_bytes)
    if hook is not None:
        hook.config = config  # a copy of the model is placed as this one is now
    pager.recount_resident(resident_bytes(model, pager.device))
    if config.prefetch and pager.prefetcher is None:
        pager.prefetcher = Prefetcher()


def _put_back(state: State, hook, saved: tuple) -> None:
    """Undo ``_take_placement``: each part as it was (the experts are registered again at the next step)."""
    ptrs, config, choice, working_set, hook_config, resident, prefetcher = saved
    state.resident_ptrs, state.config, state.choice, state.working_set_bytes = ptrs, config, choice, working_set
    if hook is not None:
        hook.config = hook_config
    state.pager.recount_resident(resident)
    if state.pager.prefetcher is not prefetcher:
        state.pager.prefetcher = prefetcher
