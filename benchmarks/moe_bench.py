"""MoE offloading at the routed-expert bound: a DeepSeek-style stack replayed under the H200 profile,
and transformers Qwen3-MoE run for real (emulated device here, GPU when there is one).

    python benchmarks/moe_bench.py                  # GPU when present, else the emulated device
    python benchmarks/moe_bench.py --device cpu     # emulated device, scaled-down Qwen3-MoE
    python benchmarks/moe_bench.py --replay-only    # only the DeepSeek-style replay (no weights)
    python benchmarks/moe_bench.py --plans          # benchmarks/moe_plans.py: decode plans of big models

1. **DeepSeek-style stack** (``--layers`` x 64 experts x 25.2 MB bf16, top-8, a resident dense
   block and shared expert per layer), built on meta and planned with ``ot.plan`` at one budget:
   nothing is allocated, the pager and its expert cache take the real decisions, and the
   recorded decode steps are replayed under the ``h200`` profile. Routing on meta has no values, so
   each token's experts are drawn per layer from a skewed popularity (Zipf, ``--zipf``), seeded;
   each layer reads its routing once (the host sync a GPU pays), recorded as a sync. Variants:
   ``offtensor`` (default placement, expert cache in the rest of the budget, no guesses: the
   honest figure), ``offtensor-all-experts-paged`` (every expert stack offloaded by policy, so the
   whole budget beyond the dense weights is expert cache), ``offtensor+assumed-guesses-NN%``
   (next-layer guesses of an ASSUMED accuracy, copied as the routing speculator copies them: meta
   has no router values to guess from, so no guess accuracy is measured here),
   ``offtensor-nocache`` (budget = one op's working set twice: every routed expert copied),
   ``copy-all`` (vLLM's cpu_offload at the same budget: the offloaded experts copied on the
   compute stream each forward, then the same ops), ``resident``. Experts run as transformers v5
   runs them, ``torch._grouped_mm`` over rows sorted by expert; offtensor runs it one expert per
   kernel, each waiting for its own copy, and the timeline records those kernels. Reported per
   variant: every replayed step's ratio to its bound, bytes copied that no op read.
2. **transformers Qwen3-MoE**, decode (batch 1) and small-batch prefill, random weights. Variants:
   ``resident``; ``copy-all`` (vLLM-style: offloaded expert stacks copied each forward into a
   state dict for ``torch.func.functional_call``); ``accelerate`` (GPU: ``dispatch_model`` with
   ``max_memory``); ``uva`` (GPU: expert stacks read in place from pinned memory by the kernels);
   ``offtensor`` (cache + routing speculation), ``offtensor-nospec`` (``prefetch=False``),
   ``offtensor-nocache`` (budget = dense weights + two working sets). Reports tokens/s, bytes per
   token, expert hit rate, guess accuracy and wasted bytes, routed bytes not cached per token, and
   the ratio to the bound max(all-resident time, uncached routed bytes / H2D).

JSON and PNG go to ``benchmarks/results/moe_bench_{cpu,cuda}.{json,png}`` plus the replayed
timeline's PNG (``moe_bench_replay.png``).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import offtensor as ot  # noqa: E402
from offtensor.pager import GiB, format_bytes, resolve_device  # noqa: E402
from offtensor.moe import guesses as guesses_mod  # noqa: E402
from offtensor.moe import speculation as speculation_mod  # noqa: E402
from offtensor.model.copies import state_of  # noqa: E402
from results_io import save_result  # noqa: E402
from uva import offload_params  # noqa: E402

# ---------------------------------------------------------------------------- DeepSeek-style stack


class _MLP(nn.Module):
    def __init__(self, hidden, inter, dtype):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden, inter, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(inter, hidden, bias=False, dtype=dtype)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _StackLayer(nn.Module):
    """A resident dense block standing in for attention/MLA, a router, 64 stacked experts in
    transformers v5's layout (``gate_up_proj`` [E, hidden, 2 inter], ``down_proj`` [E, inter,
    hidden], run by ``torch._grouped_mm`` over rows sorted by expert, as transformers' grouped-mm
    experts do), a shared expert. ``route`` (host int64 [tokens, top_k]) is the routing the
    router would give."""

    def __init__(self, hidden, experts, inter, dtype):
        super().__init__()
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(hidden, hidden, bias=False, dtype=dtype)
        self.self_attn.o_proj = nn.Linear(hidden, hidden, bias=False, dtype=dtype)
        self.mlp = nn.Module()
        self.mlp.gate = nn.Linear(hidden, experts, bias=False, dtype=dtype)
        self.mlp.experts = nn.Module()
        self.mlp.experts.gate_up_proj = nn.Parameter(torch.empty(experts, hidden, 2 * inter, dtype=dtype),
                                                     requires_grad=False)
        self.mlp.experts.down_proj = nn.Parameter(torch.empty(experts, inter, hidden, dtype=dtype), requires_grad=False)
        self.mlp.shared_experts = _MLP(hidden, inter, dtype)
        self.inter = inter

    def forward(self, x, route, after_gate_up=lambda: None):
        x = x + self.self_attn.o_proj(self.self_attn.q_proj(x))
        self.mlp.gate(x)  # the router's compute (its values decide nothing on meta)
        e = self.mlp.experts
        tokens, top_k = route.shape
        experts = e.gate_up_proj.shape[0]
        # Rows sorted by expert; ``offs`` ends each expert's group. offtensor's _grouped_mm reads
        # it once per layer (the host sync a GPU pays; the down projection reuses the read),
        # issues the layer's missing experts and runs one expert's kernel at a time.
        offs = torch.bincount(route.reshape(-1), minlength=experts).cumsum(0).to(torch.int32)
        rows = x.repeat_interleave(top_k, 0)  # on meta the order of the rows costs nothing
        h = torch._grouped_mm(rows, e.gate_up_proj, offs=offs)
        after_gate_up()
        h = F.silu(h[:, : self.inter]) * h[:, self.inter :]
        y = torch._grouped_mm(h, e.down_proj, offs=offs).view(tokens, top_k, -1).sum(1)
        return x + y + self.mlp.shared_experts(x)


class DeepSeekStyleStack(nn.Module):
    def __init__(self, layers=8, hidden=4096, experts=64, inter=1024, dtype=torch.bfloat16):
        super().__init__()
        self.layers = nn.ModuleList(_StackLayer(hidden, experts, inter, dtype) for _ in range(layers))

    def forward(self, x, routes, speculate=None):
        """``speculate(i)``: called once layer i's gate_up experts are issued (the assumed-guess
        variant copies layer i+1's guesses there)."""
        for i, (layer, route) in enumerate(zip(self.layers, routes)):
            x = layer(x, route, (lambda i=i: speculate(i)) if speculate is not None else (lambda: None))
        return x


