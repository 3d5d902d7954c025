"""Last-use marks (``pager/marks.py``) and ``CudaDevice``'s ordering, on a fake GPU.

The fake GPU models what the pager relies on: a stream runs its work in the order it was enqueued;
an event is recorded at a position of one stream's queue and completes when that stream has run up
to it; ``wait_event`` makes a stream's next work wait for the event's position at the time of the
call. Streams advance at random relative speeds, and each piece of work checks, when it runs, that
the work it must follow (by the host's order of issue) has run: a copy into a range after every
earlier reader and writer of it, a reader after the copy that filled it. A missing or too-early wait
is reported as a hazard, which on a real GPU would be a read of freed or half-written memory.
"""

from __future__ import annotations

import contextlib
import gc
import random

import pytest
import torch

import offtensor as ot
from offtensor.pager import Pager
from offtensor.pager import device as device_module
from offtensor.pager.marks import Joined, Mark, Marks

CPU = torch.device("cpu")


# ---------------------------------------------------------------------------- the fake GPU


class FakeGPU:
    def __init__(self):
        self.streams = []
        self.current = None
        self.order = 0  # host order of issue
        self.hazards = []
        self.calls = {}  # CUDA call -> count, for the per-hit figures

    def count(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1

    def stream(self, name):
        s = FakeStream(self, name)
        self.streams.append(s)
        return s

    def enqueue(self, stream, kind, lo=None, hi=None, what=None):
        self.order += 1
        stream.items.append(Work(kind, lo, hi, self.order, what))

    def run(self, stream, upto):
        """Run ``stream`` until ``upto`` items of it have completed (and whatever they wait for)."""
        while stream.completed < upto:
            item = stream.items[stream.completed]
            if item.kind == "wait":
                self.run(item.what[0], item.what[1])
            self.complete(stream, item)

    def step(self, rng):
        """Advance one runnable stream by one item, chosen at random; False if none can run."""
        runnable = []
        for s in self.streams:
            if s.completed < len(s.items):
                item = s.items[s.completed]
                if item.kind != "wait" or item.what[0].completed >= item.what[1]:
                    runnable.append(s)
        if not runnable:
            return False
        s = rng.choice(runnable)
        self.complete(s, s.items[s.completed])
        return True

    def finish(self):
        for s in self.streams:
            self.run(s, len(s.items))

    def complete(self, stream, item):
        if item.kind in ("read", "write"):
            for s in self.streams:
                for other in s.items[s.completed :]:
                    if other is item or other.order > item.order or other.kind not in ("read", "write"):
                        continue
                    if other.lo < item.hi and item.lo < other.hi and "write" in (item.kind, other.kind):
                        self.hazards.append(f"{item.kind} {item.what} ran before the earlier {other.kind} {other.what}")
        item.done = True
        stream.completed += 1


class Work:
    __slots__ = ("kind", "lo", "hi", "order", "what", "done")

    def __init__(self, kind, lo, hi, order, what):
        self.kind, self.lo, self.hi, self.order, self.what, self.done = kind, lo, hi, order, what, False


class FakeStream:
    def __init__(self, gpu, name):
        self.gpu, self.name = gpu, name
        self.items = []
        self.completed = 0
        self.cuda_stream = 1000 + len(gpu.streams)  # the raw handle

    def wait_event(self, event):
        self.gpu.count("wait_event")
        assert event.stream is not None, "waiting for an event that was never recorded"
        self.gpu.enqueue(self, "wait", what=(event.stream, event.position))

    def wait_stream(self, other):
        self.gpu.enqueue(self, "wait", what=(other, len(other.items)))

    def synchronize(self):
        self.gpu.run(self, len(self.items))

    def __repr__(self):
        return f"FakeStream({self.name})"


def fake_event_class(gpu):
    class FakeEvent:
        made = 0

        def __init__(self, *args, **kwargs):
            gpu.count("Event()")
            type(self).made += 1
            self.stream, self.position = None, 0

        def record(self, stream=None):
            gpu.count("record")
            stream = stream or gpu.current
            self.stream, self.position = stream, len(stream.items)

        def query(self):
            gpu.count("query")
            return self.stream is None or self.stream.completed >= self.position

        def synchronize(self):
            gpu.count("synchronize")
            if self.stream is not None:
                gpu.run(self.stream, self.position)

    return FakeEvent


@pytest.fixture
def gpu(monkeypatch):
    """torch.cuda's streams, events and stream switches replaced by the fake GPU's; ``CudaDevice``
    runs its GPU code on CPU tensors, its copies and the test's ops logged as work on the streams."""
    gpu = FakeGPU()
    compute = gpu.stream("compute")
    gpu.current = compute
    gpu.compute = compute
    made = []

    def current_stream(device=None):
        gpu.count("current_stream")
        return gpu.current

    def new_stream(device=None):
        s = gpu.stream(f"side{len(made)}")
        made.append(s)
        return s

    @contextlib.contextmanager
    def stream_context(s):
        gpu.count("stream ctx")
        before, gpu.current = gpu.current, s
        try:
            yield
        finally:
            gpu.current = before

    def set_stream(s):
        gpu.count("set_stream")
        gpu.current = s

    def raw_stream(index):
        gpu.count("raw stream")
        return gpu.current.cuda_stream

    monkeypatch.setattr(torch.cuda, "Event", fake_event_class(gpu))
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "Stream", new_stream)
    monkeypatch.setattr(torch.cuda, "stream", stream_context)
    monkeypatch.setattr(torch.cuda, "set_stream", set_stream)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: gpu.finish())
    monkeypatch.setattr(device_module, "_raw_stream", raw_stream)
    monkeypatch.setattr(device_module, "_current_device", lambda: 0)
    monkeypatch.setattr(device_module, "for_device", lambda device, strict: device_module.CudaDevice(device))

    # The copies the device issues, as writes on the stream they were enqueued on.
    copy_on, copy_in_line = device_module.CudaDevice._copy_on, device_module.CudaDevice.copy_in_line

    def logged_copy_on(self, stream, dst, src):
        before = gpu.current
        copy_on(self, stream, dst, src)
        assert gpu.current is before, "the caller's stream was not restored after a copy"
        if src.device.type == "cpu" and not src.is_pinned() and src.untyped_storage().data_ptr() in devices:
            gpu.enqueue(stream, "read", *gpu.span(src), "move")  # a copy within the arena reads its old range
        gpu.enqueue(stream, "write", *gpu.span(dst), "copy")

    def logged_copy_in_line(self, buf, src, nbytes, lifetimes):
        gpu.enqueue(gpu.current, "write", *gpu.span(buf), "copy in line")
        return copy_in_line(self, buf, src, nbytes, lifetimes)

    def span(t):  # device memory by address: the arena's ranges and overflow slots alike
        lo = t.data_ptr()
        return lo, lo + t.numel() * t.element_size()

    # Which storages are "device memory" (the arena, overflow slots): what the device allocates.
    devices = set()
    allocate = device_module.CudaDevice.allocate

    def logged_allocate(self, nbytes):
        buf = allocate(self, nbytes)
        devices.add(buf.untyped_storage().data_ptr())
        return buf

    gpu.span = span
    monkeypatch.setattr(device_module.CudaDevice, "allocate", logged_allocate)
    monkeypatch.setattr(device_module.CudaDevice, "_copy_on", logged_copy_on)
    monkeypatch.setattr(device_module.CudaDevice, "copy_in_line", logged_copy_in_line)
    yield gpu
    gc.collect()  # the test's pagers die (their teardown waits) while the fakes are still in place


