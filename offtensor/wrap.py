"""wrap_model / unwrap_model: turn a model's weights into resident device tensors and
OffloadedTensors for a budget, in place, keeping every Parameter object and every tie.

A model's tensors are collected by identity and by storage: a Parameter registered under several
names (tied embedding and lm_head) or several Parameters viewing one storage become views of one
host master, and each Parameter object is swapped in place (``torch.utils.swap_tensors``) so the
modules, the optimizer and the user's own references all see the new tensor.

Which tensors go is ``placement``'s decision (``choose_model_placement``); this module carries it
out (``apply_placement``, which ``load_safetensors`` calls too once its bytes are read).

After wrapping, every module of the model takes a subclass of its own class, made once per class
(``_wrapping_class``): its ``__setattr__``, ``__delattr__``, ``register_parameter``,
``register_buffer`` and ``add_module`` place any parameter, buffer, submodule or plain tensor
attribute assigned into the model (post-load rewrites, quantisation repacking,
``load_state_dict(assign=True)``) under the same budget instead of letting it land on the device
unaccounted. Nothing outside the wrapped model changes: ``nn.Module`` and torch's global hooks are
left alone, and ``unwrap_model`` gives every module its own class back.
"""

from __future__ import annotations

import contextlib
import copyreg
import itertools
import threading
import warnings
import weakref
from typing import Optional

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from . import moe
from . import leaves
from . import placement
from .config import OffloadConfig
from .ops import compile as _compile
from .pager import BudgetError, OffloadStats, Pager, covering_range, pins_host_memory, resolve_device
from .placement import Member, ModelPlacement, StorageGroup
from .prefetch import Prefetcher
from .pager import master_for
from .tensor import (
    OWN_ATTRS, OffloadedTensor, check_offloadable, guard_data_ptr, new_host_master, offloaded_class, user_attrs,
    user_class,
)

# Every submodule of a wrapped model -> the model's state, read by the wrapping classes' methods.
_WRAPPED: "weakref.WeakKeyDictionary[nn.Module, _State]" = weakref.WeakKeyDictionary()

# timeline's routing tools (RoutingRecorder, routing_stats_of, meta_twin, sync_twin, decode_example,
# faster_expert_placement): the expert placement is decided by its replay. timeline imports this
# module (it records wrapped models), so it hands them over at import instead of being imported here.
_routing_tools = None


def use_routing_tools(tools) -> None:
    global _routing_tools
    _routing_tools = tools


class _Placed:
    """Where a tensor assigned after wrapping went, keyed by the storage it came from, so that a
    second tensor over that storage (``load_state_dict(assign=True)`` wraps each key of a tied pair
    in its own Parameter) becomes a view of the same placement instead of a second copy.

    It holds no reference to the placed tensor object itself, not even a weak one: torch's
    ``swap_tensors`` (``Module.to`` under ``set_swap_module_params_on_conversion``, and for every
    wrapper-subclass parameter, as peft's ``module.to(weight.device)`` does) refuses a tensor with
    weak references. An offloaded placement is found again through its host master (weakly held;
    it dies with its last view), a resident one through the module slot it was registered in."""

    __slots__ = ("source", "master", "slot", "ptr", "dtype", "lo", "hi", "view", "base")

    def __init__(self, source: torch.Tensor, target: torch.Tensor, module: nn.Module, name: str):
        self.source = StorageWeakRef(source.untyped_storage())
        self.dtype = source.dtype
        self.lo, self.hi = covering_range(source)
        self.view = (tuple(source.shape), source.stride(), source.storage_offset())
        if isinstance(target, OffloadedTensor):
            self.master, self.slot, self.ptr = weakref.ref(target._master), None, 0
            # target storage offset - source storage offset, the same for every element of [lo, hi)
            self.base = target._host.storage_offset() - source.storage_offset()
        else:
            self.master, self.slot, self.base = None, (weakref.ref(module), name), 0
            self.ptr = target.untyped_storage().data_ptr()

    def offloaded_view(self, t: torch.Tensor) -> Optional[OffloadedTensor]:
        """``t`` (a view of the source storage) as a view of the offloaded placement, or None."""
        master = self.master() if self.master is not None else None
        if master is None or master.flat is None:
            return None
        host = torch.empty(0, dtype=t.dtype).set_(master.flat.untyped_storage(), t.storage_offset() + self.base,
                                                  t.shape, t.stride())
        return OffloadedTensor(host, master)

    def resident(self) -> Optional[torch.Tensor]:
        """The resident placement, while its slot still holds a tensor over the placed storage."""
        if self.slot is None:
            return None
        module = self.slot[0]()
        t = None if module is None else _slot_tensor(module, self.slot[1])
        if (t is None or isinstance(t, OffloadedTensor) or not leaves.is_leaf(t)  # a subclass: its leaves' slot
                or t.untyped_storage().data_ptr() != self.ptr):
            return None
        return t

    def alive(self) -> bool:
        if self.source.expired():
            return False
        return self.master() is not None if self.master is not None else self.resident() is not None


def _slot_tensor(module: nn.Module, name: str) -> Optional[torch.Tensor]:
    for table in (module._parameters, module._buffers, module.__dict__):
        t = table.get(name)
        if isinstance(t, torch.Tensor):
            return t
    return None


class _State:
    def __init__(self, model, pager: Pager, choice: placement.Placement, config: OffloadConfig):
        self.model_ref = weakref.ref(model)
        self.pager = pager
        self.config = config
        self.working_set_bytes = choice.working_set_bytes
        self.choice = choice
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
        # (module, attribute) slots that ``on_host`` lent a host stand-in: not resident weights.
        self.lent_slots: frozenset = frozenset()
        # How the routed experts were placed and why (``ot.stats(model).expert_placement``), and
        # the _PlacementWatch while that is still to be decided from the model's own routing.
        self.expert_placement: Optional[dict] = None
        self.watch = None

    def refresh_experts(self) -> None:
        self.experts_stale = False
        model = self.model_ref()
        if model is not None:
            moe.detach(self.pager)
            moe.attach(model, self.pager, speculate=self.config.prefetch)

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

    def remember(self, source: torch.Tensor, target: torch.Tensor, module: nn.Module, name: str) -> None:
        self.placed[source.untyped_storage()._cdata] = _Placed(source, target, module, name)

    def placement_of(self, t: torch.Tensor):
        """The tensor that an earlier placement of ``t``'s storage produced, if ``t`` lies inside it."""
        for key in [k for k, p in self.placed.items() if not p.alive()]:
            del self.placed[key]
        placed = self.placed.get(t.untyped_storage()._cdata)
        if placed is None or placed.dtype != t.dtype or not t.numel():
            return None
        lo, hi = covering_range(t)
        if lo < placed.lo or hi > placed.hi:
            return None
        return placed


# ---------------------------------------------------------------------------- undoing a placement