def _guesses(routes, experts, accuracy, seed):
    """ASSUMED guesses (a parameter, not a measurement: on meta there are no router values to
    guess from): per step and layer, the routed experts in a random order (standing for the
    router's confidence) with ``1 - accuracy`` of them swapped for others, each with that chance."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in routes:
        layers = []
        for route in step:
            ids = route.reshape(-1).tolist()
            others = iter(e for e in torch.randperm(experts, generator=g).tolist() if e not in ids)
            right = torch.rand(len(ids), generator=g) < accuracy
            layers.append([e if ok else next(others) for e, ok in zip(ids, right.tolist())])
        out.append(layers)
    return out


class _AssumedSpeculation:
    """Copies layer i+1's given guesses once layer i's gate_up experts are issued, with the rule
    offtensor's RoutingSpeculator follows (its most confident ``SPECULATE_EXPERTS``, into room no
    op of the step still needs), and counts how many of the issued guesses the layer routed."""

    def __init__(self, model, guesses):
        self.model, self.guesses = model, guesses
        self.issued = self.right = 0

    def __call__(self, step, layer):
        if layer + 1 >= len(self.model.layers):
            return
        e = self.model.layers[layer + 1].mlp.experts
        guess = self.guesses[step][layer + 1][: speculation_mod.SPECULATE_EXPERTS]
        routed = set(self.routes[step][layer + 1].reshape(-1).tolist())
        self.issued += len(guess)
        self.right += len(set(guess) & routed)
        for w in (e.gate_up_proj, e.down_proj):
            if not isinstance(w, ot.OffloadedTensor):
                continue  # kept resident by placement
            pager = w._master.pager
            stack = pager.experts.by_master[w._master.id]
            with pager.experts.in_spare_room_only():  # guesses take only room no op of the step needs
                for expert in guess:
                    pager.prefetch(w._master, *stack.key_of(expert)[1:])


def _zipf_routes(layers, experts, top_k, steps, s, seed):
    """Per step, per layer, ``top_k`` distinct experts drawn with Zipf(s) popularity (a per-layer
    permutation decides which experts are popular)."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.arange(1, experts + 1, dtype=torch.float64) ** -s
    perms = [torch.randperm(experts, generator=g) for _ in range(layers)]
    return [[perms[l][torch.multinomial(weights, top_k, replacement=False, generator=g)].view(1, top_k)
             for l in range(layers)] for _ in range(steps)]


