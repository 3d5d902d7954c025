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

import itertools
import math
import os
import warnings
import weakref
from typing import Optional

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from . import compile as _compile
from . import placement
from .pager import GiB, BudgetError, OffloadStats, Pager, covering_range, pins_host_memory, resolve_device
from .prefetch import Prefetcher
from . import experts
from .tensor import (
    _OWN_ATTRS, OffloadedTensor, _check_offloadable, _master_for, new_host_master, offloaded_class, user_attrs,
    user_class,
)

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


class _Placed:
    """Where a tensor assigned after wrapping went, keyed by the storage it came from, so that a
    second tensor over that storage (``load_state_dict(assign=True)`` wraps each key of a tied pair
    in its own Parameter) becomes a view of the same placement instead of a second copy."""

    __slots__ = ("source", "target", "dtype", "lo", "hi", "view", "base")

    def __init__(self, source: torch.Tensor, target: torch.Tensor):
        self.source = StorageWeakRef(source.untyped_storage())
        self.target = weakref.ref(target)
        self.dtype = source.dtype
        self.lo, self.hi = covering_range(source)
        self.view = (tuple(source.shape), source.stride(), source.storage_offset())
        # target storage offset - source storage offset, the same for every element of [lo, hi)
        if isinstance(target, OffloadedTensor):
            self.base = target._host.storage_offset() - source.storage_offset()
        else:
            self.base = 0


class _State:
    def __init__(self, model, pager: Pager, plan: placement.Plan, policy, prefetch: bool):
        self.model_ref = weakref.ref(model)
        self.pager = pager
        self.policy = policy
        self.prefetch = prefetch
        self.working_set_bytes = plan.working_set_bytes
        self.plan = plan
        self.placed: dict = {}  # source storage (_cdata) -> _Placed
        self.load_hooks = []  # handles of the load_state_dict and state_dict post-hooks on every module
        self.step_hook = None  # forward pre-hook on the model that marks prefetch passes
        # Storages of the resident weights placed so far, so that a load that only copied values
        # into them is recognised without walking the model.
        self.resident_ptrs: set = set()
        self.prefixes: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()
        # An expert stack was assigned, replaced or removed after wrapping (load_state_dict with
        # assign=True, a new experts module): the pager's expert registry names dead masters and
        # misses the new ones, so it is rebuilt before the next forward or stats read.
        self.experts_stale = False

    def refresh_experts(self) -> None:
        self.experts_stale = False
        model = self.model_ref()
        if model is not None:
            experts.detach(self.pager)
            experts.attach(model, self.pager, speculate=self.prefetch)

    def qualified_name(self, module: nn.Module, attr: str) -> str:
        """``module``'s tensor ``attr`` under its name in the model, as policies and placement see it."""
        prefix = self.prefixes.get(module)
        if prefix is None:
            model = self.model_ref()
            if model is not None:
                for path, m in model.named_modules(remove_duplicate=False):
                    self.prefixes.setdefault(m, path)
            prefix = self.prefixes.get(module)
        if prefix is None:
            return f"{type(module).__name__}.{attr}"
        return f"{prefix}.{attr}" if prefix else attr

    def remember(self, source: torch.Tensor, target: torch.Tensor) -> None:
        self.placed[source.untyped_storage()._cdata] = _Placed(source, target)

    def placement_of(self, t: torch.Tensor):
        """The tensor that an earlier placement of ``t``'s storage produced, if ``t`` lies inside it."""
        for key in [k for k, p in self.placed.items() if p.source.expired() or p.target() is None]:
            del self.placed[key]
        placed = self.placed.get(t.untyped_storage()._cdata)
        if placed is None or placed.dtype != t.dtype or not t.numel():
            return None
        lo, hi = covering_range(t)
        if lo < placed.lo or hi > placed.hi:
            return None
        return placed


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
    if len(group) == 1 and (t.is_meta or not _expanded(t)):
        return t.numel() * t.element_size()
    # Several aliases, or an expanded (stride-0) tensor: the storage range they cover, which is
    # what a host master or a resident copy of them holds (256 B for 256 B expanded to 16 KiB).
    lo, hi = _group_range(group)
    return (hi - lo) * t.element_size()


def _expanded(t: torch.Tensor) -> bool:
    """Some dim of ``t`` repeats its elements (stride 0, size > 1), as ``expand`` makes."""
    return any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape))


