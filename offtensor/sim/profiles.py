"""Device profiles: how fast one GPU copies host->device, computes per dtype and moves device memory,
its per-op overhead and offtensor's own host time per op; the built-in measured and published ones,
and a measurement of the device at hand."""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Optional

import torch

GB = 1e9


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
    # offtensor's own host time per kind of record, µs, on the host that issues them (the replay's
    # host lane): "page" per offloaded argument an op pages (dispatch through the subclass, cache
    # lookup, use counts, release), "copy" per host->device copy it issues (slot, bookkeeping), "pool"
    # per grouped GEMM served from a device-side expert pool (its lookup, admit and plan). Where
    # "expert" is given, a page that shares its op's record with others costs that instead (the
    # lookup and its expert's one-group kernel, the release and dispatch paid once per record:
    # a grouped GEMM on cached experts), and each record given back the rest of "page".
    # Empty: the host is taken to issue at no cost (launch_us is the device's per-op gap).
    host_us: dict = dataclasses.field(default_factory=dict)
    host_source: str = ""
    # The host's own compute, for routed experts computed from their host masters: GEMM TFLOP/s per
    # dtype and host-memory read GB/s (None: not measured; ``with_host`` adds them).
    host_tflops: Optional[dict] = None
    host_gbps: Optional[float] = None

    def op_ms(self, flops: float, nbytes: float, dtype: Optional[str]) -> float:
        """An op takes its roofline time, compute or memory, whichever is longer, plus its overhead."""
        rate = self.tflops.get(dtype) or self.tflops.get("float32")
        compute = flops / (rate * 1e12) if flops else 0.0
        memory = nbytes / (self.hbm_gbps * GB) if nbytes else 0.0
        return (max(compute, memory) + self.launch_us * 1e-6) * 1e3

    def host_op_ms(self, flops: float, nbytes: float, dtype: Optional[str]) -> float:
        """A host op (a routed expert's GEMM on its host master): its roofline time on the host."""
        if not self.host_tflops or not self.host_gbps:
            return float("inf")  # no host figures: the host is never chosen
        rate = self.host_tflops.get(dtype) or self.host_tflops.get("float32")
        compute = flops / (rate * 1e12) if flops else 0.0
        memory = nbytes / (self.host_gbps * GB) if nbytes else 0.0
        return max(compute, memory) * 1e3

    def with_host(self, host_tflops: dict, host_gbps: float) -> "Profile":
        """This profile with the host's compute figures (``measure_host``'s)."""
        return dataclasses.replace(self, host_tflops=dict(host_tflops), host_gbps=float(host_gbps))

    def copy_ms(self, nbytes: float) -> float:
        return (nbytes / (self.h2d_gbps * GB) + self.launch_us * 1e-6) * 1e3

    def host_ms(self, kind: str, pages: int = 0, pooled: int = 0, releases: int = 0) -> float:
        """offtensor's host time for one record: a copy, or an op that paged ``pages`` arguments,
        gave back ``releases`` records of them and ran ``pooled`` grouped GEMMs from an expert pool.
        Without an "expert" figure every page costs a whole "page" (its release included)."""
        us = self.host_us
        if kind == "copy":
            return us.get("copy", 0.0) * 1e-3
        page, expert = us.get("page", 0.0), us.get("expert")
        # An op that paged n and gave them back costs page + (n - 1) * expert. A record given back
        # after the kernels that paged it (an op split into kernels) carries its part on the record
        # after them, which is not below zero (an expert dearer than a page: off by that difference).
        paging = pages * page if expert is None else max(pages * expert + releases * (page - expert), 0.0)
        return (paging + pooled * us.get("pool", 0.0)) * 1e-3


