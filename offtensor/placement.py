"""Which weights stay resident on the device and which are offloaded, for a budget and a policy:
the one placement API that ``wrap_model``, ``load_safetensors`` and ``ot.plan`` share.

- ``choose_model_placement(groups, config, device)``: which of a model's storage groups
  (``model.groups.collect_groups``: tied names and aliases of one storage together) to offload for
  an ``OffloadConfig`` (a ``ModelPlacement``);
- ``choose_placement(weights, budget_bytes, ...)``: the same choice on bare ``Weight`` records;
- ``policy_choice``: what a policy says for a tensor assigned after wrapping. What one op pages of
  a tensor or of a module's tensors together is ``working_sets``' rule, which re-placement after
  wrapping counts by too (its names are re-exported here).

Decisions only: no tensor is moved here. The default order offloads the weights whose bytes are
largest and used least per token first: routed MoE experts (only the routed ones are paged), then
dense MLP weights, then attention, then everything else; embeddings, norms, routers and small
tensors go last because they are touched by every token and cost a page-in each time for few
bytes. Within a class, bigger tensors go first so fewer tensors are offloaded for the same bytes.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
import warnings
from typing import Iterable, Optional, Sequence

import torch

from .config import OffloadConfig, Policy
from .moe import is_routed_stack  # what the expert cache takes for a stack of routed experts
from .ops import TILE_ALIGN  # the tile width ops cut; room is planned for it
from .pager import GiB, BudgetError, device_total_bytes, format_bytes, free_device_bytes
from .pager.budget import smallest_budget_gb
from .exactness import warn_fast_paths, warn_inexact_tiles, warn_narrow_tiles  # noqa: F401  (public here too)
from .working_sets import tiled as in_tiles
from .working_sets import (  # noqa: F401  (public here too)
    EXPERTS_PER_OP, module_of, module_working_set, pair_working_set, slice_working_set, tile_working_set, weight_tile,
    working_set,
)

EXPERTS, ROWS, MLP, ATTENTION, OTHER, LAST = range(6)
CLASS_NAMES = {EXPERTS: "routed experts", ROWS: "read by rows", MLP: "dense MLP", ATTENTION: "attention", OTHER: "other", LAST: "last"}

SMALL_BYTES = 1 << 16  # below this a tensor is "small": never worth a page-in per use
# With prefetch, the room beside the working set should hold one layer's routed experts (DeepSeek
# routes 8; every stack of the layer: gate_up and down), so the expert cache can take a layer's misses at once and keep hot experts across
# tokens. Only a preference: placement offloads more experts for it when the budget allows, never
# refuses a budget for it.
EXPERTS_PER_STEP = 8
# The other placement of routed experts: every stack offloaded, so the whole budget beyond the
# dense weights is expert cache. Which of it and the default is faster depends on the routing's
# skew and locality; wrap_model decides by replay (timeline.plan_expert_paging, README "Placement").
EXPERTS_PAGED = {"offload": ["*.experts.*"]}

_MLP_PARTS = {"mlp", "ffn", "feed_forward", "shared_expert", "shared_experts", "gate_proj", "up_proj", "down_proj",
              "gate_up_proj", "w1", "w2", "w3", "fc1", "fc2", "c_fc", "dense_h_to_4h", "dense_4h_to_h"}
_ATTENTION_PARTS = {"attn", "self_attn", "attention", "self_attention", "q_proj", "k_proj", "v_proj", "o_proj",
                    "qkv_proj", "c_attn", "wq", "wk", "wv", "wo", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                    "kv_b_proj", "W_UK", "W_UV", "w_uk", "w_uv", "query_key_value"}
_LAST_PARTS = {"embed_tokens", "embed", "embeddings", "wte", "wpe", "tok_embeddings", "word_embeddings", "lm_head",
               "gate", "router", "norm", "e_score_correction_bias"}

# Kept free for activations when the budget is derived from free device memory.
DEFAULT_MARGIN_BYTES = 2 * GiB


@dataclasses.dataclass
class Weight:
    """One unique tensor (tied names and storage aliases collapsed) as placement sees it."""

    names: list  # every fully qualified name it is registered under
    nbytes: int
    shape: tuple
    working_set: int  # bytes one op pages from it at most
    # Whether one op may read every tensor of its module at once: torch.nn's own modules do
    # (weight and bias of a linear, every layer's weights of an LSTM in one cuDNN call). A model's own
    # module (a layer holding w1 and w2 for x @ w1 @ w2, a stack of experts) reads its weights in
    # separate ops, with at most its lower-rank tensors (biases) beside the largest, or two of them
    # in tiles (``x @ (w1 @ w2)``: ``pair_working_set``).
    fused: bool = True
    # Whether every use is an index op that pages only the selected rows (the weight of an
    # nn.Embedding and nothing else): offloaded first, whatever its name says.
    indexed: bool = False
    # Whether it is a table that forward may read in slices: a buffer (no Parameter) of a model's own
    # module, of two or more dims, as SD3's and DiT's cropped ``pos_embed`` and GPT-2's causal mask
    # are. Dispatch pages only the elements a view covers, so such a read costs the slice, not the
    # table; placement counts it so only when the whole table leaves no budget (``choose_placement``).
    sliced: bool = False
    # Whether dispatch may compute its ops in output tiles: a plain weight, read by linear, mm, bmm
    # and convolution, or a leaf of a wrapper subclass that has the outer tensor's dtype (a
    # DTensor's local shard: the subclass runs the same op on it). A leaf of another dtype (a
    # torchao tensor's int8 or float8 qdata) is read by the subclass's own kernels (dequantise,
    # int8 mm), which dispatch never tiles: it is paged whole.
    tileable: bool = True
    # Device bytes it holds while resident, where that is more than ``nbytes``: a view into a bigger
    # storage keeps the whole storage on the device, and offloading it (as its own elements) frees that.
    device_bytes: Optional[int] = None
    # (module path, class name) of a torch.nn module with a fused fast path reading it, which its
    # forward skips for an offloaded weight (``warn_fast_paths``).
    fast_path: Optional[tuple] = None
    dtype: Optional[torch.dtype] = None
    # The output channels of the torch.nn convolution (any form: grouped, depthwise, transposed)
    # whose weight it is: dispatch cuts such a weight by output channels alone, each ``nbytes //
    # conv_outputs`` bytes wherever its dims keep them (``working_sets.weight_tile``).
    conv_outputs: Optional[int] = None
    # The length of the dim weight_norm normalises it over, where that is not dim 0 (wav2vec2's
    # ``dim=2``): dispatch normalises it in slices of that dim, each ``nbytes // norm_slices`` bytes,
    # and any number of slices gives the whole op's results bit for bit, so it is planned at one.
    norm_slices: Optional[int] = None
    # The class of the parametrization of the user's own that computes a tensor from it (its
    # original): its forward is the user's code, which may read it whole, so it is never tiled.
    read_whole_by: Optional[str] = None

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def resident_cost(self) -> int:
        return self.nbytes if self.device_bytes is None else max(self.nbytes, self.device_bytes)


@dataclasses.dataclass
class Placement:
    """Which of a list of ``Weight`` s are offloaded, and what that leaves on the device."""

    offload: list  # Weight objects to offload, in the order chosen
    resident: list
    budget_bytes: int
    resident_bytes: int
    offloaded_bytes: int
    working_set_bytes: int  # the most one op pages at once (the largest offloaded working set)


def weight_class(name: str, shape: tuple, nbytes: int) -> int:
    parts = name.split(".")
    leaf_owner = parts[-2] if len(parts) > 1 else ""
    if nbytes < SMALL_BYTES or len(shape) < 2:
        return LAST
    if "experts" in parts:
        return EXPERTS
    if leaf_owner in _LAST_PARTS or any(p in _LAST_PARTS for p in parts[-2:]) or "norm" in leaf_owner:
        return LAST
    if any(p in _MLP_PARTS for p in parts):
        return MLP
    if any(p in _ATTENTION_PARTS for p in parts):
        return ATTENTION
    return OTHER


def weight_kind(w: Weight) -> int:
    """``w``'s class in the offload order (``weight_class``, or ROWS for a table read by rows)."""
    if w.indexed and w.nbytes >= SMALL_BYTES:
        return ROWS
    return weight_class(w.name, w.shape, w.nbytes)


