"""Greedy decode of an MoE toy model whose routed experts are served from a device-side expert pool
(``wrap_model(..., expert_pool=True)``), eager and as a captured CUDA graph, against the resident
model (eager and captured), a UVA-style offload at the same device budget (eager and captured) and
today's wrapped path (the expert cache, one host read of the routing per layer), alternating in one
run. Every variant must produce the resident model's greedy tokens.

The model: a resident embedding and head around ``--layers`` transformers Mixtral sparse-MoE blocks
(router + ``--experts`` experts, top-2, transformers' default grouped-GEMM experts forward). Every
expert stack is offloaded; the pool holds ``--pool-fraction`` of all experts, so decode steps miss
and fetch (on a GPU: the masked gather kernel reading pinned memory through its device address).
The captured graph replays the pool's LRU decisions and fetches with no Python and no host sync.

The UVA offload (GPU only) is what vLLM's ``cpu_offload_gb`` does: at the same budget, the layers'
expert stacks the budget holds beside the other weights stay on the device, the others stay in
pinned host memory and the grouped GEMMs read them there, through their device address, on every
step (benchmarks/uva.py). A variant that fails (say the UVA views on a system without unified
addressing) is recorded with its error, and the others still run.

    python benchmarks/pool_graph_decode.py [--device cuda] [--hidden 1024] [--layers 8] [--experts 16]
                                           [--tokens 32] [--repeats 3] [--pool-fraction 0.5]
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import offtensor as ot  # noqa: E402
from decode_steps import decode, graphed  # noqa: E402
from results_io import save_result  # noqa: E402
from uva import offload_params  # noqa: E402

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


def _budget(model, fraction):
    experts = {n: p for n, p in model.named_parameters() if ".experts." in n}
    layers = {n.rpartition(".")[0] for n in experts}
    slot = sum(p[0].numel() * p.element_size() for p in experts.values()) // len(layers)
    total = sum(p.shape[0] for n, p in experts.items() if n.endswith("gate_up_proj"))
    resident = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n not in experts)
    slots = max(2, int(fraction * total))
    return resident + slot + slots * slot + slot // 2, slots


def _expert_layers(model) -> dict:
    """Each MoE layer's expert stacks (parameter names), in layer order."""
    layers: dict = {}
    for name, _ in model.named_parameters():
        if ".experts." in name:
            layers.setdefault(name.rpartition(".")[0], []).append(name)
    return layers


def uva_model(base, budget: int, device):
    """The UVA-style offload at ``budget`` device bytes: the weights that are not experts resident,
    then whole layers' expert stacks on the device while they fit beside them (in layer order), the
    other layers' read in place from pinned host memory. (the model, its layers kept on the device)"""
    model = copy.deepcopy(base)
    params = dict(model.named_parameters())
    layers = _expert_layers(model)
    experts = {n for names in layers.values() for n in names}
    room = budget - sum(p.numel() * p.element_size() for n, p in params.items() if n not in experts)
    offloaded, kept = [], 0
    for names in layers.values():
        nbytes = sum(params[n].numel() * params[n].element_size() for n in names)
        if nbytes <= room:
            room, kept = room - nbytes, kept + 1
        else:
            offloaded += names
    model._uva_sources = offload_params(model, offloaded, device)
    return model.to(device), kept


def _variants(args, base, budget, device) -> tuple:
    """name -> a decode step (``step(token) -> logits``) or the error that building it raised, and
    the pooled model (for its pool's figures)."""
    steps: dict = {}

    def add(name, build):
        try:
            steps[name] = build()
        except Exception as error:  # a figure per variant: one failing leaves the others' figures
            steps[name] = error

    resident = copy.deepcopy(base).to(device)
    cuda = device.type == "cuda"
    start = torch.tensor([[3]], device=device)
    add("resident", lambda: resident)
    if cuda:
        add("resident_graph", lambda: graphed(resident, start, device)[0])
        built = {}
        add("uva", lambda: built.setdefault("uva", uva_model(base, budget, device))[0])
        if "uva" in built:
            add("uva_graph", lambda: graphed(built["uva"][0], start, device)[0])
            steps["uva_layers_on_device"] = built["uva"][1]
    today = copy.deepcopy(base)
    add("wrapped", lambda: ot.wrap_model(today, budget_gb=budget / GiB, device=device, policy=["*.experts.*"]))
    # The same without routing guesses (the expert cache alone): what the guesses' copies and their
    # host work come to in wall-clock time.
    alone = copy.deepcopy(base)
    add("wrapped_no_guesses", lambda: ot.wrap_model(alone, budget_gb=budget / GiB, device=device,
                                                    policy=["*.experts.*"], prefetch=False))
    pooled = copy.deepcopy(base)
    add("pooled", lambda: ot.wrap_model(pooled, budget_gb=budget / GiB, device=device, policy=["*.experts.*"],
                                        expert_pool=True))
    if cuda and not isinstance(steps["pooled"], Exception):
        add("pooled_graph", lambda: graphed(pooled, start, device)[0])
    return steps, pooled, start