# The measured H200 figures (an H200 SXM, PCIe Gen5 x16, torch 2.11). A bf16 GEMM burst of
# 8192^3 runs at about 790 TFLOP/s; what a step sustains is lower (clocks under sustained load): the
# all-resident prefill of 48 GEMMs of 4096 x 8192 x 24576 took 116.1 ms. The profile carries that
# sustained rate, derived here from the measurement rather than typed in.
_H200_PREFILL_FLOPS = 48 * 2 * 4096 * 8192 * 24576
_H200_SUSTAINED_BF16 = _H200_PREFILL_FLOPS / 116.1e-3 / 1e12  # about 682 TFLOP/s

# offtensor's own host time per op on the H200's host, measured there by benchmarks/gpu_probe.py
# (offtensor.measure_host_us; benchmarks/results/gpu_suite_h200.json holds the run and its command):
# 25.4 us per cache-hit page beyond the plain op, 25.7 us more per copy issued, and 649 us per
# grouped GEMM served from the device-side expert pool in eager mode (its admit is tens of small
# tensor ops, each a kernel launch; a captured CUDA graph replays them with no host work). These are
# 3.6x and 32x the emulated device's figures on the development machine: the GPU path records an
# event per use and launches real kernels where the emulated device runs one native call. The pool's
# figure was measured on an admit that still wrote host-made values into device tables (three
# blocking copies, each a stream sync); it stands until the suite measures the admit without them.
_H200_HOST_US = {"page": 25.4, "copy": 25.7, "pool": 649.2}
_H200_HOST_SOURCE = ("measured by benchmarks/gpu_probe.py (offtensor.measure_host_us) on the H200 machine's host, "
                     "torch 2.11+cu130: per cache-hit page, per copy issued, per pooled expert GEMM (eager)")

