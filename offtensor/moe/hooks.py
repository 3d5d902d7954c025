"""How a model's routed experts are wired to its pager: ``attach`` registers the offloaded expert
stacks (``pager.experts``) and hooks the routers; ``detach`` undoes both."""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch import nn

from .pool import POOL_ACCOUNT, build_pools
from .routing import attribute_top_k, is_routed_stack, model_top_k, router_modules
from . import speculation
from .first_layer import host_tokens, input_embeddings
from .guesses import Router
from .predictor import LOOKAHEAD_ACCOUNT
from .speculation import RoutingSpeculator
from .stacks import ExpertStacks


def attach(model: nn.Module, pager, speculate: bool = True, compute: str = "device",
           compute_choice=None, pool: bool = False, room_needed=None) -> Optional[ExpertStacks]:
    """Register ``model``'s offloaded stacked-expert tensors with ``pager`` and, with ``speculate``,
    hook its routers. Returns the pager's ``ExpertStacks`` (None when nothing routed is offloaded).

    ``compute`` says where an expert that is not cached is computed ("device", "host", "auto" with
    its per-layer ``compute_choice``). Guesses are copied ahead only under "device": elsewhere a
    copied guess would take the room of an expert the device computes from its cache.

    With ``pool``, the stacks get device-side expert pools (``pool.build_pools``) whose bytes are
    held from the pager's budget (given back by ``detach``); a budget too small for them raises
    ``BudgetError`` before anything is registered. ``room_needed()``: the bytes the model's largest
    op pages at once (what the learned look-ahead's maps must leave room for, ``predictor.install``)."""
    stacks = ExpertStacks(compute, compute_choice)
    stacks.room_needed = room_needed
    # Guesses are copied into the pager's cache, which a pooled decode does not read from.
    speculate = speculate and compute == "device" and not pool
    seen, tensors, other_bytes = set(), {}, 0
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        master = getattr(t, "_master", None)
        if master is None or master.id in seen:
            continue
        seen.add(master.id)
        if not is_routed_stack(name, t.shape):
            other_bytes = max(other_bytes, master.nbytes)
            continue
        stacks.register(name, t)
        tensors[master.id] = t
    if not stacks.by_master:
        return None
    if pool:  # on meta (ot.plan) too: its slots are sized and its fetches planned (ops/expert_pool.py)
        pools = build_pools(pager, stacks, model_top_k(model), tensors, other_bytes)
        if pools is not None:
            pager.hold_outside(POOL_ACCOUNT, pools.nbytes)  # (cut short here: detach sets it back)
            pager.expert_pool = pools
    pager.experts = stacks
    if not speculate:
        return stacks
    sizes = {s.num_experts for s in stacks.by_master.values()}
    routers = []
    for name, module in router_modules(model, sizes):
        router = Router(name, module)
        if router.top_k is None:
            parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            router.top_k = attribute_top_k(parent)
        # Name fallback until a pass has been recorded: <prefix>.gate selects <prefix>.experts.*.
        prefix = name.rpartition(".")[0] + "."
        router.stacks = [s for s in stacks.by_master.values() if s.name.startswith(prefix)]
        routers.append(router)
    if not routers:
        return stacks
    speculator = RoutingSpeculator(pager, stacks, routers)
    stacks.speculator = speculator  # before its hooks: a detach then removes every one it made
    _remove_stale_hooks(model, pager)
    for router in routers:
        module = router.module_ref()

        speculator.hooks.append(module.register_forward_pre_hook(_RouterHook(router, speculator, False)))
        speculator.hooks.append(module.register_forward_hook(_RouterHook(router, speculator, True)))
    embeddings = input_embeddings(model)
    if embeddings is not None:  # the step's tokens guess the first MoE layer (moe.first_layer)
        speculator.hooks.append(embeddings.register_forward_pre_hook(_TokensHook(speculator)))
    return stacks


def _remove_stale_hooks(model: nn.Module, pager) -> None:
    """Remove the router and token hooks an earlier attach to ``pager`` left on ``model`` without its
    speculator knowing them (a Ctrl-C between a hook's registration and its record), and inert
    ones (a deep copy's): a refresh run again would otherwise hook its routers twice."""
    for module in model.modules():
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for key in [k for k, h in hooks.items() if isinstance(h, _SpeculatorHook) and _stale(h, pager)]:
                del hooks[key]


