"""The routing trace of ``moe_sim.py`` replayed: offline LRU and Belady on its access sequence,
and offtensor's own pager and expert policy driven by it (``ReplayModel``, a model of the traced
model's expert count and top-k whose routers output the recorded logits and whose router inputs are
the recorded look-ahead logits), at the tiny size (``replay_ours``: hit rates) or at Qwen3-30B-A3B's
expert bytes, recorded and replayed under the ``h200`` profile (``h200_replay``: ms per decode step).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

import offtensor as ot

GiB = 1 << 30
# Every routed expert stack offloaded: the whole budget beyond the dense weights is expert cache
# (default placement would keep whole stacks resident and leave the cache a sliver).
EXPERTS_PAGED = {"offload": ["*.experts.*"]}



def expert_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n and p.dim() == 3)


def budget_gb(model, fraction: float) -> float:
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    experts = expert_bytes(model)
    return (total - experts + fraction * experts) / GiB


# ---------------------------------------------------------------------------- offline simulators


def _accesses(trace):
    """(step, layer, expert) in paging order: layer by layer, each layer's experts in id order."""
    out = []
    for s, step in enumerate(trace["steps"]):
        for layer, rec in enumerate(step):
            for e in sorted(set(rec["routed"].reshape(-1).tolist())):
                out.append((s, layer, e))
    return out


def _tally(trace, hits_of):
    """Per-layer and overall hit rates over decode steps from (step, layer, hit) tuples."""
    L = trace["layers"]
    hits, looks = [0] * L, [0] * L
    for s, layer, hit in hits_of:
        if s == 0:
            continue
        looks[layer] += 1
        hits[layer] += hit
    return {"hit_rate": sum(hits) / sum(looks), "per_layer": [h / n if n else None for h, n in zip(hits, looks)]}


def simulate_lru(trace, capacity: int) -> dict:
    cache, out = OrderedDict(), []
    for s, layer, e in _accesses(trace):
        key = (layer, e)
        hit = key in cache
        if hit:
            cache.move_to_end(key)
        else:
            if len(cache) >= capacity:
                cache.popitem(last=False)
            cache[key] = True
        out.append((s, layer, hit))
    return _tally(trace, out)


def simulate_belady(trace, capacity: int) -> dict:
    """Belady's MIN: on a miss with the cache full, evict the expert whose next use is furthest."""
    acc = _accesses(trace)
    nxt = [math.inf] * len(acc)
    seen = {}
    for i in range(len(acc) - 1, -1, -1):
        key = acc[i][1:]
        nxt[i] = seen.get(key, math.inf)
        seen[key] = i
    cache, out = {}, []  # key -> index of its next use
    for i, (s, layer, e) in enumerate(acc):
        key = (layer, e)
        hit = key in cache
        if not hit and len(cache) >= capacity:
            victim = max(cache, key=cache.get)
            del cache[victim]
        cache[key] = nxt[i]
        out.append((s, layer, hit))
    return _tally(trace, out)


# ---------------------------------------------------------------------------- ours: the real pager on the trace


class _ReplayRouter(nn.Module):
    """A router whose input is the recorded look-ahead logits, then those two layers ahead, then
    the next-token map's ([tokens, 3E]), whose weight is the identity over the first E (so layer
    i's router look-ahead, the next router's weight applied to this router's input, is the recorded
    one) and whose output is the recorded logits."""

    def __init__(self, experts: int, top_k: int):
        super().__init__()
        self.weight = nn.Parameter(torch.eye(experts, 3 * experts), requires_grad=False)
        self.top_k = top_k
        self.logits = None

    def forward(self, x):
        return self.logits


class _ReplayLayer(nn.Module):
    def __init__(self, experts: int, top_k: int, inter: int, hidden: int, dense: bool):
        super().__init__()
        if dense:  # resident stand-in for attention: the compute a layer does before its router
            self.self_attn = nn.Module()
            self.self_attn.q_proj = nn.Linear(hidden, hidden, bias=False)
            self.self_attn.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.mlp = nn.Module()
        self.mlp.gate = _ReplayRouter(experts, top_k)
        self.mlp.experts = nn.Module()
        w = torch.zeros if dense else lambda *shape: torch.randn(*shape) * 0.1
        self.mlp.experts.gate_up_proj = nn.Parameter(w(experts, hidden, 2 * inter), requires_grad=False)
        self.mlp.experts.down_proj = nn.Parameter(w(experts, inter, hidden), requires_grad=False)
        self.inter = inter

    def forward(self, x, rec, ahead):
        if hasattr(self, "self_attn"):
            x = x + self.self_attn.o_proj(self.self_attn.q_proj(x))
        gate = self.mlp.gate
        gate.logits = rec["logits"]
        gate(ahead)  # hooks: the speculator sees the recorded look-ahead, the cache the routing
        routed = rec["routed"]
        tokens, k = routed.shape
        flat = routed.reshape(-1)
        order = flat.argsort(stable=True)
        offs = torch.bincount(flat, minlength=gate.weight.shape[0]).cumsum(0).to(torch.int32)
        rows = x.repeat_interleave(k, 0)[order]
        e = self.mlp.experts
        h = torch._grouped_mm(rows, e.gate_up_proj, offs=offs)
        h = F.silu(h[:, : self.inter]) * h[:, self.inter:]
        y = torch._grouped_mm(h, e.down_proj, offs=offs)
        return x + y.view(tokens, k, -1).sum(1) * 0


