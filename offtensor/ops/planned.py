"""Routing on meta while ``ot.plan`` runs: a meta grouped GEMM's routing has no values, so it is
drawn (uniformly, or from measured ``RoutingStats`` through ``planned_routing``); the expert cache's
path and the expert pool's read it here alike."""

from __future__ import annotations

import inspect
import sys
import threading

import torch

_PLANNED_ROUTING = torch.Generator().manual_seed(0)


def reseed() -> None:
    """The uniform planned routing from its first draw again: each plan (``ot.plan``) starts here,
    so two plans of one model draw the same routing (before, the draws went on from plan to plan:
    the same call planned differently after other plans in the process)."""
    _PLANNED_ROUTING.manual_seed(0)


_planning = threading.local()  # .blocks: (ends, the frame that entered) of this thread's planned_routing blocks


class planned_routing:
    """``with planned_routing(ends):`` while ``ot.plan`` replays with measured routing
    (``moe.RoutingStats``), a meta grouped GEMM's routing comes from ``ends(experts, rows)`` instead
    of ``_planned_ends``; per thread, so a plan in one thread changes no other thread's.

    A class bound to the frame that entered it, not a ``contextlib`` generator: Python can raise a
    Ctrl-C at the entry of a ``with`` exit, before any of its code runs, and a generator's exit
    skipped there left this thread's plans on that routing for as long as the traceback kept the
    generator (a REPL keeps the last one). Here the routing holds only while its frame runs
    (``planned_ends`` drops an entry whose frame has ended); a block in a generator's frame, which
    leaves the stack at each ``yield``, is left to its exit."""

    __slots__ = ("ends",)

    def __init__(self, ends):
        self.ends = ends

    def __enter__(self):
        blocks = getattr(_planning, "blocks", None)
        if blocks is None:
            blocks = _planning.blocks = []
        blocks.append((self.ends, sys._getframe(1)))
        return self

    def __exit__(self, *exc) -> None:
        blocks = _planning.blocks
        for i in range(len(blocks) - 1, -1, -1):
            if blocks[i][0] is self.ends:
                del blocks[i:]
                break


# A generator's or coroutine's frame leaves the stack at each ``yield`` or ``await`` and comes back.
_SUSPENDABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE


def _measured():
    """This thread's measured routing, innermost block first; blocks whose frames ended are dropped."""
    blocks = getattr(_planning, "blocks", None)
    while blocks:
        ends, frame = blocks[-1]
        if frame.f_code.co_flags & _SUSPENDABLE:
            return ends
        f = sys._getframe(1)
        while f is not None and f is not frame:
            f = f.f_back
        if f is not None:
            return ends
        blocks.pop()
    return None


def _planned_ends(experts: int, rows: int) -> list:
    """Planning on meta (ot.plan): routing has no values, so ``rows`` routed rows go to
    min(experts, rows) distinct experts drawn uniformly at random (no locality: what an expert
    cache gains from skewed routing is not assumed), as evenly as they divide. Drawn from one
    generator that each plan seeds anew (``reseed``), so a plan is reproducible whatever ran before it."""
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
    return (_measured() or _planned_ends)(experts, rows)
