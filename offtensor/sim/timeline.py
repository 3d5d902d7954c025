"""A timeline: the records of a step in issue order (copies and ops, their bytes, FLOPs and what each
waits for), its replay on two in-order streams fed by one host lane under a Profile, and its export
(Chrome trace, PNG)."""

from __future__ import annotations

import dataclasses
import json
from typing import Optional, Sequence

from .profiles import GB, Profile, get_profile, measure_host


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
    pages: int = 0  # op: offloaded arguments it paged (cache hits or copies): offtensor's host work for it
    releases: int = 0  # op: records of paged arguments given back as it ran (an op's dispatch and release)
    pooled: int = 0  # op: grouped GEMMs it ran from a device-side expert pool (offtensor's host work for them)
    # copy: issued by the device itself (an expert pool's gather, decided on the device): no host work
    device_side: bool = False
    # The expert policy's host time before this record was issued (victim search, bookkeeping,
    # guesses), by wall clock on the machine that recorded it (policy_clock): charged by a replay
    # with policy_host=True.
    policy_ms: float = 0.0
    # op on the host lane: the host's time for it, measured where it ran (an op over an offloaded
    # tensor computed from its host master); a replay takes it instead of the profile's host figures.
    measured_host_ms: Optional[float] = None


@dataclasses.dataclass
class Replay:
    """Predicted times of a timeline under one profile; the figures describe the last step."""

    profile: Profile
    step_ms: float
    bound_ms: float
    ratio_to_bound: float
    copy_busy: float  # fraction of the last step's time the copy stream was busy
    compute_busy: float
    compute_ms: float  # the last step's ops alone, back to back (the compute part of the bound)
    copy_bound_ms: float  # the last step's distinct copied bytes / H2D (the copy part of the bound)
    steps_ms: list  # every step's duration
    starts: dict  # record id -> predicted start, ms
    ends: dict
    step_windows: list  # (start, end) of every step, ms
    # The last step's host lane: offtensor's own host work for its records (the profile's host_us),
    # plus, where the host runs the ops itself (the emulated device), the ops (the host part of the bound).
    host_ms: float = 0.0
    bound_by: str = "compute"  # which of "compute", "copy", "host" the bound is

    @property
    def host_bound(self) -> bool:
        return self.bound_by == "host"

    def __str__(self):
        return (
            f"Replay({self.profile.name}: step {self.step_ms:.2f} ms, bound {self.bound_ms:.2f} ms ({self.bound_by}), "
            f"ratio {self.ratio_to_bound:.3f}, copy busy {self.copy_busy:.1%}, compute busy {self.compute_busy:.1%}, "
            f"host {self.host_ms:.2f} ms)"
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
                 key=None, id: Optional[int] = None, device_side: bool = False, policy_ms: float = 0.0) -> int:
        """A host->device copy on ``stream``; ``device_side``: one the device decides and issues
        itself (an expert pool's fetch), which costs the host lane nothing."""
        rid = self.new_id() if id is None else id
        self.records.append(Record(rid, "copy", stream, name, int(nbytes), 0, None, self.step, list(waits), key,
                                   device_side=device_side, policy_ms=float(policy_ms)))
        return rid

    def add_op(self, flops: float, nbytes: int, dtype="bfloat16", waits: Sequence[int] = (), name: str = "op",
               id: Optional[int] = None, stream: str = "compute", pages: int = 0, pooled: int = 0,
               releases: int = 0, policy_ms: float = 0.0, measured_host_ms: Optional[float] = None) -> int:
        """An op on the compute stream, or with ``stream="host"`` one the host computes itself (a
        routed expert from its host master: ``Profile.host_op_ms``), which the issuing thread waits
        for; ``pages``: the offloaded arguments it paged (offtensor's host work for it); ``releases``:
        the records of paged arguments given back as it ran (one per op that paged, or per expert
        where its handler pages them one at a time); ``pooled``: the expert calls it ran from a
        device-side expert pool (their host work, with no page); ``measured_host_ms``: a host op's
        time as measured, which a replay takes instead of the profile's host figures."""
        rid = self.new_id() if id is None else id
        dtype = str(dtype).removeprefix("torch.") if dtype is not None else None
        self.records.append(Record(rid, "op", stream, name, int(nbytes), int(flops), dtype, self.step, list(waits),
                                   pages=int(pages), pooled=int(pooled), releases=int(releases),
                                   policy_ms=float(policy_ms),
                                   measured_host_ms=None if measured_host_ms is None else float(measured_host_ms)))
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

    def replay(self, profile=None, sync: Optional[str] = "device", policy_host: bool = False) -> Replay:
        """Schedule every record on its in-order stream after the records it waits for.

        ``sync`` is what the host does between steps, before it issues the next one:
        ``"device"`` (``torch.cuda.synchronize()``, how a step is timed: the calibration
        measurements were taken so) waits for both streams, prefetches in flight included;
        ``"compute"`` (reading the step's result, e.g. the sampled token) waits for the compute
        stream only; ``None`` issues the steps back to back. ``policy_host``: the host lane also carries
        the expert policy's host time as recorded (``Record.policy_ms``)."""
        if sync not in ("device", "compute", None):
            raise ValueError(f"offtensor: sync must be 'device', 'compute' or None, got {sync!r}")
        profile = get_profile(profile or self.profile or "h200")
        starts, ends, free = {}, {}, {"copy": 0.0, "compute": 0.0, "host": 0.0}
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
                host = max(host, barrier, free["compute"])
                starts[r.id] = ends[r.id] = host
                continue
            # The host lane: offtensor's own work for this record (its lookups, or issuing a copy)
            # comes before the record is issued; nothing starts before the host has issued it.
            host = max(host, barrier) + (0.0 if r.device_side else profile.host_ms(r.kind, r.pages, r.pooled, r.releases)) \
                + (r.policy_ms if policy_host else 0.0)
            ready = max(free[r.stream], host)
            for w in r.waits:
                end = ends.get(w)
                if end is None:
                    raise ValueError(f"offtensor: record {r.id} ({r.name}) waits for {w}, which was not issued before it")
                ready = max(ready, end)
            dur = (profile.copy_ms(r.nbytes) if r.kind == "copy" else _host_op_ms(profile, r)
                   if r.stream == "host" else profile.op_ms(r.flops, r.nbytes, r.dtype))
            starts[r.id], ends[r.id] = ready, ready + dur
            free[r.stream] = ready + dur
            if r.stream == "host" or (profile.host_blocking and r.stream == "compute"):
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
        compute_ms, copy_bound_ms, host_ms = self._step_parts(profile, last, policy_host)
        parts = {"compute": compute_ms, "copy": copy_bound_ms, "host": host_ms}
        bound_by = max(parts, key=parts.get)
        bound = parts[bound_by]
        span = hi - lo
        return Replay(
            profile, span, bound, span / bound if bound else float("nan"),
            busy["copy"] / span if span else 0.0, busy["compute"] / span if span else 0.0,
            compute_ms, copy_bound_ms, steps_ms, starts, ends, windows, host_ms, bound_by,
        )

    def _step_parts(self, profile: Profile, step: int, policy_host: bool = False) -> tuple:
        """(compute, copy, host) ms of ``step``: its device ops back to back, its distinct copied bytes
        / H2D, and its host lane (offtensor's host work and the ops the host computes; with every op,
        where the host runs them)."""
        compute = host = 0.0
        for r in self.records:
            if r.step == step and r.kind in ("op", "copy"):
                host += 0.0 if r.device_side else profile.host_ms(r.kind, r.pages, r.pooled, r.releases)
                host += r.policy_ms if policy_host else 0.0
                if r.kind == "op" and r.stream == "host":  # an op the host computes itself
                    host += _host_op_ms(profile, r)
                elif r.kind == "op":
                    compute += profile.op_ms(r.flops, r.nbytes, r.dtype)
        if profile.host_blocking:
            host += compute
        return compute, self.step_copy_bytes(step) / (profile.h2d_gbps * GB) * 1e3, host

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
        if any(r.stream == "host" for r in self.records):  # syncs, and ops the host computes itself
            lane = "host" if any(r.kind != "sync" and r.stream == "host" for r in self.records) else "host syncs"
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": 3, "args": {"name": lane}})
        tids = {"compute": 1, "copy": 2, "host": 3}
        for r in self.records:
            if r.step < first:
                continue
            args = {"id": r.id, "bytes": r.nbytes, "flops": r.flops, "step": r.step, "waits": list(r.waits),
                    "pages": r.pages, "releases": r.releases}
            if r.measured_host_ms is not None:
                args["measured_host_us"] = r.measured_host_ms * 1e3
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
                "copy_busy": result.copy_busy, "compute_busy": result.compute_busy, "host_ms": result.host_ms,
                "bound_by": result.bound_by, **_jsonable(self.info),
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
        from .._optional import pyplot

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
        return max(self._step_parts(profile, step))


def _host_op_ms(profile: Profile, r: Record) -> float:
    """A host op's time: as measured where it ran, else the profile's host figures for its FLOPs and
    bytes. One recorded without a time (an ``ot.plan`` on meta measures nothing) under a profile
    without host figures takes this machine's (``measure_host``), as the choice of
    ``expert_compute`` does, rather than an infinite step."""
    if r.measured_host_ms is not None:
        return r.measured_host_ms
    if not (profile.host_tflops and profile.host_gbps):
        profile = profile.with_host(**measure_host())
    return profile.host_op_ms(r.flops, r.nbytes, r.dtype)


def _jsonable(info: dict) -> dict:
    return json.loads(json.dumps(info, default=str))
