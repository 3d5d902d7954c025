"""Other offloaders and dispatchers over a wrapped model (accelerate's hooks, diffusers' group
offloading and a pipeline's CPU offloading), in either order: what would move offloaded weights a
second time, or whole onto another device, is refused where it is registered, before any weight
moves; hooks that move only what offtensor keeps resident, or move weights to the device they are
already on, are left to run.

Each library first asks a module whether it has an accelerate hook (``_hf_hook``): accelerate's
``add_hook_to_module`` before it attaches one (and before the hook's ``init_hook`` moves
anything), diffusers' group offloading before it builds its groups, and a pipeline's
``enable_model_cpu_offload`` / ``enable_sequential_cpu_offload`` (through ``remove_all_hooks``)
before it hooks any component. A wrapped module's class answers that question through
``asked_for_hooks`` when it has no hook. Nothing runs per op; a module with a hook reads it
through a property, a dict lookup at each of accelerate's hooked forwards."""

from __future__ import annotations

import sys
from collections.abc import Mapping

import torch
from torch import nn

from .. import leaves
from ..tensor import OffloadedTensor
from .state import State, wrapped_state

# The accelerate calls that offload every weight of the module they are given. They attach a
# hook that moves nothing first (inputs and outputs on one device), so they are known by name
# rather than by the offloading hooks they attach after it.
_OFFLOADING_CALLS = ("cpu_offload", "disk_offload")

# What the refusals say an offloading hook, and a model-offloading hook, would do, and instead.
_OFFLOADING = (
    "accelerate would keep a copy of each weight of its own (in CPU memory or on disk), leave a meta placeholder in "
    "the model, which ot.unwrap_model would give back, and put the whole weight on the device at each forward, "
    "outside the budget")
_NOT_OFFLOADING = (
    "leave this model out of accelerate's offloading (offtensor already bounds what it holds on the device), or "
    "call ot.unwrap_model(model) first to use accelerate's instead")
_MOVING_WHOLE = (
    "its hook moves the whole model to the CPU (module.to('cpu')) after use and back to the device whole before the "
    "next, outside the budget")
_NOT_MOVING_WHOLE = (
    "leave this model out of model offloading (offload the other models with accelerate.cpu_offload_with_hook; the "
    "budget already bounds what this one holds on the device), or call ot.unwrap_model(model) first")


def asked_for_hooks(module: nn.Module, caller) -> None:
    """``module`` (of a wrapped model, with no accelerate hook) is asked for ``_hf_hook`` by the
    code running in ``caller``: refuse here if that code is about to offload or move its weights."""
    hooks = sys.modules.get("accelerate.hooks")
    if hooks is not None and caller.f_code is getattr(getattr(hooks, "add_hook_to_module", None), "__code__", None):
        _judge_accelerate_hook(module, caller)
        return
    if _asked_by_pipeline_offloading(caller):
        _refuse_pipeline_offloading(module, caller)
        return
    group_offloading = sys.modules.get("diffusers.hooks.group_offloading")
    check = getattr(group_offloading, "_raise_error_if_accelerate_model_or_sequential_hook_present", None)
    if check is not None and caller.f_code is getattr(check, "__code__", None):
        _refuse_group_offloading(module, caller)


def _offloaded_in(module: nn.Module, recurse: bool = True) -> list:
    """``(name in module, tensor)`` of each tensor of ``module`` with an offloaded leaf."""
    return [(n, t) for n, t in (*module.named_parameters(recurse=recurse), *module.named_buffers(recurse=recurse))
            if any(isinstance(leaf, OffloadedTensor) for leaf in leaves.leaf_tensors(t))]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _where(state: State, module: nn.Module) -> str:
    """``<Module> '<name>' of <Model>`` as wrap's other refusals name a module, or ``this <Model>``
    for the wrapped model itself, or for a module holding it."""
    model = state.model_ref()
    if model is None or module is model or wrapped_state(module) is not state:
        return f"this {type(module).__name__}"
    name = state.qualified_name(module, "").rstrip(".")
    return f"{type(module).__name__} '{name}' of {type(model).__name__}"


