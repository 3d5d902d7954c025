"""Expert cache and routing speculation on a TRAINED MoE: a recorded routing trace, the
offline simulator (LRU, Belady, offtensor's own policy on the same trace) and a real wrapped run.

    python benchmarks/moe_sim.py                       # the committed models (tests/data/moe_*)
    python benchmarks/moe_sim.py --models qwen3 --steps 128 --no-real

1. **Trace.** A teacher-forced decode of held-out text (``tests/data/stdlib_heldout.txt.gz``, files
   scripts/train_moe.py never trained on): a ``--prefix``-byte prefill, then ``--steps`` one-byte
   decode steps fed the true next byte. Per step and MoE layer: the experts each token was routed
   to, the router's logits, and the look-ahead logits offtensor's RoutingSpeculator guesses from:
   the learned look-ahead (``offtensor.moe.predictor``, kept beside the checkpoint as
   ``lookahead.safetensors``; fitted when absent or with ``--refit`` on held-out windows the trace
   never decodes, and kept per layer where it beat the router look-ahead on other held-out
   windows), else layer i+1's router weight applied to layer i's router input (the router
   look-ahead; ``--router-lookahead``: that alone); where the predictor has them, the logits of
   layer i+2 from layer i (``ahead2``), of the next token's first layer from the last, and of the
   layer's own experts at the next token (``own``, the chances eviction ranks by). The real runs
   install the same predictor.
2. **Routing statistics** (decode steps): entropy of expert use per layer (bits; uniform =
   log2 E), token-to-token locality (share of a token's experts the previous token also used at
   that layer; uniform = k / E), look-ahead top-k precision per layer.
3. **Simulator**, per layer, with ``--fractions`` of all routed experts cached (one cache across
   layers, as offtensor's budget is one): ``lru`` and ``belady`` (the offline optimum: evict the
   expert used furthest in the future) on the access sequence (layer by layer, each layer's experts
   in id order, as ``_grouped_mm`` pages them); ``ours``: offtensor's real pager and
   ``offtensor/moe`` with their defaults (guesses copied where they have paid) driven by the
   same trace through a replay model (stacked experts of the real count and top-k, run by
   ``torch._grouped_mm``, whose routers output the recorded logits and whose router inputs are the
   recorded look-ahead logits, so the speculator guesses exactly what it would have guessed on the
   trained model); ``ours_cache_alone`` (``prefetch=False``: no router hooks, no guesses) and
   ``ours_scored_only`` (guesses made and scored, never copied; eviction still takes the
   next-token chances). A copied guess that its layer then routes is a hit. Hit rates count
   decode steps only. The replay model and both replays are ``moe_replay.py``.
4. **Real run** (``--no-real`` skips it): the trained model wrapped at the same budgets (dense
   weights + fraction x expert bytes) against the unwrapped model on the same teacher-forced
   decode; logits must be identical at every step. Its measured hit rate, per layer, beside the
   replay's (``real_default`` must agree with "ours", ``real`` (``prefetch=False``) with
   "ours_cache_alone": the same code on the same accesses).
5. **Speculation**, scored on what it saves: guesses of experts NOT cached (precision), the share
   of the layer's misses they cover, bytes copied ahead, bytes wasted, misses left on the critical
   path; and the offline coverage-against-waste curve of gates on the look-ahead probability.
6. **H200 replay** (``h200_sized``): the trace through the replay model with experts of
   Qwen3-30B-A3B's bytes (9.4 MB) and a resident attention stand-in per layer, the last
   ``moe_replay.H200_RECORDED`` (192) decode steps recorded (``ot.timeline``) and replayed under
   ``h200`` (its host lane: offtensor's measured host time per page and copy): the cache alone
   (``prefetch=False``), the default (one guess a layer copied where its bin has been >= 70% right,
   and guesses two layers ahead copied into the next layer's expected idle copy time), guesses
   scored but never copied, and at 25% one layer ahead only, top-k guesses a layer at a 50% gate
   and the next step's first layer guessed at the end of a step, and at both the waste budget
   (``guesses.SPECULATE_WASTE``: 0.3 with one copy a layer, 0.25 with up to top-k); per step the bytes copied ahead
   by guesses, those wasted, and the misses left on the critical path (expert copies an op waited
   for after its layer's routing); each also replayed with the host waiting for the compute
   stream only between steps (``step_ms_mean_sync_compute``), and the mean of the last 16 steps
   alone (``step_ms_mean_last_16``, the window of earlier runs).
8. **Coverage ceiling** (``coverage_ceiling``): every layer guessed, every guess scored, none
   copied; the uncached guesses ranked by confidence: the most any gate on it could cover.
9. **Summary** per model and fraction (``summary``): the default's hit against Belady's, the share
   of all misses (every layer's, the covered ones included) that copied guesses covered, the
   share of their bytes wasted, and the H200 replay against the cache alone.
7. **Routing statistics for plans**: ``moe_routing_{model}.json`` (``offtensor.RoutingStats``,
   what ``ot.plan(..., routing=...)`` and ``python -m offtensor plan --routing`` take).

JSON: ``benchmarks/results/moe_sim.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gzip
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import offtensor as ot  # noqa: E402
from moe_replay import (EXPERTS_PAGED, _wrapped_report, budget_gb, h200_replay, replay_ours,  # noqa: E402
                        simulate_belady, simulate_lru)

DATA = os.path.join(ROOT, "tests", "data")
HELDOUT = os.path.join(DATA, "stdlib_heldout.txt.gz")


# ---------------------------------------------------------------------------- the trained model


def load_model(name: str, dtype=torch.float32):
    import transformers

    path = name if os.path.isdir(name) else os.path.join(DATA, f"moe_{name}")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.eval()


def heldout_ids(start: int = 0, length: int = 4096) -> torch.Tensor:
    with gzip.open(HELDOUT, "rb") as f:
        data = f.read()
    return torch.tensor(list(data[start:start + length]), dtype=torch.long)


def _routers(model):
    """The MoE layers' routers in layer order: (layer index, router module)."""
    out = []
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(layer.mlp, "experts"):
            out.append((i, gate))
    return out