def _tensor_bytes(t: torch.Tensor) -> int:
    """The bytes ``t``'s values take: its covering storage range when expanded, else numel bytes."""
    if t.layout == torch.strided and not t.is_meta and t.numel() and _expanded(t):
        lo, hi = covering_range(t)
        return (hi - lo) * t.element_size()
    return t.numel() * t.element_size()


def _group_range(group):
    ranges = [covering_range(m.tensor) for m in group if m.tensor.numel()]
    if not ranges:
        return 0, 0
    return min(r[0] for r in ranges), max(r[1] for r in ranges)


def _weight(group) -> placement.Weight:
    names = [n for m in group for n in m.names]
    t = group[0].tensor
    nbytes = _group_bytes(group)
    # torch.nn's own modules (Linear, LSTM, MultiheadAttention...) may read all their tensors in one op.
    fused = any(type(module).__module__.startswith("torch.nn") for m in group for module, _, _ in m.slots)
    # An embedding table nothing else reads (a tied LM head registers it under a Linear too) is
    # only ever paged by rows. max_norm would renormalise the looked-up rows in place; rare, and
    # kept on the ordinary path.
    indexed = all(
        isinstance(module, nn.Embedding) and attr == "weight" and module.max_norm is None
        for m in group for module, attr, _ in m.slots
    ) and any(m.slots for m in group)
    shape = tuple(t.shape)
    return placement.Weight(names, nbytes, shape, placement.working_set(names[0], shape, nbytes, indexed), fused,
                            indexed)


# ---------------------------------------------------------------------------- moving tensors


def _swap(member: _Member, new: torch.Tensor) -> None:
    """Make ``member.tensor`` become ``new`` in place, so its identity survives; if PyTorch refuses
    (other C++ references exist), register ``new`` in every slot instead."""
    old = member.tensor
    # nn.LSTM/GRU/RNN keep weak references to their weights (to notice a re-assigned weight), and
    # swap_tensors refuses a tensor with weak references: drop them for the swap and point them at
    # the same objects afterwards, so the modules see no change of weights.
    rnns = [m for m, _, _ in member.slots if isinstance(m, nn.RNNBase) and getattr(m, "_flat_weight_refs", None)]
    for rnn in rnns:
        rnn._flat_weight_refs = []
    try:
        torch.utils.swap_tensors(old, new)
        return
    except RuntimeError:
        pass  # e.g. a live autograd graph still references the tensor
    finally:
        for rnn in rnns:
            rnn._flat_weight_refs = [weakref.ref(w) if w is not None else None for w in rnn._flat_weights]
    for module, attr, is_buffer in member.slots:
        if is_buffer is None:  # a plain tensor attribute
            module.__dict__[attr] = new
        else:
            (module._buffers if is_buffer else module._parameters)[attr] = new
    member.tensor = new


def _check_attribute_names(t: torch.Tensor, what: str) -> None:
    clash = sorted(_OWN_ATTRS & t.__dict__.keys()) if not isinstance(t, OffloadedTensor) else ()
    if clash:
        raise ValueError(
            f"offtensor: {what} of shape {tuple(t.shape)} ({t.numel() * t.element_size()} bytes) has attributes "
            f"{clash}, the names an OffloadedTensor keeps its host master under; rename them before wrapping"
        )