def _accelerate_calls(frame) -> list:
    """The frames of accelerate's code from ``frame`` outwards: the last is the call the user made
    (``cpu_offload``, ``dispatch_model``, ...), or the one a library made for them."""
    calls = []
    while frame is not None and frame.f_globals.get("__name__", "").startswith("accelerate."):
        calls.append(frame)
        frame = frame.f_back
    return calls


def _offloads(hooks: list, calls: list) -> bool:
    """Whether the accelerate call attaching ``hooks`` offloads weights: a hook with ``offload``,
    a call of ``_OFFLOADING_CALLS``, or a call given ``offload=True`` (``attach_align_device_hook``)
    or a map with an offloaded entry (``dispatch_model`` with "cpu" or "disk" entries on a GPU, or
    "disk" entries, reaches ``attach_align_device_hook_on_blocks`` with one)."""
    if any(getattr(h, "offload", False) is True for h in hooks):
        return True
    for frame in calls:
        if frame.f_code.co_name in _OFFLOADING_CALLS:
            return True
        offload = frame.f_locals.get("offload")
        if offload is True or (isinstance(offload, Mapping) and any(v is True for v in offload.values())):
            return True
    return False


def _judge_accelerate_hook(module: nn.Module, frame) -> None:
    """accelerate's ``add_hook_to_module(module, hook)`` is about to run ``hook.init_hook``."""
    state = wrapped_state(module)
    hook = frame.f_locals.get("hook")
    if state is None or hook is None:
        return
    hooks = list(getattr(hook, "hooks", None) or [hook])
    calls = _accelerate_calls(frame)
    call = calls[-1].f_code.co_name
    scope = calls[-1].f_locals.get("model", calls[-1].f_locals.get("module"))
    scope = scope if isinstance(scope, nn.Module) else module
    if _offloads(hooks, calls):
        _refuse_accelerate(state, scope, f"accelerate's {call} would offload", _OFFLOADING, _NOT_OFFLOADING)
    if any(type(h).__name__ == "CpuOffload" for h in hooks):
        doing = f"accelerate's model offloading ({call}, which diffusers' enable_model_cpu_offload calls) would move"
        _refuse_accelerate(state, module, doing, _MOVING_WHOLE, _NOT_MOVING_WHOLE)
    for h in hooks:  # an execution device's hook moves the module's weights there (init_hook)
        device = getattr(h, "execution_device", None)
        if type(h).__name__ != "AlignDevicesHook" or device is None or _same_device(device, state.pager.device):
            continue
        offloaded = _offloaded_in(module, recurse=bool(getattr(h, "place_submodules", False)))
        if offloaded:
            _refuse_move_elsewhere(state, module, call, torch.device(device), offloaded)


def _same_device(device, pager_device: torch.device) -> bool:
    device = torch.device(device)
    return device.type == pager_device.type and (device.index is None or pager_device.index is None
                                                 or device.index == pager_device.index)


def _refuse_accelerate(state: State, scope: nn.Module, doing: str, why: str, instead: str) -> None:
    """Refuse ``doing`` ``scope`` where any of its weights is offloaded; where none is, accelerate
    may take over the weights offtensor keeps resident, as it would in an unwrapped model."""
    offloaded = _offloaded_in(scope)
    if not offloaded:
        return
    name, t = offloaded[0]
    raise RuntimeError(
        f"offtensor: {doing} {_where(state, scope)}, which is wrapped: {len(offloaded)} of its weights are "
        f"offloaded by offtensor already, such as '{name}' ({_nbytes(t)} bytes), under a budget of "
        f"{state.pager.budget_bytes} bytes on {state.pager.device}, and {why}. Two offloaders of the same weights "
        f"cannot both be right: {instead}. Nothing was moved.")


