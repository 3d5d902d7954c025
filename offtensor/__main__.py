"""``python -m offtensor <command>``: ``demo`` (offtensor/demo.py) and ``plan`` (below)."""

import argparse
import math
import os
import sys
import time

USAGE = """usage: python -m offtensor demo [--device cpu|cuda] [--tokens N] [--budget-fraction F] [--size small|medium|large]
       python -m offtensor plan [--layers 24 --hidden 8192 --ffn 24576 | --config config.json|checkpoint_dir] [--dtype bf16]
                                [--budget-gb G | --offload-layers N | --offload-gb G] [--profile h200|h100]
                                [--prefill-tokens 4096] [--decode-tokens 1] [--steps 2] [--no-prefetch]
                                [--routing routing.json]
                                [--png plan.png] [--trace plan.json]"""

DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16", "fp32": "float32",
          "float32": "float32"}


def plan_main(argv) -> int:
    """What a model does on a GPU profile at a budget, predicted on this machine: placement, pager
    and prefetch run on the meta device (nothing is allocated), the replay gives the times. The
    model is a dense stack of MLP layers, or with --config a whole transformers model."""
    parser = _plan_parser()
    args = parser.parse_args(argv)
    if args.config and args.offload_layers is not None:
        parser.error("--offload-layers sizes the dense stack's budget; with --config give --budget-gb or --offload-gb")

    import torch

    from .pager import GiB, format_bytes
    from .sim.plan import plan, plan_expert_paging
    from .sim.profiles import get_profile
    from .moe import RoutingStats

    if args.dtype is None and not args.config:
        args.dtype = "bf16"  # the dense stack's default; a checkpoint's own dtype is read from its config
    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
    routing = _load_routing(RoutingStats, args.routing) if args.routing else None
    profile = get_profile(args.profile)
    started = time.perf_counter()
    model, described, total, inputs, dtype = (_transformers_model if args.config else _dense_stack)(args, dtype)
    dtype_name = args.dtype or str(dtype).removeprefix("torch.")
    budget_gb, offload_gb = args.budget_gb, args.offload_gb
    if budget_gb is None and offload_gb is None:
        if args.config:
            budget_gb = total / 2 / GiB
        else:
            layer_bytes = total // args.layers
            offload_layers = args.layers // 2 if args.offload_layers is None else args.offload_layers
            # What stays resident plus room for two weights: the one in use and the next one's copy.
            budget_gb = (total - offload_layers * layer_bytes + layer_bytes) / GiB
    weights = sum(1 for _ in model.parameters())
    host = ", ".join(f"{k} {v:g} us" for k, v in profile.host_us.items()) or "none"
    print(f"{described}, {dtype_name}, {format_bytes(total)}; profile {profile.name}: H2D {profile.h2d_gbps} GB/s, "
          f"{profile.tflops.get(str(dtype).removeprefix('torch.'), 0):.0f} TFLOP/s, HBM {profile.hbm_gbps:.0f} GB/s, "
          f"offtensor host time per op: {host}")
    rows = []
    stem, ext = os.path.splitext(args.png)
    for phase, tokens in (("prefill", args.prefill_tokens), ("decode", args.decode_tokens)):
        tl = plan(model, budget_gb=budget_gb, offload_gb=offload_gb, example_inputs=(inputs(tokens),),
                  profile=profile, steps=args.steps, prefetch=not args.no_prefetch, routing=routing,
                  expert_pool=args.expert_pool)
        r = tl.replay()
        png = tl.plot(f"{stem}-{phase}{ext or '.png'}", title=f"{phase}, {tokens} tokens: {r}")
        if args.trace:
            tstem, text = os.path.splitext(args.trace)
            tl.save(f"{tstem}-{phase}{text or '.json'}")
        copied = tl.step_copy_bytes(tl.steps - 1)
        rows.append((phase, tokens, len(tl.info["offloaded"]), tl.info["budget_bytes"], tl.info["offloaded_bytes"], r,
                     copied / r.step_ms / 1e6 if r.step_ms else 0.0, png))
    print(f"budget {format_bytes(rows[0][3])} ({rows[0][3] / GiB:.2f} GiB): {rows[0][2]} of {weights} weights "
          f"offloaded ({format_bytes(rows[0][4])})")
    header = ("phase", "tokens", "ms/step", "bound ms", "bound by", "x bound", "copy busy", "compute busy", "host ms",
              "H2D GB/s", "PNG")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for phase, tokens, _, _, _, r, gbps, png in rows:
        print(f"| {phase} | {tokens} | {r.step_ms:.1f} | {r.bound_ms:.1f} | {r.bound_by} | {r.ratio_to_bound:.3f} | "
              f"{r.copy_busy:.0%} | {r.compute_busy:.0%} | {r.host_ms:.2f} | {gbps:.1f} | "
              f"{png or 'skipped: no matplotlib'} |")
    if any(r.host_bound for *_, r, _, _ in rows):
        print("host-bound: offtensor's own host work per op (the profile's host_us) is the longest lane of a step")
    _print_expert_compute(model, budget_gb, offload_gb, total, profile, args.decode_tokens, args.prefill_tokens)
    if routing is not None:
        _print_expert_paging(plan_expert_paging, model, budget_gb, inputs(args.decode_tokens), routing, profile,
                             args.steps, offload_gb)
    print(f"planned in {time.perf_counter() - started:.1f} s; nothing was allocated (meta device)")
    return 0


