"""Decode speed of a wrap_model-ed model against the same model unwrapped, measured in one run.

1. A model whose weights FIT its budget: wrap_model keeps every weight a plain device tensor, so
   decoding should cost what it costs unwrapped. Requirement: wrapped >= 0.95x unwrapped speed.
2. The same model wrapped at a fraction (default 40%) of its weight bytes, for information:
   tokens/s and host->device bytes per token next to the unwrapped speed.

The model is a small random-initialised transformers Qwen3-MoE (stacked experts, as in
transformers v5). Wrapped and unwrapped decoding alternate, repetition by repetition, and medians
are reported, so the ratio holds on a shared, noisy machine. Each variant decodes the same greedy
tokens; the script checks that they match.

    python benchmarks/wrap_overhead.py [--device cpu|cuda] [--steps 16] [--repeats 7] [--fraction 0.4]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import offtensor as ot  # noqa: E402
from offtensor.model.copies import is_wrapped  # noqa: E402
from results_io import save_result  # noqa: E402

GiB = 1 << 30
REQUIRED_RATIO = 0.95


def _model(args):
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=8,
        num_key_value_heads=4, head_dim=args.hidden // 8, intermediate_size=4 * args.hidden,
        moe_intermediate_size=args.hidden, num_experts=args.experts, num_experts_per_tok=4,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    return model.to(getattr(torch, args.dtype)), config


def _weight_bytes(model) -> int:
    unique = {id(t): t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers())}
    return sum(unique.values())


def _decode(model, prompt, steps, sync):
    """Seconds per decoded token, host->device bytes per decoded token (prefill excluded from
    both) and the greedy tokens."""
    h2d = (lambda: ot.stats(model).bytes_h2d) if is_wrapped(model) else (lambda: 0)
    with torch.no_grad():
        out = model(input_ids=prompt, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        tokens = [token]
        sync()
        before = h2d()
        start = time.perf_counter()
        for _ in range(steps):
            out = model(input_ids=token, cache=out.cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            tokens.append(token)
        sync()
        seconds = time.perf_counter() - start
    return seconds / steps, (h2d() - before) / steps, torch.cat(tokens, dim=1).cpu()


def _compare(variants, prompt, args, sync):
    """Interleaved repetitions of every variant; per variant the median time per decoded token,
    the mean host->device bytes per decoded token and the greedy tokens."""
    samples = {name: [] for name in variants}
    tokens = {}
    for model in variants.values():
        _decode(model, prompt, 2, sync)  # warm up: first dispatches, cache, prefetch schedule
    h2d = {name: [] for name in variants}
    for rep in range(args.repeats):
        order = list(variants.items())
        if rep % 2:
            order.reverse()  # neither variant always runs right after the other
        for name, model in order:
            seconds, h2d_per_token, tokens[name] = _decode(model, prompt, args.steps, sync)
            samples[name].append(seconds)
            h2d[name].append(h2d_per_token)
    return {
        name: {
            "ms_per_token": statistics.median(samples[name]) * 1e3,
            "tokens_per_s": 1.0 / statistics.median(samples[name]),
            "ms_per_token_samples": [s * 1e3 for s in samples[name]],
            "h2d_bytes_per_token": statistics.mean(h2d[name]),
            "tokens": tokens[name],
        }
        for name in variants
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu (the emulated device, default) or cuda")
    parser.add_argument("--steps", type=int, default=16, help="decoded tokens per repetition")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--prompt", type=int, default=16, help="prompt length")
    parser.add_argument("--fraction", type=float, default=0.4, help="budget of the partial run, of weight bytes")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--dtype", default=None,
                        help="weights' dtype; default float32 on the emulated device, bfloat16 on cuda (transformers' "
                             "default MoE kernel, grouped_mm, takes only bfloat16 there)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads; default 1 on the emulated device, where the model computes on "
                             "the CPU and idle OpenMP threads spinning on a shared machine swamp the timings")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    threads = args.threads or (1 if device.type == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    base, config = _model(args)
    total = _weight_bytes(base)
    prompt = torch.randint(0, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(1)).to(device)
    unwrapped = copy.deepcopy(base).to(device)

    fits = copy.deepcopy(base)
    ot.wrap_model(fits, budget_gb=2 * total / GiB, device=device)
    fits_stats = ot.stats(fits)
    assert fits_stats.offloaded_bytes == 0, "the fitting model should keep every weight resident"
    fit_rows = _compare({"unwrapped": unwrapped, "wrapped (fits)": fits}, prompt, args, sync)
    ratio = fit_rows["unwrapped"]["ms_per_token"] / fit_rows["wrapped (fits)"]["ms_per_token"]

    partial = copy.deepcopy(base)
    ot.wrap_model(partial, budget_gb=args.fraction * total / GiB, device=device)
    partial_placed = ot.stats(partial)
    label = f"wrapped ({args.fraction:.0%} budget)"
    partial_rows = _compare({"unwrapped": unwrapped, label: partial}, prompt, args, sync)
    partial_stats = ot.stats(partial)

    same_tokens = all(
        torch.equal(rows[name]["tokens"], fit_rows["unwrapped"]["tokens"])
        for rows in (fit_rows, partial_rows) for name in rows
    )
    passed = ratio >= REQUIRED_RATIO

    print(f"decode on {device}: Qwen3-MoE {args.layers} layers x {args.experts} experts, hidden {args.hidden}, "
          f"{total / 2**20:.1f} MiB of weights; median of {args.repeats} x {args.steps} tokens, interleaved")
    print(f"{'variant':<26}{'budget MiB':>12}{'resident MiB':>14}{'ms/token':>10}{'tok/s':>9}{'h2d KiB/token':>15}")
    for rows, placed in ((fit_rows, fits_stats), (partial_rows, partial_placed)):
        for name, row in rows.items():
            wrapped = name != "unwrapped"
            budget = f"{placed.budget_bytes / 2**20:.2f}" if wrapped else "-"
            resident = f"{placed.resident_bytes / 2**20:.2f}" if wrapped else f"{total / 2**20:.2f}"
            print(f"{name:<26}{budget:>12}{resident:>14}{row['ms_per_token']:>10.3f}{row['tokens_per_s']:>9.1f}"
                  f"{row['h2d_bytes_per_token'] / 1024:>15.1f}")
    partial_ratio = partial_rows["unwrapped"]["ms_per_token"] / partial_rows[label]["ms_per_token"]
    print(f"fits: wrapped/unwrapped speed = {ratio:.3f} (required >= {REQUIRED_RATIO}): {'PASS' if passed else 'FAIL'}")
    print(f"{label}: {partial_ratio:.3f}x unwrapped speed, peak device bytes {partial_stats.peak_device_bytes} "
          f"<= budget {partial_stats.budget_bytes}, prefetch hits {partial_stats.prefetch_hits}/"
          f"{partial_stats.prefetches}; same greedy tokens everywhere: {same_tokens}")

    for rows in (fit_rows, partial_rows):
        for row in rows.values():
            row.pop("tokens")
    save_result(args.out, f"wrap_overhead_{device.type}.json",
                "decode time, wrapped vs unwrapped (same run, interleaved, median)", device, argv, {
        "device": str(device),
        "model": {"type": "Qwen3-MoE (transformers, random init)", "layers": args.layers, "hidden": args.hidden,
                  "experts": args.experts, "experts_per_token": config.num_experts_per_tok, "vocab": args.vocab,
                  "weight_bytes": total, "dtype": str(next(base.parameters()).dtype)},
        "steps": args.steps, "repeats": args.repeats, "prompt": args.prompt,
        "fits": {"budget_bytes": fits_stats.budget_bytes, "resident_bytes": fits_stats.resident_bytes,
                 "offloaded_bytes": fits_stats.offloaded_bytes, "variants": fit_rows,
                 "speed_ratio_wrapped_over_unwrapped": ratio, "required_ratio": REQUIRED_RATIO, "passed": passed},
        "partial": {"fraction": args.fraction, "budget_bytes": partial_placed.budget_bytes,
                    "resident_bytes": partial_placed.resident_bytes,
                    "offloaded_bytes": partial_placed.offloaded_bytes,
                    "peak_device_bytes": partial_stats.peak_device_bytes,
                    "prefetches": partial_stats.prefetches, "prefetch_hits": partial_stats.prefetch_hits,
                    "variants": partial_rows, "speed_ratio_wrapped_over_unwrapped": partial_ratio},
        "same_greedy_tokens": same_tokens,
    })
    return ratio


if __name__ == "__main__":
    main()
