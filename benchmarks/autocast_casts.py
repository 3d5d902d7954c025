"""Device bytes of weight casts that ``torch.autocast`` keeps during a wrapped model's forward with
grad on (its cast cache and autograd), against the budget.

An 8-layer float32 MLP (1024 wide, 32 MiB of weights) is wrapped at a budget of a quarter of its
weights, every weight offloaded, and runs one forward under ``torch.autocast(bfloat16)`` with grad
on; inside the region, the plain bfloat16 tensors shaped as a weight that are alive are weight casts
(what autocast returned for each weight and keeps). Their bytes are device memory outside the
budget. With lazy casts (``offtensor.cast_views``) there are none. ``--baseline PATH`` runs the same
in another checkout (its ``offtensor``) and reports both:

    python benchmarks/autocast_casts.py [--baseline PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))


def measure() -> dict:
    import torch
    from torch import nn

    import offtensor as ot

    torch.manual_seed(0)
    width, layers = 1024, 8
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ot.wrap_model(model, budget_gb=weights / 4 / 2**30, device="cpu", policy={"offload": ["*"]})
    x = torch.randn(8, width)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
        gc.collect()
        casts = [o for o in gc.get_objects()
                 if type(o) is torch.Tensor and o.dtype == torch.bfloat16 and o.shape == (width, width)]
        kept = sum(t.numel() * t.element_size() for t in casts)
    y.float().sum().backward()
    stats = ot.stats(model)
    return {"weights_bytes": weights, "budget_bytes": stats.budget_bytes, "weight_casts_kept": len(casts),
            "weight_cast_bytes_kept": kept, "kept_over_budget": kept / stats.budget_bytes,
            "peak_paged_bytes": stats.peak_device_bytes}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline", default=None, help="another checkout, measured the same way")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(measure()))
        return
    runs = {}
    for label, tree in (("this", os.path.dirname(HERE)), ("baseline", args.baseline)):
        if tree is None:
            continue
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child"], capture_output=True, text=True,
                             check=True, cwd=tree, env=dict(os.environ, PYTHONPATH=os.path.abspath(tree)))
        runs[label] = json.loads(out.stdout.strip().splitlines()[-1])
        print(label, runs[label], flush=True)
    sys.path.insert(0, HERE)
    import torch
    from results_io import save_result

    argv_record = ["--baseline", "<main before lazy casts>"] if args.baseline else []
    save_result(args.out, "autocast_casts_cpu.json", "weight casts autocast keeps during a wrapped model's forward "
                "with grad on", torch.device("cpu"), argv_record, {"runs": runs})

if __name__ == "__main__":
    main()
