"""wrap_model / unwrap_model / stats: turn a model's weights into resident device tensors and
OffloadedTensors for a budget, in place, keeping every Parameter object and every tie, and back.

The work is ``model.prepare``'s (check -> collect -> choose -> experts -> apply, the pipeline the
loader and ``ot.plan`` run too); the expert placement of an MoE model is ``sim.expert_choice``'s.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from .config import OffloadConfig
from .sim.expert_choice import choose_expert_placement
from .model.copies import state_of
from .model.moves import check_attribute_names, resident_bytes, untracked_bytes
from .model.prepare import check_wrappable, prepare, unwrap
from .pager import OffloadStats, resolve_device
from .tensor import OffloadedTensor


def wrap_model(model: nn.Module, budget_gb: Optional[float] = None, *, device=None, offload_gb: Optional[float] = None,
               prefetch: bool = True, policy=None, routing=None, expert_compute: str = "device", expert_pool: bool = False) -> nn.Module:
    """Place ``model``'s weights for a device budget, in place; returns ``model``.

    Weights that fit stay plain device tensors; the rest become OffloadedTensors paged onto the
    device per op. Every Parameter object and every tie is kept. The arguments make an
    ``OffloadConfig``:

    - ``budget_gb``: GiB (2**30 bytes) the weights may hold on the device at once: resident
      weights + paged copies + prefetches in flight.
    - ``device``: where the model runs; None is ``cuda`` (the current device) when available, else
      ``cpu`` (the emulated device).
    - ``offload_gb``: instead of a budget, offload at least this many GiB and keep the rest
      resident (vLLM's ``cpu_offload_gb``). With neither, the budget is the device's free memory
      minus a 2 GiB margin for activations.
    - ``prefetch``: copy the next weights ahead of use while the current op computes, and leave
      room in the budget for that copy.
    - ``policy``: which weights to offload or keep, by full name (``'layers.0.mlp.weight'``):
      a list of fnmatch patterns to offload (``["*.mlp.*"]``), a dict
      ``{"offload": [...], "keep": [...]}``, or a callable ``name -> "offload" | "keep" | None``
      (None: no opinion). Unnamed weights are placed by the default order.
    - ``routing``: an MoE model's measured routing, which decides at wrap time how its expert
      stacks are placed; see docs/moe.md.
    - ``expert_compute``: where a routed expert that is not cached on the device is computed:
      ``"device"`` (copied first), ``"host"`` (from its host master) or ``"auto"`` (per MoE layer
      and step shape, chosen by replay); see docs/moe.md.
    - ``expert_pool``: give the routed expert stacks a device-side expert pool whose slots are
      assigned on the device, so a decode step makes no host decision on the expert path (it can
      be compiled with ``fullgraph=True`` and captured in a CUDA graph); its bytes come out of the
      budget, and a budget too small for one step's experts raises ``BudgetError``; see docs/moe.md.
    """
    check_wrappable(model)
    config = OffloadConfig.from_arguments(budget_gb=budget_gb, offload_gb=offload_gb, device=device,
                                          prefetch=prefetch, policy=policy, routing=routing,
                                          expert_compute=expert_compute, expert_pool=expert_pool)
    prepare(model, config, resolve_device(config.device), check=_check_groups, choose_experts=choose_expert_placement)
    return model


def _check_groups(groups: list) -> None:
    """What wrap_model refuses before anything moves: attribute names an OffloadedTensor uses, meta weights."""
    for g in groups:
        for member in g:
            check_attribute_names(member.tensor, f"'{member.names[0]}'")
        t = g[0].tensor
        if not isinstance(t, OffloadedTensor) and t.is_meta:
            raise ValueError(
                f"offtensor: '{g[0].names[0]}' ({g.nbytes} bytes) is on the meta device and has no values; "
                f"use ot.load_safetensors(model, path) for a model built on meta, or build it on cpu (torch.empty "
                f"weights take no memory until written) and load it after wrapping"
            )


def unwrap_model(model: nn.Module) -> nn.Module:
    """Every weight back to a plain tensor on the device, keeping identities and ties. Under the
    pager's lock: an op of another thread's forward finishes first, and its next op reads the
    plain weights, which hold the same values."""
    state = state_of(model)
    with state.pager.lock:
        return unwrap(model, state)


def stats(model: nn.Module) -> OffloadStats:
    """The wrapped ``model``'s counters since wrapping or the last ``reset_stats``: budget,
    resident and offloaded bytes, page-ins, prefetches, cache hits and evictions, the peak device
    bytes, device bytes of tensor attributes no weight shares (``untracked_bytes``) and, for an MoE
    model, how its experts were placed and why (``expert_placement``). With ``expert_pool=True``
    also the pool's fetches and hits (``expert_pool``; its fetched bytes are part of ``bytes_h2d``):
    they are counted on the device, so this call reads them there, which on a GPU waits for the
    work queued so far (the decode steps themselves never wait for them)."""
    state = state_of(model)
    with state.pager.lock:
        if state.experts_stale:
            state.refresh_experts()
        state.pager.recount_resident(resident_bytes(model, state.pager.device))
        s = state.pager.snapshot()
        s.untracked_bytes = untracked_bytes(model, state.pager.device)
        s.expert_placement = dict(state.expert_placement) if state.expert_placement is not None else None
    return s


def reset_stats(model: nn.Module) -> None:
    """Zero the wrapped ``model``'s counters (page-ins, bytes copied, prefetches, hits, the peak),
    for example after a warm-up forward; placement and budget are unchanged."""
    state_of(model).pager.reset_stats()