class ReplayModel(nn.Module):
    """Stacked experts of the traced model's count and top-k, driven by a recorded trace. By
    default tiny (the pager's decisions do not depend on an expert's size, only on how many fit);
    with ``hidden`` and ``inter`` (and ``dense``: a resident attention stand-in per layer) sized
    for a timeline replayed under a GPU profile."""

    def __init__(self, trace, inter: int = 8, hidden: Optional[int] = None, dense: bool = False):
        super().__init__()
        self.hidden = hidden or trace["experts"]
        # The input embeddings (resident), where the trace recorded each step's tokens: what a token
        # table guesses the first layer from (moe.first_layer), at the step's first op.
        self.embed_tokens = nn.Embedding(trace["vocab"], self.hidden) if trace.get("vocab") else None
        self.layers = nn.ModuleList(_ReplayLayer(trace["experts"], trace["top_k"], inter, self.hidden, dense)
                                    for _ in range(trace["layers"]))
        for step in trace["steps"]:  # the routers' inputs, made before any run (not ops of a step)
            for rec in step:
                zero = torch.zeros_like(rec["logits"])
                rec["router_input"] = torch.cat([zero if rec.get(f) is None else rec[f]
                                                 for f in ("ahead", "ahead2", "own")], -1)

    def get_input_embeddings(self):
        return self.embed_tokens

    def forward(self, step):
        tokens = step[0].get("tokens")
        if self.embed_tokens is not None and tokens is not None:
            x = self.embed_tokens(tokens)
        else:
            x = torch.zeros(step[0]["routed"].shape[0], self.hidden)
        for i, (layer, rec) in enumerate(zip(self.layers, step)):
            x = layer(x, rec, rec["router_input"])
        return x


HIDDEN_SHIFT = 200.0  # recorded logits lie well within +-HIDDEN_SHIFT + 10


def _as_installed(model, trace) -> None:
    """The replay model's speculator told which layers the learned look-ahead guesses (their
    look-ahead logits are in the trace), as ``moe.predictor.install`` tells a real model's."""
    from offtensor.model.state import pager_of
    from offtensor.moe import guesses

    speculator = getattr(getattr(pager_of(model), "experts", None), "speculator", None)
    if speculator is None:
        return
    routers = [r for r in speculator.routers if r.stacks]
    speculator.token_table = trace.get("token_table")
    if speculator.token_table is not None and routers:
        routers[0].evidence = guesses.SPECULATE_EVIDENCE_LEARNED
    E = trace["experts"]
    for i in trace.get("learned_layers", ()):
        if len(routers) > 1:  # (the last layer's map guesses the next step's first layer)
            routers[(i + 1) % len(routers)].evidence = guesses.SPECULATE_EVIDENCE_LEARNED
        # The learned look-ahead's logits are the router's input: its weight picks them (the first
        # E columns guess the next layer; with a two-ahead map, the next E the one after; with a
        # next-token map, the last E this layer's own experts at the next token).
        two = i in trace.get("two_ahead_layers", ()) and i + 2 < len(routers)
        own = i in trace.get("own_layers", ())
        pick = torch.eye(3 * E)
        rows = [pick[:E]] + ([pick[E:2 * E]] if two else []) + ([pick[2 * E:]] if own else [])
        weight = torch.cat(rows)
        routers[i].lookahead = (weight, torch.zeros(weight.shape[0]))
        if i in trace.get("hidden_layers", ()):
            # A map that reads a hidden layer (its logits recorded): the same kernels, the ReLU layer
            # shifted where it is the identity (relu(v) = v above 0) and shifted back.
            shift = torch.full((weight.shape[0],), HIDDEN_SHIFT)
            routers[i].lookahead = (torch.eye(weight.shape[0]), -shift, weight, shift)
        routers[i].split = E if two else None
        routers[i].own = (2 * E if two else E) if own else None


# Decode steps of the trace recorded for the H200 replay (the first 64 of 256 warm the cache and
# the guesses' confidence bins). A step's time swings by a factor of two with the misses its
# tokens draw, so a short window misleads: the last 16 steps alone put the default 9.1 / 16.6 /
# 4.7 % ahead of the cache alone on Qwen3 / Qwen2 / Mixtral, where the last 192 say 4.0 / 6.6 /
# 1.8 % (the same code; ``step_ms_mean_last_16`` keeps the short window's figure).
H200_RECORDED = 192


