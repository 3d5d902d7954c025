"""Plans on the meta device: the real placement, pager, prefetcher and expert cache run a model built on
meta and the recorder keeps the timeline (``ot.plan``); MoE routing drawn from measured statistics; the
expert placement (whole stacks resident, or every stack paged) chosen by replaying both."""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn

from .. import ops
from ..ops import planned as planned_draws
from ..moe import RoutingStats, model_top_k
from .. import placement
from ..config import OffloadConfig
from ..model.moves import Undo
from ..model.prepare import prepare, unwrap
from ..model.state import wrapped_state
from ..pager import GiB
from .profiles import get_profile
from .recording import timeline
from . import meta_memo
from .selection import PlannedSelection
from .timeline import Timeline

# ---------------------------------------------------------------------------- planning on meta


def plan(model: nn.Module, budget_gb: Optional[float] = None, example_inputs=(), profile="h200", steps: int = 3, *,
         offload_gb: Optional[float] = None, policy=None, prefetch: bool = True, warmup: int = 3,
         forward=None, routing: Optional[RoutingStats] = None, expert_pool: bool = False) -> Timeline:
    """What ``model`` would do on a GPU at this budget: place its weights, run ``warmup + steps``
    forwards on the meta device with the real pager and prefetcher, and return the recorded
    timeline (replay it with ``tl.replay()``). Nothing is allocated or computed; ``model`` may be
    built on meta and is left as it was. ``warmup`` forwards let the prefetcher learn the order
    before the recorded steps (``tl.replay`` reports the last one).

    Routing has no values on meta: MoE layers route each token to distinct experts drawn
    uniformly, unless ``routing`` (``RoutingStats``, measured on a real run) gives each layer's
    skew and token-to-token locality, scaled to this model's expert count.

    ``expert_pool``: plan the model as ``wrap_model(..., expert_pool=True)`` runs it: the pool's
    slots sized from the budget as at wrap, its LRU decisions made on a host mirror of its tables
    from the (planned) routing, each fetch a copy of one slot's bytes on the compute stream (where
    the pool's gather kernel runs), with no host read or host decision on the expert path."""
    if budget_gb is None and offload_gb is None:
        raise ValueError("offtensor: plan() needs budget_gb or offload_gb: a meta model has no device to measure")
    config = OffloadConfig(budget_gb=budget_gb, offload_gb=offload_gb, device=torch.device("meta"), prefetch=prefetch,
                           policy=policy, strict=False, expert_pool=expert_pool)
    _check_built_on_meta(model)
    # The placement wrap_model would make, applied on a meta pager (on meta every copy is done when
    # issued: pager/device.py's MetaDevice); unwrapped when the plan ends, so the model is as it was.
    try:
        placed, pager = prepare(model, config, config.device)
        return _record_plan(model, placed, pager, example_inputs, profile, steps, warmup, forward, routing)
    finally:
        # An unwrap cut short (a Ctrl-C) leaves the model wrapped and whole: it is run again, as an
        # undo is (``Undo.roll_back``), from inside this block, since a helper called here would take
        # an interrupt at its entry, outside any try. A prepare cut short has left nothing wrapped.
        failures, pending = 0, None
        while failures < Undo.ATTEMPTS:
            try:
                state = wrapped_state(model)
                if state is not None:
                    unwrap(model, state)
                break
            except BaseException as error:
                pending = error if pending is None else pending
                failures += 1
        if pending is not None:
            try:
                raise pending
            finally:
                pending = None  # not a cycle through this frame


def _record_plan(model: nn.Module, placed: placement.ModelPlacement, pager, example_inputs, profile, steps: int,
                 warmup: int, forward, routing: Optional[RoutingStats]) -> Timeline:
    """``plan``'s forwards on the prepared meta model, recorded; the timeline with the plan's info."""
    hooks = []
    planned = None
    if routing is not None:
        planned = _PlannedRouting(routing, model_top_k(model) or routing.top_k)
        hooks.append(model.register_forward_pre_hook(lambda m, a: planned.new_step()))
    inputs = tuple(x.to("meta") if isinstance(x, torch.Tensor) else x for x in example_inputs)
    planned_draws.reseed()
    rec = timeline(model, profile)
    tl = rec.tl
    tl.warmup_steps = warmup
    # (outside the recorder: it records each routing read as an op, then this answers it)
    selection = PlannedSelection(model, model_top_k(model) or (routing.top_k if routing is not None else None), pager)
    try:
        # (the memo innermost: it answers an op's kernel, after the recorder and selection saw it)
        with torch.no_grad(), meta_memo.memo(), selection, rec, _routing_from(planned):
            for _ in range(warmup + steps):
                (forward or model)(*inputs)
    finally:
        for h in hooks:
            h.remove()
    tl.info = _planned_info(placed.choice, pager.snapshot())
    tl.info["routing"] = routing.summary() if routing is not None else "uniform"
    return tl


def _check_built_on_meta(model: nn.Module) -> None:
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for attr, t in table.items():
                if t is not None and not t.is_meta:
                    raise ValueError(
                        f"offtensor: plan() needs a model built on meta (found {type(module).__name__}.{attr} on "
                        f"{t.device}); build it under `with torch.device('meta'):`"
                    )


def _planned_info(choice: placement.Placement, stats) -> dict:
    return {
        "budget_bytes": choice.budget_bytes,
        "resident_bytes": choice.resident_bytes,
        "offloaded_bytes": choice.offloaded_bytes,
        "offloaded": [w.name for w in choice.offload],
        "peak_device_bytes": stats.peak_device_bytes,
        "prefetches": stats.prefetches,
        "prefetch_hits": stats.prefetch_hits,
        "budget_gb": choice.budget_bytes / GiB,
        "experts": stats.experts,  # per stacked-expert tensor: hits, misses, bytes (all planned steps)
        "expert_pool": stats.expert_pool,  # expert_pool=True: its slots, fetches and hits (all planned steps)
    }


