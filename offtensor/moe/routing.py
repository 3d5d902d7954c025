"""Routing: which tensors are routed expert stacks, which modules are their routers, which experts a
router selects (the one reader of router outputs), and the routing a run measures.

``routed_experts`` is the only place a router's output is turned into expert ids: the ids it
returns where it returns them (transformers' routers return logits, weights and indices), else the
top-k of its logits by the router's own rule (DeepSeek-V3 selects on sigmoid scores plus
``e_score_correction_bias``, as transformers' ``DeepseekV3TopkRouter`` does). The recorder
(``RoutingRecorder``) and the speculator (``speculation.RoutingSpeculator``) both read routers
through it. ``RoutingStats`` is the routing measured on a real run that plans of MoE models take.

Nothing here reads model code: routers are found by their weight (``[num_experts, hidden]``, the
leading size of a registered stack) and their names (``gate``/``router``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from typing import Optional

import torch
from torch import nn

ROUTER_NAMES = ("gate", "router")


def is_routed_stack(name: str, shape) -> bool:
    """Whether the tensor registered as ``name`` is a stack of routed experts: 3 dims or more under
    an ``experts`` module (``mlp.experts.gate_up_proj``). One rule for the cache, placement and plans."""
    return len(shape) >= 3 and "experts" in name.split(".")


def router_modules(model: nn.Module, sizes) -> list:
    """(name, module) of ``model``'s routers, in module order: a ``gate`` / ``router`` whose weight
    is [num_experts, hidden] for a ``num_experts`` in ``sizes``."""
    routers = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if (name.rpartition(".")[2] in ROUTER_NAMES and isinstance(weight, torch.Tensor) and weight.dim() == 2
                and weight.shape[0] in sizes):
            routers.append((name, module))
    return routers



def attribute_top_k(module: nn.Module) -> Optional[int]:
    for name in ("top_k", "num_experts_per_tok"):
        value = getattr(module, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None



def model_top_k(model: nn.Module) -> Optional[int]:
    """How many experts ``model`` routes each token to, from its config or any module's attribute."""
    config = getattr(model, "config", None)
    for owner in (config, *model.modules()):
        for name in ("num_experts_per_tok", "top_k", "moe_top_k"):
            value = getattr(owner, name, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def correction_bias(module: nn.Module, num_experts: int) -> Optional[torch.Tensor]:
    """The router's ``e_score_correction_bias`` (DeepSeek-V3), where it has one on the host side of
    paging (not offloaded) with one entry per expert; else None."""
    bias = getattr(module, "e_score_correction_bias", None)
    if isinstance(bias, torch.Tensor) and not hasattr(bias, "_master") and bias.shape[-1] == num_experts:
        return bias
    return None


def select_experts(logits: torch.Tensor, top_k: int, module: nn.Module) -> torch.Tensor:
    """[tokens, top_k] ids of the experts ``module`` (a router) selects from its ``logits``: their
    top-k, or with a correction bias the top-k of sigmoid scores plus the bias. Stays on the device."""
    num_experts = logits.shape[-1]
    with torch.no_grad():
        scores = logits.detach().reshape(-1, num_experts).float()
        bias = correction_bias(module, num_experts)
        if bias is not None:
            scores = scores.sigmoid() + bias.detach().float()
        return scores.topk(min(top_k, num_experts), dim=-1).indices


def routed_experts(output, num_experts: int, top_k: int, module: nn.Module) -> Optional[torch.Tensor]:
    """[tokens, top_k] expert ids from a router's output: the ids it returns (transformers'
    routers return logits, scores and indices), else ``select_experts`` of its logits. None when
    the output holds neither (or only meta tensors). Stays on the device: nothing is read."""
    outs = output if isinstance(output, (tuple, list)) else (output,)
    tensors = [t for t in outs if isinstance(t, torch.Tensor) and t.dim() >= 1 and not t.is_meta]
    ids = next((t for t in tensors if not t.is_floating_point() and t.shape[-1] == top_k), None)
    if ids is not None:
        return ids.detach().reshape(-1, top_k)
    logits = next((t for t in tensors if t.is_floating_point() and t.shape[-1] == num_experts), None)
    if logits is None:
        return None
    return select_experts(logits, top_k, module)


# ---------------------------------------------------------------------------- measured routing for plans


def _number(v) -> bool:
    """A finite JSON number (not a bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _shares(values) -> bool:
    """Whether ``values`` are finite non-negative numbers with a positive sum."""
    return all(_number(v) and v >= 0 for v in values) and sum(values) > 0


@dataclasses.dataclass
class RoutingStats:
    """Routing measured on a real run, for plans of MoE models (``plan(..., routing=stats)``).

    Per MoE layer of the measured model: ``popularity``, the share of routed slots each expert
    took, most used first (the layer's skew), and ``locality``, the share of a token's experts
    that the previous token also used there (token-to-token reuse). A plan of a model with other
    counts scales them: the planned model's layers map onto the measured ones in proportion, and a
    layer's popularity curve is resampled at the planned expert count (the top 10% of experts take
    the same share of the routing). ``lookahead_precision`` (the next layer's top-k guessed from
    this layer's router input, per layer) is carried with the figures but enters no plan: meta
    tensors have no router values, so a plan makes no guesses (a real run copies them,
    moe.speculation.SPECULATE_COPY), and its step times are the cache's alone."""

    popularity: list
    locality: list
    top_k: int
    lookahead_precision: list = dataclasses.field(default_factory=list)
    source: str = ""

    @classmethod
    def from_trace(cls, steps, num_experts: int, lookahead_precision=(), source: str = "") -> "RoutingStats":
        """``steps``: a recorded decode, one entry per step, each a list over MoE layers of the
        expert ids that step's token was routed to."""
        if not steps or not steps[0]:
            raise ValueError("offtensor: RoutingStats.from_trace needs at least one step of one MoE layer")
        layers, top_k = len(steps[0]), len(steps[0][0])
        popularity, locality = [], []
        for layer in range(layers):
            counts = [0] * num_experts
            shared = pairs = 0
            prev = None
            for step in steps:
                ids = [int(e) for e in step[layer]]
                if len(ids) != top_k or any(not 0 <= e < num_experts for e in ids):
                    raise ValueError(f"offtensor: routing trace layer {layer}: {ids} is not {top_k} ids below "
                                     f"{num_experts}")
                for e in ids:
                    counts[e] += 1
                if prev is not None:
                    shared += len(prev & set(ids))
                    pairs += 1
                prev = set(ids)
            total = sum(counts)
            popularity.append(sorted((c / total for c in counts), reverse=True))
            locality.append(shared / (top_k * pairs) if pairs else top_k / num_experts)
        return cls(popularity, locality, top_k, list(lookahead_precision), source)

    @classmethod
    def uniform(cls, num_experts: int, top_k: int, layers: int = 1) -> "RoutingStats":
        """What an unmeasured plan assumes: every expert alike, consecutive tokens independent."""
        return cls([[1.0 / num_experts] * num_experts for _ in range(layers)], [top_k / num_experts] * layers, top_k,
                   source="uniform")

    @classmethod
    def load(cls, path: str) -> "RoutingStats":
        """A RoutingStats JSON (``to_dict``'s, alone or under ``"routing_stats"``); anything else
        is a ValueError naming the file and what is wrong with it."""
        with open(path) as f:
            d = json.load(f)
        if isinstance(d, dict):
            d = d.get("routing_stats", d)

        def wrong(what):
            return ValueError(f"offtensor: {path} is not routing statistics: {what}")

        if not isinstance(d, dict):
            raise wrong(f"a JSON {type(d).__name__}, not an object")
        missing = [k for k in ("popularity", "locality", "top_k") if k not in d]
        if missing:
            raise wrong(f"no {', '.join(missing)}")
        popularity, locality, top_k = d["popularity"], d["locality"], d["top_k"]
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
            raise wrong(f"top_k {top_k!r} is not a whole number of at least 1")
        if (not isinstance(popularity, list) or not popularity
                or not all(isinstance(row, list) and len(row) >= top_k and _shares(row) for row in popularity)):
            raise wrong("popularity is not a list, per MoE layer, of at least top_k non-negative shares summing "
                        "above 0")
        if not isinstance(locality, list) or not locality or not all(_number(v) and 0 <= v <= 1 for v in locality):
            raise wrong("locality is not a list of shares between 0 and 1, one per MoE layer")
        return cls(popularity, locality, top_k, d.get("lookahead_precision", []), d.get("source", path))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def layer_shares(self, layer: int, layers: int, num_experts: int) -> list:
        """The popularity of planned layer ``layer`` of ``layers``, resampled at ``num_experts``:
        share i is the measured cumulative share curve between ranks i / E and (i + 1) / E."""
        measured = self.popularity[min(layer * len(self.popularity) // max(layers, 1), len(self.popularity) - 1)]
        n = len(measured)
        cum = [0.0]
        for p in measured:
            cum.append(cum[-1] + p)

        def at(x):  # the cumulative share of the top x (0..1) of the experts, piecewise linear
            pos = x * n
            i = min(int(pos), n - 1)
            return cum[i] + (pos - i) * measured[i]

        shares = [max(at((i + 1) / num_experts) - at(i / num_experts), 0.0) for i in range(num_experts)]
        total = sum(shares)
        return [s / total for s in shares]

    def layer_locality(self, layer: int, layers: int) -> float:
        return self.locality[min(layer * len(self.locality) // max(layers, 1), len(self.locality) - 1)]

    def summary(self) -> dict:
        """Per measured layer: entropy of expert use (bits) and locality, as the plan tables show them."""
        entropy = [-sum(p * math.log2(p) for p in layer if p > 0) for layer in self.popularity]
        return {"layers": len(self.popularity), "experts": len(self.popularity[0]), "top_k": self.top_k,
                "entropy_bits": entropy, "locality": list(self.locality),
                "lookahead_precision": list(self.lookahead_precision), "source": self.source}


def routing_stats_of(routing, num_experts: Optional[int] = None, what: str = "routing") -> RoutingStats:
    """``routing`` as ``RoutingStats``: a ``RoutingStats``; a recorded trace (``from_trace``'s
    steps: per step, per MoE layer, the expert ids the token was routed to) of a model with
    ``num_experts`` experts per layer; or a path to a JSON file holding either (``to_dict``'s
    fields, as ``benchmarks/moe_sim.py`` writes them, or a trace). Anything else is a TypeError or
    ValueError that says what is wrong with it."""
    if isinstance(routing, (str, os.PathLike)):
        path = os.fspath(routing)
        try:
            with open(path) as f:
                loaded = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"offtensor: {what}={path!r} is not a readable JSON file of routing statistics or a "
                             f"routing trace: {type(e).__name__}: {e}") from None
        if isinstance(loaded, dict):
            loaded = loaded.get("routing_stats", loaded)
            missing = [k for k in ("popularity", "locality", "top_k") if k not in loaded]
            if missing:
                raise ValueError(f"offtensor: {what}={path!r} holds a JSON object without {missing}: not "
                                 f"RoutingStats.to_dict()'s fields (popularity, locality, top_k)")
            loaded = RoutingStats(loaded["popularity"], loaded["locality"], loaded["top_k"],
                                  loaded.get("lookahead_precision", []), loaded.get("source", path))
        return routing_stats_of(loaded, num_experts, f"{what} (from {path!r})")
    if isinstance(routing, RoutingStats):
        _check_routing_stats(routing, what)
        return routing
    if isinstance(routing, (list, tuple)):
        if num_experts is None:
            raise ValueError(f"offtensor: {what} is a routing trace, but the model has no routed expert stacks to "
                             f"say how many experts its ids count")
        try:
            return RoutingStats.from_trace(routing, num_experts, source=f"a routing trace of {len(routing)} steps")
        except (TypeError, IndexError) as e:
            raise ValueError(f"offtensor: {what} is not a routing trace (a list of steps, each a list over MoE "
                             f"layers of the expert ids a token was routed to): {type(e).__name__}: {e}") from None
    raise TypeError(f"offtensor: {what} must be RoutingStats, a routing trace (a list of steps, each a list over MoE "
                    f"layers of expert ids) or a path to a JSON file of either, got {type(routing).__name__}")


def _check_routing_stats(stats: RoutingStats, what: str) -> None:
    layers = stats.popularity
    if not isinstance(layers, (list, tuple)) or not layers or not all(isinstance(p, (list, tuple)) and p
                                                                        for p in layers):
        raise ValueError(f"offtensor: {what}: popularity must be a non-empty list of per-layer lists of expert "
                         f"shares, got {str(layers)[:80]}")
    if not isinstance(stats.top_k, int) or isinstance(stats.top_k, bool) or stats.top_k < 1:
        raise ValueError(f"offtensor: {what}: top_k must be a positive int, got {stats.top_k!r}")
    for i, shares in enumerate(layers):
        total = sum(shares) if all(isinstance(p, (int, float)) and p >= 0 for p in shares) else None
        if total is None or abs(total - 1.0) > 1e-3:
            raise ValueError(f"offtensor: {what}: layer {i}'s popularity must be non-negative shares summing to 1, "
                             f"got {str(shares)[:80]} (sum {total})")
    if len(stats.locality) != len(layers) or not all(isinstance(x, (int, float)) and 0 <= x <= 1
                                                       for x in stats.locality):
        raise ValueError(f"offtensor: {what}: locality must be one share in [0, 1] per layer ({len(layers)}), got "
                         f"{str(stats.locality)[:80]}")


def _router_modules(model: nn.Module) -> list:
    """(name, module, experts) of the routers of ``model``'s routed expert stacks, in module order:
    what ``moe.attach`` hooks (a ``gate`` / ``router`` with a [num_experts, hidden] weight)."""
    sizes = {t.shape[0] for name, t in list(model.named_parameters()) + list(model.named_buffers())
             if is_routed_stack(name, t.shape)}
    return [(name, module, module.weight.shape[0]) for name, module in router_modules(model, sizes)]


class RoutingRecorder:
    """The routing a model runs, read off its routers' outputs by forward hooks: for each routed
    token (every row a router sees, prefill rows in order, then each decode step's), the experts
    of every MoE layer. Ids stay on the device until ``trace()`` reads them all at once, so
    recording adds no host sync. Records ``limit`` tokens per router, then nothing."""

    def __init__(self, model: nn.Module, limit: int):
        self.limit = limit
        self.top_k = model_top_k(model)
        routers = _router_modules(model) if self.top_k else []
        self.num_experts = max((e for _, _, e in routers), default=None)
        self.ids = [[] for _ in routers]  # per router: [tokens, top_k] id tensors, in call order
        self.rows = [0] * len(routers)
        self.hooks = [module.register_forward_hook(functools.partial(self._seen, i, experts_count))
                      for i, (_, module, experts_count) in enumerate(routers)]

    def _seen(self, i: int, num_experts: int, module, args, output) -> None:
        if torch.compiler.is_compiling() or self.rows[i] >= self.limit:
            return
        ids = routed_experts(output, num_experts, self.top_k, module)
        if ids is not None:
            self.ids[i].append(ids)
            self.rows[i] += ids.shape[0]

    @property
    def tokens(self) -> int:
        """Tokens every router has been seen routing."""
        return min(self.rows, default=0)

    def trace(self) -> list:
        """The recorded routing as ``RoutingStats.from_trace`` takes it: per token, per layer, ids."""
        n = self.tokens
        layers = [torch.cat(ids)[:n].tolist() for ids in self.ids]
        return [[layer[t] for layer in layers] for t in range(n)]

    def stats(self) -> RoutingStats:
        return RoutingStats.from_trace(self.trace(), self.num_experts,
                                       source=f"measured by the wrapped model over its first {self.tokens} routed tokens")

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []
        self.ids = [[] for _ in self.ids]
