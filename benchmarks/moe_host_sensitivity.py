"""What bounds the MoE look-ahead's gain in the H200 replay: offtensor's host time, or the guesses.

The decode traces of ``moe_sim.py`` (the committed trained models, held-out text, their learned
look-ahead) replayed as its ``h200_sized`` rows are (experts of Qwen3-30B-A3B's bytes, 25% of them
cached, the last 192 of 256 decode steps under the ``h200`` profile), once per set of host figures:
the figures measured on the H200's host, then the same profile with offtensor's host time per page,
per copy issued and per further expert of a grouped GEMM cut to hypothetical lower figures (what a
leaner GPU hit path would leave; not measurements). For each: ms per decode step with the cache
alone, with the default guesses, with the opt-in waste-budget gate at 0.3 (``moe_sim``'s
``waste_budget_30``: more guesses copied), and with a perfect look-ahead (the trace's true routing of the
next layer fed in as the look-ahead logits: every guess right, the same gates and eviction), the
same two layers ahead as well (the true routing of the layer after the next as the two-ahead
logits: a copy started a layer earlier), and how much faster than the cache alone each is.

    python benchmarks/moe_host_sensitivity.py [--models qwen3 qwen2 mixtral] [--fraction 0.25]
        [--host-from probe.json] [--sets N]

``--host-from`` adds a first set: the ``host_us`` that ``benchmarks/gpu_probe.py`` wrote into that
file, measured on the host that ran the probe (the GPU suite runs this right after its probe, so
one device call gives the replay under the host figures of the code it ran); ``--sets N`` replays
only the first N sets (there: the probe's and the committed H200 figures).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_sim  # noqa: E402
from moe_replay import h200_replay  # noqa: E402
from results_io import save_result  # noqa: E402

from offtensor.sim import profiles  # noqa: E402

# Host microseconds: the H200 host's measured figures (per page, per copy; no per-expert figure yet,
# so each expert of a grouped GEMM costs a whole page), the same with a hypothetical per-expert
# figure (what the probe's "expert" could show), then hypothetical cuts of all three.
HOST_SETS = {
    "measured on the H200's host": None,
    "hypothetical: measured page and copy, expert 6": {"page": 25.4, "copy": 25.7, "expert": 6.0},
    "hypothetical: page 12, copy 12, expert 6": {"page": 12.0, "copy": 12.0, "expert": 6.0},
    "hypothetical: page 6, copy 6, expert 4": {"page": 6.0, "copy": 6.0, "expert": 4.0},
}
SURE = 30.0  # a logit this far above the rest: a softmax of ~1 on the true experts


def _true_logits(rec: dict, later: dict, experts: int) -> torch.Tensor:
    """Logits over ``rec``'s tokens that name ``later``'s routed experts (a later layer's, or the
    next step's first layer's) with certainty."""
    logits = torch.zeros(rec["routed"].shape[0], experts)
    if later["routed"].shape[0] == logits.shape[0]:  # the same tokens at the later layer
        logits.scatter_(1, later["routed"].long(), SURE)
    else:  # the prefill's last layer: its last token is the one the next step follows
        logits[-1].scatter_(0, later["routed"][-1].long(), SURE)
    return logits


def perfect(trace: dict, two_ahead: bool = False) -> dict:
    """The trace with each layer's look-ahead logits replaced by its next layer's true routing (the
    last layer's by the next step's first layer, as a learned map guesses it); with ``two_ahead``
    also every layer's two-ahead logits by the true routing of the layer after the next (no two-ahead
    map otherwise); no next-token maps. The token table (the first MoE layer from the step's
    tokens), where the trace has one, stays: it guesses that layer in every variant."""
    out = copy.copy(trace)
    steps = trace["steps"]
    out["steps"] = []
    for s, step in enumerate(steps):
        new = []
        for i, rec in enumerate(step):
            nxt = step[i + 1] if i + 1 < len(step) else (steps[s + 1][0] if s + 1 < len(steps) else None)
            r = dict(rec, ahead2=None, own=None)
            r.pop("router_input", None)
            if nxt is not None:
                r["ahead"] = _true_logits(rec, nxt, trace["experts"])
            if two_ahead and i + 2 < len(step):
                r["ahead2"] = _true_logits(rec, step[i + 2], trace["experts"])
            new.append(r)
        out["steps"].append(new)
    out["two_ahead_layers"] = list(range(trace["layers"] - 2)) if two_ahead else []
    out["own_layers"] = []
    # Every layer guesses from its (perfect) look-ahead with a learned layer's evidence.
    out["learned_layers"] = list(range(trace["layers"]))
    return out


def host_sets(probe: str | None) -> dict:
    """HOST_SETS, led by the probe's measured ``host_us`` when ``probe`` names its ``probe.json``."""
    if probe is None:
        return dict(HOST_SETS)
    with open(probe) as f:
        report = json.load(f)
    host = report.get("host_us")
    if not host or "page" not in host or "copy" not in host:
        raise SystemExit(f"moe_host_sensitivity: {probe} has no host_us with page and copy figures: {host!r}")
    where = report.get("gpu") or "the emulated device"
    return {f"measured by the probe on {where}'s host": {k: float(v) for k, v in host.items()}, **HOST_SETS}


