"""Whether a change to the pager or the expert policy changed what they decide: the hit rate and
the bytes copied of offtensor's real pager and expert policy replayed on the trained test models'
decode (``moe_replay.replay_ours`` on ``moe_sim``'s traces, the committed look-ahead), at 25 % and
50 % of the experts cached, with the cache alone and with the default guesses.

A change meant to be faster only (an index, a cache of a search) must leave every figure exactly
as it was; a change of policy shows here what it changed, setting by setting. The figures are
deterministic (the emulated device, a fixed trace), so equality is exact, not within noise.

    python benchmarks/moe_decisions.py            # write results/moe_decisions.json
    python benchmarks/moe_decisions.py --check    # compare with it: exit 1 on any difference
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_sim  # noqa: E402
from moe_replay import replay_ours  # noqa: E402
from results_io import save_result  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
NAME = "moe_decisions.json"
MODELS = ("qwen3", "qwen2", "mixtral")
PREFIX, STEPS = 32, 96


def decisions(models=MODELS) -> dict:
    """``"model fraction setting"`` -> (decode hit rate, bytes copied in the decode)."""
    out = {}
    for name in models:
        model = moe_sim.load_model(name)
        ids = moe_sim.heldout_ids(0, PREFIX + STEPS + 1)
        trace = moe_sim.record_trace(model, ids, PREFIX, STEPS, moe_sim.lookahead_of(name, model))
        for fraction in (0.25, 0.5):
            for label, speculate in (("cache_alone", False), ("default", True)):
                r = replay_ours(trace, fraction, speculate)
                out[f"{name} {fraction:.0%} {label}"] = [r["hit_rate"], r["bytes_h2d"]]
                print(f"{name} {fraction:.0%} {label}: hit {r['hit_rate']:.4f}, {r['bytes_h2d']} bytes", flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help=f"compare with results/{NAME} instead of writing it")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    got = decisions()
    if not args.check:
        save_result(RESULTS, NAME, "what the pager and the expert policy decide on the trained models' decode",
                    torch.device("cpu"), argv, {"prefix": PREFIX, "decode_steps": STEPS, "decisions": got})
        return 0
    with open(os.path.join(RESULTS, NAME)) as f:
        want = json.load(f)["decisions"]
    changed = {k: (want.get(k), v) for k, v in got.items() if want.get(k) != v}
    for k, (was, now) in changed.items():
        print(f"changed: {k}: {was} -> {now}")
    print("the same decisions" if not changed else f"{len(changed)} of {len(got)} settings changed")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
