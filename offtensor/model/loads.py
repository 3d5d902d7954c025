"""``load_state_dict`` into a wrapped model and ``state_dict()`` out of it: what a load brought is
placed under the budget, and the state dict's offloaded values pickle as plain CPU tensors."""

from __future__ import annotations

import torch
from torch import nn

from .. import leaves
from ..tensor import OffloadedTensor
from .moves import resident_bytes
from .place import place
from .state import State, placing_target


def after_load(module, incompatible_keys):
    """load_state_dict post-hook. With ``torch.__future__.set_swap_module_params_on_conversion``
    load_state_dict swaps loaded values into the existing Parameter objects, so no registration
    hook sees them; place what this module now holds unless it is on the device within budget."""
    state, module = placing_target(module)  # a shallow copy's tables are its original's
    model = state.model_ref() if state is not None else None
    if model is None:
        return
    with state.pager.lock:
        try:
            # A parent's own tensors that torch swapped in are placed by its post-hook, after its
            # children's: they are not resident weights beside which the children's must fit.
            _place_loaded(state, model, module, _unplaced_slots(state, module))
            state.unplaced.pop(module, None)
        finally:
            if state.loading_root is module:  # the last post-hook of load_state_dict(assign=True)
                state.loading, state.loading_root = {}, None


def load_whole(load, module, *args, **kwargs):
    """``module.load_state_dict(*args, **kwargs)`` (``load``, the user class's own), which a Ctrl-C
    or a hook's exception may cut short between two of its steps:

    - Under ``set_swap_module_params_on_conversion`` torch swaps each incoming tensor into its
      Parameter object and only the module's post-hook (``after_load``) places it: cut short in
      between, a host tensor would stay where the wrap offloaded a weight, resident beside a room
      planned without it. The modules whose post-hook has not placed what they hold
      (``State.unplaced``) are placed here, as the post-hooks would have; where that fails, as a
      post-hook would have failed, the load's own exception is the one raised.
    - A load with ``assign=True`` records the tensors it replaces (``State.loading``) until its
      root's last post-hook; left, the record would hold every replaced weight's host master alive
      and counted until the next such load. It ends however the load ends: stores only in the
      ``finally``, where Python raises no Ctrl-C before they run."""
    state, owner = placing_target(module)
    try:
        return load(*args, **kwargs)
    except BaseException:
        if state is not None and state.unplaced:
            try:
                _place_unplaced(state)
            except Exception:
                pass  # (the error a post-hook raised placing it: the load's own, raised below)
        raise
    finally:
        if state is not None:
            state.unplaced = {}  # (a module kept here would outlive its removal from the model)
            if state.loading_root is owner:
                state.loading, state.loading_root = {}, None


def _place_unplaced(state: State) -> None:
    """Place what the modules a load cut short left unplaced, each module's tensors beside the
    others' still to be placed (``_unplaced_slots``)."""
    model = state.model_ref()
    if model is None:
        return
    with state.pager.lock:
        for m in list(state.unplaced):
            _place_loaded(state, model, m, _unplaced_slots(state, m))
            state.unplaced.pop(m, None)


def _unplaced_slots(state: State, module: nn.Module) -> frozenset:
    """The (module, attribute) slots of the modules in ``State.unplaced`` but ``module`` that hold
    a plain tensor no placement has counted as resident (``resident_ptrs``): what torch swapped in
    there waits for its module's post-hook, and is not counted as resident meanwhile."""
    return frozenset(
        (m, attr) for m in state.unplaced if m is not module for table in (m._parameters, m._buffers)
        for attr, t in table.items()
        if t is not None and not isinstance(t, OffloadedTensor) and not t.is_meta and t.layout == torch.strided
        and t.untyped_storage().data_ptr() not in state.resident_ptrs
    )


def _place_loaded(state: State, model: nn.Module, module: nn.Module, elsewhere: frozenset = frozenset()) -> None:
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
    resident = resident_bytes(model, pager.device)
    if all(t.device == pager.device for t in held) and resident + state.working_set_bytes <= pager.budget_bytes:
        pager.recount_resident(resident)  # cached copies make room first (assign=True on a warm cache)
        return
    # Tensors of this module not placed yet do not count as resident while their siblings are placed.
    pending = {(module, attr) for _, attr, _, _ in plain} | elsewhere
    for table, attr, is_buffer, t in plain:
        pending.discard((module, attr))
        new = place(state, module, attr, t, is_buffer, attaching=((), frozenset(pending)))
        if new is not None:
            table[attr] = new


def portable_state_dict(module, state_dict, prefix, local_metadata) -> None:
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
