"""Train a small byte-level MoE on real text available on this machine (Python's standard library
source), so that expert-cache and routing-speculation figures come from a trained router, not a
random one.

    python scripts/train_moe.py --model qwen3 --minutes 20        # tests/data/moe_qwen3/
    python scripts/train_moe.py --model qwen2 --minutes 20        # tests/data/moe_qwen2/
    python scripts/train_moe.py --model mixtral --minutes 8 --seed 1   # tests/data/moe_mixtral/

Data: every ``*.py`` under ``/usr/lib/python3.11`` (sorted by path relative to it); a file is held
out when the first 8 hex digits of the SHA-1 of its relative path, mod 100, are below 5 (about 5%
of files). Bytes are tokens (vocabulary 256). The held-out split is written gzipped to
``tests/data/stdlib_heldout.txt.gz`` (files joined by a ``\\n# ---- <path>\\n`` line), so tests and
benchmarks need neither training nor the source tree.

Models (transformers, random init from ``--seed``):

- ``qwen3``: Qwen3-MoE, 6 layers, hidden 128, 32 experts top-4 (moe intermediate 96), no shared expert;
- ``qwen2``: Qwen2-MoE, 8 layers, hidden 128, 16 experts top-2 (moe intermediate 64) plus a gated
  shared expert (intermediate 128);
- ``mixtral``: Mixtral, 4 layers, hidden 128, 16 experts top-2 (expert intermediate 96), no shared
  expert: another shape (fewer, wider layers; top-2 of 16), so that tuning the expert cache to the
  Qwen models shows.

Training: AdamW, batches of random 256-byte windows of the training split, the load-balancing aux
loss transformers computes (``router_aux_loss_coef`` 0.01), a time budget (``--minutes``) with the
learning rate following a cosine of elapsed time. The checkpoint is saved in bf16 (``save_pretrained``:
config.json + model.safetensors) with ``train_log.json`` (steps, time, train and held-out loss in
bits/byte of the bf16 model).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import math
import os
import random
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
DATA = os.path.join(ROOT, "tests", "data")
SOURCE = "/usr/lib/python3.11"
HELDOUT = os.path.join(DATA, "stdlib_heldout.txt.gz")
SEQ = 256


def split_files(source: str = SOURCE):
    train, held = [], []
    for dirpath, dirnames, filenames in os.walk(source):
        dirnames.sort()
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, name), source)
            bucket = int(hashlib.sha1(rel.encode()).hexdigest()[:8], 16) % 100
            (held if bucket < 5 else train).append(rel)
    return sorted(train), sorted(held)


def join(source: str, files) -> bytes:
    parts = []
    for rel in files:
        with open(os.path.join(source, rel), "rb") as f:
            parts.append(b"\n# ---- " + rel.encode() + b"\n" + f.read())
    return b"".join(parts)


def load_heldout() -> bytes:
    with gzip.open(HELDOUT, "rb") as f:
        return f.read()


def config_of(name: str):
    import transformers

    common = dict(vocab_size=256, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=SEQ, tie_word_embeddings=False, router_aux_loss_coef=0.01,
                  output_router_logits=True, rope_theta=10000.0)
    if name == "qwen3":
        return transformers.Qwen3MoeConfig(**common, num_hidden_layers=6, head_dim=32, intermediate_size=256,
                                           moe_intermediate_size=96, num_experts=32, num_experts_per_tok=4,
                                           norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    if name == "qwen2":
        return transformers.Qwen2MoeConfig(**common, num_hidden_layers=8, intermediate_size=256,
                                           moe_intermediate_size=64, shared_expert_intermediate_size=128,
                                           num_experts=16, num_experts_per_tok=2, norm_topk_prob=False,
                                           decoder_sparse_step=1, mlp_only_layers=[])
    if name == "mixtral":
        return transformers.MixtralConfig(**common, num_hidden_layers=4, head_dim=32, intermediate_size=96,
                                          num_local_experts=16, num_experts_per_tok=2, sliding_window=None)
    raise ValueError(name)


def bits_per_byte(model, data: torch.Tensor, windows: int, seed: int = 0) -> float:
    """Mean next-byte loss in bits over ``windows`` fixed, evenly spaced 256-byte windows."""
    starts = torch.linspace(0, len(data) - SEQ - 2, windows).long().tolist()
    total = 0.0
    with torch.no_grad():
        for i in range(0, windows, 8):
            batch = torch.stack([data[s:s + SEQ + 1] for s in starts[i:i + 8]])
            out = model(input_ids=batch[:, :-1], output_router_logits=False)
            loss = torch.nn.functional.cross_entropy(out.logits.float().reshape(-1, 256), batch[:, 1:].reshape(-1))
            total += loss.item() * len(batch)
    return total / windows / math.log(2)


def main(argv=None):
    import transformers

    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=["qwen3", "qwen2", "mixtral"], default="qwen3")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--out", default=None)
    p.add_argument("--steps", type=int, default=None,
                   help="stop after this many steps, the learning rate scheduled by steps (reproducible)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = args.out or os.path.join(DATA, f"moe_{args.model}")
    os.makedirs(out, exist_ok=True)
    train_files, held_files = split_files()
    train = torch.frombuffer(bytearray(join(SOURCE, train_files)), dtype=torch.uint8).long()
    held_bytes = join(SOURCE, held_files)
    os.makedirs(DATA, exist_ok=True)
    if not os.path.exists(HELDOUT):
        with gzip.GzipFile(HELDOUT, "wb", mtime=0) as f:
            f.write(held_bytes)
    held = torch.frombuffer(bytearray(held_bytes), dtype=torch.uint8).long()
    print(f"train {len(train_files)} files {len(train) / 1e6:.1f} MB, held out {len(held_files)} files "
          f"{len(held) / 1e6:.2f} MB", flush=True)

    torch.manual_seed(args.seed)
    config = config_of(args.model)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.train()
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.model}: {params / 1e6:.2f} M parameters", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    rng = random.Random(args.seed)
    budget = args.minutes * 60
    t0 = time.perf_counter()
    step, log, ema = 0, [], None
    while True:
        elapsed = time.perf_counter() - t0
        if (args.steps is None and elapsed >= budget) or (args.steps is not None and step >= args.steps):
            break
        # The learning rate follows the time budget, or with --steps the step count (then the run
        # is deterministic: the committed checkpoints came from time budgets, see train_log.json).
        frac = step / args.steps if args.steps else elapsed / budget
        lr = args.lr * min(1.0, (step + 1) / 100) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        starts = [rng.randrange(0, len(train) - SEQ - 1) for _ in range(args.batch)]
        batch = torch.stack([train[s:s + SEQ + 1] for s in starts])
        res = model(input_ids=batch[:, :-1], labels=batch[:, :-1].clone())
        # transformers shifts labels itself: labels = inputs, the loss is on the next byte.
        loss = res.loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        lm = (loss.item() - config.router_aux_loss_coef * res.aux_loss.item()) / math.log(2)
        ema = lm if ema is None else 0.98 * ema + 0.02 * lm
        if step % 25 == 0:
            print(f"step {step} {elapsed:7.1f}s lr {lr:.2e} train {ema:.3f} bits/byte aux {res.aux_loss.item():.3f}",
                  flush=True)
            log.append({"step": step, "s": round(elapsed, 1), "train_bits_per_byte": round(ema, 4)})
    seconds = time.perf_counter() - t0
    model.eval()
    model = model.to(torch.bfloat16)
    held_bpb = bits_per_byte(model, held, 64)
    print(f"done: {step} steps in {seconds:.0f}s, held-out {held_bpb:.3f} bits/byte (bf16, 64 windows)", flush=True)
    model.config.output_router_logits = False
    model.save_pretrained(out, safe_serialization=True)
    with open(os.path.join(out, "train_log.json"), "w") as f:
        json.dump({"model": args.model, "seed": args.seed, "minutes": args.minutes, "threads": args.threads,
                   "batch": args.batch, "seq": SEQ, "lr": args.lr, "steps": step, "seconds": round(seconds, 1),
                   "parameters": params, "train_files": len(train_files), "heldout_files": len(held_files),
                   "train_bytes": len(train), "heldout_bytes": len(held),
                   "heldout_bits_per_byte_64_windows": round(held_bpb, 4), "torch": torch.__version__,
                   "transformers": transformers.__version__, "log": log}, f, indent=1)


if __name__ == "__main__":
    main()
