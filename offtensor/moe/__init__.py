"""Routed experts: which offloaded tensors are stacks of experts, how their cached copies are used
and evicted, the guess of the next MoE layer's experts, and the routing a run measures.

    stack.py       Stack (per-stack counters), LayerOrder (the layer order of a pass)
    stacks.py      ExpertStacks: what the pager holds as
                   ``pager.experts`` (its observer and eviction policy for experts)
    eviction.py    ExpertEviction: use frequencies, per-layer reuse, the victim
    eviction_index.py  what eviction keeps between searches: predicted next turns (NextTurn), each
                   layer's best candidate (KeptBest), per stack its copies by coldness (ColdHeaps)
    prefetch.py    ExpertIssuer: the current op's experts (announce / expect) and their copies
    guesses.py     Router: a router's record of its guesses (confidence bins, their precision, the
                   gates a copy must pass, the report); the host softmax / top-k of a guess
    speculation.py RoutingSpeculator: guesses of the next layer's experts, scored and copied
    predictor.py   LookaheadPredictor: the learned look-ahead (a ridge fit of the next layer's
                   experts from this layer's router input, and of the layer after next; a logistic
                   fit of the layer's own experts at the next token, for eviction), fitted,
                   compared, saved, installed
    refit.py       fit_offline: the learned look-ahead fitted from a model's recorded routing and
                   saved beside its checkpoint; OnlineRefit: refitted now and then from the
                   routing a wrapped model records as it decodes
    routing.py     is_routed_stack, router_modules, routed_experts (the one reader of router
                   outputs), RoutingStats, routing_stats_of, RoutingRecorder
    hooks.py       attach / detach: stacks registered with a pager, routers hooked
"""

from .hooks import attach, detach
from .predictor import reinstall
from .routing import (RoutingRecorder, RoutingStats, is_routed_stack, model_top_k, routed_experts, router_modules,
                      routing_stats_of, select_experts)
from .speculation import RoutingSpeculator
from .stacks import ExpertStacks

__all__ = ["ExpertStacks", "RoutingRecorder", "RoutingSpeculator", "RoutingStats", "attach", "detach",
           "is_routed_stack", "model_top_k", "routed_experts", "router_modules", "routing_stats_of", "select_experts"]
