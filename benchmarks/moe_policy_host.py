"""The host time of offtensor's expert policy on a decode: what the H200 replay's host lane does not
carry yet.

The replay charges offtensor's host time per record from the profile's measured figures (a page, a
copy issued, a further expert of a grouped GEMM), which were measured on a pager without the expert
policy. The policy's own work runs on the host too, in Python: choosing each victim among the cached
experts (``ExpertEviction.victim``), the bookkeeping of every expert paged and of each layer's
announce (``ExpertStacks``), and the routing guesses (``RoutingSpeculator``: the look-ahead's
read-back, softmax and top-k on the host, the copies ahead, the scoring). This replays the trained
models' decode traces (``moe_sim.py``'s, the committed look-ahead) through offtensor's pager and
expert policy with tiny experts (no copy costs anything to speak of: on the emulated device a
worker thread makes the copies, and with real expert sizes its memory traffic slows the host's
Python several fold) and times those calls by wall clock, each call's time less that of the timed
calls inside it, on this machine's host; the fastest of ``--repeats`` runs (by the policy's total):

    python benchmarks/moe_policy_host.py [--models qwen3 qwen2 mixtral] [--fraction 0.25] [--repeats 3] [--by-method]

Per model and setting (the cache alone, the default guesses): µs per decode step in each part of
the policy (``offtensor.sim.policy_clock``: victim search, bookkeeping, guesses), the pager's own
paging and copy issue, which the replay's figures stand for, left out (timed apart as
``us_per_step_pager``: the same run's yardstick, for comparing runs on a machine whose speed
varies), as are Python's garbage collections (``us_per_step_gc``: the whole run's pauses, which
land in whichever call allocates) and the look-ahead's kernels (on a GPU launches on the compute stream); and
``moe_sim.py``'s H200 replay of the same decode (its committed result) with that time added to
each step.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_sim  # noqa: E402
from moe_replay import replay_ours  # noqa: E402
from results_io import save_result  # noqa: E402

from offtensor.pager import Pager  # noqa: E402
from offtensor.sim.policy_clock import PolicyClock  # noqa: E402

# The pager's own paging, copy issue and release: what the replay's page and copy figures stand
# for, timed apart from the policy (a policy call is charged less the pager calls inside it).
PAGER = ("page", "prefetch", "release")
# Parts timed apart from the policy's: the pager's own (above) and the garbage collector's pauses,
# which land in whichever call allocates when a generation fills (the whole run's, reported apart).
APART = ("pager", "gc")


def timed_replay(trace, fraction: float, speculate: bool, pager_part=None, warm: bool = True, wrapped=None,
                 by_method: bool = False):
    """``replay_ours`` of ``trace`` (after a warm run, with ``warm``) with a ``PolicyClock`` installed,
    the pager's own calls timed apart (as ``pager_part`` where named): (the clock, the replay's result).
    ``wrapped``: called once the timed run's model is wrapped; ``by_method``: the clock's parts per
    entry point ("victim.victim", "bookkeeping.accessed", ...; ``by_part`` sums them)."""
    if warm:
        replay_ours(copy.copy(trace), fraction, speculate)  # imports, first calls
    clock = PolicyClock(by_method)
    if not clock.install():
        raise RuntimeError("offtensor: another PolicyClock is installed")
    try:
        clock.exclude(Pager, PAGER, part=pager_part)
        result = replay_ours(copy.copy(trace), fraction, speculate, wrapped)
    finally:
        clock.remove()
    return clock, result


def by_part(figures: dict) -> dict:
    """A clock's parts (or calls) with its per-method parts ("guesses.issue_ready") summed by part."""
    out = {}
    for name, value in figures.items():
        part = name.partition(".")[0]
        out[part] = out.get(part, 0) + value
    return out


def print_methods(clock, steps: int) -> dict:
    """The per-method parts of a ``by_method`` clock, most time first: us a step, calls a step, us a call."""
    rows = {}
    for name, s in sorted(clock.parts.items(), key=lambda item: -item[1]):
        if "." in name:
            calls = clock.calls.get(name, 0)
            rows[name] = {"us_per_step": s / steps * 1e6, "calls_per_step": calls / steps, "us_per_call": s / max(calls, 1) * 1e6}
            print(f"    {name:32s} {rows[name]['us_per_step']:9.1f} us a step {rows[name]['calls_per_step']:8.1f} calls "
                  f"{rows[name]['us_per_call']:8.2f} us a call", flush=True)
    return rows


