"""Marking a model wrapped (its state, hooks and step hook) and undoing that; and copies of a
wrapped model: the step hook carries the wrap's settings through ``copy.deepcopy`` and pickling,
and the copy is adopted on a pager of its own the first time it is used, while a ``copy.copy``
(the same modules and weights under a second name) shares the original's wrap."""

from __future__ import annotations

import sys
import weakref
from typing import Optional

import torch
from torch import nn
from torch.nn.utils import stateless

from ..ops import compile as _compile
from .. import moe
from .. import placement
from .. import working_sets
from ..config import OffloadConfig
from ..pager import Pager
from ..prefetch import Prefetcher
from ..tensor import OffloadedTensor
from .assignment import give_user_class, join, leave
from .groups import collect_groups
from .loads import after_load, portable_state_dict
from .moves import Undo, resident_bytes, weight_tensors
from .state import WRAPPED, State, enrol, member_module, shares_tables, wrapped_state


def register_wrapped(model: nn.Module, pager: Pager, choice: placement.Placement, config: OffloadConfig) -> None:
    """Mark ``model`` as wrapped: its modules now place whatever is assigned into them. Inside a
    placement (``Undo``) the undo is noted before anything is registered, so an interrupt at any
    point of the registration is undone with the rest."""
    config = config.replace(device=pager.device)
    state = State(model, pager, choice, config)
    Undo.note("call", undo_registration, model, state)
    try:
        _register_state(model, pager, choice, config, state)
    except BaseException:
        undo_registration(model, state)
        raise


def _register_state(model: nn.Module, pager: Pager, choice: placement.Placement, config: OffloadConfig,
                    state: State) -> None:
    for module in model.modules():
        join(module, state)
    state.resident_ptrs = {
        t.untyped_storage().data_ptr()
        for t in weight_tensors(model)
        if not isinstance(t, OffloadedTensor) and t.device == pager.device and not t.is_meta
    }
    # On meta (ot.plan) no tensor holds bytes: the resident weights count what the choice keeps, as
    # a GPU would hold them, and speculation, which needs router values, is not hooked.
    planning = pager.device.type == "meta"
    pager.recount_resident(choice.resident_bytes if planning else resident_bytes(model, pager.device))
    pager.reset_stats()
    if config.prefetch and choice.offload:
        pager.prefetcher = Prefetcher()
    # Offloaded stacked experts: per-stack stats, expert-aware eviction, routing speculation.
    moe.attach(model, pager, speculate=config.prefetch and not planning, compute=config.expert_compute,
               compute_choice=config.expert_compute_choice, pool=config.expert_pool, room_needed=state.room_needed())
    state.step_hook = model.register_forward_pre_hook(StepHook(config, choice.budget_bytes, pager,
                                                               state=state))


def unregister_wrapped(model: nn.Module, state: State) -> None:
    """Undo ``register_wrapped`` (a failed registration; the end of ``unwrap_model``): every module of
    ``state`` gets its own class back, the hooks go, the pager's observers are dropped.

    Each step can run again, and ``model`` itself leaves last: ``unwrap_model`` finds the state
    through it, so an unwrap cut short anywhere (a Ctrl-C) is still wrapped and finishes when
    called again, rather than leaving modules of the wrapping class, its hooks (whose step hook
    would adopt the model as a copy) and no way to unwrap or wrap it again."""
    pager = state.pager
    pager.prefetcher = None
    moe.detach(pager)
    if state.watch is not None:
        state.watch.stop()
        state.watch = None
    for handle in state.load_hooks:
        handle.remove()
    state.load_hooks.clear()
    if state.step_hook is not None:
        state.step_hook.remove()
        state.step_hook = None
    modules = [m for m, s in list(WRAPPED.items()) if s is state] + list(model.modules())
    for module in [m for m in modules if m is not model] + [model]:
        if wrapped_state(module) is state:
            leave(module)


