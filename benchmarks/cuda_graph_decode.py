"""Greedy decode of a wrapped decoder-shaped toy model: eager, torch.compile (aot_eager) and a
captured CUDA graph of the compiled step, against the unwrapped model, measured in one run.

The model has a resident embedding and offloaded MLP blocks and lm_head; the budget holds
``--fraction`` of the weights. Eager and compiled steps page through the pager (cache, prefetch);
the CUDA graph copies every offloaded weight from its pinned master into graph memory on each
replay (ops/compile.py's capture path), so it moves all offloaded bytes per token but launches the
step as one graph. Every variant must produce the unwrapped greedy tokens.

    python benchmarks/cuda_graph_decode.py [--width 2048] [--layers 8] [--tokens 32] [--fraction 0.5]
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

GiB = 1 << 30


class ToyLM(nn.Module):
    def __init__(self, vocab, width, layers, dtype):
        super().__init__()
        self.embed = nn.Embedding(vocab, width, dtype=dtype)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 4 * width, dtype=dtype), nn.GELU(), nn.Linear(4 * width, width, dtype=dtype))
            for _ in range(layers))
        self.head = nn.Linear(width, vocab, bias=False, dtype=dtype)
        for p in self.parameters():
            nn.init.normal_(p, std=p.shape[-1] ** -0.5 if p.dim() > 1 else 0.02)

    def forward(self, token):
        h = self.embed(token)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fraction", type=float, default=0.5)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    base = ToyLM(args.vocab, args.width, args.layers, dtype).eval()
    reference = copy.deepcopy(base).to(device)
    weight_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    ot.wrap_model(base, budget_gb=args.fraction * weight_bytes / GiB, device=device,
                  policy=lambda name: "keep" if name.startswith("embed") else None)
    start = torch.tensor([[1]], device=device)
    variants = {"unwrapped eager": reference, "wrapped eager": base}
    with torch.no_grad():
        compiled = torch.compile(base, backend="aot_eager")
        compiled(start)
        variants["wrapped compiled"] = compiled
        if device.type == "cuda":
            variants["wrapped CUDA graph"], replay_bytes = graphed(compiled, start, device,
                                                                   lambda: ot.stats(base).bytes_h2d)
        expected, _ = decode(reference, start, args.tokens, device)
        times = {name: [] for name in variants}
        same, h2d = {}, {}
        for _ in range(args.repeats):  # interleaved, medians reported
            for name, step in variants.items():
                ot.reset_stats(base)
                tokens, seconds = decode(step, start, args.tokens, device)
                times[name].append(seconds * 1e3)
                same[name] = bool(torch.equal(tokens, expected))
                if name == "wrapped CUDA graph":
                    h2d[name] = replay_bytes
                else:
                    h2d[name] = 0 if name == "unwrapped eager" else ot.stats(base).bytes_h2d // args.tokens
    results = {name: {"ms_per_token": round(statistics.median(t), 3), "same_tokens": same[name],
                      "h2d_bytes_per_token": h2d[name]} for name, t in times.items()}
    s = ot.stats(base)
    body = {"weight_bytes": weight_bytes, "offloaded_bytes": s.offloaded_bytes, "budget_bytes": s.budget_bytes,
            "tokens": args.tokens, "variants": results}
    print(body)
    print("wrote", save_result(args.out, f"cuda_graph_decode_{device.type}.json", "cuda_graph_decode", device, argv,
                               body))
    if not all(same.values()):
        raise SystemExit("tokens differ from the unwrapped model")


if __name__ == "__main__":
    main()
