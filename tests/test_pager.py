"""The pager's own invariants, driven directly: what it may evict, and when."""

from __future__ import annotations

import gc

import pytest
import torch

import offtensor as ot
from offtensor import _ext, ops
from offtensor.pager import Pager, host_layout
from offtensor.pager import arena
from offtensor.pager import device as device_module
from offtensor.pager.lifetimes import HostLifetimes

CPU = torch.device("cpu")
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


class _PrefetchOther:
    """A prefetcher that, whenever anything is paged, asks for one other tensor."""

    def __init__(self, other):
        self.other = other
        self.started = []

    def accessed(self, pager, master, key):
        lo, hi = host_layout(self.other._host)[:2]
        self.started.append(pager.prefetch(self.other._master, self.other.dtype, lo, hi))


def test_a_prefetch_never_evicts_the_copy_its_op_is_about_to_use(device):
    # Room for exactly one copy: prefetching the other tensor would have to evict the one just
    # paged for the current op. On a GPU its block would then be reused under the op.
    pager = Pager(torch.device(device), budget_bytes=4096)
    a = ot.offload(torch.randn(1024), pager=pager)
    b = ot.offload(torch.randn(1024), pager=pager)
    pager.prefetcher = _PrefetchOther(b)
    view, entry = pager.page(a._host, a._master)
    assert entry.key in pager.cache.entries and entry.users == 1
    assert pager.prefetcher.started == [False]
    assert torch.equal(view.cpu(), a._host)
    pager.release([entry])
    assert pager.snapshot().peak_device_bytes <= 4096


def test_a_prefetch_given_its_ranges_key_caches_the_copy_under_that_key_object(device):
    # A stack's expert keys are made once: a copy under one of them adds no key object of its own.
    from offtensor.pager import cache_key

    pager = Pager(torch.device(device), budget_bytes=8192)
    t = ot.offload(torch.randn(1024), pager=pager)
    key = cache_key(t._master.id, torch.float32, 0, 512)
    assert pager.prefetch(t._master, torch.float32, 0, 512, key=key)
    entry = pager.cache.entries[key]
    assert entry.key is key and entry.prefetched
    view, paged = pager.page(t._host[:512], t._master)
    assert paged is entry and torch.equal(view.cpu(), t._host[:512])
    pager.release([paged])


def test_a_prefetch_may_evict_copies_no_op_is_using(device):
    pager = Pager(torch.device(device), budget_bytes=8192)
    a, b, c = (ot.offload(torch.randn(1024), pager=pager) for _ in range(3))
    for t in (a, b):
        _, entry = pager.page(t._host, t._master)
        pager.release([entry])
    pager.prefetcher = _PrefetchOther(c)
    view, entry = pager.page(a._host, a._master)  # a hit; b is the least recently used
    assert pager.prefetcher.started == [True]
    assert entry.key in pager.cache.entries
    assert pager.snapshot().evictions == 1 and pager.snapshot().prefetches == 1
    pager.release([entry])
    hits = pager.snapshot().hits
    view, entry = pager.page(c._host, c._master)
    assert pager.snapshot().hits == hits + 1 and pager.snapshot().prefetch_hits == 1
    assert torch.equal(view.cpu(), c._host)
    pager.release([entry])
    assert pager.snapshot().peak_device_bytes <= 8192


def test_a_prefetch_never_evicts_an_earlier_prefetch_still_to_be_used(device):
    # Room for two copies: the one in use and one prefetch. A second prefetch would have to evict
    # the first before it is used: a copy thrown away for one needed later.
    pager = Pager(torch.device(device), budget_bytes=8192)
    a, b, c = (ot.offload(torch.randn(1024), pager=pager) for _ in range(3))

    class PrefetchBoth(_PrefetchOther):
        def accessed(self, pager, master, key):
            for other in (b, c):
                self.other = other
                super().accessed(pager, master, key)

    pager.prefetcher = PrefetchBoth(b)
    view, entry = pager.page(a._host, a._master)
    assert pager.prefetcher.started == [True, False]
    pager.release([entry])
    pager.prefetcher = None
    view, entry = pager.page(b._host, b._master)
    assert pager.snapshot().prefetch_hits == 1
    pager.release([entry])


# ---------------------------------------------------------------------------- host lifetimes, strict device


def _prefetch_whole(pager, t):
    lo, hi = host_layout(t._host)[:2]
    assert pager.prefetch(t._master, t.dtype, lo, hi)


def _prefetch_then_drop_the_master():
    """A prefetch is in flight when the last alias of its master dies (deleting a model mid-step)."""
    pager = Pager(CPU, budget_bytes=1 << 20, strict=True)
    t = ot.offload(torch.randn(4096), pager=pager)
    before = len(_ext.strict_failures())
    with _ext.StrictCopyEngine.held():
        _prefetch_whole(pager, t)
        del t
        gc.collect()
    _ext.StrictCopyEngine.drain()
    return _ext.strict_failures()[before:]


