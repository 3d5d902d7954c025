"""Greedy decode of an MoE toy model whose routed experts are served from a device-side expert pool
(``wrap_model(..., expert_pool=True)``), eager and as a captured CUDA graph, against the resident
model (eager and captured) and today's wrapped path (the expert cache, one host read of the routing
per layer), measured in one run. Every variant must produce the resident model's greedy tokens.

The model: a resident embedding and head around ``--layers`` transformers Mixtral sparse-MoE blocks
(router + ``--experts`` experts, top-2, transformers' default grouped-GEMM experts forward). Every
expert stack is offloaded; the pool holds ``--pool-fraction`` of all experts, so decode steps miss
and fetch (on a GPU: the masked gather kernel reading pinned memory through its device address).
The captured graph replays the pool's LRU decisions and fetches with no Python and no host sync.

    python benchmarks/pool_graph_decode.py [--device cuda] [--hidden 1024] [--layers 8] [--experts 16]
                                           [--tokens 32] [--pool-fraction 0.5]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import offtensor as ot  # noqa: E402
from results_io import save_result  # noqa: E402

GiB = 1 << 30


class MoeLM(nn.Module):
    def __init__(self, args, dtype):
        super().__init__()
        import transformers
        from transformers.models.mixtral import modeling_mixtral

        config = transformers.MixtralConfig(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
            num_hidden_layers=args.layers, num_local_experts=args.experts, num_experts_per_tok=2,
            num_attention_heads=8, num_key_value_heads=4)
        config._experts_implementation = "grouped_mm"  # transformers' default in a full model
        self.config = config
        self.embed = nn.Embedding(args.vocab, args.hidden, dtype=dtype)
        self.layers = nn.ModuleList(modeling_mixtral.MixtralSparseMoeBlock(config) for _ in range(args.layers))
        self.head = nn.Linear(args.hidden, args.vocab, bias=False, dtype=dtype)
        for p in self.parameters():
            nn.init.normal_(p, std=p.shape[-1] ** -0.5 if p.dim() > 1 else 0.02)
        self.to(dtype)

    def forward(self, token):
        h = self.embed(token)
        for layer in self.layers:
            out = layer(h)
            h = h + (out[0] if isinstance(out, tuple) else out)
        return self.head(h)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_eager(model, start, tokens, device):
    token, out = start, []
    with torch.no_grad():
        model(token)  # warm-up (the pool's first fetches, kernels' first launches)
        _sync(device)
        began = time.perf_counter()
        for _ in range(tokens):
            token = model(token).argmax(-1)
            out.append(token)
        _sync(device)
    return torch.cat(out, -1), (time.perf_counter() - began) / tokens


def decode_graph(model, start, tokens, device):
    """The step captured once (after a warm-up on a side stream) and replayed per token."""
    with torch.no_grad():
        static = start.clone()
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                model(static)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = model(static)
        static.copy_(start)
        out = []
        _sync(device)
        began = time.perf_counter()
        for _ in range(tokens):
            graph.replay()
            static.copy_(logits.argmax(-1))
            out.append(static.clone())
        _sync(device)
    return torch.cat(out, -1), (time.perf_counter() - began) / tokens


def _budget(model, fraction):
    experts = {n: p for n, p in model.named_parameters() if ".experts." in n}
    layers = {n.rpartition(".")[0] for n in experts}
    slot = sum(p[0].numel() * p.element_size() for p in experts.values()) // len(layers)
    total = sum(p.shape[0] for n, p in experts.items() if n.endswith("gate_up_proj"))
    resident = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n not in experts)
    slots = max(2, int(fraction * total))
    return resident + slot + slots * slot + slot // 2, slots


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--pool-fraction", type=float, default=0.5)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # grouped_mm is bf16 on CUDA
    torch.manual_seed(0)
    base = MoeLM(args, dtype).eval()
    start = torch.tensor([[3]], device=device)
    budget, slots = _budget(base, args.pool_fraction)
    resident = copy.deepcopy(base).to(device)
    rows, expected = {}, None

    def record(name, fn, model):
        nonlocal expected
        try:
            tokens, seconds = fn(model, start, args.tokens, device)
        except Exception as error:  # a figure per mode: one failing mode leaves the others' figures
            rows[name] = {"error": f"{type(error).__name__}: {error}"[:400]}
            print(f"{name:>16}: {rows[name]['error']}")
            return
        expected = tokens if expected is None else expected
        rows[name] = {"ms_per_token": seconds * 1e3, "tok_per_s": 1 / seconds,
                      "tokens_match_resident": bool(torch.equal(tokens, expected))}
        print(f"{name:>16}: {seconds * 1e3:8.3f} ms/token  {1 / seconds:8.1f} tok/s  "
              f"tokens {'match' if rows[name]['tokens_match_resident'] else 'DIFFER'}")

    record("resident", decode_eager, resident)
    if device.type == "cuda":
        record("resident_graph", decode_graph, resident)
    today = copy.deepcopy(base)
    ot.wrap_model(today, budget_gb=budget / GiB, device=device, policy=["*.experts.*"])
    record("wrapped", decode_eager, today)
    del today
    pooled = copy.deepcopy(base)
    ot.wrap_model(pooled, budget_gb=budget / GiB, device=device, policy=["*.experts.*"], expert_pool=True)
    pools = next(t for t in pooled.parameters() if isinstance(t, ot.OffloadedTensor))._master.pager.expert_pool
    record("pooled", decode_eager, pooled)
    if device.type == "cuda":
        record("pooled_graph", decode_graph, pooled)
    body = {"model": f"{args.layers} Mixtral MoE blocks x {args.experts} experts (top-2), hidden {args.hidden}, "
                     f"{str(dtype).replace('torch.', '')}", "budget_bytes": budget, "pool": pools.report(),
            "pool_slots_asked": slots, "tokens": args.tokens, "modes": rows}
    for name in ("pooled", "pooled_graph", "wrapped"):
        if "tok_per_s" in rows.get(name, {}) and "tok_per_s" in rows.get("resident", {}):
            body[f"{name}_over_resident_tok_s"] = rows[name]["tok_per_s"] / rows["resident"]["tok_per_s"]
    save_result(args.out, f"pool_graph_decode_{device.type}.json", "MoE decode from a device-side expert pool, "
                "eager and as a CUDA graph", device, argv, body)
    return body


if __name__ == "__main__":
    main()
