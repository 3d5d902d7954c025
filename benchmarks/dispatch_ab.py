"""benchmarks/dispatch.py, A/B: this checkout against another (say, a worktree of an older commit),
alternating process by process in one sitting, so that both see the same machine.

Each run is a fresh process that imports offtensor from one checkout and then runs this checkout's
benchmarks/dispatch.py (the same measurement on both sides). A per-op figure is that op's time
divided by the pass-through subclass's in the same process (raw microseconds swing up to 2x between
processes on a shared host); the result is the median of those ratios over the runs, and
``this_over_baseline`` compares the two medians.

    git worktree add /tmp/base <commit> && cp offtensor/_C*.so /tmp/base/offtensor/
    python benchmarks/dispatch_ab.py --baseline /tmp/base [--runs 9] [--iters 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from results_io import save_result  # noqa: E402

# Imports offtensor from the checkout given first, then runs the dispatch benchmark given second.
_RUN = """
import os, runpy, sys
sys.path.insert(0, sys.argv[1])
import offtensor
assert offtensor.__file__.startswith(sys.argv[1]), offtensor.__file__
script = sys.argv[2]
sys.path.insert(1, os.path.dirname(script))  # its results_io
sys.argv = [script] + sys.argv[3:]
runpy.run_path(script, run_name="__main__")
"""

SUBJECTS = {"cache_hit": "offloaded (cache hit)", "no_cache": "offloaded (no cache)", "plain": "plain",
            "page_in": "offloaded (page-in)"}  # page_in: only the row of two weights in turn


def _one_run(checkout: str, iters: int, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        args = [sys.executable, "-c", _RUN, os.path.abspath(checkout), os.path.join(HERE, "dispatch.py"),
                "--device", "cpu", "--iters", str(iters), "--repeats", str(repeats), "--out", out]
        subprocess.run(args, check=True, stdout=subprocess.DEVNULL, cwd=checkout)
        with open(os.path.join(out, "dispatch_cpu.json")) as f:
            return json.load(f)["us_per_op"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="another checkout of offtensor, extension built")
    parser.add_argument("--this", default=os.path.dirname(HERE), help="the checkout measured against it "
                        "(default: this script's)")
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--name", default="dispatch_ab_cpu.json")
    args = parser.parse_args(argv)
    trees = {"this": os.path.abspath(args.this), "baseline": os.path.abspath(args.baseline)}
    ratios = {tree: {} for tree in trees}  # tree -> op -> subject -> [ratio over pass-through per run]
    for run in range(args.runs):
        for tree, path in (trees.items() if run % 2 == 0 else reversed(trees.items())):
            for op, row in _one_run(path, args.iters, args.repeats).items():
                for key, subject in SUBJECTS.items():
                    if subject not in row:
                        continue
                    ratios[tree].setdefault(op, {}).setdefault(key, []).append(row[subject] / row["passthrough"])
        print(f"run {run + 1}/{args.runs} done", flush=True)
    table = {}
    print(f"{'op':<16}{'hit/pt this':>13}{'hit/pt base':>13}{'this/base':>11}{'nocache this/base':>19}")
    for op in ratios["this"]:
        row = {}
        for key in SUBJECTS:
            if key not in ratios["this"][op]:
                continue
            this = statistics.median(ratios["this"][op][key])
            base = statistics.median(ratios["baseline"][op][key])
            row[key] = {"this_over_passthrough": round(this, 3), "baseline_over_passthrough": round(base, 3),
                        "this_over_baseline": round(this / base, 3)}
        table[op] = row
        print(f"{op:<16}{row['cache_hit']['this_over_passthrough']:>13.2f}"
              f"{row['cache_hit']['baseline_over_passthrough']:>13.2f}{row['cache_hit']['this_over_baseline']:>11.3f}"
              f"{row['no_cache']['this_over_baseline']:>19.3f}"
              + (f"   page-in this/base {row['page_in']['this_over_baseline']:.3f}" if "page_in" in row else ""))
    commits = {}
    for tree, path in trees.items():
        done = subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        commits[tree] = done.stdout.strip() or None
    save_result(args.out, args.name, "dispatch A/B (per-op time over the pass-through subclass's)",
                torch.device("cpu"), argv, {"runs": args.runs, "iters": args.iters, "repeats": args.repeats,
                                            "checkouts": commits, "ops": table})


if __name__ == "__main__":
    main()