class _Undo:
    """What ``apply_placement`` changed so far, newest last, so that a failure at any step (an
    allocation, a read, a registration) puts the model back exactly as it was: the same tensor
    objects with the same classes, attributes and storages, masters on their old pagers. Until the
    placement completes, the record keeps the original tensors alive (the price of an exact undo:
    for a wrap of a host model, its offloaded bytes are held twice until ``wrap_model`` returns);
    dropping the record after an undo frees what the placement allocated."""

    _active = threading.local()  # the record of the placement running in this thread, if any

    def __init__(self):
        self.steps = []

    @classmethod
    def note(cls, *step) -> None:
        record = getattr(cls._active, "record", None)
        if record is not None:
            record.steps.append(step)

    def __enter__(self):
        _Undo._active.record = self
        return self

    def __exit__(self, kind, error, tb):
        _Undo._active.record = None
        if kind is not None:
            self.roll_back()
        self.steps.clear()  # a failure's traceback holds this frame: the new tensors go now
        return False

    def roll_back(self) -> None:
        for step in reversed(self.steps):
            what, *args = step
            if what == "swapped":  # swap_tensors exchanged the contents: exchange them back
                member, new = args
                _swap(member, new)
            elif what == "slots":  # the slots took the new object: give them the old one
                member, old = args
                for module, attr, is_buffer in member.slots:
                    if is_buffer is None:
                        module.__dict__[attr] = old
                    else:
                        (module._buffers if is_buffer else module._parameters)[attr] = old
                member.tensor = old
            elif what == "data":
                t, data = args
                t.data = data
            elif what == "moved":
                master, pager = args
                if pager is not None:
                    master.move_to(pager)


# ---------------------------------------------------------------------------- moving tensors


def _swap(member: Member, new: torch.Tensor) -> None:
    """Make ``member.tensor`` become ``new`` in place, so its identity survives; if PyTorch refuses
    (other C++ references exist), register ``new`` in every slot instead."""
    old = member.tensor
    if member.owners:
        _swap_leaf(member, new)
        return
    # nn.LSTM/GRU/RNN keep weak references to their weights (to notice a re-assigned weight), and
    # swap_tensors refuses a tensor with weak references: drop them for the swap and point them at
    # the same objects afterwards, so the modules see no change of weights.
    rnns = [m for m, _, _ in member.slots if isinstance(m, nn.RNNBase) and getattr(m, "_flat_weight_refs", None)]
    for rnn in rnns:
        rnn._flat_weight_refs = []
    try:
        torch.utils.swap_tensors(old, new)
        _Undo.note("swapped", member, new)  # ``new`` now holds the old contents
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
    _Undo.note("slots", member, old)
    member.tensor = new


def _swap_leaf(member: Member, new: torch.Tensor) -> None:
    """A leaf of a wrapper subclass (a DTensor's local shard...) becomes ``new`` in every outer
    tensor holding it; the outer objects, registered in the modules, stay as they are."""
    old = member.tensor
    if new.requires_grad != old.requires_grad:
        new.requires_grad_(old.requires_grad)  # DTensor keeps its local shard's flag equal to its own
    for owner, attr in member.owners:
        leaves.replace_leaf(owner, attr, new)
    member.tensor = new


def _check_attribute_names(t: torch.Tensor, what: str) -> None:
    clash = sorted(OWN_ATTRS & t.__dict__.keys()) if not isinstance(t, OffloadedTensor) else ()
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
    return guard_data_ptr(result) if isinstance(result, OffloadedTensor) else result


def _offload_group(group: StorageGroup, pager: Pager) -> None:
    first = group[0].tensor
    if isinstance(first, OffloadedTensor):
        _Undo.note("moved", first._master, first._master.pager)
        first._master.move_to(pager)
        return
    for member in group:
        check_offloadable(member.tensor, f"'{member.names[0]}'")
    lo, hi = group.element_range()
    flat = first.detach().as_strided((hi - lo,), (1,), lo)
    host_flat = new_host_master(flat, pin=pins_host_memory(pager.device))
    master = master_for(host_flat, pager)
    master.name = next((n for m in group for n in m.names), None)
    for member in group:
        t = member.tensor
        host = host_flat.as_strided(t.shape, t.stride(), t.storage_offset() - lo)
        _swap(member, _as_param_like(t, OffloadedTensor(host, master)))


def _make_resident(group: StorageGroup, device: torch.device) -> None:
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
            f"offtensor: '{group[0].names[0]}' ({group.nbytes} bytes) is on the meta device and has no values; "
            f"load its weights first (ot.load_safetensors) or build the model on cpu"
        )
    lo, hi = group.element_range()
    flat = first.detach().as_strided((hi - lo,), (1,), lo).to(device)
    for member in group:
        t = member.tensor
        _Undo.note("data", t, t.data)
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
    for t in itertools.chain.from_iterable(map(leaves.leaf_tensors, tensors)):  # a subclass holds its leaves' bytes
        if not isinstance(t, OffloadedTensor) and t.device == device and not t.is_meta:
            key, nbytes = _storage_bytes(t)
            storages[key] = nbytes
    return storages


def _tensors(model: nn.Module, skip=frozenset()):
    """The plain tensors holding ``model``'s parameters and buffers: each registered tensor, or
    the leaves of one that is a wrapper subclass (a DTensor's local shard)."""
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for attr, t in table.items():
                if t is not None and (not skip or (module, attr) not in skip):
                    if leaves.is_leaf(t):
                        yield t
                    else:
                        yield from leaves.leaf_tensors(t)


# ---------------------------------------------------------------------------- public API


def wrap_model(model: nn.Module, budget_gb: Optional[float] = None, *, device=None, offload_gb: Optional[float] = None,
               prefetch: bool = True, policy=None, routing=None) -> nn.Module:
    """Place ``model``'s weights for a device budget, in place; returns ``model``.

    Weights that fit stay plain device tensors; the rest become OffloadedTensors paged per op.
    ``budget_gb`` (GiB) caps resident weights + paged copies + prefetches; ``offload_gb`` instead
    offloads at least that many GiB (vLLM's ``cpu_offload_gb``). With neither, the budget is the
    free device memory minus a margin for activations. The arguments make an ``OffloadConfig``.

    MoE models: whether whole expert stacks stay resident or every stack is paged through the
    expert cache is decided by a replay of both (``timeline.plan_expert_paging``), once: at wrap
    time under ``routing`` (``moe.RoutingStats``, a recorded trace or a path to a saved one),
    else from the model's own first ``OffloadConfig.routing_warmup`` routed tokens, re-placing
    the experts if paging them all is faster. ``ot.stats(model).expert_placement`` says which was
    chosen, when, and both replayed step times. A ``policy`` decides instead.
    """
    check_wrappable(model)
    config = OffloadConfig.from_arguments(budget_gb=budget_gb, offload_gb=offload_gb, device=device,
                                          prefetch=prefetch, policy=policy, routing=routing)
    device = resolve_device(config.device)
    groups = placement.collect_groups(model)
    for g in groups:
        for member in g:  # before anything moves, so a refusal leaves the model as it was
            _check_attribute_names(member.tensor, f"'{member.names[0]}'")
        t = g[0].tensor
        if not isinstance(t, OffloadedTensor) and t.is_meta:
            raise ValueError(
                f"offtensor: '{g[0].names[0]}' ({g.nbytes} bytes) is on the meta device and has no values; "
                f"use ot.load_safetensors(model, path) for a model built on meta, or build it on cpu (torch.empty "
                f"weights take no memory until written) and load it after wrapping"
            )
    placed = placement.choose_model_placement(groups, config, device)
    placed, config, report, watch = choose_expert_placement(model, groups, placed, config, device)
    pager = Pager(device, placed.budget_bytes, strict=config.strict)
    return apply_placement(model, placed, pager, config, expert=(report, watch))