def _as_param_like(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``new`` (an OffloadedTensor, or a plain device tensor when unwrapping) dressed as ``old``: a
    Parameter of ``old``'s own class (vLLM's ``ModelWeightParameter``...) holding the same attribute
    objects (``weight_loader``, ``output_dim``...). ``_swap`` then moves class and ``__dict__`` onto
    ``old``'s object, so the user's references see them too."""
    _check_attribute_names(old, f"a {type(old).__name__}")
    cls = user_class(old)
    if cls is not None:
        # The user's __new__/__init__ may demand arguments (vLLM's weight_loader); bypass them,
        # as attributes are copied below anyway.
        if isinstance(new, OffloadedTensor):
            result = offloaded_class(cls)(new._host, new._master, old.requires_grad)
        else:
            result = torch.Tensor._make_subclass(cls, new, old.requires_grad)
    elif isinstance(old, nn.Parameter):
        result = nn.Parameter(new, requires_grad=old.requires_grad)
    else:
        result = new
    attrs = user_attrs(old)
    if attrs:
        result.__dict__.update(attrs)
    return result


def _offload_group(group, pager: Pager) -> None:
    first = group[0].tensor
    if isinstance(first, OffloadedTensor):
        first._master.move_to(pager)
        return
    for member in group:
        _check_offloadable(member.tensor, f"'{member.names[0]}'")
    lo, hi = _group_range(group)
    flat = first.detach().as_strided((hi - lo,), (1,), lo)
    host_flat = new_host_master(flat, pin=pins_host_memory(pager.device))
    master = _master_for(host_flat, pager)
    master.name = next((n for m in group for n in m.names), None)
    for member in group:
        t = member.tensor
        host = host_flat.as_strided(t.shape, t.stride(), t.storage_offset() - lo)
        _swap(member, _as_param_like(t, OffloadedTensor(host, master)))


def _make_resident(group, device: torch.device) -> None:
    first = group[0].tensor
    if isinstance(first, OffloadedTensor):
        host_group = [(m, m.tensor._host) for m in group]
        lo = min(covering_range(h)[0] for _, h in host_group)
        hi = max(covering_range(h)[1] for _, h in host_group)
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


def _resident_bytes(model: nn.Module, device: torch.device, skip=frozenset(), extra=()) -> int:
    """Device bytes held by the plain device tensors of ``model`` and of ``extra`` (modules being
    attached, tensors being placed), each storage once; ``skip``: (module, attribute) slots whose
    tensor is being replaced."""
    return sum(_resident_storages(model, device, skip, extra).values())


def _resident_storages(model: nn.Module, device: torch.device, skip=frozenset(), extra=()) -> dict:
    """Storage key -> bytes for the tensors ``_resident_bytes`` counts."""
    sources = [_tensors(model, skip), (t for _, _, t in _attribute_tensors(model))]
    sources += [_tensors(e, skip) if isinstance(e, nn.Module) else (e,) for e in extra]
    return _resident_storages_of(itertools.chain.from_iterable(sources), device)


def _storage_bytes(t: torch.Tensor):
    storage = t.untyped_storage()
    if storage.data_ptr():
        return storage.data_ptr(), storage.nbytes()
    return id(t), t.numel() * t.element_size()


def _attribute_tensors(model: nn.Module):
    """(module, name, tensor) for tensors held as plain attributes (not Parameters or buffers,
    which nn.Module keeps out of ``__dict__``): weights computed after loading, like vLLM's W_UV."""
    for module in model.modules():
        for name, t in module.__dict__.items():
            if isinstance(t, torch.Tensor) and not t.is_meta and t.layout == torch.strided:
                yield module, name, t


def _untracked_bytes(model: nn.Module, device: torch.device) -> int:
    """Device bytes of plain tensor attributes whose storage no Parameter or buffer shares."""
    weights = _resident_storages_of(_tensors(model), device)
    attributes = _resident_storages_of((t for _, _, t in _attribute_tensors(model)), device)
    return sum(n for key, n in attributes.items() if key not in weights)


def _resident_storages_of(tensors, device: torch.device) -> dict:
    storages = {}
    for t in tensors:
        if not isinstance(t, OffloadedTensor) and t.device == device and not t.is_meta:
            key, nbytes = _storage_bytes(t)
            storages[key] = nbytes
    return storages


def _tensors(model: nn.Module, skip=frozenset()):
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for attr, t in table.items():
                if t is not None and (not skip or (module, attr) not in skip):
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
    _check_wrappable(model, budget_gb, offload_gb)
    device = resolve_device(device)
    groups = _collect(model)
    for g in groups:
        for member in g:  # before anything moves, so a refusal leaves the model as it was
            _check_attribute_names(member.tensor, f"'{member.names[0]}'")
        t = g[0].tensor
        if not isinstance(t, OffloadedTensor) and t.is_meta:
            raise ValueError(
                f"offtensor: '{g[0].names[0]}' ({_group_bytes(g)} bytes) is on the meta device and has no values; "
                f"use ot.load_safetensors(model, path) for a model built on meta, or build it on cpu (torch.empty "
                f"weights take no memory until written) and load it after wrapping"
            )
    plan, by_weight = _plan(groups, device, budget_gb, offload_gb, policy, prefetch)
    pager = Pager(device, plan.budget_bytes)
    for w in plan.offload:
        _offload_group(by_weight[id(w)], pager)
    for w in plan.resident:
        _make_resident(by_weight[id(w)], device)
    _register(model, pager, plan, policy, prefetch)
    return model