def test_a_master_freed_under_an_in_flight_prefetch_lives_until_the_copy_is_done():
    assert _prefetch_then_drop_the_master() == []


@pytest.mark.filterwarnings("ignore:offtensor. a pager's teardown")
def test_strict_device_reports_a_host_source_freed_under_a_copy(monkeypatch):
    # Proves the strict mode can fail: without the pager keeping copy sources alive (the code
    # before the host-lifetime fix), the copy finds its source freed.
    keep = HostLifetimes.keep
    # Forget every source, as the code did before (a premature free).
    monkeypatch.setattr(HostLifetimes, "keep", lambda self, src, token, stream=None: keep(self, None, token, stream))
    failures = _prefetch_then_drop_the_master()
    assert len(failures) == 1 and "freed before the copy ran" in failures[0]
    _ext._strict_failures.clear()  # reported on purpose; conftest checks that none remain


def test_strict_device_turns_a_missing_wait_into_wrong_values(monkeypatch):
    pager = Pager(CPU, budget_bytes=1 << 20, strict=True)
    t = ot.offload(torch.randn(4096), pager=pager)
    assert torch.equal(t * 1, t._host)
    pager.clear()
    monkeypatch.setattr(device_module.EmulatedDevice, "wait_ready", lambda self, entry, lifetimes: None)
    with _ext.StrictCopyEngine.held():
        got = t * 1  # the copy has not run: the op reads the poisoned slot
    assert got.isnan().all()
    _ext.StrictCopyEngine.drain()


def test_before_write_waits_for_the_copies_of_that_master_only():
    pager = Pager(CPU, budget_bytes=1 << 20, strict=True)
    a, b = (ot.offload(torch.randn(4096), pager=pager) for _ in range(2))
    with _ext.StrictCopyEngine.held():
        _prefetch_whole(pager, a)
        _prefetch_whole(pager, b)
        ready_b = pager.cache.entries[next(k for k in pager.cache.entries if k[0] == b._master.id)].ready
        pager.before_write(a._master)
        assert not any(k[0] == a._master.id for k in pager.cache.entries)
        assert not pager.device_ops.engine.query(ready_b)  # b's copy was not waited for
    a.copy_(torch.ones(4096))
    assert torch.equal(a * 1, torch.ones(4096)) and torch.equal(b * 1, b._host)


def test_unwrap_copy_and_materialize_keep_their_source_until_the_copy_is_done():
    pager = Pager(CPU, budget_bytes=1 << 20, strict=True)
    before = len(_ext.strict_failures())
    values = torch.randn(4096)
    got = ot.offload(values, pager=pager).materialize()  # the master dies right after the copy
    gc.collect()
    _ext.StrictCopyEngine.drain()
    assert torch.equal(got, values) and _ext.strict_failures()[before:] == []
    assert len(pager.lifetimes) == 0  # and not a moment longer: the master's memory is free


def test_a_dying_pager_waits_for_its_copies(monkeypatch):
    pager = Pager(CPU, budget_bytes=1 << 20, strict=True)
    t = ot.offload(torch.randn(4096), pager=pager)
    source = t._master.flat
    with _ext.StrictCopyEngine.held():
        _prefetch_whole(pager, t)
        ticket = next(iter(pager.cache.entries.values())).ready
        engine = pager.device_ops.engine
        del pager
        gc.collect()
        assert engine.query(ticket)  # the finalizer waited for the copy before its slot went
    del t, source


# ---------------------------------------------------------------------------- arena and hot path


def test_paged_copies_reuse_arena_ranges_and_the_arena_stays_within_the_budget(device):
    budget = 3 * 4096 * 4
    pager = Pager(torch.device(device), budget_bytes=budget)
    ts = [ot.offload(torch.randn(n), pager=pager) for n in (4096, 4096, 2048, 4096, 1024, 2048)]
    for _ in range(3):
        for t in ts:
            got = t * 2
            assert torch.equal(got.cpu(), t._host * 2)
            view, entry = pager.page(t._host, t._master)
            pager.release([entry])
    s = pager.snapshot()
    assert s.peak_device_bytes <= budget
    # Real bytes: one arena, the room (the budget: nothing is resident) plus its stated alignment
    # padding, allocated once for every size; nothing outside it.
    assert s.peak_pool_bytes <= budget - s.resident_bytes + arena.PAD
    assert pager.pool.allocations == 1 and s.arena_overflows == 0
    assert s.evictions > 0
    # Layers of one model repeat their shapes: a cycle over more same-sized weights than the
    # budget holds copies every time, always into the same three ranges of the arena.
    pager = Pager(torch.device(device), budget_bytes=budget)
    ts = [ot.offload(torch.randn(4096), pager=pager) for _ in range(5)]
    addresses = set()
    for _ in range(3):
        for t in ts:
            assert torch.equal((t * 2).cpu(), t._host * 2)
            view, entry = pager.page(t._host, t._master)
            addresses.add(view.data_ptr())
            pager.release([entry])
    assert pager.snapshot().page_ins == 15 and len(addresses) == 3 and pager.pool.allocations == 1


