"""Per-op overhead of OffloadedTensor, in microseconds, against plain tensors and against a minimal
pass-through wrapper subclass (the floor that any Python ``__torch_dispatch__`` pays).

Tensors are tiny so that the numbers are dispatch overhead, not copies. Every configuration is
measured in the same run, interleaved, and the median of several repetitions is reported, so
ratios are meaningful on a shared, noisy machine.

One more row, ``F.linear, 2 weights in turn``, times an op on each of two weights in turn (per op):
beside the subjects above, ``offloaded (page-in)`` runs under a budget that holds one copy, so every
op pages in (evicting the other weight's copy and reusing its device range): the host cost of a page.

    python benchmarks/dispatch.py [--device cpu|cuda] [--iters 2000] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import offtensor as ot  # noqa: E402
from offtensor.pager import Pager  # noqa: E402
from results_io import save_result  # noqa: E402


class PassThrough(torch.Tensor):
    """The smallest useful wrapper subclass: unwrap, run, return plain results."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(), dtype=inner.dtype,
                                                   device=inner.device)

    def __init__(self, inner):
        self.inner = inner

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        args = tuple(a.inner if isinstance(a, PassThrough) else a for a in args)
        return func(*args, **(kwargs or {}))


def _ops(device):
    x = torch.randn(16, 16, device=device)
    idx = torch.tensor([1, 3, 5], device=device)
    return {
        "t (view)": lambda w: w.t(),
        "view": lambda w: w.view(256),
        "detach": lambda w: w.detach(),
        "add (compute)": lambda w: w + 1,
        "F.linear": lambda w: F.linear(x, w),
        "x @ w.t()": lambda w: x @ w.t(),
        "select row [3]": lambda w: w[3],
        "embedding": lambda w: F.embedding(idx, w),
        "sum": lambda w: w.sum(),
        # what model code reads of a weight at every call (transformers' expert code: a stack's
        # dtype, device, dim() and size(i), and its transpose(-2, -1))
        "w.dtype": lambda w: w.dtype,
        "w.shape": lambda w: w.shape,
        "w.device": lambda w: w.device,
        "w.dim()": lambda w: w.dim(),
        "w.size(-1)": lambda w: w.size(-1),
        "w.is_contiguous()": lambda w: w.is_contiguous(),
        "w.requires_grad": lambda w: w.requires_grad,
        "transpose(-2,-1)": lambda w: w.transpose(-2, -1),
    }


def _time(fn, arg, iters, sync):
    fn(arg)
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn(arg)
    sync()
    return (time.perf_counter() - start) / iters * 1e6


def _page_in_row(device, iters, repeats, sync) -> dict:
    """Per-op time of ``F.linear`` on two 16x16 weights in turn, for each subject and for a pager whose
    budget holds one copy (every op a page-in: an eviction, a device range reused, a copy)."""
    x = torch.randn(16, 16, device=device)
    bases = [torch.randn(16, 16), torch.randn(16, 16)]
    one_copy = bases[0].numel() * bases[0].element_size()
    pairs = {
        "plain": [b.to(device) for b in bases],
        "passthrough": [PassThrough(b.to(device)) for b in bases],
        "offloaded (cache hit)": [ot.offload(b, pager=Pager(device, budget_bytes=1 << 20)) for b in bases],
        "offloaded (no cache)": [ot.offload(b, device) for b in bases],
    }
    paging = Pager(device, budget_bytes=one_copy)
    pairs["offloaded (page-in)"] = [ot.offload(b, pager=paging) for b in bases]

    def both(pair):
        F.linear(x, pair[0])
        F.linear(x, pair[1])

    samples = {name: [] for name in pairs}
    with torch.no_grad():
        for _ in range(repeats):
            for name, pair in pairs.items():
                samples[name].append(_time(both, pair, iters, sync) / 2)
    assert paging.snapshot().hits == 0, "the page-in subject must page in on every op"
    return {name: statistics.median(v) for name, v in samples.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    base = torch.randn(16, 16)
    plain = base.to(device)
    passthrough = PassThrough(plain)
    uncached = ot.offload(base, device)
    cached_pager = Pager(device, budget_bytes=1 << 20)
    cached = ot.offload(base, pager=cached_pager)
    subjects = {"plain": plain, "passthrough": passthrough, "offloaded (cache hit)": cached,
                "offloaded (no cache)": uncached}

    results = {}
    with torch.no_grad():
        for op_name, fn in _ops(device).items():
            samples = {name: [] for name in subjects}
            for _ in range(args.repeats):
                for name, subject in subjects.items():  # interleaved: drift hits all alike
                    samples[name].append(_time(fn, subject, args.iters, sync))
            results[op_name] = {name: statistics.median(v) for name, v in samples.items()}

    results["F.linear, 2 weights in turn"] = _page_in_row(device, args.iters, args.repeats, sync)

    header = f"{'op':<16}" + "".join(f"{name:>24}" for name in subjects) + f"{'cached/passthrough':>20}"
    print(f"per-op time in microseconds on {device} (median of {args.repeats} x {args.iters} iterations)")
    print(header)
    for op_name, row in results.items():
        ratio = row["offloaded (cache hit)"] / row["passthrough"]
        print(f"{op_name:<16}" + "".join(f"{row[name]:>24.2f}" for name in subjects) + f"{ratio:>20.2f}")
    page_in = results["F.linear, 2 weights in turn"]["offloaded (page-in)"]
    print(f"F.linear, 2 weights in turn, offloaded (page-in): {page_in:.2f} us per op")

    save_result(args.out, f"dispatch_{device.type}.json", "dispatch overhead per op (us)", device, argv,
                {"iters": args.iters, "repeats": args.repeats, "us_per_op": results})
    return results


if __name__ == "__main__":
    main()