def check_wrappable(model) -> None:
    """Refuse what ``wrap_model`` and ``load_safetensors`` cannot take: not a module, or wrapped already."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"offtensor: expected an nn.Module, got {type(model).__name__}")
    if model in _WRAPPED:
        state = _WRAPPED[model]
        raise RuntimeError(
            f"offtensor: {type(model).__name__} is already wrapped (budget {state.pager.budget_bytes} bytes on "
            f"{state.pager.device}); call ot.unwrap_model(model) before wrapping it again"
        )


def apply_placement(model: nn.Module, placed: ModelPlacement, pager: Pager, config: OffloadConfig,
                    loaded: Optional[dict] = None, expert: Optional[tuple] = None) -> nn.Module:
    """Make ``model``'s tensors what ``placed`` chose, on ``pager``, and mark the model wrapped.

    ``loaded``: id(member) -> the tensor a loader already filled for it (a view of a host master on
    ``pager``, or a device tensor), for every member of the groups it read: those members become
    these tensors (same Parameter objects); the other groups are offloaded or moved to the device.

    Atomic: what cannot be offloaded is refused before anything moves, and a failure at any later
    step (an allocation, a read, a registration) undoes every step before it (``_Undo``) and frees
    what they allocated, so the model is exactly as it was and not registered as wrapped.

    ``expert``: the (report, watch) of ``choose_expert_placement``, which chose ``placed``'s
    expert placement (wrap_model and the loaders decide before anything is placed or read)."""
    loaded = loaded if loaded is not None else {}
    for group in placed.offloaded:
        if id(group[0]) not in loaded and not isinstance(group[0].tensor, OffloadedTensor):
            for member in group:
                check_offloadable(member.tensor, f"'{member.names[0]}'")
    try:
        with _Undo():
            for group in placed.offloaded + placed.resident:
                if id(group[0]) in loaded:
                    for member in group:
                        _swap(member, _as_param_like(member.tensor, loaded[id(member)]))
                elif placed.offloads(group):
                    _offload_group(group, pager)  # for a load: not in the files, has values (a buffer made at init)
                else:
                    _make_resident(group, pager.device)
            _register(model, pager, placed.choice, config)
    except BaseException:
        loaded.clear()  # the loader's destinations: freed now, not when the traceback goes
        raise
    if expert is not None:
        _start_expert_placement(model, *expert)
    return model


def _start_expert_placement(model: nn.Module, report: Optional[dict], watch) -> None:
    state = _WRAPPED[model]
    state.expert_placement = report
    if watch is not None:
        watch.start(state, model)


def _register(model: nn.Module, pager: Pager, choice: placement.Placement, config: OffloadConfig) -> None:
    """Mark ``model`` as wrapped: its modules now place whatever is assigned into them."""
    config = config.replace(device=pager.device)
    state = _State(model, pager, choice, config)
    try:
        _register_state(model, pager, choice, config, state)
    except BaseException:
        _unregister(model, state)
        raise


def _register_state(model: nn.Module, pager: Pager, choice: placement.Placement, config: OffloadConfig,
                    state: _State) -> None:
    for module in model.modules():
        _enter(module, state)
    state.resident_ptrs = {
        t.untyped_storage().data_ptr()
        for t in _tensors(model)
        if not isinstance(t, OffloadedTensor) and t.device == pager.device and not t.is_meta
    }
    pager.recount_resident(_resident_bytes(model, pager.device))
    pager.reset_stats()
    if config.prefetch and choice.offload:
        pager.prefetcher = Prefetcher()
    # Offloaded stacked experts: per-stack stats, expert-aware eviction, routing speculation.
    moe.attach(model, pager, speculate=config.prefetch)
    state.step_hook = model.register_forward_pre_hook(_StepHook(config, choice.budget_bytes, pager))


def _unregister(model: nn.Module, state: _State) -> None:
    """Undo ``_register`` (a failed registration; the end of ``unwrap_model``): every module of
    ``state`` gets its own class back, the hooks go, the pager's observers are dropped."""
    pager = state.pager
    pager.prefetcher = None
    moe.detach(pager)
    for module in list(_WRAPPED.keys()):
        if _WRAPPED.get(module) is state:
            _leave(module)
    if state.watch is not None:
        state.watch.stop()
        state.watch = None
    for handle in state.load_hooks:
        handle.remove()
    state.load_hooks.clear()
    if state.step_hook is not None:
        state.step_hook.remove()
        state.step_hook = None


def _enter(module: nn.Module, state: _State) -> None:
    """``module`` joins a wrapped model: it places what is assigned into it and what it loads."""
    _WRAPPED[module] = state
    state.load_hooks.append(module.register_load_state_dict_post_hook(_after_load))
    state.load_hooks.append(module.register_state_dict_post_hook(_portable_state_dict))
    _give_wrapping_class(module)


def _leave(module: nn.Module) -> None:
    """``module`` is no longer part of a wrapped model: its own class back, no placement."""
    del _WRAPPED[module]
    _give_user_class(module)


def unwrap_model(model: nn.Module) -> nn.Module:
    """Every weight back to a plain tensor on the device, keeping identities and ties. Under the
    pager's lock: an op of another thread's forward finishes first, and its next op reads the
    plain weights, which hold the same values."""
    state = _state(model)
    with state.pager.lock:
        return _unwrap(model, state)


def _unwrap(model: nn.Module, state: "_State") -> nn.Module:
    pager = state.pager
    pager.prefetcher = None
    moe.detach(pager)
    pager.clear()
    for group in placement.collect_groups(model):
        if group.is_offloaded:
            _make_resident(group, pager.device)
    _unregister(model, state)
    # The model's weights are no longer this pager's: what it still pages (a view of a master taken
    # before unwrapping, an op of another thread's forward dispatched before the swap) pages within
    # the budget beside no resident weights, instead of failing beside weights it no longer holds.
    pager.recount_resident(0)
    return model


def stats(model: nn.Module) -> OffloadStats:
    state = _state(model)
    with state.pager.lock:
        if state.experts_stale:
            state.refresh_experts()
        state.pager.recount_resident(_resident_bytes(model, state.pager.device))
        s = state.pager.snapshot()
        s.untracked_bytes = _untracked_bytes(model, state.pager.device)
        s.expert_placement = dict(state.expert_placement) if state.expert_placement is not None else None
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


def pager_of(model: nn.Module) -> Optional[Pager]:
    """The pager of the wrapped model that ``model`` is (or is a module of), or None."""
    state = _WRAPPED.get(model)
    return state.pager if state is not None else None


def _state(model: nn.Module) -> _State:
    if not is_wrapped(model):
        raise ValueError(f"offtensor: this {type(model).__name__} is not wrapped; call ot.wrap_model(model, ...) first")
    return _WRAPPED[model]


# ---------------------------------------------------------------------------- expert placement
#
# The default placement keeps whole expert stacks resident as far as the budget holds them and
# pages the rest; the other one pages every stack through the expert cache
# (``placement.EXPERTS_PAGED``). Skewed routing with token-to-token reuse favours the second (the
# cache keeps each layer's hot experts; a resident stack holds its cold ones too), uniform routing
# the first. Which one is decided once, by timeline's replay of both, never by a flag, and never
# undone: a second decision could undo the first on a few tokens' noise.


