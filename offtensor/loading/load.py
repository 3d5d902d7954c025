"""load_safetensors: fill a model built on meta straight from safetensors files, every header
checked against the model and the placement chosen before a byte is read; the model changes only
after every byte has arrived."""

from __future__ import annotations

import os
from typing import Optional

from torch import nn

from ..config import OffloadConfig
from ..sim.expert_choice import choose_expert_placement
from ..model.prepare import check_wrappable, prepare
from ..pager import format_bytes, resolve_device
from .configs import physical_memory
from ..safetensors_files import CheckpointError, headers
from ..safetensors_paths import shard_files
from .names import architecture_problem, match
from .read import Progress, Reader, read


def load_safetensors(model: nn.Module, path, budget_gb: Optional[float] = None, device=None, *,
                     offload_gb: Optional[float] = None, prefetch: bool = True, policy=None,
                     strict: bool = True, progress: Optional[bool] = None, threads: Optional[int] = None,
                     convert_dtypes: bool = False, allow_outside_paths: bool = False, routing=None,
                     expert_compute: str = "device", expert_pool: bool = False) -> nn.Module:
    """Load ``model``'s weights (usually built on meta) from safetensors and wrap it for a budget.

    ``path`` is a ``.safetensors`` file, a directory of shards, or a ``*.safetensors.index.json``.
    Tied names need to be in the files once. With ``strict`` every weight the model lacks values
    for must be in the files and every tensor in the files must belong to the model.
    ``progress``: None shows a bar for loads of at least 256 MB (``OFFTENSOR_PROGRESS=0`` silences
    it, ``=1`` forces it), True/False force it. ``threads``: readers (default: the CPU count, 4..8,
    since they mostly wait on page faults; ``OFFTENSOR_LOAD_THREADS``). ``convert_dtypes``: floating
    tensors of another dtype in the files are converted to the model's instead of refused.
    ``allow_outside_paths``: an index may name shards outside its own directory (absolute paths,
    ``..``, symlinks leading elsewhere); by default such an index is refused, except for
    huggingface_hub's cache layout (``snapshots/<rev>/*`` linking to ``../../blobs``). The
    placement arguments, ``progress`` and ``threads`` make an ``OffloadConfig``; ``routing`` (an MoE
    model's measured routing, as for ``wrap_model``) decides the expert placement before any byte
    is read, else the loaded model decides from its own routing. ``expert_compute``: where a
    routed expert that is not cached on the device is computed, and ``expert_pool``, as for ``wrap_model``.
    """
    check_wrappable(model)
    config = OffloadConfig.from_arguments(budget_gb=budget_gb, offload_gb=offload_gb, device=device, prefetch=prefetch,
                                          policy=policy, progress=progress, load_threads=threads, routing=routing,
                                          expert_compute=expert_compute, expert_pool=expert_pool)
    return load(model, path, config, strict, convert_dtypes, allow_outside_paths)


def load(model: nn.Module, path, config: OffloadConfig, strict: bool, convert_dtypes: bool,
         allow_outside_paths: bool) -> nn.Module:
    """``load_safetensors`` once its arguments are settings: the one ``prepare`` pipeline, whose
    check step matches every header against the model and whose read step fills every destination
    after the placement (the expert placement too) is chosen; only then does the model change."""
    device = resolve_device(config.device)
    files = shard_files(path, allow_outside_paths)
    entries = headers(files)
    chosen = {}

    def check(groups):
        matched, problems = match(entries, model, groups, convert_dtypes, path, strict)
        architecture = architecture_problem(model, files)
        if architecture:
            problems.insert(0, architecture)
        if problems:
            raise CheckpointError("offtensor: cannot load " + os.fspath(path) + " into " + type(model).__name__
                                  + " (the model is unchanged):\n  " + "\n  ".join(problems))
        chosen.update(matched)

    def read_all(groups, placed, pager, config):
        _check_host_memory(path, groups, chosen, placed, device)
        total = sum(p.source.nbytes for _, ps in chosen.values() for p in ps)
        progress_bar = Progress(total, config.progress, f"offtensor: loading {os.path.basename(os.fspath(path))}")
        ok = False
        try:
            loaded = read(groups, chosen, placed, pager, Reader(device, config.load_threads, progress_bar))
            ok = True
        finally:
            progress_bar.close(ok)
        return loaded  # every byte is in place: only now does the model change

    prepare(model, config, device, check=check, choose_experts=choose_expert_placement, read=read_all)
    return model


def _check_host_memory(path, groups, chosen: dict, placed, device) -> None:
    """Refuse, before anything is allocated, a load whose host memory (the offloaded weights' host
    masters; every weight on the emulated device) is more than this machine has. Each master is
    allocated untouched, so a sum past the memory is not refused when allocated: the reads then
    fault it in until the kernel kills the process (a checkpoint, or a sparse file padded out to a
    config's absurd sizes, larger than the machine)."""
    memory = physical_memory()
    host = sum(g.nbytes for g in groups if any(id(m) in chosen for m in g)
               and (placed.offloads(g) or device.type == "cpu"))
    if memory is not None and host > memory:
        raise CheckpointError(f"offtensor: loading {os.fspath(path)} would take {format_bytes(host)} ({host} bytes) "
                              f"of host memory, more than this machine's {format_bytes(memory)} ({memory} bytes): "
                              f"nothing was allocated (the model is unchanged)")

