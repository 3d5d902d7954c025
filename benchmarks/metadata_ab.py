"""The wrapped MoE decode step of benchmarks/hit_path.py with OffloadedTensor's direct metadata
reads and memoized transposes on and off, alternating step by step in one process ("off" is the
class and function table without them: every read through ``__torch_function__``, a new view per
transpose), so that the machine's load hits both alike. Also counts the step's
``__torch_function__`` entries each way, and times benchmarks/dispatch.py's ops on a cached 16 x 16
tensor the same way (on over off, per op, median of ``--op-rounds`` alternations): what the change
costs the ops it does not target, without another checkout's other changes in the comparison.

    python benchmarks/metadata_ab.py [--steps 60] [--rounds 3] [--op-rounds 15] [--name metadata_ab_cpu.json]
"""

from __future__ import annotations

import argparse
import collections
import copy
import os
import statistics
import sys

import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dispatch  # noqa: E402
import hit_path  # noqa: E402
import offtensor as ot  # noqa: E402
from offtensor import OffloadedTensor  # noqa: E402
from offtensor.ops.functions import FUNCTION_TABLE  # noqa: E402
from offtensor.tensor import METADATA_METHODS, METADATA_PROPERTIES  # noqa: E402
from results_io import save_result  # noqa: E402

_READS = {n: OffloadedTensor.__dict__[n] for n in (*METADATA_PROPERTIES, *METADATA_METHODS)}
_MEMO = {f: FUNCTION_TABLE[f] for f in (torch.Tensor.t, torch.Tensor.transpose)}


def switch(on: bool) -> None:
    for name, member in _READS.items():
        if on:
            setattr(OffloadedTensor, name, member)
        else:
            delattr(OffloadedTensor, name)
    if on:
        FUNCTION_TABLE.update(_MEMO)
    else:
        for f in _MEMO:
            FUNCTION_TABLE.pop(f)


def torch_function_entries(step) -> collections.Counter:
    counts = collections.Counter()
    original = OffloadedTensor.__dict__["__torch_function__"]

    def counting(cls, func, types, args=(), kwargs=None):
        counts[getattr(func, "__name__", str(func))] += 1
        return original.__func__(cls, func, types, args, kwargs)

    OffloadedTensor.__torch_function__ = classmethod(counting)
    try:
        step()
    finally:
        OffloadedTensor.__torch_function__ = original
    return counts


def op_ratios(rounds: int, iters: int = 2000) -> dict:
    """dispatch.py's ops on a cached OffloadedTensor, on over off, median over ``rounds``."""
    w = ot.offload(torch.randn(16, 16), pager=ot.pager.Pager(torch.device("cpu"), budget_bytes=1 << 20))
    out = {}
    with torch.no_grad():
        for name, fn in dispatch._ops(torch.device("cpu")).items():
            ratios = []
            for _ in range(rounds):
                times = []
                for on in (False, True):
                    switch(on)
                    fn(w)
                    start = time.perf_counter()
                    for _ in range(iters):
                        fn(w)
                    times.append(time.perf_counter() - start)
                ratios.append(times[1] / times[0])
            out[name] = round(statistics.median(ratios), 3)
            print(f"{name:<20} on/off {out[name]:.3f}", flush=True)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--op-rounds", type=int, default=15)
    p.add_argument("--name", default="metadata_ab_cpu.json")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args(argv)
    config = argparse.Namespace(model="trained-qwen3-moe")
    plain = hit_path.trained_qwen3_moe(config)
    wrapped = copy.deepcopy(plain)
    weights = sum(t.numel() * t.element_size() for t in plain.parameters())
    ot.wrap_model(wrapped, budget_gb=2 * weights / hit_path.GiB, device="cpu", prefetch=False, policy=["*.experts.*"])
    prompt = torch.randint(0, config.vocab, (1, 8), generator=torch.Generator().manual_seed(1))
    plain_step, plain_state = hit_path._step_timer(plain, prompt)
    step, state = hit_path._step_timer(wrapped, prompt)
    hit_path._route_to_every_expert(wrapped, config)
    for _ in range(3):
        plain_step(), step()
    rounds = []
    for _ in range(args.rounds):
        times = {"off": [], "on": [], "plain": []}
        for _ in range(args.steps):
            switch(False)
            times["off"].append(step())
            switch(True)
            times["on"].append(step())
            times["plain"].append(plain_step())
        ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        rounds.append({**ms, "on_over_off": ms["on"] / ms["off"]})
        print(f"wrapped step: off {ms['off']:.2f} ms, on {ms['on']:.2f} ms, on/off {ms['on'] / ms['off']:.3f} "
              f"(plain {ms['plain']:.2f} ms)", flush=True)
    assert plain_state["tokens"] == state["tokens"][: len(plain_state["tokens"])], "wrapped decoding diverged"
    switch(False)
    entries_off = torch_function_entries(step)
    switch(True)
    entries_on = torch_function_entries(step)
    print(f"__torch_function__ entries per step: off {sum(entries_off.values())} {dict(entries_off)}, "
          f"on {sum(entries_on.values())} {dict(entries_on)}")
    ops = op_ratios(args.op_rounds)
    save_result(args.out, args.name, "decode step with direct metadata reads and memoized transposes "
                "on / off, alternating", torch.device("cpu"), argv,
                {"steps": args.steps, "rounds": rounds,
                 "median_on_over_off": statistics.median(r["on_over_off"] for r in rounds),
                 "torch_function_entries_per_step": {"off": dict(entries_off), "on": dict(entries_on)},
                 "dispatch_ops_on_over_off": ops})


if __name__ == "__main__":
    main()