def read(gpu, pager, t, private=False):
    """One op reading ``t``'s paged copy on the current stream: page, enqueue the read, release."""
    view, entry = pager.page(t._host, t._master, private=private)
    gpu.enqueue(gpu.current, "read", *gpu.span(view), f"of master {t._master.id}")
    pager.release([entry])
    return entry


# ---------------------------------------------------------------------------- the mark class


class _Ev:
    def __init__(self):
        self.at = None
        self.complete = False


def _marks(every=4, keep=64):
    log = []

    def record(stream, event):
        event = event or _Ev()
        event.at, event.complete = (stream, stream_len[stream]), False
        log.append(event)
        return event

    stream_len = {"a": 0, "b": 0}
    return Marks(record, lambda e: e.complete, every=every, keep=keep), log, stream_len


def test_marks_record_one_event_every_n_marked_ops_per_stream():
    marks, log, _ = _marks(every=4)
    a, b = marks.track(1, "a"), marks.track(2, "b")
    for _ in range(10):
        marks.mark(a)
    for _ in range(3):
        marks.mark(b)
    assert [e.at[0] for e in log] == ["a", "a"]  # after a's 4th and 8th marks; b's 3 need none yet
    assert a.seqs == [4, 8] and b.seqs == []


def test_a_mark_resolves_to_the_earliest_event_at_or_after_it_else_to_one_recorded_now():
    marks, log, _ = _marks(every=4)
    a = marks.track(1, "a")
    ms = [marks.mark(a) for _ in range(10)]  # events after marks 4 and 8
    assert marks.event(ms[0]) is log[0] and marks.event(ms[3]) is log[0]
    assert marks.event(ms[4]) is log[1] and marks.event(ms[7]) is log[1]
    assert len(log) == 2
    late = marks.event(ms[9])  # no event covers mark 10 yet: one is recorded now, covering 9 and 10
    assert late is log[2] and marks.event(ms[8]) is late and len(log) == 3