def undo_registration(model: nn.Module, state: State) -> None:
    """``unregister_wrapped`` for a registration that may have stopped anywhere (an interrupt):
    also the modules that took the wrapping class or a hook before they were recorded. Idempotent."""
    unregister_wrapped(model, state)
    for module in model.modules():
        if wrapped_state(module) is state:
            leave(module)
        give_user_class(module)
        for hooks, hook in ((module._load_state_dict_post_hooks, after_load),
                            (module._state_dict_hooks, portable_state_dict)):
            for key in [k for k, h in hooks.items() if h is hook]:
                del hooks[key]
    for key in [k for k, h in model._forward_pre_hooks.items()
                if isinstance(h, StepHook) and h.pager_ref is not None and h.pager_ref() is state.pager]:
        del model._forward_pre_hooks[key]


class StepHook:
    """Forward pre-hook of a wrapped model: one forward is one step of the prefetch schedule.

    It also carries the wrap's settings through ``copy.deepcopy``: the copy of a wrapped model
    holds a copy of this hook, and the first time the copy is used (``ot.stats``, a forward...)
    ``adopt_copy`` gives it its own pager with the same budget, instead of leaving its new host
    masters charged to the original's pager. The copy's paging room is the original's as it stood
    when copied (``working_set``): planned again from the copy's weights, it would be whole working
    sets where the original had planned tiles, and refuse assignments the original accepts."""

    __slots__ = ("config", "budget_bytes", "pager_ref", "pager_key", "copy_pager", "room", "working_set",
                 "copied_offloaded")

    def __init__(self, config: OffloadConfig, budget_bytes: int, pager=None, copy_pager=None, state=None,
                 working_set=None, copied_offloaded=False):
        self.config, self.budget_bytes = config, budget_bytes  # config.device: the device resolved
        self.room = weakref.ref(state) if state is not None else None  # the wrapped model's State
        self.working_set = working_set  # a copy's: the original's working_set_bytes when copied
        self.pager_ref = weakref.ref(pager) if pager is not None else None
        # Under torch.compile the step is an op of the graph, keyed by this int (a constant to
        # Dynamo): looking the model up in WRAPPED would make Dynamo guard on that table's
        # entries, which change as models come and go (compile.step_hook).
        self.pager_key = _compile.register_pager(pager) if pager is not None else None
        self.copy_pager = copy_pager  # a deepcopy's pager, until adopt_copy registers it
        self.copied_offloaded = copied_offloaded  # a deepcopy's: the original had offloaded weights

    def __call__(self, model, args):
        if torch.compiler.is_compiling() and self.pager_key is not None:
            # (an empty tensor made in the graph: the op's device, compile.py)
            torch.ops.offtensor.new_step(torch.empty(0, device=self.config.device), self.pager_key)
            return
        state = model_state(model)
        if state is None:
            state = adopt(model)
        if state is not None:
            if state.loans:
                state.settle_loans()
            with state.pager.lock:
                for master_id in state.shared_masters:  # another process may have written them
                    state.pager.forget_master(master_id)
                if state.experts_stale:
                    state.refresh_experts()
                state.pager.new_step()  # one pass of the prefetch schedule and of the expert statistics

    def __reduce__(self):
        # torch.save(model) of a wrapped model: the loaded model is adopted like a deepcopy (a
        # callable policy may not pickle; patterns do).
        config = self.config.replace(policy=None) if callable(self.config.policy) else self.config
        return StepHook, (config, self.budget_bytes, None, None, None, self._room_now())

    def new_pager(self) -> Pager:
        """A pager with the wrapped model's device, budget and strictness, for a copy of the model."""
        return Pager(self.config.device, self.budget_bytes, strict=self.config.strict)

    def __deepcopy__(self, memo):
        pager = self.new_pager()
        # (a copy not yet adopted: the pager its own deep copy charged its masters to)
        original = self.pager_ref() if self.pager_ref is not None else self.copy_pager
        if original is not None:
            # OffloadedTensor.__deepcopy__ charges the new host masters to this pager, not the original's.
            memo[("offtensor.pager", id(original))] = pager
        return StepHook(self.config, self.budget_bytes, copy_pager=pager, working_set=self._room_now(),
                        copied_offloaded=original is not None and original.budget.offloaded_bytes > 0)

    def _room_now(self):
        """The original's working_set_bytes now (a copy's: the one it was given), None if unknown."""
        state = self.room() if self.room is not None else None
        return state.working_set_bytes if state is not None else self.working_set


