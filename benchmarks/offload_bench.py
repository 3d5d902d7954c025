"""Offloaders side by side on one dense stack, in one process, interleaved: ms per step, ratio to the
PCIe bound, achieved GB/s, the replay's prediction beside the measurement, device memory.

    python benchmarks/offload_bench.py                    # GPU: the H200 workload (docs/benchmarks.md)
    python benchmarks/offload_bench.py --device cpu       # the emulated device, scaled down

Variants (every one offloads the same layers, the ones offtensor's default placement picks):

- ``resident``: every weight on the device (the compute half of the bound);
- ``vllm``: vLLM's cpu_offload: each forward copies the offloaded weights with
  ``.to(device, non_blocking=True)`` into a state dict for ``torch.func.functional_call``;
- ``uva`` (GPU): the GEMMs read the pinned host masters in place through zero-copy device views
  (decode only: at prefill every GEMM re-reads its weight over PCIe, 3.1 s a step on the H200);
- ``accelerate`` (GPU): ``accelerate.cpu_offload`` hooks on the offloaded layers;
- ``hand``: hand-written double buffering: two layer slots, copies on a side stream (the copy
  engine's worker thread on the emulated device), the tail of a step copying the head of the next;
- ``offtensor``: ``ot.wrap_model`` with prefetch, and ``offtensor-noprefetch`` (the same placement and
  pager, prefetcher switched off).

Each round runs every variant for ``--steps-per-round`` steps back to back (the first untimed, so
cross-step prefetch reaches its steady state), with a device synchronisation closing every step as
in the H200 calibration's measurements; the median over rounds is reported. The bound is max(all-resident
compute, offloaded bytes / H2D bandwidth), the H2D bandwidth measured here. Predictions replay
three recorded steps under the built-in ``h200`` profile on an H200, else a profile measured here
(on the emulated device, its compute rates scaled to this run's all-resident measurement).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import offtensor as ot  # noqa: E402
from offtensor import _ext  # noqa: E402
from offtensor.models.dense import DenseStack  # noqa: E402
from offtensor.pager import GiB, resolve_device  # noqa: E402
from offtensor.tensor import OffloadedTensor  # noqa: E402
from results_io import save_result  # noqa: E402

GPU_SIZES = dict(layers=24, hidden=8192, ffn=24576, dtype="bfloat16", offload_layers=12, prefill=4096, decode=1)
# Emulated device: a weight takes about as long to copy (a memcpy into a fresh buffer, first touch
# included) as the prefill GEMM that reads it on one core, so overlap is what prefetch can win.
CPU_SIZES = dict(layers=8, hidden=1024, ffn=4096, dtype="float32", offload_layers=4, prefill=32, decode=1)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--steps-per-round", type=int, default=3)
    p.add_argument("--variants", default=None, help="comma-separated subset")
    p.add_argument("--phases", default="prefill,decode")
    for key in ("layers", "hidden", "ffn", "offload_layers", "prefill", "decode"):
        p.add_argument("--" + key.replace("_", "-"), type=int, default=None)
    p.add_argument("--dtype", default=None)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------- the workload


class Workload:
    """One set of weights shared by every variant: the wrapped model's resident device weights and
    the pinned host masters of its offloaded ones."""

    def __init__(self, sizes, device):
        self.sizes, self.device = sizes, device
        self.cuda = device.type == "cuda"
        dtype = getattr(torch, sizes["dtype"])
        layers, hidden, ffn = sizes["layers"], sizes["hidden"], sizes["ffn"]
        torch.manual_seed(0)
        model = DenseStack(layers, hidden, ffn, dtype, device=device)
        with torch.no_grad():
            for layer in model.layers:
                # Scaled so activations stay O(1) through the stack (never time on zeros or infs).
                layer.w1.normal_(0, 1 / math.sqrt(hidden))
                layer.w2.normal_(0, 1 / math.sqrt(ffn))
        self.layer_bytes = model.layer_bytes()
        total = self.layer_bytes * layers
        # Room for two weights beside the resident ones: the one in use and the next one's copy.
        self.budget_bytes = total - sizes["offload_layers"] * self.layer_bytes + self.layer_bytes
        self.model = ot.wrap_model(model, budget_gb=self.budget_bytes / GiB, device=device)
        self.pager = self.model.layers[0].w1.pager if isinstance(self.model.layers[0].w1, OffloadedTensor) else None
        self.offloaded = [i for i, layer in enumerate(self.model.layers) if isinstance(layer.w1, OffloadedTensor)]
        if self.pager is None:
            self.pager = next(layer.w1.pager for layer in self.model.layers if isinstance(layer.w1, OffloadedTensor))
        self.prefetcher = self.pager.prefetcher
        self.offloaded_bytes = self.layer_bytes * len(self.offloaded)
        # (w1, w2) per layer: a plain device tensor, or the pinned host view of its master.
        self.weights = []
        for layer in self.model.layers:
            pair = []
            for w in (layer.w1, layer.w2):
                pair.append(w._host if isinstance(w, OffloadedTensor) else w.detach())
            self.weights.append(tuple(pair))

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)


# ---------------------------------------------------------------------------- variants


def resident_variant(wl):
    weights = [tuple(w.to(wl.device, copy=True) if i in wl.offloaded else w for w in pair)
               for i, pair in enumerate(wl.weights)]

    def step(x):
        for w1, w2 in weights:
            x = x @ w1 @ w2
        return x

    return step, wl.offloaded_bytes  # its extra device weights


def vllm_variant(wl):
    # Only the structure: functional_call substitutes every parameter. Not the wrapped model, whose
    # registration hooks would place the substituted tensors under offtensor's budget.
    s = wl.sizes
    with torch.device("meta"):
        template = DenseStack(s["layers"], s["hidden"], s["ffn"], getattr(torch, s["dtype"]))
    names = [(f"layers.{i}.w1", f"layers.{i}.w2") for i in range(len(wl.weights))]

    def step(x):
        params = {}
        for i, (pair, pair_names) in enumerate(zip(wl.weights, names)):
            for w, name in zip(pair, pair_names):
                # copy=True: on the emulated device .to("cpu") would otherwise copy nothing.
                params[name] = w.to(wl.device, non_blocking=True, copy=True) if i in wl.offloaded else w
        return torch.func.functional_call(template, params, (x,))

    return step, 0


def uva_variant(wl):
    if not wl.cuda or not all(wl.weights[i][0].is_pinned() for i in wl.offloaded):
        return None

    class _DeviceView:  # a zero-copy CUDA view of pinned host memory (__cuda_array_interface__)
        def __init__(self, t):
            self.__cuda_array_interface__ = {
                "shape": (t.numel(),), "typestr": "<i2", "data": (t.data_ptr(), False), "version": 3, "strides": None,
            }

    views = []
    for i, pair in enumerate(wl.weights):
        if i in wl.offloaded:
            views.append(tuple(torch.as_tensor(_DeviceView(w.contiguous()), device=wl.device).view(w.dtype).view(w.shape)
                               for w in pair))
        else:
            views.append(pair)

    def step(x):
        for w1, w2 in views:
            x = x @ w1 @ w2
        return x

    return step, 0


def accelerate_variant(wl):
    if not wl.cuda:
        return None  # execution on the cpu: accelerate's hooks would move nothing
    try:
        from accelerate import cpu_offload
    except ImportError:
        return None
    from offtensor.models.dense import DenseLayer

    layers = []
    for i, (w1, w2) in enumerate(wl.weights):
        with torch.device("meta"):
            layer = DenseLayer(w1.shape[0], w1.shape[1], w1.dtype)
        if i in wl.offloaded:
            layer.w1 = torch.nn.Parameter(w1, requires_grad=False)  # host tensors; accelerate keeps a CPU state dict
            layer.w2 = torch.nn.Parameter(w2, requires_grad=False)
            cpu_offload(layer, execution_device=wl.device)
        else:
            layer.w1 = torch.nn.Parameter(w1, requires_grad=False)
            layer.w2 = torch.nn.Parameter(w2, requires_grad=False)
        layers.append(layer)

    def step(x):
        for layer in layers:
            x = layer(x)
        return x

    return step, 0


def hand_variant(wl):
    """Two layer slots; layer order is a cycle, so the slot a step's last offloaded layers free
    takes the first ones of the next step."""
    order = list(wl.offloaded)
    if not order:
        return None
    first = wl.weights[order[0]]
    slots = [tuple(torch.empty_like(w, device=wl.device) for w in first) for _ in range(2)]
    freed = [None, None]  # GPU: event after the last GEMM that read each slot
    ready = {}
    state = {"next": 0}
    if wl.cuda:
        stream = torch.cuda.Stream(wl.device)
    else:
        engine = _ext.CopyEngine()

    def issue():
        index = state["next"]
        state["next"] += 1
        layer, slot = order[index % len(order)], index % 2
        host = wl.weights[layer]
        if wl.cuda:
            with torch.cuda.stream(stream):
                if freed[slot] is not None:
                    stream.wait_event(freed[slot])
                for dst, src in zip(slots[slot], host):
                    dst.copy_(src, non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
            ready[layer] = (slot, done)
        else:
            # On the emulated device compute is synchronous: a slot is free once its GEMM returned.
            ready[layer] = (slot, [engine.submit(dst.view(-1), src.reshape(-1)) for dst, src in zip(slots[slot], host)])

    def step(x):
        if not ready:
            issue()
            issue()
        for i, pair in enumerate(wl.weights):
            if i in ready:
                slot, done = ready.pop(i)
                if wl.cuda:
                    torch.cuda.current_stream(wl.device).wait_event(done)
                else:
                    for ticket in done:
                        engine.wait(ticket)
                w1, w2 = slots[slot]
                x = x @ w1 @ w2
                if wl.cuda:
                    event = torch.cuda.Event()
                    event.record(torch.cuda.current_stream(wl.device))
                    freed[slot] = event
                issue()
            else:
                x = x @ pair[0] @ pair[1]
        return x

    return step, 2 * wl.layer_bytes


def offtensor_variant(wl, prefetch):
    def step(x):
        wl.pager.prefetcher = wl.prefetcher if prefetch else None
        return wl.model(x)

    return step, 0


# ---------------------------------------------------------------------------- measuring


def time_steps(wl, step, x, n):
    """ms of each of ``n`` steps, each closed by a device synchronisation."""
    times = []
    with torch.no_grad():
        for _ in range(n):
            wl.sync()
            t0 = time.perf_counter()
            step(x)
            wl.sync()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def check_outputs(wl, variants, x):
    """Every variant computes the same function: same output as all-resident (fresh random input)."""
    with torch.no_grad():
        reference = variants["resident"][0](x).double() if "resident" in variants else None
        for name, (step, _) in variants.items():
            out = step(x).double()
            wl.sync()
            if reference is not None:
                error = ((out - reference).norm() / reference.norm()).item()
                if not error <= 1e-2:
                    raise AssertionError(f"{name}: output differs from all-resident by {error:.3g} (relative)")


def record(wl, step, x, steps):
    """A timeline of ``steps`` consecutive steps (the pager's copies included)."""
    with torch.no_grad(), ot.timeline(pagers=[wl.pager]) as tl:
        for s in range(steps):
            if s:
                tl.next_step()
            step(x)
    wl.sync()
    return tl


def main(argv=None) -> int:
    args = parse(argv)
    device = resolve_device(args.device)
    cuda = device.type == "cuda"
    sizes = dict(GPU_SIZES if cuda else CPU_SIZES)
    for key in sizes:
        value = getattr(args, key, None)
        if value is not None:
            sizes[key] = value
    if not cuda and "OMP_NUM_THREADS" not in os.environ:
        # One core computes, the other runs the copy engine's worker thread (as in tests/conftest.py).
        torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    rounds = args.rounds or (2 if cuda else 5)
    started = time.perf_counter()
    wl = Workload(sizes, device)
    dtype = getattr(torch, sizes["dtype"])
    print(f"{device}: {sizes['layers']} layers x {sizes['hidden']}x{sizes['ffn']} {sizes['dtype']}, "
          f"{len(wl.offloaded)} offloaded ({wl.offloaded_bytes / 1e9:.2f} GB): {wl.offloaded}; "
          f"setup {time.perf_counter() - started:.1f} s", flush=True)

    profile = ot.get_profile("h200") if cuda and "H200" in torch.cuda.get_device_name(device) else ot.measure_profile(device)
    h2d_gbps = ot.measure_profile(device).h2d_gbps if cuda and profile.name == "h200" else profile.h2d_gbps
    builders = {
        "resident": resident_variant,
        "vllm": vllm_variant,
        "uva": uva_variant,
        "accelerate": accelerate_variant,
        "hand": hand_variant,
        "offtensor": lambda w: offtensor_variant(w, True),
        "offtensor-noprefetch": lambda w: offtensor_variant(w, False),
    }
    wanted = args.variants.split(",") if args.variants else list(builders)
    variants = {}
    for name in wanted:
        try:
            built = builders[name](wl)
        except Exception as e:  # e.g. UVA views refused by this driver: report, and measure the others
            print(f"{name}: not available here ({type(e).__name__}: {e})")
            built = None
        if built is not None:
            variants[name] = built
    check_outputs(wl, variants, torch.randn(2, sizes["hidden"], device=device).to(dtype))
    phases = {"prefill": sizes["prefill"], "decode": sizes["decode"]}
    results = {}
    for phase in args.phases.split(","):
        tokens = phases[phase]
        x = torch.randn(tokens, sizes["hidden"], device=device).to(dtype)
        names = [n for n in variants if not (n == "uva" and phase == "prefill")]
        times = {n: [] for n in names}
        memory = {n: [] for n in names}
        per_round = {n: [] for n in names}  # each round's median, for ratios of runs adjacent in time
        for name in names:
            # Warm-up: cuBLAS handles, the allocator, and offtensor's prefetcher, which prefetches an
            # entry once it was used in three passes in a row.
            time_steps(wl, variants[name][0], x, 4 if name.startswith("offtensor") else 1)
        for _ in range(rounds):
            for name in names:
                step, _ = variants[name]
                if cuda:
                    torch.cuda.reset_peak_memory_stats(device)
                    base = torch.cuda.memory_allocated(device)
                ms = time_steps(wl, step, x, args.steps_per_round)
                times[name].extend(ms[1:])  # the first of a run re-establishes cross-step state
                per_round[name].append(statistics.median(ms[1:]))
                if cuda:
                    memory[name].append(torch.cuda.max_memory_allocated(device) - base)
        # Predictions: a recorded run of three consecutive steps, replayed.
        timelines = {name: record(wl, variants[name][0], x, 3)
                     for name in ("resident", "vllm", "offtensor", "offtensor-noprefetch") if name in names}
        phase_profile = profile
        if not cuda and "resident" in timelines:
            # Two cores shared with other jobs: a profile measured at another moment is off by
            # 2-6x. Scale its compute and memory rates so the all-resident replay equals the
            # all-resident measurement of this run (as h200's bf16 rate comes from its all-resident
            # prefill); copies keep the measured rate.
            scale = timelines["resident"].replay(profile).step_ms / statistics.median(times["resident"])
            phase_profile = dataclasses.replace(
                profile, name=f"{profile.name} x{scale:.2f}", tflops={k: v * scale for k, v in profile.tflops.items()},
                hbm_gbps=profile.hbm_gbps * scale, launch_us=profile.launch_us / scale)
        predictions = {name: tl.replay(phase_profile) for name, tl in timelines.items()}
        compute_ms = predictions["resident"].compute_ms if "resident" in predictions else None
        resident_ms = statistics.median(times["resident"]) if "resident" in times else None
        copy_ms = wl.offloaded_bytes / (h2d_gbps * 1e9) * 1e3
        bound = max(resident_ms or 0.0, copy_ms)
        rows = {}
        for name in names:
            ms = statistics.median(times[name])
            moved = 0 if name == "resident" else wl.offloaded_bytes
            pred = predictions.get(name)
            rows[name] = {
                "ms_per_step": ms,
                "all_ms": times[name],
                "ratio_to_bound": ms / bound,
                "achieved_h2d_gbps": moved / ms / 1e6 if moved else 0.0,
                "predicted_ms": pred.step_ms if pred else None,
                "measured_over_predicted": ms / pred.step_ms if pred else None,
                "extra_device_weight_bytes": variants[name][1],
                "peak_extra_device_bytes": max(memory[name]) if memory[name] else None,
            }
        results[phase] = {
            "tokens": tokens, "bound_ms": bound, "copy_bound_ms": copy_ms, "resident_ms": resident_ms,
            "predicted_compute_ms": compute_ms, "replay_profile": dataclasses.asdict(phase_profile), "variants": rows,
        }
        print(f"\n{phase} ({tokens} tokens): bound {bound:.1f} ms (copy {copy_ms:.1f} at {h2d_gbps:.1f} GB/s, "
              f"all-resident {resident_ms:.1f})")
        print("| variant | ms/step | x bound | GB/s | predicted ms | measured/predicted | peak extra MB |")
        print("|---|---|---|---|---|---|---|")
        for name, row in rows.items():
            pred = f"{row['predicted_ms']:.1f}" if row["predicted_ms"] else "-"
            ratio = f"{row['measured_over_predicted']:.2f}" if row["measured_over_predicted"] else "-"
            peak = f"{row['peak_extra_device_bytes'] / 1e6:.0f}" if row["peak_extra_device_bytes"] is not None else "-"
            print(f"| {name} | {row['ms_per_step']:.1f} | {row['ratio_to_bound']:.3f} | "
                  f"{row['achieved_h2d_gbps']:.1f} | {pred} | {ratio} | {peak} |", flush=True)
        if "offtensor" in rows and "offtensor-noprefetch" in rows:
            # The two run one after the other in every round: the median of the rounds' ratios
            # holds when the machine's load changes between rounds (the emulated device shares
            # two cores with other jobs), where a ratio of overall medians does not.
            ratios = [a / b for a, b in zip(per_round["offtensor"], per_round["offtensor-noprefetch"])]
            results[phase]["prefetch_on_over_off"] = statistics.median(ratios)
            results[phase]["prefetch_on_over_off_per_round"] = ratios
            print(f"offtensor prefetch on / off: {statistics.median(ratios):.3f} (median of rounds; each round: "
                  f"{', '.join(f'{r:.2f}' for r in ratios)})")

    reserved = torch.cuda.max_memory_reserved(device) if cuda else None
    body = {
        "sizes": sizes, "budget_bytes": wl.budget_bytes, "offloaded_layers": wl.offloaded,
        "offloaded_bytes": wl.offloaded_bytes, "h2d_gbps": h2d_gbps, "profile": profile.__dict__,
        "rounds": rounds, "steps_per_round": args.steps_per_round, "max_reserved_bytes": reserved,
        "phases": results, "seconds": time.perf_counter() - started,
    }
    suffix = "gpu" if cuda else "cpu"
    save_result(args.out, f"offload_bench_{suffix}.json", "offload_bench", device, argv, body)
    plot(results, os.path.join(args.out, f"offload_bench_{suffix}.png"), f"{device}: {sizes}")
    print(f"done in {time.perf_counter() - started:.1f} s")
    return 0


def plot(results, path, title):
    from offtensor._optional import pyplot

    plt = pyplot()
    if plt is None:  # no matplotlib: warned once, the PNG is skipped
        return None

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 3.6), squeeze=False)
    for ax, (phase, res) in zip(axes[0], results.items()):
        names = list(res["variants"])
        measured = [res["variants"][n]["ms_per_step"] for n in names]
        predicted = [res["variants"][n]["predicted_ms"] or 0 for n in names]
        ys = range(len(names))
        ax.barh([y + 0.2 for y in ys], measured, height=0.4, label="measured", color="#4477aa")
        ax.barh([y - 0.2 for y in ys], predicted, height=0.4, label="replay", color="#ee7733")
        ax.axvline(res["bound_ms"], color="green", label="bound")
        ax.set_yticks(list(ys))
        ax.set_yticklabels(names)
        ax.set_xscale("log")
        ax.set_xlabel("ms per step")
        ax.set_title(f"{phase}, {res['tokens']} tokens", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