def _stale(hook: "_SpeculatorHook", pager) -> bool:
    speculator = hook.speculator_ref() if hook.speculator_ref is not None else None
    return speculator is None or speculator.pager_ref() is pager


class _SpeculatorHook:
    """A forward hook that hands what it sees to the speculator under the pager's lock (guesses and
    their scores are pager state, shared by threads' forwards).

    Under torch.compile it stands aside: it reads routing results or token ids on the host, which
    would break the graph; compiled MoE layers page exactly as eager ones, without guesses.

    A copy of the model (``copy.deepcopy``, ``torch.save``) gets an inert hook: the copy is adopted
    on a pager of its own, which hooks its modules itself, and this one would feed the original's
    speculator (a function, which deepcopy shares and pickle refuses, did)."""

    __slots__ = ("speculator_ref",)

    def __init__(self, speculator):
        self.speculator_ref = weakref.ref(speculator) if speculator is not None else None

    def _live(self):
        """(the speculator, its pager) where the hook acts now, else None."""
        if self.speculator_ref is None or torch.compiler.is_compiling():
            return None
        speculator = self.speculator_ref()
        pager = speculator.pager_ref() if speculator is not None else None
        return None if pager is None else (speculator, pager)

    def __deepcopy__(self, memo):
        return type(self)(*self._inert_args())

    def __reduce__(self):
        return type(self), self._inert_args()


class _TokensHook(_SpeculatorHook):
    """The input embeddings' forward pre-hook: a decode step's token ids, read on the host once
    (``first_layer.host_tokens``: None where that would wait for the device) and handed to the
    speculator (``guess_first``) and its recorder (``OnlineRefit.tokens_in``)."""

    __slots__ = ()

    def __call__(self, module, args):
        live = self._live()
        if live is None or not args:
            return None
        speculator, pager = live
        recorder, ids = speculator.recorder, args[0]  # (an OnlineRefit counts the tokens for a table of its own)
        if (speculator.token_table is None and recorder is None) or not isinstance(ids, torch.Tensor) \
                or ids.is_meta or ids.numel() > speculation.GUESS_ON_HOST_TOKENS:  # (a prefill: neither uses its ids)
            return None
        with pager.lock:
            tokens = host_tokens(ids)  # read once for both (on a GPU, a copy to the host)
            if recorder is not None:
                recorder.tokens_in(tokens)
            speculator.guess_first(tokens)
        return None

    @staticmethod
    def _inert_args() -> tuple:
        return (None,)


class _RouterHook(_SpeculatorHook):
    """A router's forward pre-hook (its input: guess the next layer's experts) or forward hook (its
    output: score the guesses)."""

    __slots__ = ("router", "output")

    def __init__(self, router, speculator, output: bool):
        super().__init__(speculator)
        self.router, self.output = router, output

    def __call__(self, module, args, output=None):
        live = self._live()
        if live is None:
            return None
        speculator, pager = live
        if self.output:
            with pager.lock:
                speculator.router_output(self.router, output)
        elif args and isinstance(args[0], torch.Tensor) and not args[0].is_meta:
            with pager.lock:
                if torch.is_grad_enabled():  # (the look-ahead's kernels build no graph; decode runs without one)
                    with torch.no_grad():
                        speculator.router_ran(self.router, args[0])
                else:
                    speculator.router_ran(self.router, args[0])
        return None

    def _inert_args(self) -> tuple:
        return None, None, self.output


def detach(pager) -> None:
    """Undo ``attach``: the pools, router hooks and look-ahead maps go, and the budget they held
    comes back. Every step can run again, and the budget's accounts are set (to nothing) whether or
    not the records still name what held them: a detach, or an attach, cut short anywhere (a Ctrl-C
    between taking bytes and recording what holds them) is put right by the next detach."""
    if getattr(pager, "expert_pool", None) is not None:
        pager.expert_pool = None  # before its bytes come back: cut short between, the budget errs low
    pager.hold_outside(POOL_ACCOUNT, 0)
    stacks = getattr(pager, "experts", None)
    if stacks is not None and stacks.speculator is not None:
        stacks.speculator.remove()
        for router in stacks.speculator.routers:
            router.lookahead = None
    pager.hold_outside(LOOKAHEAD_ACCOUNT, 0)  # the learned look-ahead's maps went with the routers'
    if stacks is not None:
        stacks.lookahead = None
    pager.experts = None