def measure(args, steps, pooled, start, device) -> dict:
    """Each variant decoded ``args.repeats`` times, alternating (drift hits all alike): the median
    ms and tok/s, whether its tokens are the resident model's, and for the pooled ones the pool's
    fetches per token (counted on the device, read after the timed steps)."""
    rows = {name: {"error": f"{type(s).__name__}: {s}"[:400]} for name, s in steps.items() if isinstance(s, Exception)}
    live = {name: s for name, s in steps.items() if callable(s) and name not in rows}
    times: dict = {name: [] for name in live}
    expected = None
    for _ in range(args.repeats):
        for name, step in list(live.items()):
            if name.startswith("pooled"):
                ot.reset_stats(pooled)
            try:
                tokens, seconds = decode(step, start, args.tokens, device, warmup=1)
            except Exception as error:  # reported, and left out of the later rounds
                rows[name] = {"error": f"{type(error).__name__}: {error}"[:400]}
                del live[name]
                continue
            expected = tokens if expected is None else expected
            times[name].append(seconds)
            row = rows.setdefault(name, {})
            row["tokens_match_resident"] = row.get("tokens_match_resident", True) and bool(torch.equal(tokens, expected))
            if name.startswith("pooled"):
                pool = ot.stats(pooled).expert_pool
                row["pool_fetches_per_token"] = pool["fetches"] / (args.tokens + 1)
                row["pool_bytes_h2d_per_token"] = pool["bytes_h2d"] / (args.tokens + 1)
    for name in live:
        seconds = statistics.median(times[name])
        rows[name].update(ms_per_token=seconds * 1e3, tok_per_s=1 / seconds)
        print(f"{name:>16}: {seconds * 1e3:8.3f} ms/token  {1 / seconds:8.1f} tok/s  "
              f"tokens {'match' if rows[name]['tokens_match_resident'] else 'DIFFER'}")
    for name, row in rows.items():
        if "error" in row:
            print(f"{name:>16}: {row['error']}")
    return rows


def _ratios(rows) -> dict:
    """tok/s of each variant over the resident model's, and of the pooled ones over the UVA ones'."""
    tok = {name: row["tok_per_s"] for name, row in rows.items() if "tok_per_s" in row}
    out = {}
    for name in ("pooled", "pooled_graph", "uva", "uva_graph", "wrapped", "wrapped_no_guesses", "resident_graph"):
        for against in ("resident", "uva", "uva_graph"):
            if name in tok and against in tok and name != against and (against == "resident" or name.startswith("pooled")):
                out[f"{name}_over_{against}_tok_s"] = tok[name] / tok[against]
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="rounds over the variants, alternating; medians")
    p.add_argument("--pool-fraction", type=float, default=0.5)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # grouped_mm is bf16 on CUDA
    torch.manual_seed(0)
    base = MoeLM(args, dtype).eval()
    budget, slots = _budget(base, args.pool_fraction)
    steps, pooled, start = _variants(args, base, budget, device)
    uva_layers = steps.pop("uva_layers_on_device", None)
    rows = measure(args, steps, pooled, start, device)
    if device.type != "cuda":
        rows["uva"] = {"skipped": "a UVA offload reads pinned host memory from a GPU's kernels: GPU only"}
    pools = next(t for t in pooled.parameters() if isinstance(t, ot.OffloadedTensor))._master.pager.expert_pool
    body = {"model": f"{args.layers} Mixtral MoE blocks x {args.experts} experts (top-2), hidden {args.hidden}, "
                     f"{str(dtype).replace('torch.', '')}", "budget_bytes": budget, "pool": pools.report(),
            "pool_slots_asked": slots, "uva_layers_on_device": uva_layers, "tokens": args.tokens,
            "repeats": args.repeats, "modes": rows, **_ratios(rows)}
    save_result(args.out, f"pool_graph_decode_{device.type}.json", "MoE decode from a device-side expert pool, "
                "eager and as a CUDA graph, against the resident model and a UVA-style offload", device, argv, body)
    return body


if __name__ == "__main__":
    main()
