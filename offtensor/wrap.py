"""wrap_model / unwrap_model: turn a model's weights into resident device tensors and
OffloadedTensors for a budget, in place, keeping every Parameter object and every tie.

A model's tensors are collected by identity and by storage: a Parameter registered under several
names (tied embedding and lm_head) or several Parameters viewing one storage become views of one
host master, and each Parameter object is swapped in place (``torch.utils.swap_tensors``) so the
modules, the optimizer and the user's own references all see the new tensor.

After wrapping, a global registration hook places any parameter, buffer or submodule assigned
into the model (post-load rewrites, quantisation repacking, ``load_state_dict(assign=True)``)
under the same budget instead of letting it land on the device unaccounted.
"""

from __future__ import annotations

import os
import weakref
from typing import Optional

import torch
from torch import nn

from . import placement
from .pager import GiB, BudgetError, OffloadStats, Pager, _covering_range, resolve_device
from .prefetch import Prefetcher
from .tensor import OffloadedTensor, _check_offloadable, _master_for, new_host_master

# Every submodule of a wrapped model -> the model's state, for the registration hooks.
_WRAPPED: "weakref.WeakKeyDictionary[nn.Module, _State]" = weakref.WeakKeyDictionary()
_hooks = []

# Kept free for activations when the budget is derived from free device memory.
DEFAULT_MARGIN_BYTES = 2 * GiB


class _Member:
    """One tensor object and every (module, attribute) slot it is registered in."""

    __slots__ = ("tensor", "slots", "names")

    def __init__(self, tensor):
        self.tensor = tensor
        self.slots = []  # (module, attribute, is_buffer)
        self.names = []


class _State:
    def __init__(self, model, pager: Pager, plan: placement.Plan, policy, prefetch: bool):
        self.model_ref = weakref.ref(model)
        self.pager = pager
        self.policy = policy
        self.prefetch = prefetch
        self.working_set_bytes = plan.working_set_bytes
        self.plan = plan


# ---------------------------------------------------------------------------- collection


def _collect(model: nn.Module):
    """Unique tensors grouped by storage: a list of lists of _Member that alias one storage."""
    members = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for table, is_buffer in ((module._parameters, False), (module._buffers, True)):
            for attr, t in table.items():
                if t is None:
                    continue
                member = members.get(id(t))
                if member is None:
                    member = members[id(t)] = _Member(t)
                name = f"{prefix}.{attr}" if prefix else attr
                if (module, attr) not in [(m, a) for m, a, _ in member.slots]:
                    member.slots.append((module, attr, is_buffer))
                if name not in member.names:
                    member.names.append(name)
    groups = {}
    for member in members.values():
        t = member.tensor
        groups.setdefault(_storage_key(t), []).append(member)
    return list(groups.values())


def _storage_key(t: torch.Tensor):
    if isinstance(t, OffloadedTensor):
        return ("master", t._master.id)
    if t.is_meta or t.layout != torch.strided or t.untyped_storage().data_ptr() == 0:
        return ("object", id(t))
    return (t.device, t.untyped_storage().data_ptr(), t.dtype)


def _group_bytes(group) -> int:
    t = group[0].tensor
    if isinstance(t, OffloadedTensor):
        return t._master.nbytes
    if len(group) == 1:
        return t.numel() * t.element_size()
    lo, hi = _group_range(group)
    return (hi - lo) * t.element_size()


def _group_range(group):
    ranges = [_covering_range(m.tensor) for m in group if m.tensor.numel()]
    if not ranges:
        return 0, 0
    return min(r[0] for r in ranges), max(r[1] for r in ranges)


def _weight(group) -> placement.Weight:
    names = [n for m in group for n in m.names]
    t = group[0].tensor
    nbytes = _group_bytes(group)
    return placement.Weight(names, nbytes, tuple(t.shape), placement.working_set(names[0], tuple(t.shape), nbytes))


# ---------------------------------------------------------------------------- moving tensors


def _swap(member: _Member, new: torch.Tensor) -> None:
    """Make ``member.tensor`` become ``new`` in place, so its identity survives; if PyTorch refuses
    (other C++ references exist), register ``new`` in every slot instead."""
    old = member.tensor
    try:
        torch.utils.swap_tensors(old, new)
        return
    except RuntimeError:
        pass  # e.g. a live autograd graph still references the tensor
    for module, attr, is_buffer in member.slots:
        (module._buffers if is_buffer else module._parameters)[attr] = new
    member.tensor = new


