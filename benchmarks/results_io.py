"""Writing a benchmark's result: the measured figures plus when, where and how they were taken,
so a JSON file in benchmarks/results/ can be read and rerun without its author."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys

import torch


def machine(device: torch.device) -> dict:
    from offtensor import _ext

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "native_extension": _ext.NATIVE,
    }


def save_result(out_dir: str, filename: str, benchmark: str, device: torch.device, argv, body: dict) -> str:
    """Write ``body`` under a header (benchmark, date, machine, command) to ``out_dir/filename``."""
    script = os.path.relpath(sys.argv[0]) if sys.argv and sys.argv[0] else "benchmarks/?"
    args = list(argv) if argv is not None else sys.argv[1:]
    record = {
        "benchmark": benchmark,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(device),
        "command": " ".join(["python", script, *args]),
        **body,
    }
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, filename)
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
    print(f"wrote {path}")
    return path