def _whole_number(least: int):
    """An argparse type: a whole number of at least ``least``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
        return value

    return parse


def _gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of GiB: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative number of GiB, got {text}")
    return value


def _plan_parser() -> argparse.ArgumentParser:
    from . import PROFILES

    parser = argparse.ArgumentParser(prog="python -m offtensor plan", description=plan_main.__doc__)
    count = _whole_number(1)
    parser.add_argument("--layers", type=count, default=24, help="dense stack: number of MLP layers (default: 24)")
    parser.add_argument("--hidden", type=count, default=8192, help="dense stack: hidden size, W1's rows (default: 8192)")
    parser.add_argument("--ffn", type=count, default=24576, help="dense stack: MLP width, W1's columns (default: 24576)")
    parser.add_argument("--config", help="a transformers config.json, or a checkpoint directory holding one: the "
                        "whole model (AutoModelForCausalLM.from_config on meta; needs transformers)")
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                        help="the weights' dtype (default: the config's dtype with --config, float32 when it names "
                        "none, as transformers loads it; bf16 for the dense stack)")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--budget-gb", type=_gib, help="device budget, GiB (default: half the weights with "
                        "--config; for the dense stack, what offloads half its layers)")
    budget.add_argument("--offload-layers", type=_whole_number(0), default=None,
                        help="dense stack only: a budget that makes the default placement offload this many layers")
    budget.add_argument("--offload-gb", type=_gib, help="offload at least this many GiB (vLLM's cpu_offload_gb)")
    parser.add_argument("--profile", default="h200", type=str.lower, choices=sorted(PROFILES),
                        help="the GPU whose copy and compute rates the replay uses (default: h200)")
    parser.add_argument("--prefill-tokens", type=count, default=4096,
                        help="tokens of the prefill phase's forward (default: 4096)")
    parser.add_argument("--decode-tokens", type=count, default=1,
                        help="tokens of the decode phase's forward (default: 1)")
    parser.add_argument("--steps", type=count, default=2,
                        help="forwards recorded per phase after the warm-up; the table reports the last (default: 2)")
    parser.add_argument("--no-prefetch", action="store_true",
                        help="page each weight in when an op needs it, with no copy ahead of use")
    parser.add_argument("--expert-pool", action="store_true",
                        help="MoE: plan the device-side expert pool (wrap_model(..., expert_pool=True)): calls whose "
                             "routed rows fit its slots are served from it, the others by the expert cache")
    parser.add_argument("--routing", help="MoE: measured routing (a RoutingStats JSON, e.g. benchmarks/results/"
                        "moe_routing_qwen3.json) instead of uniform; also names the faster expert placement")
    parser.add_argument("--png", default="plan.png", help="timeline PNG; one per phase: plan-prefill.png, ...")
    parser.add_argument("--trace", default=None, help="Chrome trace JSON, one per phase like --png")
    return parser


def _load_routing(RoutingStats, path: str):
    try:
        return RoutingStats.load(path)
    except (OSError, ValueError) as e:
        if str(e).startswith("offtensor: "):  # RoutingStats.load's own words, which name the file
            raise SystemExit(f"offtensor plan: {str(e).removeprefix('offtensor: ')}") from None
        raise SystemExit(f"offtensor plan: cannot read routing statistics from {path!r}: {e}") from None


def _print_expert_paging(plan_expert_paging, model, budget_gb, x, routing, profile, steps, offload_gb) -> None:
    """The measured routing's verdict on the expert placement (decode): whole stacks resident as the
    budget allows, or every stack paged through the expert cache."""
    s = routing.summary()
    print(f"routing: {routing.source or 'measured'}, {s['layers']} layers x {s['experts']} experts top-{s['top_k']}, "
          f"entropy {min(s['entropy_bits']):.2f}-{max(s['entropy_bits']):.2f} bits, locality "
          f"{min(s['locality']):.2f}-{max(s['locality']):.2f}; scaled to this model's experts")
    _print_hit_curve(model, routing)
    if budget_gb is None:
        print("expert placement: not compared (give --budget-gb)")
        return
    from .moe import is_routed_stack

    if not any(is_routed_stack(n, p.shape) for n, p in model.named_parameters()):
        print("expert placement: no stacked experts in this model")
        return
    verdict = plan_expert_paging(model, budget_gb, (x,), routing=routing, profile=profile, steps=steps)
    d, a = verdict["default"], verdict["all_paged"]
    chosen = f"page every stack (policy={verdict['policy']})" if verdict["paged"] else "the default placement"
    print(f"expert placement, decode: whole stacks resident {d.step_ms:.1f} ms, every stack paged {a.step_ms:.1f} ms "
          f"-> {chosen}")


def _print_expert_compute(model, budget_gb, offload_gb, total, profile, decode_tokens, prefill_tokens) -> None:
    """Per MoE layer: where expert_compute="auto" computes an uncached routed expert (the host or the
    device) and the layer's replayed step time, for a decode step and a prefill."""
    from .moe import is_routed_stack, model_top_k
    from .pager import GiB
    from .sim.host_compute import compute_rows, with_host_figures

    routed = [(n, p) for n, p in model.named_parameters() if is_routed_stack(n, p.shape)]
    if not routed:
        return
    stacks = [(n, tuple(p.shape), p.dtype) for n, p in routed]
    expert_bytes = sum(p.numel() * p.element_size() for _, p in routed)
    budget = budget_gb * GiB if budget_gb is not None else total - offload_gb * GiB
    share = max(0.0, min(1.0, (budget - (total - expert_bytes)) / expert_bytes))
    profile = with_host_figures(profile)
    rows = compute_rows(stacks, profile, model_top_k(model), share, decode_tokens, prefill_tokens)
    print(f'expert_compute="auto", {share:.0%} of the experts cached; host {profile.host_gbps:.0f} GB/s, '
          f"{max(profile.host_tflops.values()):.2f} TFLOP/s (layer alone, replayed):")
    print("| MoE layer | decode | decode ms (host / device) | prefill | prefill ms (host / device) |")
    print("|---|---|---|---|---|")
    for group, ((_, _, d, d_ms, d_host, d_dev), (_, _, p, p_ms, p_host, p_dev)) in rows:
        print(f"| {group} | {d} | {d_ms:.3f} ({d_host:.3f} / {d_dev:.3f}) | {p} | {p_ms:.3f} ({p_host:.3f} / {p_dev:.3f}) |")