def _refuse_move_elsewhere(state: State, module: nn.Module, call: str, device: torch.device, offloaded: list) -> None:
    name, t = offloaded[0]
    raise RuntimeError(
        f"offtensor: accelerate's {call} would move the weights of {_where(state, module)} to {device}, but it is "
        f"wrapped for {state.pager.device}: {len(offloaded)} of them are offloaded, such as '{name}' "
        f"({_nbytes(t)} bytes), and would be copied onto {device} whole, outside the budget. Dispatch the model to "
        f"the device it is wrapped for (one device), or call ot.unwrap_model(model) first. Nothing was moved.")


def _refuse_group_offloading(module: nn.Module, frame) -> None:
    """diffusers' ``apply_group_offloading`` (a model's or a pipeline's ``enable_group_offload``)
    asks each module of the model it offloads for accelerate hooks before it builds any group."""
    state = wrapped_state(module)
    scope = frame.f_locals.get("module")
    scope = scope if isinstance(scope, nn.Module) else module
    offloaded = _offloaded_in(scope) if state is not None else []
    if not offloaded:
        return
    name, t = offloaded[0]
    where = _where(state, scope) if wrapped_state(scope) is state else f"this {type(scope).__name__}"
    raise RuntimeError(
        f"offtensor: diffusers' group offloading (enable_group_offload / apply_group_offloading) would offload "
        f"{where}, which is wrapped: {len(offloaded)} of its weights are offloaded by offtensor already, such as "
        f"'{name}' ({_nbytes(t)} bytes), under a budget of {state.pager.budget_bytes} bytes on {state.pager.device}. "
        f"Group offloading would move each group's weights to the device whole at each forward, outside the "
        f"budget. Leave this model out of it (a pipeline's enable_group_offload(..., exclude_modules=[...]) takes "
        f"its name), or call ot.unwrap_model(model) first. Nothing was moved.")


_PIPELINES = "diffusers.pipelines.pipeline_utils"
_PIPELINE_OFFLOADING = ("enable_model_cpu_offload", "enable_sequential_cpu_offload")


def _asked_by_pipeline_offloading(caller) -> bool:
    """A diffusers pipeline's ``enable_model_cpu_offload`` / ``enable_sequential_cpu_offload``
    first removes its components' hooks (``remove_all_hooks``), asking each whether it has one,
    before it hooks any: the one point where the whole call can be refused with nothing hooked."""
    outer = caller.f_back
    return (caller.f_code.co_name == "remove_all_hooks" and caller.f_globals.get("__name__") == _PIPELINES
            and outer is not None and outer.f_code.co_name in _PIPELINE_OFFLOADING
            and outer.f_globals.get("__name__") == _PIPELINES)


def _refuse_pipeline_offloading(module: nn.Module, caller) -> None:
    """Refuse a pipeline's CPU offloading that would hook the wrapped component ``module``: all of
    the model offloading sequence (``model_cpu_offload_seq``) and every other component not in
    ``_exclude_from_cpu_offload`` (which are moved to the device instead, where a wrapped model
    already is)."""
    state, offloaded = wrapped_state(module), _offloaded_in(module)
    pipe = caller.f_locals.get("self")
    names = [n for n, c in (getattr(pipe, "components", None) or {}).items() if c is module]
    if state is None or not offloaded or not names:
        return
    how, name = caller.f_back.f_code.co_name, names[0]
    excluded = name in (getattr(pipe, "_exclude_from_cpu_offload", None) or ())
    sequence = (getattr(pipe, "model_cpu_offload_seq", None) or "").split("->")
    if excluded and (how == "enable_sequential_cpu_offload" or name not in sequence):
        return
    weight, t = offloaded[0]
    if how == "enable_sequential_cpu_offload":
        what, instead = _OFFLOADING, (
            f"leave it out (pipe._exclude_from_cpu_offload = [..., '{name}']: the pipeline then moves it to the "
            f"device, where it is already), or call ot.unwrap_model on it first")
    else:
        what, instead = _MOVING_WHOLE, (
            "offload the other components yourself with accelerate.cpu_offload_with_hook(component, device, "
            "prev_module_hook=...) in the pipeline's order and leave this one out (the pipeline hooks every model of "
            f"its sequence {'->'.join(sequence)}), or call ot.unwrap_model on it first")
    raise RuntimeError(
        f"offtensor: {type(pipe).__name__}.{how} would hook its component '{name}', a wrapped {type(module).__name__}: "
        f"{len(offloaded)} of its weights are offloaded by offtensor already, such as '{weight}' ({_nbytes(t)} bytes), "
        f"under a budget of {state.pager.budget_bytes} bytes on {state.pager.device}, and {what}. Two offloaders of "
        f"the same weights cannot both be right: {instead}. No component was hooked.")


