"""The GPU suite's first look at a machine (30 s at most): is offtensor's CUDA path really there?

- ``cuda_compiled``: the extension was built with its CUDA part;
- ``libcudart``: which libcudart.so files the process has mapped (torch's own and, if another,
  the toolkit's that the extension linked; two different ones would be worth knowing);
- ``alloc_host_pinned``: ``alloc_host(pin=True).is_pinned()``, and the same for a master made by
  ``ot.offload``: exact-size host memory that the driver really registered;
- host->device GB/s from pinned and from pageable memory (one buffer, median of a few copies);
- ``host_us``: offtensor's own host time per cache-hit page and per copy on this machine's host
  (``offtensor.sim.profiles.measure_host_us``), the figure the ``h200`` profile's ``host_us`` estimates;
- ``cuda_call_us`` (GPU only): host µs per call of the CUDA calls a page or a copy is made of,
  so ``host_us`` can be read as a sum of them (``measure_cuda_calls``);
- ``host_us_event_per_op`` (GPU only): ``host_us`` again with an event recorded after every op that
  read a cached copy (``OFFTENSOR_MARK_EVERY=1``, the pager before last-use marks).

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


def measure_cuda_calls(device: torch.device, iters: int = 2000, repeats: int = 5) -> dict:
    """Host µs per call, the fastest of ``repeats`` runs of ``iters`` calls: the pieces of the
    pager's per-op host cost on a GPU. None of them waits for the device.

    - ``current_stream``: ``torch.cuda.current_stream(device)`` (a Stream object per call);
    - ``raw_stream``: ``torch._C._cuda_getCurrentRawStream`` (an int), where this torch has it;
    - ``op_stream_lookup``: what ``CudaDevice`` does per op instead: the raw handle, then its track;
    - ``mark``: a last-use mark (``Marks.mark``), an event every ``RECORD_EVERY`` marks included;
    - ``event_record``: ``torch.cuda.Event()`` + ``record`` (what every hit cost before marks);
    - ``event_query``: ``query()`` of a completed event;
    - ``wait_event``: ``stream.wait_event`` on a completed event;
    - ``stream_context``: ``with torch.cuda.stream(side): pass``;
    - ``set_stream_pair``: ``torch.cuda.set_stream(side)`` and back (``CudaDevice._copy_on``);
    - ``copy_1KiB``: a non-blocking 1 KiB copy from pinned memory on the current stream.
    Skipped (``{"skipped": why}``) off a GPU."""
    if device.type != "cuda":
        return {"skipped": "not a GPU: the emulated device makes no CUDA calls"}
    from offtensor.pager.device import CudaDevice, _raw_stream
    from offtensor.sim.profiles import _min_us

    sync = lambda: torch.cuda.synchronize(device)  # noqa: E731
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream, side = torch.cuda.current_stream(device), torch.cuda.Stream(device=device)
    done = torch.cuda.Event()
    done.record(stream)
    torch.cuda.synchronize(device)
    src = torch.ones(1024, dtype=torch.uint8).pin_memory()
    dst = torch.empty(1024, dtype=torch.uint8, device=device)
    ops = CudaDevice(device)
    track = ops._current()

    def event_record():
        torch.cuda.Event().record(stream)

    def stream_context():
        with torch.cuda.stream(side):
            pass

    def set_stream_pair():
        torch.cuda.set_stream(side)
        torch.cuda.set_stream(stream)

    calls = {
        "current_stream": lambda: torch.cuda.current_stream(device),
        "op_stream_lookup": ops._current,
        "mark": lambda: ops.marks.mark(track),
        "event_record": event_record,
        "event_query": done.query,
        "wait_event": lambda: stream.wait_event(done),
        "stream_context": stream_context,
        "set_stream_pair": set_stream_pair,
        "copy_1KiB": lambda: dst.copy_(src, non_blocking=True),
    }
    if _raw_stream is not None:
        calls["raw_stream"] = lambda: _raw_stream(index)
    return {name: _min_us(call, iters, repeats, sync) for name, call in calls.items()}


def _with_env(name: str, value: str, fn):
    """``fn()`` with the environment variable ``name`` set to ``value`` (read when a pager is made)."""
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        return fn()
    finally:
        if saved is None:
            del os.environ[name]
        else:
            os.environ[name] = saved


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
        try:  # a breakdown: its failure must not cost the probe's other figures
            report["cuda_call_us"] = measure_cuda_calls(device, iters=500, repeats=3)
        except Exception as error:
            report["cuda_call_us"] = {"error": f"{type(error).__name__}: {error}"}
        if gpu:  # the same with an event per marked op (the pager before last-use marks): the A/B
            report["host_us_event_per_op"] = _with_env("OFFTENSOR_MARK_EVERY", "1",
                                                       lambda: measure_host_us(device, iters=500, repeats=5))
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
