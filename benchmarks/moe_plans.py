"""Decode plans of Qwen3-30B-A3B and a DeepSeek-V3-shaped model (``ot.plan`` on meta, replayed under
the ``h200`` profile) at a few budgets, uniform routing against routing calibrated to the trained
test models, each with the default expert placement and with every stack paged:

    python benchmarks/moe_plans.py [--plan-models qwen3_30b_a3b deepseek_v3_shaped] [--out DIR]

Needs the ``moe_routing_*.json`` that ``benchmarks/moe_sim.py`` writes (in ``--out``); writes
``moe_plans.json`` there, row by row as each plan completes. ``moe_bench.py --plans`` runs this.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from results_io import save_result  # noqa: E402

# Qwen3-30B-A3B's config.json (bf16, 61 GB: 48 layers x 128 experts of 2048 x 768, top-8).
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[],
                     tie_word_embeddings=False, max_position_embeddings=40960, norm_topk_prob=True)
# DeepSeek-V3's per-layer shape (hidden 7168, 256 routed experts of 2048, top-8, one shared expert,
# MLA), 3 dense layers then MoE ones, cut to DEEPSEEK_LAYERS layers so a plan takes seconds: an
# expert is 88 MB in bf16, a MoE layer's stacks 22.5 GB.
DEEPSEEK_LAYERS = 8
DEEPSEEK_V3_SHAPED = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                          num_hidden_layers=DEEPSEEK_LAYERS, first_k_dense_replace=3, num_attention_heads=128,
                          num_key_value_heads=128, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
                          n_group=8, topk_group=4, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                          qk_rope_head_dim=64, v_head_dim=128, tie_word_embeddings=False, max_position_embeddings=4096)
PLANS = {"qwen3_30b_a3b": ("Qwen3MoeConfig", QWEN3_30B_A3B), "deepseek_v3_shaped": ("DeepseekV3Config", DEEPSEEK_V3_SHAPED)}
# (model, budget GiB) in the order planned (the headline first; each row is written as it
# completes, so a run cut short keeps what it has).
PLAN_ORDER = (("qwen3_30b_a3b", 24.0), ("deepseek_v3_shaped", 48.0), ("qwen3_30b_a3b", 16.0), ("qwen3_30b_a3b", 32.0),
              ("deepseek_v3_shaped", 24.0))


def _routing_stats(out_dir):
    """The routing measured on the trained test models (benchmarks/moe_sim.py writes it)."""
    from offtensor import RoutingStats

    stats = {}
    for name in ("qwen3", "qwen2"):
        path = os.path.join(out_dir, f"moe_routing_{name}.json")
        if os.path.exists(path):
            stats[f"trained_{name}"] = RoutingStats.load(path)
    if not stats:
        raise SystemExit(f"moe_bench --plans: no moe_routing_*.json in {out_dir}: run benchmarks/moe_sim.py first")
    return stats


def plans_driven_by_routing(args, out_dir, save=None) -> dict:
    """Decode plans (``ot.plan`` on meta, replayed under ``h200``) of Qwen3-30B-A3B and a
    DeepSeek-V3-shaped model at a few budgets: uniform routing against routing calibrated to the
    trained test models (their per-layer skew and locality, scaled to 128 / 256 experts), each
    with the default expert placement and with every stack paged; ``plan_expert_paging``'s
    verdict is the faster of the two."""
    import transformers

    routings = {"uniform": None, **_routing_stats(out_dir)}
    x = torch.zeros(1, 1, dtype=torch.long, device="meta")
    result = {"routing_stats": {k: v.summary() for k, v in routings.items() if v is not None}, "models": {}}
    built = {}
    for model_name, budget in PLAN_ORDER:
        if args.plan_models and model_name not in args.plan_models:
            continue
        if model_name not in built:
            config_class, fields = PLANS[model_name]
            with torch.device("meta"):
                built[model_name] = transformers.AutoModelForCausalLM.from_config(
                    getattr(transformers, config_class)(**fields), dtype=torch.bfloat16).eval()
            model = built[model_name]
            result["models"][model_name] = {"config": config_class, "fields": PLANS[model_name][1], "plans": {},
                                            "weights_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}
        rows = result["models"][model_name]["plans"]
        for routing_name, routing in routings.items():
            rows[f"{budget:g} GiB, {routing_name}"] = row = _plan_row(built[model_name], budget, x, routing)
            d, a = row["default"], row["all_paged"]
            print(f"plan {model_name} {budget:g} GiB {routing_name:14s}: default {d['step_ms']:.1f} ms "
                  f"({d['ratio_to_bound']:.2f} x {d['bound_by']}, host {d['host_ms']:.2f} ms), all paged "
                  f"{a['step_ms']:.1f} ms ({a['ratio_to_bound']:.2f} x {a['bound_by']}, host {a['host_ms']:.2f} ms) "
                  f"-> {'all paged' if row['paged'] else 'default'}", flush=True)
            if save is not None:
                save(result)
    return result


def _plan_row(model, budget, x, routing) -> dict:
    from offtensor.sim.plan import EXPERTS_PAGED, plan

    row = {}
    for placement_name, policy in (("default", None), ("all_paged", EXPERTS_PAGED)):
        t0 = time.perf_counter()
        tl = plan(model, budget_gb=budget, example_inputs=(x,), steps=2, warmup=3, policy=policy, routing=routing)
        r = tl.replay("h200")
        hits = sum(e["hits"] for e in tl.info["experts"].values())
        looks = hits + sum(e["misses"] for e in tl.info["experts"].values())
        row[placement_name] = {
            "step_ms": r.step_ms, "bound_ms": r.bound_ms, "bound_by": r.bound_by, "host_ms": r.host_ms,
            "ratio_to_bound": r.ratio_to_bound, "copy_busy": r.copy_busy, "copied_bytes": tl.step_copy_bytes(tl.steps - 1),
            "offloaded_weights": len(tl.info["offloaded"]), "offloaded_bytes": tl.info["offloaded_bytes"],
            "expert_hit_rate": hits / looks if looks else None, "plan_seconds": time.perf_counter() - t0}
    row["paged"] = row["all_paged"]["step_ms"] < row["default"]["step_ms"]
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--plan-models", nargs="*", default=None, help=f"a subset of {sorted(PLANS)}")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    return plans_driven_by_routing(args, args.out, save=lambda result: save_result(
        args.out, "moe_plans.json", "moe_bench --plans", torch.device("meta"), argv, result))


if __name__ == "__main__":
    main()