def _as_param_like(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    if isinstance(old, nn.Parameter):
        return nn.Parameter(new, requires_grad=old.requires_grad)
    return new


def _offload_group(group, pager: Pager) -> None:
    first = group[0].tensor
    if isinstance(first, OffloadedTensor):
        first._master.move_to(pager)
        return
    for member in group:
        _check_offloadable(member.tensor, f"'{member.names[0]}'")
    lo, hi = _group_range(group)
    flat = first.detach().as_strided((hi - lo,), (1,), lo)
    host_flat = new_host_master(flat, pin=pager.device.type == "cuda")
    master = _master_for(host_flat, pager)
    for member in group:
        t = member.tensor
        host = host_flat.as_strided(t.shape, t.stride(), t.storage_offset() - lo)
        _swap(member, _as_param_like(t, OffloadedTensor(host, master)))


def _make_resident(group, device: torch.device) -> None:
    first = group[0].tensor
    if isinstance(first, OffloadedTensor):
        host_group = [(m, m.tensor._host) for m in group]
        lo = min(_covering_range(h)[0] for _, h in host_group)
        hi = max(_covering_range(h)[1] for _, h in host_group)
        flat = first._master.pager.copy_out(first._host.as_strided((hi - lo,), (1,), lo))
        for member, host in host_group:
            view = flat.as_strided(host.shape, host.stride(), host.storage_offset() - lo)
            _swap(member, _as_param_like(member.tensor, view))
        return
    if first.device == device:
        return
    if first.is_meta:
        raise ValueError(
            f"offtensor: '{group[0].names[0]}' ({_group_bytes(group)} bytes) is on the meta device and has no values; "
            f"load its weights first (ot.load_safetensors) or build the model on cpu"
        )
    lo, hi = _group_range(group)
    flat = first.detach().as_strided((hi - lo,), (1,), lo).to(device)
    for member in group:
        t = member.tensor
        t.data = flat.as_strided(t.shape, t.stride(), t.storage_offset() - lo)


def _resident_bytes(model: nn.Module, device: torch.device) -> int:
    seen = set()
    total = 0
    for t in _tensors(model):
        if isinstance(t, OffloadedTensor) or t.device != device or t.is_meta:
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr() or id(t)
        if key not in seen:
            seen.add(key)
            total += storage.nbytes() if storage.data_ptr() else t.numel() * t.element_size()
    return total


def _tensors(model: nn.Module):
    for module in model.modules():
        for t in module._parameters.values():
            if t is not None:
                yield t
        for t in module._buffers.values():
            if t is not None:
                yield t


# ---------------------------------------------------------------------------- public API


def wrap_model(model: nn.Module, budget_gb: Optional[float] = None, *, device=None, offload_gb: Optional[float] = None,
               prefetch: bool = True, policy=None) -> nn.Module:
    """Place ``model``'s weights for a device budget, in place; returns ``model``.

    Weights that fit stay plain device tensors; the rest become OffloadedTensors paged per op.
    ``budget_gb`` (GiB) caps resident weights + paged copies + prefetches; ``offload_gb`` instead
    offloads at least that many GiB (vLLM's ``cpu_offload_gb``). With neither, the budget is the
    free device memory minus a margin for activations.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"offtensor: wrap_model takes an nn.Module, got {type(model).__name__}")
    if model in _WRAPPED:
        state = _WRAPPED[model]
        raise RuntimeError(
            f"offtensor: {type(model).__name__} is already wrapped (budget {state.pager.budget_bytes} bytes on "
            f"{state.pager.device}); call ot.unwrap_model(model) before wrapping it again"
        )
    if budget_gb is not None and offload_gb is not None:
        raise ValueError("offtensor: give budget_gb or offload_gb, not both")
    for label, value in (("budget_gb", budget_gb), ("offload_gb", offload_gb)):
        if value is not None and (not isinstance(value, (int, float)) or value < 0):
            raise ValueError(f"offtensor: {label} must be a non-negative number of GiB, got {value!r}")
    device = resolve_device(device)
    groups = _collect(model)
    weights = [_weight(g) for g in groups]
    for g in groups:
        t = g[0].tensor
        if not isinstance(t, OffloadedTensor) and t.is_meta:
            raise ValueError(
                f"offtensor: '{g[0].names[0]}' ({_group_bytes(g)} bytes) is on the meta device and has no values; "
                f"use ot.load_safetensors(model, path) for a model built on meta"
            )
    budget_bytes = None if budget_gb is None else int(budget_gb * GiB)
    offload_bytes = None if offload_gb is None else int(offload_gb * GiB)
    if budget_bytes is None and offload_bytes is None:
        budget_bytes = _free_device_bytes(device) - DEFAULT_MARGIN_BYTES
    already = {id(w) for w, g in zip(weights, groups) if isinstance(g[0].tensor, OffloadedTensor)}
    user_policy = policy
    if already:
        # Tensors the user offloaded by hand stay offloaded.
        ids = {n for w in weights if id(w) in already for n in w.names}

        def policy(name, _user=user_policy):
            return "offload" if name in ids else placement._policy_choice(_user, [name])

    plan = placement.plan(weights, budget_bytes, offload_bytes, policy, prefetch)
    pager = Pager(device, plan.budget_bytes)
    by_weight = {id(w): g for w, g in zip(weights, groups)}
    for w in plan.offload:
        _offload_group(by_weight[id(w)], pager)
    for w in plan.resident:
        _make_resident(by_weight[id(w)], device)
    state = _State(model, pager, plan, user_policy, prefetch)
    for module in model.modules():
        _WRAPPED[module] = state
    pager.resident_bytes = _resident_bytes(model, device)
    pager.reset_stats()
    if prefetch and plan.offload:
        pager.prefetcher = Prefetcher()
    _install_hooks()
    return model


def unwrap_model(model: nn.Module) -> nn.Module:
    """Every weight back to a plain tensor on the device, keeping identities and ties."""
    state = _state(model)
    pager = state.pager
    pager.prefetcher = None
    pager.clear()
    for group in _collect(model):
        if isinstance(group[0].tensor, OffloadedTensor):
            _make_resident(group, pager.device)
    for module in list(_WRAPPED.keys()):
        if _WRAPPED.get(module) is state:
            del _WRAPPED[module]
    pager.resident_bytes = _resident_bytes(model, pager.device)
    return model


def stats(model: nn.Module) -> OffloadStats:
    state = _state(model)
    state.pager.resident_bytes = _resident_bytes(model, state.pager.device)
    return state.pager.snapshot()


def reset_stats(model: nn.Module) -> None:
    _state(model).pager.reset_stats()


def _state(model: nn.Module) -> _State:
    state = _WRAPPED.get(model)
    if state is None or state.model_ref() is not model:
        raise ValueError(f"offtensor: this {type(model).__name__} is not wrapped; call ot.wrap_model(model, ...) first")
    return state


def _free_device_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


# ---------------------------------------------------------------------------- re-placement


def _place(state: _State, module: nn.Module, name: str, t: torch.Tensor, is_buffer: bool):
    """Place a tensor being registered into a wrapped model; returns a replacement or None."""
    pager = state.pager
    if isinstance(t, OffloadedTensor):
        t._master.move_to(pager)
        return None
    if t.is_meta or t.layout != torch.strided:
        return None
    table = module._buffers if is_buffer else module._parameters
    old = table.get(name)
    model = state.model_ref()
    resident = _resident_bytes(model, pager.device) if model is not None else pager.resident_bytes
    if old is not None and not isinstance(old, OffloadedTensor) and old.device == pager.device and not old.is_meta:
        resident -= old.numel() * old.element_size()
    nbytes = t.numel() * t.element_size()
    full_name = f"{type(module).__name__}.{name}"
    choice = placement._policy_choice(state.policy, [name, full_name])
    ws = placement.working_set(name, tuple(t.shape), nbytes)
    keep = choice == "keep" or (
        choice != "offload" and resident + nbytes + max(state.working_set_bytes, 0) <= pager.budget_bytes
    )
    if keep:
        if resident + nbytes > pager.budget_bytes:
            raise BudgetError(
                f"offtensor: keeping {full_name} ({nbytes} bytes) resident would put {resident + nbytes} bytes of "
                f"resident weights over the budget of {pager.budget_bytes} bytes"
            )
        if t.device != pager.device:
            with torch.no_grad():
                t.data = t.data.to(pager.device)
        pager.resident_bytes = resident + nbytes
        pager._note_peak()
        return None
    if resident + ws > pager.budget_bytes:
        raise BudgetError(
            f"offtensor: {full_name} ({nbytes} bytes) needs {ws} bytes on the device to be paged, but only "
            f"{pager.budget_bytes - resident} of the budget's {pager.budget_bytes} bytes are not resident weights"
        )
    state.working_set_bytes = max(state.working_set_bytes, ws)
    member = _Member(t)
    member.slots.append((module, name, is_buffer))
    member.names.append(full_name)
    _offload_group([member], pager)
    return member.tensor


def _param_hook(module, name, param):
    state = _WRAPPED.get(module)
    if state is None or param is None:
        return None
    return _place(state, module, name, param, is_buffer=False)


def _buffer_hook(module, name, buffer):
    state = _WRAPPED.get(module)
    if state is None or buffer is None:
        return None
    return _place(state, module, name, buffer, is_buffer=True)


def _module_hook(module, name, submodule):
    state = _WRAPPED.get(module)
    if state is None or submodule is None:
        return None
    for child in submodule.modules():
        if _WRAPPED.get(child) is state:
            continue
        _WRAPPED[child] = state
        for table, is_buffer in ((child._parameters, False), (child._buffers, True)):
            for attr, t in list(table.items()):
                if t is not None:
                    new = _place(state, child, attr, t, is_buffer)
                    if new is not None:
                        table[attr] = new
    return None


def _install_hooks() -> None:
    if _hooks:
        return
    from torch.nn.modules import module as module_mod

    _hooks.append(module_mod.register_module_parameter_registration_hook(_param_hook))
    _hooks.append(module_mod.register_module_buffer_registration_hook(_buffer_hook))
    _hooks.append(module_mod.register_module_module_registration_hook(_module_hook))