PROFILES = {
    "h200": Profile(
        name="h200",
        h2d_gbps=55.3,
        tflops={"bfloat16": _H200_SUSTAINED_BF16, "float16": _H200_SUSTAINED_BF16, "float32": 67.0},
        hbm_gbps=4300.0,
        launch_us=4.0,
        host_us=dict(_H200_HOST_US),
        host_source=_H200_HOST_SOURCE,
        source=(
            "measured on an H200 SXM, torch 2.11: pinned H2D 55.3 GB/s; bf16 GEMM "
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
    """The ``Profile`` that ``profile`` names. A ``Profile`` (a built-in one, or what ``measure_profile``
    returned) is returned as it is; anything else is looked up, as ``str(profile).lower()``, among the
    built-in names of ``PROFILES`` ("h200", "h100"). There is no file form: any other name, a path
    included, is a ValueError that lists the built-in names."""
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
    from ..pager import resolve_device
    from .. import _ext

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
    # On the emulated device a half-precision GEMM runs without native kernels (seconds at 1024^3):
    # 512^3 gives the same rate in an eighth of the time.
    n = 8192 if cuda else 512
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        tflops[str(dtype).removeprefix("torch.")] = 2 * n**3 / timed(lambda: a @ b, 5 if cuda else 2) / 1e12
    profile = Profile(
        name=name or (torch.cuda.get_device_name(device) if cuda else "emulated-cpu"),
        h2d_gbps=h2d,
        tflops=tflops,
        hbm_gbps=hbm,
        launch_us=measure_launch_us(device),
        source=f"measured by offtensor.measure_profile on {device}, torch {torch.__version__}",
        host_blocking=not cuda,
        host_source=f"measured by offtensor.measure_host_us on {device}'s host",
        **measure_host(),
    )
    return dataclasses.replace(profile, host_us=measure_host_us(device, profile))


def _min_us(fn, iters: int, repeats: int, sync) -> float:
    """µs per call of ``fn``: the fastest of ``repeats`` runs of ``iters`` calls (host wall-clock)."""
    best = float("inf")
    for _ in range(repeats):
        fn()
        sync()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        best = min(best, (time.perf_counter() - start) / iters * 1e6)
    return best


def measure_launch_us(device=None, iters: int = 1000, repeats: int = 5) -> float:
    """The per-op overhead on ``device``: a 16-element in-place add, the fastest of ``repeats`` runs
    (load on a shared host only adds time)."""
    from ..pager import resolve_device

    device = resolve_device(device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    tiny = torch.zeros(16, device=device)
    return _min_us(lambda: tiny.add_(1), iters, repeats, sync)


def measure_host_us(device=None, profile: Optional[Profile] = None, iters: int = 2000, repeats: int = 5) -> dict:
    """offtensor's own host time per op on ``device``'s host, µs: ``{"page": ..., "copy": ..., "pool": ...,
    "expert": ...}``.

    ``page``: ``F.linear`` of one token on a tiny cached OffloadedTensor, less the same op on the
    plain tensor (the dispatch, lookup, use counts and release around a cache hit). Where the host
    runs the ops itself (a ``host_blocking`` ``profile``: the emulated device), less the time
    ``profile`` gives that op instead, so that a replayed hit takes what a measured one does.
    ``copy``: the same op on an uncached OffloadedTensor, less the cached one (issuing the copy and
    its bookkeeping; the copy itself, of 1 KiB, is the profile's ``copy_ms``). ``pool``: a one-row
    ``_grouped_mm`` on a 4-expert stack served from a device-side expert pool that holds its expert,
    two calls per routing as an MoE layer makes them (an admit, then its reuse), per call, less the
    plain call (or, on the emulated device, less the time ``profile`` gives that op). ``expert``: a
    ``_grouped_mm`` routing one row to each of 4 cached experts of a stack, less the same routing one
    row to 1, per further expert: what each expert costs beyond the op's one dispatch and release
    (its lookup, its one-group kernel's launch; on the emulated device less the time ``profile``
    gives that kernel). Host wall-clock time, interleaved, the fastest of ``repeats`` runs of ``iters`` ops: the host's
    cost, not the noise of a shared machine."""
    import torch.nn.functional as F

    from ..pager import Pager, resolve_device
    from ..tensor import offload

    device = resolve_device(device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    weight = torch.randn(16, 16)
    x = torch.randn(1, 16, device=device)
    cached_pager = Pager(device, budget_bytes=1 << 20)
    subjects = {"plain": weight.to(device), "hit": offload(weight, pager=cached_pager),
                "copy": offload(weight, device)}
    try:
        grouped, keep = _grouped_subjects(x, cached_pager, device)  # keep: the pool's pager, held here
        subjects.update(grouped)
    except RuntimeError as error:  # no grouped GEMM on this device: no "pool" figure, and why
        warnings.warn(f"offtensor: measure_host_us: the pooled grouped GEMM does not run on {device} ({error}); "
                      f"host_us has no 'pool' figure")
    best = {name: float("inf") for name in subjects}
    with torch.no_grad():
        for _ in range(repeats):  # interleaved: a burst of load hits all alike
            for name, w in subjects.items():
                if isinstance(w, tuple):  # (a call, the grouped GEMMs it makes)
                    calls = w[1]
                    best[name] = min(best[name], _min_us(w[0], max(iters // calls, 1), 1, sync) / calls)
                else:
                    best[name] = min(best[name], _min_us(lambda: F.linear(x, w), iters, 1, sync))
    plain, stacked, kernel = best["plain"], best.get("stack"), 0.0
    if profile is not None and profile.host_blocking:
        # What the replay charges the ops themselves: y (1 x 16) = x (1 x 16) @ W^T (16 x 16), float32
        # (the grouped one reads one expert of the stack and the group ends besides; an expert's
        # one-group kernel, a recorded op of its own, the same).
        plain = profile.op_ms(2 * 16 * 16, (16 + 16 * 16 + 16) * 4, "float32") * 1e3
        stacked = kernel = profile.op_ms(2 * 16 * 16, (16 + 16 * 16 + 16 + 4) * 4, "float32") * 1e3
    host = {"page": max(best["hit"] - plain, 0.0), "copy": max(best["copy"] - best["hit"], 0.0)}
    if "pool" in best:
        host["pool"] = max(best["pool"] - stacked, 0.0)
    if "experts_4" in best:
        # Per expert that shares its op's record: its lookup, its one-group kernel's launch (on a
        # GPU, host time the plain one-kernel call does not spend) and no release of its own.
        host["expert"] = max((best["experts_4"] - best["experts_1"]) / 3 - kernel, 0.0)
    return host


def _grouped_subjects(x: torch.Tensor, cached_pager, device) -> tuple:
    """measure_host_us's grouped GEMMs, each ``(a call, the grouped GEMMs it makes)``, first called
    once (the pool's fetch, every expert's first copy, the kernels' first launches): ``stack`` and
    ``pool``, an MoE layer's two GEMMs per routing (the second reuses the admit) twice on a plain
    stack and on one served from a device-side expert pool; ``experts_1`` / ``experts_4``, one on
    the expert cache's hit path routing one row to each of 1 and of 4 cached experts (one dispatch
    and one release either way: the difference is 3 experts' lookups and one-group kernels).
    (the subjects, what must outlive them)"""
    from ..tensor import offload

    # bf16 on a GPU (its _grouped_mm kernel's dtype), float32 here.
    gx = x.to(torch.bfloat16) if device.type == "cuda" else x
    stack = torch.randn(4, 16, 16, dtype=gx.dtype)
    offs = torch.tensor([0, 1, 1, 1], dtype=torch.int32, device=device)
    routings = (offs, offs.clone())

    def layer(w):
        for o in routings:
            torch._grouped_mm(gx, w.transpose(-2, -1), o)
            torch._grouped_mm(gx, w.transpose(-2, -1), o)

    pooled, pool_pager = _pooled(stack, device)  # a master holds its pager weakly
    dense = stack.to(device)
    cached_stack = offload(stack, pager=cached_pager).transpose(-2, -1)
    g4 = gx.expand(4, -1).contiguous()
    to_one = torch.tensor([1, 1, 1, 1], dtype=torch.int32, device=device)
    to_four = torch.tensor([1, 2, 3, 4], dtype=torch.int32, device=device)
    subjects = {"stack": (lambda: layer(dense), 4), "pool": (lambda: layer(pooled), 4),
                "experts_1": (lambda: torch._grouped_mm(gx, cached_stack, to_one), 1),
                "experts_4": (lambda: torch._grouped_mm(g4, cached_stack, to_four), 1)}
    with torch.no_grad():
        for call, _ in subjects.values():
            call()
    return subjects, (pool_pager, pooled)


def _pooled(stack: torch.Tensor, device) -> tuple:
    """``stack`` offloaded to a pager of its own whose device-side expert pool has a slot for each
    of its experts (``moe.pool``): after its first call, a pooled grouped GEMM's hit path. (the
    stack, its pager)"""
    from ..moe.pool import ExpertPool, ExpertPools
    from ..pager import Pager
    from ..tensor import offload

    pager = Pager(device, budget_bytes=1 << 20)
    w = offload(stack, pager=pager)
    n = stack.shape[0]
    pool = ExpertPool(((tuple(stack.shape[1:]), stack.dtype),), n, [([w._master.id], n, [w._host])], device)
    pager.expert_pool = ExpertPools([pool])
    return w, pager


_HOST = {}  # the host's figures, measured once per process


def measure_host() -> dict:
    """The host's GEMM TFLOP/s per dtype (at the shape of a decode's routed expert, a few rows
    against a weight that is not in cache) and host-memory read GB/s: what computing a routed
    expert from its host master costs (``Profile.host_tflops`` / ``host_gbps``). Measured once."""
    if _HOST:
        return dict(_HOST)

    def timed(fn, repeat):
        fn()
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        return (time.perf_counter() - t0) / repeat

    src = torch.ones(16 << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    gbps = src.numel() / timed(lambda: dst.copy_(src), 5) / GB  # each byte read once (and written)
    tflops = {}
    n = 512
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        tflops[str(dtype).removeprefix("torch.")] = 2 * n**3 / timed(lambda: a @ b, 3) / 1e12
    _HOST.update(host_tflops=tflops, host_gbps=gbps)
    return dict(_HOST)