def test_done_never_records_and_a_completed_event_completes_every_mark_before_it():
    marks, log, _ = _marks(every=4)
    a = marks.track(1, "a")
    ms = [marks.mark(a) for _ in range(6)]
    assert not marks.done(ms[5]) and len(log) == 1  # not covered: "not known done", nothing recorded
    assert not marks.done(ms[0])
    log[0].complete = True
    assert marks.done(ms[2]) and marks.done(ms[0]) and marks.done(ms[3])
    assert marks.event(ms[1]) is None  # known complete: nothing to wait for
    assert not marks.done(ms[4])


def test_marks_on_interleaved_streams_resolve_to_their_own_streams_events():
    marks, log, _ = _marks(every=2)
    a, b = marks.track(1, "a"), marks.track(2, "b")
    on_a, on_b = [], []
    for i in range(7):
        on_a.append(marks.mark(a))
        if i % 2:
            on_b.append(marks.mark(b))
    for m in on_a:
        assert marks.event(m).at[0] == "a"
    for m in on_b:
        assert marks.event(m).at[0] == "b"
    for e in log:
        e.complete = e.at[0] == "b"  # b has run, a has not
    assert all(marks.done(m) for m in on_b) and not any(marks.done(m) for m in on_a)


def test_dropping_old_events_makes_marks_resolve_later_never_earlier():
    marks, log, _ = _marks(every=1, keep=3)
    a = marks.track(1, "a")
    ms = [marks.mark(a) for _ in range(6)]  # an event after each; only the last 3 kept
    assert a.seqs == [4, 5, 6]
    assert marks.event(ms[0]) is log[3]  # its own event is gone: the next one, recorded after it
    log[3].complete = True
    assert marks.done(ms[0]) and marks.done(ms[3]) and not marks.done(ms[4])


def test_events_known_complete_are_recorded_again_not_made_anew():
    marks, log, _ = _marks(every=2)
    a = marks.track(1, "a")
    ms = [marks.mark(a) for _ in range(4)]
    first = log[0]
    first.complete = True
    assert marks.done(ms[0])
    marks.mark(a), marks.mark(a)  # the next periodic event reuses the completed one
    assert log[-1] is first and marks.event(marks.mark(a)) is not None


def test_a_mark_asked_for_after_a_device_sync_is_complete():
    marks, log, _ = _marks(every=4)
    a = marks.track(1, "a")
    ms = [marks.mark(a) for _ in range(6)]
    marks.all_done()
    assert all(marks.done(m) for m in ms) and marks.event(ms[5]) is None and len(log) == 1


# ---------------------------------------------------------------------------- CudaDevice on the fake GPU