def policy_choice(policy: Policy, names: Iterable[str]) -> Optional[str]:
    """"offload", "keep" or None (no opinion) for a weight with these names."""
    if policy is None:
        return None
    if callable(policy):
        for name in names:
            choice = policy(name)
            if choice is not None:
                return _check_choice(choice)
        return None
    if isinstance(policy, dict):
        unknown = set(policy) - {"offload", "keep"}
        if unknown:
            raise ValueError(f"offtensor: policy keys must be 'offload' and/or 'keep', got {sorted(unknown)}")
        rules = [(p, "keep") for p in _patterns(policy.get("keep"))] + [(p, "offload") for p in _patterns(policy.get("offload"))]
    else:
        rules = [(p, "offload") for p in _patterns(policy)]
    for pattern, choice in rules:
        if any(fnmatch.fnmatchcase(name, pattern) for name in names):
            return choice
    return None


def unmatched_patterns(policy: Policy, names: Iterable[str]) -> list:
    """(pattern, "offload" | "keep") for each pattern of a pattern policy that matches none of
    ``names`` (a callable policy has no patterns to check)."""
    if policy is None or callable(policy):
        return []
    if isinstance(policy, dict):
        rules = [(p, "keep") for p in _patterns(policy.get("keep"))] + [(p, "offload") for p in _patterns(policy.get("offload"))]
    else:
        rules = [(p, "offload") for p in _patterns(policy)]
    names = list(names)
    unmatched = []
    for pattern, choice in rules:
        match = re.compile(fnmatch.translate(pattern)).match if isinstance(pattern, str) else None
        if match is not None and not any(map(match, names)):
            unmatched.append((pattern, choice))
    return unmatched


