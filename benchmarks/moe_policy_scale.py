"""How the expert policy's host time grows with the model's depth: a decode of many MoE layers of
DeepSeek-V3's expert count and top-k (256 experts, 8 routed a token), a quarter of the experts
cached, through offtensor's pager and expert policy.

The trained test models have 4 to 8 MoE layers of 16 to 32 experts; DeepSeek-V3 has 58 of 256.
Work that grows with the number of cached copies or stacks per call grows with depth squared per
step, and such a cost does not show on the small models. The routing here is synthetic (no model of
that size runs on this machine): per layer a fixed popularity over the experts, per token noise,
and a pull towards the experts the layer routed at the last token (token-to-token reuse); the
look-ahead logits the guesses read are the next layer's router logits plus noise. Experts are tiny
(a decode's host work does not depend on an expert's bytes, only on how many fit), so a run times
the host's Python, not copies.

    python benchmarks/moe_policy_scale.py [--layers 6 24 58] [--steps 48] [--fraction 0.25] [--freeze-gc] [--by-method]

Per depth and setting (the cache alone, the default guesses): the decode hit rate; ms per decode
step of the whole run (wall clock: the model's ops on the emulated device, the pager, the policy)
and in each part (``offtensor.sim.policy_clock``: the policy's victim search, bookkeeping and
guesses; the pager's own paging, copies and room-making apart as ``pager``; Python's garbage
collections apart as ``gc``, the whole run's pauses, which land in whichever call allocates);
calls per step.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_policy_host import APART, by_part, print_methods, timed_replay  # noqa: E402
from results_io import save_result  # noqa: E402

EXPERTS, TOP_K = 256, 8
POPULARITY = 0.7  # spread of a layer's fixed expert popularity (logits), against per-token noise of 1
REUSE_PULL = 1.5  # logit added to the experts the layer routed at the last token
AHEAD_NOISE = 1.0  # noise on the next layer's router logits, as the look-ahead's guess of them


def synthetic_trace(layers: int, steps: int, seed: int = 0) -> dict:
    """A routing trace in ``moe_sim.record_trace``'s form: a 4-token prefill, then ``steps``
    one-token decode steps."""
    g = torch.Generator().manual_seed(seed)
    popularity = torch.randn(layers, EXPERTS, generator=g) * POPULARITY
    last = [None] * layers
    out = []
    for s in range(steps + 1):
        tokens = 4 if s == 0 else 1
        step = []
        for layer in range(layers):
            logits = popularity[layer].expand(tokens, EXPERTS) + torch.randn(tokens, EXPERTS, generator=g)
            if last[layer] is not None:
                logits = logits.clone()
                logits[-1, last[layer]] += REUSE_PULL
            routed = logits.topk(TOP_K, -1).indices
            last[layer] = routed[-1]
            step.append({"routed": routed, "logits": logits, "ahead": None, "ahead2": None, "own": None})
        for layer in range(layers - 1):
            after = step[layer + 1]["logits"]
            step[layer]["ahead"] = after + torch.randn(after.shape, generator=g) * AHEAD_NOISE
        out.append(step)
    return {"steps": out, "layers": layers, "experts": EXPERTS, "top_k": TOP_K, "prefix": 4,
            "learned_layers": [], "hidden_layers": [], "two_ahead_layers": [], "own_layers": []}


def measure(layers: int, steps: int, fraction: float, freeze: bool = False, by_method: bool = False) -> dict:
    """Each setting's decode, timed; with ``freeze``, also with every object alive once the model is
    wrapped moved out of the garbage collector's walks (``gc.freeze()``, as a serving process may do
    after loading), as ``<setting>_gc_frozen``, the runs alternating."""
    trace = synthetic_trace(layers, steps)
    out = {}
    settings = [(label, speculate, frozen) for label, speculate in (("cache_alone", False), ("default", True))
                for frozen in ((False, True) if freeze else (False,))]
    for label, speculate, frozen in settings:
        label = label + ("_gc_frozen" if frozen else "")
        try:
            clock, r = timed_replay(trace, fraction, speculate, pager_part="pager", wrapped=gc.freeze if frozen else None,
                                    by_method=by_method)
        finally:
            if frozen:
                gc.unfreeze()
        n = len(trace["steps"])
        parts = {part: s / n * 1e3 for part, s in by_part(clock.parts).items()}
        out[label] = {"hit_rate": r["hit_rate"], "ms_per_step": r["seconds"] / n * 1e3,
                      "ms_per_step_by_part": parts,
                      "ms_per_step_policy": sum(v for p, v in parts.items() if p not in APART),
                      "calls_per_step": {part: c / n for part, c in by_part(clock.calls).items()}}
        print(f"{layers} layers, {label}: hit {r['hit_rate']:.3f}, {out[label]['ms_per_step']:.2f} ms a step ("
              + ", ".join(f"{p} {v:.2f}" for p, v in parts.items()) + ")", flush=True)
        if by_method:
            out[label]["by_method"] = print_methods(clock, n)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", nargs="+", type=int, default=[6, 24, 58])
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--fraction", type=float, default=0.25)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--name", default="moe_policy_scale.json", help="the result's file name in --out")
    p.add_argument("--by-method", action="store_true", help="also each entry point of the policy apart")
    p.add_argument("--freeze-gc", action="store_true",
                   help="each setting also with gc.freeze() once the model is wrapped")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    body = {"experts": EXPERTS, "top_k": TOP_K, "fraction_cached": args.fraction, "decode_steps": args.steps,
            "layers": {str(n): measure(n, args.steps, args.fraction, args.freeze_gc, args.by_method) for n in args.layers}}
    save_result(args.out, args.name, "host time of the expert policy against the model's depth",
                torch.device("cpu"), argv, body)


if __name__ == "__main__":
    main()