def _print_hit_curve(model, routing) -> None:
    """Decode hit rate against cache slots a layer, from the measured routing, and the knee."""
    from .moe import is_routed_stack
    from .pager import format_bytes
    from .sim.hit_curve import format_curve, hit_curve

    named = [(n, p) for n, p in model.named_parameters() if is_routed_stack(n, p.shape)]
    stacks = [p for _, p in named]
    experts = stacks[0].shape[0] if stacks else len(routing.popularity[0])
    per_expert = sum(p.numel() * p.element_size() for p in stacks) // max(experts, 1)
    layers = len({n.rpartition(".")[0] for n, _ in named})  # a layer's stacks share their experts module
    dense = sum(p.numel() * p.element_size() for p in model.parameters()) - per_expert * experts
    if stacks and experts != len(routing.popularity[0]):
        routing = type(routing)([routing.layer_shares(i, layers, experts) for i in range(layers)],
                                [routing.layer_locality(i, layers) for i in range(layers)], routing.top_k)
    curve = hit_curve(routing)
    per_layer = per_expert / max(layers, 1)  # one expert of one layer, every stack of it
    print("decode hit rate against expert-cache slots a layer (a decode drawn from the measured routing):")
    for line in format_curve(curve, per_layer, layers, dense):
        print(line)
    knee = curve["knee_slots"]
    where = f", a budget of {format_bytes(int(dense + knee * layers * per_layer))}" if per_layer else ""
    print(f"the curve bends at {knee} slots a layer ({knee / curve['experts']:.0%} of the experts cached{where}): "
          f"each slot past it buys less hit than the average slot")