def adopt_copy(model: nn.Module) -> Optional[State]:
    """Register a ``copy.deepcopy`` of a wrapped model as wrapped on its own pager; None when
    ``model`` holds no copied step hook (it was never a wrapped model).

    All or nothing, as a wrap (``Undo``): cut short anywhere (a Ctrl-C), the copy keeps its copied
    hooks, its masters stay on the pager its deep copy made and its step hook keeps that pager, so
    its next use adopts it again. Before, a Ctrl-C after the copied step hook was dropped left a copy
    that nothing would ever adopt: not wrapped, its masters on a pager no state counted."""
    hooks = [(key, h) for key, h in model._forward_pre_hooks.items() if isinstance(h, StepHook)]
    if not hooks:
        return None
    if _copied_weights_gone(model, hooks[0][1]):
        _drop_copied_hooks(model, hooks)
        return None
    if _inside_functional_call() or any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in weight_tensors(model)):
        # torch.func's functional_call runs it, or vmap / grad over it: its tables hold the caller's
        # tensors for this call (under vmap with no storage), not its own. Placed, they would be
        # counted as its resident weights beyond the budget. Adopted at its next use outside.
        return None
    Undo.run(_adopt, model, hooks)
    return wrapped_state(model)


def _copied_weights_gone(model: nn.Module, hook: StepHook) -> bool:
    """Every offloaded weight a deep copy was made with died before its first use, and it holds no
    offloaded tensor: the copy was moved to another device (``copy.deepcopy(model).to("meta")``,
    the skeleton ``torch.func``'s ``functional_call`` runs over stacked weights) or its weights were
    replaced. It is a plain model now; adopting it then would place whatever its tables hold at that
    moment, which inside ``functional_call`` are the caller's tensors (under ``vmap``, batched ones
    with no storage)."""
    pager = hook.copy_pager
    weights = list(weight_tensors(model))
    if (pager is not None and hook.copied_offloaded and pager.budget.offloaded_bytes == 0
            and not any(isinstance(t, OffloadedTensor) for t in weights)):
        return True
    # The same skeleton of a model whose weights all fitted the budget (none was offloaded): every
    # weight on meta, the original's device another.
    return hook.config.device.type != "meta" and bool(weights) and all(t.is_meta for t in weights)


def _inside_functional_call() -> bool:
    """Whether ``torch.func.functional_call`` (``stateless._functional_call``) is running a module
    now: the caller of a not yet adopted copy's step hook, a few frames up."""
    code = stateless._functional_call.__code__
    frame = sys._getframe(2)
    for _ in range(64):
        if frame is None:
            return False
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _drop_copied_hooks(model: nn.Module, hooks: list) -> None:
    """The hooks a deep copy carries from its wrapped original, taken off a copy that is not adopted
    (its step hook last: cut short, the next use drops the rest)."""
    for module in model.modules():
        for key in [k for k, h in module._load_state_dict_post_hooks.items() if h is after_load]:
            del module._load_state_dict_post_hooks[key]
        for key in [k for k, h in module._state_dict_hooks.items() if h is portable_state_dict]:
            del module._state_dict_hooks[key]
    for key, _ in hooks:
        del model._forward_pre_hooks[key]