def _check_wrappable(model, budget_gb, offload_gb) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"offtensor: expected an nn.Module, got {type(model).__name__}")
    if model in _WRAPPED:
        state = _WRAPPED[model]
        raise RuntimeError(
            f"offtensor: {type(model).__name__} is already wrapped (budget {state.pager.budget_bytes} bytes on "
            f"{state.pager.device}); call ot.unwrap_model(model) before wrapping it again"
        )
    if budget_gb is not None and offload_gb is not None:
        raise ValueError("offtensor: give budget_gb or offload_gb, not both")
    for label, value in (("budget_gb", budget_gb), ("offload_gb", offload_gb)):
        if value is not None and (
            not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0
        ):
            raise ValueError(f"offtensor: {label} must be a non-negative number of GiB, got {value!r}")


def _plan(groups, device, budget_gb, offload_gb, policy, prefetch):
    """The placement plan for these storage groups, and weight -> group."""
    weights = [_weight(g) for g in groups]
    budget_bytes = None if budget_gb is None else int(budget_gb * GiB)
    offload_bytes = None if offload_gb is None else int(offload_gb * GiB)
    names = [n for w in weights for n in w.names]
    for pattern, choice in placement.unmatched_patterns(policy, names):
        warnings.warn(
            f"offtensor: the policy's {choice!r} pattern {pattern!r} matches none of the model's {len(names)} tensor "
            f"names (such as {names[:3]}), so it decides nothing; patterns are fnmatch globs on full names like "
            f"'layers.0.mlp.weight' (a tensor assigned later is matched when it is placed)", UserWarning, stacklevel=3)
    total = _device_total_bytes(device) if budget_bytes is not None else None
    if total is not None and budget_bytes > total:
        memory = "GPU memory (torch.cuda.mem_get_info)" if device.type == "cuda" else "RAM on this machine"
        warnings.warn(
            f"offtensor: budget_gb={budget_gb} ({budget_bytes} bytes) is more than the {total} bytes "
            f"({total / GiB:.2f} GiB) of {memory} that {device} has: the budget cannot hold, and weights it lets stay "
            f"resident may not fit; give a budget below the device's memory", UserWarning, stacklevel=3)
    if budget_bytes is None and offload_bytes is None:
        budget_bytes = _free_device_bytes(device) - DEFAULT_MARGIN_BYTES
    already = {id(w) for w, g in zip(weights, groups) if isinstance(g[0].tensor, OffloadedTensor)}
    if already:
        # Tensors the user offloaded by hand stay offloaded.
        names = {n for w in weights if id(w) in already for n in w.names}

        def policy(name, _user=policy):
            return "offload" if name in names else placement._policy_choice(_user, [name])

    plan = placement.plan(weights, budget_bytes, offload_bytes, policy, prefetch)
    return plan, {id(w): g for w, g in zip(weights, groups)}


def _register(model: nn.Module, pager: Pager, plan: placement.Plan, policy, prefetch: bool) -> None:
    """Mark ``model`` as wrapped: its modules now place whatever is assigned into them."""
    state = _State(model, pager, plan, policy, prefetch)
    for module in model.modules():
        _WRAPPED[module] = state
        state.load_hooks.append(module.register_load_state_dict_post_hook(_after_load))
        state.load_hooks.append(module.register_state_dict_post_hook(_portable_state_dict))
    state.resident_ptrs = {
        t.untyped_storage().data_ptr()
        for t in _tensors(model)
        if not isinstance(t, OffloadedTensor) and t.device == pager.device and not t.is_meta
    }
    pager.budget.recount_resident(_resident_bytes(model, pager.device))
    pager.reset_stats()
    if prefetch and plan.offload:
        pager.prefetcher = Prefetcher()
    # Offloaded stacked experts: per-stack stats, expert-aware eviction, routing speculation.
    experts.attach(model, pager, speculate=prefetch)
    state.step_hook = model.register_forward_pre_hook(_StepHook(pager.device, plan.budget_bytes, policy, prefetch, pager))
    _install_hooks()


def unwrap_model(model: nn.Module) -> nn.Module:
    """Every weight back to a plain tensor on the device, keeping identities and ties."""
    state = _state(model)
    pager = state.pager
    pager.prefetcher = None
    experts.detach(pager)
    pager.clear()
    for group in _collect(model):
        if isinstance(group[0].tensor, OffloadedTensor):
            _make_resident(group, pager.device)
    for module in list(_WRAPPED.keys()):
        if _WRAPPED.get(module) is state:
            del _WRAPPED[module]
    for handle in state.load_hooks:
        handle.remove()
    state.load_hooks.clear()
    if state.step_hook is not None:
        state.step_hook.remove()
        state.step_hook = None
    pager.budget.recount_resident(_resident_bytes(model, pager.device))
    return model


