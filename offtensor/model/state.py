"""A wrapped model's state: the registry of wrapped modules and what each model's wrap holds
(its pager, settings, placement, the tensors placed after wrapping), read by everything that
places, casts, copies or unwraps it."""

from __future__ import annotations

import itertools
import weakref
from typing import Optional

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from .. import moe
from .. import leaves
from .. import placement
from ..config import OffloadConfig
from ..pager import Pager, covering_range
from ..tensor import OffloadedTensor


# Every wrapped module, for walking a model's modules (unwrapping them all, a copy's adoption). A
# module's own state is looked up through the member it carries (``wrapped_state``), not here: a
# lookup in this table inside a traced forward (a ModuleList slice builds a new module, whose
# ``add_module`` asks whether it is wrapped) makes Dynamo guard on the table's entries, and the
# compiled model recompiles whenever any other wrapped model comes or goes.
WRAPPED: "weakref.WeakKeyDictionary[nn.Module, State]" = weakref.WeakKeyDictionary()
_MEMBER = "_offtensor_member"


class Member:
    """What a wrapped module carries in its ``__dict__``: its model's state, for the module it was
    given to only. A copy of the module (``copy.copy``, ``copy.deepcopy``, pickling) carries a
    member that names no module, so it is not taken for a module of the original's model."""

    __slots__ = ("module", "state")

    def __init__(self, module: Optional[nn.Module], state: "Optional[State]"):
        self.module = weakref.ref(module) if module is not None else _no_module
        self.state = state

    def __reduce__(self):
        return Member, (None, None)

    def __copy__(self):
        return Member(None, None)

    def __deepcopy__(self, memo):
        return Member(None, None)


def _no_module():
    return None


def enrol(module: nn.Module, state: "State") -> None:
    """``module`` is a module of ``state``'s wrapped model."""
    WRAPPED[module] = state
    module.__dict__[_MEMBER] = Member(module, state)


def withdraw(module: nn.Module) -> None:
    """``module`` is no longer a module of a wrapped model."""
    WRAPPED.pop(module, None)
    module.__dict__.pop(_MEMBER, None)


class Placed:
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


class State:
    def __init__(self, model, pager: Pager, choice: placement.Placement, config: OffloadConfig):
        self.model_ref = weakref.ref(model)
        self.pager = pager
        self.config = config
        self.working_set_bytes = choice.working_set_bytes
        self.choice = choice
        self.placed: dict = {}  # source storage (_cdata) -> Placed
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
        # The learned look-ahead a refresh of the registry installs again (``ExpertStacks.lookahead``),
        # kept here until it has: the detach drops it from the stacks, and a refresh cut short after
        # that would otherwise run again without it.
        self.reinstalling = None
        # A load_state_dict(assign=True) under way: (module, attribute) -> (the offloaded tensor it
        # replaces, the incoming one, is_buffer), so each key's placement counts its module's other
        # incoming tensors at their new sizes (room.reserve_paging_room); and the module it was
        # called on, whose load post-hook ends it.
        self.loading: dict = {}
        self.loading_root = None
        # Modules a load_state_dict has loaded whose post-hook has not yet placed what they hold
        # (under set_swap_module_params_on_conversion torch swaps the incoming tensors in): placed
        # by ``loads.load_whole`` when the load is cut short before that hook. Module -> None, in order.
        self.unplaced: dict = {}
        # Shallow copies (``copy.copy``) of its modules, which take the wrapping class too so that
        # what is assigned through them is placed; each gets its own class back when its original
        # leaves the model (``assignment.leave``).
        self.shallow_copies: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
        # (module, attribute) slots that ``on_host`` lent a host stand-in: not resident weights.
        self.lent_slots: frozenset = frozenset()
        # The ``on_host`` loans not given back yet (``host.HostLoan``), innermost last.
        self.loans: tuple = ()
        # How the routed experts were placed and why (``ot.stats(model).expert_placement``), and
        # the PlacementWatch while that is still to be decided from the model's own routing.
        self.expert_placement: Optional[dict] = None
        self.watch = None
        # Ids of the masters ``module.share_memory()`` put in shared memory (Hogwild): another
        # process may write them, which no cached copy here would see, so each forward drops their
        # cached copies first (``copies.StepHook``).
        self.shared_masters: set = set()

    def take_over(self, model: nn.Module) -> None:
        """``model``, a module of this wrapped model that outlived it, is the wrapped model from now on
        (``copies.adopt_orphan``). Its names in the old model are forgotten, and its expert stacks are
        registered again at the next step. The model last: until then ``model`` is still an orphan."""
        self.prefixes = weakref.WeakKeyDictionary()
        self.experts_stale = True
        self.model_ref = weakref.ref(model)

    def settle_loans(self) -> None:
        """Give back each ``on_host`` loan whose block this thread left without its exit running (a
        Ctrl-C at the exit's entry); called where a model is touched, before its lock is taken."""
        for loan in reversed(self.loans):
            if loan.ended():
                loan.settle()

    def refresh_experts(self) -> None:
        """Rebuild the pager's expert registry and router hooks. Stale until done: a refresh cut short
        (a Ctrl-C in a forward's step hook) runs again at the next step, rather than leaving the
        experts half detached (router hooks gone, no guesses) until the next change of a stack."""
        model = self.model_ref()
        if model is not None:
            if self.reinstalling is None:
                self.reinstalling = getattr(self.pager.experts, "lookahead", None)
            moe.detach(self.pager)
            moe.attach(model, self.pager, speculate=self.config.prefetch, compute=self.config.expert_compute,
                       compute_choice=self.config.expert_compute_choice, pool=self.config.expert_pool,
                       room_needed=self.room_needed())
            if self.reinstalling is not None:  # the learned look-ahead, for the stacks registered anew
                moe.reinstall(self.pager, self.reinstalling)
        self.reinstalling = None
        self.experts_stale = False

    def room_needed(self):
        """() -> the bytes this model's largest op pages at once (``working_set_bytes``, as it is
        re-planned), for the device memory the MoE layer takes from the budget (held weakly: the
        pager's stacks do not keep the state alive)."""
        ref = weakref.ref(self)
        return lambda: getattr(ref(), "working_set_bytes", 0)

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
        self.placed[source.untyped_storage()._cdata] = Placed(source, target, module, name)

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


