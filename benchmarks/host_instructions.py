"""offtensor's host work on an MoE decode counted in instructions, not timed.

This project's CPU machine is shared: its wall clock has swung two- to threefold between days and
by a fifth between two runs of the same code minutes apart, so a change of a few percent in the
pager's or the expert policy's host time cannot be read off a timed run. Instructions executed do
not depend on the machine's load: this runs ``moe_policy_scale.py``'s synthetic decode (256
experts, top-8, a quarter of them cached, tiny experts: host work only) through the pager and the
expert policy under valgrind's callgrind, counting from the first decode step to the last (the
model's build, its wrap and the prefill are not counted), and reports instructions per decode
step. Two runs of the same code agree within half a percent (the copy thread's timing and object
addresses still vary), where timed runs differ by a fifth. All of the process's instructions in that
span are counted: offtensor's Python, the interpreter, torch's ops on the tiny tensors and the
emulated device's copy thread. It counts work, not time (a cache miss costs no more than a hit),
and runs some 30 times slower than a timed run.

    python benchmarks/host_instructions.py [--layers 6 58] [--models qwen3 ...] [--steps 12] [--warm 0] [--baseline PATH]

``--models``: besides, the decode of trained test models (``moe_sim.py``'s trace of held-out text,
their committed look-ahead and token table), keyed by name beside the depths. ``--warm``: decode
steps run uncounted before the counted ones; the synthetic decode's cache fills in its first dozen
steps, so without them no victim search is counted there.

``--baseline``: another checkout (its offtensor and benchmarks/), counted on the same decode beside
this one, with this one's count over the baseline's per setting. Needs ``valgrind`` on the PATH.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))


def count(tree: str, layers: int, steps: int, speculate: bool, fraction: float, warm: int = 0) -> int:
    """Instructions of the decode steps of one replay (a child process under callgrind)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={tmp}/callgrind.out",
             sys.executable, os.path.abspath(__file__), "--child", tree, str(layers), str(steps),
             str(int(speculate)), str(fraction), str(warm)],
            capture_output=True, text=True, check=False,
            env=dict(os.environ, PYTHONHASHSEED="0"))  # (str hashes order dicts and sets: one order every run)
    found = re.search(r"Collected : (\d+)", out.stderr)
    if out.returncode != 0 or found is None:
        raise RuntimeError(f"offtensor: the callgrind run of {layers} layers failed (exit {out.returncode}):\n"
                           + out.stderr[-3000:])
    return int(found.group(1))


def trained_trace(name: str, steps: int) -> dict:
    """``moe_sim.py``'s decode trace of the trained model ``name`` (its committed look-ahead and
    token table), 32 tokens of prefix and ``steps`` decode steps of held-out text."""
    import moe_sim

    model = moe_sim.load_model(name)
    ids = moe_sim.heldout_ids(0, 32 + steps + 1)
    return moe_sim.record_trace(model, ids, 32, steps, moe_sim.lookahead_of(name, model, False))


def child(tree: str, layers: str, steps: int, speculate: bool, fraction: float, warm: int = 0) -> None:
    """Under callgrind: build, wrap, prefill and ``warm`` decode steps uncounted, then count the
    decode steps (``layers``: the synthetic decode's depth, or a trained model's name)."""
    sys.path[:0] = [tree, os.path.join(tree, "benchmarks")]
    import torch

    import offtensor as ot
    from moe_policy_scale import synthetic_trace
    from moe_replay import EXPERTS_PAGED, ReplayModel, _as_installed, budget_gb

    torch.set_num_threads(1)
    trace = synthetic_trace(int(layers), warm + steps) if layers.isdigit() else trained_trace(layers, warm + steps)
    torch.manual_seed(0)
    model = ReplayModel(trace)
    ot.wrap_model(model, budget_gb=budget_gb(model, fraction), device="cpu", prefetch=speculate, policy=EXPERTS_PAGED)
    _as_installed(model, trace)
    toggle = ["callgrind_control", "-i"]
    with torch.no_grad():
        for step in trace["steps"][:1 + warm]:
            model(step)
        subprocess.run(toggle + ["on", str(os.getpid())], check=True, capture_output=True)
        for step in trace["steps"][1 + warm:]:
            model(step)
        subprocess.run(toggle + ["off", str(os.getpid())], check=True, capture_output=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", nargs="*", type=int, default=[6, 58])
    p.add_argument("--models", nargs="*", default=[], help="trained models (moe_sim.py's) counted besides")
    p.add_argument("--steps", type=int, default=12, help="decode steps counted")
    p.add_argument("--warm", type=int, default=0,
                   help="decode steps run uncounted after the prefill and before them (the synthetic decode's "
                        "cache fills in its first dozen steps: no victim search runs before)")
    p.add_argument("--fraction", type=float, default=0.25)
    p.add_argument("--baseline", default=None, help="another checkout, counted beside this one")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--name", default="host_instructions_cpu.json", help="the result's file name in --out")
    p.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        tree, layers, steps, speculate, fraction, warm = args.child
        return child(tree, layers, int(steps), speculate == "1", float(fraction), int(warm))
    if shutil.which("valgrind") is None:
        raise SystemExit("offtensor: host_instructions.py needs valgrind (callgrind) on the PATH")
    import torch

    sys.path.insert(0, HERE)
    from results_io import save_result

    trees = {"this": os.path.dirname(HERE)}
    if args.baseline:
        trees["baseline"] = os.path.abspath(args.baseline)
    body = {"experts": 256, "top_k": 8, "fraction_cached": args.fraction, "decode_steps": args.steps,
            "warm_steps": args.warm, "layers": {}}
    for layers in [str(n) for n in args.layers] + args.models:
        row = {}
        for label, speculate in (("cache_alone", False), ("default", True)):
            with ThreadPoolExecutor(len(trees)) as pool:  # one process per checkout, side by side
                counts = dict(zip(trees, pool.map(lambda t: count(t, layers, args.steps, speculate, args.fraction, args.warm),
                                                  trees.values())))
            row[label] = {f"{name}_per_step": n / args.steps for name, n in counts.items()}
            line = f"{layers + ' layers' if layers.isdigit() else layers}, {label}: {counts['this'] / args.steps / 1e6:.2f} M instructions a decode step"
            if "baseline" in counts:
                row[label]["this_over_baseline"] = counts["this"] / counts["baseline"]
                line += f" (the baseline's {counts['baseline'] / args.steps / 1e6:.2f} M: x{counts['this'] / counts['baseline']:.3f})"
            print(line, flush=True)
        body["layers"][layers] = row
    save_result(args.out, args.name, "host instructions of an MoE decode (callgrind)", torch.device("cpu"), argv, body)


if __name__ == "__main__":
    main()