# ---------------------------------------------------------------------------- a model hooked before wrapping


def refuse_other_offloaders(model: nn.Module) -> None:
    """Refuse to wrap a model that another offloader already moves: accelerate's offloading hooks
    (``from_pretrained(..., device_map=...)`` with "cpu" or "disk" entries, ``cpu_offload``,
    ``disk_offload``), accelerate's model offloading (``cpu_offload_with_hook``, diffusers'
    ``enable_model_cpu_offload``) and diffusers' group offloading. Raises before anything moves,
    naming the module."""
    _refuse_accelerate_offload(model)
    _refuse_diffusers_group_offload(model)


def _accelerate_hooks(module: nn.Module) -> list:
    hook = module.__dict__.get("_hf_hook")
    return list(getattr(hook, "hooks", None) or ([hook] if hook is not None else []))


def _refuse_accelerate_offload(model: nn.Module) -> None:
    """Offloaded by accelerate's hooks, its weights are meta tensors between forwards, filled from
    accelerate's own copies at each one; under model offloading the hook moves the whole model to
    the CPU after use and back before the next. Two offloaders of the same weights cannot both be
    right."""
    for name, module in model.named_modules():
        hooks = _accelerate_hooks(module)
        if any(getattr(h, "offload", False) is True for h in hooks):
            device_map = getattr(model, "hf_device_map", None)
            raise ValueError(
                f"offtensor: {type(module).__name__} '{name}' of {type(model).__name__} has its weights offloaded by "
                f"accelerate's hooks{f' (hf_device_map {device_map})' if device_map else ''}: they are meta tensors "
                f"that accelerate fills at each forward, and offtensor would offload the same weights. Load the "
                f"model without offloading in its device_map (device_map=None or {{'': 'cpu'}}) and wrap it, or "
                f"load it with ot.from_pretrained(path, budget_gb=...). Nothing was changed.")
        if any(type(h).__name__ == "CpuOffload" for h in hooks):
            raise ValueError(
                f"offtensor: {type(module).__name__} '{name}' of {type(model).__name__} is under accelerate's model "
                f"offloading (cpu_offload_with_hook, diffusers' enable_model_cpu_offload), whose hook moves the whole "
                f"model to the CPU after use and back to the device before the next, and offtensor would offload "
                f"its weights as well. Remove the hook first (hook.remove(), or "
                f"accelerate.hooks.remove_hook_from_module(model)) and wrap it: the budget bounds what its weights "
                f"hold on the device. Nothing was changed.")


# The names diffusers registers its group offloading hooks under (diffusers.hooks.group_offloading).
_GROUP_OFFLOAD_HOOKS = ("group_offloading", "lazy_prefetch_group_offloading")


def _refuse_diffusers_group_offload(model: nn.Module) -> None:
    """A model whose weights diffusers' group offloading moves (``enable_group_offload``,
    ``apply_group_offloading``, a pipeline's ``enable_group_offload``): its hooks move each group's
    weights to the onload device before the group's forward and back after it, so offtensor would
    offload weights that diffusers moves as well, each offloader under its own count of the device's
    bytes."""
    for name, module in model.named_modules():
        hooks = getattr(getattr(module, "_diffusers_hook", None), "hooks", None)
        if isinstance(hooks, dict) and any(h in hooks for h in _GROUP_OFFLOAD_HOOKS):
            raise ValueError(
                f"offtensor: {type(module).__name__} '{name}' of {type(model).__name__} has its weights offloaded by "
                f"diffusers' group offloading (enable_group_offload / apply_group_offloading), which moves them to "
                f"the onload device at each forward, and offtensor would offload the same weights. Build the model "
                f"without group offloading and wrap it: the budget bounds what its weights hold on the device. "
                f"Nothing was changed.")


