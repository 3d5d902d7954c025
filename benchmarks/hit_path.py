"""A copy-free decode step of a wrapped MoE against the plain model, in one run, alternating.

Every routed expert stack of a small MoE is offloaded (the Qwen3-MoE trained on the standard library
that tests/data/moe_qwen3 holds, or a random transformers Mixtral built from a config: ``--model``),
and the budget caches them all: after a warm-up step every expert a token routes to is a cache hit,
so a decode step copies nothing (checked: no host->device bytes in the timed steps) and what it
costs beyond the plain model is offtensor's own host work per op: dispatch, the cache lookup, use
counts and release. Plain and wrapped steps alternate, step by step, and the medians are compared,
so the ratio holds on a shared, noisy machine; both decode the same greedy tokens. A third model,
wrapped with ``expert_pool=True`` (the device-side expert pool: no host decision on the expert
path), alternates with them; its copies are the pager's plus the pool's fetches (slots whose expert
changed). Two more pooled models alternate too, each run in a form a GPU runs: ``pooled_tensor_ops``
(the admit as the GPU's tensor ops instead of the emulated device's one native call) and
``pooled_gpu_form`` (also the GPU's plan, one group per pool slot; on this CPU its grouped GEMM walks
every slot, so its time holds CPU compute a GPU does not spend). Each pooled model's figures: its
extra host microseconds per MoE layer over the plain step, and the ops it dispatches per MoE layer
beyond the plain model's (each a kernel launch on a GPU). Each step is timed on the wall clock and
in the calling thread's CPU time (``time.thread_time``: with one torch thread the step's host work,
free of the time a loaded machine spends running other processes); the medians of both are kept.

Then the per-op figures of ``benchmarks/dispatch.py`` (tiny tensors: dispatch overhead only) as
ratios against plain tensors and against a pass-through wrapper subclass (the floor of any
Python ``__torch_dispatch__``).

    python benchmarks/hit_path.py [--model trained-qwen3-moe|mixtral] [--layers 4] [--experts 16] [--hidden 256] [--steps 40] [--dispatch-iters 1000]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import offtensor as ot  # noqa: E402
from results_io import save_result  # noqa: E402

GiB = 1 << 30
TARGET = 1.15
# The pooled models and the form each runs in: (NATIVE_ADMIT, SLOT_GROUPS) of ops/expert_pool.py,
# None for the emulated device's own (its native admit and grouped GEMM).
POOLED = {"pooled": None, "pooled_tensor_ops": (False, ("cuda",)), "pooled_gpu_form": (False, ("cuda", "cpu"))}


TRAINED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "moe_qwen3")


def trained_qwen3_moe(args):
    """The small Qwen3-MoE trained by scripts/train_moe.py (tests/data/moe_qwen3), in float32."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(TRAINED, dtype=torch.float32).eval()
    args.experts, args.hidden, args.vocab = model.config.num_experts, model.config.hidden_size, model.config.vocab_size
    args.top_k = model.config.num_experts_per_tok
    return model


def mixtral(args):
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4, head_dim=args.hidden // 8,
        num_local_experts=args.experts, num_experts_per_tok=2, max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    args.top_k = 2
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _step_timer(model, prompt):
    """A callable that runs one decode step of ``model`` (greedy, KV cache) and returns its seconds,
    (wall clock, the thread's CPU time)."""
    with torch.no_grad():
        out = model(input_ids=prompt, use_cache=True)
    state = {"cache": out.past_key_values, "token": out.logits[:, -1:].argmax(-1), "tokens": []}

    def step():
        with torch.no_grad():
            start, cpu = time.perf_counter(), time.thread_time()
            out = model(input_ids=state["token"], past_key_values=state["cache"], use_cache=True)
            seconds = time.perf_counter() - start, time.thread_time() - cpu
        state["cache"], state["token"] = out.past_key_values, out.logits[:, -1:].argmax(-1)
        state["tokens"].append(int(state["token"]))
        return seconds

    return step, state


@contextlib.contextmanager
def _form(form):
    """ops/expert_pool.py set to run a pooled model in ``form`` (see ``POOLED``), then put back."""
    from offtensor.ops import expert_pool

    if form is None:
        yield
        return
    saved = expert_pool.NATIVE_ADMIT, expert_pool.SLOT_GROUPS
    expert_pool.NATIVE_ADMIT, expert_pool.SLOT_GROUPS = form
    try:
        yield
    finally:
        expert_pool.NATIVE_ADMIT, expert_pool.SLOT_GROUPS = saved