def replay_deepseek_stack(args, out_dir):
    layers, experts, top_k = args.layers, 64, 8
    with torch.device("meta"):
        model = DeepSeekStyleStack(layers=layers, experts=experts)
    expert_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    dense_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." not in n)
    one_expert = expert_bytes // (layers * experts)
    steps, warmup = 6, 6
    routes = _zipf_routes(layers, experts, top_k, steps + warmup, args.zipf, seed=0)
    x = torch.empty(1, 4096, dtype=torch.bfloat16, device="meta")
    budget_gb = (dense_bytes + args.cache_gb * GiB) / GiB
    # No cache: the budget holds the dense weights and two ops' working sets (8 experts of a stack),
    # which placement needs; nothing survives from one step to the next.
    nocache_gb = (dense_bytes + 2 * 8 * one_expert // 3 + 1) / GiB

    def planned(budget, speculation=None, policy=None):
        step = iter(range(10**9))

        def forward(x):
            i = next(step)
            return model(x, routes[i], (lambda layer: speculation(i, layer)) if speculation is not None else None)

        return ot.plan(model, budget_gb=budget, example_inputs=(x,), steps=steps, warmup=warmup, prefetch=False,
                       policy=policy, forward=forward)

    results = {}
    # The honest variant: default placement, no guesses; every copy is one the code issued for a
    # routing it had read.
    tl = planned(budget_gb)
    r = tl.replay("h200")
    results["offtensor"] = _replay_row(tl, r, steps)
    if out_dir is not None:
        tl.plot(os.path.join(out_dir, "moe_bench_replay.png"), profile="h200", steps=2,
                title=f"DeepSeek-style stack, {layers} x 64 experts x {one_expert / 1e6:.1f} MB, top-8, budget dense + "
                      f"{args.cache_gb} GiB, no guesses: {r.step_ms:.1f} ms/step, bound {r.bound_ms:.1f} ms "
                      f"(x{r.ratio_to_bound:.3f}); v = host sync")
    # Every expert stack offloaded (policy), so the whole budget beyond the dense weights is expert
    # cache, instead of default placement keeping whole stacks resident.
    cached = planned(budget_gb, policy={"offload": ["*.experts.*"]})
    results["offtensor-all-experts-paged"] = _replay_row(cached, cached.replay("h200"), steps)
    # Guesses of ASSUMED accuracy (meta has no router values to guess from): named for it.
    speculation = _AssumedSpeculation(model, _guesses(routes, experts, args.guess_accuracy, seed=1))
    speculation.routes = routes
    guessed = planned(budget_gb, speculation)
    name = f"offtensor+assumed-guesses-{args.guess_accuracy:.0%}"
    results[name] = _replay_row(guessed, guessed.replay("h200"), steps)
    results[name]["guess_accuracy_assumed"] = args.guess_accuracy
    results[name]["issued_guesses_routed"] = speculation.right / speculation.issued if speculation.issued else None
    nocache = planned(nocache_gb)
    results["offtensor-nocache"] = _replay_row(nocache, nocache.replay("h200"), steps)
    # At the same budget vLLM's cpu_offload keeps as much resident as fits and copies the rest
    # every forward: the bytes placement offloaded for the offtensor variant.
    results["copy-all"] = _replay_row_copy_all(tl, tl.info["offloaded_bytes"])
    results["resident"] = {"step_ms": r.compute_ms, "bound_ms": r.compute_ms, "ratio_to_bound": 1.0,
                           "routed_bytes_not_cached_per_step": 0}
    for row in results.values():
        row["tokens_per_s"] = 1e3 / row["step_ms"]
    return {
        "workload": {"layers": layers, "experts": experts, "top_k": top_k, "expert_bytes": one_expert,
                     "expert_bytes_total": expert_bytes, "dense_bytes": dense_bytes, "zipf": args.zipf,
                     "expert_kernel": "torch._grouped_mm (transformers v5 layout), one expert per kernel",
                     "assumed_guess_accuracy": args.guess_accuracy, "budget_bytes": int(budget_gb * GiB),
                     "nocache_budget_bytes": int(nocache_gb * GiB), "profile": "h200",
                     "decode_steps_replayed": steps, "warmup_steps": warmup},
        "variants": results,
        # Measured guesses need router values, which a meta plan has none of: the replay has none.
        "guess_accuracy_measured": None,
        "speedup_vs_copy_all": results["copy-all"]["step_ms"] / results["offtensor"]["step_ms"],
        "speedup_vs_copy_all_with_assumed_guesses": results["copy-all"]["step_ms"] / results[name]["step_ms"],
    }


def _replay_row(tl, r, steps):
    last = tl.steps - 1
    first = tl.steps - steps
    routed = tl.step_copy_bytes(last)
    syncs = sum(1 for rec in tl.records if rec.kind == "sync" and rec.step == last)
    copied = sum(rec.nbytes for rec in tl.records if rec.kind == "copy" and rec.step == last)
    read = {w for rec in tl.records if rec.kind == "op" for w in rec.waits}
    # Copies no op ever read (a guess that was wrong, or a copy evicted before its use): bytes the
    # copy stream spent for nothing, over the replayed steps.
    wasted = sum(rec.nbytes for rec in tl.records if rec.kind == "copy" and rec.step >= first and rec.id not in read)
    ratios = [r.steps_ms[s] / tl._step_bound(r.profile, s) for s in range(first, tl.steps)]
    return {"step_ms": r.step_ms, "bound_ms": r.bound_ms, "ratio_to_bound": r.ratio_to_bound,
            "compute_ms": r.compute_ms, "copy_busy": r.copy_busy, "routed_bytes_not_cached_per_step": routed,
            "bytes_per_token": copied, "host_syncs_per_step": syncs,
            "expert_hit_rate_all_steps": _hit_rate(tl.info.get("experts")),
            "wasted_copy_bytes_per_step": wasted / steps,
            "steps_ms": r.steps_ms[-steps:],
            # Every replayed step against its own bound (routing differs from step to step).
            "ratio_to_bound_per_step": ratios, "max_ratio_to_bound": max(ratios)}


def _hit_rate(per_stack):
    if not per_stack:
        return None
    hits = sum(r["hits"] for r in per_stack.values())
    looked_up = hits + sum(r["misses"] for r in per_stack.values())
    return hits / looked_up if looked_up else None


def _replay_row_copy_all(tl, expert_bytes):
    """vLLM's cpu_offload on the same ops: every offloaded expert copied on the compute stream at
    the start of the forward (functional_call's state dict), then the last step's ops."""
    last = tl.steps - 1
    copy_all = ot.Timeline()
    copy_all.add_copy(expert_bytes, stream="compute", name="copy all experts")
    for rec in tl.records:
        if rec.kind == "op" and rec.step == last:
            copy_all.add_op(rec.flops, rec.nbytes, rec.dtype, name=rec.name)
    r = copy_all.replay("h200")
    bound = max(r.compute_ms, ot.get_profile("h200").copy_ms(expert_bytes))  # the copy has no reader op
    return {"step_ms": r.step_ms, "bound_ms": bound, "ratio_to_bound": r.step_ms / bound,
            "bytes_per_token": expert_bytes, "routed_bytes_not_cached_per_step": expert_bytes}


# ---------------------------------------------------------------------------- transformers Qwen3-MoE


def qwen3_moe(device, gpu: bool):
    import transformers

    if gpu:  # the H200 MoE workload: 24 layers x 64 experts, top-8, about 15 GB of random bf16
        config = transformers.Qwen3MoeConfig(
            vocab_size=32000, hidden_size=2048, num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=4,
            head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=64, num_experts_per_tok=8,
            decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=4096,
        )
        dtype = torch.bfloat16
    else:
        config = transformers.Qwen3MoeConfig(
            vocab_size=1024, hidden_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, intermediate_size=512, moe_intermediate_size=256, num_experts=32, num_experts_per_tok=4,
            decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=512,
        )
        dtype = torch.float32
    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    model = model.to_empty(device="cpu").to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model, config


def _expert_stacks(model):
    return [(n, p) for n, p in model.named_parameters() if ".experts." in n and p.dim() == 3]


def _greedy(model, ids, new_tokens, sync, after_prefill=lambda: None):
    """Prefill ``ids`` then decode ``new_tokens`` greedily; (prefill s, decode s per token, tokens)."""
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        sync()
        prefill = time.perf_counter() - t0
        after_prefill()
        tokens = [token]
        t0 = time.perf_counter()
        for _ in range(new_tokens - 1):
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            tokens.append(token)
        sync()
        decode = (time.perf_counter() - t0) / max(new_tokens - 1, 1)
    return prefill, decode, torch.cat(tokens, 1).cpu()


class _Counter:
    """Bytes moved and routed-not-cached bytes of an offtensor-wrapped model, step by step."""

    def __init__(self, model):
        self.pager = state_of(model).pager
        self.uncached = 0
        self._cached = None
        model.register_forward_pre_hook(self._before)
        model.register_forward_hook(self._after)

    def _before(self, module, args):
        self._cached = set(self.pager.cache.entries)

    def _after(self, module, args, out):
        routed = self.pager.experts.routed_keys() if self.pager.experts is not None else {}
        self.uncached += sum(b for k, b in routed.items() if k not in self._cached)


def run_qwen(args, device):
    gpu = device.type == "cuda"
    base, config = qwen3_moe(device, gpu)
    total = sum(p.numel() * p.element_size() for p in base.parameters())
    experts = sum(p.numel() * p.element_size() for _, p in _expert_stacks(base))
    budget_gb = args.budget_gb if args.budget_gb is not None else (total - experts + 0.3 * experts) / GiB
    one = max(p.numel() * p.element_size() // p.shape[0] for _, p in _expert_stacks(base))
    nocache_gb = (total - experts + 2 * 8 * one) / GiB
    gen = torch.Generator().manual_seed(1)
    sync = (lambda: torch.cuda.synchronize(device)) if gpu else (lambda: None)
    decode_ids = torch.randint(0, config.vocab_size, (1, 8), generator=gen).to(device)
    prefill_ids = torch.randint(0, config.vocab_size, (4, 64 if gpu else 16), generator=gen).to(device)
    new_tokens = args.tokens
    h2d = _h2d_gbps(device)
    rows, tokens_of = {}, {}

    def record(name, model, counter=None, wrapped=False):
        _greedy(model, decode_ids, 3, sync)  # warm-up: first dispatches, the learned orders

        def decode_only():  # the figures per token are the decode steps'
            if wrapped:
                ot.reset_stats(model)
                counter.uncached = 0

        prefill, decode, tokens = _greedy(model, decode_ids, new_tokens, sync, decode_only)
        row = {"decode_tokens_per_s": 1 / decode, "decode_ms": decode * 1e3}
        if wrapped:
            s = ot.stats(model)
            steps = new_tokens - 1  # one-token decode steps
            looked = sum(r["hits"] + r["misses"] for r in s.experts.values())
            row.update({
                "bytes_per_token": s.bytes_h2d / steps, "routed_bytes_not_cached_per_token": counter.uncached / steps,
                "bytes_over_uncached_routed": s.bytes_h2d / counter.uncached if counter.uncached else None,
                "expert_hit_rate": sum(r["hits"] for r in s.experts.values()) / looked if looked else None,
                "guess_accuracy": s.guesses["accuracy"] if s.guesses else None,
                "guess_recall": s.guesses["recall"] if s.guesses else None,
                "prefetched_bytes": s.guesses["prefetched_bytes"] if s.guesses else 0,
                "wasted_bytes": s.guesses["wasted_bytes"] if s.guesses else 0,
                "peak_device_bytes": s.peak_device_bytes, "budget_bytes": s.budget_bytes,
            })
        t0 = time.perf_counter()
        with torch.no_grad():
            model(input_ids=prefill_ids)
        sync()
        row["prefill_tokens_per_s"] = prefill_ids.numel() / (time.perf_counter() - t0)
        rows[name], tokens_of[name] = row, tokens
        print(f"{name:20s} decode {row['decode_tokens_per_s']:8.2f} tok/s  prefill {row['prefill_tokens_per_s']:9.1f} tok/s"
              + (f"  {format_bytes(row['bytes_per_token'])}/token, hit {row['expert_hit_rate']:.2f}"
                 if wrapped and row["expert_hit_rate"] is not None else ""))

    resident = copy.deepcopy(base).to(device)
    record("resident", resident)
    rows["resident"]["bytes_per_token"] = 0
    copied = _copy_all_variant(resident, base, device, record, sync)
    rows["copy-all"]["bytes_per_token"] = copied
    del resident
    if gpu:
        _accelerate_variant(base, device, budget_gb, record)
        _uva_variant(base, device, record)
    for name, budget, prefetch in (("offtensor", budget_gb, True), ("offtensor-nospec", budget_gb, False),
                                   ("offtensor-nocache", nocache_gb, False)):
        model = ot.wrap_model(copy.deepcopy(base), budget_gb=budget, device=device, prefetch=prefetch)
        record(name, model, _Counter(model), wrapped=True)
        ot.unwrap_model(model)
        del model
    compute = 1 / rows["resident"]["decode_tokens_per_s"]
    for name, row in rows.items():
        uncached = row.get("routed_bytes_not_cached_per_token")
        if uncached is not None:
            bound = max(compute, uncached / (h2d * 1e9))
            row["bound_ms"] = bound * 1e3
            row["ratio_to_bound"] = row["decode_ms"] / row["bound_ms"]
        row["same_tokens_as_resident"] = bool(torch.equal(tokens_of[name], tokens_of["resident"]))
    return {
        "workload": {"model": "transformers Qwen3-MoE, random weights", "layers": config.num_hidden_layers,
                     "experts": config.num_experts, "top_k": config.num_experts_per_tok, "weight_bytes": total,
                     "expert_bytes": experts, "budget_bytes": int(budget_gb * GiB),
                     "nocache_budget_bytes": int(nocache_gb * GiB), "decode_tokens": new_tokens,
                     "prefill_batch": list(prefill_ids.shape), "h2d_gbps": h2d},
        "variants": rows,
    }


def _h2d_gbps(device) -> float:
    return ot.measure_profile(device).h2d_gbps if device.type == "cuda" else _cpu_copy_gbps()


def _cpu_copy_gbps() -> float:
    src = torch.empty(64 << 20, dtype=torch.uint8)
    src.fill_(1)
    t0 = time.perf_counter()
    for _ in range(5):
        torch.empty_like(src).copy_(src)
    return 5 * src.numel() / (time.perf_counter() - t0) / 1e9


def _copy_all_variant(resident, base, device, record, sync):
    """vLLM's cpu_offload: the offloaded weights (here every routed expert stack) live on the host
    and each forward copies them into a state dict for ``torch.func.functional_call``."""
    host = {n: (p.detach().pin_memory() if device.type == "cuda" else p.detach().clone()) for n, p in _expert_stacks(base)}

    class _CopyAll(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = resident

        def forward(self, **kwargs):
            weights = {n: w.to(device, non_blocking=True, copy=True) for n, w in host.items()}
            return torch.func.functional_call(self.inner, weights, (), kwargs)

    record("copy-all", _CopyAll())  # record() fills rows["copy-all"]
    return sum(w.numel() * w.element_size() for w in host.values())  # copied every forward


def _accelerate_variant(base, device, budget_gb, record):
    try:
        from accelerate import dispatch_model, infer_auto_device_map
    except ImportError:
        return
    model = copy.deepcopy(base)
    device_map = infer_auto_device_map(model, max_memory={device.index or 0: f"{budget_gb:.2f}GiB", "cpu": "200GiB"},
                                       no_split_module_classes=["Qwen3MoeDecoderLayer"])
    dispatch_model(model, device_map=device_map)
    record("accelerate", model)


def _uva_variant(base, device, record):
    """The expert stacks stay in pinned host memory and the kernels read them in place (zero-copy
    CUDA views, benchmarks/uva.py); everything else is resident."""
    model = copy.deepcopy(base)
    model._uva_sources = offload_params(model, [name for name, _ in _expert_stacks(model)], device)
    model.to(device)
    record("uva", model)


# ---------------------------------------------------------------------------- main


def plot(result, path):
    from offtensor._optional import pyplot

    plt = pyplot()
    if plt is None:  # no matplotlib: warned once, the PNG is skipped
        return None

    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    replay = result["deepseek_stack_replay"]["variants"]
    names = list(replay)
    axes[0].bar(names, [replay[n]["step_ms"] for n in names], color="#4477aa")
    axes[0].bar(names, [replay[n]["bound_ms"] for n in names], fill=False, edgecolor="green", label="bound")
    axes[0].set_yscale("log")
    axes[0].set_ylabel("ms per decode step (h200 replay)")
    axes[0].set_title("DeepSeek-style stack, replayed", fontsize=9)
    axes[0].legend(fontsize=8)
    qwen = result.get("qwen3_moe")
    if qwen:
        rows = qwen["variants"]
        names = list(rows)
        axes[1].bar(names, [rows[n]["decode_tokens_per_s"] for n in names], color="#ee7733")
        axes[1].set_ylabel("decode tokens/s")
        axes[1].set_title(f"Qwen3-MoE ({result['device']})", fontsize=9)
        wrapped = [n for n in names if "bytes_per_token" in rows[n] and n.startswith("offtensor")]
        axes[2].bar(wrapped, [rows[n]["bytes_per_token"] / 1e6 for n in wrapped], color="#cc3311", label="moved")
        axes[2].bar(wrapped, [rows[n]["routed_bytes_not_cached_per_token"] / 1e6 for n in wrapped], fill=False,
                    edgecolor="black", label="routed, not cached")
        axes[2].set_ylabel("MB per token")
        axes[2].legend(fontsize=8)
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


# ---------------------------------------------------------------------------- plans driven by measured routing

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--layers", type=int, default=8, help="layers of the DeepSeek-style stack")
    p.add_argument("--cache-gb", type=float, default=4.0, help="GiB of expert cache beside the stack's dense weights")
    p.add_argument("--zipf", type=float, default=1.0, help="skew of the stack's synthetic routing")
    p.add_argument("--guess-accuracy", type=float, default=guesses_mod.SPECULATE_PRECISION,
                   help="share of the next layer's experts the ASSUMED guesses of the replay's "
                        "offtensor+assumed-guesses variant get right (a parameter, not a measurement; default: the "
                        "precision a router must show before offtensor copies its guesses)")
    p.add_argument("--budget-gb", type=float, default=None, help="Qwen3-MoE budget (default: dense + 30%% of experts)")
    p.add_argument("--tokens", type=int, default=None, help="decoded tokens per variant")
    p.add_argument("--replay-only", action="store_true")
    p.add_argument("--plans", action="store_true", help="the decode plans instead (benchmarks/moe_plans.py, which "
                   "takes the rest of the arguments)")
    if argv is None:
        argv = sys.argv[1:]
    if "--plans" in argv:
        import moe_plans

        return moe_plans.main([a for a in argv if a != "--plans"])
    args = p.parse_args(argv)
    device = resolve_device(args.device)
    if args.tokens is None:
        args.tokens = 16 if device.type == "cuda" else 12  # accelerate decodes at ~0.33 tok/s on the H200
    os.makedirs(args.out, exist_ok=True)
    result = {"device": str(device)}
    replay = replay_deepseek_stack(args, args.out)
    result["deepseek_stack_replay"] = replay
    for name, row in replay["variants"].items():
        print(f"{name:20s} replay {row['step_ms']:8.2f} ms/step, bound {row['bound_ms']:8.2f} ms, "
              f"ratio {row['ratio_to_bound']:.3f}")
    print(f"speed-up over copy-all: {replay['speedup_vs_copy_all']:.1f}x")
    if not args.replay_only:
        result["qwen3_moe"] = run_qwen(args, device)
    suffix = "cuda" if device.type == "cuda" else "cpu"
    save_result(args.out, f"moe_bench_{suffix}.json", "moe_bench", device, argv, result)
    plot(result, os.path.join(args.out, f"moe_bench_{suffix}.png"))
    return result


if __name__ == "__main__":
    main()
