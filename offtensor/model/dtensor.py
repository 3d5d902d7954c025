"""What a wrapped model refuses from torch.distributed: FSDP2 managing an offloaded weight, in
either order (``fully_shard`` of a wrapped model, or a wrap that would offload what ``fully_shard``
manages), and ``parallelize_module`` while any weight is offloaded, each before anything changes."""

from __future__ import annotations


import torch
from torch import nn

from .. import leaves
from ..tensor import OffloadedTensor
from .state import State, offloaded_weights, wrapped_state


def _is_dtensor(t) -> bool:
    dtensor = getattr(getattr(torch.distributed, "tensor", None), "DTensor", None) if torch.distributed.is_available() else None
    return dtensor is not None and isinstance(t, dtensor)


def refuse_sharding_an_offloaded_weight(state: State, module: nn.Module, name: str, before, t) -> None:
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
        f"do to a wrapped model's weights: the shard would leave host memory, and {_FSDP2_UNSUPPORTED}, or for tensor "
        f"parallelism run parallelize_module first and ot.wrap_model after, on each rank. '{full_name}' was left as "
        f"it was."
    )


_FSDP2_UNSUPPORTED = (
    "FSDP2 all-gathers from a copy of its own, which an optimizer step on the offloaded weight would leave stale. "
    "FSDP2 over offloaded weights is not supported: keep them out of it with fully_shard(module, "
    "ignored_params={...}) (the frozen base of LoRA training)"
)


def fsdp_managed(model: nn.Module) -> dict:
    """(module, attribute name) -> the FSDP2 module that manages that parameter, for every
    parameter that a ``fully_shard`` inside ``model`` shards (its ``ignored_params`` are not)."""
    if not torch.distributed.is_available():
        return {}
    fsdp = getattr(getattr(torch.distributed, "fsdp", None), "FSDPModule", None)
    if fsdp is None:
        return {}
    managed = {}
    for module in model.modules():
        if not isinstance(module, fsdp):
            continue
        state = module._get_fsdp_state()
        for group in getattr(state, "_fsdp_param_groups", None) or [getattr(state, "_fsdp_param_group", None)]:
            for param in getattr(group, "fsdp_params", ()) if group is not None else ():
                info = param._module_info
                for owner, attr in ((info.module, info.param_name), *zip(info.shared_modules, info.shared_param_names)):
                    managed[(owner, attr)] = module
    return managed


def refuse_offloading_what_fsdp2_manages(model: nn.Module, groups) -> None:
    """``wrap_model`` after ``fully_shard`` would offload a weight FSDP2 manages: refused, naming
    it, before anything moves (the same refusal as ``fully_shard`` after ``wrap_model``). FSDP2
    all-gathers from its own copy of each shard, so the optimizer would step the offloaded master
    while every forward computed with the stale copy: training silently wrong."""
    managed = fsdp_managed(model)
    if not managed:
        return
    for group in groups:
        for member in group:
            for module, attr, _ in member.slots:
                if (module, attr) in managed:
                    name = member.names[0]
                    raise RuntimeError(
                        f"offtensor: '{name}' is managed by FSDP2 (fully_shard) and would be offloaded "
                        f"({member.tensor.numel() * member.tensor.element_size()} bytes of this rank's shard): "
                        f"{_FSDP2_UNSUPPORTED}, or keep what FSDP2 manages resident "
                        f"(wrap_model(..., policy={{'keep': [...]}})). Nothing was offloaded."
                    )


def refuse_offloading_an_fsdp2_parameter(state: State, module: nn.Module, name: str, t: torch.Tensor,
                                         resident: int) -> None:
    """Placement is about to offload ``t``, assigned as ``module.name``: refused if FSDP2 manages
    that parameter. FSDP2 assigns its unsharded parameter before each forward and backward and its
    sharded one after (through ``setattr`` once the module has a wrapping class); offloaded there,
    the model would compute with a copy FSDP2 never sees, and gradients and optimizer steps would go
    to the wrong tensor without an error. Only reached when placement offloads, never per op."""
    model = state.model_ref()
    if model is None or (module, name) not in fsdp_managed(model):
        return
    full_name = state.qualified_name(module, name)
    nbytes = t.numel() * t.element_size()
    raise RuntimeError(
        f"offtensor: '{full_name}' ({type(module).__name__}.{name}) is managed by FSDP2 (fully_shard), which "
        f"assigns it again at every forward and backward, and the tensor it assigns now ({nbytes} bytes, "
        f"{t.dtype}) does not fit beside {resident} bytes of resident weights and {state.working_set_bytes} bytes "
        f"of paging room in the budget of {state.pager.budget_bytes} bytes, so it would be offloaded where FSDP2 "
        f"does not see it (training would go wrong without an error). Keep what FSDP2 manages resident with room "
        f"for its unsharded parameters: raise budget_gb, or offload more of what FSDP2 does not manage "
        f"(fully_shard(..., ignored_params=...)). '{full_name}' was left as it was."
    )


def asked_by_distribute_module(frame) -> bool:
    """Whether ``frame`` runs torch's ``distribute_module``: only its read of
    ``_distribute_module_applied`` is refused. Any other reader (``hasattr`` over ``dir(module)``, as
    ``torch.jit.trace``, ``inspect.getmembers`` and completion in a shell do) finds no attribute."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import _api  # (imported once it is asked: a module of torch's own)

    return frame.f_code is _api.distribute_module.__code__


def refuse_distribute(module: nn.Module) -> None:
    """``distribute_module`` (``parallelize_module``) asks a wrapped module whether it was
    distributed before it scatters any weight; an offloaded weight would reach gloo/NCCL inside a
    ``Tensor[][]`` argument, which the dispatcher never hands to the OffloadedTensor (rank 0 died
    of SIGSEGV). Refused at the first module asked while any weight of the model is offloaded, so
    no module has been parallelized yet when it raises."""
    offloaded = offloaded_weights(module)
    if offloaded:
        name, t = offloaded[0]
        raise RuntimeError(
            f"offtensor: {type(module).__name__} '{wrapped_state(module).qualified_name(module, '').rstrip('.')}' of a wrapped model "
            f"is being parallelized (distribute_module / parallelize_module) while {len(offloaded)} of the model's "
            f"weights are offloaded ('{name}', {t.numel() * t.element_size()} bytes): parallelize first, then call "
            f"ot.wrap_model on each rank, so that each rank's host masters hold only its shard. Nothing was "
            f"parallelized."
        )