class _Decoder:
    """Teacher-forced: prefill ``ids[:prefix]``, then one true byte per step."""

    def __init__(self, model, ids, prefix):
        self.model, self.ids, self.prefix = model, ids, prefix
        self.cache, self.t = None, 0

    def step(self):
        with torch.no_grad():
            if self.cache is None:
                x = self.ids[None, : self.prefix]
            else:
                x = self.ids[None, self.prefix + self.t - 1: self.prefix + self.t]
            out = self.model(input_ids=x, past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        self.t += 1
        return out.logits


# The learned look-ahead (offtensor.moe.predictor) is fitted on held-out text the trace never
# decodes: FIT_WINDOWS 256-byte windows from byte FIT_START of the held-out split, and compared
# with the router look-ahead on VAL_WINDOWS more from VAL_START (the trace decodes from byte 0).
FIT_START, FIT_WINDOWS, VAL_START, VAL_WINDOWS, FIT_RIDGE, FIT_SEQ = 100_000, 64, 300_000, 16, 1e-3, 256
# Its maps read a hidden layer of this width (moe.predictor.HIDDEN; None: linear maps, ridge).
HIDDEN = 128


def fit_lookahead(model):
    """The learned look-ahead fitted on the fit windows, compared with the router look-ahead (its
    next-token maps with the previous token's experts) on the validation windows and kept for the
    layers where it is right more often (``offtensor.moe.refit.fit_offline``)."""
    from offtensor.moe.refit import fit_offline

    return fit_offline(model, heldout_ids(FIT_START, FIT_WINDOWS * FIT_SEQ), heldout_ids(VAL_START, VAL_WINDOWS * FIT_SEQ),
                       FIT_SEQ, ridge=FIT_RIDGE, hidden=HIDDEN)


def _num_experts(model) -> int:
    config = model.config
    return getattr(config, "num_experts", None) or config.num_local_experts


def record_trace(model, ids, prefix: int, steps: int, predictor=None) -> dict:
    """Routing of a teacher-forced decode: per step (the prefill first), per MoE layer, the routed
    experts [tokens, k], the router logits [tokens, E], the look-ahead logits the speculator
    guesses the next MoE layer from (None for the last): the learned look-ahead's where
    ``predictor`` covers the layer, else the next router's weight applied to this layer's router
    input, and that router look-ahead itself (``router_ahead``)."""
    routers = _routers(model)
    current = []

    def hook(module, args, output, pos):
        x = args[0].reshape(-1, args[0].shape[-1])
        logits, _, indices = output
        router_ahead = ahead = ahead2 = own = None
        if predictor is not None and pos in predictor.weights2:
            ahead2 = predictor.logits2(pos, x.float()).detach().clone()
        if predictor is not None and pos in predictor.own_weights:
            own = predictor.own_logits(pos, x.float()).detach().clone()
        if pos + 1 < len(routers):
            router_ahead = F.linear(x.to(routers[pos + 1][1].weight.dtype), routers[pos + 1][1].weight).float()
            ahead = router_ahead
        if predictor is not None and pos in predictor.weights:
            ahead = predictor.logits(pos, x.float())  # the last layer's: the next token's first layer
        current.append({"routed": indices.detach().clone(), "logits": logits.detach().float().clone(),
                        "ahead": None if ahead is None else ahead.detach().clone(), "ahead2": ahead2, "own": own,
                        "router_ahead": None if router_ahead is None else router_ahead.detach().clone()})

    handles = [gate.register_forward_hook(lambda m, a, o, pos=pos: hook(m, a, o, pos))
               for pos, (_, gate) in enumerate(routers)]
    trace, nll = [], 0.0
    run = _Decoder(model, ids, prefix)
    try:
        for t in range(steps + 1):
            current = []
            logits = run.step()
            current[0]["tokens"] = ids[:prefix] if t == 0 else ids[prefix + t - 1: prefix + t]  # what the step fed
            if t > 0:
                nll += F.cross_entropy(logits[0, -1:].float(), ids[prefix + t: prefix + t + 1]).item()
            trace.append(current)
    finally:
        for h in handles:
            h.remove()
    config = model.config
    return {"steps": trace, "learned_layers": sorted(predictor.weights) if predictor is not None else [],
            "hidden_layers": sorted(predictor.hidden_layers) if predictor is not None else [],
            "two_ahead_layers": sorted(predictor.weights2) if predictor is not None else [],
            "own_layers": sorted(predictor.own_weights) if predictor is not None else [],
            "token_table": getattr(predictor, "token_table", None), "vocab": model.config.vocab_size,
            "layers": len(routers), "experts": _num_experts(model),
            "top_k": config.num_experts_per_tok, "prefix": prefix,
            "decode_bits_per_byte": nll / steps / math.log(2)}


# ---------------------------------------------------------------------------- routing statistics


def routing_stats(trace) -> dict:
    L, E, k = trace["layers"], trace["experts"], trace["top_k"]
    decode = trace["steps"][1:]
    entropy, locality, precision, router_precision = [], [], [], []
    for layer in range(L):
        counts = torch.zeros(E)
        shared = 0
        prev = None
        for step in decode:
            routed = step[layer]["routed"][0].tolist()
            counts[routed] += 1
            if prev is not None:
                shared += len(set(routed) & prev)
            prev = set(routed)
        p = counts / counts.sum()
        entropy.append(float(-(p[p > 0] * p[p > 0].log2()).sum()))
        locality.append(shared / (k * (len(decode) - 1)))
        if layer > 0:
            for field, out in (("ahead", precision), ("router_ahead", router_precision)):
                right = 0
                for step in decode:
                    guess = set(step[layer - 1].get(field, step[layer - 1]["ahead"])[0].topk(k).indices.tolist())
                    right += len(guess & set(step[layer]["routed"][0].tolist()))
                out.append(right / (k * len(decode)))
    return {"entropy_bits": entropy, "entropy_uniform_bits": math.log2(E), "locality": locality,
            "locality_uniform": k / E, "lookahead_precision": precision,
            "router_lookahead_precision": router_precision, "lookahead_uniform": k / E}


SPECULATION_KNOBS = ("SPECULATE_COPY", "SPECULATE_PRECISION", "SPECULATE_PRECISION_IDLE", "SPECULATE_NEXT_STEP",
                     "SPECULATE_EXPERTS", "SPECULATE_VICTIM_CYCLES", "SPECULATE_SAMPLE", "SPECULATE_SAMPLE_UNPAID", "SPECULATE_EVIDENCE",
                     "SPECULATE_EVIDENCE_LEARNED", "SPECULATE_WASTE")
# The gates tried for the coverage-against-waste curve (each point changes one knob of the
# default): the bin precision a one-ahead guess must have shown (1.01: none copied, two-ahead ones still);
# the room a guess may take, a victim whose expected next use is at least SPECULATE_VICTIM_CYCLES
# cycles away (a stricter limit copies fewer guesses and so evicts fewer copies that are read
# again soon: fewer bytes, fewer misses covered); up to top-k guesses a layer instead of one (a
# looser gate with them); the two-ahead guesses' gate (1.01: none copied); the next step's first
# layer guessed and copied at the end of a step; the waste budget (guesses.SPECULATE_WASTE: copies
# made, most precise first, while their expected wasted share stays within it) with one guess a
# layer and with up to top-k.
COPIED = {"SPECULATE_COPY": True}
SCORED_ONLY = {"SPECULATE_COPY": False}
CURVE = [{**COPIED, "SPECULATE_PRECISION": p} for p in (0.5, 0.6, 0.7, 0.8, 0.9, 1.01)] + \
    [{**COPIED, "SPECULATE_VICTIM_CYCLES": c} for c in (3.0, 4.0)] + [{**COPIED, "SPECULATE_EXPERTS": 8}] + \
    [{**COPIED, "SPECULATE_EXPERTS": 8, "SPECULATE_PRECISION": 0.5}] + \
    [{**COPIED, "SPECULATE_PRECISION_IDLE": p} for p in (0.5, 1.01)] + [{**COPIED, "SPECULATE_NEXT_STEP": True}] + \
    [{**COPIED, "SPECULATE_WASTE": w} for w in (0.25, 0.3)] + \
    [{**COPIED, "SPECULATE_EXPERTS": 8, "SPECULATE_WASTE": w} for w in (0.15, 0.2, 0.25)]
# The H200 replays: the cache alone, the default (a guess a layer, copied where it has paid, and
# two-ahead guesses copied into the next layer's expected idle copy time) and guesses scored but
# not copied; at 25% also one layer ahead only (no two-ahead copies), top-k guesses a layer at a
# 50% gate, and the next step's first layer guessed and copied at the end of a step. Both fractions
# also replay the waste budget (guesses.SPECULATE_WASTE): at 0.3 with one copy a layer, and at 0.25
# with up to top-k.
H200_VARIANTS = {"cache_alone": None, "default": {}, "scored_only": SCORED_ONLY,
                 "waste_budget_30": {**COPIED, "SPECULATE_WASTE": 0.3},
                 "waste_budget_25_top_k": {**COPIED, "SPECULATE_EXPERTS": 8, "SPECULATE_WASTE": 0.25}}
# More misses covered, opt-in: the next step's first layer guessed and the waste budget at 0.3.
NEXT_STEP_WASTE_30 = {**COPIED, "SPECULATE_NEXT_STEP": True, "SPECULATE_WASTE": 0.3}
H200_VARIANTS_25 = {**H200_VARIANTS, "one_ahead_only": {**COPIED, "SPECULATE_PRECISION_IDLE": 1.01},
                    "top_k_gate_50": {**COPIED, "SPECULATE_EXPERTS": 8, "SPECULATE_PRECISION": 0.5},
                    "next_step": {**COPIED, "SPECULATE_NEXT_STEP": True},
                    "next_step_waste_budget_30": NEXT_STEP_WASTE_30}
TIMELINE_STEPS = 8


@contextlib.contextmanager
def _knobs(setting):
    """``offtensor.moe``'s SPECULATION_KNOBS set to ``setting`` inside, restored after."""
    from offtensor.moe import eviction, guesses, speculation

    owner = {k: next(m for m in (eviction, guesses, speculation) if hasattr(m, k)) for k in SPECULATION_KNOBS}
    saved = {k: getattr(owner[k], k) for k in SPECULATION_KNOBS}
    try:
        for k, v in (setting or {}).items():
            setattr(owner[k], k, v)
        yield
    finally:
        for k, v in saved.items():
            setattr(owner[k], k, v)


def h200_variants(trace, fraction: float) -> dict:
    variants = H200_VARIANTS_25 if fraction <= 0.25 else H200_VARIANTS
    return {name: (h200_replay(trace, fraction, False) if setting is None else _with(setting, h200_replay, trace,
                                                                                     fraction, True))
            for name, setting in variants.items()}


def _with(setting, fn, *args):
    with _knobs(setting):
        return fn(*args)


def routing_stats_of(trace, name: str):
    """The trace's decode routing as ``RoutingStats`` (what ``ot.plan(..., routing=...)`` takes)."""
    from offtensor import RoutingStats

    steps = [[rec["routed"][0].tolist() for rec in step] for step in trace["steps"][1:]]
    return RoutingStats.from_trace(steps, trace["experts"], routing_stats(trace)["lookahead_precision"],
                                   f"trained {name} (benchmarks/moe_sim.py, {len(steps)} held-out decode steps)")


@contextlib.contextmanager
def _uncached_guesses(out: list):
    """Inside: every one-ahead guess of an uncached expert the speculator scores is appended to
    ``out`` as (confidence, routed)."""
    from offtensor.moe import speculation

    cls = speculation.RoutingSpeculator
    real_issue, real_score, open_guesses = cls._issue, cls._score, {}

    def issue(self, pager, router, confidence, tokens, ahead=1, idle=True):
        real_issue(self, pager, router, confidence, tokens, ahead, idle)
        if ahead == 1:
            open_guesses[router] = [(e, p) for e, p in confidence.items() if e not in router.cached]

    def score(self, router):
        guesses = open_guesses.pop(router, None)
        if router.guess is not None and guesses:
            used = set().union(*(s.used for s in router.stacks))
            if used:
                out.extend((p, e in used) for e, p in guesses)
        real_score(self, router)

    cls._issue, cls._score = issue, score
    try:
        yield
    finally:
        cls._issue, cls._score = real_issue, real_score


def coverage_ceiling(trace, fraction: float) -> dict:
    """What the look-ahead could cover at most: every layer guessed (the next step's first layer
    too), every guess scored and none copied; the guesses of uncached experts ranked by their
    confidence, the share of all misses the most confident ones would cover at a waste of at most
    25%, and the waste at which they would cover 40%."""
    guesses = []
    with _uncached_guesses(guesses):
        r = _with({"SPECULATE_COPY": False, "SPECULATE_NEXT_STEP": True}, replay_ours, trace, fraction, True)
    misses = r["guesses"]["misses"]
    guesses.sort(key=lambda g: -g[0])
    right = best = 0
    waste_at_40 = None
    for n, (_, hit) in enumerate(guesses, 1):
        right += hit
        if right >= 0.75 * n:
            best = right / misses
        if waste_at_40 is None and right >= 0.4 * misses:
            waste_at_40 = 1 - right / n
    return {"misses": misses, "uncached_guesses": len(guesses),
            "uncached_precision": right / len(guesses) if guesses else None,
            "covered_if_all_copied": right / misses if misses else None,
            "best_covered_at_most_25pct_wasted": best if misses else None, "wasted_at_40pct_covered": waste_at_40}


def speculation_curve(trace, fraction: float, settings) -> list:
    """The real speculator on the trace under other gates: each of ``settings`` (a dict of
    ``offtensor.moe`` SPECULATION_KNOBS) replayed, restored afterwards. One point per setting:
    the share of misses its copies covered against the share of its copied bytes wasted."""
    points = []
    for setting in settings:
        r = _with(setting, replay_ours, trace, fraction, True)
        g = r["guesses"]
        points.append({**setting, "hit_rate": r["hit_rate"], "bytes_h2d": r["bytes_h2d"],
                       "covered_misses": g["covered_misses"],
                       "wasted_share": g["wasted_share"], "uncached_precision": g["uncached_precision"],
                       "miss_coverage": g["miss_coverage"], "prefetched_bytes": g["prefetched_bytes"]})
    return points


# ---------------------------------------------------------------------------- the real wrapped run


def real_run(model, ids, prefix: int, steps: int, fraction: float, speculate: bool = True, device="cpu",
             timeline_steps: int = 0, predictor=None) -> dict:
    """The trained model wrapped at ``fraction`` of its experts cached against the unwrapped one,
    teacher-forced: identical logits at every step, and the measured hit rates. With
    ``predictor`` (and ``speculate``) its routers guess from the learned look-ahead, whose maps
    come out of the budget: the budget holds their bytes more (``maps_bytes``), so the expert cache
    has the room the replay and the cache alone have."""
    maps = predictor.installed_bytes(len(_routers(model))) if predictor is not None and speculate else 0
    wrapped = ot.wrap_model(copy.deepcopy(model), budget_gb=budget_gb(model, fraction) + maps / 2**30,
                            device=device, prefetch=speculate, policy=EXPERTS_PAGED)
    if predictor is not None and speculate:
        from offtensor.model.state import pager_of
        from offtensor.moe.predictor import install

        install(pager_of(wrapped), predictor)
    # The unwrapped model runs on the wrapped one's device: a GPU's kernels need not round as the host's do.
    plain = model if next(model.parameters()).device == torch.device(device) else copy.deepcopy(model).to(device)
    a, b = _Decoder(wrapped, ids.to(device), prefix), _Decoder(plain, ids.to(device), prefix)
    identical = True
    t0 = time.perf_counter()
    for t in range(steps + 1):
        identical &= bool(torch.equal(a.step(), b.step()))
        if t == 0:
            ot.reset_stats(wrapped)
    L = len(_routers(model))
    out = _wrapped_report(wrapped, L)
    out["identical_logits_every_step"] = identical
    out["seconds"] = time.perf_counter() - t0
    out["maps_bytes"] = maps
    if timeline_steps:
        # A few more decode steps recorded and replayed under the H200 profile (the tiny model's
        # own sizes: 74 KB experts, so per-op overheads weigh more than on a real model).
        with ot.timeline(wrapped) as tl:
            for _ in range(timeline_steps):
                identical &= bool(torch.equal(a.step(), b.step()))
        r = tl.replay("h200")
        out["h200_replay"] = {"steps": timeline_steps, "step_ms_mean": sum(r.steps_ms) / len(r.steps_ms),
                              "bound_ms_last": r.bound_ms, "copy_busy_last": r.copy_busy}
        out["identical_logits_every_step"] = identical
    ot.unwrap_model(wrapped)
    return out


# ---------------------------------------------------------------------------- main


def evaluate(name: str, args) -> dict:
    torch.set_num_threads(args.threads)
    model = load_model(name)
    ids = heldout_ids(args.start, args.prefix + args.steps + 1 + TIMELINE_STEPS)
    t0 = time.perf_counter()
    predictor = None if args.router_lookahead else lookahead_of(name, model, args.refit, args.refit_table)
    trace = record_trace(model, ids, args.prefix, args.steps, predictor)
    # The same decode guessed by the router look-ahead alone, for the comparison row.
    router_trace = record_trace(model, ids, args.prefix, args.steps) if predictor is not None else None
    stats = routing_stats_of(trace, name)
    with open(os.path.join(args.out, f"moe_routing_{name}.json"), "w") as f:
        json.dump(stats.to_dict(), f, indent=1)  # for ot.plan(..., routing=RoutingStats.load(path))
    result = {"model": name, "trace_seconds": time.perf_counter() - t0,
              "decode_bits_per_byte": trace["decode_bits_per_byte"],
              "layers": trace["layers"], "experts": trace["experts"], "top_k": trace["top_k"],
              "prefix": args.prefix, "decode_steps": args.steps, "routing": routing_stats(trace),
              "lookahead": None if predictor is None else {
                  "learned_layers": sorted(predictor.weights),
                  "heldout_precision": {str(k): v for k, v in predictor.scores.items()}},
              "cache": {}}
    total = trace["layers"] * trace["experts"]
    for fraction in args.fractions:
        cap = int(round(fraction * total))
        row = {"capacity_experts": cap, "lru": simulate_lru(trace, cap), "belady": simulate_belady(trace, cap),
               "ours": replay_ours(trace, fraction, True), "ours_cache_alone": replay_ours(trace, fraction, False),
               "ours_scored_only": _with(SCORED_ONLY, replay_ours, trace, fraction, True)}
        if router_trace is not None:
            row["ours_router_lookahead"] = replay_ours(router_trace, fraction, True)
        if fraction <= 0.25:
            row["ours_next_step_waste_30"] = _with(NEXT_STEP_WASTE_30, replay_ours, trace, fraction, True)
        row["speculation_curve"] = speculation_curve(trace, fraction, CURVE)
        row["coverage_ceiling"] = coverage_ceiling(trace, fraction)
        row["h200_sized"] = h200_variants(trace, fraction)
        if not args.no_real:
            row["real"] = real_run(model, ids, args.prefix, args.steps, fraction, speculate=False,
                                   timeline_steps=TIMELINE_STEPS)
            row["real_default"] = real_run(model, ids, args.prefix, args.steps, fraction, speculate=True,
                                           timeline_steps=TIMELINE_STEPS,
                                           predictor=predictor)  # guesses copied where they paid
        row["summary"] = _summary(row)
        result["cache"][f"{fraction:.0%}"] = row
        print(f"{name} {fraction:.0%}: " + ", ".join(f"{k} {v['hit_rate']:.3f}" for k, v in row.items()
                                                     if isinstance(v, dict) and "hit_rate" in v), flush=True)
    return result


def _summary(row) -> dict:
    """The figures the look-ahead is judged by: the default's hit rate against Belady's, the share
    of all misses (those a copied guess covered included, every layer's) that copied guesses
    covered and the share of their bytes wasted, and the H200 replay's step against the cache
    alone's."""
    ours, g = row["ours"], row["ours"]["guesses"]
    h200 = row["h200_sized"]
    out = {"hit": ours["hit_rate"], "belady": row["belady"]["hit_rate"],
           "hit_vs_belady": ours["hit_rate"] - row["belady"]["hit_rate"],
           "covered_of_all_misses": _covered_of_all(ours), "wasted_share": g.get("wasted_share"),
           "h200_faster_than_cache_alone": 1 - h200["default"]["step_ms_mean"] / h200["cache_alone"]["step_ms_mean"],
           "h200_faster_sync_compute": {name: 1 - v["step_ms_mean_sync_compute"] / h200["cache_alone"]["step_ms_mean_sync_compute"]
                                        for name, v in h200.items() if name != "cache_alone"}}
    opt_in = row.get("ours_next_step_waste_30")
    if opt_in is not None:  # the same figures for the opt-in that covers more misses
        out["next_step_waste_30"] = {"hit": opt_in["hit_rate"],
                                     "hit_vs_belady": opt_in["hit_rate"] - row["belady"]["hit_rate"],
                                     "covered_of_all_misses": _covered_of_all(opt_in),
                                     "wasted_share": opt_in["guesses"].get("wasted_share")}
    return out


def _covered_of_all(ours) -> float:
    """The share of all misses (those a copied guess covered included) that copied guesses covered."""
    covered = ours["guesses"].get("copied_correct") or 0
    misses_left = sum(ours["misses_per_layer"])
    return covered / (misses_left + covered) if misses_left + covered else None


def lookahead_of(name: str, model, refit: bool = False, refit_table: bool = False):
    """The learned look-ahead kept beside the checkpoint (``lookahead.safetensors``), fitted and
    saved there when absent or with ``refit``; with ``refit_table``, its maps kept and only its
    token table fitted again (``refit_token_table``) and saved."""
    from offtensor.moe.predictor import FILE_NAME, LookaheadPredictor

    directory = name if os.path.isdir(name) else os.path.join(DATA, f"moe_{name}")
    if not refit and os.path.exists(os.path.join(directory, FILE_NAME)):
        predictor = LookaheadPredictor.load(directory)
        if refit_table:
            refit_token_table(model, predictor)
            predictor.save(directory)
        return predictor
    predictor = fit_lookahead(model)
    predictor.save(directory)
    return predictor


def refit_token_table(model, predictor) -> float:
    """``predictor``'s token table (the first MoE layer's experts per input token) counted on the
    fit windows and kept where it beats the next-token map on the validation windows
    (``offtensor.moe.refit.fit_token_table``, as ``fit_lookahead`` does): its precision there."""
    from offtensor.moe.refit import fit_token_table, record_routing

    ids, held = heldout_ids(FIT_START, FIT_WINDOWS * FIT_SEQ), heldout_ids(VAL_START, VAL_WINDOWS * FIT_SEQ)
    return fit_token_table(model, predictor, ids, record_routing(model, ids, FIT_SEQ)[1][0], held,
                           record_routing(model, held, FIT_SEQ)[1][0])


def _keep_real_runs(path: str, results: dict) -> None:
    """The real wrapped runs of an earlier full run, carried into a --no-real run's rows (a real run
    takes minutes per row; the replay of the real pager, "ours", is checked against it)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        old = json.load(f)
    origin = {"date": old.get("date"), "command": old.get("command")}
    for name, result in results.items():
        for fraction, row in result["cache"].items():
            before = old.get(name, {}).get("cache", {}).get(fraction, {})
            for key in ("real", "real_default"):
                if key in before:
                    row[key] = {**before[key], "carried_over_from": before[key].get("carried_over_from", origin)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["qwen3", "qwen2", "mixtral"])
    p.add_argument("--fractions", nargs="+", type=float, default=[0.25, 0.5])
    p.add_argument("--prefix", type=int, default=32)
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--start", type=int, default=0, help="byte offset into the held-out split")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--router-lookahead", action="store_true",
                   help="guess from the router look-ahead only (no learned look-ahead)")
    p.add_argument("--refit", action="store_true", help="fit the learned look-ahead again (saved beside the "
                   "checkpoint as lookahead.safetensors) rather than load it")
    p.add_argument("--refit-table", action="store_true", help="keep the learned look-ahead's maps and fit its "
                   "token table (the first MoE layer's experts per input token) again")
    p.add_argument("--no-real", action="store_true", help="skip the real wrapped runs (the slow part); those in "
                   "the output JSON already are kept, marked with the run they came from")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args(argv)
    from results_io import save_result

    os.makedirs(args.out, exist_ok=True)
    results = {name: evaluate(name, args) for name in args.models}
    if args.no_real:
        _keep_real_runs(os.path.join(args.out, "moe_sim.json"), results)
    save_result(args.out, "moe_sim.json", "moe_sim", torch.device("cpu"), argv, results)
    return results


if __name__ == "__main__":
    main()
