"""The host cost of a page-in, A/B: this checkout against another, alternating process by process.

Each process imports offtensor from one checkout and times ``Pager.page`` + ``release`` of tensors
that a budget cannot hold together, so every page evicts, takes device memory and copies (the
emulated device: the copy is a host memcpy on the copy engine's thread). Two workloads:

- ``same``: ten 16 KiB tensors in turn under a budget for three (layers that repeat their shapes);
- ``mixed``: 25 KiB x8, 100 KiB x2 and 7 KiB x5 in turn under 256 KiB (the GPU test's scenario,
  in KiB): sizes that alternate, where device memory must be found for a size just evicted.

Per-page microseconds are the median over rounds in a process; the result is the median over runs
of each checkout, and ``this_over_baseline`` their ratio.

    git worktree add /tmp/base <commit> && cp offtensor/_C*.so /tmp/base/offtensor/
    python benchmarks/page_in_ab.py --baseline /tmp/base [--runs 9]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from results_io import save_result  # noqa: E402

_RUN = r"""
import json, statistics, sys, time
sys.path.insert(0, sys.argv[1])
import torch, offtensor as ot
from offtensor.pager import Pager
assert ot.__file__.startswith(sys.argv[1]), ot.__file__
torch.set_num_threads(1)
KiB, rounds = 1024, int(sys.argv[2])

def per_page(sizes, budget):
    pager = Pager(torch.device("cpu"), budget_bytes=budget)
    ts = [ot.offload(torch.zeros(n // 4), pager=pager) for n in sizes]
    def once():
        for t in ts:
            _, entry = pager.page(t._host, t._master)
            pager.release([entry])
    once()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        once()
        times.append((time.perf_counter() - start) / len(ts) * 1e6)
    assert pager.snapshot().hits == 0
    return statistics.median(times)

print(json.dumps({"same": per_page([16 * KiB] * 10, 48 * KiB),
                  "mixed": per_page([25 * KiB] * 8 + [100 * KiB] * 2 + [7 * KiB] * 5, 256 * KiB)}))
"""


def _one_run(checkout: str, rounds: int) -> dict:
    done = subprocess.run([sys.executable, "-c", _RUN, os.path.abspath(checkout), str(rounds)], check=True,
                          capture_output=True, text=True, cwd=checkout)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="another checkout of offtensor, extension built")
    parser.add_argument("--this", default=os.path.dirname(HERE), help="the checkout measured against it")
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--name", default="page_in_ab_cpu.json")
    args = parser.parse_args(argv)
    trees = {"this": os.path.abspath(args.this), "baseline": os.path.abspath(args.baseline)}
    us = {tree: {} for tree in trees}  # tree -> workload -> [us per page, per run]
    for run in range(args.runs):
        for tree, path in (trees.items() if run % 2 == 0 else reversed(trees.items())):
            for workload, value in _one_run(path, args.rounds).items():
                us[tree].setdefault(workload, []).append(value)
        print(f"run {run + 1}/{args.runs} done", flush=True)
    table = {}
    for workload in us["this"]:
        this, base = statistics.median(us["this"][workload]), statistics.median(us["baseline"][workload])
        table[workload] = {"this_us_per_page": round(this, 2), "baseline_us_per_page": round(base, 2),
                           "this_over_baseline": round(this / base, 3)}
        print(f"{workload:<8} this {this:7.2f} us/page   baseline {base:7.2f} us/page   this/base {this / base:.3f}")
    save_result(args.out, args.name, "page-in host cost A/B (us per page)", torch.device("cpu"), argv,
                {"runs": args.runs, "rounds": args.rounds, "workloads": table})


if __name__ == "__main__":
    main()