def choose_expert_placement(model: nn.Module, groups: list, placed: ModelPlacement, config: OffloadConfig,
                             device: torch.device):
    """The expert placement at wrap time: (placement, config, report, watch). ``watch`` is a
    ``_PlacementWatch`` when the decision waits for the model's own routing (or, for a model
    that is not a transformers language model, for a forward to plan a step of)."""
    stacks = [g for g in groups if placement.is_expert_stack(g)]
    if not stacks:
        if config.routing is not None:
            raise ValueError(
                f"offtensor: routing= was given, but {type(model).__name__} has no routed expert stacks (tensors of "
                f"3 or more dims under an 'experts' module, such as 'layers.0.mlp.experts.down_proj') whose placement "
                f"it could decide; leave routing out for a dense model")
        return placed, config, None, None
    tools = _routing_tools
    num_experts = max(g.tensor.shape[0] for g in stacks)
    # A bad routing= fails here, before anything moves (with a policy too: it is still a mistake).
    stats = tools.routing_stats_of(config.routing, num_experts) if config.routing is not None else None
    if config.policy is not None:
        why = "the policy given to wrap_model places the experts" + (
            "; routing= is not used" if config.routing is not None else "")
        return placed, config, {"chosen": "policy", "why": why}, None
    if not placement.expert_placement_open(placed):
        why = ("every weight stays resident" if not placed.offloaded
               else "the budget offloads every expert stack either way")
        return placed, config, {"chosen": "default", "why": why}, None
    if stats is None and config.routing_warmup == 0:
        return placed, config, {"chosen": "default", "why": "routing_warmup=0: no decision by measured routing"}, None
    twin = tools.meta_twin(model)
    example = tools.decode_example(model)
    if stats is None or example is None:
        why = (f"to be decided after {config.routing_warmup} routed tokens" if stats is None
               else "to be decided at the first forward (its inputs give the planned step)")
        return placed, config, {"chosen": "default", "why": why}, _PlacementWatch(twin, stats)
    report = _replay_expert_placement(twin, placed.budget_bytes, example, stats, config, "at wrap time, by routing=")
    if report["chosen"] == "all_paged":
        config = config.replace(policy=placement.EXPERTS_PAGED)
        placed = placement.choose_model_placement(groups, _pinned(config, placed.budget_bytes), device)
    return placed, config, report, None


def _pinned(config: OffloadConfig, budget_bytes: int) -> OffloadConfig:
    """``config`` at exactly ``budget_bytes`` (the default placement's budget; exact: a power-of-2 division)."""
    return config.replace(budget_gb=budget_bytes / placement.GiB, offload_gb=None)


def _replay_expert_placement(twin: nn.Module, budget_bytes: int, example, stats, config: OffloadConfig,
                             when: str) -> dict:
    """The report of timeline's replay of both placements; the default, with the reason, if the
    replay cannot run (a model whose forward does not run on meta)."""
    try:
        report = _routing_tools.faster_expert_placement(twin, budget_bytes, example, stats,
                                                        config.placement_profile, config.prefetch)
    except Exception as e:  # noqa: BLE001 - whatever stops the plan, the model runs on as placed
        warnings.warn(f"offtensor: the expert placement stays the default: its replay failed "
                      f"({type(e).__name__}: {e})", UserWarning, stacklevel=4)
        return {"chosen": "default", "why": f"the replay failed: {type(e).__name__}: {e}", "decided": when}
    report.pop("policy", None)
    report["decided"] = when
    faster = "every stack paged" if report["chosen"] == "all_paged" else "the default placement"
    report["why"] = (f"{faster} replays faster: {report['default_step_ms']:.3f} ms/step default, "
                     f"{report['all_paged_step_ms']:.3f} ms/step all paged ({report['profile']})")
    return report


