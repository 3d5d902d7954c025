"""The seed's scenario at TP=2 on the emulated device: ``LLM("deepseek-ai/DeepSeek-R1",
tensor_parallel_size=N, cpu_offload_gb=X)``, in miniature.

Each rank, in its own process (gloo):
1. builds its part of the vLLM-style DeepSeek (offtensor/models/vllm_deepseek.py: MLA with
   absorption, routed + shared experts, tied embeddings; attention and expert weights stored
   float8_e4m3fn with per-block ``weight_scale_inv``, dequantised in forward), uninitialised, on the CPU;
2. wraps it with ``offload_gb`` of its own (vLLM's ``cpu_offload_gb`` is per GPU);
3. loads the sharded safetensors checkpoint through the model's weight loaders, lazily, so it reads
   only its own rows of each tensor; then ``process_weights_after_loading``;
4. decodes greedily and compares with the same rank's model built on the device and never wrapped.

Writes per-rank figures (tokens equal, peak against budget, host bytes against offloaded bytes,
checkpoint bytes read, bytes paged per decoded token) to ``--out``/seed_tp.json.

    python benchmarks/seed_tp.py [--world 2] [--tokens 8] [--offload-fraction 0.5] [--out benchmarks/results]

tests/test_seed_tp.py runs it small.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import offtensor as ot  # noqa: E402
from offtensor.models import vllm_deepseek as vd  # noqa: E402
from offtensor.models.deepseek import CONFIGS  # noqa: E402
from results_io import save_result  # noqa: E402

GiB = 1 << 30
BLOCK = 8  # FP8 block edge: DeepSeek-R1 uses 128; the tiny config's dimensions tile into 8


def seed_config():
    """The tiny reference DeepSeek with its embeddings tied (the seed's model unties them; the tie
    is what broke loading elsewhere, so it is what this run keeps)."""
    return dataclasses.replace(CONFIGS["tiny"], tie_word_embeddings=True, dtype=torch.bfloat16,
                               scoring_func="sigmoid", norm_topk_prob=True)


def rank_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def run_rank(rank: int, world: int, args: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{args['store']}", rank=rank, world_size=world)
    try:
        result = decode_on_rank(rank, world, args)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(args["scratch"], f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def decode_on_rank(rank: int, world: int, args: dict) -> dict:
    config, device = seed_config(), args["device"]
    par = vd.Parallel(rank=rank, size=world, fp8_block=BLOCK)
    ids = torch.tensor(args["prompt"]).to(device)

    with torch.device(device):  # the reference: this rank's part on the device, never wrapped
        reference = vd.DeepseekForCausalLM(config, par)
    reference.load_weights(vd.iterate_checkpoint(args["checkpoint"], lazy=True))
    reference.process_weights_after_loading()
    expected = reference.generate(ids, max_new_tokens=args["tokens"])
    del reference

    model = vd.DeepseekForCausalLM(config, par)  # vLLM's order: build, place, then load
    weights = rank_bytes(model)
    offload_gb = args["offload_fraction"] * weights / GiB
    ot.wrap_model(model, offload_gb=offload_gb, device=device)
    log = {}
    model.load_weights(vd.iterate_checkpoint(args["checkpoint"], lazy=True, log=log))
    loaded = ot.stats(model)
    model.process_weights_after_loading()
    ot.reset_stats(model)
    prefill_and_decode = model.generate(ids, max_new_tokens=args["tokens"])
    s = ot.stats(model)
    return {
        "rank": rank, "tokens_equal": bool(torch.equal(prefill_and_decode, expected)),
        "tokens": prefill_and_decode.tolist(), "rank_weight_bytes": weights,
        "offload_bytes_asked": int(offload_gb * GiB), "offloaded_bytes": s.offloaded_bytes,
        "resident_bytes": s.resident_bytes, "budget_bytes": s.budget_bytes, "peak_device_bytes": s.peak_device_bytes,
        "paged_while_loading": loaded.bytes_h2d, "checkpoint_bytes_read": log.get("bytes", 0),
        "bytes_h2d": s.bytes_h2d, "bytes_h2d_per_token": s.bytes_h2d / args["tokens"],
        "fp8_offloaded": sorted({str(p.dtype) for p in model.parameters() if isinstance(p, ot.OffloadedTensor)}),
    }


def run(world: int = 2, tokens: int = 8, offload_fraction: float = 0.5, device: str = "cpu") -> dict:
    config = seed_config()
    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = os.path.join(scratch, "ckpt")
        os.mkdir(checkpoint)
        tensors = vd.random_checkpoint(config, seed=0, fp8_block=BLOCK)
        vd.write_sharded_checkpoint(tensors, checkpoint, shard_bytes=128 << 10)
        prompt = torch.randint(0, config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1)).tolist()
        args = {"store": os.path.join(scratch, "store"), "scratch": scratch, "checkpoint": checkpoint,
                "prompt": prompt, "tokens": tokens, "offload_fraction": offload_fraction, "device": device}
        mp.start_processes(run_rank, args=(world, args), nprocs=world, join=True, start_method="spawn")
        ranks = [json.load(open(os.path.join(scratch, f"rank{r}.json"))) for r in range(world)]
    checkpoint_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return {"world": world, "tokens": tokens, "device": device, "fp8_block": BLOCK,
            "checkpoint_bytes": checkpoint_bytes, "ranks": ranks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--offload-fraction", type=float, default=0.5)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args()
    result = run(args.world, args.tokens, args.offload_fraction)
    print(f"TP={result['world']}, {result['tokens']} tokens, checkpoint {result['checkpoint_bytes']} bytes")
    for r in result["ranks"]:
        print(f"rank {r['rank']}: tokens equal {r['tokens_equal']}, weights {r['rank_weight_bytes']} B, offloaded "
              f"{r['offloaded_bytes']} B (asked {r['offload_bytes_asked']}), peak {r['peak_device_bytes']} / budget "
              f"{r['budget_bytes']} B, read {r['checkpoint_bytes_read']} B, paged {r['bytes_h2d_per_token']:.0f} B/token")
    save_result(args.out, "seed_tp.json", "seed_tp", torch.device("cpu"), None, result)


if __name__ == "__main__":
    main()
