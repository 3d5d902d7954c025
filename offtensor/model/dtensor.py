"""What a wrapped model refuses from torch.distributed: FSDP2 sharding an offloaded weight, and
``parallelize_module`` while any weight is offloaded, each before anything changes."""

from __future__ import annotations

import itertools

import torch
from torch import nn

from .. import leaves
from ..tensor import OffloadedTensor
from .state import WRAPPED, State


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
        f"do to a wrapped model's weights: the shard would leave host memory, and FSDP2 all-gathers from a copy of its "
        f"own. FSDP2 over offloaded weights is not supported: keep them out of it with fully_shard(module, "
        f"ignored_params={{...}}) (the frozen base of LoRA training), or for tensor parallelism run parallelize_module "
        f"first and ot.wrap_model after, on each rank. '{full_name}' was left as it was."
    )


def refuse_distribute(module: nn.Module) -> None:
    """``distribute_module`` (``parallelize_module``) asks a wrapped module whether it was
    distributed before it scatters any weight; an offloaded weight would reach gloo/NCCL inside a
    ``Tensor[][]`` argument, which the dispatcher never hands to the OffloadedTensor (rank 0 died
    of SIGSEGV). Refused at the first module asked while any weight of the model is offloaded, so
    no module has been parallelized yet when it raises."""
    state = WRAPPED.get(module)
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