def wrapped_state(module: nn.Module) -> Optional[State]:
    """The state of the wrapped model that ``module`` is (or is a module of), or None. A copy of a
    wrapped model is not adopted here (``copies.state_of`` does that). Read from the module itself,
    so that a traced forward guards on nothing but the module."""
    member = module.__dict__.get(_MEMBER)
    return member.state if member is not None and member.module() is module else None


def member_module(module: nn.Module) -> Optional[nn.Module]:
    """The module named by the member ``module`` carries: ``module`` itself for a module of a wrapped
    model; the original for a shallow copy of one (``copy.copy`` carries the original's member
    object as it is); None when it carries none, or one naming no live module."""
    member = module.__dict__.get(_MEMBER)
    return member.module() if member is not None else None


def refuse_wrapped_elsewhere(module: nn.Module, doing: str, state: "Optional[State]" = None) -> None:
    """Refuse ``doing`` with ``module`` where it, or a module in it, is already a module of a wrapped
    model other than ``state``'s (wrapped on its own, or shared with another wrapped model): its
    weights would be paged under two budgets at once and that wrap's stats go stale. Raises before
    anything changes, naming the module, as ``wrap_model`` of a wrapped model itself does."""
    for name, sub in module.named_modules():
        other = wrapped_state(sub)
        owner = other.model_ref() if other is not None and other is not state else None
        if owner is None:
            continue
        own = owner is sub
        what = "wrapped on its own" if own else f"a module of another wrapped model, a {type(owner).__name__}"
        unwrap = (f"ot.unwrap_model on that {type(owner).__name__}" if not own
                  else f"ot.unwrap_model(model.get_submodule({name!r}))" if name else "ot.unwrap_model on it")
        which = f"{type(sub).__name__} '{name}' of this {type(module).__name__}" if name else f"this {type(sub).__name__}"
        raise RuntimeError(
            f"offtensor: {which} is {what} (budget "
            f"{other.pager.budget_bytes} bytes on {other.pager.device}); call {unwrap} before {doing}. Nothing was "
            f"changed.")


def offloaded_weights(module: nn.Module) -> list:
    """``(name, tensor)`` of each weight of ``module``'s wrapped model with an offloaded leaf, in the
    model's order (empty for a module of no wrapped model): what refusals name."""
    state = wrapped_state(module)
    model = state.model_ref() if state is not None else None
    if model is None:
        return []
    return [(n, t) for n, t in itertools.chain(model.named_parameters(), model.named_buffers())
            if any(isinstance(leaf, OffloadedTensor) for leaf in leaves.leaf_tensors(t))]


def shares_tables(module: nn.Module, original: nn.Module) -> bool:
    """``module`` is ``original`` or a shallow copy of it (``copy.copy``): the very same module,
    parameter and buffer tables, so the same modules and weights under a second name."""
    return module is original or (module._modules is original._modules and module._parameters is original._parameters
                                  and module._buffers is original._buffers)


def placing_target(module: nn.Module) -> tuple:
    """(``placing_state``, the module to place into) for what is assigned into, loaded into or cast in
    ``module``: ``module`` itself, or, for a shallow copy of a module of a wrapped model (it carries
    the original's member and shares its tables), the original: a weight registered through the copy
    lands in the original's tables, so it is placed, named and counted as through the original.
    (None, ``module``) where nothing is to be placed."""
    state = placing_state(module)
    if state is not None:
        return state, module
    original = member_module(module)
    if original is None or original is module or not shares_tables(module, original):
        return None, module
    state = placing_state(original)
    return (state, original) if state is not None else (None, module)


def placing_state(module: nn.Module) -> Optional[State]:
    """``wrapped_state(module)`` when what is assigned into, cast in or loaded into ``module`` is to
    be placed. None also while ``ot.plan`` runs the model on a meta pager: meta tensors hold no
    bytes, and the plan counts the bytes its placement chose, as a GPU run would hold them."""
    state = wrapped_state(module)
    if state is None or state.pager.device.type == "meta":
        return None
    if state.loans:
        state.settle_loans()
    return state


def pager_of(model: nn.Module) -> Optional[Pager]:
    """The pager of the wrapped model that ``model`` is (or is a module of), or None."""
    state = wrapped_state(model)
    return state.pager if state is not None else None
