"""The expert placement of a wrapped MoE model: whether whole expert stacks stay resident (the
default) or every stack is paged through the expert cache, decided once by the replay (plan.py) of
both, at wrap time under ``routing=`` or from the model's own first routed tokens."""

from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch import nn

from .. import placement
from ..config import OffloadConfig
from ..model.groups import StorageGroup
from ..model.copies import model_state
from ..model.prepare import pinned, re_place_experts
from ..model.state import State
from ..moe import RoutingRecorder, is_routed_stack, model_top_k, routing_stats_of
from .host_compute import cached_share, choose_expert_compute
from ..placement import ModelPlacement
from .plan import faster_expert_placement
from .twins import decode_example, meta_twin, sync_twin


# The default placement keeps whole expert stacks resident as far as the budget holds them and
# pages the rest; the other one pages every stack through the expert cache
# (``placement.EXPERTS_PAGED``). Skewed routing with token-to-token reuse favours the second (the
# cache keeps each layer's hot experts; a resident stack holds its cold ones too), uniform routing
# the first. Which one is decided once, by the replay of both (plan.py), never by a flag, and never
# undone: a second decision could undo the first on a few tokens' noise.


def choose_expert_placement(model: nn.Module, groups: list, placed: ModelPlacement, config: OffloadConfig,
                             device: torch.device):
    """The expert placement at wrap time: (placement, config, report, watch). ``watch`` is a
    ``PlacementWatch`` when the decision waits for the model's own routing (or, for a model
    that is not a transformers language model, for a forward to plan a step of). Under
    ``expert_compute="auto"`` the config also carries the per-layer choice of where uncached
    experts are computed (``host_compute``)."""
    placed, config, report, watch = _choose_expert_placement(model, groups, placed, config, device)
    if config.expert_compute == "auto":
        stacks = [g for g in groups if is_expert_stack(g)]
        named = [(g.names[0], tuple(g.tensor.shape), g.tensor.dtype) for g in stacks]
        choice = choose_expert_compute(named, config.placement_profile, model_top_k(model), cached_share(placed, stacks))
        config = config.replace(expert_compute_choice=choice)
    return placed, config, report, watch


def _choose_expert_placement(model: nn.Module, groups: list, placed: ModelPlacement, config: OffloadConfig,
                             device: torch.device):
    stacks = [g for g in groups if is_expert_stack(g)]
    if not stacks:
        if config.routing is not None:
            raise ValueError(
                f"offtensor: routing= was given, but {type(model).__name__} has no routed expert stacks (tensors of "
                f"3 or more dims under an 'experts' module, such as 'layers.0.mlp.experts.down_proj') whose placement "
                f"it could decide; leave routing out for a dense model")
        return placed, config, None, None
    num_experts = max(g.tensor.shape[0] for g in stacks)
    # A bad routing= fails here, before anything moves (with a policy too: it is still a mistake).
    stats = routing_stats_of(config.routing, num_experts) if config.routing is not None else None
    if config.policy is not None:
        why = "the policy given to wrap_model places the experts" + (
            "; routing= is not used" if config.routing is not None else "")
        return placed, config, {"chosen": "policy", "why": why}, None
    if not expert_placement_open(placed):
        why = ("every weight stays resident" if not placed.offloaded
               else "the budget offloads every expert stack either way")
        return placed, config, {"chosen": "default", "why": why}, None
    if stats is None and config.routing_warmup == 0:
        return placed, config, {"chosen": "default", "why": "routing_warmup=0: no decision by measured routing"}, None
    twin = meta_twin(model)
    example = decode_example(model)
    if stats is None or example is None:
        why = (f"to be decided after {config.routing_warmup} routed tokens" if stats is None
               else "to be decided at the first forward (its inputs give the planned step)")
        return placed, config, {"chosen": "default", "why": why}, PlacementWatch(twin, stats)
    # A failed replay warns at the caller of wrap_model or the loader (it runs inside ``prepare``).
    report = _replay_expert_placement(twin, placed.budget_bytes, example, stats, config, "at wrap time, by routing=",
                                      stacklevel=5)
    if report["chosen"] == "all_paged":
        config = config.replace(policy=placement.EXPERTS_PAGED)
        placed = placement.choose_model_placement(groups, pinned(config, placed.budget_bytes), device)
    return placed, config, report, None


def _replay_expert_placement(twin: nn.Module, budget_bytes: int, example, stats, config: OffloadConfig,
                             when: str, stacklevel: int = 4) -> dict:
    """The report of the replay of both placements; the default, with the reason, if the
    replay cannot run (a model whose forward does not run on meta)."""
    try:
        report = faster_expert_placement(twin, budget_bytes, example, stats,
                                                        config.placement_profile, config.prefetch)
    except Exception as e:  # noqa: BLE001 - whatever stops the plan, the model runs on as placed
        warnings.warn(f"offtensor: the expert placement stays the default: its replay failed "
                      f"({type(e).__name__}: {e})", UserWarning, stacklevel=stacklevel)
        return {"chosen": "default", "why": f"the replay failed: {type(e).__name__}: {e}", "decided": when}
    report.pop("policy", None)
    report["decided"] = when
    faster = "every stack paged" if report["chosen"] == "all_paged" else "the default placement"
    report["why"] = (f"{faster} replays faster: {report['default_step_ms']:.3f} ms/step default, "
                     f"{report['all_paged_step_ms']:.3f} ms/step all paged ({report['profile']})")
    return report