def _adopt(model: nn.Module, hooks: list) -> None:
    """``adopt_copy``'s steps, each undo noted before the step."""
    hook = hooks[0][1]
    modules = list(model.modules())
    _note_hook_tables(model, modules, [(m, type(m), WRAPPED.get(m)) for m in modules if m in WRAPPED])
    Undo.note("call", setattr, hook, "copy_pager", hook.copy_pager)
    for module in modules:
        if module in WRAPPED:
            leave(module)
    # The copy's modules carry copies of the original's hooks; register_wrapped adds its own.
    _drop_copied_hooks(model, hooks)
    pager = hook.copy_pager or hook.new_pager()
    hook.copy_pager = None
    offloaded = 0
    groups = collect_groups(model)
    for group in groups:
        if group.is_offloaded:
            master = group[0].tensor._master
            Undo.note("moved", master, master.pager)
            master.move_to(pager)
            offloaded += master.nbytes
    weights = [g.weight() for g in groups]
    offload = [w for w, g in zip(weights, groups) if g.is_offloaded]
    resident = [w for w, g in zip(weights, groups) if not g.is_offloaded]
    resident_now = resident_bytes(model, pager.device)
    ws = hook.working_set
    if ws is None:  # the original was gone when copied: the room planned again, tiled where it must be
        plans = working_sets.modules_room(offload, hook.budget_bytes - resident_now)
        ws = plans[0].need if plans else 0
    choice = placement.Placement(offload, resident, hook.budget_bytes, resident_now, offloaded, ws)
    register_wrapped(model, pager, choice, hook.config)


def take_over_copies(model: nn.Module) -> None:
    """Deep copies of wrapped models inside ``model`` (or ``model`` itself), not adopted yet: the
    wrap being made places their weights under its own budget (``offload_group`` moves their masters
    to its pager), so their copied hooks go, as adoption drops them. Kept, the first use of such a
    copy (``AveragedModel(wrapped)``'s ``module``, wrapped with the averaged model) adopted it onto
    a pager of its own at the original's budget: device bytes beside this wrap's budget that its
    stats never saw. Noted for undo: a wrap that fails leaves the copies as they were."""
    for module in model.modules():
        hooks = [(key, h) for key, h in module._forward_pre_hooks.items()
                 if isinstance(h, StepHook) and h.pager_ref is None]  # a live wrap's hook names its pager
        if not hooks:
            continue
        _note_hook_tables(module, list(module.modules()), [])
        _drop_copied_hooks(module, hooks)


def _note_hook_tables(model: nn.Module, modules: list, members: list) -> None:
    """Undo noted for what ``_drop_copied_hooks`` changes on ``model`` (whose ``modules`` are
    given): each hook table as it is now, and ``members`` (module, class, state) to put back."""
    tables = [model._forward_pre_hooks] + [t for m in modules for t in (m._load_state_dict_post_hooks,
                                                                          m._state_dict_hooks)]
    Undo.note("call", _put_back_hooks, [(t, dict(t)) for t in tables], members)


def _put_back_hooks(tables: list, members: list) -> None:
    """Undo ``_adopt``'s drops: each hook table as it was, each module it took out of a wrapped model
    back in it, with its class. Can run again."""
    for table, saved in tables:
        if list(table.items()) != list(saved.items()):
            table.clear()
            table.update(saved)
    for module, cls, state in members:
        if type(module) is not cls:
            module.__class__ = cls
        if state is not None and wrapped_state(module) is not state:
            enrol(module, state)


def model_state(model: nn.Module) -> Optional[State]:
    """The state of the wrapped model that ``model`` is, or is a shallow copy of; None for anything
    else (a deep copy still to be adopted, a module of a wrapped model, a plain model). Only a
    lookup: nothing changes.

    A ``copy.copy`` of a module copies its ``__dict__`` entry by entry, not what they hold: its
    module, parameter, buffer and hook tables are the original's own dicts. It shares the original's
    wrap (one pager, one budget, one set of stats) instead of being adopted as a deep copy, which
    would take the shared modules and masters away from the original. It is found through the
    member it carries, which names the original, or, where the original has none (unwrapped, then
    wrapped again through the copy), through the step hook in the shared hook table, which names the
    state; either way only while that state's model still has these very tables."""
    state = wrapped_state(model)
    if state is not None and state.model_ref() is model:
        return state
    original = member_module(model)
    candidates = [wrapped_state(original)] if original is not None else []
    candidates += [hook.room() for hook in model._forward_pre_hooks.values()
                   if isinstance(hook, StepHook) and hook.room is not None]
    for state in candidates:
        original = state.model_ref() if state is not None else None
        if original is not None and wrapped_state(original) is state and shares_tables(model, original):
            return state
    return None