def _pager(budget_tensors=3, numel=1024):
    return Pager(CPU, budget_bytes=budget_tensors * numel * 4, strict=False)


@pytest.mark.parametrize("seed, every", [(0, 8), (1, 1), (2, 2), (3, 8)])
def test_a_range_is_never_reused_before_its_last_reader_ran_under_random_schedules(gpu, seed, every):
    # Cached pages on two compute streams, private pages, prefetches, copies of three sizes (so
    # ranges split, merge and copies move within the arena), and the streams run at random speeds.
    rng = random.Random(seed)
    pager = _pager(budget_tensors=3)
    pager.device_ops.marks.every = every
    ts = [ot.offload(torch.randn(rng.choice([256, 1024, 1536])), pager=pager) for _ in range(8)]
    side = torch.cuda.Stream()  # a second compute stream the caller switches to now and then
    for i in range(500):
        t = rng.choice(ts)
        choice = rng.random()
        if choice < 0.2:
            with torch.cuda.stream(side):
                read(gpu, pager, t)
        elif choice < 0.3:
            read(gpu, pager, t, private=True)
        elif choice < 0.45:
            pager.prefetch(t._master, torch.float32, 0, t.numel())
        else:
            read(gpu, pager, t)
        for _ in range(rng.randrange(4)):
            gpu.step(rng)
    gpu.finish()
    stats = pager.snapshot()
    assert stats.evictions > 200 and stats.hits > 90
    assert gpu.hazards == []


def test_the_fake_gpu_reports_a_missing_wait(gpu, monkeypatch):
    # The check above can fail: a device that never orders a reuse after its last reader is caught.
    monkeypatch.setattr(device_module.CudaDevice, "order_after", lambda self, token, stream=None: None)
    rng = random.Random(1)
    pager = _pager(budget_tensors=2)
    ts = [ot.offload(torch.randn(1024), pager=pager) for _ in range(6)]
    for i in range(200):
        read(gpu, pager, rng.choice(ts))
        if rng.random() < 0.3:
            gpu.step(rng)
    gpu.finish()
    assert gpu.hazards


def test_a_prefetch_into_a_range_read_long_ago_waits_only_for_an_event_soon_after_its_reader(gpu):
    pager = _pager(budget_tensors=2)
    old, hot, new = (ot.offload(torch.randn(1024), pager=pager) for _ in range(3))
    read(gpu, pager, old)
    reader_at = len(gpu.compute.items)  # the last read of old's range ends here
    for _ in range(50):  # the host runs far ahead: 50 more marked ops queued, none run
        read(gpu, pager, hot)
    copy = pager.device_ops.copy_stream
    waits_before = len(copy.items)
    assert pager.prefetch(new._master, torch.float32, 0, 1024)  # evicts old, copies into its range
    waits = [w for w in copy.items[waits_before:] if w.kind == "wait" and w.what[0] is gpu.compute]
    assert len(waits) == 1
    every = pager.device_ops.marks.every
    # The event it waits for was recorded after the reader, and at most ``every`` - 1 marked ops
    # (reads) after it, not after the 50 queued since.
    at = waits[0].what[1]
    assert at >= reader_at
    assert sum(item.kind == "read" for item in gpu.compute.items[reader_at:at]) <= every - 1
    gpu.finish()
    assert gpu.hazards == []


def test_a_reuse_on_the_readers_own_stream_needs_no_event(gpu):
    pager = _pager(budget_tensors=1)
    a, b = (ot.offload(torch.randn(1024), pager=pager) for _ in range(2))
    read(gpu, pager, a)
    gpu.finish()
    gpu.calls.clear()
    read(gpu, pager, b, private=True)  # a transient copy on the compute stream reuses a's range
    assert pager.snapshot().evictions == 1
    assert gpu.calls.get("Event()", 0) == 0 and gpu.calls.get("wait_event", 0) == 0, gpu.calls
    gpu.finish()
    assert gpu.hazards == []


