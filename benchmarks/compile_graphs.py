"""torch.compile of wrapped models: graph breaks, compile time and outputs against the unwrapped
model, measured in one run.

For each model (the reference DeepSeek-style model, tiny transformers Llama and Qwen3-MoE) this
reports ``torch._dynamo.explain`` graph and break counts unwrapped and wrapped (at a fraction of the
weight bytes), the first-call (compile) and steady-state time of ``torch.compile`` with each
backend, the largest logit difference against the unwrapped eager model, and whether later steps
recompiled. Breaks that the unwrapped model also has (``.tolist()`` in the reference MoE) are the
model's own.

    python benchmarks/compile_graphs.py [--device cpu|cuda] [--backends aot_eager,inductor] [--fraction 0.4]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import offtensor as ot  # noqa: E402
from results_io import save_result  # noqa: E402

GiB = 1 << 30


def _deepseek():
    import dataclasses

    from offtensor.models import CONFIGS, DeepSeekForCausalLM

    config = dataclasses.replace(CONFIGS["tiny"], q_lora_rank=0)
    return DeepSeekForCausalLM.empty(config).init_weights(seed=0), 256


def _transformers(name):
    from offtensor.models.tiny import tiny_transformers

    return tiny_transformers(name), 128


MODELS = {"deepseek_reference": _deepseek, "llama": lambda: _transformers("llama"),
          "qwen3_moe": lambda: _transformers("qwen3_moe")}


def _logits(model, ids):
    out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def _weight_bytes(model):
    return sum({id(t): t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]}.values())


def measure(name, args, device):
    import torch._dynamo

    base, vocab = MODELS[name]()
    base = base.to(device).eval()
    ids = torch.randint(0, vocab, (1, 8), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        reference = _logits(base, ids)
    result = {"weight_bytes": _weight_bytes(base)}
    torch._dynamo.reset()
    with torch.no_grad():
        plain = torch._dynamo.explain(lambda i: _logits(base, i))(ids)
    result["unwrapped"] = {"graphs": plain.graph_count, "breaks": plain.graph_break_count}
    wrapped = copy.deepcopy(base)
    ot.wrap_model(wrapped, budget_gb=args.fraction * result["weight_bytes"] / GiB, device=device)
    torch._dynamo.reset()
    with torch.no_grad():
        ex = torch._dynamo.explain(lambda i: _logits(wrapped, i))(ids)
    result["wrapped"] = {
        "graphs": ex.graph_count, "breaks": ex.graph_break_count,
        "reasons": sorted({r.reason.splitlines()[0][:160] for r in ex.break_reasons}),
    }
    for backend in args.backends.split(","):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        compiled = torch.compile(wrapped, backend=backend)
        with torch.no_grad():
            start = time.perf_counter()
            first = _logits(compiled, ids)
            compile_s = time.perf_counter() - start
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            start = time.perf_counter()
            for _ in range(args.steps):
                later = _logits(compiled, ids)
            step_s = (time.perf_counter() - start) / args.steps
            recompiled = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
        result[backend] = {
            "first_call_s": round(compile_s, 2), "step_s": round(step_s, 4),
            "max_abs_diff": float(max((first - reference).abs().max(), (later - reference).abs().max())),
            "graphs_compiled_after_first_call": recompiled,
        }
    print(name, result, flush=True)
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backends", default="aot_eager,inductor")
    parser.add_argument("--fraction", type=float, default=0.4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))  # leave the copy worker a core
    results = {name: measure(name, args, device) for name in args.models.split(",")}
    path = save_result(args.out, f"compile_graphs_{device.type}.json", "compile_graphs", device, argv,
                       {"fraction": args.fraction, "models": results})
    print("wrote", path)


if __name__ == "__main__":
    main()
