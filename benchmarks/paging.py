"""How close paging gets to the copy bound, for a dense layer stack and for routed MoE experts.

Measured in one run, each configuration against its own bound:

- ``copy``: host->device bandwidth of one large copy from an exact-size host master (the ceiling);
- ``dense``: a stack of square bf16 linear layers, decode-shaped (few tokens), wrapped at a budget
  that keeps about half the layers resident; time per forward against resident and against
  ``max(compute, offloaded bytes / copy bandwidth)``;
- ``moe``: stacked experts, ``route`` of ``experts`` picked per step; paging only the routed experts
  against copying the whole stack.

    python benchmarks/paging.py [--device cuda|cpu] [--out DIR]

Sizes default to the H200 workload's on a GPU and to small ones on the emulated device.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import offtensor as ot  # noqa: E402
from offtensor import _ext  # noqa: E402
from offtensor.pager import GiB  # noqa: E402
from results_io import save_result  # noqa: E402


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn, device, repeats):
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(device, nbytes, repeats):
    host = _ext.alloc_host(nbytes, pin=device.type == "cuda")
    host.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    seconds = _median_time(lambda: dst.copy_(host, non_blocking=True), device, repeats)
    return {"bytes": nbytes, "seconds": seconds, "GB_per_s": nbytes / seconds / 1e9, "pinned": host.is_pinned()}


class Dense(nn.Module):
    def __init__(self, layers, hidden, dtype):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden, bias=False, dtype=dtype) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def dense(device, layers, hidden, tokens, dtype, bandwidth, repeats):
    torch.manual_seed(0)
    # Built on the device (12.9 GB of bf16 on a GPU: seconds there, minutes of CPU uniform_), then
    # wrapped: wrap_model copies the offloaded half to host masters, the resident half is shared.
    with torch.device(device):
        resident = Dense(layers, hidden, dtype).eval()
    with torch.device("meta"):
        model = Dense(layers, hidden, dtype).eval()
    model.load_state_dict(resident.state_dict(), assign=True)
    layer_bytes = hidden * hidden * torch.tensor([], dtype=dtype).element_size()
    budget = (layers // 2 + 2) * layer_bytes  # about half resident, room to page and prefetch
    ot.wrap_model(model, budget_gb=budget / GiB, device=device)
    x = torch.randn(tokens, hidden, dtype=dtype, device=device)
    with torch.no_grad():
        # A sanity check, not the test suite's bit-identity: a first CPU GEMM call may pick another kernel.
        torch.testing.assert_close(model(x), resident(x), rtol=1e-3, atol=1e-3)
        model(x)  # a pass for the prefetch schedule
        t_resident = _median_time(lambda: resident(x), device, repeats)
        ot.reset_stats(model)
        t_wrapped = _median_time(lambda: model(x), device, repeats)
    s = ot.stats(model)
    moved = s.bytes_h2d / repeats
    bound = max(t_resident, moved / (bandwidth * 1e9))
    return {"layers": layers, "hidden": hidden, "tokens": tokens, "dtype": str(dtype), "budget_bytes": budget,
            "offloaded_bytes": s.offloaded_bytes, "h2d_bytes_per_forward": moved,
            "resident_ms": t_resident * 1e3, "wrapped_ms": t_wrapped * 1e3, "bound_ms": bound * 1e3,
            "wrapped_over_bound": t_wrapped / bound, "peak_device_bytes": s.peak_device_bytes,
            "peak_pool_bytes": s.peak_pool_bytes, "max_memory_allocated": s.max_memory_allocated,
            "max_memory_reserved": s.max_memory_reserved,
            "prefetches": s.prefetches, "prefetch_hits": s.prefetch_hits}


class Experts(nn.Module):
    def __init__(self, experts, hidden, inter, dtype):
        super().__init__()
        self.w = nn.Parameter(torch.randn(experts, inter, hidden, dtype=dtype) * hidden**-0.5, requires_grad=False)


class MoE(nn.Module):
    """Only the stack: placement knows ``*.experts.*`` tensors are paged a few experts at a time."""

    def __init__(self, experts, hidden, inter, dtype):
        super().__init__()
        self.experts = Experts(experts, hidden, inter, dtype)

    def forward(self, x, routed):
        return sum(F.linear(x, self.experts.w[e]).sum() for e in routed)


def moe(device, experts, route, hidden, inter, dtype, repeats):
    torch.manual_seed(0)
    with torch.device(device):  # randn on the device; wrap_model copies the stack to its host master
        model = MoE(experts, hidden, inter, dtype)
    stack_bytes = model.experts.w.numel() * model.experts.w.element_size()
    expert_bytes = stack_bytes // experts
    budget = (route + 2) * expert_bytes
    ot.wrap_model(model, budget_gb=budget / GiB, device=device, prefetch=False)
    host_stack = model.experts.w._host
    device_stack = torch.empty(host_stack.shape, dtype=dtype, device=device)
    x = torch.randn(1, hidden, dtype=dtype, device=device)
    generator = torch.Generator().manual_seed(1)
    steps = [torch.randperm(experts, generator=generator)[:route].tolist() for _ in range(repeats)]
    with torch.no_grad():
        t_all = _median_time(lambda: device_stack.copy_(host_stack, non_blocking=True), device, repeats)
        ot.reset_stats(model)
        it = iter(steps)
        t_routed = _median_time(lambda: model(x, next(it)), device, repeats)
    s = ot.stats(model)
    return {"experts": experts, "route": route, "expert_bytes": expert_bytes, "copy_all_ms": t_all * 1e3,
            "routed_ms": t_routed * 1e3, "routed_over_copy_all": t_routed / t_all,
            "h2d_bytes_per_step": s.bytes_h2d / repeats, "peak_device_bytes": s.peak_device_bytes,
            "peak_pool_bytes": s.peak_pool_bytes, "max_memory_reserved": s.max_memory_reserved,
            "budget_bytes": budget}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    bf16 = torch.bfloat16
    results = {"copy": copy_bandwidth(device, (2 * GiB) if gpu else (256 << 20), args.repeats)}
    bandwidth = results["copy"]["GB_per_s"]
    results["dense"] = dense(device, layers=24 if gpu else 8, hidden=16384 if gpu else 1024,
                             tokens=8, dtype=bf16 if gpu else torch.float32, bandwidth=bandwidth, repeats=args.repeats)
    results["moe"] = moe(device, experts=64, route=8, hidden=4096 if gpu else 512, inter=3072 if gpu else 256,
                         dtype=bf16, repeats=args.repeats)

    c, d, m = results["copy"], results["dense"], results["moe"]
    print(f"paging on {device}")
    print(f"  host->device copy      {c['GB_per_s']:.1f} GB/s ({c['bytes'] / 1e9:.2f} GB, pinned={c['pinned']})")
    print(f"  dense {d['layers']} x {d['hidden']}^2  resident {d['resident_ms']:.2f} ms, wrapped {d['wrapped_ms']:.2f} ms, "
          f"bound {d['bound_ms']:.2f} ms -> {d['wrapped_over_bound']:.2f}x bound "
          f"({d['h2d_bytes_per_forward'] / 1e9:.3f} GB/forward)")
    print(f"  moe route {m['route']}/{m['experts']}      copy all {m['copy_all_ms']:.2f} ms, routed {m['routed_ms']:.2f} ms "
          f"-> {m['routed_over_copy_all']:.2f}x of copying every expert")
    save_result(args.out, f"paging_{device.type}.json", "paging against the copy bound", device, argv,
                {"results": results})

if __name__ == "__main__":
    main()
