"""from_pretrained: a transformers checkpoint directory -> its model, built from a checked
``config.json`` (once all on meta, to match it against the files; then with buffers kept real), tied
as transformers ties it, and filled by the loader."""

from __future__ import annotations

import copy
import os
import stat
import warnings
from typing import Optional

import torch
from torch import nn

from ..config import OffloadConfig
from .configs import building, check_on_meta, counted_build, read_config
from ..safetensors_files import CheckpointError, headers
from ..safetensors_paths import directory_checkpoint, shard_files, stat_or_none
from .load import load
from .scoped import ScopedHooks
from .ties import apply as apply_ties
from .ties import decide as decide_ties


def _on_meta(state, module, name, param):
    if param is None or param.is_meta:
        return None
    on_meta = type(param)(param.to("meta"), requires_grad=param.requires_grad)
    on_meta.__dict__.update(param.__dict__)
    return on_meta


# ``with _parameters_on_meta():`` builds parameters on meta and leaves buffers real, like
# accelerate's ``init_empty_weights(include_buffers=False)``: buffers computed at init (rotary
# frequencies) are not in checkpoints, so they must keep their values. Only the thread inside the
# block, while the frame that entered it runs, is affected (``scoped.py``): a module built meanwhile
# in another thread gets ordinary weights; concurrent builds each see their own.
_parameters_on_meta = ScopedHooks(parameter=_on_meta)


def from_pretrained(path, budget_gb: Optional[float] = None, device=None, dtype: Optional[torch.dtype] = None, *,
                    offload_gb: Optional[float] = None, prefetch: bool = True, policy=None,
                    progress: Optional[bool] = None, threads: Optional[int] = None, model_class=None,
                    trust_remote_code: bool = False, strict: bool = True,
                    allow_outside_paths: bool = False, routing=None, expert_compute: str = "device", expert_pool: bool = False) -> nn.Module:
    """A transformers checkpoint directory -> its model built on meta from ``config.json``, every
    shard read through ``load_safetensors``, wrapped for the budget, in eval mode.

    ``dtype``: None keeps the checkpoint's floating dtype; another floating dtype converts while
    loading. ``model_class``: a transformers class to build instead of ``config.architectures[0]``
    (or ``AutoModelForCausalLM`` when the config names none). ``allow_outside_paths``: as for
    ``load_safetensors``. ``expert_compute``, ``expert_pool``: as for ``wrap_model``. transformers is needed only here.

    config.json is checked, and the model built once with every tensor on meta and matched against
    the files, before anything is allocated (``configs.py``); tied weights are decided from the
    files as transformers decides them (``ties.py``).
    """
    try:
        import transformers
    except ImportError:
        raise ImportError(
            "offtensor.from_pretrained needs transformers (pip install transformers) to build the model from "
            "config.json; without it, build the model on meta yourself and call ot.load_safetensors(model, path)"
        ) from None
    root = os.fspath(path)
    found = stat_or_none(root, "the checkpoint directory")
    config_file = stat_or_none(os.path.join(root, "config.json"), "the config") if found else None
    # A config.json that is there but no regular file (a FIFO, a device) is refused as such when read.
    if not found or not stat.S_ISDIR(found.st_mode) or not config_file:
        raise FileNotFoundError(f"offtensor: {root!r} is not a transformers checkpoint directory (no config.json)")
    config = OffloadConfig.from_arguments(budget_gb=budget_gb, offload_gb=offload_gb, device=device, prefetch=prefetch,
                                          policy=policy, progress=progress, load_threads=threads, routing=routing,
                                          expert_compute=expert_compute, expert_pool=expert_pool)
    model_config = read_config(root, trust_remote_code)
    files = shard_files(root, allow_outside_paths)
    entries = headers(files)
    if dtype is None:
        by_dtype: dict = {}
        for entry in entries.values():
            if entry.dtype.is_floating_point:
                by_dtype[entry.dtype] = by_dtype.get(entry.dtype, 0) + entry.nbytes
        dtype = max(by_dtype, key=by_dtype.get) if by_dtype else torch.get_default_dtype()
    cls = model_class if model_class is not None else _architecture(transformers, model_config, root)

    def build(model_config):
        with building(root, model_config):
            if cls is None:
                return transformers.AutoModelForCausalLM.from_config(model_config, dtype=dtype,
                                                                     trust_remote_code=trust_remote_code)
            return cls._from_config(model_config, dtype=dtype)

    ties = check_on_meta(build, copy.deepcopy(model_config), entries, root, strict)
    with _parameters_on_meta(), counted_build(entries, model_config, root):
        model = build(model_config)
    if ties is None:  # the model cannot be built on meta (its __init__ reads values): decide on this build
        decide_ties(model, entries)
    else:
        apply_ties(model, ties)
    model.eval()
    index = directory_checkpoint(root)[0]  # the one shard_files chose: named in the load's messages
    model = load(model, index or root, config, strict, convert_dtypes=True, allow_outside_paths=allow_outside_paths)
    if config.prefetch:
        _install_lookahead(model, root)
    return model


def _architecture(transformers, model_config, root: str):
    """The transformers model class config.json's ``architectures`` names, or None (then
    ``AutoModelForCausalLM``). Only model classes: any other name of transformers' is passed over."""
    names = getattr(model_config, "architectures", None) or []
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise CheckpointError(f"offtensor: {os.path.join(root, 'config.json')!r} gives architectures = {names!r:.200}, "
                              f"not a list of transformers model class names: the checkpoint's config is corrupt")
    found = (getattr(transformers, n, None) for n in names)
    return next((c for c in found if isinstance(c, type) and issubclass(c, transformers.PreTrainedModel)), None)


def _install_lookahead(model: nn.Module, root: str) -> None:
    """The learned look-ahead saved beside the checkpoint (``lookahead.safetensors``:
    ``offtensor.moe.predictor``) given to the model's routing guesses, where its routed experts are
    offloaded. One that cannot be read or installed (another model's, too big for the budget) is
    left out with a warning naming it: the model loads as it would without it."""
    from ..model.state import pager_of
    from ..moe.predictor import FILE_NAME, LookaheadPredictor, install

    path = os.path.join(root, FILE_NAME)
    pager = pager_of(model)
    if not os.path.isfile(path) or getattr(getattr(pager, "experts", None), "speculator", None) is None:
        return
    try:
        install(pager, LookaheadPredictor.load(path))
    except Exception as e:  # (a file beside the checkpoint: any error of reading or fitting it)
        warnings.warn(f"offtensor: {path}: the learned look-ahead beside the checkpoint was not installed "
                      f"({type(e).__name__}: {e}); routing guesses use the router look-ahead", UserWarning, stacklevel=3)