class PlacementWatch:
    """Forward pre-hook of a wrapped MoE model whose expert placement is still open. With
    ``stats`` None it records the model's routing (``moe.RoutingRecorder``) and, at the first
    forward after ``routing_warmup`` routed tokens, before that forward pages anything, replays
    both placements under it and re-places the experts if paging every stack is faster. Then it
    removes itself: the decision is taken once. A copy of the model (deepcopy, pickle) keeps the
    placement it was copied with and decides nothing."""

    def __init__(self, twin: Optional[nn.Module] = None, stats=None):
        self.twin, self.stats = twin, stats
        self.recorder = None
        self.handle = None
        self.verdict = None  # the replay's report once it chose every stack paged

    def start(self, state: State, model: nn.Module) -> None:
        if self.stats is None:
            self.recorder = RoutingRecorder(model, state.config.routing_warmup)
            if not self.recorder.hooks:
                self.stop()
                state.expert_placement = {"chosen": "default", "why": "no router of the expert stacks was found (a "
                                          "'gate' or 'router' with a [num_experts, hidden] weight and a known top-k)"}
                return
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True, prepend=True)
        state.watch = self

    def __call__(self, model, args, kwargs):
        if torch.compiler.is_compiling():
            return None
        state = model_state(model)  # (a copy.copy of the model runs the same modules: its forwards count too)
        if state is None or state.watch is not self:
            if state is not None:
                self.stop()  # decided (a decision cut short after it was recorded left the hooks)
            return None
        if self.recorder is not None and self.recorder.tokens < state.config.routing_warmup:
            return None
        with state.pager.lock:
            if state.watch is self:  # another thread's forward may have decided first
                _decide_expert_placement(state, state.model_ref(), self, args)
        return None

    def stop(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        if self.recorder is not None:
            self.recorder.remove()
        self.twin = None

    def __deepcopy__(self, memo):
        return PlacementWatch()

    def __reduce__(self):
        return PlacementWatch, ()


def _decide_expert_placement(state: State, model: nn.Module, watch: PlacementWatch, args) -> None:
    """The watch's one decision, under the pager's lock. The watch stays until the decision is
    recorded: one cut short (a Ctrl-C in the replay, or in the re-placement, which copies every
    stack it offloads: seconds on a large model) is taken again at the next forward, instead of
    lost for good with the report saying it is still to be decided."""
    if watch.stats is not None:
        stats, when = watch.stats, "at the first forward, by routing="
    else:
        stats = watch.recorder.stats()
        when = f"after {watch.recorder.tokens} routed tokens, by the routing measured"
    report = watch.verdict
    if report is None or state.config.policy is not placement.EXPERTS_PAGED:  # (else: re-placed, not recorded)
        report = _decision(state, model, watch, args, stats, when)
    state.expert_placement = report
    state.watch = None  # decided: the watch's next call removes it, if this one is cut short before it does
    watch.stop()


def _decision(state: State, model: nn.Module, watch: PlacementWatch, args, stats, when: str) -> dict:
    """The report of the replay under ``stats``, the experts re-placed if every stack paged is faster."""
    example = decode_example(model, args)
    if example is None:
        return {"chosen": "default", "decided": when,
                "why": "no tensor input to plan a step from: the forward takes keywords only"}
    sync_twin(watch.twin, model)
    report = _replay_expert_placement(watch.twin, state.pager.budget_bytes, example, stats, state.config, when,
                                      stacklevel=5)
    if report["chosen"] == "all_paged":
        watch.verdict = report  # kept for a retry that finds the stacks re-placed already
        try:
            re_place_experts(state, model, placement.EXPERTS_PAGED)
        except Exception as e:  # noqa: BLE001 - undone by Undo; the forward runs on the default placement
            warnings.warn(f"offtensor: the experts stay in the default placement: re-placing them failed "
                          f"({type(e).__name__}: {e})", UserWarning, stacklevel=4)
            report = dict(report, chosen="default", why=f"{report['why']}, but re-placing failed: "
                          f"{type(e).__name__}: {e}")
    return report


def is_expert_stack(group: StorageGroup) -> bool:
    """Whether ``group`` is a stack of routed experts (a tensor of 3 dims or more under an
    ``experts`` module: ``mlp.experts.gate_up_proj``), as the expert cache sees one."""
    return any(is_routed_stack(name, group.tensor.shape) for name in group.names)


def expert_placement_open(placed: ModelPlacement) -> bool:
    """Whether the expert placement is a choice at all under ``placed`` (the default): some weight
    is offloaded and some expert stack stays whole. With every weight resident nothing is paged; with
    every stack offloaded both placements are the same."""
    return bool(placed.offloaded) and any(is_expert_stack(g) for g in placed.resident)