def test_a_stream_the_caller_switches_to_is_the_ops_stream(gpu):
    pager = _pager()
    t = ot.offload(torch.randn(1024), pager=pager)
    read(gpu, pager, t)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        entry = read(gpu, pager, t)
    assert type(entry.last_use) is Joined  # read on both streams, neither known done: both kept
    assert [m.track.stream for m in entry.last_use.marks] == [gpu.compute, side]
    pager.device_ops.drain()  # everything has run
    entry = read(gpu, pager, t)
    assert type(entry.last_use) is Mark and entry.last_use.track.stream is gpu.compute


def test_a_copy_read_on_two_streams_is_reused_only_after_both_readers(gpu):
    pager = _pager(budget_tensors=1)
    a, b = (ot.offload(torch.randn(1024), pager=pager) for _ in range(2))
    side = torch.cuda.Stream()
    read(gpu, pager, a)
    with torch.cuda.stream(side):
        read(gpu, pager, a)
    copy = pager.device_ops.copy_stream
    before = len(copy.items)
    assert pager.prefetch(b._master, torch.float32, 0, 1024)  # evicts a: its range is b's
    waited = {w.what[0] for w in copy.items[before:] if w.kind == "wait"}
    assert waited == {gpu.compute, side}
    gpu.finish()
    assert gpu.hazards == []


def test_the_copy_stream_switch_restores_the_callers_stream(gpu):
    pager = _pager()
    side = torch.cuda.Stream()
    t = ot.offload(torch.randn(1024), pager=pager)
    with torch.cuda.stream(side):
        pager.prefetch(t._master, torch.float32, 0, 1024)
        assert gpu.current is side
    assert gpu.current is gpu.compute
    assert gpu.calls.get("set_stream", 0) == 2  # the fast switch: to the copy stream and back


def hit_calls(gpu, pager, t, n=64):
    """CUDA calls per cache hit on a completed copy, averaged over ``n`` hits."""
    read(gpu, pager, t)
    gpu.finish()
    read(gpu, pager, t)  # clears the completed copy's ready event
    gpu.calls.clear()
    for _ in range(n):
        read(gpu, pager, t)
    return {name: count / n for name, count in sorted(gpu.calls.items())}


def test_a_cache_hit_makes_one_raw_stream_lookup_and_an_event_every_n_hits(gpu):
    pager = _pager()
    t = ot.offload(torch.randn(1024), pager=pager)
    calls = hit_calls(gpu, pager, t)
    every = pager.device_ops.marks.every
    assert calls == {"raw stream": 1.0, "record": 1 / every, "Event()": 1 / every}, calls


def test_the_probes_cuda_call_breakdown_runs_its_gpu_path_on_the_fake_gpu(gpu, monkeypatch):
    # The next GPU run's probe measures these; a mistake in the GPU-only path would cost that run's
    # figures, so it runs here on the fakes (its tensors on the CPU).
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "gpu_probe.py")
    spec = importlib.util.spec_from_file_location("gpu_probe_under_test", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, device=None, **k: empty(*a, **k))
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    monkeypatch.setattr(device_module, "_raw_stream", lambda index: gpu.current.cuda_stream)
    figures = probe.measure_cuda_calls(torch.device("cuda", 0), iters=3, repeats=1)
    assert set(figures) == {"current_stream", "raw_stream", "op_stream_lookup", "mark", "event_record", "event_query",
                            "wait_event", "stream_context", "set_stream_pair", "copy_1KiB"}
    assert all(us >= 0 for us in figures.values())
    assert probe.measure_cuda_calls(torch.device("cpu")) == {
        "skipped": "not a GPU: the emulated device makes no CUDA calls"}


def test_the_mark_interval_comes_from_the_environment_and_a_bad_one_is_refused(gpu, monkeypatch):
    monkeypatch.setenv("OFFTENSOR_MARK_EVERY", "1")
    pager = _pager()
    t = ot.offload(torch.randn(1024), pager=pager)
    assert hit_calls(gpu, pager, t, n=8)["record"] == 1.0  # an event after every hit, as before marks
    for bad in ("0", "often"):
        monkeypatch.setenv("OFFTENSOR_MARK_EVERY", bad)
        with pytest.raises(ValueError, match="OFFTENSOR_MARK_EVERY"):
            _pager()
