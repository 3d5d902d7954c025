"""``python -m offtensor demo``: run a DeepSeek-style MLA + MoE model under a weight budget well
below its size and show that it gives the unwrapped model's tokens, and what it cost.

The steps are the ones an inference engine takes: build a model without values, wrap it, load the
checkpoint into it (resident weights on the device, the rest into host masters), run the post-load
weight rewrites (MLA absorption creates W_UK / W_UV and deletes kv_b_proj), then generate. The
reference is a separate, unwrapped copy of the same weights run on the same device, so the token
comparison is between two independent models.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time
from typing import Optional

import torch

import offtensor as ot

from .models import CONFIGS, DeepSeekForCausalLM, weight_bytes
from .pager import GiB, format_bytes, resolve_device

PROMPT_LENGTH = 16
WARMUP_TOKENS = 2


class _Clock:
    """Prints each long step with the time it took, so a slow step is visible while it runs."""

    def __init__(self, device: torch.device):
        self.device = device
        self.start = time.perf_counter()

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @contextlib.contextmanager
    def step(self, what: str):
        print(f"[{time.perf_counter() - self.start:6.1f}s] {what} ...", flush=True)
        began = self.now()
        yield
        print(f"          done in {self.now() - began:.2f} s", flush=True)


@dataclasses.dataclass
class _Run:
    tokens: torch.Tensor
    prefill_s: float
    decode_s: float
    new_tokens: int
    prefill_h2d: int = 0
    total_h2d: int = 0
    hits: int = 0
    page_ins: int = 0
    prefetches: int = 0
    prefetch_hits: int = 0

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def decode_tokens_per_s(self) -> Optional[float]:
        return (self.new_tokens - 1) / self.decode_s if self.new_tokens > 1 and self.decode_s > 0 else None


def _generate(model, prompt, new_tokens: int, clock: _Clock, label: str, wrapped: bool) -> _Run:
    """Greedy generation timed per token, with a progress line. For a wrapped model the paging
    counters of this run are recorded (the stats are not reset, so the peak covers the model's whole
    life since wrap_model: loading and absorption included)."""
    interactive = sys.stdout.isatty()
    report_every = max(1, new_tokens // 4)
    token_times = []
    prefill_h2d = [0]

    def on_token(count, _token):
        token_times.append(clock.now())
        if wrapped and count == 1:
            prefill_h2d[0] = ot.stats(model).bytes_h2d - before.bytes_h2d
        rate = (count - 1) / (token_times[-1] - token_times[0]) if count > 1 else 0.0
        line = f"  {label}: {count}/{new_tokens} tokens, {rate:.1f} tok/s after the first"
        if interactive:
            print("\r" + line, end="\n" if count == new_tokens else "", flush=True)
        elif count % report_every == 0 or count == new_tokens:
            print(line, flush=True)

    before = ot.stats(model) if wrapped else None
    began = clock.now()
    tokens = model.generate(prompt, new_tokens, on_token=on_token)
    run = _Run(tokens.cpu(), token_times[0] - began, token_times[-1] - token_times[0], new_tokens)
    if wrapped:
        after = ot.stats(model)
        run.prefill_h2d = prefill_h2d[0]
        for counter in ("bytes_h2d", "hits", "page_ins", "prefetches", "prefetch_hits"):
            setattr(run, "total_h2d" if counter == "bytes_h2d" else counter,
                    getattr(after, counter) - getattr(before, counter))
    return run


def _parse(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m offtensor demo",
        description="Generate with a DeepSeek-style MLA + MoE model whose weights exceed the device budget, "
        "and check the tokens against the unwrapped model.",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="cuda when available, else cpu (the emulated device)")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens to generate (default 32)")
    parser.add_argument("--budget-fraction", type=float, default=0.35,
                        help="device budget as a fraction of the weight bytes (default 0.35)")
    parser.add_argument("--size", choices=sorted(CONFIGS), default=None,
                        help="model size: large (~6.8 GB bf16) on a GPU, medium (~530 MB fp32) on cpu by default")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.tokens < 1:
        parser.error(f"--tokens must be at least 1, got {args.tokens}")
    if not 0 < args.budget_fraction <= 1:
        parser.error(f"--budget-fraction must be in (0, 1], got {args.budget_fraction}")
    return args


def main(argv=None) -> int:
    args = _parse(argv)
    try:
        device = resolve_device(args.device)
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    size, config = _model_config(args, device)
    clock = _Clock(device)
    _announce(args, size, device)

    with clock.step("building the reference model on the host (random weights)"):
        reference = DeepSeekForCausalLM.empty(config).init_weights(args.seed)
    total_bytes = weight_bytes(reference)
    params = sum(p.numel() for p in reference.parameters())
    budget_gb = args.budget_fraction * total_bytes / GiB
    print(f"          {params / 1e6:.1f} M parameters, {format_bytes(total_bytes)} of weights; "
          f"budget {format_bytes(budget_gb * GiB)} ({budget_gb:.3f} GiB)", flush=True)
    model = _wrapped_copy(reference, config, budget_gb, device, clock)
    if model is None:
        return 2
    placed = ot.stats(model)

    generator = torch.Generator().manual_seed(args.seed + 1)
    prompt = torch.randint(0, config.vocab_size, (1, PROMPT_LENGTH), generator=generator).to(device)
    expected, reference_gpu_peak = _reference_run(reference, prompt, args.tokens, clock, device)
    del reference
    if device.type == "cuda":
        torch.cuda.empty_cache()
    got, wrapped_gpu_peak = _wrapped_run(model, prompt, args.tokens, clock, device)
    s = ot.stats(model)

    tokens_equal = torch.equal(got.tokens, expected.tokens)
    within_budget = s.peak_device_bytes <= s.budget_bytes
    _print_table(args, size, total_bytes, placed, s, expected, got, reference_gpu_peak, wrapped_gpu_peak,
                 tokens_equal, within_budget)
    print(f"total {time.perf_counter() - clock.start:.1f} s")
    return _verdict(expected, got, s, tokens_equal, within_budget)


def _model_config(args, device: torch.device):
    """The model size and its config for ``device``: bf16 on a GPU as models are served; float32 on
    the CPU, where bf16 matmuls are slow, except for the GPU-sized model, which would need 13.6 GB
    per copy in float32."""
    on_gpu = device.type == "cuda"
    size = args.size or ("large" if on_gpu else "medium")
    dtype = torch.bfloat16 if on_gpu or size == "large" else torch.float32
    return size, dataclasses.replace(CONFIGS[size], dtype=dtype)


def _announce(args, size: str, device: torch.device) -> None:
    where = "GPU" if device.type == "cuda" else "emulated device (cpu)"
    if device.type != "cuda":
        # The emulated device's copy engine is a worker thread: leave it a core. With every core
        # given to intra-op threads, their spin-waits and the copies starve each other (seconds per
        # token on 2 cores instead of tens of milliseconds), for the unwrapped run as well.
        torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
        where += f", {torch.get_num_threads()} compute thread(s) + the copy thread"
        if size == "large":
            print("note: the 'large' model is sized for a GPU; on the emulated device it needs ~20 GB of host "
                  "memory and minutes per step", flush=True)
    print(f"offtensor demo: '{size}' DeepSeek-style model on {device} ({where}), {args.tokens} new tokens, "
          f"budget {args.budget_fraction:.0%} of the weights", flush=True)


def _wrapped_copy(reference, config, budget_gb: float, device: torch.device, clock: _Clock):
    """An empty model wrapped for the budget, then loaded and absorbed as an engine does; None
    (with the error printed) when the budget cannot hold it."""
    with clock.step(f"wrapping an empty copy for {device} under the budget"):
        model = DeepSeekForCausalLM.empty(config)
        try:
            ot.wrap_model(model, budget_gb=budget_gb, device=device)
        except ot.BudgetError as error:
            print(f"{error}\nTry a larger --budget-fraction.", file=sys.stderr)
            return None
    with clock.step("loading the reference weights into it (load_state_dict)"):
        model.load_state_dict(reference.state_dict())
    with clock.step("MLA absorption (process_weights_after_loading) on the wrapped model"):
        model.process_weights_after_loading()
    return model


def _reference_run(reference, prompt, tokens: int, clock: _Clock, device: torch.device):
    """The unwrapped model's tokens on ``device``, and the GPU memory its run added (None on cpu)."""
    on_gpu = device.type == "cuda"
    with clock.step(f"reference run: unwrapped model on {device}, absorbed, {tokens} tokens"):
        # The wrapped model's resident weights are already on the device; the unwrapped run's peak
        # counts only what it adds (its weights and activations), or it would look bigger than it is.
        others_gpu_bytes = torch.cuda.memory_allocated(device) if on_gpu else 0
        reference.to(device)
        reference.process_weights_after_loading()
        reference.generate(prompt, WARMUP_TOKENS)
        if on_gpu:
            torch.cuda.reset_peak_memory_stats(device)
        expected = _generate(reference, prompt, tokens, clock, "unwrapped", wrapped=False)
        gpu_peak = torch.cuda.max_memory_allocated(device) - others_gpu_bytes if on_gpu else None
    return expected, gpu_peak


