"""Which placements may not give the unwrapped model's results bit for bit, and the warnings that
say so, naming the weights: output tiles narrower than ``TILE_ALIGN``, tiles of a dtype they are not
known to be exact in, and torch.nn modules whose fused fast path an offloaded weight switches off."""

from __future__ import annotations

import warnings
from typing import Sequence

import torch

from .ops import TILE_ALIGN

# The dtypes whose output tiles TILE_ALIGN wide are tested bit-identical to the whole op (integer
# sums are exact in any order). A tile of another dtype (float64: 1.6e-15 apart for 16-row tiles
# of a (96, 512) weight) may be summed in another order: wrap warns, naming the weight.
EXACT_TILE_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.int16,
                               torch.int32, torch.int64, torch.bool})


def warn_inexact_tiles(tiled: Sequence, stacklevel: int) -> None:
    """Warn about weights computed in tiles whose dtype tiles are not known to be exact in."""
    inexact = [w for w in tiled if w.tileable and w.dtype is not None and w.dtype not in EXACT_TILE_DTYPES]
    if inexact:
        names = ", ".join(f"'{w.name}' ({w.dtype}, {w.nbytes} bytes)" for w in inexact[:3])
        warnings.warn(
            f"offtensor: {names}{' ...' if len(inexact) > 3 else ''} will be computed in output tiles (its whole "
            f"working set is larger than the budget's room for paging), and tiles of its dtype may be summed in "
            f"another order than the whole op, so results may differ in the last bits; tiles are bit-identical in "
            f"float32, bfloat16, float16 and integer dtypes. Raise budget_gb for bit-identical results.",
            UserWarning, stacklevel=stacklevel)


def warn_fast_paths(offloaded: Sequence) -> None:
    """Warn, naming them, about offloaded weights of torch.nn modules whose fused fast path
    (``torch._transformer_encoder_layer_fwd``, ``_native_multi_head_attention``) their forward
    takes only when no argument has a ``__torch_function__``: with an OffloadedTensor weight they
    run their composite path, which sums in another order than the unwrapped model's fast path."""
    modules = {}
    for w in offloaded:
        if w.fast_path is not None:
            modules.setdefault(w.fast_path, w.name)
    if modules:
        listed = ", ".join(f"'{path or '(the model)'}' ({cls}, e.g. '{name}')"
                           for (path, cls), name in list(modules.items())[:3])
        warnings.warn(
            f"offtensor: {listed}{' ...' if len(modules) > 3 else ''} read offloaded weights; such a module's forward "
            "skips its fused fast path when a weight is an OffloadedTensor and runs its composite path, which sums in "
            "another order, so in inference its outputs may differ from the unwrapped model's in the last bits. Keep "
            "these weights resident (policy={'keep': [...]}) for bit-identical results.", UserWarning, stacklevel=5)



def warn_narrow_tiles(budget_bytes: int, what: str, stacklevel: int) -> None:
    """The warning for a budget that leaves room only for tiles narrower than ``TILE_ALIGN``."""
    warnings.warn(
        f"offtensor: the budget of {budget_bytes} bytes leaves room for output tiles narrower than "
        f"{TILE_ALIGN} slices of {what} only; such tiles are summed in another order, so results may "
        "differ from the unwrapped model's in the last bits. Raise budget_gb for bit-identical results.",
        stacklevel=stacklevel)