def evaluate(name: str, fraction: float, sets: dict = HOST_SETS) -> dict:
    model = moe_sim.load_model(name)
    ids = moe_sim.heldout_ids(0, 32 + 256 + 1 + moe_sim.TIMELINE_STEPS)
    predictor = moe_sim.lookahead_of(name, model, False)
    trace = moe_sim.record_trace(model, ids, 32, 256, predictor)
    oracle, oracle2 = perfect(trace), perfect(trace, two_ahead=True)
    base = profiles.PROFILES["h200"]
    rows = {}
    try:
        for label, host in sets.items():
            profiles.PROFILES["h200"] = base if host is None else dataclasses.replace(base, host_us=dict(host))
            alone = h200_replay(copy.copy(trace), fraction, False)["step_ms_mean"]
            default = h200_replay(copy.copy(trace), fraction, True)
            budget = moe_sim._with(moe_sim.H200_VARIANTS["waste_budget_30"], h200_replay, copy.copy(trace), fraction,
                                   True)
            best = h200_replay(oracle, fraction, True)
            best2 = h200_replay(oracle2, fraction, True)
            rows[label] = {
                "host_us": dict(profiles.PROFILES["h200"].host_us),
                "cache_alone_ms": alone,
                "default_ms": default["step_ms_mean"], "default_faster": 1 - default["step_ms_mean"] / alone,
                "default_covered_misses": default["covered_misses"], "default_wasted_share": default["wasted_share"],
                "waste_budget_ms": budget["step_ms_mean"], "waste_budget_faster": 1 - budget["step_ms_mean"] / alone,
                "waste_budget_covered_misses": budget["covered_misses"],
                "waste_budget_wasted_share": budget["wasted_share"],
                "perfect_ms": best["step_ms_mean"], "perfect_faster": 1 - best["step_ms_mean"] / alone,
                "perfect_covered_misses": best["covered_misses"], "perfect_wasted_share": best["wasted_share"],
                "perfect_two_ahead_ms": best2["step_ms_mean"], "perfect_two_ahead_faster": 1 - best2["step_ms_mean"] / alone,
                "perfect_two_ahead_covered_misses": best2["covered_misses"],
                "perfect_two_ahead_critical_path_misses_per_step": best2["critical_path_misses_per_step"],
            }
            print(f"{name} {label}: cache alone {alone:.3f} ms, default {rows[label]['default_ms']:.3f} "
                  f"({100 * rows[label]['default_faster']:.1f} % faster), waste budget 0.3 "
                  f"{rows[label]['waste_budget_ms']:.3f} ({100 * rows[label]['waste_budget_faster']:.1f} %), perfect look-ahead "
                  f"{rows[label]['perfect_ms']:.3f} ({100 * rows[label]['perfect_faster']:.1f} % faster), two layers ahead "
                  f"{rows[label]['perfect_two_ahead_ms']:.3f} ({100 * rows[label]['perfect_two_ahead_faster']:.1f} %)", flush=True)
    finally:
        profiles.PROFILES["h200"] = base
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["qwen3", "qwen2", "mixtral"])
    p.add_argument("--fraction", type=float, default=0.25)
    p.add_argument("--host-from", default=None, help="a gpu_probe.py probe.json whose host_us leads the sets")
    p.add_argument("--sets", type=int, default=None, help="replay only the first N sets of host figures")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    sets = dict(list(host_sets(args.host_from).items())[: args.sets])
    t0 = time.perf_counter()
    body = {"fraction_cached": args.fraction, "recorded_steps": 192,
            "models": {name: evaluate(name, args.fraction, sets) for name in args.models}}
    body["seconds"] = time.perf_counter() - t0
    save_result(args.out, "moe_host_sensitivity.json", "H200 replay of MoE decode under lower host costs",
                torch.device("cpu"), argv, body)


if __name__ == "__main__":
    main()