def _wrapped_run(model, prompt, tokens: int, clock: _Clock, device: torch.device):
    """The wrapped model's tokens, and the GPU memory in use at its peak (None on cpu)."""
    on_gpu = device.type == "cuda"
    with clock.step(f"wrapped run: {tokens} tokens"):
        model.generate(prompt, WARMUP_TOKENS)  # as for the reference: first-call costs, and the prefetcher's first pass
        if on_gpu:
            torch.cuda.reset_peak_memory_stats(device)
        got = _generate(model, prompt, tokens, clock, "wrapped", wrapped=True)
        # Everything on the device now is the wrapped model's: resident weights, slots, activations.
        gpu_peak = torch.cuda.max_memory_allocated(device) if on_gpu else None
    return got, gpu_peak


def _verdict(expected: _Run, got: _Run, s, tokens_equal: bool, within_budget: bool) -> int:
    if not tokens_equal:
        new_expected = expected.tokens[0, PROMPT_LENGTH:].tolist()
        new_got = got.tokens[0, PROMPT_LENGTH:].tolist()
        first = next(i for i, (a, b) in enumerate(zip(new_expected, new_got)) if a != b)
        print(f"FAIL: the wrapped model's tokens differ from the unwrapped model's from new token {first}:\n"
              f"  unwrapped {new_expected}\n  wrapped   {new_got}", file=sys.stderr)
        return 1
    if not within_budget:
        print(f"FAIL: peak device bytes {s.peak_device_bytes} exceed the budget of {s.budget_bytes} bytes",
              file=sys.stderr)
        return 1
    print("OK: the wrapped model generated the unwrapped model's tokens within the budget")
    return 0