class _Dispatches(TorchDispatchMode):
    """Counts the ops dispatched in its scope, those inside offtensor's Python custom ops included
    (a dispatch mode sees such an op whole: its body is run under the counter)."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.python_ops = getattr(torch._library.custom_ops, "OPDEFS", {})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        body = self.python_ops.get(func._schema.name)
        if body is not None:
            with self:
                return body._init_fn(*args, **(kwargs or {}))
        self.count += 1
        return func(*args, **(kwargs or {}))


def _dispatches(step) -> int:
    counter = _Dispatches()
    with counter:
        step()
    return counter.count


def _route_to_every_expert(model, args) -> None:
    """Run each MoE layer's experts once with a token routed to every expert: each expert's copy is
    then cached (the budget holds them all), whatever the decode steps route to."""
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    assert experts, "no experts module found"
    n, k = args.experts, args.top_k
    index = torch.stack([(torch.arange(n) + j) % n for j in range(k)], dim=1)
    with torch.no_grad():
        for module in experts:
            module(torch.randn(n, args.hidden), index, torch.full((n, k), 1.0 / k))


def decode_ratio(args) -> dict:
    plain = trained_qwen3_moe(args) if args.model == "trained-qwen3-moe" else mixtral(args)
    wrapped = copy.deepcopy(plain)
    pooled = {name: copy.deepcopy(plain) for name in POOLED}
    weights = sum(p.numel() * p.element_size() for p in plain.parameters())
    ot.wrap_model(wrapped, budget_gb=2 * weights / GiB, device="cpu", prefetch=False, policy=["*.experts.*"])
    # The pool: every expert of every layer fits its slots (the same budget), so after the warm-up
    # a decode step fetches nothing into it either.
    for model in pooled.values():
        ot.wrap_model(model, budget_gb=2 * weights / GiB, device="cpu", prefetch=False, policy=["*.experts.*"],
                      expert_pool=True)
    offloaded = [n for n, p in wrapped.named_parameters() if isinstance(p, ot.OffloadedTensor)]
    experts = [n for n, p in plain.named_parameters() if ".experts." in n]
    assert offloaded and sorted(offloaded) == sorted(experts), (offloaded, experts)
    layers = sum(type(m).__name__.endswith("Experts") for m in plain.modules())
    prompt = torch.randint(0, args.vocab, (1, 8), generator=torch.Generator().manual_seed(1))
    steps, states = {}, {}
    steps["plain"], states["plain"] = _step_timer(plain, prompt)
    steps["wrapped"], states["wrapped"] = _step_timer(wrapped, prompt)
    for name, model in pooled.items():
        with _form(POOLED[name]):
            step, states[name] = _step_timer(model, prompt)
            _route_to_every_expert(model, args)  # every expert is in the pool from here on

        def in_form(step=step, form=POOLED[name]):
            with _form(form):
                return step()

        steps[name] = in_form
    _route_to_every_expert(wrapped, args)  # every expert is cached from here on
    for _ in range(args.warmup):
        for step in steps.values():
            step()
    h2d = {name: ot.stats(m).bytes_h2d for name, m in [("wrapped", wrapped), *pooled.items()]}
    times = {name: [] for name in steps}
    for _ in range(args.steps):  # alternating: drift hits all alike
        for name, step in steps.items():
            times[name].append(step())
    ops = {name: _dispatches(step) for name, step in steps.items()}  # one more step of each, counted
    copied = {name: ot.stats(m).bytes_h2d - h2d[name] for name, m in [("wrapped", wrapped), *pooled.items()]}
    hits = ot.stats(wrapped).hits
    if any(copied.values()):
        # A token routed to an expert no warm-up step used: its first copy. Not a hit-path figure.
        print(f"note: the timed steps copied bytes: {copied} (the pooled ones: the pool's fetches)")
    for name, state in states.items():
        assert state["tokens"] == states["plain"]["tokens"], f"{name} decoding diverged from the plain model"
    ms = {name: statistics.median(w for w, _ in t) * 1e3 for name, t in times.items()}
    cpu = {name: statistics.median(c for _, c in t) * 1e3 for name, t in times.items()}
    plain_ms, wrapped_ms, pooled_ms = ms["plain"], ms["wrapped"], ms["pooled"]
    forms = {name: {"ms_per_step": ms[name], "over_plain": ms[name] / plain_ms,
                    "host_us_per_moe_layer_over_plain": (ms[name] - plain_ms) * 1e3 / layers,
                    "cpu_ms_per_step": cpu[name], "cpu_over_plain": cpu[name] / cpu["plain"],
                    "cpu_us_per_moe_layer_over_plain": (cpu[name] - cpu["plain"]) * 1e3 / layers,
                    "ops_per_moe_layer_over_plain": (ops[name] - ops["plain"]) / layers,
                    "bytes_copied_timed_steps": copied[name]} for name in pooled}
    return {
        "model": (f"trained Qwen3-MoE (tests/data/moe_qwen3): {plain.config.num_hidden_layers} layers x {args.experts} "
                  f"experts (top-{args.top_k}), hidden {args.hidden}, float32" if args.model == "trained-qwen3-moe" else
                  f"random Mixtral: {args.layers} layers x {args.experts} experts (top-2), hidden {args.hidden}, float32"),
        "offloaded_weights": len(offloaded), "moe_layers": layers, "timed_steps": args.steps,
        "bytes_h2d_timed_steps": copied["wrapped"], "cache_hits_total": hits, "plain_ms_per_step": plain_ms,
        "wrapped_ms_per_step": wrapped_ms, "wrapped_over_plain": wrapped_ms / plain_ms, "target": TARGET,
        "plain_cpu_ms_per_step": cpu["plain"], "wrapped_cpu_ms_per_step": cpu["wrapped"],
        "pooled_ms_per_step": pooled_ms, "pooled_over_plain": pooled_ms / plain_ms,
        "pooled_bytes_copied_timed_steps": copied["pooled"], "pooled_forms": forms,
    }


def dispatch_ratios(args) -> dict:
    import dispatch

    us = dispatch.main(["--device", "cpu", "--iters", str(args.dispatch_iters), "--repeats", "3",
                        "--out", args.scratch])
    return {op: {"cache_hit_us": row["offloaded (cache hit)"], "over_plain": row["offloaded (cache hit)"] / row["plain"],
                 "over_passthrough": row["offloaded (cache hit)"] / row["passthrough"]} for op, row in us.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("trained-qwen3-moe", "mixtral"), default="trained-qwen3-moe")
    p.add_argument("--layers", type=int, default=4, help="random Mixtral: layers (and --experts, --hidden, --vocab)")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=12)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--dispatch-iters", type=int, default=1000)
    p.add_argument("--no-dispatch", action="store_true")
    p.add_argument("--scratch", default="/tmp", help="where dispatch.py's own JSON goes")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    result = {"decode": decode_ratio(args)}
    d = result["decode"]
    print(f"decode step, every expert offloaded and cached: plain {d['plain_ms_per_step']:.2f} ms, wrapped "
          f"{d['wrapped_ms_per_step']:.2f} ms: {d['wrapped_over_plain']:.3f}x (target <= {TARGET}x); "
          f"{d['bytes_h2d_timed_steps']} bytes copied in the timed steps")
    print(f"thread CPU time: plain {d['plain_cpu_ms_per_step']:.2f} ms, "
          f"wrapped {d['wrapped_cpu_ms_per_step']:.2f} ms")
    for name, f in d["pooled_forms"].items():
        print(f"{name} (expert_pool=True): {f['ms_per_step']:.2f} ms: {f['over_plain']:.3f}x, "
              f"{f['host_us_per_moe_layer_over_plain']:.0f} us per MoE layer over plain; CPU time "
              f"{f['cpu_ms_per_step']:.2f} ms: {f['cpu_over_plain']:.3f}x, {f['cpu_us_per_moe_layer_over_plain']:.0f} us "
              f"per MoE layer; {f['ops_per_moe_layer_over_plain']:.0f} ops per MoE layer over plain; "
              f"{f['bytes_copied_timed_steps']} bytes copied in the timed steps")
    if not args.no_dispatch:
        result["dispatch"] = dispatch_ratios(args)
        print(f"{'op':<16}{'cache hit us':>14}{'/ plain':>10}{'/ passthrough':>15}")
        for op, row in result["dispatch"].items():
            print(f"{op:<16}{row['cache_hit_us']:>14.2f}{row['over_plain']:>10.2f}{row['over_passthrough']:>15.2f}")
    save_result(args.out, "hit_path_cpu.json", "copy-free decode step of a wrapped MoE, and per-op hit-path ratios",
                torch.device("cpu"), argv, result)
    return result


if __name__ == "__main__":
    main()