class _PlacementWatch:
    """Forward pre-hook of a wrapped MoE model whose expert placement is still open. With
    ``stats`` None it records the model's routing (``moe.RoutingRecorder``) and, at the first
    forward after ``routing_warmup`` routed tokens, before that forward pages anything, replays
    both placements under it and re-places the experts if paging every stack is faster. Then it
    removes itself: the decision is taken once. A copy of the model (deepcopy, pickle) keeps the
    placement it was copied with and decides nothing."""

    def __init__(self, twin: Optional[nn.Module] = None, stats=None):
        self.twin, self.stats = twin, stats
        self.recorder = None
        self.handle = None

    def start(self, state: _State, model: nn.Module) -> None:
        if self.stats is None:
            self.recorder = _routing_tools.RoutingRecorder(model, state.config.routing_warmup)
            if not self.recorder.hooks:
                self.stop()
                state.expert_placement = {"chosen": "default", "why": "no router of the expert stacks was found (a "
                                          "'gate' or 'router' with a [num_experts, hidden] weight and a known top-k)"}
                return
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True, prepend=True)
        state.watch = self

    def __call__(self, model, args, kwargs):
        if torch.compiler.is_compiling():
            return None
        state = _WRAPPED.get(model)
        if state is None or state.watch is not self:
            return None
        if self.recorder is not None and self.recorder.tokens < state.config.routing_warmup:
            return None
        with state.pager.lock:
            if state.watch is self:  # another thread's forward may have decided first
                _decide_expert_placement(state, model, self, args)
        return None

    def stop(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        if self.recorder is not None:
            self.recorder.remove()
        self.twin = None

    def __deepcopy__(self, memo):
        return _PlacementWatch()

    def __reduce__(self):
        return _PlacementWatch, ()


def _decide_expert_placement(state: _State, model: nn.Module, watch: _PlacementWatch, args) -> None:
    """The watch's one decision, under the pager's lock."""
    tools = _routing_tools
    if watch.stats is not None:
        stats, when = watch.stats, "at the first forward, by routing="
    else:
        stats = watch.recorder.stats()
        when = f"after {watch.recorder.tokens} routed tokens, by the routing measured"
    twin = watch.twin
    watch.stop()
    state.watch = None
    example = tools.decode_example(model, args)
    if example is None:
        state.expert_placement = {"chosen": "default", "decided": when,
                                  "why": "no tensor input to plan a step from: the forward takes keywords only"}
        return
    tools.sync_twin(twin, model)
    report = _replay_expert_placement(twin, state.pager.budget_bytes, example, stats, state.config, when)
    if report["chosen"] == "all_paged":
        try:
            _re_place_experts(state, model, placement.EXPERTS_PAGED)
        except Exception as e:  # noqa: BLE001 - undone by _Undo; the forward runs on the default placement
            warnings.warn(f"offtensor: the experts stay in the default placement: re-placing them failed "
                          f"({type(e).__name__}: {e})", UserWarning, stacklevel=3)
            report = dict(report, chosen="default", why=f"{report['why']}, but re-placing failed: "
                          f"{type(e).__name__}: {e}")
    state.expert_placement = report


def _re_place_experts(state: _State, model: nn.Module, policy) -> None:
    """Offload the expert stacks that the placement under ``policy`` offloads and that are still
    resident, between two forwards, under the pager's lock. Only offloading: groups offloaded now
    stay offloaded (``choose_model_placement``), so device bytes only fall and the budget holds
    throughout; values are the same bytes, so logits do not change. Atomic, as ``apply_placement``."""
    pager = state.pager
    config = state.config.replace(policy=policy)
    placed = placement.choose_model_placement(placement.collect_groups(model), _pinned(config, pager.budget_bytes),
                                              pager.device)
    moving = [g for g in placed.offloaded if not g.is_offloaded]
    ptrs = {m.tensor.untyped_storage().data_ptr() for g in moving for m in g if leaves.is_leaf(m.tensor)}
    with _Undo():
        for group in moving:
            _offload_group(group, pager)
    state.resident_ptrs -= ptrs
    state.config, state.choice = config, placed.choice
    state.working_set_bytes = max(state.working_set_bytes, placed.choice.working_set_bytes)
    hook = model._forward_pre_hooks.get(state.step_hook.id) if state.step_hook is not None else None
    if isinstance(hook, _StepHook):
        hook.config = config  # a copy of the model is placed as this one is now
    pager.recount_resident(_resident_bytes(model, pager.device))
    if config.prefetch and pager.prefetcher is None:
        pager.prefetcher = Prefetcher()
    state.refresh_experts()  # the new stacks join the expert cache and its router hooks


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
    if not leaves.is_leaf(t):
        _place_leaves(state, module, name, t, is_buffer, full_name, attaching)
        return None  # the outer object stays registered; its leaves were placed inside it
    if t.is_meta or t.layout != torch.strided:
        return None
    member = Member(t)
    member.slots.append((module, name, is_buffer))
    return _place_member(state, member, full_name, attaching)


def _place_leaves(state: _State, module: nn.Module, name: str, t: torch.Tensor, is_buffer: bool, full_name: str,
                  attaching=None) -> None:
    """Place each plain leaf of the wrapper subclass ``t`` (a DTensor's local shard, a quantised
    tensor's data and scales) registered as ``module.name``, replacing it inside its owner. The
    leaves placed first count as resident beside the later ones."""
    extra, skip = attaching or ((), frozenset())
    done = []
    for owner, attr, leaf in leaves.leaves(t, f"'{full_name}'"):
        if isinstance(leaf, OffloadedTensor):
            leaf._master.move_to(state.pager)
        elif not leaf.is_meta and leaf.layout == torch.strided:
            member = Member(leaf)
            member.slots.append((module, name, is_buffer))
            member.owners.append((owner, attr))
            _place_member(state, member, full_name, (tuple(extra) + tuple(done), skip))
            leaf = member.tensor
        done.append(leaf)


def _place_member(state: _State, member: Member, full_name: str, attaching=None):
    """``_place`` for one plain tensor (``member.tensor``, in the slot ``member.slots[0]``)."""
    pager = state.pager
    t = member.tensor
    module, name, _ = member.slots[0]
    placed = state.placement_of(t)
    if placed is not None:
        view = placed.offloaded_view(t)
        if view is not None:
            _swap(member, _as_param_like(t, view))
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
            _replan_paging_room(state, with_t, f"keeping {full_name} ({nbytes} bytes) resident, as the policy says,")
        if moves:
            source = t.detach()
            pager.room_for_resident(with_t)  # cached copies go before the new bytes are allocated
            with torch.no_grad():
                t.data = t.data.to(pager.device)
            state.remember(source, t, module, name)
        state.resident_ptrs.add(t.untyped_storage().data_ptr())
        pager.hold_resident(with_t)
        return None
    _reserve_paging_room(state, full_name, t, resident, tileable=placement.leaf_is_tileable(t, member.owners))
    member.names.append(full_name)
    source = t.detach()
    _offload_group(StorageGroup([member]), pager)
    state.remember(source, member.tensor, module, name)
    pager.recount_resident(resident)
    return member.tensor


def _reserve_paging_room(state: _State, full_name: str, t: torch.Tensor, resident: int, kind: str = "",
                         tileable: bool = True) -> None:
    """Before ``t`` is offloaded beside ``resident`` bytes of resident weights: make sure the budget
    can page it, whole or in tiles (dispatch computes linear, mm, bmm and conv ops on a weight larger
    than the room in output tiles), and reserve that working set. ``tileable=False``: a leaf of a
    wrapper subclass, read whole by the subclass's kernels (``placement.Weight.tileable``)."""
    pager = state.pager
    nbytes = placement.tensor_bytes(t)  # offloading keeps an expanded tensor's stride-0 layout
    ws = placement.working_set(full_name, tuple(t.shape), nbytes)
    narrow = False
    for slices in (placement.TILE_ALIGN, 1) if tileable else ():  # bit-identical tiles first (see tile_working_set)
        if resident + max(ws, state.working_set_bytes) > pager.budget_bytes:
            ws = placement.tile_working_set(tuple(t.shape), nbytes, ws, slices)
            narrow = slices < placement.TILE_ALIGN
    if resident + max(ws, state.working_set_bytes) > pager.budget_bytes:
        raise BudgetError(
            f"offtensor: {kind}{full_name} ({nbytes} bytes) needs {ws} bytes on the device to be paged, but only "
            f"{pager.budget_bytes - resident} of the budget's {pager.budget_bytes} bytes are not resident "
            f"weights; raise budget_gb or offload more"
        )
    if narrow:  # the same fallback, and the same warning, as wrap-time placement's
        placement.warn_narrow_tiles(pager.budget_bytes, f"{kind}{full_name}", stacklevel=2)
    state.working_set_bytes = max(state.working_set_bytes, ws)


def _replan_paging_room(state: _State, resident: int, why: str) -> None:
    """Resident weights grow to ``resident`` bytes and leave less room than the paging planned for
    (a weight the policy keeps, a cast that the policy keeps resident): plan the room again, each
    offloaded weight whole if it fits, else in tiles as placement would have chosen at that room,
    so ``working_set_bytes`` says what paging needs now. Raises a BudgetError, before anything
    changes, if some offloaded weight cannot be paged in the room left even one slice at a time."""
    pager, model = state.pager, state.model_ref()
    room = pager.budget_bytes - resident
    need, narrow = 0, None
    for group in placement.collect_groups(model) if model is not None else ():
        if not group.is_offloaded:
            continue
        w = group.weight()
        ws = w.working_set
        for slices in (placement.TILE_ALIGN, 1):
            if ws > room:
                ws = placement.tile_working_set(w.shape, w.nbytes, ws, slices)
                narrow = w.name if slices < placement.TILE_ALIGN and narrow is None else narrow
        if ws > room:
            raise BudgetError(
                f"offtensor: {why} leaves {max(room, 0)} of the budget's {pager.budget_bytes} bytes for paging, but the "
                f"offloaded '{w.name}' ({w.nbytes} bytes) needs {ws} bytes on the device at once even one slice at a "
                f"time; raise budget_gb or let the policy offload more"
            )
        need = max(need, ws)
    if narrow is not None:
        placement.warn_narrow_tiles(pager.budget_bytes, f"'{narrow}'", stacklevel=3)
    state.working_set_bytes = need


def _attach_submodule(state: _State, module: nn.Module, name: str, submodule: nn.Module) -> None:
    """``submodule`` is being set as ``module.name`` of a wrapped model: its modules join the model
    and its tensors are placed, those of the submodule it replaces no longer counting."""
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
        _enter(child, state)
        for table, is_buffer in ((child._parameters, False), (child._buffers, True)):
            for attr, t in list(table.items()):
                if t is not None:
                    new = _place(state, child, attr, t, is_buffer, attaching=(tuple(placed), replaced))
                    if new is not None:
                        table[attr] = new
                    placed.append(table[attr])


# ---------------------------------------------------------------------------- host reads


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
    state = _state(model)
    # Held throughout: another thread's forward must not read the host stand-ins.
    with state.pager.lock:
        yield from _lend_host_masters(state, model)


def _lend_host_masters(state: _State, model: nn.Module):
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
                        stand_in = stand_ins[id(t)] = _as_param_like(t, t._host)
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
        pager.recount_resident(_resident_bytes(model, pager.device))


# ---------------------------------------------------------------------------- casts and moves


def _apply_to_wrapped(apply, module: nn.Module, fn, recurse: bool = True):
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
    state = _WRAPPED.get(module)
    if state is None or state.model_ref() is None:
        return apply(fn, recurse)
    with state.pager.lock:  # another thread's op finishes first; the next one sees the new dtype
        return _apply_locked(state, apply, module, fn, recurse)


def _apply_locked(state: _State, apply, module: nn.Module, fn, recurse: bool):
    if recurse:
        for child in module.children():
            child._apply(fn)
    handled = _cast_offloaded(state, module, fn)
    before = _own_resident_bytes(module, state.pager.device)
    for table, attr, _ in handled:
        table[attr] = None  # torch's _apply skips None: these are done
    try:
        apply(fn, False)
    finally:
        for table, attr, t in handled:
            table[attr] = t
        if handled and isinstance(module, nn.RNNBase):
            module._init_flat_weights()  # it re-read its weights while they were hidden
    _replan_resident_after_cast(state, module, before)
    return module


def _cast_offloaded(state: _State, module: nn.Module, fn) -> list:
    """Convert ``module``'s own offloaded tensors as ``fn`` asks, in place; returns the
    (table, attribute, tensor) of those done (converted, or left as they are because ``fn`` leaves
    them so). What ``fn`` does is read off a tiny stand-in of each tensor's dtype on its device: a
    cast is done here; a move to another device or memory format is left to torch."""
    handled = []
    for table in (module._parameters, module._buffers):
        for attr, t in table.items():
            if not isinstance(t, OffloadedTensor):
                continue
            stand_in = torch.empty((2,) * t.dim(), dtype=t.dtype, device=t.device)
            try:
                with torch.no_grad():
                    probe = fn(stand_in)
            except Exception:  # noqa: BLE001 - whatever fn does, torch's own path does it (or raises) below
                continue
            if probe is stand_in:
                handled.append((table, attr, t))
                continue
            if (not isinstance(probe, torch.Tensor) or type(probe) is not torch.Tensor or probe.device != t.device
                    or probe.shape != stand_in.shape or not probe.is_contiguous() or probe.dtype == t.dtype):
                continue  # not a plain cast: torch's path
            _cast_master(state, state.qualified_name(module, attr), t, probe.dtype)
            if t.grad is not None:
                t.grad = fn(t.grad)
            handled.append((table, attr, t))
    return handled


def _cast_master(state: _State, full_name: str, t: OffloadedTensor, dtype: torch.dtype) -> None:
    """Re-point the offloaded ``t`` at a new host master holding its values cast to ``dtype``,
    after reserving the room to page it at that size (a BudgetError leaves ``t`` as it was)."""
    pager = state.pager
    host = t._host
    at_new_size = torch.empty_strided(host.shape, host.stride(), dtype=dtype, device="meta")
    _reserve_paging_room(state, full_name, at_new_size, pager.budget.resident_bytes)
    new_host = new_host_master(host, pin=pins_host_memory(pager.device), dtype=dtype)
    master = master_for(new_host, pager)
    master.name = full_name
    with torch.no_grad():
        t.data = OffloadedTensor(new_host, master)  # dispatch's .data setter: same object, new master
    if "experts" in full_name.split("."):
        state.experts_stale = True  # the registry names the old master


def _own_resident_bytes(module: nn.Module, device: torch.device) -> int:
    """Device bytes of ``module``'s own plain parameters and buffers (not its children's)."""
    tensors = (t for table in (module._parameters, module._buffers) for t in table.values() if t is not None)
    return sum(_resident_storages_of(tensors, device).values())


def _replan_resident_after_cast(state: _State, module: nn.Module, before: int) -> None:
    """After torch's ``_apply`` cast ``module``'s plain device tensors from ``before`` bytes: count
    the difference as resident, and offload the ones that grew past the budget's room, largest
    first, as a weight assigned after wrapping that does not fit is offloaded."""
    pager = state.pager
    after = _own_resident_bytes(module, pager.device)
    if after == before:
        return
    resident = max(0, pager.budget.resident_bytes + after - before)
    for table in (module._parameters, module._buffers):
        for t in table.values():
            if t is not None and not isinstance(t, OffloadedTensor) and t.device == pager.device:
                state.resident_ptrs.add(t.untyped_storage().data_ptr())
    if after < before or resident + state.working_set_bytes <= pager.budget_bytes:
        pager.recount_resident(resident)
        return
    plain = [
        (table, attr, is_buffer, t)
        for table, is_buffer in ((module._parameters, False), (module._buffers, True))
        for attr, t in table.items()
        if t is not None and not isinstance(t, OffloadedTensor) and t.device == pager.device
        and _check_offloadable_quietly(t)
    ]
    plain.sort(key=lambda entry: -entry[3].numel() * entry[3].element_size())
    for table, attr, is_buffer, t in plain:
        if resident + state.working_set_bytes <= pager.budget_bytes:
            break
        full_name = state.qualified_name(module, attr)
        if placement.policy_choice(state.config.policy, [full_name]) == "keep":
            continue
        resident -= _storage_bytes(t)[1]
        _reserve_paging_room(state, full_name, t, resident)
        member = Member(t)
        member.slots.append((module, attr, is_buffer))
        member.names.append(full_name)
        _offload_group(StorageGroup([member]), pager)
        table[attr] = member.tensor
    if resident + state.working_set_bytes > pager.budget_bytes:  # what is left is what the policy keeps
        _replan_paging_room(state, resident, f"casting {type(module).__name__} kept {resident} bytes resident and")
    pager.recount_resident(resident)


class _StepHook:
    """Forward pre-hook of a wrapped model: one forward is one step of the prefetch schedule.

    It also carries the wrap's settings through ``copy.deepcopy``: the copy of a wrapped model
    holds a copy of this hook, and the first time the copy is used (``ot.stats``, a forward...)
    ``_adopt_copy`` gives it its own pager with the same budget, instead of leaving its new host
    masters charged to the original's pager."""

    __slots__ = ("config", "budget_bytes", "pager_ref", "pager_key", "copy_pager")

    def __init__(self, config: OffloadConfig, budget_bytes: int, pager=None, copy_pager=None):
        self.config, self.budget_bytes = config, budget_bytes  # config.device: the device resolved
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
            with state.pager.lock:
                if state.experts_stale:
                    state.refresh_experts()
                state.pager.new_step()  # one pass of the prefetch schedule and of the expert statistics

    def __reduce__(self):
        # torch.save(model) of a wrapped model: the loaded model is adopted like a deepcopy (a
        # callable policy may not pickle; patterns do).
        config = self.config.replace(policy=None) if callable(self.config.policy) else self.config
        return _StepHook, (config, self.budget_bytes)

    def new_pager(self) -> Pager:
        """A pager with the wrapped model's device, budget and strictness, for a copy of the model."""
        return Pager(self.config.device, self.budget_bytes, strict=self.config.strict)

    def __deepcopy__(self, memo):
        pager = self.new_pager()
        original = self.pager_ref() if self.pager_ref is not None else None
        if original is not None:
            # OffloadedTensor.__deepcopy__ charges the new host masters to this pager, not the original's.
            memo[("offtensor.pager", id(original))] = pager
        return _StepHook(self.config, self.budget_bytes, copy_pager=pager)


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
            _leave(module)
    for key, _ in hooks:
        del model._forward_pre_hooks[key]
    pager = hook.copy_pager or hook.new_pager()
    hook.copy_pager = None
    offloaded = 0
    groups = placement.collect_groups(model)
    for group in groups:
        if group.is_offloaded:
            group[0].tensor._master.move_to(pager)
            offloaded += group[0].tensor._master.nbytes
    weights = [g.weight() for g in groups]
    offload = [w for w, g in zip(weights, groups) if g.is_offloaded]
    resident = [w for w, g in zip(weights, groups) if not g.is_offloaded]
    ws = placement.choose_placement(offload, None, offload_bytes=0, policy=lambda name: "offload",
                                    prefetch=False).working_set_bytes
    choice = placement.Placement(offload, resident, hook.budget_bytes, _resident_bytes(model, pager.device), offloaded,
                                 ws)
    _register(model, pager, choice, hook.config)
    return _WRAPPED[model]


def _after_load(module, incompatible_keys):
    """load_state_dict post-hook. With ``torch.__future__.set_swap_module_params_on_conversion``
    load_state_dict swaps loaded values into the existing Parameter objects, so no registration
    hook sees them; place what this module now holds unless it is on the device within budget."""
    state = _WRAPPED.get(module)
    model = state.model_ref() if state is not None else None
    if model is None:
        return
    with state.pager.lock:
        _place_loaded(state, model, module)


def _place_loaded(state: "_State", model: nn.Module, module: nn.Module) -> None:
    pager = state.pager
    plain = [
        (table, attr, is_buffer, t)
        for table, is_buffer in ((module._parameters, False), (module._buffers, True))
        for attr, t in table.items()
        if t is not None and not isinstance(t, OffloadedTensor) and not t.is_meta and t.layout == torch.strided
    ]
    held = [leaf for *_, t in plain for leaf in leaves.leaf_tensors(t) if not isinstance(leaf, OffloadedTensor)]
    if all(t.device == pager.device and t.untyped_storage().data_ptr() in state.resident_ptrs for t in held):
        return  # values were copied into the weights already placed (the usual load_state_dict)
    resident = _resident_bytes(model, pager.device)
    if all(t.device == pager.device for t in held) and resident + state.working_set_bytes <= pager.budget_bytes:
        pager.recount_resident(resident)  # cached copies make room first (assign=True on a warm cache)
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
    choice = placement.policy_choice(state.config.policy, [full_name])
    keep = choice == "keep" or (
        choice != "offload" and resident + state.working_set_bytes <= pager.budget_bytes
    )
    shares_a_weight = _storage_bytes(t)[0] in _resident_storages_of(_tensors(model), pager.device)
    if keep or shares_a_weight or not _check_offloadable_quietly(t):
        pager.hold_resident(resident)
        return
    without_t = resident - _storage_bytes(t)[1]
    _reserve_paging_room(state, full_name, t, without_t, kind="the attribute ")
    member = Member(t)
    member.slots.append((module, name, None))
    member.names.append(full_name)
    _offload_group(StorageGroup([member]), pager)
    pager.recount_resident(_resident_bytes(model, pager.device))


def _check_offloadable_quietly(t: torch.Tensor) -> bool:
    try:
        check_offloadable(t, "attribute")
    except (TypeError, ValueError, RuntimeError):
        return False
    return True


def _set_attribute(set_attribute, module: nn.Module, name: str, value) -> None:
    """``module.name = value`` through the module class's own ``set_attribute``, plus what a wrapped
    model needs: a submodule's tensors placed, a plain tensor attribute placed (no registration
    method sees those) and a recount when a weight or submodule is set to None."""
    state = _WRAPPED.get(module)
    if state is None:
        return set_attribute(name, value)
    with state.pager.lock:  # re-placement waits for another thread's op, which then sees the result
        _set_placed(state, set_attribute, module, name, value)


def _set_placed(state: "_State", set_attribute, module: nn.Module, name: str, value) -> None:
    # Only a weight, submodule or tensor attribute set to None releases bytes (forwards set other
    # attributes to None often; a recount walks the model).
    releases = value is None and (
        module._modules.get(name) is not None
        or module._parameters.get(name) is not None
        or module._buffers.get(name) is not None
        or isinstance(module.__dict__.get(name), torch.Tensor)
    )
    old = module._modules.get(name) if releases else None
    if isinstance(value, nn.Module):
        _attach_submodule(state, module, name, value)
    set_attribute(name, value)  # a Parameter or buffer goes through register_parameter / register_buffer
    if isinstance(value, torch.Tensor) and module.__dict__.get(name) is value:
        _place_attribute(state, module, name, value)
    elif releases:
        _released(state, old)


def _delete_attribute(delete_attribute, module: nn.Module, name: str) -> None:
    """``del module.name``, plus releasing a deleted submodule's or weight's bytes at once:
    resident bytes are recounted, and the submodule no longer places what is assigned into it."""
    state = _WRAPPED.get(module)
    if state is None:
        return delete_attribute(name)
    with state.pager.lock:
        old = module._modules.get(name)
        delete_attribute(name)
        _released(state, old)


_ABSENT = object()


def _register_tensor(register, module: nn.Module, table: dict, name: str, t, is_buffer: bool) -> None:
    """``register(name, t)``, the module class's own ``register_parameter`` / ``register_buffer``
    (which checks the name and the tensor), then the placement of ``t`` into the wrapped model. If
    placing fails (over budget), the slot goes back to what it held."""
    state = _WRAPPED.get(module)
    if state is None or t is None:
        return register(name, t)
    with state.pager.lock:
        before = table.get(name, _ABSENT)
        _refuse_sharding_an_offloaded_weight(state, module, name, before, t)
        register(name, t)
        try:
            new = _place(state, module, name, t, is_buffer)
        except BaseException:
            if before is _ABSENT:
                table.pop(name, None)
            else:
                table[name] = before
            raise
        if new is not None:
            table[name] = new


def _is_dtensor(t) -> bool:
    dtensor = getattr(getattr(torch.distributed, "tensor", None), "DTensor", None) if torch.distributed.is_available() else None
    return dtensor is not None and isinstance(t, dtensor)


def _refuse_sharding_an_offloaded_weight(state: _State, module: nn.Module, name: str, before, t) -> None:
    """An offloaded weight replaced by a DTensor whose local shard is a plain tensor: FSDP2's
    ``fully_shard`` does that to every weight it manages, and keeps its own copy of each shard to
    all-gather from, so offloading the shard would leave that copy on the device unaccounted (and
    stale after an optimizer step). Refused before the slot changes, naming the weight."""
    if not (isinstance(before, OffloadedTensor) and _is_dtensor(t)):
        return
    if all(isinstance(leaf, OffloadedTensor) for leaf in leaves.leaf_tensors(t)):
        return  # DTensor.from_local on an offloaded shard: nothing leaves host memory
    full_name = state.qualified_name(module, name)
    raise RuntimeError(
        f"offtensor: '{full_name}' is offloaded ({before.host_nbytes} bytes of host master) and is being replaced by "
        f"a DTensor with a plain local shard on {t.device}, which is what FSDP2's fully_shard (and distribute_tensor) "
        f"do to a wrapped model's weights: the shard would leave host memory, and FSDP2 all-gathers from a copy of its "
        f"own. FSDP2 over offloaded weights is not supported: keep them out of it with fully_shard(module, "
        f"ignored_params={{...}}) (the frozen base of LoRA training), or for tensor parallelism run parallelize_module "
        f"first and ot.wrap_model after, on each rank. '{full_name}' was left as it was."
    )


def _refuse_distribute(module: nn.Module) -> None:
    """``distribute_module`` (``parallelize_module``) asks a wrapped module whether it was
    distributed before it scatters any weight; an offloaded weight would reach gloo/NCCL inside a
    ``Tensor[][]`` argument, which the dispatcher never hands to the OffloadedTensor (rank 0 died
    of SIGSEGV). Refused at the first module asked while any weight of the model is offloaded, so
    no module has been parallelized yet when it raises."""
    state = _WRAPPED.get(module)
    model = state.model_ref() if state is not None else None
    if model is None:
        return
    offloaded = [
        (n, t) for n, t in itertools.chain(model.named_parameters(), model.named_buffers())
        if any(isinstance(leaf, OffloadedTensor) for leaf in leaves.leaf_tensors(t))
    ]
    if offloaded:
        name, t = offloaded[0]
        raise RuntimeError(
            f"offtensor: {type(module).__name__} '{state.qualified_name(module, '').rstrip('.')}' of a wrapped model "
            f"is being parallelized (distribute_module / parallelize_module) while {len(offloaded)} of the model's "
            f"weights are offloaded ('{name}', {t.numel() * t.element_size()} bytes): parallelize first, then call "
            f"ot.wrap_model on each rank, so that each rank's host masters hold only its shard. Nothing was "
            f"parallelized."
        )


def _add_submodule(add_module, module: nn.Module, name: str, submodule) -> None:
    """``module.add_module(name, submodule)``, its tensors placed first when ``module`` is wrapped."""
    state = _WRAPPED.get(module)
    if state is None or not isinstance(submodule, nn.Module):
        return add_module(name, submodule)
    with state.pager.lock:
        _attach_submodule(state, module, name, submodule)
        add_module(name, submodule)


def _released(state: _State, old: Optional[nn.Module] = None) -> None:
    model = state.model_ref()
    if model is None:
        return
    if old is not None:
        live = set(model.modules())
        for m in old.modules():
            if m not in live and _WRAPPED.get(m) is state:
                _leave(m)
    state.pager.recount_resident(_resident_bytes(model, state.pager.device))
    if state.pager.experts is not None:
        state.experts_stale = True  # a registered stack may be what was deleted


# ---------------------------------------------------------------------------- wrapped modules' classes


# A user's module class -> the subclass its instances take while wrapped, made once per class.
_WRAPPING_CLASSES: dict = {}
_WRAPPING_CLASSES_LOCK = threading.Lock()


def _wrapping_class(user_class: type) -> type:
    """The subclass of ``user_class`` that the modules of a wrapped model take while wrapped.

    Its ``__setattr__``, ``__delattr__``, ``register_parameter``, ``register_buffer`` and
    ``add_module`` do what ``user_class``'s do, plus the placement of what is assigned (no torch
    hook sees plain tensor attributes or deletions). It has ``user_class``'s name, qualified name
    and module (so reprs and ``type(m).__name__`` checks see no change) and no slots of its own
    (so ``module.__class__`` can be swapped both ways); it pickles and deep-copies as ``user_class``.
    A module's ops never go through it: forwards cost what they cost unwrapped."""
    if "_offtensor_user_class" in user_class.__dict__:
        return user_class
    with _WRAPPING_CLASSES_LOCK:
        cls = _WRAPPING_CLASSES.get(user_class)
        if cls is None:
            cls = _WRAPPING_CLASSES[user_class] = _make_wrapping_class(user_class)
    return cls


def _make_wrapping_class(user_class: type) -> type:
    def __setattr__(self, name, value):
        _set_attribute(super(cls, self).__setattr__, self, name, value)

    def __delattr__(self, name):
        _delete_attribute(super(cls, self).__delattr__, self, name)

    def register_parameter(self, name, param):
        _register_tensor(super(cls, self).register_parameter, self, self._parameters, name, param, False)

    def register_buffer(self, name, tensor, persistent=True):
        own = super(cls, self).register_buffer
        register = own if persistent else (lambda n, t: own(n, t, persistent=False))
        _register_tensor(register, self, self._buffers, name, tensor, True)

    def add_module(self, name, module):
        _add_submodule(super(cls, self).add_module, self, name, module)

    def _apply(self, fn, recurse=True):
        return _apply_to_wrapped(super(cls, self)._apply, self, fn, recurse)

    # distribute_module (parallelize_module) first asks getattr(module, "_distribute_module_applied",
    # False): a property answers it, refusing a module with offloaded weights. A property, not a
    # __getattr__, so that forwards (and torch.compile's handling of modules) see no change.
    def _get_distributed(self):
        if "_distribute_module_applied" in self.__dict__:
            return self.__dict__["_distribute_module_applied"]
        _refuse_distribute(self)
        raise AttributeError("_distribute_module_applied")

    def _set_distributed(self, value):
        self.__dict__["_distribute_module_applied"] = value

    def __reduce_ex__(self, protocol):
        reduced = super(cls, self).__reduce_ex__(protocol)
        if isinstance(reduced, tuple) and reduced[0] is copyreg.__newobj__ and reduced[1] == (cls,):
            # pickle insists that __newobj__ builds the object's own class: rebuild the user's
            # class as protocols 0 and 1 do instead.
            reduced = (copyreg._reconstructor, (user_class, object, None), *reduced[2:])
        return reduced

    namespace = {
        "__module__": user_class.__module__, "__qualname__": user_class.__qualname__, "__slots__": (),
        "_offtensor_user_class": user_class, "__setattr__": __setattr__, "__delattr__": __delattr__,
        "register_parameter": register_parameter, "register_buffer": register_buffer, "add_module": add_module,
        "_apply": _apply, "_distribute_module_applied": property(_get_distributed, _set_distributed),
        "__reduce_ex__": __reduce_ex__,
    }
    cls = type(user_class)(user_class.__name__, (user_class,), namespace)
    return cls


def _give_wrapping_class(module: nn.Module) -> None:
    cls = type(module)
    if "_offtensor_user_class" not in cls.__dict__:
        module.__class__ = _wrapping_class(cls)


def _give_user_class(module: nn.Module) -> None:
    user_class = type(module).__dict__.get("_offtensor_user_class")
    if user_class is not None:
        module.__class__ = user_class
