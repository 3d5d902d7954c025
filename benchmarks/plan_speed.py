"""The host time of a plan (``ot.plan`` on meta), with the meta-op memo against without it, A/B in one
process, alternating run by run, and the two plans' timelines compared record by record.

Subjects (each built on meta once):

- ``decision``: the expert placement decision of the two-layer test Qwen3-MoE (tests/test_moe_placement.py's
  model at half its experts' bytes): ``plan_expert_paging``, two plans of 3 warm-up and 2 replayed
  decode steps, under skewed routing; what a wrapped MoE model pays once, in the forward that decides;
- ``qwen3_30b_a3b``: one decode plan of Qwen3-30B-A3B's shape at 24 GiB, every stack paged
  (``moe_plans.py``'s model; 48 layers of 128 experts), uniform routing.

Per subject: seconds per plan with the memo off and on (the fastest and the median of the runs),
their ratio, the memo's hits and misses, and whether both timelines have the same records (every
field but the expert policy's measured host time) and the same replay.

    python benchmarks/plan_speed.py [--runs 3] [--subjects decision qwen3_30b_a3b]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
from moe_plans import QWEN3_30B_A3B  # noqa: E402
from results_io import save_result  # noqa: E402

from offtensor import RoutingStats  # noqa: E402
from offtensor.placement import EXPERTS_PAGED  # noqa: E402
from offtensor.sim import meta_memo  # noqa: E402
from offtensor.sim.plan import plan  # noqa: E402

GiB = 1 << 30


def _meta(fields: dict, dtype):
    import transformers

    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**fields), dtype=dtype).eval()


def _decision():
    """(model, the plans' keyword arguments): the test model's placement decision, both plans."""
    fields = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, max_position_embeddings=64,
                  num_hidden_layers=2, num_key_value_heads=2, head_dim=16, intermediate_size=256,
                  moe_intermediate_size=64, num_experts=16, num_experts_per_tok=2, decoder_sparse_step=1,
                  mlp_only_layers=[])
    model = _meta(fields, torch.float32)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    shares = [1 / (i + 1) for i in range(32)]
    skewed = RoutingStats([[s / sum(shares) for s in shares]] * 6, [0.45] * 6, 4, source="zipf(1), reuse 0.45")
    budget = (total - experts / 2) / GiB
    return model, [dict(budget_gb=budget, routing=skewed, policy=None), dict(budget_gb=budget, routing=skewed,
                                                                             policy=EXPERTS_PAGED)]


def _qwen3_30b():
    return _meta(QWEN3_30B_A3B, torch.bfloat16), [dict(budget_gb=24.0, routing=None, policy=EXPERTS_PAGED)]


SUBJECTS = {"decision": _decision, "qwen3_30b_a3b": _qwen3_30b}


def _records(tl) -> list:
    """The timeline's records, comparable across runs: a copy's key names its pager and master by
    their ids (numbered here in order of first use), and the expert policy's host time is measured
    by wall clock."""
    names = {}

    def key(k):
        if k is None:
            return None
        return (names.setdefault(("pager", k[0]), len(names)), names.setdefault(("master", k[1]), len(names))) + k[2:]

    return [dataclasses.replace(r, policy_ms=0.0, key=key(r.key)) for r in tl.records]


def _run(model, plans: list, memo: bool):
    """(seconds, timelines, memo hits, misses) of ``plans`` of ``model`` with the memo on or off."""
    memos = []
    enter = meta_memo.MetaMemo.__enter__

    def counting_enter(self):  # the memo of each plan, counted when it is entered
        memos.append(self)
        return enter(self)

    meta_memo.ENABLED = memo
    meta_memo.MetaMemo.__enter__ = counting_enter
    x = torch.zeros(1, 1, dtype=torch.long, device="meta")
    try:
        t0 = time.perf_counter()
        timelines = [plan(model, example_inputs=(x,), steps=2, warmup=3, **kw) for kw in plans]
        seconds = time.perf_counter() - t0
    finally:
        meta_memo.ENABLED = True
        meta_memo.MetaMemo.__enter__ = enter
    return seconds, timelines, sum(m.hits for m in memos), sum(m.misses for m in memos)


def measure(name: str, runs: int) -> dict:
    model, plans = SUBJECTS[name]()
    _run(model, plans, True)  # imports, first-call caches
    times = {False: [], True: []}
    same = True
    for _ in range(runs):
        got = {}
        for memo in (False, True):
            seconds, timelines, hits, misses = _run(model, plans, memo)
            times[memo].append(seconds)
            got[memo] = timelines
        for a, b in zip(got[False], got[True]):
            same &= _records(a) == _records(b) and a.replay("h200").step_ms == b.replay("h200").step_ms
    off, on = min(times[False]), min(times[True])
    row = {"plans": len(plans), "seconds_without_memo": times[False], "seconds_with_memo": times[True],
           "fastest_without": off, "fastest_with": on, "with_over_without": on / off,
           "median_with_over_without": statistics.median(times[True]) / statistics.median(times[False]),
           "memo_hits": hits, "memo_misses": misses, "same_timelines": same}
    print(f"{name}: {len(plans)} plan(s) {off:.2f} s without the memo, {on:.2f} s with it ({on / off:.2f} x); "
          f"memo {hits} hits, {misses} misses; same timelines: {same}", flush=True)
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--subjects", nargs="+", default=list(SUBJECTS), choices=list(SUBJECTS))
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    body = {"runs": args.runs, "subjects": {name: measure(name, args.runs) for name in args.subjects}}
    save_result(args.out, "plan_speed_cpu.json", "ot.plan host time with and without the meta-op memo",
                torch.device("meta"), argv, body)


if __name__ == "__main__":
    main()
