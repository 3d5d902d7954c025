"""Timelines: what a step does on the copy stream and the compute stream, and how long it takes on a GPU.

A ``Timeline`` is a list of records in issue order. A record is a copy (host->device, on the copy
stream, or on the compute stream for a copy the op waits for in line) or an op (a kernel on the
compute stream), with its bytes, its FLOPs (``torch.utils.flop_counter``'s formulas), the step
(forward) it was issued in and ``waits``: the ids of the records it cannot start before (the copy
an op reads; the op whose block a copy reuses). ``replay(profile)`` schedules the records on two
in-order streams under a ``Profile`` (H2D bandwidth, dense TFLOP/s per dtype, HBM bandwidth, a
per-op overhead), which is what a GPU does with two CUDA streams and events.

Three ways to get a timeline:

- ``with ot.timeline(model) as tl: model(x)`` records a real run (emulated device or GPU): a
  ``TorchDispatchMode`` sees every op, including ops on plain resident tensors, and the pager tells
  the recorder about every copy, every use of a paged copy, every release and every eviction;
- ``ot.plan(model, budget_gb=..., example_inputs=...)`` runs the same placement, pager and
  prefetcher on the meta device: nothing is allocated or computed, the decisions are the GPU's;
- ``Timeline()`` and ``add_copy`` / ``add_op`` write a schedule by hand (tests/test_calibration.py).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import math
import os
import time
from typing import Optional, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from . import dispatch
from . import experts
from . import placement
from .config import OffloadConfig
from .model.prepare import prepare, unwrap
from .model.state import pager_of, wrapped_state
from .pager import GiB

GB = 1e9

# ---------------------------------------------------------------------------- device profiles


@dataclasses.dataclass(frozen=True)
class Profile:
    """How fast one GPU moves and computes: what ``replay`` needs to turn records into times."""

    name: str
    h2d_gbps: float  # pinned host -> device, GB/s (1e9 bytes)
    tflops: dict  # dtype name ("bfloat16", ...) -> dense TFLOP/s a large matmul sustains
    hbm_gbps: float  # device memory, bytes read + written per second / 1e9
    launch_us: float  # per-op overhead (kernel launch and drain), added to every op and copy
    source: str = ""
    # The emulated device runs each op on the host thread that issues the next one: nothing is
    # issued before the op before it has finished (a GPU's host runs ahead of its streams).
    host_blocking: bool = False

    def op_ms(self, flops: float, nbytes: float, dtype: Optional[str]) -> float:
        """An op takes its roofline time, compute or memory, whichever is longer, plus its overhead."""
        rate = self.tflops.get(dtype) or self.tflops.get("float32")
        compute = flops / (rate * 1e12) if flops else 0.0
        memory = nbytes / (self.hbm_gbps * GB) if nbytes else 0.0
        return (max(compute, memory) + self.launch_us * 1e-6) * 1e3

    def copy_ms(self, nbytes: float) -> float:
        return (nbytes / (self.h2d_gbps * GB) + self.launch_us * 1e-6) * 1e3


# The measured H200 figures (DESIGN.md, 2026-11-29, PCIe Gen5 x16, torch 2.11). A bf16 GEMM burst of
# 8192^3 runs at about 790 TFLOP/s; what a step sustains is lower (clocks under sustained load): the
# all-resident prefill of 48 GEMMs of 4096 x 8192 x 24576 took 116.1 ms. The profile carries that
# sustained rate, derived here from the measurement rather than typed in.
_H200_PREFILL_FLOPS = 48 * 2 * 4096 * 8192 * 24576
_H200_SUSTAINED_BF16 = _H200_PREFILL_FLOPS / 116.1e-3 / 1e12  # about 682 TFLOP/s

PROFILES = {
    "h200": Profile(
        name="h200",
        h2d_gbps=55.3,
        tflops={"bfloat16": _H200_SUSTAINED_BF16, "float16": _H200_SUSTAINED_BF16, "float32": 67.0},
        hbm_gbps=4300.0,
        launch_us=4.0,
        source=(
            "measured on an H200 SXM, torch 2.11, 2026-11-29 (DESIGN.md): pinned H2D 55.3 GB/s; bf16 GEMM "
            "790 TFLOP/s burst, sustained rate from the 116.1 ms all-resident prefill; device copy 4.3 TB/s "
            "(read + write); fp32 (no tensor cores) and the 4 us per-op overhead are the datasheet's and a "
            "typical launch gap, not measured"
        ),
    ),
    "h100": Profile(
        name="h100",
        h2d_gbps=64.0,
        tflops={"bfloat16": 989.4, "float16": 989.4, "float32": 66.9},
        hbm_gbps=3350.0,
        launch_us=4.0,
        source=(
            "published: NVIDIA H100 Tensor Core GPU datasheet, SXM5 (dense BF16/FP16 989.4 TFLOP/s, FP32 66.9, "
            "HBM3 3.35 TB/s, PCIe Gen5 x16 128 GB/s both ways = 64 GB/s host->device). Peak figures: "
            "a replay under them is optimistic (the H200's measured H2D is 86% of 64 GB/s)"
        ),
    ),
}


def get_profile(profile) -> Profile:
    if isinstance(profile, Profile):
        return profile
    try:
        return PROFILES[str(profile).lower()]
    except KeyError:
        raise ValueError(
            f"offtensor: unknown device profile {profile!r}; built in: {sorted(PROFILES)}, "
            f"or pass a Profile (ot.measure_profile() measures the device at hand)"
        ) from None


def measure_profile(device=None, name: Optional[str] = None) -> Profile:
    """Measure H2D, matmul TFLOP/s per dtype, device-memory bandwidth and per-op overhead on
    ``device`` (the current GPU; ``cpu`` measures the emulated device, where a "copy" is a memcpy)."""
    from .pager import resolve_device
    from . import _ext

    device = resolve_device(device)
    cuda = device.type == "cuda"

    def timed(fn, repeat):
        fn()  # warm-up: allocator, handles, first touch
        if cuda:
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeat):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / repeat
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        return (time.perf_counter() - t0) / repeat

    copy_bytes = (256 << 20) if cuda else (32 << 20)
    host = _ext.alloc_host(copy_bytes, pin=cuda)
    dev = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    if cuda:
        h2d = copy_bytes / timed(lambda: dev.copy_(host, non_blocking=True), 10) / GB
    else:
        # The emulated pager copies into a fresh buffer each time, whose pages fault in on first touch.
        h2d = copy_bytes / timed(lambda: torch.empty_like(dev).copy_(host), 10) / GB
    other = torch.empty_like(dev)
    hbm = 2 * copy_bytes / timed(lambda: other.copy_(dev), 10) / GB
    tflops = {}
    n = 8192 if cuda else 1024
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        tflops[str(dtype).removeprefix("torch.")] = 2 * n**3 / timed(lambda: a @ b, 5 if cuda else 2) / 1e12
    tiny = torch.zeros(16, device=device)
    launch_us = timed(lambda: tiny.add_(1), 1000) * 1e6
    return Profile(
        name=name or (torch.cuda.get_device_name(device) if cuda else "emulated-cpu"),
        h2d_gbps=h2d,
        tflops=tflops,
        hbm_gbps=hbm,
        launch_us=launch_us,
        source=f"measured by offtensor.measure_profile on {device}, torch {torch.__version__}",
        host_blocking=not cuda,
    )


# ---------------------------------------------------------------------------- records and replay


@dataclasses.dataclass
class Record:
    id: int
    kind: str  # "copy" or "op"
    stream: str  # "copy" or "compute"
    name: str
    nbytes: int  # copy: bytes moved host->device; op: bytes read + written in device memory
    flops: int
    dtype: Optional[str]
    step: int
    waits: list
    key: Optional[tuple] = None  # copy: what it copies (master, dtype, range), so a step counts it once
    measured_ms: Optional[tuple] = None  # (start, end) from CUDA events, relative to the first record


@dataclasses.dataclass
class Replay:
    """Predicted times of a timeline under one profile; the figures describe the last step."""

    profile: Profile
    step_ms: float
    bound_ms: float
    ratio_to_bound: float
    copy_busy: float  # fraction of the last step's time the copy stream was busy
    compute_busy: float
    compute_ms: float  # the last step's ops alone, back to back (the compute half of the bound)
    copy_bound_ms: float  # the last step's distinct copied bytes / H2D (the copy half of the bound)
    steps_ms: list  # every step's duration
    starts: dict  # record id -> predicted start, ms
    ends: dict
    step_windows: list  # (start, end) of every step, ms

    def __str__(self):
        return (
            f"Replay({self.profile.name}: step {self.step_ms:.2f} ms, bound {self.bound_ms:.2f} ms, "
            f"ratio {self.ratio_to_bound:.3f}, copy busy {self.copy_busy:.1%}, compute busy {self.compute_busy:.1%})"
        )


class Timeline:
    """Records in issue order. Build one by hand with ``add_copy`` / ``add_op`` / ``next_step``, or
    get one from ``ot.timeline(model)`` or ``ot.plan(...)``."""

    def __init__(self, profile=None):
        self.records: list = []
        self.step = 0
        self.profile = profile  # the default for replay/save/plot (plan sets it)
        self.warmup_steps = 0  # leading steps that ran only to warm the prefetcher up (plan)
        self._next_id = 0
        self.info: dict = {}  # what produced it (plan: budget, placement), for the table and the JSON

    # -------------------------------------------------------------- building

    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def add_copy(self, nbytes: int, waits: Sequence[int] = (), name: str = "copy", stream: str = "copy",
                 key=None, id: Optional[int] = None) -> int:
        rid = self.new_id() if id is None else id
        self.records.append(Record(rid, "copy", stream, name, int(nbytes), 0, None, self.step, list(waits), key))
        return rid

    def add_op(self, flops: float, nbytes: int, dtype="bfloat16", waits: Sequence[int] = (), name: str = "op",
               id: Optional[int] = None) -> int:
        rid = self.new_id() if id is None else id
        dtype = str(dtype).removeprefix("torch.") if dtype is not None else None
        self.records.append(Record(rid, "op", "compute", name, int(nbytes), int(flops), dtype, self.step, list(waits)))
        return rid

    def add_sync(self, name: str = "host sync", id: Optional[int] = None) -> int:
        """The host waits for the compute stream (a device->host read it needs, such as which experts
        were routed): nothing issued after this record starts before the compute work issued before
        it has finished. Takes no time on either stream itself."""
        rid = self.new_id() if id is None else id
        self.records.append(Record(rid, "sync", "host", name, 0, 0, None, self.step, []))
        return rid

    def next_step(self) -> None:
        if self.records:
            self.step += 1

    @property
    def steps(self) -> int:
        return 1 + max((r.step for r in self.records), default=-1)

    # -------------------------------------------------------------- replay

    def replay(self, profile=None, sync: Optional[str] = "device") -> Replay:
        """Schedule every record on its in-order stream after the records it waits for.

        ``sync`` is what the host does between steps, before it issues the next one:
        ``"device"`` (``torch.cuda.synchronize()``, how a step is timed: the calibration
        measurements were taken so) waits for both streams, prefetches in flight included;
        ``"compute"`` (reading the step's result, e.g. the sampled token) waits for the compute
        stream only; ``None`` issues the steps back to back."""
        if sync not in ("device", "compute", None):
            raise ValueError(f"offtensor: sync must be 'device', 'compute' or None, got {sync!r}")
        profile = get_profile(profile or self.profile or "h200")
        starts, ends = {}, {}
        free = {"copy": 0.0, "compute": 0.0}
        step, barrier, host = 0, 0.0, 0.0
        barriers = [0.0]  # when the host may issue each step; then when the last one's sync returns

        def synchronised():
            return max(free.values()) if sync == "device" else free["compute"] if sync == "compute" else None

        for r in self.records:
            if r.step != step:
                # The host issues nothing of step r.step before the synchronisation ending the last.
                step = r.step
                barrier = synchronised() or 0.0
                barriers.append(barrier)
            if r.kind == "sync":
                host = max(host, free["compute"])
                starts[r.id] = ends[r.id] = host
                continue
            ready = max(free[r.stream], barrier, host)
            for w in r.waits:
                end = ends.get(w)
                if end is None:
                    raise ValueError(f"offtensor: record {r.id} ({r.name}) waits for {w}, which was not issued before it")
                ready = max(ready, end)
            dur = profile.copy_ms(r.nbytes) if r.kind == "copy" else profile.op_ms(r.flops, r.nbytes, r.dtype)
            starts[r.id], ends[r.id] = ready, ready + dur
            free[r.stream] = ready + dur
            if profile.host_blocking and r.stream == "compute":
                host = ready + dur
        n = self.steps
        if not n:
            raise ValueError("offtensor: the timeline is empty")
        if sync is None:
            # Back to back, a step ends when its last op ends (the result exists).
            last_op_end = [0.0] * n
            for r in self.records:
                if r.kind == "op":
                    last_op_end[r.step] = max(last_op_end[r.step], ends[r.id])
            for s in range(1, n):
                last_op_end[s] = max(last_op_end[s], last_op_end[s - 1])
            windows = [(last_op_end[s - 1] if s else 0.0, last_op_end[s]) for s in range(n)]
        else:
            # A step lasts from the sync that let the host issue it to the sync that ends it, which
            # also waits for what the step issued for the next one (a prefetch, under "device").
            barriers.append(synchronised())
            windows = list(zip(barriers[:-1], barriers[1:]))
        steps_ms = [b - a for a, b in windows]
        last = n - 1
        lo, hi = windows[last]
        busy = {"copy": 0.0, "compute": 0.0}
        for r in self.records:
            overlap = min(hi, ends[r.id]) - max(lo, starts[r.id])
            if overlap > 0 and r.stream in busy:
                busy[r.stream] += overlap
        compute_ms = sum(profile.op_ms(r.flops, r.nbytes, r.dtype) for r in self.records if r.kind == "op" and r.step == last)
        copy_bound_ms = self.step_copy_bytes(last) / (profile.h2d_gbps * GB) * 1e3
        bound = max(compute_ms, copy_bound_ms)
        span = hi - lo
        return Replay(
            profile, span, bound, span / bound if bound else float("nan"),
            busy["copy"] / span if span else 0.0, busy["compute"] / span if span else 0.0,
            compute_ms, copy_bound_ms, steps_ms, starts, ends, windows,
        )

    def step_copy_bytes(self, step: int) -> int:
        """Bytes the ops of ``step`` had to have copied: every copy whose first reader is in this
        step, each copied range once (a prefetch issued in the step before counts here; a copy
        still cached from an earlier step does not)."""
        first_reader = {}
        for r in self.records:
            if r.kind == "op":
                for w in r.waits:
                    first_reader.setdefault(w, r.step)
        seen, total = set(), 0
        for r in self.records:
            if r.kind == "copy" and first_reader.get(r.id) == step:
                key = r.key if r.key is not None else ("record", r.id)
                if key not in seen:
                    seen.add(key)
                    total += r.nbytes
        return total

    # -------------------------------------------------------------- export

    def trace(self, profile=None, steps: Optional[int] = None) -> dict:
        """Chrome trace (Perfetto, chrome://tracing): one complete event per record, ts/dur predicted, µs."""
        result = self.replay(profile)
        first = self._first_shown_step(steps)
        pid = 1
        events = [
            {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"offtensor replay ({result.profile.name})"}},
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": 1, "args": {"name": "compute"}},
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": 2, "args": {"name": "copy"}},
        ]
        if any(r.kind == "sync" for r in self.records):
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": 3, "args": {"name": "host syncs"}})
        tids = {"compute": 1, "copy": 2, "host": 3}
        for r in self.records:
            if r.step < first:
                continue
            args = {"id": r.id, "bytes": r.nbytes, "flops": r.flops, "step": r.step, "waits": list(r.waits)}
            if r.measured_ms is not None:
                args["measured_ts_us"] = r.measured_ms[0] * 1e3
                args["measured_dur_us"] = (r.measured_ms[1] - r.measured_ms[0]) * 1e3
            events.append({
                "name": r.name, "cat": r.kind, "ph": "X", "pid": pid, "tid": tids[r.stream],
                "ts": result.starts[r.id] * 1e3, "dur": (result.ends[r.id] - result.starts[r.id]) * 1e3, "args": args,
            })
        return {
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "otherData": {
                "profile": dataclasses.asdict(result.profile),
                "step_ms": result.step_ms, "bound_ms": result.bound_ms, "ratio_to_bound": result.ratio_to_bound,
                "copy_busy": result.copy_busy, "compute_busy": result.compute_busy, **_jsonable(self.info),
            },
        }

    def save(self, path: str, profile=None, steps: Optional[int] = None) -> str:
        with open(path, "w") as f:
            json.dump(self.trace(profile, steps), f)
        return path

    def _first_shown_step(self, steps: Optional[int]) -> int:
        n = self.steps
        if steps is None:
            return min(self.warmup_steps, n - 1) if n else 0
        return max(0, n - steps)

    def plot(self, path: str, profile=None, steps: Optional[int] = None, title: Optional[str] = None) -> str:
        """PNG: the compute and copy lanes, idle gaps shaded, each step's bound marked. Returns its
        path, or None without matplotlib (one warning per process; JSON and replays need none)."""
        from ._optional import pyplot

        plt = pyplot()
        if plt is None:  # no matplotlib: warned once, the PNG is skipped
            return None

        result = self.replay(profile)
        first = self._first_shown_step(steps)
        shown = [r for r in self.records if r.step >= first]
        t0 = result.step_windows[first][0]
        t1 = result.step_windows[-1][1]
        fig, ax = plt.subplots(figsize=(14, 3.2))
        lanes = {"compute": 1, "copy": 0}
        colors = {("op", "compute"): "#4477aa", ("copy", "copy"): "#ee7733", ("copy", "compute"): "#cc3311"}
        for lane, y in lanes.items():
            spans = sorted((result.starts[r.id], result.ends[r.id]) for r in shown if r.stream == lane)
            ax.broken_barh([(a - t0, b - a) for a, b in spans], (y - 0.35, 0.7),
                           facecolors=[colors[(r.kind, r.stream)] for r in sorted(
                               (r for r in shown if r.stream == lane), key=lambda r: result.starts[r.id])],
                           edgecolor="white", linewidth=0.3)
            cursor = t0  # idle gaps of this lane
            gaps = []
            for a, b in spans:
                if a > cursor + 1e-9:
                    gaps.append((cursor - t0, a - cursor))
                cursor = max(cursor, b)
            if t1 > cursor:
                gaps.append((cursor - t0, t1 - cursor))
            ax.broken_barh(gaps, (y - 0.35, 0.7), facecolors="#dddddd", hatch="//", edgecolor="#999999", linewidth=0)
        syncs = [result.starts[r.id] - t0 for r in shown if r.kind == "sync"]
        if syncs:  # the host waited for the compute stream here (a device->host read)
            ax.plot(syncs, [1.45] * len(syncs), "v", color="#cc3311", markersize=4, label="host sync")
        for s in range(first, self.steps):
            a, b = result.step_windows[s]
            ax.axvline(b - t0, color="black", linewidth=0.8)
            bound = self._step_bound(result.profile, s)
            ax.plot([a - t0, a - t0 + bound], [1.55, 1.55], color="green", linewidth=3,
                    label="bound" if s == first else None)
        ax.set_yticks([0, 1])
        ax.set_yticklabels(["copy", "compute"])
        ax.set_ylim(-0.6, 1.8)
        ax.set_xlabel("predicted time, ms")
        ax.set_title(title or (f"{result.profile.name}: {result.step_ms:.1f} ms/step, bound {result.bound_ms:.1f} ms "
                               f"(x{result.ratio_to_bound:.3f}), copy busy {result.copy_busy:.0%}, "
                               f"compute busy {result.compute_busy:.0%}; grey = idle"), fontsize=9)
        ax.legend(loc="upper right", fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    def _step_bound(self, profile: Profile, step: int) -> float:
        compute = sum(profile.op_ms(r.flops, r.nbytes, r.dtype) for r in self.records if r.kind == "op" and r.step == step)
        return max(compute, self.step_copy_bytes(step) / (profile.h2d_gbps * GB) * 1e3)


def _jsonable(info: dict) -> dict:
    return json.loads(json.dumps(info, default=str))


# ---------------------------------------------------------------------------- recording


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _op_cost(func, args, kwargs, out):
    """(FLOPs, device bytes read + written, dtype) of one op, from shapes only."""
    flops = 0
    counter = flop_registry.get(func._overloadpacket)
    if func is torch.ops.aten._grouped_mm.default and isinstance(out, torch.Tensor) and args[0].dim() == 2:
        # torch's flop counter has no formula for it: every row of x meets one group's [K, N] matrix.
        flops = 2 * args[0].shape[0] * args[0].shape[1] * out.shape[-1]
    elif counter is not None:
        try:
            flops = int(counter(*args, **kwargs, out_val=out))
        except Exception:
            flops = 0  # a formula that does not take this overload's arguments: count bytes only
    nbytes, dtype = 0, None
    selects = func in _ROW_SELECTS
    grouped = func is torch.ops.aten._grouped_mm.default and len(args) > 1 and isinstance(args[1], torch.Tensor) \
        and args[1].dim() == 3
    for t in torch.utils._pytree.tree_leaves((args, kwargs, out)):
        if isinstance(t, torch.Tensor):
            if grouped and t is args[1]:
                # A grouped GEMM reads the matrices of the groups that have rows, at most one per row
                # (8 of 64 experts at a one-token decode), not the whole stack.
                groups = min(t.shape[0], args[0].shape[0])
                nbytes += groups * (_tensor_bytes(t) // max(t.shape[0], 1))
                continue
            if selects and hasattr(t, "_master"):
                # An offloaded stack indexed by rows: the kernel reads the selected rows (as many
                # bytes as the output), not the whole stack (64 experts where 8 were routed).
                nbytes += _tensor_bytes(out) if isinstance(out, torch.Tensor) else 0
                continue
            nbytes += _tensor_bytes(t)
            if dtype is None and t.is_floating_point():
                dtype = str(t.dtype).removeprefix("torch.")
    return flops, nbytes, dtype


_COPIES = (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)
_ROW_SELECTS = (torch.ops.aten.index_select.default, torch.ops.aten.index.Tensor, torch.ops.aten.embedding.default)


def _host_to_device_bytes(func, args, out) -> int:
    """Bytes of a host -> GPU copy (``_to_copy`` or ``copy_`` from a CPU tensor), else 0."""
    if func not in _COPIES:
        return 0
    src = args[1] if func is torch.ops.aten.copy_.default else args[0]
    dst = args[0] if func is torch.ops.aten.copy_.default else out
    if isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor) and src.device.type == "cpu" \
            and dst.device.type == "cuda":
        return _tensor_bytes(dst)
    return 0


def _launches_nothing(func) -> bool:
    """Views and metadata ops alias their input: no kernel runs on the device."""
    schema = func._schema
    return bool(schema.returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def _is_meta_grouped_mm(func, args) -> bool:
    return (func is torch.ops.aten._grouped_mm.default and len(args) > 1 and isinstance(args[0], torch.Tensor)
            and args[0].is_meta and args[0].dtype != torch.bfloat16)


def _meta_grouped_mm(func, args, kwargs):
    """``_grouped_mm`` of a plan of a float32 (or float16) model: torch's meta kernel accepts
    bf16 only, though the CPU and CUDA kernels take other dtypes, so the shapes come from a bf16
    call and the result takes the inputs' dtype (meta: nothing is computed either way). The cost
    is counted on the real arguments."""
    dtype = args[0].dtype
    cast = [a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    kw = {k: v.to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
          for k, v in kwargs.items() if k != "out_dtype"}
    return func(*cast, **kw).to(kwargs.get("out_dtype") or dtype)


class Recorder(TorchDispatchMode):
    """Fills a Timeline from a running model: ops through this dispatch mode, copies and their
    lifetimes through the pager's ``recorder`` call sites."""

    def __init__(self, timeline: Timeline, measure: bool = False):
        super().__init__()
        self.tl = timeline
        self._copy_of = {}  # id(pager entry) -> the record id of the copy that filled it
        self._last_use = {}  # id(pager entry) -> the record id of the last op that read it
        self._pending_waits = []  # copies the next op reads
        self._pending_frees = []  # ops whose blocks the next copy reuses
        self._open_ops = []  # ids reserved for ops running now (their pages are released inside)
        self._last_op = None
        self._measure = measure and torch.cuda.is_available()
        self._events = []  # (record id, start event, end event) when measuring
        # Inside the pager (allocating a copy's buffer, the copy itself): its work is recorded by
        # its call sites as copies, not as ops. Set by quiet().
        self._quiet = 0
        self._split = set()  # open ops whose handler runs their kernels one by one (kernels())

    def quiet(self, method):
        """``method`` (a pager entry point) with this mode's op recording paused while it runs."""

        def run(*args, **kwargs):
            self._quiet += 1
            try:
                return method(*args, **kwargs)
            finally:
                self._quiet -= 1

        return run

    @contextlib.contextmanager
    def kernels(self):
        """Inside an op being recorded, whose handler splits it into kernels that each read only
        their own paged copies (``_grouped_mm``: one expert at a time): the kernels run in the
        block are recorded as ops of their own, each waiting for its own copies, as the compute
        stream runs them on a GPU (expert j computes while expert j+1 is still copying). The op
        itself is then recorded without cost (its kernels carry it) and with what its handler
        does after them (the concatenation of the pieces)."""
        if self._open_ops:
            self._split.add(self._open_ops[-1])
        with self:  # this mode is off while it dispatches the outer op: back on for the kernels
            yield

    # -------------------------------------------------------------- ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._quiet or _launches_nothing(func):
            return func(*args, **kwargs)
        rid = self.tl.new_id()
        self._open_ops.append(rid)
        start = end = None
        if self._measure:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        try:
            out = _meta_grouped_mm(func, args, kwargs) if _is_meta_grouped_mm(func, args) else func(*args, **kwargs)
        finally:
            self._open_ops.pop()
        if self._measure:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((rid, start, end))
        h2d = _host_to_device_bytes(func, args, out)
        if h2d:
            # A `.to(device)` / `copy_` of host memory outside the pager (vLLM-style offloading): an
            # H2D copy on the stream that issued it, which is the compute stream here.
            self.tl.add_copy(h2d, name=str(func.overloadpacket.__name__), stream="compute", id=rid)
            self._last_op = rid
            return out
        if rid in self._split:
            self._split.discard(rid)
            flops, nbytes = 0, 0
            dtype = next((str(t.dtype).removeprefix("torch.") for t in torch.utils._pytree.tree_leaves(out)
                          if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
        else:
            flops, nbytes, dtype = _op_cost(func, args, kwargs, out)
        waits, self._pending_waits = self._pending_waits, []
        self.tl.add_op(flops, nbytes, dtype, waits=_unique(waits), name=str(func.overloadpacket.__name__), id=rid)
        self._last_op = rid
        return out

    # -------------------------------------------------------------- pager call sites

    def copied(self, pager, entry, nbytes: int, stream: str, prefetch: bool) -> None:
        waits, self._pending_frees = self._pending_frees, []
        key = getattr(entry, "key", None)
        rid = self.tl.add_copy(nbytes, waits=_unique(waits), name="prefetch" if prefetch else "page", stream=stream,
                               key=(id(pager),) + tuple(key) if key is not None else None)
        self._copy_of[id(entry)] = rid

    def used(self, entry) -> None:
        rid = self._copy_of.get(id(entry))
        if rid is not None:
            self._pending_waits.append(rid)

    def released(self, entries) -> None:
        # The last reader is the op running now, or, inside an op split into kernels, the kernel
        # just recorded.
        op = self._open_ops[-1] if self._open_ops and self._open_ops[-1] not in self._split else self._last_op
        if op is None:
            return
        for entry in entries:
            self._last_use[id(entry)] = op

    def freed(self, entry) -> None:
        """A cached copy is dropped: the next copy may take its block once its last reader is done."""
        op = self._last_use.pop(id(entry), None)
        self._copy_of.pop(id(entry), None)
        if op is not None:
            self._pending_frees.append(op)

    def host_sync(self) -> None:
        """The host reads a device value (dispatch._read_to_host) and waits for the compute stream."""
        self.tl.add_sync()

    def finish(self) -> None:
        if not self._events:
            return
        torch.cuda.synchronize()
        t0 = self._events[0][1]
        by_id = {r.id: r for r in self.tl.records}
        for rid, start, end in self._events:
            by_id[rid].measured_ms = (t0.elapsed_time(start), t0.elapsed_time(end))


def _unique(ids):
    return list(dict.fromkeys(ids))


def _pagers_of(model: nn.Module):
    pagers = []
    wrapped = pager_of(model)
    if wrapped is not None:
        pagers.append(wrapped)
    for t in list(model.parameters()) + list(model.buffers()):
        master = getattr(t, "_master", None)
        pager = master.pager if master is not None else None
        if pager is not None and all(pager is not p for p in pagers):
            pagers.append(pager)
    return pagers


class timeline:
    """``with ot.timeline(model) as tl: model(x)``: record every op and copy of the runs inside.
    Each forward of ``model`` is one step. ``measure=True`` on a GPU also keeps CUDA-event times of
    the ops (``Record.measured_ms``), to put beside the prediction.

    ``model=None`` records whatever runs inside (a step function, say); then ``pagers`` names the
    pagers whose copies to record and the caller marks steps with ``tl.next_step()``."""

    def __init__(self, model: Optional[nn.Module] = None, profile=None, measure: bool = False, pagers=None):
        self.model = model
        self.tl = Timeline(profile)
        self.recorder = Recorder(self.tl, measure)
        self._hook = None
        self._pagers = list(pagers) if pagers is not None else None
        self._started = False

    # The pager entry points that allocate and copy through ATen: their ops are the pager's, not the model's.
    _PAGER_ENTRY_POINTS = ("page", "upload", "copy_out", "prefetch")

    def __enter__(self) -> Timeline:
        if self._pagers is None:
            self._pagers = _pagers_of(self.model) if self.model is not None else []
        for pager in self._pagers:
            pager.recorder = self.recorder
            for name in self._PAGER_ENTRY_POINTS:
                # An instance attribute shadows the method while recording; __exit__ deletes it.
                setattr(pager, name, self.recorder.quiet(getattr(pager, name)))

        def new_step(module, args):
            if self._started:
                self.tl.next_step()
            self._started = True

        if self.model is not None:
            self._hook = self.model.register_forward_pre_hook(new_step)
        self.recorder.__enter__()
        return self.tl

    def __exit__(self, *exc):
        self.recorder.__exit__(*exc)
        if self._hook is not None:
            self._hook.remove()
        for pager in self._pagers:
            pager.recorder = None
            for name in self._PAGER_ENTRY_POINTS:
                pager.__dict__.pop(name, None)
        self.recorder.finish()
        return False


# ---------------------------------------------------------------------------- planning on meta


def plan(model: nn.Module, budget_gb: Optional[float] = None, example_inputs=(), profile="h200", steps: int = 3, *,
         offload_gb: Optional[float] = None, policy=None, prefetch: bool = True, warmup: int = 3,
         forward=None, routing: Optional[RoutingStats] = None) -> Timeline:
    """What ``model`` would do on a GPU at this budget: place its weights, run ``warmup + steps``
    forwards on the meta device with the real pager and prefetcher, and return the recorded
    timeline (replay it with ``tl.replay()``). Nothing is allocated or computed; ``model`` may be
    built on meta and is left as it was. ``warmup`` forwards let the prefetcher learn the order
    before the recorded steps (``tl.replay`` reports the last one).

    Routing has no values on meta: MoE layers route each token to distinct experts drawn
    uniformly, unless ``routing`` (``RoutingStats``, measured on a real run) gives each layer's
    skew and token-to-token locality, scaled to this model's expert count."""
    if budget_gb is None and offload_gb is None:
        raise ValueError("offtensor: plan() needs budget_gb or offload_gb: a meta model has no device to measure")
    config = OffloadConfig(budget_gb=budget_gb, offload_gb=offload_gb, device=torch.device("meta"), prefetch=prefetch,
                           policy=policy, strict=False)
    _check_built_on_meta(model)
    # The placement wrap_model would make, applied on a meta pager (on meta every copy is done when
    # issued: pager/device.py's MetaDevice); unwrapped when the plan ends, so the model is as it was.
    placed, pager = prepare(model, config, config.device)
    try:
        tl = _record_plan(model, placed, pager, example_inputs, profile, steps, warmup, forward, routing)
    finally:
        unwrap(model, wrapped_state(model))
    return tl


def _record_plan(model: nn.Module, placed: placement.ModelPlacement, pager, example_inputs, profile, steps: int,
                 warmup: int, forward, routing: Optional[RoutingStats]) -> Timeline:
    """``plan``'s forwards on the prepared meta model, recorded; the timeline with the plan's info."""
    hooks = []
    planned = None
    if routing is not None:
        planned = _PlannedRouting(routing, _top_k_of(model) or routing.top_k)
        hooks.append(model.register_forward_pre_hook(lambda m, a: planned.new_step()))
    inputs = tuple(x.to("meta") if isinstance(x, torch.Tensor) else x for x in example_inputs)
    rec = timeline(model, profile)
    tl = rec.tl
    tl.warmup_steps = warmup
    try:
        with torch.no_grad(), rec, _routing_from(planned):
            for _ in range(warmup + steps):
                (forward or model)(*inputs)
    finally:
        for h in hooks:
            h.remove()
    tl.info = _planned_info(placed.choice, pager.snapshot())
    tl.info["routing"] = routing.summary() if routing is not None else "uniform"
    return tl


def _check_built_on_meta(model: nn.Module) -> None:
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for attr, t in table.items():
                if t is not None and not t.is_meta:
                    raise ValueError(
                        f"offtensor: plan() needs a model built on meta (found {type(module).__name__}.{attr} on "
                        f"{t.device}); build it under `with torch.device('meta'):`"
                    )


def _planned_info(choice: placement.Placement, stats) -> dict:
    return {
        "budget_bytes": choice.budget_bytes,
        "resident_bytes": choice.resident_bytes,
        "offloaded_bytes": choice.offloaded_bytes,
        "offloaded": [w.name for w in choice.offload],
        "peak_device_bytes": stats.peak_device_bytes,
        "prefetches": stats.prefetches,
        "prefetch_hits": stats.prefetch_hits,
        "budget_gb": choice.budget_bytes / GiB,
        "experts": stats.experts,  # per stacked-expert tensor: hits, misses, bytes (all planned steps)
    }


# ---------------------------------------------------------------------------- measured routing for plans


@dataclasses.dataclass
class RoutingStats:
    """Routing measured on a real run, for plans of MoE models (``plan(..., routing=stats)``).

    Per MoE layer of the measured model: ``popularity``, the share of routed slots each expert
    took, most used first (the layer's skew), and ``locality``, the share of a token's experts
    that the previous token also used there (token-to-token reuse). A plan of a model with other
    counts scales them: the planned model's layers map onto the measured ones in proportion, and a
    layer's popularity curve is resampled at the planned expert count (the top 10% of experts take
    the same share of the routing). ``lookahead_precision`` (the next layer's top-k guessed from
    this layer's router input, per layer) is carried with the figures but enters no plan: meta
    tensors have no router values, so a plan makes no guesses (a real run copies them,
    experts.SPECULATE_COPY), and its step times are the cache's alone."""

    popularity: list
    locality: list
    top_k: int
    lookahead_precision: list = dataclasses.field(default_factory=list)
    source: str = ""

    @classmethod
    def from_trace(cls, steps, num_experts: int, lookahead_precision=(), source: str = "") -> "RoutingStats":
        """``steps``: a recorded decode, one entry per step, each a list over MoE layers of the
        expert ids that step's token was routed to."""
        if not steps or not steps[0]:
            raise ValueError("offtensor: RoutingStats.from_trace needs at least one step of one MoE layer")
        layers, top_k = len(steps[0]), len(steps[0][0])
        popularity, locality = [], []
        for layer in range(layers):
            counts = [0] * num_experts
            shared = pairs = 0
            prev = None
            for step in steps:
                ids = [int(e) for e in step[layer]]
                if len(ids) != top_k or any(not 0 <= e < num_experts for e in ids):
                    raise ValueError(f"offtensor: routing trace layer {layer}: {ids} is not {top_k} ids below "
                                     f"{num_experts}")
                for e in ids:
                    counts[e] += 1
                if prev is not None:
                    shared += len(prev & set(ids))
                    pairs += 1
                prev = set(ids)
            total = sum(counts)
            popularity.append(sorted((c / total for c in counts), reverse=True))
            locality.append(shared / (top_k * pairs) if pairs else top_k / num_experts)
        return cls(popularity, locality, top_k, list(lookahead_precision), source)

    @classmethod
    def uniform(cls, num_experts: int, top_k: int, layers: int = 1) -> "RoutingStats":
        """What an unmeasured plan assumes: every expert alike, consecutive tokens independent."""
        return cls([[1.0 / num_experts] * num_experts for _ in range(layers)], [top_k / num_experts] * layers, top_k,
                   source="uniform")

    @classmethod
    def load(cls, path: str) -> "RoutingStats":
        with open(path) as f:
            d = json.load(f)
        d = d.get("routing_stats", d)
        return cls(d["popularity"], d["locality"], int(d["top_k"]), d.get("lookahead_precision", []),
                   d.get("source", path))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def layer_shares(self, layer: int, layers: int, num_experts: int) -> list:
        """The popularity of planned layer ``layer`` of ``layers``, resampled at ``num_experts``:
        share i is the measured cumulative share curve between ranks i / E and (i + 1) / E."""
        measured = self.popularity[min(layer * len(self.popularity) // max(layers, 1), len(self.popularity) - 1)]
        n = len(measured)
        cum = [0.0]
        for p in measured:
            cum.append(cum[-1] + p)

        def at(x):  # the cumulative share of the top x (0..1) of the experts, piecewise linear
            pos = x * n
            i = min(int(pos), n - 1)
            return cum[i] + (pos - i) * measured[i]

        shares = [max(at((i + 1) / num_experts) - at(i / num_experts), 0.0) for i in range(num_experts)]
        total = sum(shares)
        return [s / total for s in shares]

    def layer_locality(self, layer: int, layers: int) -> float:
        return self.locality[min(layer * len(self.locality) // max(layers, 1), len(self.locality) - 1)]

    def summary(self) -> dict:
        """Per measured layer: entropy of expert use (bits) and locality, as the plan tables show them."""
        entropy = [-sum(p * math.log2(p) for p in layer if p > 0) for layer in self.popularity]
        return {"layers": len(self.popularity), "experts": len(self.popularity[0]), "top_k": self.top_k,
                "entropy_bits": entropy, "locality": list(self.locality),
                "lookahead_precision": list(self.lookahead_precision), "source": self.source}


class _PlannedRouting:
    """Routing on meta drawn from ``RoutingStats``: what ``dispatch``'s planned routing returns
    while ``plan(..., routing=...)`` runs. Each offloaded MoE layer reads its routing once per
    forward, in layer order, so the n-th read of a forward is the n-th MoE layer. A token keeps
    each of the previous token's experts at that layer with the measured locality and draws the
    rest from the layer's popularity (a fixed random assignment of ranks to expert ids per layer),
    excluding the previous token's: the expected reuse is the measured one."""

    def __init__(self, stats: RoutingStats, top_k: int, seed: int = 0):
        self.stats, self.top_k = stats, top_k
        self.g = torch.Generator().manual_seed(seed)
        self.layer, self.layers = 0, 0
        self.weights = {}  # (layer, experts) -> weight per expert id
        self.prev = {}  # layer -> the last token's experts

    def new_step(self) -> None:
        if self.layer:
            self.layers = self.layer
        self.layer = 0

    def _weights(self, layer: int, experts: int) -> torch.Tensor:
        w = self.weights.get((layer, experts))
        if w is None:
            shares = torch.tensor(self.stats.layer_shares(layer, self.layers or len(self.stats.popularity), experts),
                                  dtype=torch.float64)
            w = self.weights[(layer, experts)] = torch.empty_like(shares).scatter_(
                0, torch.randperm(experts, generator=self.g), shares)
        return w

    def ends(self, experts: int, rows: int) -> list:
        layer = self.layer
        self.layer += 1
        w = self._weights(layer, experts)
        k = max(min(self.top_k, experts, rows), 1)
        tokens = max(rows // k, 1)
        counts = torch.zeros(experts, dtype=torch.long)
        if tokens * k > 4 * experts:
            # A prefill: nearly every expert is routed; the rows follow the popularity.
            counts += torch.bincount(torch.multinomial(w, rows, replacement=True, generator=self.g), minlength=experts)
        else:
            reuse = self.stats.layer_locality(layer, self.layers or len(self.stats.locality))
            prev = self.prev.get(layer, [])
            for _ in range(tokens):
                kept = [e for e in prev if torch.rand((), generator=self.g).item() < reuse][:k]
                free = w.clone()
                free[list(set(prev) | set(kept))] = 0.0
                fill = k - len(kept)
                drawn = torch.multinomial(free, fill, replacement=False, generator=self.g).tolist() if fill else []
                prev = kept + drawn
                counts[prev] += 1
            self.prev[layer] = prev
            counts[torch.argmax(counts)] += rows - int(counts.sum())  # rows not a multiple of top-k
        return counts.cumsum(0).tolist()


@contextlib.contextmanager
def _routing_from(routing: Optional[_PlannedRouting]):
    """While planning with measured routing, dispatch's routing of a meta grouped GEMM comes from
    ``routing`` (``dispatch.planned_routing``)."""
    if routing is None:
        yield
        return
    with dispatch.planned_routing(routing.ends):
        yield


def _top_k_of(model: nn.Module) -> Optional[int]:
    config = getattr(model, "config", None)
    for owner in (config, *model.modules()):
        for name in ("num_experts_per_tok", "top_k", "moe_top_k"):
            value = getattr(owner, name, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


# Every routed expert stack offloaded: the whole budget beyond the dense weights is expert cache.
EXPERTS_PAGED = placement.EXPERTS_PAGED


def plan_expert_paging(model: nn.Module, budget_gb: float, example_inputs=(), routing: Optional[RoutingStats] = None,
                       profile="h200", steps: int = 2, warmup: int = 3, prefetch: bool = True) -> dict:
    """Which placement of a MoE model's routed experts is faster at this budget, decided by the
    replay rather than a policy flag: the default placement (whole expert stacks kept resident as
    far as the budget holds them, the rest paged) against every stack paged through the expert
    cache (``EXPERTS_PAGED``), both planned under ``routing`` (uniform without it).

    Skewed routing with token-to-token reuse favours paging everything (the cache keeps each
    layer's hot experts, a resident stack holds its cold ones too); uniform routing favours whole
    stacks. Returns ``{"policy": the wrap_model policy to use (None: the default), "paged": bool,
    "default": Replay, "all_paged": Replay}``."""
    replays = {}
    for name, policy in (("default", None), ("all_paged", EXPERTS_PAGED)):
        tl = plan(model, budget_gb=budget_gb, example_inputs=example_inputs, profile=profile, steps=steps,
                  warmup=warmup, policy=policy, routing=routing, prefetch=prefetch)
        replays[name] = tl.replay()
    paged = replays["all_paged"].step_ms < replays["default"].step_ms
    return {"policy": EXPERTS_PAGED if paged else None, "paged": paged, **replays}


# ---------------------------------------------------------------------------- placement that follows the routing
# What the expert-placement choice (expert_choice.py) decides by: routing statistics, a meta twin
# of the model to replay, an example step, and the replay of both placements.


def routing_stats_of(routing, num_experts: Optional[int] = None, what: str = "routing") -> RoutingStats:
    """``routing`` as ``RoutingStats``: a ``RoutingStats``; a recorded trace (``from_trace``'s
    steps: per step, per MoE layer, the expert ids the token was routed to) of a model with
    ``num_experts`` experts per layer; or a path to a JSON file holding either (``to_dict``'s
    fields, as ``benchmarks/moe_sim.py`` writes them, or a trace). Anything else is a TypeError or
    ValueError that says what is wrong with it."""
    if isinstance(routing, (str, os.PathLike)):
        path = os.fspath(routing)
        try:
            with open(path) as f:
                loaded = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"offtensor: {what}={path!r} is not a readable JSON file of routing statistics or a "
                             f"routing trace: {type(e).__name__}: {e}") from None
        if isinstance(loaded, dict):
            loaded = loaded.get("routing_stats", loaded)
            missing = [k for k in ("popularity", "locality", "top_k") if k not in loaded]
            if missing:
                raise ValueError(f"offtensor: {what}={path!r} holds a JSON object without {missing}: not "
                                 f"RoutingStats.to_dict()'s fields (popularity, locality, top_k)")
            loaded = RoutingStats(loaded["popularity"], loaded["locality"], loaded["top_k"],
                                  loaded.get("lookahead_precision", []), loaded.get("source", path))
        return routing_stats_of(loaded, num_experts, f"{what} (from {path!r})")
    if isinstance(routing, RoutingStats):
        _check_routing_stats(routing, what)
        return routing
    if isinstance(routing, (list, tuple)):
        if num_experts is None:
            raise ValueError(f"offtensor: {what} is a routing trace, but the model has no routed expert stacks to "
                             f"say how many experts its ids count")
        try:
            return RoutingStats.from_trace(routing, num_experts, source=f"a routing trace of {len(routing)} steps")
        except (TypeError, IndexError) as e:
            raise ValueError(f"offtensor: {what} is not a routing trace (a list of steps, each a list over MoE "
                             f"layers of the expert ids a token was routed to): {type(e).__name__}: {e}") from None
    raise TypeError(f"offtensor: {what} must be RoutingStats, a routing trace (a list of steps, each a list over MoE "
                    f"layers of expert ids) or a path to a JSON file of either, got {type(routing).__name__}")


def _check_routing_stats(stats: RoutingStats, what: str) -> None:
    layers = stats.popularity
    if not isinstance(layers, (list, tuple)) or not layers or not all(isinstance(p, (list, tuple)) and p
                                                                        for p in layers):
        raise ValueError(f"offtensor: {what}: popularity must be a non-empty list of per-layer lists of expert "
                         f"shares, got {str(layers)[:80]}")
    if not isinstance(stats.top_k, int) or isinstance(stats.top_k, bool) or stats.top_k < 1:
        raise ValueError(f"offtensor: {what}: top_k must be a positive int, got {stats.top_k!r}")
    for i, shares in enumerate(layers):
        total = sum(shares) if all(isinstance(p, (int, float)) and p >= 0 for p in shares) else None
        if total is None or abs(total - 1.0) > 1e-3:
            raise ValueError(f"offtensor: {what}: layer {i}'s popularity must be non-negative shares summing to 1, "
                             f"got {str(shares)[:80]} (sum {total})")
    if len(stats.locality) != len(layers) or not all(isinstance(x, (int, float)) and 0 <= x <= 1
                                                       for x in stats.locality):
        raise ValueError(f"offtensor: {what}: locality must be one share in [0, 1] per layer ({len(layers)}), got "
                         f"{str(stats.locality)[:80]}")


def _router_modules(model: nn.Module) -> list:
    """(name, module, experts) of the routers of ``model``'s routed expert stacks, in module order:
    what ``experts.attach`` hooks (a ``gate`` / ``router`` with a [num_experts, hidden] weight)."""
    sizes = {t.shape[0] for name, t in list(model.named_parameters()) + list(model.named_buffers())
             if experts.is_routed_stack(name, t.shape)}
    return [(name, module, module.weight.shape[0]) for name, module in experts.router_modules(model, sizes)]


def _routed_ids(output, num_experts: int, top_k: int, module: nn.Module) -> Optional[torch.Tensor]:
    """[tokens, top_k] expert ids from a router's output: the ids it returns (transformers'
    routers return logits, scores and indices), else the top-k of its logits (DeepSeek-V3 selects
    on sigmoid scores plus ``e_score_correction_bias``). Stays on the device: nothing is read."""
    outs = output if isinstance(output, (tuple, list)) else (output,)
    tensors = [t for t in outs if isinstance(t, torch.Tensor) and t.dim() >= 1 and not t.is_meta]
    ids = next((t for t in tensors if not t.is_floating_point() and t.shape[-1] == top_k), None)
    if ids is not None:
        return ids.detach().reshape(-1, top_k)
    logits = next((t for t in tensors if t.is_floating_point() and t.shape[-1] == num_experts), None)
    if logits is None:
        return None
    with torch.no_grad():
        scores = logits.detach().reshape(-1, num_experts).float()
        bias = getattr(module, "e_score_correction_bias", None)
        if isinstance(bias, torch.Tensor) and not hasattr(bias, "_master") and bias.shape[-1] == num_experts:
            scores = scores.sigmoid() + bias.detach().float()
        return scores.topk(min(top_k, num_experts), dim=-1).indices


class RoutingRecorder:
    """The routing a model runs, read off its routers' outputs by forward hooks: for each routed
    token (every row a router sees, prefill rows in order, then each decode step's), the experts
    of every MoE layer. Ids stay on the device until ``trace()`` reads them all at once, so
    recording adds no host sync. Records ``limit`` tokens per router, then nothing."""

    def __init__(self, model: nn.Module, limit: int):
        self.limit = limit
        self.top_k = _top_k_of(model)
        routers = _router_modules(model) if self.top_k else []
        self.num_experts = max((e for _, _, e in routers), default=None)
        self.ids = [[] for _ in routers]  # per router: [tokens, top_k] id tensors, in call order
        self.rows = [0] * len(routers)
        self.hooks = [module.register_forward_hook(functools.partial(self._seen, i, experts_count))
                      for i, (_, module, experts_count) in enumerate(routers)]

    def _seen(self, i: int, num_experts: int, module, args, output) -> None:
        if torch.compiler.is_compiling() or self.rows[i] >= self.limit:
            return
        ids = _routed_ids(output, num_experts, self.top_k, module)
        if ids is not None:
            self.ids[i].append(ids)
            self.rows[i] += ids.shape[0]

    @property
    def tokens(self) -> int:
        """Tokens every router has been seen routing."""
        return min(self.rows, default=0)

    def trace(self) -> list:
        """The recorded routing as ``RoutingStats.from_trace`` takes it: per token, per layer, ids."""
        n = self.tokens
        layers = [torch.cat(ids)[:n].tolist() for ids in self.ids]
        return [[layer[t] for layer in layers] for t in range(n)]

    def stats(self) -> RoutingStats:
        return RoutingStats.from_trace(self.trace(), self.num_experts,
                                       source=f"measured by the wrapped model over its first {self.tokens} routed tokens")

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []
        self.ids = [[] for _ in self.ids]


def meta_twin(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters, buffers and tensor attributes are meta tensors of the
    same shapes and dtypes (nothing allocated): what ``plan`` replays for a model that has values.
    Parameters tied by identity stay tied. Taken before wrapping, so none of offtensor's classes
    come with it, and without the modules' hooks: a user's hook (one that logs outputs, say) would
    otherwise run on the plan's meta tensors, and its closure is the user's, shared, not copied."""
    memo = {}
    for module in model.modules():
        for attr, value in module.__dict__.items():
            if isinstance(value, dict) and attr.startswith("_") and "_hooks" in attr:
                memo[id(value)] = type(value)()
        tensors = [*module._parameters.values(), *module._buffers.values(),
                   *(t for t in module.__dict__.values() if isinstance(t, torch.Tensor))]
        for t in tensors:
            if t is not None and id(t) not in memo:
                memo[id(t)] = _meta_like(t)
    return copy.deepcopy(model, memo)


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
    return nn.Parameter(meta, requires_grad=False) if isinstance(t, nn.Parameter) else meta


def sync_twin(twin: nn.Module, model: nn.Module) -> None:
    """Give ``twin`` (``meta_twin`` of ``model``) the shapes and dtypes ``model`` has now (a cast
    after wrapping halves the bytes a plan must count)."""
    now = dict(model.named_parameters(remove_duplicate=False))
    now.update(model.named_buffers(remove_duplicate=False))
    for table_of, named in ((lambda m: m._parameters, twin.named_parameters), (lambda m: m._buffers, twin.named_buffers)):
        for name, t in list(named(remove_duplicate=False)):
            current = now.get(name)
            if current is not None and (current.dtype != t.dtype or current.shape != t.shape):
                owner, _, attr = name.rpartition(".")
                table_of(twin.get_submodule(owner))[attr] = _meta_like(current)


def decode_example(model: nn.Module, args=(), kwargs=None) -> Optional[tuple]:
    """The inputs of one planned decode step of ``model`` on meta: a token for a transformers
    language model; else the tensors of a forward's positional ``args`` as meta tensors, token ids
    ([batch, tokens] integers) cut to the last token and objects (a KV cache) left out, so the
    plan starts without them. None when there is nothing to plan from."""
    if getattr(model, "main_input_name", None) == "input_ids":
        return (torch.zeros(1, 1, dtype=torch.long, device="meta"),)
    example = []
    for a in args:
        if isinstance(a, torch.Tensor):
            shape = (*a.shape[:-1], 1) if a.dim() == 2 and not a.is_floating_point() and a.shape[-1] else a.shape
            example.append(torch.empty(shape, dtype=a.dtype, device="meta"))
        else:
            example.append(a if a is None or isinstance(a, (bool, int, float, str)) else None)
    return tuple(example) if any(isinstance(a, torch.Tensor) for a in example) else None


def faster_expert_placement(twin: nn.Module, budget_bytes: int, example_inputs, routing: RoutingStats,
                            profile="h200", prefetch: bool = True) -> dict:
    """``plan_expert_paging`` of ``twin`` at ``budget_bytes`` under ``routing``, as the report
    ``ot.stats(model).expert_placement`` shows: the placement chosen and both replayed steps."""
    profile = get_profile(profile)
    verdict = plan_expert_paging(twin, budget_bytes / GiB, example_inputs, routing=routing, profile=profile,
                                 prefetch=prefetch)
    return {"chosen": "all_paged" if verdict["paged"] else "default", "policy": verdict["policy"],
            "default_step_ms": verdict["default"].step_ms, "all_paged_step_ms": verdict["all_paged"].step_ms,
            "profile": profile.name, "routing": routing.summary()}

