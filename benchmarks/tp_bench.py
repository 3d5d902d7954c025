"""The seed at TP=2, per rank: the reference DeepSeek with FP8 block-scaled weights
(offtensor/models/tp_deepseek.py), built per rank, wrapped with ``offload_gb`` per rank BEFORE
loading (vLLM's ``cpu_offload_gb`` order), loaded slice by slice through its weight loaders from one
safetensors file, post-processed (MLA absorption), then greedy decoding. The same TP=2 model
unwrapped is the reference in the same run.

Reports per rank: tokens equal, host->device bytes per decoded token (prefill excluded), offloaded
and resident bytes, peak device bytes against the budget, the bytes its loaders read from the file,
and how much the process's resident memory grew while building, wrapping and loading (host masters
+ resident weights on the emulated device) against its offloaded + resident bytes.

    python benchmarks/tp_bench.py [--size tiny|small|medium] [--offload-fraction 0.5] [--steps 8]
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import datetime
import gc
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
WORLD = 2


def _rss() -> tuple:
    """(resident, anonymous resident) bytes. Resident memory counts the checkpoint's pages that the
    safetensors mmap read as well (file-backed, shared, dropped under pressure); the anonymous part
    is what the process itself allocated: masters, resident weights, temporaries."""
    # Hand freed heap memory back first: wrap_model frees each offloaded weight's original after
    # copying it into its master, and glibc keeps freed blocks mapped, where they would look live.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    page = os.sysconf("SC_PAGE_SIZE")
    return int(fields[1]) * page, (int(fields[1]) - int(fields[2])) * page


def _config(size: str):
    from offtensor.models import CONFIGS

    # tp_deepseek splits q_proj by heads, so queries come from a plain q_proj (q_lora_rank 0).
    return dataclasses.replace(CONFIGS[size], q_lora_rank=0, tie_word_embeddings=True)


def _decode(model, ids, steps, h2d):
    from offtensor.models.deepseek import LatentCache

    cache = LatentCache()
    with torch.no_grad():
        tokens = [model(ids, cache)[:, -1:].argmax(-1)]
        start = h2d()
        for _ in range(steps - 1):
            tokens.append(model(tokens[-1], cache)[:, -1:].argmax(-1))
    return torch.cat(tokens, 1), (h2d() - start) / max(steps - 1, 1)


def _rank(rank: int, args, directory: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{directory}/init", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=600))
    torch.set_num_threads(1)
    from safetensors import safe_open

    import offtensor as ot
    from offtensor.models import tp_deepseek
    from offtensor.models.deepseek import weight_bytes

    config, path = _config(args.size), os.path.join(directory, "fp8.safetensors")
    ids = torch.randint(0, config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))

    def load(model, counter):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                tp_deepseek.load_weights(model, [(name, tp_deepseek.CountingSlice(piece, counter))])
        tp_deepseek.process_weights_after_loading(model)

    # The unwrapped TP run first: its tokens are the reference, and it pays what the first build,
    # load and decode of a process allocate for good (~70 MB here: thread pools, dispatch tables,
    # the allocator's arenas), so the resident-memory growth below is the wrapped model's own.
    reference = tp_deepseek.build(config, rank, WORLD)
    load(reference, [0])
    expected, _ = _decode(reference, ids, args.steps, lambda: 0)
    dist.all_reduce(ot.offload(torch.ones(4), device="cpu") + 0)
    del reference
    gc.collect()
    rss_before, read = _rss(), [0]
    model = tp_deepseek.build(config, rank, WORLD)
    rank_bytes = weight_bytes(model)
    offload_gb = args.offload_fraction * rank_bytes / 2**30
    ot.wrap_model(model, offload_gb=offload_gb, device="cpu")
    load(model, read)
    s = ot.stats(model)
    rss_after = _rss()
    rss_growth, anon_growth = rss_after[0] - rss_before[0], rss_after[1] - rss_before[1]
    ot.reset_stats(model)
    tokens, bytes_per_token = _decode(model, ids, args.steps, lambda: ot.stats(model).bytes_h2d)
    after = ot.stats(model)
    # A second unwrapped build and load, measured the same way: on the emulated device its weights
    # live in this process's memory as the wrapped rank's resident weights and masters do, so
    # equal growth means the masters replaced the offloaded weights instead of copying them.
    del model
    gc.collect()
    reference_before = _rss()
    reference = tp_deepseek.build(config, rank, WORLD)
    load(reference, [0])
    reference_growth = _rss()[1] - reference_before[1]
    results[rank] = {
        "rank_weight_bytes_before_loading": rank_bytes, "offload_gb": offload_gb,
        "offloaded_bytes": s.offloaded_bytes, "resident_bytes": s.resident_bytes,
        "budget_bytes": after.budget_bytes, "peak_device_bytes": after.peak_device_bytes,
        "peak_within_budget": after.peak_device_bytes <= after.budget_bytes,
        "decode_bytes_h2d_per_token": round(bytes_per_token), "loader_read_bytes": read[0],
        "rss_growth_bytes": rss_growth, "rss_growth_over_offloaded_plus_resident":
            round(rss_growth / max(s.offloaded_bytes + s.resident_bytes, 1), 3),
        "anonymous_rss_growth_bytes": anon_growth, "unwrapped_anonymous_rss_growth_bytes": reference_growth,
        "anonymous_rss_growth_over_unwrapped": round(anon_growth / max(reference_growth, 1), 3),
        "tokens_equal": bool(torch.equal(tokens, expected)),
    }
    dist.destroy_process_group()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=["tiny", "small", "medium"])
    parser.add_argument("--offload-fraction", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)
    from safetensors.torch import save_file

    from offtensor.models import tp_deepseek
    from results_io import save_result

    with tempfile.TemporaryDirectory() as directory:
        tensors = tp_deepseek.checkpoint(_config(args.size))
        save_file(tensors, os.path.join(directory, "fp8.safetensors"))
        file_bytes = os.path.getsize(os.path.join(directory, "fp8.safetensors"))
        del tensors
        with mp.Manager() as manager:
            results = manager.dict()
            mp.start_processes(_rank, args=(args, directory, results), nprocs=WORLD, start_method="spawn")
            ranks = [dict(results[r]) for r in range(WORLD)]
    body = {"device": "cpu (emulated)", "world": WORLD, "size": args.size, "checkpoint_file_bytes": file_bytes,
            "offload_fraction": args.offload_fraction, "steps": args.steps, "ranks": ranks}
    for rank, r in enumerate(ranks):
        print(f"rank {rank}: " + ", ".join(f"{k}={v}" for k, v in r.items()))
    save_result(args.out, "tp_bench_cpu.json", "the seed at TP=2: FP8 DeepSeek per rank, offload_gb per rank, "
                "slice loaders, greedy decode", torch.device("cpu"), argv, body)
    if not all(r["tokens_equal"] and r["peak_within_budget"] for r in ranks):
        raise SystemExit("a rank's tokens differ from the unwrapped TP run's, or its peak exceeded its budget")


if __name__ == "__main__":
    main()