def _print_table(args, size, total_bytes, placed, s, expected: _Run, got: _Run, reference_gpu_peak,
                 wrapped_gpu_peak, tokens_equal, within_budget) -> None:
    def rate(run: _Run):
        per_s = run.decode_tokens_per_s
        return "-" if per_s is None else f"{per_s:.1f}"

    def gb_per_s(nbytes, seconds):
        return f"{nbytes / seconds / 1e9:.2f} GB/s" if seconds > 0 else "-"

    decode_h2d = got.total_h2d - got.prefill_h2d
    rows = [
        ("model", f"{size}, {args.tokens} new tokens after a {PROMPT_LENGTH}-token prompt", ""),
        ("weight bytes", format_bytes(total_bytes), ""),
        ("budget", f"{format_bytes(s.budget_bytes)} ({s.budget_bytes / total_bytes:.0%} of weights)", ""),
        ("resident / offloaded", f"{format_bytes(placed.resident_bytes)} / {format_bytes(placed.offloaded_bytes)}", ""),
        ("", "unwrapped", "wrapped"),
        ("prefill", f"{expected.prefill_s:.3f} s", f"{got.prefill_s:.3f} s"),
        ("decode tokens/s", rate(expected), rate(got)),
        ("tokens/s (whole generate)", f"{args.tokens / expected.total_s:.1f}", f"{args.tokens / got.total_s:.1f}"),
        ("bytes moved per token", "-", f"{format_bytes(got.total_h2d / args.tokens)} (decode only: "
         f"{format_bytes(decode_h2d / max(args.tokens - 1, 1))})"),
        ("achieved host->device", "-", f"{gb_per_s(got.total_h2d, got.total_s)} (decode only: "
         f"{gb_per_s(decode_h2d, got.decode_s)})"),
        ("peak device bytes (weights)", format_bytes(total_bytes),  # wrapped: since wrap_model, loading included
         f"{format_bytes(s.peak_device_bytes)} {'<=' if within_budget else '>'} budget {format_bytes(s.budget_bytes)}"),
    ]
    if reference_gpu_peak is not None:
        rows.append(("peak GPU memory (model's own)", format_bytes(reference_gpu_peak), format_bytes(wrapped_gpu_peak)))
        rows.append(("max reserved (whole device)", "-", f"{format_bytes(s.max_memory_reserved)}, paging arena peak "
                     f"{format_bytes(s.peak_pool_bytes)}"))
    rows += [
        ("cache hits / page-ins", "-",
         f"{got.hits} / {got.page_ins} (prefetched {got.prefetches}, used {got.prefetch_hits})"),
        ("tokens equal", "", "yes" if tokens_equal else "NO"),
    ]
    width = max(len(r[0]) for r in rows)
    column = max(len(r[1]) for r in rows if r[2]) + 2
    print()
    for label, left, right in rows:
        print(f"  {label:<{width}}  {left:<{column}}{right}".rstrip())
    print()