def stats(model: nn.Module) -> OffloadStats:
    state = _state(model)
    if state.experts_stale:
        state.refresh_experts()
    state.pager.budget.recount_resident(_resident_bytes(model, state.pager.device))
    s = state.pager.snapshot()
    s.untracked_bytes = _untracked_bytes(model, state.pager.device)
    return s


def reset_stats(model: nn.Module) -> None:
    _state(model).pager.reset_stats()


def is_wrapped(model: nn.Module) -> bool:
    """Whether ``model`` is currently wrapped (by wrap_model or load_safetensors, or is a
    ``copy.deepcopy`` of a wrapped model, which this registers on its own pager)."""
    state = _WRAPPED.get(model)
    if state is None or state.model_ref() is not model:
        state = _adopt_copy(model) if isinstance(model, nn.Module) else None
    return state is not None and state.model_ref() is model


def _state(model: nn.Module) -> _State:
    if not is_wrapped(model):
        raise ValueError(f"offtensor: this {type(model).__name__} is not wrapped; call ot.wrap_model(model, ...) first")
    return _WRAPPED[model]


def _device_total_bytes(device: torch.device) -> Optional[int]:
    """All the memory of ``device`` (a GPU's total, the emulated device's: the machine's RAM), or
    None where it is not known (meta)."""
    try:
        if device.type == "cuda":
            return torch.cuda.mem_get_info(device)[1]
        if device.type == "cpu":
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (RuntimeError, ValueError, OSError):
        return None
    return None


def _free_device_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


# ---------------------------------------------------------------------------- re-placement


def _place(state: _State, module: nn.Module, name: str, t: torch.Tensor, is_buffer: bool, attaching=None):
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
        t._master.move_to(pager)
        return None
    if t.is_meta or t.layout != torch.strided:
        return None
    member = _Member(t)
    member.slots.append((module, name, is_buffer))
    placed = state.placement_of(t)
    if placed is not None:
        target = placed.target()
        if isinstance(target, OffloadedTensor):
            host = target._host.as_strided(t.shape, t.stride(), t.storage_offset() + placed.base)
            _swap(member, _as_param_like(t, OffloadedTensor(host, target._master)))
            return member.tensor
        if placed.view == (tuple(t.shape), t.stride(), t.storage_offset()) and target.device == pager.device:
            with torch.no_grad():
                t.data = target.detach()
            return None
    model = state.model_ref()
    if model is None:
        return None  # the wrapped model is gone; nothing left to account against
    extra, skip = attaching or ((), frozenset())
    skip = skip | {(module, name)}
    storages = _resident_storages(model, pager.device, skip, extra)
    resident = sum(storages.values())
    nbytes = t.numel() * t.element_size()
    moves = t.device != pager.device
    if moves:
        with_t = resident + nbytes
    else:
        # Already on the device: it may share storage with resident weights (a re-assigned tie).
        key, storage_bytes = _storage_bytes(t)
        with_t = resident + (0 if key in storages else storage_bytes)
    choice = placement._policy_choice(state.policy, [full_name])
    keep = choice == "keep" or (choice != "offload" and with_t + state.working_set_bytes <= pager.budget_bytes)
    if keep:
        if with_t > pager.budget_bytes:
            raise BudgetError(
                f"offtensor: keeping {full_name} ({nbytes} bytes) resident would put {with_t} bytes of "
                f"resident weights over the budget of {pager.budget_bytes} bytes; let the policy offload it "
                f"or raise budget_gb"
            )
        if moves:
            source = t.detach()
            with torch.no_grad():
                t.data = t.data.to(pager.device)
            state.remember(source, t)
        state.resident_ptrs.add(t.untyped_storage().data_ptr())
        pager.budget.hold_resident(with_t)
        return None
    _reserve_paging_room(state, full_name, t, resident)
    member.names.append(full_name)
    source = t.detach()
    _offload_group([member], pager)
    state.remember(source, member.tensor)
    pager.budget.recount_resident(resident)
    return member.tensor


