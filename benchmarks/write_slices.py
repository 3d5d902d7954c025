"""What the all-or-nothing write of an in-place op in slices costs.

An in-place op on a weight larger than the budget's free room (an optimizer's ``param.add_(grad)``)
runs in slices, each paged to the device, computed and written back to the host master. To leave
the weight whole or written under a Ctrl-C, ``ops/pieces.py`` keeps a host copy of its values for
the op's duration (``_saved``). This times the same op with and without that copy, alternating in
one run (this machine is shared and noisy: the ratio is the figure), and the copy alone, and
counts the bytes each moves:

    python benchmarks/write_slices.py [--out benchmarks/results] [--mib 64] [--repeats 9]

On the emulated device (``cpu``) the slices' copies are host memcpys too, so the ratio here is the
host copy against the op's own host work; on a GPU the slices cross PCIe and the host copy runs
beside them on the CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import offtensor as ot  # noqa: E402
from offtensor.ops import pieces  # noqa: E402
from results_io import save_result  # noqa: E402


class _Holder(nn.Module):
    def __init__(self, rows: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(rows, 4096))


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure(mib: int, repeats: int, device: str) -> dict:
    torch.manual_seed(0)
    model = _Holder(mib * 2**20 // (4096 * 4))
    weight_bytes = model.w.numel() * 4
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ot.wrap_model(model, budget_gb=weight_bytes / 4 / 2**30, device=device)
    grad = torch.randn(model.w.shape, device=device)
    saved_fn = pieces._saved

    def step():
        with torch.no_grad():
            model.w.add_(grad, alpha=1e-3)
        if device != "cpu":
            torch.cuda.synchronize()

    def unsaved(*args):
        return ()

    step()  # warm
    with_copy, without_copy, copy_alone = [], [], []
    host = model.w._host
    for _ in range(repeats):
        with_copy.append(_timed(step))
        pieces._saved = unsaved
        try:
            without_copy.append(_timed(step))
        finally:
            pieces._saved = saved_fn
        copy_alone.append(_timed(lambda: host.clone()))
    stats = ot.stats(model)
    med = {k: statistics.median(v) for k, v in
           {"with_host_copy_s": with_copy, "without_host_copy_s": without_copy, "host_copy_alone_s": copy_alone}.items()}
    return {
        "weight_bytes": weight_bytes,
        "budget_bytes": weight_bytes // 4,
        "repeats": repeats,
        **{k: round(v, 6) for k, v in med.items()},
        "ratio_with_to_without": round(med["with_host_copy_s"] / med["without_host_copy_s"], 3),
        "host_copy_bytes_per_op": weight_bytes,
        "bytes_h2d_per_op": stats.bytes_h2d // (2 * repeats + 1),
        "bytes_d2h_per_op": stats.bytes_d2h // (2 * repeats + 1),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    body = measure(args.mib, args.repeats, args.device)
    for k, v in body.items():
        print(f"{k}: {v}")
    device = torch.device(args.device)
    save_result(args.out, f"write_slices_{device.type}.json", "write_slices", device, argv, body)


if __name__ == "__main__":
    main()