def measure(name: str, fraction: float, repeats: int = 3, by_method: bool = False) -> dict:
    model = moe_sim.load_model(name)
    ids = moe_sim.heldout_ids(0, 32 + 256 + 1)
    trace = moe_sim.record_trace(model, ids, 32, 256, moe_sim.lookahead_of(name, model, False))
    steps = len(trace["steps"])
    out = {}
    for label, speculate in (("cache_alone", False), ("default", True)):
        runs = [timed_replay(trace, fraction, speculate, pager_part="pager", warm=not n, by_method=by_method)[0]
                for n in range(repeats)]
        clock = min(runs, key=lambda c: sum(v for p, v in c.parts.items() if p not in APART))
        parts, calls = by_part(clock.parts), by_part(clock.calls)
        per_step = {part: s / steps * 1e6 for part, s in parts.items() if part not in APART}
        policy = sum(per_step.values())
        pager = parts.get("pager", 0.0) / steps * 1e6
        collector = parts.get("gc", 0.0) / steps * 1e6
        victim = parts.get("victim", 0.0) / max(calls.get("victim", 0), 1) * 1e6
        out[label] = {"us_per_step": per_step, "us_per_step_policy": policy, "us_per_victim": victim,
                      "us_per_step_pager": pager, "us_per_step_gc": collector,
                      "calls_per_step": {part: n / steps for part, n in calls.items()}}
        print(f"{name} {label}: {policy:.0f} us a step of the expert policy's host work ("
              + ", ".join(f"{p} {v:.0f}" for p, v in per_step.items()) + f"); {victim:.1f} us a victim; "
              f"the pager's own {pager:.0f}; garbage collection {collector:.0f}", flush=True)
        if by_method:
            out[label]["by_method"] = print_methods(clock, steps)
    out["layers"], out["steps"] = trace["layers"], steps
    return out


def with_replay(results: dict, sim_path: str, fraction: float) -> dict:
    """Per model, ``moe_sim.py``'s H200 replay of the same decode (``sim_path``, its ``h200_sized``
    rows at ``fraction``) with this policy time added to every step, serially (where the host is the
    bottleneck, as the replay finds it, the policy's work is on the critical path): ms a step, cache
    alone and default, and how much faster the default is."""
    import json

    if not os.path.exists(sim_path):
        return {}
    with open(sim_path) as f:
        sim = json.load(f)
    out = {}
    for name, row in results.items():
        h200 = sim.get(name, {}).get("cache", {}).get(f"{round(fraction * 100)}%", {}).get("h200_sized")
        if not h200:
            continue
        alone = h200["cache_alone"]["step_ms_mean"] + row["cache_alone"]["us_per_step_policy"] / 1e3
        default = h200["default"]["step_ms_mean"] + row["default"]["us_per_step_policy"] / 1e3
        out[name] = {"cache_alone_ms": alone, "default_ms": default, "default_faster": 1 - default / alone,
                     "replay_default_faster": 1 - h200["default"]["step_ms_mean"] / h200["cache_alone"]["step_ms_mean"]}
        print(f"{name}: the H200 replay with this policy time added: cache alone {alone:.3f} ms, default "
              f"{default:.3f} ms ({100 * out[name]['default_faster']:+.1f} % faster; without it "
              f"{100 * out[name]['replay_default_faster']:+.1f} %)", flush=True)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["qwen3", "qwen2", "mixtral"])
    p.add_argument("--fraction", type=float, default=0.25)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per setting; the fastest is kept")
    p.add_argument("--by-method", action="store_true", help="also each entry point of the policy apart")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--name", default="moe_policy_host.json", help="the result's file name in --out")
    p.add_argument("--sim", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "moe_sim.json"),
                   help="moe_sim.py's result, whose H200 replay the policy time is added to")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    body = {"fraction_cached": args.fraction, "models": {name: measure(name, args.fraction, args.repeats, args.by_method) for name in args.models}}
    body["h200_replay_with_policy"] = with_replay(body["models"], args.sim, args.fraction)
    save_result(args.out, args.name, "host time of the expert policy on the trained models' decode",
                torch.device("cpu"), argv, body)


if __name__ == "__main__":
    main()
