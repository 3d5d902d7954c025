"""Does a plan's host lane predict a host-bound step? Two models whose steps copy nothing, so that
what a step costs is offtensor's own host work per op (the profile's ``host_us``) beside tiny ops:

- ``plain``: 128 one-token linears over 16 x 16 weights, every one offloaded and cached (a hit a
  op: ``host_us["page"]``), the op ``measure_host_us`` calibrates on;
- ``pooled``: 48 MoE layers of two one-token grouped GEMMs over tiny expert stacks, all held by an
  expert pool (``host_us["pool"]`` a GEMM, measured on an admit and its reuse, as an MoE layer
  makes them).

Each is planned on the meta device under the emulated device's measured profile, then wrapped and
run on the emulated device. Calibration (``measure_launch_us``, ``measure_host_us``) and measured
steps alternate, and each side takes its fastest run: a shared machine's load only ever adds time.
The prediction is the plan's replay under the profile so calibrated. It is a wall-clock
comparison, so it lives here rather than in the tests (tests/test_calibration.py checks what the
plan charges, exactly): on a shared 2-core machine the other side's load can move one side.

    python benchmarks/plan_calibration.py [--tries 3] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import offtensor as ot  # noqa: E402
from offtensor.sim.profiles import measure_host_us, measure_launch_us  # noqa: E402

from results_io import save_result  # noqa: E402


class ManySmallOps(nn.Module):
    """A host-bound model: ``n`` one-token linears over tiny weights, one after another. The
    weights are read from the parameter table directly: a module call per op would be host time no
    plan models."""

    def __init__(self, n: int, width: int):
        super().__init__()
        self.names = [f"w{i}" for i in range(n)]
        for name in self.names:
            self.register_parameter(name, nn.Parameter(torch.randn(width, width) / 4, requires_grad=False))

    def forward(self, x):
        params = self._parameters
        for name in self.names:
            x = F.linear(x, params[name])
        return x


class ManyPooledLayers(nn.Module):
    """A host-bound MoE: ``n`` layers of two one-token grouped GEMMs over tiny routed-expert stacks
    (``layers.i.experts.up`` / ``down``), one routing per layer (the second GEMM reuses the first's
    admit, as gate_up and down do)."""

    def __init__(self, n: int, width: int, experts: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(nn.Module() for _ in range(n))
        for layer in self.layers:
            layer.experts = nn.Module()
            for name in ("up", "down"):
                layer.experts.register_parameter(name, nn.Parameter(torch.randn(experts, width, width) / 4,
                                                                    requires_grad=False))
        self.register_buffer("offs", torch.ones(experts, dtype=torch.int32))  # the token to expert 0
        self.tables = [layer.experts._parameters for layer in self.layers]

    def forward(self, x):
        offs = self._buffers["offs"]
        for params in self.tables:
            x = torch._grouped_mm(x, params["up"].transpose(-2, -1), offs)
            x = torch._grouped_mm(x, params["down"].transpose(-2, -1), offs)
        return x


PLAIN = dict(n=128, width=16)  # one token through a 16 x 16 weight: the op measure_host_us times
POOLED = dict(n=48, width=16)


def plain_setup(profile, n: int = PLAIN["n"], width: int = PLAIN["width"]):
    """(the plan, the wrap's keywords, the model class and its arguments) of the plain model."""
    budget = 4 * n * width * width * 4 / 2**30
    with torch.device("meta"):
        meta = ManySmallOps(n, width)
    kwargs = dict(budget_gb=budget, device="cpu", prefetch=False, policy=["*"])
    tl = ot.plan(meta, budget_gb=budget, example_inputs=(torch.empty(1, width, device="meta"),), profile=profile,
                 policy=["*"], prefetch=False)
    return tl, kwargs, ManySmallOps, (n, width)


def pooled_setup(profile, n: int = POOLED["n"], width: int = POOLED["width"]):
    """As plain_setup, for the pooled MoE (the plan routes as the model does)."""
    budget = 8 * 2 * n * width * width * 4 / 2**30
    with torch.device("meta"):
        meta = ManyPooledLayers(n, width)
    kwargs = dict(budget_gb=budget, device="cpu", prefetch=False, policy=["*experts*"], expert_pool=True)
    with ot.ops.planned_routing(lambda experts, rows: [rows] * experts):
        tl = ot.plan(meta, budget_gb=budget, example_inputs=(torch.empty(1, width, device="meta"),), profile=profile,
                     policy=kwargs["policy"], prefetch=False, expert_pool=True)
    return tl, kwargs, ManyPooledLayers, (n, width)


def predicted_and_measured(model, x, base, tl, rounds: int = 5):
    """Calibration and measured steps alternating (both see the same machine), the fastest of each."""
    launch, host, steps = [], [], []
    with torch.no_grad():
        for _ in range(rounds):
            launch.append(measure_launch_us("cpu", 200, 10))
            host.append(measure_host_us("cpu", dataclasses.replace(base, launch_us=launch[-1]), iters=200, repeats=10))
            for _ in range(20):  # one step (about 1 ms) a run, as long as a calibration run
                start = time.perf_counter()
                model(x)
                steps.append((time.perf_counter() - start) * 1e3)
    fastest = min(range(len(launch)), key=lambda i: launch[i] + host[i]["page"])
    profile = dataclasses.replace(base, launch_us=launch[fastest], host_us=host[fastest])
    return tl.replay(profile).step_ms, min(steps), profile


def run(setup, tries: int) -> dict:
    base = ot.measure_profile("cpu")
    tl, kwargs, cls, args = setup(base)
    torch.manual_seed(0)
    model = ot.wrap_model(cls(*args), **kwargs)
    x = torch.randn(1, args[1])
    with torch.no_grad():
        for _ in range(3):
            model(x)
    copied = ot.stats(model).bytes_h2d
    rows = []
    for _ in range(tries):
        predicted, measured, profile = predicted_and_measured(model, x, base, tl)
        rows.append(dict(predicted_ms=round(predicted, 4), measured_ms=round(measured, 4),
                         error=round(predicted / measured - 1, 4), host_us=profile.host_us, launch_us=profile.launch_us,
                         bound_by=tl.replay(profile).bound_by))
        print(f"  predicted {predicted:.3f} ms, measured {measured:.3f} ms ({predicted / measured - 1:+.1%}, "
              f"{rows[-1]['bound_by']}-bound)", flush=True)
    return dict(tries=rows, copy_free=ot.stats(model).bytes_h2d == copied,
                best_error=min((abs(r["error"]) for r in rows)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tries", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--name", default="plan_calibration_cpu.json")
    args = parser.parse_args(argv)
    body = {}
    for name, setup, shape in (("plain", plain_setup, PLAIN), ("pooled", pooled_setup, POOLED)):
        print(f"{name} ({shape['n']} {'linears' if name == 'plain' else 'layers'} of width {shape['width']}):", flush=True)
        body[name] = dict(shape=shape, **run(setup, args.tries))
    save_result(args.out, args.name, "plan_calibration", torch.device("cpu"), argv, body)


if __name__ == "__main__":
    main()