def _reserve_paging_room(state: _State, full_name: str, t: torch.Tensor, resident: int, kind: str = "") -> None:
    """Before ``t`` is offloaded beside ``resident`` bytes of resident weights: make sure the budget
    can page it, whole or in tiles (dispatch computes linear, mm, bmm and conv ops on a weight larger
    than the room in output tiles), and reserve that working set."""
    pager = state.pager
    nbytes = _tensor_bytes(t)  # offloading keeps an expanded tensor's stride-0 layout
    ws = placement.working_set(full_name, tuple(t.shape), nbytes)
    for slices in (placement.TILE_ALIGN, 1):  # bit-identical tiles first (see tile_working_set)
        if resident + max(ws, state.working_set_bytes) > pager.budget_bytes:
            ws = placement.tile_working_set(tuple(t.shape), nbytes, ws, slices)
    if resident + max(ws, state.working_set_bytes) > pager.budget_bytes:
        raise BudgetError(
            f"offtensor: {kind}{full_name} ({nbytes} bytes) needs {ws} bytes on the device to be paged, but only "
            f"{pager.budget_bytes - resident} of the budget's {pager.budget_bytes} bytes are not resident "
            f"weights; raise budget_gb or offload more"
        )
    state.working_set_bytes = max(state.working_set_bytes, ws)


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
    old = module._modules.get(name)
    # Slots of the module being replaced stop counting, except those of its submodules that the new
    # one keeps (peft's LoRA layer holds the Linear it replaces as ``base_layer``): they stay resident.
    kept = set(submodule.modules())
    replaced = frozenset(
        (m, attr) for m in (old.modules() if old is not None else ()) if m not in kept
        for attr in (*m._parameters, *m._buffers)
    )
    parent = state.qualified_name(module, name)
    for path, child in submodule.named_modules(remove_duplicate=False):
        state.prefixes.setdefault(child, f"{parent}.{path}" if path else parent)
    placed = []
    for child in submodule.modules():
        if _WRAPPED.get(child) is state:
            continue
        _WRAPPED[child] = state
        state.load_hooks.append(child.register_load_state_dict_post_hook(_after_load))
        state.load_hooks.append(child.register_state_dict_post_hook(_portable_state_dict))
        for table, is_buffer in ((child._parameters, False), (child._buffers, True)):
            for attr, t in list(table.items()):
                if t is not None:
                    new = _place(state, child, attr, t, is_buffer, attaching=(tuple(placed), replaced))
                    if new is not None:
                        table[attr] = new
                    placed.append(table[attr])
    return None


class _StepHook:
    """Forward pre-hook of a wrapped model: one forward is one step of the prefetch schedule.

    It also carries the wrap's settings through ``copy.deepcopy``: the copy of a wrapped model
    holds a copy of this hook, and the first time the copy is used (``ot.stats``, a forward...)
    ``_adopt_copy`` gives it its own pager with the same budget, instead of leaving its new host
    masters charged to the original's pager."""

    __slots__ = ("device", "budget_bytes", "policy", "prefetch", "pager_ref", "pager_key", "copy_pager")

    def __init__(self, device, budget_bytes, policy, prefetch, pager=None, copy_pager=None):
        self.device, self.budget_bytes, self.policy, self.prefetch = device, budget_bytes, policy, prefetch
        self.pager_ref = weakref.ref(pager) if pager is not None else None
        # Under torch.compile the step is an op of the graph, keyed by this int (a constant to
        # Dynamo): looking the model up in _WRAPPED would make Dynamo guard on that table's
        # entries, which change as models come and go (compile.step_hook).
        self.pager_key = _compile.register_pager(pager) if pager is not None else None
        self.copy_pager = copy_pager  # a deepcopy's pager, until _adopt_copy registers it

    def __call__(self, model, args):
        if torch.compiler.is_compiling() and self.pager_key is not None:
            torch.ops.offtensor.new_step(self.pager_key)
            return
        state = _WRAPPED.get(model)
        if state is None or state.model_ref() is not model:
            state = _adopt_copy(model)
        if state is not None:
            if state.experts_stale:
                state.refresh_experts()
            state.pager.new_step()  # one pass of the prefetch schedule and of the expert statistics

    def __reduce__(self):
        # torch.save(model) of a wrapped model: the loaded model is adopted like a deepcopy (a
        # callable policy may not pickle; patterns do).
        return _StepHook, (self.device, self.budget_bytes, None if callable(self.policy) else self.policy, self.prefetch)

    def __deepcopy__(self, memo):
        pager = Pager(self.device, self.budget_bytes)
        original = self.pager_ref() if self.pager_ref is not None else None
        if original is not None:
            # OffloadedTensor.__deepcopy__ charges the new host masters to this pager, not the original's.
            memo[("offtensor.pager", id(original))] = pager
        return _StepHook(self.device, self.budget_bytes, self.policy, self.prefetch, copy_pager=pager)


