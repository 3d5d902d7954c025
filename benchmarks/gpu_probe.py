"""The GPU suite's first look at a machine (30 s at most): is offtensor's CUDA path really there?

- ``cuda_compiled``: the extension was built with its CUDA part;
- ``libcudart``: which libcudart.so files the process has mapped (torch's own and, if another,
  the toolkit's that the extension linked; two different ones would be worth knowing);
- ``alloc_host_pinned``: ``alloc_host(pin=True).is_pinned()``, and the same for a master made by
  ``ot.offload``: exact-size host memory that the driver really registered;
- host->device GB/s from pinned and from pageable memory (one buffer, median of a few copies);
- ``host_us``: offtensor's own host time per cache-hit page and per copy on this machine's host
  (``offtensor.sim.profiles.measure_host_us``), the figure the ``h200`` profile's ``host_us`` estimates.

    python benchmarks/gpu_probe.py [--device cuda|cpu] [--out DIR]

Writes ``probe.json`` into ``--out`` and prints one line per figure. On the emulated device the
"copies" are host memcpys, so the bandwidths only prove the script runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def _mapped_libraries(fragment: str) -> list[str]:
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if fragment in line and "/" in line}
    except OSError:
        return []
    return sorted(paths)


def _gb_per_s(dst: torch.Tensor, src: torch.Tensor, device: torch.device, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return src.nbytes / statistics.median(times) / 1e9


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=".")
    parser.add_argument("--mib", type=int, default=None, help="copy size (default 1024 MiB on a GPU, 64 on cpu)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    report: dict = {"device": str(device), "torch": torch.__version__, "torch_cuda": torch.version.cuda}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import offtensor as ot
        from offtensor import _ext

        if gpu:
            torch.cuda.init()
            report["gpu"] = torch.cuda.get_device_name(device)
        report["native"] = _ext.NATIVE
        report["cuda_compiled"] = _ext.CUDA_COMPILED
        report["extension_cuda_devices"] = _ext.cuda_device_count()
        report["libcudart"] = _mapped_libraries("libcudart")
        report["offtensor_C"] = _mapped_libraries("offtensor/_C")
        pinned_raw = _ext.alloc_host(64 << 20, pin=True)
        report["alloc_host_pinned"] = bool(pinned_raw.is_pinned())
        master = ot.offload(torch.ones(1 << 20), device=device)
        report["offload_master_pinned"] = bool(master._host.is_pinned())
        nbytes = (args.mib or (1024 if gpu else 64)) << 20
        src = _ext.alloc_host(nbytes, pin=gpu)
        src.fill_(1)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        report["copy_bytes"] = nbytes
        report["pinned_h2d_GB_per_s"] = _gb_per_s(dst, src, device)
        pageable = torch.ones(nbytes, dtype=torch.uint8)
        report["pageable_h2d_GB_per_s"] = _gb_per_s(dst, pageable, device)
        from offtensor.sim.profiles import measure_host_us

        report["host_us"] = measure_host_us(device, iters=500, repeats=5)
    report["warnings"] = [str(w.message) for w in caught]
    for key, value in report.items():
        print(f"probe {key}: {value}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "probe.json"), "w") as f:
        json.dump(report, f, indent=1)
    ok = report["native"] and (not gpu or (report["cuda_compiled"] and report["alloc_host_pinned"]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