def _patterns(value) -> list:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return list(value)


def _check_choice(choice: str) -> str:
    if choice not in ("offload", "keep"):
        raise ValueError(f"offtensor: a policy must answer 'offload', 'keep' or None, got {choice!r}")
    return choice


@dataclasses.dataclass
class ModelPlacement:
    """A model's storage groups and the placement chosen for them."""

    groups: list  # every StorageGroup, in registration order
    choice: Placement  # the same decision on the groups' Weights: budget and bytes
    offloaded: list  # the StorageGroups to offload, in the order chosen
    resident: list

    def __post_init__(self):
        self._offloaded_ids = {id(g) for g in self.offloaded}

    @property
    def budget_bytes(self) -> int:
        return self.choice.budget_bytes

    def offloads(self, group) -> bool:
        return id(group) in self._offloaded_ids


def choose_model_placement(groups: Sequence, config: OffloadConfig,
                           device: torch.device) -> ModelPlacement:
    """Which of ``groups`` to offload under ``config``'s budget (or ``offload_gb``; neither: the free
    memory of ``device`` less ``DEFAULT_MARGIN_BYTES``) and policy. Groups the user offloaded by
    hand stay offloaded."""
    weights = [g.weight() for g in groups]
    budget_bytes, offload_bytes = config.budget_bytes, config.offload_bytes
    _warn_unmatched_patterns(config.policy, [n for w in weights for n in w.names])
    _warn_budget_over_memory(config, device)
    if budget_bytes is None and offload_bytes is None:
        budget_bytes = free_device_bytes(device) - DEFAULT_MARGIN_BYTES
    policy = config.policy
    already = {n for w, g in zip(weights, groups) if g.is_offloaded for n in w.names}
    if already:
        def policy(name, _user=policy):
            return "offload" if name in already else policy_choice(_user, [name])

    choice = choose_placement(weights, budget_bytes, offload_bytes, policy, config.prefetch)
    warn_fast_paths(choice.offload)
    warn_inexact_tiles([w for w in choice.offload if w.working_set > choice.budget_bytes - choice.resident_bytes],
                       stacklevel=5)
    group_of = {id(w): g for w, g in zip(weights, groups)}
    return ModelPlacement(list(groups), choice, [group_of[id(w)] for w in choice.offload],
                          [group_of[id(w)] for w in choice.resident])


def _warn_unmatched_patterns(policy: Policy, names: list) -> None:
    for pattern, choice in unmatched_patterns(policy, names):
        warnings.warn(
            f"offtensor: the policy's {choice!r} pattern {pattern!r} matches none of the model's {len(names)} tensor "
            f"names (such as {names[:3]}), so it decides nothing; patterns are fnmatch globs on full names like "
            f"'layers.0.mlp.weight' (a tensor assigned later is matched when it is placed)", UserWarning, stacklevel=5)


def _warn_budget_over_memory(config: OffloadConfig, device: torch.device) -> None:
    total = device_total_bytes(device) if config.budget_bytes is not None else None
    if total is not None and config.budget_bytes > total:
        memory = "GPU memory (torch.cuda.mem_get_info)" if device.type == "cuda" else "RAM on this machine"
        warnings.warn(
            f"offtensor: budget_gb={config.budget_gb} ({config.budget_bytes} bytes) is more than the {total} bytes "
            f"({total / GiB:.2f} GiB) of {memory} that {device} has: the budget cannot hold, and weights it lets stay "
            f"resident may not fit; give a budget below the device's memory", UserWarning, stacklevel=5)