def test_a_completed_copy_is_not_waited_for_again(device):
    pager = Pager(torch.device(device), budget_bytes=1 << 20)
    t = ot.offload(torch.randn(4096), pager=pager)
    _, entry = pager.page(t._host, t._master)
    pager.release([entry])
    if device == "cuda":
        torch.cuda.synchronize()
        _, entry = pager.page(t._host, t._master)
        pager.release([entry])
    assert entry.ready is None


@cuda_only
def test_reserved_memory_stays_within_the_budget_plus_slack(device):
    # Stated slack: every copy is a range of one arena, allocated once at the room (the budget here)
    # plus 4 KiB of alignment padding, which the caching allocator rounds up to 2 MiB; no copy
    # overflows it here (no op holds two copies); the compute stream's own transients (op outputs)
    # are outside the budget. 64 MiB covers them all. Sizes that alternate (25, 100 and 7 MiB) once
    # reserved their sum over the sizes, when each slot was its own allocation.
    if device != "cuda":
        pytest.skip("runs with OFFTENSOR_TEST_DEVICE=cuda")
    slack = 64 << 20
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    budget = 256 << 20
    pager = Pager(torch.device("cuda"), budget_bytes=budget)
    sizes = [25 << 20] * 8 + [100 << 20] * 2 + [7 << 20] * 5
    ts = [ot.offload(torch.empty(n // 2, dtype=torch.bfloat16), pager=pager) for n in sizes]
    x = torch.ones(1, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        for t in ts:
            (t[:1] * x).sum()
            view, entry = pager.page(t._host, t._master)
            pager.release([entry])
    torch.cuda.synchronize()
    s = pager.snapshot()
    assert s.max_memory_reserved is not None
    assert s.max_memory_reserved - base <= budget + slack, (s.max_memory_reserved - base, budget)
    assert s.arena_overflows == 0 and pager.pool.allocations == 1


def test_an_moe_layer_costs_one_host_sync(device):
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        intermediate_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        num_hidden_layers=1, decoder_sparse_step=1, mlp_only_layers=[],
    )
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config).eval()
    with torch.no_grad():
        for p in block.parameters():  # the block alone is not initialised by a model's init
            p.normal_(0, 0.2)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # CUDA's grouped_mm kernel is bf16
    block.to(device, dtype)
    x = torch.randn(1, 5, 32, device=device, dtype=dtype)
    with torch.no_grad():
        expected = block(x)
    experts = block.experts
    pager = Pager(torch.device(device), budget_bytes=1 << 20)
    for name, p in list(experts.named_parameters()):
        setattr(experts, name, torch.nn.Parameter(ot.offload(p.detach().cpu(), pager=pager), requires_grad=False))
    with torch.no_grad():
        block(x)  # warm-up: first dispatches
        syncs = ops.HOST_SYNCS[0]
        got = block(x)
        per_layer = ops.HOST_SYNCS[0] - syncs
    torch.testing.assert_close(got, expected)
    assert pager.snapshot().page_ins > 0
    assert per_layer == 1


# ---------------------------------------------------------------------------- the GPU branch, driven on the CPU


class _FakeEvent:
    created = 0

    def __init__(self, *args, **kwargs):
        type(self).created += 1
        self.stream = None

    def record(self, stream=None):
        self.stream = stream

    def query(self):
        return True

    def synchronize(self):
        pass


class _FakeStream:
    def __init__(self, name):
        self.name = name
        self.cuda_stream = id(self)  # the raw handle CudaDevice keys its stream tracks by
        self.waits = []

    def wait_event(self, event):
        assert event.stream is not None, "waiting for an event that was never recorded"
        self.waits.append(event)

    def synchronize(self):
        pass


def _gpu_branch_pager(monkeypatch, budget):
    """A pager whose streams and events are stand-ins, so the code a GPU runs (events, stream
    waits, slot hand-over between streams) executes here on CPU tensors."""
    import contextlib

    compute = _FakeStream("compute")
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    copy = _FakeStream("copy")
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: copy)
    monkeypatch.setattr(device_module, "for_device", lambda device, strict: device_module.CudaDevice(device))
    pager = Pager(CPU, budget_bytes=budget, strict=False)
    return pager, compute, copy


def test_gpu_branch_records_events_only_for_copies_periodic_marks_and_stream_crossings(monkeypatch):
    from offtensor.pager.marks import Mark

    pager, compute, copy = _gpu_branch_pager(monkeypatch, budget=4 * 4096 * 4)
    ts = [ot.offload(torch.randn(4096), pager=pager) for _ in range(3)]
    for t in ts:
        assert torch.equal(t * 1, t._host)  # cached pages: a copy-ready event each, a last-use mark each
    start = _FakeEvent.created
    for t in ts:  # cache hits on completed copies: the ready event is cleared, a mark and no event each
        view, entry = pager.page(t._host, t._master)
        assert entry.ready is None
        pager.release([entry])
        assert type(entry.last_use) is Mark and entry.last_use.track.stream is compute
    assert _FakeEvent.created == start
    every = pager.device_ops.marks.every
    for _ in range(every):  # every ``every`` marked ops on a stream, one event
        pager.release([pager.page(ts[0]._host, ts[0]._master)[1]])
    assert _FakeEvent.created - start == 1
    start = _FakeEvent.created
    pager.forget_master(ts[1]._master.id)  # its slot goes idle, for the transient pages below
    start = _FakeEvent.created
    for _ in range(10):  # private (transient) pages on the compute stream: no event at all
        view, entry = pager.page(ts[0]._host, ts[0]._master, private=True)
        assert torch.equal(view, ts[0]._host)
        pager.release([entry])
    assert _FakeEvent.created == start
    # That slot then serves a copy on the copy stream: one event, recorded now, hands it over.
    copy.waits.clear()
    view, entry = pager.page(ts[1]._host, ts[1]._master)
    pager.release([entry])
    handover = [e for e in copy.waits if e.stream is compute]
    assert len(handover) == 1 and _FakeEvent.created - start == 2  # handover, copy ready (its last use: a mark)
    assert torch.equal(view, ts[1]._host)
    # Host sources of transient copies are released in sealed batches, not one event per copy.
    assert len(pager.lifetimes) <= pager.lifetimes.SEAL_EVERY
    pager.wait_copies()
    assert len(pager.lifetimes) == 0


def test_an_index_op_on_a_table_whose_whole_copy_is_cached_reads_it_with_no_host_sync(device):
    # A tied output projection (or any linear over the table) caches the whole table: the lookups
    # then read that copy like any cache hit, with no read of their indices and no copy.
    pager = Pager(torch.device(device), budget_bytes=1 << 20)
    table = torch.randn(100, 16)
    weight = ot.offload(table, pager=pager)
    torch.nn.functional.linear(torch.randn(2, 16, device=device), weight)  # pages the whole table
    ids = torch.tensor([[3, 7, 3], [99, 0, 7]], device=device)
    syncs, before = ops.HOST_SYNCS[0], pager.snapshot()
    got = [torch.nn.functional.embedding(ids, weight), weight.index_select(0, ids[0]), weight[ids]]
    after = pager.snapshot()
    assert ops.HOST_SYNCS[0] - syncs == 0
    assert after.bytes_h2d == before.bytes_h2d and after.hits - before.hits == 3
    expected = [table[ids.cpu()], table.index_select(0, ids[0].cpu()), table[ids.cpu()]]
    for g, e in zip(got, expected):
        assert torch.equal(g.cpu(), e)


def test_an_embedding_lookup_of_offloaded_rows_costs_one_host_sync(device):
    pager = Pager(torch.device(device), budget_bytes=1 << 20)
    table = torch.randn(100, 16)
    weight = ot.offload(table, pager=pager)
    ids = torch.tensor([[3, 7, 3], [99, 0, 7]], device=device)
    torch.nn.functional.embedding(ids, weight)  # warm-up
    syncs = ops.HOST_SYNCS[0]
    got = torch.nn.functional.embedding(ids, weight)
    assert ops.HOST_SYNCS[0] - syncs == 1  # reading ids: which rows to page
    assert torch.equal(got.cpu(), table[ids.cpu()])


def test_a_cache_hit_hands_the_op_the_device_view_it_handed_the_last_one(device):
    # The hit path builds no new device view for a tensor whose layout it memoized; a write to the
    # master drops the copy, so the next op gets a new copy with the new values.
    from offtensor.ops.paging import Paged

    pager = Pager(torch.device(device), budget_bytes=1 << 20)
    reference = torch.randn(8, 4)
    w = ot.offload(reference, pager=pager)

    def page(t):
        paged = Paged()
        try:
            return paged.page(t)
        finally:
            paged.release()

    first, second = page(w), page(w)
    assert second is first and pager.snapshot().hits == 1
    transposed = w.t()
    assert page(transposed) is not first and torch.equal(page(transposed).cpu(), reference.t())
    with torch.no_grad():
        w.add_(1)
    third = page(w)
    assert third is not first and torch.equal(third.cpu(), reference + 1)