class _PlannedRouting:
    """Routing on meta drawn from ``RoutingStats``: what ``dispatch``'s planned routing returns
    while ``plan(..., routing=...)`` runs. Each offloaded MoE layer reads its routing once per
    forward, in layer order, so the n-th read of a forward is the n-th MoE layer. A token keeps
    each of the previous token's experts at that layer with the measured locality and draws the
    rest from the layer's popularity (a fixed random assignment of ranks to expert ids per layer),
    excluding the previous token's: the expected reuse is the measured one."""

    def __init__(self, stats: RoutingStats, top_k: int, seed: int = 0):
        self.stats, self.top_k = stats, top_k
        self.g = torch.Generator().manual_seed(seed)
        self.layer, self.layers = 0, 0
        self.weights = {}  # (layer, experts) -> weight per expert id
        self.prev = {}  # layer -> the last token's experts

    def new_step(self) -> None:
        if self.layer:
            self.layers = self.layer
        self.layer = 0

    def _weights(self, layer: int, experts: int) -> torch.Tensor:
        w = self.weights.get((layer, experts))
        if w is None:
            shares = torch.tensor(self.stats.layer_shares(layer, self.layers or len(self.stats.popularity), experts),
                                  dtype=torch.float64)
            w = self.weights[(layer, experts)] = torch.empty_like(shares).scatter_(
                0, torch.randperm(experts, generator=self.g), shares)
        return w

    def ends(self, experts: int, rows: int) -> list:
        layer = self.layer
        self.layer += 1
        w = self._weights(layer, experts)
        k = max(min(self.top_k, experts, rows), 1)
        tokens = max(rows // k, 1)
        counts = torch.zeros(experts, dtype=torch.long)
        if tokens * k > 4 * experts:
            # A prefill: nearly every expert is routed; the rows follow the popularity.
            counts += torch.bincount(torch.multinomial(w, rows, replacement=True, generator=self.g), minlength=experts)
        else:
            reuse = self.stats.layer_locality(layer, self.layers or len(self.stats.locality))
            prev = self.prev.get(layer, [])
            for _ in range(tokens):
                kept = [e for e in prev if torch.rand((), generator=self.g).item() < reuse][:k]
                free = w.clone()
                free[list(set(prev) | set(kept))] = 0.0
                fill = k - len(kept)
                drawn = torch.multinomial(free, fill, replacement=False, generator=self.g).tolist() if fill else []
                prev = kept + drawn
                counts[prev] += 1
            self.prev[layer] = prev
            counts[torch.argmax(counts)] += rows - int(counts.sum())  # rows not a multiple of top-k
        return counts.cumsum(0).tolist()


def _routing_from(routing: Optional[_PlannedRouting]):
    """While planning with measured routing, dispatch's routing of a meta grouped GEMM comes from
    ``routing`` (``ops.planned_routing``, entered by the caller's own frame)."""
    return ops.planned_routing(routing.ends) if routing is not None else contextlib.nullcontext()


# Every routed expert stack offloaded: the whole budget beyond the dense weights is expert cache.
EXPERTS_PAGED = placement.EXPERTS_PAGED


def plan_expert_paging(model: nn.Module, budget_gb: float, example_inputs=(), routing: Optional[RoutingStats] = None,
                       profile="h200", steps: int = 2, warmup: int = 3, prefetch: bool = True) -> dict:
    """Which placement of a MoE model's routed experts is faster at this budget, decided by the
    replay rather than a policy flag: the default placement (whole expert stacks kept resident as
    far as the budget holds them, the rest paged) against every stack paged through the expert
    cache (``EXPERTS_PAGED``), both planned under ``routing`` (uniform without it).

    Skewed routing with token-to-token reuse favours paging everything (the cache keeps each
    layer's hot experts, a resident stack holds its cold ones too); uniform routing favours whole
    stacks. Returns ``{"policy": the wrap_model policy to use (None: the default), "paged": bool,
    "default": Replay, "all_paged": Replay}``."""
    replays = {}
    for name, policy in (("default", None), ("all_paged", EXPERTS_PAGED)):
        tl = plan(model, budget_gb=budget_gb, example_inputs=example_inputs, profile=profile, steps=steps,
                  warmup=warmup, policy=policy, routing=routing, prefetch=prefetch)
        replays[name] = tl.replay()
    paged = replays["all_paged"].step_ms < replays["default"].step_ms
    return {"policy": EXPERTS_PAGED if paged else None, "paged": paged, **replays}


def faster_expert_placement(twin: nn.Module, budget_bytes: int, example_inputs, routing: RoutingStats,
                            profile="h200", prefetch: bool = True) -> dict:
    """``plan_expert_paging`` of ``twin`` at ``budget_bytes`` under ``routing``, as the report
    ``ot.stats(model).expert_placement`` shows: the placement chosen and both replayed steps."""
    profile = get_profile(profile)
    verdict = plan_expert_paging(twin, budget_bytes / GiB, example_inputs, routing=routing, profile=profile,
                                 prefetch=prefetch)
    return {"chosen": "all_paged" if verdict["paged"] else "default", "policy": verdict["policy"],
            "default_step_ms": verdict["default"].step_ms, "all_paged_step_ms": verdict["all_paged"].step_ms,
            "profile": profile.name, "routing": routing.summary()}