# ---------------------------------------------------------------------------- choosing


def choose_placement(weights: Sequence[Weight], budget_bytes: Optional[int], offload_bytes: Optional[int] = None,
                     policy: Policy = None, prefetch: bool = True) -> Placement:
    """Choose what to offload so that resident bytes plus the largest working set fit the budget.

    With ``offload_bytes`` (vLLM's ``cpu_offload_gb``) at least that many bytes are offloaded and,
    if no budget was given, the budget becomes what stays resident plus room to page.

    A budget too small for the largest whole working set is chosen again with tile working sets:
    the smallest budget accepted is the largest tile one op needs, not the largest weight. One that
    is too small even so, because of a table forward may read in slices (``Weight.sliced``), is
    chosen again with such tables counted at the least a read of them pages (``slice_working_set``).
    """
    first, error = _attempt(_choose_whole_or_tiled, weights, budget_bytes, offload_bytes, policy, prefetch)
    if first is not None:
        return first
    trial = [dataclasses.replace(w, working_set=slice_working_set(w)) if w.sliced else w for w in weights]
    if all(t.working_set == w.working_set for t, w in zip(trial, weights)):
        raise error
    chosen, _ = _attempt(_choose_whole_or_tiled, trial, budget_bytes, offload_bytes, policy, prefetch)
    if chosen is None:
        raise error  # the error about whole tables: slicing them did not help
    original = {id(t): w for t, w in zip(trial, weights)}
    chosen.offload = [original[id(t)] for t in chosen.offload]
    chosen.resident = [original[id(t)] for t in chosen.resident]
    tables = [w for w in chosen.offload if w.sliced and w.working_set + chosen.resident_bytes > chosen.budget_bytes]
    if tables:
        names = ", ".join(f"'{w.name}' ({w.nbytes} bytes)" for w in tables[:3]) + (" ..." if len(tables) > 3 else "")
        warnings.warn(
            f"offtensor: {names} cannot be paged whole within the budget of {chosen.budget_bytes} bytes, so it is "
            f"offloaded as a table that forward reads in slices (a buffer of the model's own module), each read paging "
            f"only its slice (a pointwise op over all of it runs in slices too); any other op that reads more of it at once than the "
            f"{chosen.budget_bytes - chosen.resident_bytes} bytes of room raises BudgetError naming it",
            UserWarning, stacklevel=5)
    return chosen


def _choose_whole_or_tiled(weights: Sequence[Weight], budget_bytes: Optional[int], offload_bytes: Optional[int],
                           policy: Policy, prefetch: bool) -> Placement:
    """``choose_placement`` with whole working sets, else tiled ones (``TILE_ALIGN``, then 1 slice)."""
    whole, error = _attempt(_choose_untiled, weights, budget_bytes, offload_bytes, policy, prefetch)
    if whole is not None:
        return whole
    for slices in (TILE_ALIGN, 1):
        tiled, tiled_error = _attempt(_choose_tiled, weights, budget_bytes, offload_bytes, policy, prefetch, slices)
        if tiled_error is not None:
            error = tiled_error
            continue
        if tiled is None:
            continue  # nothing can be tiled: the error about whole working sets says what is needed
        if slices < TILE_ALIGN:
            warn_narrow_tiles(budget_bytes, "the largest weights", stacklevel=7)
        return tiled
    raise error


def _choose_tiled(weights: Sequence[Weight], budget_bytes, offload_bytes, policy, prefetch,
                  slices: int) -> Placement:
    """``_choose_untiled`` with the weights of the largest working sets computed in tiles of ``slices``
    slices, 1, 2, 4... of them: the others keep room for their whole working set (one op, one page,
    no tiles). The last BudgetError when no count fits; None when no weight can be tiled."""
    tileable = sorted(
        (w for w in weights if w.tileable and weight_tile(w, slices) < w.working_set),
        key=lambda w: -w.working_set,
    )
    if not tileable:
        return None
    error = None
    count = 1
    while tileable:
        count = min(count, len(tileable))
        tiled_ids = {id(w) for w in tileable[:count]}
        trial = [in_tiles(w, slices) if id(w) in tiled_ids else w for w in weights]
        tiled, error = _attempt(_choose_untiled, trial, budget_bytes, offload_bytes, policy, prefetch)
        if tiled is None:
            if count == len(tileable):
                break
            count *= 2
            continue
        # Callers key their tensors by these Weight objects: hand back the originals.
        original = {id(t): w for t, w in zip(trial, weights)}
        tiled.offload = [original[id(t)] for t in tiled.offload]
        tiled.resident = [original[id(t)] for t in tiled.resident]
        return tiled
    raise error


