"""The seed's path, measured: a vLLM-style DeepSeek (offtensor/models/vllm_deepseek.py) built on the
CPU, wrapped at a fraction of its weight bytes BEFORE loading (as vLLM's cpu_offload_gb places
weights), loaded through its own weight loaders from a sharded safetensors checkpoint,
post-processed (MLA absorption, int8 dequantisation), then greedy decoding. The same model built on
the device and loaded the same way, never wrapped, is the reference in the same run.

Reports: tokens equal, host->device bytes while loading (should be 0) and per decoded token, peak
device bytes against the budget (and, on a GPU, torch.cuda.max_memory_reserved), load seconds and
decode tokens/s wrapped and unwrapped.

    python benchmarks/vllm_path.py [--device cpu|cuda] [--size tiny|small|medium|large] [--fraction 0.3] [--steps 16]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import offtensor as ot  # noqa: E402
from offtensor.models import CONFIGS  # noqa: E402
from offtensor.models import vllm_deepseek as vd  # noqa: E402
from offtensor.models.deepseek import weight_bytes  # noqa: E402
from offtensor.pager import resolve_device  # noqa: E402
from results_io import save_result  # noqa: E402

GiB = 1 << 30


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _decode(model, ids, steps, device, h2d):
    """Greedy tokens, decode seconds per token and host->device bytes per decoded token (prefill excluded)."""
    cache = vd.LatentCache()
    with torch.no_grad():
        logits = model(ids, cache)
        tokens = [logits[:, -1:].argmax(-1)]
        _sync(device)
        start, bytes_start = time.perf_counter(), h2d()
        for _ in range(steps - 1):
            tokens.append(model(tokens[-1], cache)[:, -1:].argmax(-1))
        _sync(device)
        seconds = time.perf_counter() - start
    return torch.cat(tokens, 1), seconds / (steps - 1), (h2d() - bytes_start) / (steps - 1)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None)
    parser.add_argument("--size", default="small", choices=list(CONFIGS))
    parser.add_argument("--fraction", type=float, default=0.3)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    if device.type == "cpu":
        # The emulated device's copy worker needs a core of its own (as in tests/conftest.py).
        torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    config = CONFIGS[args.size]
    ids = torch.randint(0, config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1)).to(device)

    with tempfile.TemporaryDirectory() as directory:
        checkpoint = vd.random_checkpoint(config, seed=0)
        checkpoint_bytes = sum(t.numel() * t.element_size() for t in checkpoint.values())
        shards = vd.write_sharded_checkpoint(checkpoint, directory, shard_bytes=max(checkpoint_bytes // 4, 1))
        del checkpoint

        with torch.device(device):
            reference = vd.DeepseekForCausalLM(config)
        start = time.perf_counter()
        reference.load_weights(vd.iterate_checkpoint(directory))
        reference.process_weights_after_loading()
        _sync(device)
        reference_load_s = time.perf_counter() - start
        expected, reference_s, _ = _decode(reference, ids, args.steps, device, lambda: 0)
        del reference
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            reserved_before = torch.cuda.memory_reserved(device)

        model = vd.DeepseekForCausalLM(config)  # on the CPU: uninitialised, nothing written yet
        total = weight_bytes(model)
        budget_gb = args.fraction * total / GiB
        start = time.perf_counter()
        ot.wrap_model(model, budget_gb=budget_gb, device=device)
        wrap_s = time.perf_counter() - start
        start = time.perf_counter()
        model.load_weights(vd.iterate_checkpoint(directory))
        _sync(device)
        load_s = time.perf_counter() - start
        load_h2d = ot.stats(model).bytes_h2d
        model.process_weights_after_loading()
        tokens, wrapped_s, bytes_per_token = _decode(model, ids, args.steps, device, lambda: ot.stats(model).bytes_h2d)
        s = ot.stats(model)

    body = {
        "device": str(device),
        "model": {"size": args.size, "weight_bytes_before_loading": total, "dtype": str(config.dtype),
                  "checkpoint_bytes": checkpoint_bytes, "shards": shards},
        "fraction": args.fraction, "budget_bytes": s.budget_bytes, "peak_device_bytes": s.peak_device_bytes,
        "peak_within_budget": s.peak_device_bytes <= s.budget_bytes,
        "resident_bytes": s.resident_bytes, "offloaded_bytes": s.offloaded_bytes,
        "tokens_equal": bool(torch.equal(tokens, expected)), "steps": args.steps,
        "wrap_s": round(wrap_s, 3), "load_s": round(load_s, 3), "reference_load_s": round(reference_load_s, 3),
        "load_bytes_h2d": load_h2d,
        "decode_bytes_h2d_per_token": round(bytes_per_token),
        "decode_tok_s_wrapped": round(1 / wrapped_s, 2), "decode_tok_s_unwrapped": round(1 / reference_s, 2),
    }
    if device.type == "cuda":
        body["cuda_max_memory_reserved_above_start"] = torch.cuda.max_memory_reserved(device) - reserved_before
    for key, value in body.items():
        print(f"{key}: {value}")
    save_result(args.out, f"vllm_path_{device.type}.json", "vLLM-style DeepSeek: wrap before loading, load through "
                "weight loaders, post-process, decode", device, argv, body)
    if not body["tokens_equal"] or not body["peak_within_budget"]:
        raise SystemExit("tokens differ from the unwrapped model's, or the peak exceeded the budget")


if __name__ == "__main__":
    main()