def _adopt_copy(model: nn.Module) -> Optional[_State]:
    """Register a ``copy.deepcopy`` of a wrapped model as wrapped on its own pager; None when
    ``model`` holds no copied step hook (it was never a wrapped model)."""
    hooks = [(key, h) for key, h in model._forward_pre_hooks.items() if isinstance(h, _StepHook)]
    if not hooks:
        return None
    hook = hooks[0][1]
    for module in model.modules():
        # The copy's modules carry copies of the original's hooks; _register adds its own.
        for key in [k for k, h in module._load_state_dict_post_hooks.items() if h is _after_load]:
            del module._load_state_dict_post_hooks[key]
        for key in [k for k, h in module._state_dict_hooks.items() if h is _portable_state_dict]:
            del module._state_dict_hooks[key]
        if _WRAPPED.get(module) is not None:
            del _WRAPPED[module]
    for key, _ in hooks:
        del model._forward_pre_hooks[key]
    pager = hook.copy_pager or Pager(hook.device, hook.budget_bytes)
    hook.copy_pager = None
    offloaded = 0
    groups = _collect(model)
    for group in groups:
        if isinstance(group[0].tensor, OffloadedTensor):
            group[0].tensor._master.move_to(pager)
            offloaded += group[0].tensor._master.nbytes
    weights = [_weight(g) for g in groups]
    offload = [w for w, g in zip(weights, groups) if isinstance(g[0].tensor, OffloadedTensor)]
    resident = [w for w, g in zip(weights, groups) if not isinstance(g[0].tensor, OffloadedTensor)]
    ws = placement.plan(offload, None, offload_bytes=0, policy=lambda name: "offload", prefetch=False).working_set_bytes
    plan = placement.Plan(offload, resident, hook.budget_bytes, _resident_bytes(model, pager.device), offloaded, ws)
    _register(model, pager, plan, hook.policy, hook.prefetch)
    return _WRAPPED[model]


def _after_load(module, incompatible_keys):
    """load_state_dict post-hook. With ``torch.__future__.set_swap_module_params_on_conversion``
    load_state_dict swaps loaded values into the existing Parameter objects, so no registration
    hook sees them; place what this module now holds unless it is on the device within budget."""
    state = _WRAPPED.get(module)
    model = state.model_ref() if state is not None else None
    if model is None:
        return
    pager = state.pager
    plain = [
        (table, attr, is_buffer, t)
        for table, is_buffer in ((module._parameters, False), (module._buffers, True))
        for attr, t in table.items()
        if t is not None and not isinstance(t, OffloadedTensor) and not t.is_meta and t.layout == torch.strided
    ]
    if all(t.device == pager.device and t.untyped_storage().data_ptr() in state.resident_ptrs for *_, t in plain):
        return  # values were copied into the weights already placed (the usual load_state_dict)
    resident = _resident_bytes(model, pager.device)
    if all(t.device == pager.device for *_, t in plain) and resident + state.working_set_bytes <= pager.budget_bytes:
        pager.budget.recount_resident(resident)
        return
    # Tensors of this module not placed yet do not count as resident while their siblings are placed.
    pending = {(module, attr) for _, attr, _, _ in plain}
    for table, attr, is_buffer, t in plain:
        pending.discard((module, attr))
        new = _place(state, module, attr, t, is_buffer, attaching=((), frozenset(pending)))
        if new is not None:
            table[attr] = new


def _portable_state_dict(module, state_dict, prefix, local_metadata) -> None:
    """state_dict post-hook: the OffloadedTensors this module put in ``state_dict`` (detached views
    of its weights, so ``load_state_dict`` and in-place writes through them still reach the
    masters) are marked to pickle as the plain CPU tensors they hold. ``torch.save(model.state_dict())``
    then writes a file any process loads with ``torch.load(weights_only=True)``, offtensor or
    not, each tie once, with nothing paged. ``keep_vars=True`` values are the Parameters
    themselves and keep their class when pickled, as a Parameter saved on its own does."""
    for table in (module._parameters, module._buffers):
        for name, t in table.items():
            value = state_dict.get(prefix + name)
            if value is not t and isinstance(value, OffloadedTensor):
                value.__dict__["_portable"] = True