def _attempt(choose, *args) -> tuple:
    """``(choose(*args), None)``, or ``(None, the BudgetError it raised)`` with the error's traceback
    dropped. The choosers try several plans and raise the first plan's error only when none fits; an
    error kept in a local of a frame that its own traceback holds is a reference cycle, and it kept
    that frame's callers (wrap's model, its groups, the tensors they name, a replaced weight's host
    master) alive after a successful wrap until Python's cyclic collector ran."""
    try:
        return choose(*args), None
    except BudgetError as e:
        return None, e.with_traceback(None)


class _Offloading:
    """The weights chosen for offloading so far, and the most one op pages of them at once."""

    def __init__(self, total_bytes: int):
        self.total_bytes = total_bytes
        self.clear()

    def clear(self) -> None:
        self.weights = []
        self.nbytes = 0
        self.freed = 0  # device bytes the offloaded weights held while resident
        self.working_set = 0
        self.widest = None  # the module whose offloaded tensors set ``working_set``
        self.by_module = {}  # module path -> its offloaded Weights

    def add(self, w: Weight) -> None:
        """Offload ``w``. An op may read every tensor of one module together (weight and bias of a
        linear, all four weights of an LSTM layer in one cuDNN call, in_proj weight and bias of
        attention), so a module's offloaded tensors count together; ops over tensors of several
        modules (``cat`` of two weights) page their inputs one at a time (ops' list ops), so
        they need no more room than one of them. A model's own modules count as ``Weight.fused`` says."""
        self.weights.append(w)
        self.nbytes += w.nbytes
        self.freed += w.resident_cost
        for stem in {module_of(name) for name in w.names}:
            tensors = self.by_module.setdefault(stem, [])
            tensors.append(w)
            need = module_working_set(tensors)
            if need > self.working_set:
                self.working_set, self.widest = need, stem

    def replace_all(self, weights) -> None:
        self.clear()
        for w in weights:
            self.add(w)

    @property
    def resident_bytes(self) -> int:
        return self.total_bytes - self.freed

    def prefetch_room(self) -> int:
        """Room for copies ahead of the current op: another working set, or a layer's routed experts."""
        routed = {}  # a layer's experts module -> bytes of its stacks' routed experts together
        for w in self.weights:
            if is_routed_stack(w.name, w.shape) and w.shape[0] > 0:
                stem = w.name.rpartition(".")[0]
                routed[stem] = routed.get(stem, 0) + w.nbytes // w.shape[0] * min(w.shape[0], EXPERTS_PER_STEP)
        return max([self.working_set, *routed.values()])

    def room_needed(self, prefetch: bool) -> int:
        return self.working_set + (self.prefetch_room() if prefetch else 0)

    def fits(self, budget: int, copies: int = 1) -> bool:
        if copies == 2:
            return self.resident_bytes + self.working_set + self.prefetch_room() <= budget
        return self.resident_bytes + copies * self.working_set <= budget


def _choose_untiled(weights: Sequence[Weight], budget_bytes: Optional[int], offload_bytes: Optional[int] = None,
                    policy: Policy = None, prefetch: bool = True) -> Placement:
    """``choose_placement`` with every working set as given (no tiling)."""
    forced, kept, free = [], [], []
    for w in weights:
        choice = policy_choice(policy, w.names)
        (forced if choice == "offload" else kept if choice == "keep" else free).append(w)
    # Ties break by forward order (registration order: `layers.10` after `layers.9`), not by name;
    # _spread then picks which of a run of equal weights go.
    position = {id(w): i for i, w in enumerate(weights)}
    free.sort(key=lambda w: _tie_key(w, position))

    chosen = _Offloading(sum(w.resident_cost for w in weights))
    for w in forced:
        chosen.add(w)
    pending = list(free)
    if offload_bytes is not None:
        while pending and chosen.nbytes < offload_bytes:
            chosen.add(pending.pop(0))
        if budget_bytes is None:
            budget_bytes = chosen.resident_bytes + chosen.room_needed(prefetch)
    if budget_bytes is None:
        raise ValueError("offtensor: choose_placement() needs a budget or offload_bytes")

    while pending and not chosen.fits(budget_bytes):
        chosen.add(pending.pop(0))
    if prefetch and chosen.fits(budget_bytes):
        # Room for a second copy lets the next weight's copy overlap the current op's compute.
        # Offloading one more weight of the same kind frees about that much, so this costs about one
        # weight's bytes per forward; never worth it for the last class (touched by every token).
        while pending and not chosen.fits(budget_bytes, 2) and weight_kind(pending[0]) != LAST:
            chosen.add(pending.pop(0))
    if not chosen.fits(budget_bytes):
        # Every weight the policy allows is offloaded by now: what stays resident is what it keeps.
        raise _budget_error(chosen, kept, budget_bytes)
    first_choice = list(chosen.weights)
    spread = _spread(first_choice, free, position)
    if spread is not first_choice:
        chosen.replace_all(spread)
        if not chosen.fits(budget_bytes):  # a module's tensors together made the working set larger: keep the first choice
            chosen.replace_all(first_choice)
    offload_ids = {id(w) for w in chosen.weights}
    resident = [w for w in weights if id(w) not in offload_ids]
    return Placement(chosen.weights, resident, budget_bytes, chosen.resident_bytes, chosen.nbytes,
                     chosen.working_set)


