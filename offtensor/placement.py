"""Which weights stay resident on the device and which are offloaded, for a budget and a policy.

Pure planning: no tensors are moved here. The default order offloads the weights whose bytes are
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
from typing import Callable, Iterable, Optional, Sequence, Union

from .pager import BudgetError

EXPERTS, ROWS, MLP, ATTENTION, OTHER, LAST = range(6)
CLASS_NAMES = {EXPERTS: "routed experts", ROWS: "read by rows", MLP: "dense MLP", ATTENTION: "attention", OTHER: "other", LAST: "last"}

# Output tiles at least this many slices wide (rows of a linear weight, columns of mm's operand,
# output channels, bmm batches) are bit-identical to the whole op on CPU BLAS (MKL/oneDNN, see
# test_budget_and_tiling); narrower ones may get a matrix-vector kernel that sums in another order.
# Placement reserves room for tiles this wide, and dispatch cuts tiles to multiples of it.
TILE_ALIGN = 16

SMALL_BYTES = 1 << 16  # below this a tensor is "small": never worth a page-in per use
# Stacked experts are never paged whole: ``_grouped_mm`` pages the routed experts one at a time,
# eager MoE selects one expert per linear, and index ops page the selected experts in chunks that
# fit the free room. So one op needs room for this many slices of a stack, not the routed 8.
EXPERTS_PER_OP = 1
# With prefetch, the room beside the working set should hold one layer's routed experts (DeepSeek
# routes 8; every stack of the layer: gate_up and down), so the expert cache can take a layer's misses at once and keep hot experts across
# tokens. Only a preference: placement offloads more experts for it when the budget allows, never
# refuses a budget for it.
EXPERTS_PER_STEP = 8

_MLP_PARTS = {"mlp", "ffn", "feed_forward", "shared_expert", "shared_experts", "gate_proj", "up_proj", "down_proj",
              "gate_up_proj", "w1", "w2", "w3", "fc1", "fc2", "c_fc", "dense_h_to_4h", "dense_4h_to_h"}
_ATTENTION_PARTS = {"attn", "self_attn", "attention", "self_attention", "q_proj", "k_proj", "v_proj", "o_proj",
                    "qkv_proj", "c_attn", "wq", "wk", "wv", "wo", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                    "kv_b_proj", "W_UK", "W_UV", "w_uk", "w_uv", "query_key_value"}
_LAST_PARTS = {"embed_tokens", "embed", "embeddings", "wte", "wpe", "tok_embeddings", "word_embeddings", "lm_head",
               "gate", "router", "norm", "e_score_correction_bias"}

Policy = Union[None, Sequence[str], dict, Callable[[str], Optional[str]]]


@dataclasses.dataclass
class Weight:
    """One unique tensor (tied names and storage aliases collapsed) as placement sees it."""

    names: list  # every fully qualified name it is registered under
    nbytes: int
    shape: tuple
    working_set: int  # bytes one op pages from it at most
    # Whether one op may read every tensor of its module at once: torch.nn's own modules do
    # (weight and bias of a linear, an LSTM layer's four weights in one cuDNN call). A model's own
    # module (a layer holding w1 and w2 for x @ w1 @ w2, a stack of experts) reads its weights in
    # separate ops, with at most its lower-rank tensors (biases) beside the largest.
    fused: bool = True
    # Whether every use is an index op that pages only the selected rows (the weight of an
    # nn.Embedding and nothing else): offloaded first, whatever its name says.
    indexed: bool = False

    @property
    def name(self) -> str:
        return self.names[0]


@dataclasses.dataclass
class Plan:
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


def working_set(name: str, shape: tuple, nbytes: int, indexed: bool = False) -> int:
    if indexed and len(shape) >= 1 and shape[0] > 0:
        # ``_gather_rows`` pages the selected rows in chunks that fit the free room: one row at least.
        return nbytes // shape[0]
    if "experts" in name.split(".") and len(shape) >= 3 and shape[0] > 0:
        return nbytes // shape[0] * min(shape[0], EXPERTS_PER_OP)
    return nbytes


def _policy_choice(policy: Policy, names: Iterable[str]) -> Optional[str]:
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


def tile_working_set(shape: tuple, nbytes: int, working_set: int, slices: int = TILE_ALIGN) -> int:
    """The least one op must page of a weight when it computes in output tiles (dispatch tiles
    linear, mm/addmm, bmm and convolution by rows, columns, batches or output channels; index ops
    page only selected rows): ``slices`` slices along the shorter of its first two dims.

    Placement plans for tiles ``TILE_ALIGN`` slices wide: narrower output tiles make BLAS pick
    another kernel (matrix-vector for a few rows), which sums in another order and differs from the
    whole op in the last bits. One slice is the fallback for a budget with no room for that."""
    if len(shape) < 2 or min(shape[0], shape[1]) <= 0:
        return working_set
    n = min(shape[0], shape[1])
    return min(working_set, nbytes // n * min(slices, n))


def plan(weights: Sequence[Weight], budget_bytes: Optional[int], offload_bytes: Optional[int] = None,
         policy: Policy = None, prefetch: bool = True) -> Plan:
    """Choose what to offload so that resident bytes plus the largest working set fit the budget.

    With ``offload_bytes`` (vLLM's ``cpu_offload_gb``) at least that many bytes are offloaded and,
    if no budget was given, the budget becomes what stays resident plus room to page.

    A budget too small for the largest whole working set is planned again with tile working sets:
    the smallest budget accepted is the largest tile one op needs, not the largest weight.
    """
    try:
        return _plan(weights, budget_bytes, offload_bytes, policy, prefetch)
    except BudgetError as whole_error:
        error = whole_error
    for slices in (TILE_ALIGN, 1):
        try:
            tiled = _plan_tiled(weights, budget_bytes, offload_bytes, policy, prefetch, slices)
        except BudgetError as e:
            error = e
            continue
        if slices < TILE_ALIGN:
            warnings.warn(
                f"offtensor: the budget of {budget_bytes} bytes leaves room for output tiles narrower than "
                f"{TILE_ALIGN} slices of the largest weights only; such tiles are summed in another order, so "
                "results may differ from the unwrapped model's in the last bits. Raise budget_gb for "
                "bit-identical results.", stacklevel=3)
        return tiled
    raise error


def _plan_tiled(weights: Sequence[Weight], budget_bytes, offload_bytes, policy, prefetch, slices: int) -> Plan:
    """``_plan`` with the weights of the largest working sets computed in tiles of ``slices``
    slices, 1, 2, 4... of them: the others keep room for their whole working set (one op, one page,
    no tiles). The last BudgetError when no count fits."""
    tileable = sorted(
        (w for w in weights if tile_working_set(w.shape, w.nbytes, w.working_set, slices) < w.working_set),
        key=lambda w: -w.working_set,
    )
    error = BudgetError(f"offtensor: no weight can be tiled in {slices}-slice tiles to fit {budget_bytes} bytes")
    count = 1
    while tileable:
        count = min(count, len(tileable))
        tiled_ids = {id(w) for w in tileable[:count]}
        trial = [
            dataclasses.replace(w, working_set=tile_working_set(w.shape, w.nbytes, w.working_set, slices))
            if id(w) in tiled_ids else w
            for w in weights
        ]
        try:
            tiled = _plan(trial, budget_bytes, offload_bytes, policy, prefetch)
        except BudgetError as e:
            error = e
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


def _plan(weights: Sequence[Weight], budget_bytes: Optional[int], offload_bytes: Optional[int] = None,
          policy: Policy = None, prefetch: bool = True) -> Plan:
    total = sum(w.nbytes for w in weights)
    forced, kept, free = [], [], []
    for w in weights:
        choice = _policy_choice(policy, w.names)
        (forced if choice == "offload" else kept if choice == "keep" else free).append(w)
    # Ties break by forward order (registration order: `layers.10` after `layers.9`), not by name;
    # _spread then picks which of a run of equal weights go.
    position = {id(w): i for i, w in enumerate(weights)}
    free.sort(key=lambda w: _tie_key(w, position))

    offload = []
    offloaded = 0
    ws = 0

    offloaded_by_module = {}  # module path -> [(rank, working set, fused)] of its offloaded tensors
    widest = None  # the module whose offloaded tensors set ``ws``

    def together(tensors) -> int:
        """The most one op pages of one module's offloaded tensors (see ``Weight.fused``)."""
        if any(fused for _, _, fused in tensors):
            return sum(ws for _, ws, _ in tensors)
        top = max(rank for rank, _, _ in tensors)
        return max(ws for rank, ws, _ in tensors if rank == top) + sum(ws for rank, ws, _ in tensors if rank < top)

    def add(w):
        """Offload ``w``; keep ``ws`` = the most one op pages at once. An op may read every tensor
        of one module together (weight and bias of a linear, all four weights of an LSTM layer in
        one cuDNN call, in_proj weight and bias of attention), so a module's offloaded tensors
        count together; ops over tensors of several modules (``cat`` of two weights) page their
        inputs one at a time (dispatch's list ops), so they need no more room than one of them.
        A model's own modules count as ``Weight.fused`` says."""
        nonlocal offloaded, ws, widest
        offload.append(w)
        offloaded += w.nbytes
        for stem in {name.rpartition(".")[0] for name in w.names}:
            tensors = offloaded_by_module.setdefault(stem, [])
            tensors.append((len(w.shape), w.working_set, w.fused))
            need = together(tensors)
            if need > ws:
                ws, widest = need, stem

    for w in forced:
        add(w)
    candidates = iter(free)

    def room_needed():
        return ws + (prefetch_room() if prefetch else 0)

    def prefetch_room():
        """Room for copies ahead of the current op: another working set, or a layer's routed experts."""
        routed = {}  # a layer's experts module -> bytes of its stacks' routed experts together
        for w in offload:
            if len(w.shape) >= 3 and w.shape[0] > 0 and "experts" in w.name.split("."):
                stem = w.name.rpartition(".")[0]
                routed[stem] = routed.get(stem, 0) + w.nbytes // w.shape[0] * min(w.shape[0], EXPERTS_PER_STEP)
        return max([ws, *routed.values()])

    def fits(budget, copies=1):
        if copies == 2:
            return total - offloaded + ws + prefetch_room() <= budget
        return total - offloaded + copies * ws <= budget

    if offload_bytes is not None:
        for w in candidates:
            if offloaded >= offload_bytes:
                free_left = [w] + list(candidates)
                candidates = iter(free_left)
                break
            add(w)
        if budget_bytes is None:
            budget_bytes = total - offloaded + room_needed()
    if budget_bytes is None:
        raise ValueError("offtensor: plan() needs a budget or offload_bytes")

    pending = list(candidates)
    while pending and not fits(budget_bytes):
        add(pending.pop(0))
    if prefetch and fits(budget_bytes):
        # Room for a second copy lets the next weight's copy overlap the current op's compute.
        # Offloading one more weight of the same kind frees about that much, so this costs about one
        # weight's bytes per forward; never worth it for the last class (touched by every token).
        while pending and not fits(budget_bytes, 2) and weight_kind(pending[0]) != LAST:
            add(pending.pop(0))
    if not fits(budget_bytes):
        # Every weight the policy allows is offloaded by now: what stays resident is what it keeps.
        largest = max(offload, key=lambda w: w.working_set, default=None)
        needs = []
        if kept:
            needs.append(
                f"the policy keeps {total - offloaded} bytes resident ({len(kept)} tensors, e.g. '{kept[0].name}')"
            )
        if largest is not None:
            of_widest = [w for w in offload if any(n.rpartition(".")[0] == widest for n in w.names)]
            first = max(of_widest, key=lambda w: w.working_set).name if of_widest else largest.name
            needs.append(
                f"paging '{first}'"
                + (f" (one op of module '{widest}', {len(of_widest)} offloaded tensors)" if len(of_widest) > 1 else "")
                + f" needs {ws} bytes on the device at once"
            )
        raise BudgetError(
            f"offtensor: a budget of {budget_bytes} bytes cannot hold this model even with every other weight "
            f"offloaded: {' and '.join(needs)}, {total - offloaded + ws} bytes in all. Raise budget_gb"
            + (" or let the policy offload more." if kept else ".")
        )
    spread = _spread(offload, free, position)
    if spread is not offload:
        chosen = offload
        offload, offloaded, ws, widest = [], 0, 0, None
        offloaded_by_module.clear()
        for w in spread:
            add(w)
        if not fits(budget_bytes):  # a module's tensors together made the working set larger: keep the first choice
            offload, offloaded, ws, widest = [], 0, 0, None
            offloaded_by_module.clear()
            for w in chosen:
                add(w)
    offload_ids = {id(w) for w in offload}
    resident = [w for w in weights if id(w) not in offload_ids]
    return Plan(offload, resident, budget_bytes, total - offloaded, offloaded, ws)


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
