"""Routing on meta while ``ot.plan`` runs: a meta grouped GEMM's routing has no values, so it is
drawn (uniformly, or from measured ``RoutingStats`` through ``planned_routing``); the expert cache's
path and the expert pool's read it here alike."""

from __future__ import annotations

import contextlib
import threading

import torch

_PLANNED_ROUTING = torch.Generator().manual_seed(0)
_planning = threading.local()  # .ends: the routing of a plan with measured routing, in this thread


@contextlib.contextmanager
def planned_routing(ends):
    """While ``ot.plan`` replays with measured routing (``moe.RoutingStats``), a meta grouped
    GEMM's routing comes from ``ends(experts, rows)`` instead of ``_planned_ends``; per thread, so a
    plan in one thread changes no other thread's."""
    saved = getattr(_planning, "ends", None)
    _planning.ends = ends
    try:
        yield
    finally:
        _planning.ends = saved


def _planned_ends(experts: int, rows: int) -> list:
    """Planning on meta (ot.plan): routing has no values, so ``rows`` routed rows go to
    min(experts, rows) distinct experts drawn uniformly at random (no locality: what an expert
    cache gains from skewed routing is not assumed), as evenly as they divide. Seeded once per
    process, so a plan is reproducible within it."""
    chosen = sorted(torch.randperm(experts, generator=_PLANNED_ROUTING)[: min(experts, rows)].tolist())
    counts = [0] * experts
    for i, e in enumerate(chosen):
        counts[e] = rows // len(chosen) + (i < rows % len(chosen))
    ends, total = [], 0
    for c in counts:
        total += c
        ends.append(total)
    return ends


def planned_ends(experts: int, rows: int) -> list:
    """The cumulative group ends of a meta grouped GEMM of ``rows`` routed rows over ``experts``
    experts: the measured routing of this thread's plan, else ``_planned_ends``."""
    return (getattr(_planning, "ends", None) or _planned_ends)(experts, rows)