def _budget_error(chosen: _Offloading, kept: list, budget_bytes: int) -> BudgetError:
    """What keeps a budget from holding the model with every weight the policy allows offloaded,
    and the smallest budget that holds it: those resident bytes plus the largest working set."""
    largest = max(chosen.weights, key=lambda w: w.working_set, default=None)
    resident, ws, widest = chosen.resident_bytes, chosen.working_set, chosen.widest
    needs, why = [], ""
    if kept:
        needs.append(f"the policy keeps {_bytes(resident)} resident ({len(kept)} tensors, e.g. '{kept[0].name}')")
    if largest is not None:
        of_widest = [w for w in chosen.weights if any(module_of(n) == widest for n in w.names)]
        heaviest = max(of_widest, key=lambda w: w.working_set) if of_widest else largest
        first = heaviest.name
        if heaviest.read_whole_by:
            why = (f" '{first}' is counted whole: it is the original of the parametrization "
                   f"{heaviest.read_whole_by}, the user's own, whose forward may read it whole. Registered after "
                   f"wrap_model instead, it runs where each of its ops runs in slices, tiles or on the host.")
        module = f"module '{widest}'" if widest else "the model itself"
        needs.append(
            f"paging '{first}'"
            + (f" (one op of {module}, {len(of_widest)} offloaded tensors)" if len(of_widest) > 1 else "")
            + f" needs {_bytes(ws)} on the device at once"
        )
    return BudgetError(
        f"offtensor: a budget of {_bytes(budget_bytes)} cannot hold this model even with every other weight "
        f"offloaded: {' and '.join(needs)}, {_bytes(resident + ws)} in all. The smallest budget that holds it is "
        f"budget_gb={smallest_budget_gb(resident + ws)}"
        + ("; raise budget_gb to that or let the policy offload more." if kept else ": raise budget_gb to that.")
        + why
    )


def _bytes(n: int) -> str:
    return f"{format_bytes(n)} ({n} bytes)"


def _tie_key(w: Weight, position: dict):
    return (weight_kind(w), -w.nbytes, position[id(w)])


def _spread(offload: list, free: list, position: dict) -> list:
    """Of each run of interchangeable free weights (same class, bytes and shape) of which only some
    are offloaded, offload evenly spaced ones in forward order instead of the first ones.

    A block of consecutive offloaded layers followed by a block of resident ones leaves the copy
    stream idle while the resident block computes, then the compute stream idle while the offloaded
    block copies (replayed under the H200 profile: 1.22 x the PCIe bound for 12 of 24 layers).
    Spread out, every copy overlaps the resident compute before it."""
    groups = {}
    for w in free:
        groups.setdefault((weight_kind(w), w.nbytes, tuple(w.shape)), []).append(w)
    chosen_ids = {id(w) for w in offload}
    replace = {}
    for members in groups.values():
        k = sum(id(w) in chosen_ids for w in members)
        n = len(members)
        if 0 < k < n:
            members = sorted(members, key=lambda w: position[id(w)])
            picked = [members[int((j + 0.5) * n / k)] for j in range(k)]
            replace[id(members[0])] = (members, picked)
    if not replace:
        return offload
    spread = []
    member_ids = {id(w) for members, _ in replace.values() for w in members}
    for w in offload:
        if id(w) not in member_ids:
            spread.append(w)
    for members, picked in replace.values():
        spread.extend(picked)
    return spread
