"""Loading a sharded transformers checkpoint into a meta-built model, four ways, each in its own
process so that its peak RSS is its own:

- ``offtensor``: ``ot.load_safetensors`` (file -> exact-size host masters / device, then the budget);
- ``load_state_dict``: the usual way, ``safetensors.torch.load_file`` per shard +
  ``model.load_state_dict(sd, assign=True)``, everything on the device;
- ``load_file+wrap_model``: the same, then ``ot.wrap_model`` for the budget;
- ``pin_memory``: ``load_file`` + ``tensor.pin_memory()`` per tensor (GPU only: without a GPU torch
  cannot pin, and the row says so);
- ``preadv_floor``, for scale, no model: each shard read with ``os.preadv`` on 4 threads into fresh
  ``torch.empty`` memory, i.e. what any load into new anonymous memory costs on this machine
  (first faults included), which the usual way avoids by keeping the file's page-cache mapping.

Each child process imports, builds the model on meta (``accelerate.init_empty_weights``), resets
its peak RSS (``/proc/self/clear_refs``), then loads and runs one forward. Reported per variant:
load GB/s (checkpoint bytes / load seconds), seconds to the first forward's logits, and peak RSS
above the pre-load RSS as a multiple of the checkpoint's bytes (with the emulated device's own
bytes, ``stats.peak_device_bytes``, beside it: on the emulated device those are CPU memory too).
Variants run interleaved, ``--repeats`` rounds, medians reported; the page cache is warmed first,
so every variant reads from memory. On a GPU the child also measures pinning GB/s: offtensor's
``pin_host`` of a filled allocation, ``alloc_host(pin=True)`` and torch's ``pin_memory()``.

Requirements checked: logits identical to the usual way; offtensor's time to the first
forward <= 2x the usual way's; offtensor's peak RSS <= 1.25x checkpoint + device bytes.

    python benchmarks/load_bench.py [--device cpu|cuda] [--repeats 3] [--budget-fraction 0.3]
                                    [--layers 7] [--hidden 1024] [--shard-mb 200] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

VARIANTS = ["offtensor", "load_state_dict", "load_file+wrap_model", "pin_memory", "preadv_floor"]
MAX_TIME_RATIO = 2.0
MAX_RSS_RATIO = 1.25
GiB = 1 << 30


# ---------------------------------------------------------------------------- child side


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak_rss() -> None:
    # Writing 5 resets VmHWM to the current RSS (Linux >= 4.0), so the peak is this load's alone.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _shards(ckpt):
    return sorted(os.path.join(ckpt, f) for f in os.listdir(ckpt) if f.endswith(".safetensors"))


def _pinning(device, nbytes):
    """GB/s of three ways to get nbytes of pinned, filled host memory (GPU only)."""
    import torch
    from offtensor import _ext

    out = {}
    raw = _ext.alloc_host(nbytes, pin=False, touch=False)
    raw.fill_(1)  # filled as a load fills it
    t = time.perf_counter()
    pinned = _ext.pin_host(raw)
    out["offtensor_pin_host_after_fill_gbps"] = nbytes / (time.perf_counter() - t) / 1e9 if pinned else None
    del raw
    t = time.perf_counter()
    raw = _ext.alloc_host(nbytes, pin=True)
    out["offtensor_alloc_host_pinned_gbps"] = nbytes / (time.perf_counter() - t) / 1e9
    del raw
    src = torch.ones(nbytes, dtype=torch.uint8)
    t = time.perf_counter()
    src.pin_memory()
    out["torch_pin_memory_gbps"] = nbytes / (time.perf_counter() - t) / 1e9
    return out


def _preadv_floor(ckpt, ckpt_bytes) -> dict:
    import torch
    from concurrent.futures import ThreadPoolExecutor

    chunk = 32 << 20
    base_kb = _status_kb("VmRSS")
    _reset_peak_rss()
    start = time.perf_counter()
    buffers = []
    with ThreadPoolExecutor(4) as pool:
        for shard in _shards(ckpt):
            n = os.path.getsize(shard)
            buf = torch.empty(n, dtype=torch.uint8)
            buffers.append(buf)
            view = memoryview(buf.numpy())
            fd = os.open(shard, os.O_RDONLY)

            def read(lo, fd=fd, view=view, n=n):
                done, hi = lo, min(lo + chunk, n)
                while done < hi:
                    done += os.preadv(fd, [view[done:hi]], done)

            list(pool.map(read, range(0, n, chunk)))
            os.close(fd)
    seconds = time.perf_counter() - start
    peak_kb = _status_kb("VmHWM")
    return {"variant": "preadv_floor", "checkpoint_bytes": ckpt_bytes, "load_s": seconds,
            "load_gbps": ckpt_bytes / seconds / 1e9, "first_forward_s": None, "forward_s": None,
            "peak_rss_over_start_bytes": (peak_kb - base_kb) * 1024,
            "peak_rss_over_checkpoint": (peak_kb - base_kb) * 1024 / ckpt_bytes,
            "load_peak_rss_over_checkpoint": (peak_kb - base_kb) * 1024 / ckpt_bytes,
            "device_peak_bytes": None, "budget_bytes": None, "no_logits": True}


def child(args) -> dict:
    import torch

    if "OMP_NUM_THREADS" not in os.environ:
        # As in the tests: leave a core for the emulated device's copy worker, in every variant alike.
        torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    import transformers
    from accelerate import init_empty_weights
    from safetensors.torch import load_file

    import offtensor as ot
    from offtensor.model.copies import is_wrapped

    device = torch.device(args.device)
    config = transformers.AutoConfig.from_pretrained(args.ckpt)
    ckpt_bytes = sum(os.path.getsize(f) for f in _shards(args.ckpt))
    budget_gb = args.budget_fraction * ckpt_bytes / GiB
    ids = torch.randint(0, config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    if args.variant == "pin_memory" and device.type != "cuda":
        return {"variant": args.variant, "skipped": "tensor.pin_memory() needs a GPU; none on this machine"}

    if args.variant == "preadv_floor":
        return _preadv_floor(args.ckpt, ckpt_bytes)
    with init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    base_kb = _status_kb("VmRSS")
    _reset_peak_rss()
    start = time.perf_counter()
    if args.variant == "offtensor":
        ot.load_safetensors(model, args.ckpt, budget_gb=budget_gb, device=device, progress=False)
    else:
        state = {}
        for shard in _shards(args.ckpt):
            part = load_file(shard)
            if args.variant == "pin_memory":
                part = {k: v.pin_memory() for k, v in part.items()}
            state.update(part)
        if args.variant == "load_state_dict":
            state = {k: v.to(device) for k, v in state.items()}
        # wrap_model takes the CPU tensors: it copies what stays resident to the device itself.
        model.load_state_dict(state, assign=True, strict=True)
        del state, part
        if args.variant == "load_file+wrap_model":
            ot.wrap_model(model, budget_gb=budget_gb, device=device)
        else:
            model.to(device)  # buffers made at init (rotary frequencies) too; loaded weights are there already
        model.tie_weights()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    loaded = time.perf_counter()
    load_peak_kb = _status_kb("VmHWM")  # the load's own peak, before the forward pages anything
    with torch.no_grad():
        logits = model(input_ids=ids.to(device)).logits.float().cpu()
    done = time.perf_counter()
    peak_kb = _status_kb("VmHWM")
    wrapped = is_wrapped(model)
    device_bytes = ot.stats(model).peak_device_bytes if wrapped else None
    torch.save(logits, args.logits)
    result = {
        "variant": args.variant,
        "checkpoint_bytes": ckpt_bytes,
        "load_s": loaded - start,
        "load_gbps": ckpt_bytes / (loaded - start) / 1e9,
        "first_forward_s": done - start,
        "forward_s": done - loaded,
        "peak_rss_over_start_bytes": (peak_kb - base_kb) * 1024,
        "peak_rss_over_checkpoint": (peak_kb - base_kb) * 1024 / ckpt_bytes,
        "load_peak_rss_over_checkpoint": (load_peak_kb - base_kb) * 1024 / ckpt_bytes,
        "device_peak_bytes": device_bytes,
        "budget_bytes": int(budget_gb * GiB) if wrapped else None,
    }
    if device.type == "cuda" and args.variant == "offtensor":
        del model
        result["pinning"] = _pinning(device, 2 * GiB)
    return result


# ---------------------------------------------------------------------------- parent side


def build_checkpoint(args) -> str:
    """A random Llama saved by transformers in shards (built once, reused)."""
    ckpt = args.ckpt or os.path.join(tempfile.gettempdir(), f"offtensor_load_bench_llama_{args.layers}x{args.hidden}")
    if os.path.exists(os.path.join(ckpt, "config.json")):
        return ckpt
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.75),
        num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=16,
        max_position_embeddings=512, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(ckpt, max_shard_size=f"{args.shard_mb}MB")
    return ckpt


def _warm_page_cache(ckpt) -> None:
    for f in _shards(ckpt):
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass


def _run_child(args, variant, logits_path) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--ckpt", args.ckpt,
           "--device", args.device, "--budget-fraction", str(args.budget_fraction), "--logits", logits_path]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _plot(rows, path, title, device_limit=None) -> bool:
    from offtensor._optional import pyplot

    plt = pyplot()
    if plt is None:  # no matplotlib: warned once, the PNG is skipped
        return False

    rows = [r for r in rows if "skipped" not in r]
    names = [r["variant"] for r in rows]
    # The floor has no forward: its bar is left out of that panel (drawn as 0 with the name kept).
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    # load_file only maps the file (its bytes are read by the forward), so its "load GB/s" is not
    # comparable: the middle panel is checkpoint bytes / seconds to the first forward's logits.
    values = {
        "first_forward_s": [r["first_forward_s"] or 0 for r in rows],
        "gbps": [r["checkpoint_bytes"] / 1e9 / (r["first_forward_s"] or r["load_s"]) for r in rows],
        "rss": [r["peak_rss_over_checkpoint"] for r in rows],
    }
    panels = [("first_forward_s", "seconds to first forward"),
              ("gbps", "checkpoint GB / s to first forward\n(preadv_floor: to loaded)"),
              ("rss", "peak RSS / checkpoint bytes")]
    for ax, (key, label) in zip(axes, panels):
        ax.bar(names, values[key], color=["tab:green" if n == "offtensor" else "tab:gray" for n in names])
        ax.set_title(label, fontsize=10)
        ax.tick_params(axis="x", rotation=20)
        if key == "rss":
            ax.axhline(MAX_RSS_RATIO, color="tab:red", linestyle="--", linewidth=1, label=f"{MAX_RSS_RATIO}x")
            if device_limit is not None:
                ax.axhline(device_limit, color="tab:orange", linestyle=":", linewidth=1,
                           label=f"{MAX_RSS_RATIO}x + emulated device bytes")
            ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget-fraction", type=float, default=0.3)
    p.add_argument("--layers", type=int, default=7)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--shard-mb", type=int, default=200)
    p.add_argument("--ckpt", default=None, help="checkpoint directory (built here when missing)")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--logits", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        args.variant = args.child
        print(json.dumps(child(args)))
        return 0

    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.ckpt = build_checkpoint(args)
    _warm_page_cache(args.ckpt)
    runs = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        logits = {v: os.path.join(tmp, f"{v}.pt") for v in VARIANTS}
        for r in range(args.repeats):
            for v in VARIANTS:
                row = _run_child(args, v, logits[v])
                runs[v].append(row)
                if "skipped" not in row:
                    forward = f"{row['first_forward_s']:.3f} s" if row["first_forward_s"] is not None else "-"
                    print(f"round {r} {v:22s} load {row['load_s']:.3f} s  first forward {forward}"
                          f"  peak RSS {row['peak_rss_over_checkpoint']:.2f}x", flush=True)
        reference = torch.load(logits["load_state_dict"])
        identical = {v: bool(torch.equal(torch.load(logits[v]), reference)) for v in VARIANTS
                     if "skipped" not in runs[v][0] and "no_logits" not in runs[v][0]}

    rows = []
    for v in VARIANTS:
        if "skipped" in runs[v][0]:
            rows.append(runs[v][0])
            continue
        row = {k: runs[v][0][k] for k in ("variant", "checkpoint_bytes", "budget_bytes")}
        for key in ("load_s", "load_gbps", "first_forward_s", "forward_s", "peak_rss_over_start_bytes",
                    "peak_rss_over_checkpoint", "load_peak_rss_over_checkpoint"):
            values = [x[key] for x in runs[v] if x[key] is not None]
            row[key] = statistics.median(values) if values else None
        device_peaks = [x["device_peak_bytes"] for x in runs[v] if x["device_peak_bytes"] is not None]
        row["device_peak_bytes"] = max(device_peaks) if device_peaks else None
        row["logits_identical_to_load_state_dict"] = identical.get(v)
        row["runs"] = runs[v]
        if "pinning" in runs[v][0]:
            row["pinning"] = {k: statistics.median(x["pinning"][k] for x in runs[v] if x["pinning"][k] is not None)
                              for k in runs[v][0]["pinning"] if runs[v][0]["pinning"][k] is not None}
        rows.append(row)
    by = {r["variant"]: r for r in rows}
    ours, usual = by["offtensor"], by["load_state_dict"]
    ckpt_bytes = ours["checkpoint_bytes"]
    device_extra = (ours["device_peak_bytes"] or 0) if args.device == "cpu" else 0
    rss_limit = MAX_RSS_RATIO * ckpt_bytes + device_extra
    checks = {
        "logits_identical": all(identical.values()),
        "time_ratio_to_usual": ours["first_forward_s"] / usual["first_forward_s"],
        "time_ratio_ok": ours["first_forward_s"] <= MAX_TIME_RATIO * usual["first_forward_s"],
        "rss_limit_bytes": rss_limit,
        "rss_ok": ours["peak_rss_over_start_bytes"] <= rss_limit,
    }
    floor = by.get("preadv_floor")
    if floor is not None and "skipped" not in floor:
        # What any loader that copies the checkpoint into new memory pays before the usual forward:
        # the usual way pays neither the copy nor the first touch of fresh pages (it maps the page
        # cache), so this, not the usual way, is the least a copying loader can reach here.
        checks["floor_first_forward_s"] = floor["load_s"] + usual["forward_s"]
        checks["time_ratio_to_floor"] = ours["first_forward_s"] / checks["floor_first_forward_s"]
    print(f"\ncheckpoint {ckpt_bytes / 1e6:.0f} MB in {len(_shards(args.ckpt))} shards, budget "
          f"{args.budget_fraction:.0%}, device {args.device}, medians of {args.repeats}")
    print(f"{'variant':22s} {'load GB/s':>9s} {'load s':>7s} {'fwd s':>6s} {'1st fwd s':>9s} {'peak RSS/ckpt (load only)':>25s} "
          f"{'device MB':>9s} identical")
    for r in rows:
        if "skipped" in r:
            print(f"{r['variant']:22s} skipped: {r['skipped']}")
            continue
        dev = f"{r['device_peak_bytes'] / 1e6:.0f}" if r["device_peak_bytes"] is not None else "-"
        forward = f"{r['first_forward_s']:9.3f}" if r["first_forward_s"] is not None else f"{'-':>9s}"
        same = r["logits_identical_to_load_state_dict"]
        fwd = f"{r['forward_s']:6.3f}" if r["forward_s"] is not None else f"{'-':>6s}"
        print(f"{r['variant']:22s} {r['load_gbps']:9.2f} {r['load_s']:7.3f} {fwd} {forward} "
              f"{r['peak_rss_over_checkpoint']:18.2f} ({r['load_peak_rss_over_checkpoint']:.2f}) {dev:>9s} "
              f"{'-' if same is None else same}")
    if "pinning" in ours:
        print("pinning GB/s:", {k: round(v, 2) for k, v in ours["pinning"].items()})
    print(f"offtensor / usual time to first forward: {checks['time_ratio_to_usual']:.2f}x "
          f"(limit {MAX_TIME_RATIO}x) {'ok' if checks['time_ratio_ok'] else 'FAIL'}")
    if "time_ratio_to_floor" in checks:
        print(f"offtensor / (preadv floor + usual forward): {checks['time_ratio_to_floor']:.2f}x "
              f"(floor {checks['floor_first_forward_s']:.3f} s = "
              f"{checks['floor_first_forward_s'] / usual['first_forward_s']:.2f}x the usual way)")
    print(f"offtensor peak RSS over start: {ours['peak_rss_over_start_bytes'] / 1e6:.0f} MB, limit "
          f"{MAX_RSS_RATIO}x checkpoint + device bytes = {rss_limit / 1e6:.0f} MB {'ok' if checks['rss_ok'] else 'FAIL'}")
    print(f"logits identical to the usual way: {checks['logits_identical']}")

    from results_io import save_result

    name = f"load_bench_{torch.device(args.device).type}"
    save_result(args.out, name + ".json", "load_bench", torch.device(args.device), argv,
                {"checkpoint": {"dir": args.ckpt, "bytes": ckpt_bytes, "shards": len(_shards(args.ckpt)),
                                "layers": args.layers, "hidden": args.hidden},
                 "budget_fraction": args.budget_fraction, "repeats": args.repeats, "variants": rows,
                 "checks": checks})
    png = os.path.join(args.out, name + ".png")
    if _plot(rows, png, f"load {ckpt_bytes / 1e6:.0f} MB, {args.device}, budget {args.budget_fraction:.0%}",
             rss_limit / ckpt_bytes if device_extra else None):
        print(f"wrote {png}")
    return 0 if checks["logits_identical"] and checks["time_ratio_ok"] and checks["rss_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
