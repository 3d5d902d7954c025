"""What one op pages at once: of one tensor (whole, in output tiles, in slices) and of one module's
offloaded tensors together. Wrap-time placement (``placement.choose_placement``) and re-placement
after wrapping (``model.room``: a weight assigned, a cast, a weight the policy keeps) count by these
rules, so a budget is judged the same way whenever a weight is placed.

The tensors are ``placement.Weight`` records (read here by their fields only: ``names``, ``shape``,
``nbytes``, ``working_set``, ``fused``, ``sliced``, ``tileable``)."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from .moe import is_routed_stack  # what the expert cache takes for a stack of routed experts
from .ops import TILE_ALIGN  # the tile width ops cut; room is planned for it

# Stacked experts are never paged whole: ``_grouped_mm`` pages the routed experts one at a time,
# eager MoE selects one expert per linear, and index ops page the selected experts in chunks that
# fit the free room. So one op needs room for this many slices of a stack, not the routed 8.
EXPERTS_PER_OP = 1


def working_set(name: str, shape: tuple, nbytes: int, indexed: bool = False) -> int:
    """The bytes one op pages of a tensor read whole: a row of a table read by rows, an expert of a
    stack of routed experts, else all of it."""
    if indexed and len(shape) >= 1 and shape[0] > 0:
        # ``_gather_rows`` pages the selected rows in chunks that fit the free room: one row at least.
        return nbytes // shape[0]
    if is_routed_stack(name, shape) and shape[0] > 0:
        return nbytes // shape[0] * min(shape[0], EXPERTS_PER_OP)
    return nbytes


def tile_working_set(shape: tuple, nbytes: int, working_set: int, slices: int = TILE_ALIGN) -> int:
    """The least one op must page of a weight when it computes in output tiles (ops tile
    linear, mm/addmm, bmm and convolution by rows, columns, batches or output channels; index ops
    page only selected rows): ``slices`` slices along the shorter of its first two dims.

    Placement plans for tiles ``TILE_ALIGN`` slices wide: narrower output tiles make BLAS pick
    another kernel (matrix-vector for a few rows), which sums in another order and differs from the
    whole op in the last bits. One slice is the fallback for a budget with no room for that."""
    if len(shape) < 2 or min(shape[0], shape[1]) <= 0:
        return working_set
    n = min(shape[0], shape[1])
    return min(working_set, nbytes // n * min(slices, n))


def weight_tile(w, slices: int = TILE_ALIGN) -> int:
    """``tile_working_set`` of the Weight ``w``. A model's own module's tensor of three or more dims
    (a bmm operand, an einsum's stacked weight) is a stack of matrices over its last two dims: bmm,
    baddbmm and cdist tile it a batch at a time and, where one matrix does not fit, in columns or
    rows of that matrix, so its tile is ``slices`` slices of one matrix; but no less than one kernel
    over its dims past the first two, the least a convolution reading it pages (ops cut a
    convolution's weight down to one input channel of one output channel, not within the kernel).
    For a stack of three dims that is never more than a slice of one matrix. A torch.nn
    convolution's weight is cut by output channels alone (``conv_tile``); another torch.nn module's
    tensor, routed experts (``_grouped_mm``
    pages each expert whole) and tables read in slices (a crop is no matrix product; they are
    counted at a slice instead, ``slice_working_set``) keep the rule of the first two dims, and so
    does a stack of one matrix (ViT's ``pos_embed`` of shape (1, tokens, width), read whole by
    ``x + pos_embed`` as often as by a product)."""
    if w.conv_outputs:
        return conv_tile(w, slices)
    if w.norm_slices:  # weight_norm's v over another dim than 0: one slice of that dim, at any width
        return min(w.working_set, w.nbytes // w.norm_slices)
    matrices = 1
    for n in w.shape[:-2]:
        matrices *= n
    if len(w.shape) < 3 or w.fused or w.sliced or is_routed_stack(w.name, w.shape) or matrices <= 1:
        return tile_working_set(w.shape, w.nbytes, w.working_set, slices)
    one = w.nbytes // matrices
    kernel = w.nbytes // (w.shape[0] * w.shape[1]) if w.shape[0] * w.shape[1] else 0
    return min(w.working_set, max(tile_working_set(w.shape[-2:], one, one, slices), kernel))


def conv_tile(w, slices: int = TILE_ALIGN) -> int:
    """The tile of a torch.nn convolution's weight: ``slices`` of its output channels. Dispatch
    (``ops.convolutions``) cuts every form by output channels: along dim 0, or dim 1 when
    transposed; whole groups of a grouped one, or one group's channels at a time. One output
    channel is ``nbytes // conv_outputs`` bytes in every form (a transposed grouped weight holds a
    group's share of it in each of the group's rows), so these are the bytes one tile pages at
    most. Not the shorter of its first two dims, as for a matrix: a depthwise weight (C, 1, k)
    would count whole."""
    outputs = w.conv_outputs
    return min(w.working_set, w.nbytes // outputs * min(slices, outputs))


def slice_working_set(w) -> int:
    """The least one read of a table in slices pages: one slice along its longest dim (ops
    gathers exactly the elements a view covers)."""
    longest = max(w.shape, default=1)
    return w.nbytes // longest if longest > 0 else w.working_set


def module_of(name: str) -> str:
    """The module whose one op may read ``name`` with its other tensors: its owner; but a
    parametrization's own tensors (spectral_norm's ``l.parametrizations.weight.0._v``) count with the
    tensor it parametrizes (``l.parametrizations.weight.original``), as ``mv(weight, _v)`` reads both."""
    stem = name.rpartition(".")[0]
    return stem.rpartition(".")[0] if stem.split(".")[-3:-2] == ["parametrizations"] else stem


def pair_working_set(w) -> int:
    """What an op of ``w`` and another weight of its module (``w1 @ w2``, an einsum of both) pages of
    ``w`` at least: its tile (``TILE_ALIGN`` slices; one where its working set is one slice), as mm
    and bmm do. 0 for routed experts and tables read in slices, which no such op reads."""
    if len(w.shape) < 2 or w.sliced or is_routed_stack(w.name, w.shape):
        return 0
    return weight_tile(w) if w.tileable else w.working_set


def module_working_set(weights: Sequence) -> int:
    """The most one op pages of one module's offloaded ``weights``, each at the working set it is
    planned for (whole or a tile): all of them where one op may read them together (``Weight.fused``:
    a linear's weight and bias, an LSTM's weights in one kernel); for a model's own module its
    largest tensor of the highest rank with its lower-rank ones (biases) beside it, but at least a
    tile of each of its two largest of that rank (``pair_working_set``: ``x @ (w1 @ w2)``)."""
    if not weights:
        return 0
    if any(w.fused for w in weights):
        return sum(w.working_set for w in weights)
    top = max(len(w.shape) for w in weights)
    pair = sum(sorted((pair_working_set(w) for w in weights if len(w.shape) == top), reverse=True)[:2])
    widest = max(w.working_set for w in weights if len(w.shape) == top)
    return max(widest, pair) + sum(w.working_set for w in weights if len(w.shape) < top)


def tiled(w, slices: int):
    """``w`` planned in output tiles of ``slices`` slices where dispatch may tile it, else as it is."""
    if not w.tileable:
        return w
    return dataclasses.replace(w, working_set=weight_tile(w, slices))


@dataclasses.dataclass
class ModuleRoom:
    """What one op of a module pages of its offloaded tensors, with as little tiling as a room allows."""

    module: str  # its path in the model ("" for the model itself)
    whole: list  # its offloaded tensors, each at its whole working set
    weights: list  # the same as planned: a tiled one at its tile working set
    need: int  # bytes: ``module_working_set(weights)``
    slices: Optional[int]  # the tile width they are planned for, None where read whole

    @property
    def tiled(self) -> list:
        """The tensors (as read whole) planned in tiles."""
        return [w for w, t in zip(self.whole, self.weights) if t.working_set < w.working_set]


def module_room(module: str, weights: Sequence, room: int) -> ModuleRoom:
    """``weights`` of ``module`` read whole if that fits ``room`` bytes, else in tiles of
    ``TILE_ALIGN`` slices, else of one (the fallbacks wrap-time placement takes); the last try's
    need where none fits."""
    planned, slices = list(weights), None
    need = module_working_set(planned)
    for width in (TILE_ALIGN, 1):
        if need <= room:
            break
        planned, slices = [tiled(w, width) for w in weights], width
        need = module_working_set(planned)
    return ModuleRoom(module, list(weights), planned, need, slices)


def modules_room(weights: Sequence, room: int) -> list:
    """``module_room`` for each module of the offloaded ``weights`` (a tensor of several modules,
    a tie, counts in each), largest need first."""
    by_module = {}
    for w in weights:
        for stem in {module_of(name) for name in w.names}:
            by_module.setdefault(stem, []).append(w)
    rooms = [module_room(stem, ws, room) for stem, ws in by_module.items()]
    return sorted(rooms, key=lambda r: -r.need)