def refuse_dispatched_elsewhere(model: nn.Module, device: torch.device) -> None:
    """A model that accelerate dispatched across devices (``from_pretrained(..., device_map=...)``
    over several GPUs, ``dispatch_model``): its hooks move each module's inputs to that module's
    execution device, where its weights would no longer be once wrapped for ``device``. Refused
    before anything moves, naming the module and its device."""
    for name, module in model.named_modules():
        for h in _accelerate_hooks(module):
            execution = getattr(h, "execution_device", None)
            if execution is None or _same_device(execution, device):
                continue
            if not any(True for _ in module.parameters(recurse=bool(getattr(h, "place_submodules", False)))):
                continue  # a hook over no weights of its own moves inputs only
            raise ValueError(
                f"offtensor: {type(module).__name__} '{name}' of {type(model).__name__} is dispatched by accelerate "
                f"to {torch.device(execution)} (its hooks move the module's inputs there), and offtensor would "
                f"place its weights for {device}. Dispatch the model to the one device it is wrapped for (or load "
                f"it without a device_map), then wrap it. Nothing was changed.")


def remade_by_accelerate(data: torch.Tensor, requires_grad: bool, caller):
    """What ``type(p)(data, requires_grad=...)`` makes where accelerate's
    ``set_module_tensor_to_device(module, name, device, value=...)`` re-creates an offloaded weight
    of a wrapped module from new values (``load_checkpoint_in_model`` and
    ``load_checkpoint_and_dispatch`` with a device map call it for every key), or None for what
    nn.Parameter makes. accelerate writes what it makes into ``module._parameters`` itself, past the
    wrapping class, so a plain Parameter there was a whole resident weight that nothing placed:
    a checkpoint loaded so into a wrapped model left every weight resident, several times the
    budget, without a word. The values are written into the weight's host master instead, as
    ``load_state_dict`` writes them, and the weight itself is what accelerate puts back."""
    modeling = sys.modules.get("accelerate.utils.modeling")
    if caller.f_code is not getattr(getattr(modeling, "set_module_tensor_to_device", None), "__code__", None):
        return None
    frame = caller.f_locals
    module, name = frame.get("module"), frame.get("tensor_name")
    weight = module._parameters.get(name) if isinstance(module, nn.Module) else None
    state = wrapped_state(module) if isinstance(weight, OffloadedTensor) else None
    if state is None or frame.get("value") is None or isinstance(data, OffloadedTensor) or data.is_meta:
        return None  # (a weight to meta and back: made as nn.Parameter makes it)
    if not _same_device(data.device, weight.device) or data.dtype != weight.dtype or data.shape != weight.shape:
        raise RuntimeError(
            f"offtensor: accelerate's set_module_tensor_to_device would replace "
            f"'{state.qualified_name(module, name)}' ({_nbytes(weight)} bytes, {weight.dtype}, offloaded for "
            f"{weight.device}) with a plain {data.dtype} tensor of shape {tuple(data.shape)} on {data.device}, which "
            f"would be resident, whole and outside the budget. Load values of the weight's dtype onto its device "
            f"(device_map={{'': '{weight.device}'}}, no dtype=), cast the wrapped model first (model.to(dtype)), or "
            f"use model.load_state_dict / ot.load_safetensors. This weight was not changed.")
    with torch.no_grad():
        weight.copy_(data)
    return weight if weight.requires_grad == requires_grad else type(weight)(weight, requires_grad=requires_grad)


OffloadedTensor.set_remade(remade_by_accelerate)