def adopt_orphan(model: nn.Module) -> Optional[State]:
    """A module of a wrapped model that outlived that model takes its wrap over; None for any other
    module. peft's ``merge_and_unload`` returns the base model of a wrapped PeftModel, and the caller
    drops the PeftModel: the base model's weights are still offloaded on that wrap's pager and its
    forwards still page them, but nothing could count or unwrap them any more (``ot.stats`` said it
    was not wrapped, ``ot.wrap_model`` that it was). It keeps that pager and budget, and gets the
    step hook a wrapped model carries.

    Each step can run again: a step hook left by an adoption cut short is replaced, and the state
    names ``model`` last, so until then the next use adopts it again."""
    state = wrapped_state(model)
    if state is None or state.model_ref() is not None:
        return None
    for key in [k for k, h in model._forward_pre_hooks.items()
                if isinstance(h, StepHook) and h.pager_ref is not None and h.pager_ref() is state.pager]:
        del model._forward_pre_hooks[key]
    state.step_hook = model.register_forward_pre_hook(StepHook(state.config, state.choice.budget_bytes, state.pager,
                                                               state=state))
    state.take_over(model)
    return state


def is_wrapped(model: nn.Module) -> bool:
    """Whether ``model`` is currently wrapped (by wrap_model or load_safetensors, or is a
    ``copy.deepcopy`` of a wrapped model, which this registers on its own pager, or a ``copy.copy``
    of one, which shares its wrap, or a module of a wrapped model that outlived it, which takes that
    wrap over)."""
    if not isinstance(model, nn.Module):
        return False
    if model_state(model) is None:
        adopt(model)
    return model_state(model) is not None


def adopt(model: nn.Module) -> Optional[State]:
    """``model``, not a wrapped model itself, adopted as one where it is a module that outlived its
    wrapped model, else where it is a deep copy of one; None when it is neither. The outlived module
    first: one whose adoption was cut short carries a step hook already, and would be taken for a
    deep copy (adopted on a new pager, its masters taken from the pager that pages them)."""
    state = adopt_orphan(model)
    return state if state is not None else adopt_copy(model)


def state_of(model: nn.Module) -> State:
    """The state of the wrapped ``model`` (or of the wrapped model it is a ``copy.copy`` of)."""
    if not is_wrapped(model):
        raise _not_wrapped(model)
    state = model_state(model)
    if state.loans:
        state.settle_loans()
    return state


def _not_wrapped(model: nn.Module) -> ValueError:
    """The error for ``model``, which is not a wrapped model, naming the wrapped model to pass instead
    where there is one: the one ``model`` is a module of, or one inside ``model`` (a PeftModel made
    around a wrapped base model). ``wrap_model`` of either names it too (``prepare.check_wrappable``)."""
    state = wrapped_state(model)
    owner = state.model_ref() if state is not None else None
    if owner is not None:
        return ValueError(
            f"offtensor: this {type(model).__name__} is a module of a wrapped {type(owner).__name__} (budget "
            f"{state.pager.budget_bytes} bytes on {state.pager.device}), not a wrapped model itself: its weights are "
            f"paged, counted and unwrapped with that {type(owner).__name__}'s; pass that {type(owner).__name__} instead")
    for name, sub in model.named_modules():
        state = wrapped_state(sub)
        if name and state is not None and state.model_ref() is sub:
            return ValueError(
                f"offtensor: this {type(model).__name__} is not wrapped, but its {type(sub).__name__} {name!r} is (budget "
                f"{state.pager.budget_bytes} bytes on {state.pager.device}); pass model.get_submodule({name!r}) instead")
    return ValueError(f"offtensor: this {type(model).__name__} is not wrapped; call ot.wrap_model(model, ...) first")
