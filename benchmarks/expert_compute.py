"""expert_compute "device" / "host" / "auto" on the trained test models (tests/data) at 25% of the
experts cached: bytes copied per decode step and experts computed on the host, measured on the
emulated device (a teacher-forced decode of held-out text, logits checked against the unwrapped
model), and each layer's replayed step time per mode under the H200 profile with this machine's
host figures. Writes benchmarks/results/expert_compute.json.

    .venv/bin/python benchmarks/expert_compute.py [--steps 16]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_sim  # noqa: E402

import offtensor as ot  # noqa: E402
from offtensor.moe import is_routed_stack, model_top_k  # noqa: E402
from offtensor.sim.host_compute import compute_rows, with_host_figures  # noqa: E402

PREFIX, FRACTION = 32, 0.25


def _decode(model, ids, steps, before=lambda: None) -> list:
    """Prefill ``ids[:PREFIX]``, then one true byte per step with the KV cache: each step's logits."""
    logits, cache = [], None
    with torch.no_grad():
        for t in range(steps + 1):
            before()
            x = ids[:, :PREFIX] if cache is None else ids[:, PREFIX + t - 1 : PREFIX + t]
            out = model(input_ids=x, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logits.append(out.logits[:, -1])
    return logits


def measure(name: str, steps: int) -> dict:
    base = moe_sim.load_model(name)
    ids = moe_sim.heldout_ids(0, PREFIX + steps + 1).unsqueeze(0)
    expected = _decode(base, ids, steps)
    out = {}
    for mode in ("device", "host", "auto"):
        model = copy.deepcopy(base)
        ot.wrap_model(model, budget_gb=moe_sim.budget_gb(model, FRACTION), device="cpu", expert_compute=mode)
        counted = []
        got = _decode(model, ids, steps, lambda: counted.append(ot.stats(model).bytes_h2d))
        same = all(torch.equal(a, b) for a, b in zip(got, expected))
        decode_bytes = ot.stats(model).bytes_h2d - counted[1]
        s = ot.stats(model)
        out[mode] = {"decode_bytes_per_step": decode_bytes / steps, "host_experts": s.host_experts,
                     "identical_logits": bool(same)}
    stacks = [(n, tuple(p.shape), p.dtype) for n, p in base.named_parameters() if is_routed_stack(n, p.shape)]
    profile = with_host_figures("h200")
    rows = compute_rows(stacks, profile, model_top_k(base), FRACTION)
    for phase, i in (("decode", 0), ("prefill", 1)):
        out[f"replay_{phase}_ms"] = {
            "device": sum(r[i][5] for _, r in rows), "host": sum(r[i][4] for _, r in rows),
            "auto": sum(r[i][3] for _, r in rows), "auto_host_layers": sum(r[i][2] == "host" for _, r in rows),
            "layers": len(rows)}
    out["host_figures"] = {"tflops": profile.host_tflops, "gbps": profile.host_gbps}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    results = {"command": "benchmarks/expert_compute.py --steps %d" % args.steps}
    for name in ("qwen3", "qwen2"):
        results[name] = measure(name, args.steps)
        print(name, json.dumps(results[name], indent=1))
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "expert_compute.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