def _dense_stack(args, dtype):
    import torch

    from .models.dense import DenseStack

    with torch.device("meta"):
        model = DenseStack(args.layers, args.hidden, args.ffn, dtype)
    described = f"dense stack: {args.layers} layers x (x @ W1 {args.hidden}x{args.ffn} @ W2 {args.ffn}x{args.hidden})"
    return model, described, model.layer_bytes() * args.layers, (
        lambda tokens: torch.empty(tokens, args.hidden, dtype=dtype, device="meta")), dtype


def _transformers_model(args, dtype):
    """The whole causal LM of a transformers config, built on meta; its input is ``tokens`` ids of
    one sequence (distinct, as far as an offloaded embedding's paging is concerned)."""
    import torch

    from ._optional import quiet_torchao_on_cpu_torch

    quiet_torchao_on_cpu_torch()  # transformers imports torchao where it is installed
    try:
        import transformers
    except ImportError:
        raise SystemExit("offtensor plan --config needs transformers (pip install transformers)") from None
    path = args.config
    if not os.path.exists(path):
        raise SystemExit(f"offtensor plan: no config at {path!r}")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise SystemExit(f"offtensor plan: no config.json in {path!r}")
    try:
        config = transformers.AutoConfig.from_pretrained(os.path.dirname(path) if path.endswith(".json") else path)
    except (OSError, ValueError, KeyError) as e:  # not JSON, no or an unknown model_type
        raise SystemExit(f"offtensor plan: transformers cannot read the config at {path!r}: "
                         f"{str(e).strip().splitlines()[0]}") from None
    dtype = dtype or _checkpoint_dtype(config)
    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    except ValueError as e:  # a model type with no causal LM (t5, clip, ...)
        raise SystemExit(f"offtensor plan: {path!r} is not a causal LM transformers can build: "
                         f"{str(e).strip().splitlines()[0]}") from None
    seen = {}
    for t in model.parameters():
        seen[id(t)] = t.numel() * t.element_size()
    total = sum(seen.values())
    layers = getattr(config, "num_hidden_layers", "?")
    return model, f"{type(model).__name__}: {layers} layers", total, (
        lambda tokens: torch.zeros(1, tokens, dtype=torch.long, device="meta")), dtype


def _checkpoint_dtype(config):
    """The dtype a checkpoint's weights are stored in: its config's ``dtype`` (transformers reads an
    older config.json's ``torch_dtype`` into it), float32 when it names none, as transformers loads it."""
    import torch

    value = getattr(config, "dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value.removeprefix("torch."), None)
    return value if isinstance(value, torch.dtype) else torch.float32


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from .demo import main as demo

        return demo(rest)
    if command == "plan":
        from .pager import BudgetError

        try:
            return plan_main(rest)
        except BudgetError as error:  # a budget the model cannot run in: its message, without a traceback
            print(error, file=sys.stderr)
            return 2
    print(f"offtensor: unknown command {command!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