def h200_replay(trace, fraction: float, speculate: bool, hidden: int = 1024, inter: int = 768,
                recorded: int = H200_RECORDED) -> dict:
    """The trace's decode through experts sized like Qwen3-30B-A3B's (1024 x 768 fp32 = 9.4 MB,
    its bf16 2048 x 768 experts' bytes) and a resident attention stand-in, run on the emulated
    device; the last ``recorded`` steps recorded and replayed under the ``h200`` profile."""
    model = ReplayModel(trace, inter=inter, hidden=hidden, dense=True)
    ot.wrap_model(model, budget_gb=budget_gb(model, fraction), device="cpu", prefetch=speculate,
                  policy=EXPERTS_PAGED)
    _as_installed(model, trace)
    steps = trace["steps"]
    recorded = max(1, min(recorded, len(steps) - 1 - 32))  # a short trace: at least 32 decode steps warm up
    with torch.no_grad():
        for step in steps[:-recorded]:
            model(step)
        ot.reset_stats(model)
        with ot.timeline(model) as tl:
            for step in steps[-recorded:]:
                model(step)
    r = tl.replay("h200")
    # The same steps when the host waits only for each step's result (the compute stream), as a
    # decode loop reading its token does: a copy still in flight runs on into the next step.
    rc = tl.replay("h200", sync="compute")
    s = ot.stats(model)
    g = s.guesses or {}
    misses = sum(e["misses"] for e in s.experts.values())
    ot.unwrap_model(model)
    # Per recorded step: bytes a guess copied ahead of its layer, those no op read, and the expert
    # copies an op still waited for (misses: paged after the layer's own routing read).
    return {"expert_bytes": 3 * hidden * inter * 4, "recorded_steps": recorded,
            "step_ms_mean": sum(r.steps_ms) / len(r.steps_ms), "bound_ms_last": r.bound_ms,
            "step_ms_mean_last_16": sum(r.steps_ms[-16:]) / len(r.steps_ms[-16:]),
            "step_ms_mean_sync_compute": sum(rc.steps_ms) / len(rc.steps_ms),
            "copy_busy_last": r.copy_busy, "bytes_h2d_per_step": s.bytes_h2d / recorded,
            "guess_bytes_ahead_per_step": (g.get("prefetched_bytes") or 0) / recorded,
            "guess_bytes_wasted_per_step": (g.get("wasted_bytes") or 0) / recorded,
            "critical_path_misses_per_step": misses / 2 / recorded,  # two stacks (gate_up, down) per expert
            "covered_misses": g.get("covered_misses"), "wasted_share": g.get("wasted_share")}


def _layer_of(name: str) -> int:
    return int(name.split(".")[1]) if name.startswith("layers.") else int(name.split("layers.")[1].split(".")[0])


def _wrapped_report(model, layers: int) -> dict:
    """Hit rates (overall, per layer) and speculation figures of a wrapped model's stats."""
    s = ot.stats(model)
    hits, looks, misses, stacks = [0] * layers, [0] * layers, [0] * layers, [0] * layers
    names = sorted(s.experts, key=_layer_of)
    order = sorted({_layer_of(n) for n in names})
    for n in names:
        i = order.index(_layer_of(n))
        hits[i] += s.experts[n]["hits"]
        looks[i] += s.experts[n]["hits"] + s.experts[n]["misses"]
        misses[i] += s.experts[n]["misses"]
        stacks[i] += 1
    g = s.guesses or {}
    return {"hit_rate": sum(hits) / max(sum(looks), 1), "per_layer": [h / n if n else None for h, n in zip(hits, looks)],
            # experts paged on a miss, per layer (each of an expert's stacks counts one miss)
            "misses_per_layer": [m / max(n, 1) for m, n in zip(misses, stacks)],
            "bytes_h2d": s.bytes_h2d, "guesses": {k: v for k, v in g.items() if k != "routers"}}


def replay_ours(trace, fraction: float, speculate: bool = False, wrapped=None) -> dict:
    """offtensor's pager and expert policy on the trace (wrap_model of the replay model); ``wrapped``
    is called once the model is wrapped, before it runs."""
    torch.manual_seed(0)
    model = ReplayModel(trace)
    budget = budget_gb(model, fraction)
    ot.wrap_model(model, budget_gb=budget, device="cpu", prefetch=speculate, policy=EXPERTS_PAGED)
    _as_installed(model, trace)
    if wrapped is not None:
        wrapped()
    t0 = time.perf_counter()
    with torch.no_grad():
        model(trace["steps"][0])
        ot.reset_stats(model)  # decode steps only
        for step in trace["steps"][1:]:
            model(step)
    out = _wrapped_report(model, trace["layers"])
    out["seconds"] = time.perf_counter() - t0
    ot.unwrap_model(model)
    return out