def _place_attribute(state: _State, module: nn.Module, name: str, t: torch.Tensor) -> None:
    """A tensor assigned to a wrapped module as a plain attribute (``self.W_UV = ...`` after
    loading): counted as resident when it is on the device and fits beside the resident weights and
    the room paging needs, else offloaded in place (the object stays; its device memory is freed)
    like a parameter that does not fit. Tensors elsewhere (a CPU mask on a GPU run) hold no device
    bytes and are left alone."""
    pager = state.pager
    model = state.model_ref()
    if model is None:
        return
    if isinstance(t, OffloadedTensor):
        t._master.move_to(pager)
        return
    nbytes = t.numel() * t.element_size()
    if t.device != pager.device or nbytes < placement.SMALL_BYTES:
        # Small attributes (often set during forward) are counted by the next recount (ot.stats,
        # a registration) rather than walking the model on every assignment.
        return
    resident = _resident_bytes(model, pager.device)  # with t counted, once per storage
    full_name = state.qualified_name(module, name)
    choice = placement._policy_choice(state.policy, [full_name])
    keep = choice == "keep" or (
        choice != "offload" and resident + state.working_set_bytes <= pager.budget_bytes
    )
    shares_a_weight = _storage_bytes(t)[0] in _resident_storages_of(_tensors(model), pager.device)
    if keep or shares_a_weight or not _check_offloadable_quietly(t):
        pager.budget.hold_resident(resident)
        return
    without_t = resident - _storage_bytes(t)[1]
    _reserve_paging_room(state, full_name, t, without_t, kind="the attribute ")
    member = _Member(t)
    member.slots.append((module, name, None))
    member.names.append(full_name)
    _offload_group([member], pager)
    pager.budget.recount_resident(_resident_bytes(model, pager.device))


def _check_offloadable_quietly(t: torch.Tensor) -> bool:
    try:
        _check_offloadable(t, "attribute")
    except (TypeError, ValueError, RuntimeError):
        return False
    return True


_module_setattr = nn.Module.__setattr__
_module_delattr = nn.Module.__delattr__


def _setattr(module, name, value):
    """nn.Module.__setattr__, plus placement of plain tensor attributes of wrapped modules (no
    registration hook sees those) and a recount when a weight or submodule is set to None."""
    state = _WRAPPED.get(module) if _WRAPPED else None
    if state is None:
        return _module_setattr(module, name, value)
    # Only a weight, submodule or tensor attribute set to None releases bytes (forwards set other
    # attributes to None often; a recount walks the model).
    releases = value is None and (
        module._modules.get(name) is not None
        or module._parameters.get(name) is not None
        or module._buffers.get(name) is not None
        or isinstance(module.__dict__.get(name), torch.Tensor)
    )
    old = module._modules.get(name) if releases else None
    _module_setattr(module, name, value)
    if isinstance(value, torch.Tensor) and module.__dict__.get(name) is value:
        _place_attribute(state, module, name, value)
    elif releases:
        _released(state, old)


def _delattr(module, name):
    """nn.Module.__delattr__, plus releasing a deleted submodule's or weight's bytes at once:
    resident bytes are recounted, and the submodule no longer places what is assigned into it."""
    state = _WRAPPED.get(module) if _WRAPPED else None
    old = module._modules.get(name) if state is not None else None
    _module_delattr(module, name)
    if state is not None:
        _released(state, old)


def _released(state: _State, old: Optional[nn.Module] = None) -> None:
    model = state.model_ref()
    if model is None:
        return
    if old is not None:
        live = set(model.modules())
        for m in old.modules():
            if m not in live and _WRAPPED.get(m) is state:
                del _WRAPPED[m]
    state.pager.budget.recount_resident(_resident_bytes(model, state.pager.device))
    if state.pager.experts is not None:
        state.experts_stale = True  # a registered stack may be what was deleted


def _install_hooks() -> None:
    if _hooks:
        return
    # No hook exists for plain attributes or deletions: every wrapped model needs them seen, so
    # nn.Module's own methods are extended once (they do nothing more for unwrapped modules).
    nn.Module.__setattr__ = _setattr
    nn.Module.__delattr__ = _delattr
    from torch.nn.modules import module as module_mod

    _hooks.append(module_mod.register_module_parameter_registration_hook(_param_hook))
    _hooks.append(module_mod.register_module_buffer_registration_hook(_buffer_hook))
    _hooks.append(module_mod.register_module_module_registration_hook(_module_hook))
