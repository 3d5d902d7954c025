"""The device-side expert pool (``expert_pool=True``, offtensor/moe/pool.py, ops/expert_pool.py):
decode of a wrapped MoE served from a pool of device slots assigned by LRU on the device, with no
host read on the expert path, bit-identical to the plain model, eager and compiled with
``fullgraph=True``; the budget it takes, what it refuses, writes, and an interrupted admit.

The models are the trained checkpoints in tests/data (Qwen3-MoE top-4 of 32, Mixtral top-2 of 16)
in float32, every expert stack offloaded; small pools (a few slots) make every decode step evict.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import offtensor as ot
from offtensor.ops import expert_pool as pool_ops
from offtensor.ops.rows import HOST_SYNCS

transformers = pytest.importorskip("transformers")

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
GiB = 1 << 30
aten = torch.ops.aten
SYNCING = {aten._local_scalar_dense.default, aten.nonzero.default, aten.item.default, aten.unique_consecutive.default,
           aten._unique2.default}


def _load(name: str):
    return transformers.AutoModelForCausalLM.from_pretrained(os.path.join(DATA, name), dtype=torch.float32).eval()


def _expert_sizes(model):
    experts = {n: p for n, p in model.named_parameters() if ".experts." in n}
    layers = {n.rpartition(".")[0] for n in experts}
    slot = sum(p[0].numel() * p.element_size() for p in experts.values()) // len(layers)
    resident = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n not in experts)
    return slot, resident


def _wrap_pooled(model, slots: int, **kwargs):
    """Every expert stack offloaded; a budget whose room beside the resident weights holds the
    pager's reserve (one expert of each stack of a layer) and ``slots`` pool slots."""
    slot, resident = _expert_sizes(model)
    budget = resident + slot + slots * slot + slot // 2
    ot.wrap_model(model, budget_gb=budget / GiB, device="cpu", prefetch=False, policy=["*.experts.*"],
                  expert_pool=True, **kwargs)
    return _pager(model).expert_pool.pools[0]


def _pager(model):
    return next(p for p in model.parameters() if isinstance(p, ot.OffloadedTensor))._master.pager


def _consistent(pool) -> bool:
    slot_of, expert_in = pool.slot_of[:-1].tolist(), pool.expert_in[:-1].tolist()
    return (all(expert_in[s] == e for e, s in enumerate(slot_of) if s >= 0)
            and all(slot_of[e] == s for s, e in enumerate(expert_in) if e >= 0) and pool.slot_of[-1] == -1)


def _bytes_match(pool, model) -> bool:
    """Every occupied slot holds its expert's bytes, in every role."""
    stacks = sorted((n, p) for n, p in model.named_parameters() if isinstance(p, ot.OffloadedTensor))
    by_master = {p._master.id: p for _, p in stacks}
    for master_id, (role, base, count, hosts) in pool.layers.items():
        host = by_master[master_id]._host
        for e in range(count):
            s = int(pool.slot_of[base + e])
            if s >= 0 and not torch.equal(pool.buffers[role][s], host[e]):
                return False
    return True


class _SyncCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.syncs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SYNCING:
            self.syncs.append(func)
        return func(*args, **(kwargs or {}))


@pytest.fixture(params=[("moe_qwen3", 6), ("moe_mixtral", 3)], ids=["qwen3", "mixtral"])
def pair(request):
    name, slots = request.param
    plain = _load(name)
    pooled = copy.deepcopy(plain)
    pool = _wrap_pooled(pooled, slots)
    return plain, pooled, pool


def test_pooled_decode_gives_the_plain_models_tokens_and_logits_bit_for_bit(pair):
    plain, pooled, pool = pair
    ids = torch.randint(0, plain.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = plain.generate(ids, max_new_tokens=24, do_sample=False)
        got = pooled.generate(ids, max_new_tokens=24, do_sample=False)
        assert torch.equal(got, expected)
        # a batch of 2 tokens per step (rows fit the pool or not, by top-k): the same logits
        assert torch.equal(pooled(expected[:, -2:]).logits, plain(expected[:, -2:]).logits)
    assert int(pool.clock) > 0 and _consistent(pool) and _bytes_match(pool, pooled)


def test_the_gpus_one_group_per_slot_form_gives_the_same_bits_on_the_emulated_device(pair, monkeypatch):
    """The form a GPU runs (the admit as tensor ops; rows reordered by slot, one group per pool
    slot, results put back)."""
    monkeypatch.setattr(pool_ops, "SLOT_GROUPS", ("cuda", "cpu"))
    monkeypatch.setattr(pool_ops, "NATIVE_ADMIT", False)
    plain, pooled, pool = pair
    ids = torch.randint(0, plain.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert torch.equal(pooled.generate(ids, max_new_tokens=16, do_sample=False),
                           plain.generate(ids, max_new_tokens=16, do_sample=False))
        assert torch.equal(pooled(ids[:, -2:]).logits, plain(ids[:, -2:]).logits)
    assert _consistent(pool) and _bytes_match(pool, pooled)


def test_a_pooled_decode_step_makes_no_host_sync_on_the_expert_path(pair):
    plain, pooled, pool = pair
    ids = torch.randint(0, plain.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(2))
    experts = [m for n, m in pooled.named_modules() if n.endswith("mlp.experts")]
    top_k = plain.config.num_experts_per_tok
    with torch.no_grad():
        pooled(ids)
        hidden = torch.randn(1, plain.config.hidden_size)
        for step in range(6):  # one decode token per layer call, routed to changing experts
            index = torch.randperm(experts[0].num_experts, generator=torch.Generator().manual_seed(step))[:top_k]
            before, counter = HOST_SYNCS[0], _SyncCounter()
            with counter:
                for module in experts:
                    module(hidden, index[None], torch.full((1, top_k), 1.0 / top_k))
            assert HOST_SYNCS[0] == before and counter.syncs == []
    # the same calls on today's path (no pool) read the routing on the host: counted
    today = copy.deepcopy(plain)
    ot.wrap_model(today, budget_gb=pool.nbytes * 4 / GiB + 0.01, device="cpu", prefetch=False,
                  policy=["*.experts.*"])
    module = [m for n, m in today.named_modules() if n.endswith("mlp.experts")][0]
    before = HOST_SYNCS[0]
    with torch.no_grad():
        module(hidden, index[None], torch.full((1, top_k), 1.0 / top_k))
    assert HOST_SYNCS[0] == before + 1


def test_compiled_fullgraph_pooled_decode_gives_the_plain_tokens_without_host_syncs():
    """The wrapped decode compiled with ``fullgraph=True`` (a graph break anywhere, the expert
    path included, fails the compile) gives the plain tokens; each layer's expert path compiled
    alone holds no syncing op in its graph, and its runs read nothing on the host."""
    from torch._dynamo.backends.debugging import aot_eager

    plain = _load("moe_qwen3")
    pooled = copy.deepcopy(plain)
    pool = _wrap_pooled(pooled, 8)
    ids = torch.randint(0, plain.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(3))
    kwargs = dict(max_new_tokens=6, do_sample=False, cache_implementation="static")
    with torch.no_grad():
        expected = plain.generate(ids, **kwargs)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    torch._dynamo.reset()
    try:
        pooled.forward = torch.compile(pooled.forward, backend="aot_eager", fullgraph=True)
        with torch.no_grad():
            assert torch.equal(pooled.generate(ids, **kwargs), expected)
        experts = [m for n, m in pooled.named_modules() if n.endswith("mlp.experts")]
        top_k = plain.config.num_experts_per_tok
        hidden = torch.randn(1, plain.config.hidden_size)
        with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=64):
            compiled = [torch.compile(m, backend=backend, fullgraph=True) for m in experts]
            for step in range(4):
                index = torch.randperm(experts[0].num_experts, generator=torch.Generator().manual_seed(step))[:top_k]
                before = HOST_SYNCS[0]
                for module, run in zip(experts, compiled):
                    got = run(hidden, index[None], torch.full((1, top_k), 1.0 / top_k))
                    assert torch.equal(got, module(hidden, index[None], torch.full((1, top_k), 1.0 / top_k)))
                assert HOST_SYNCS[0] == before
    finally:
        torch._dynamo.reset()
    targets = {str(node.target) for gm in graphs for node in gm.graph.nodes}
    syncing = [t for t in targets if t in ("item", "tolist") or "nonzero" in t or "_local_scalar_dense" in t]
    assert graphs and not syncing
    assert _consistent(pool)


def test_a_budget_too_small_for_one_steps_experts_is_refused_at_wrap_naming_the_stack():
    model = _load("moe_mixtral")
    slot, resident = _expert_sizes(model)
    budget = resident + slot + 1 * slot + slot // 2  # one slot: top-2 needs two
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(ot.BudgetError, match=r"expert pool for .*experts\.(down|gate_up)_proj.* needs 2 slots of "
                                             rf"{slot} bytes"):
        ot.wrap_model(model, budget_gb=budget / GiB, device="cpu", prefetch=False, policy=["*.experts.*"],
                      expert_pool=True)
    assert not any(isinstance(p, ot.OffloadedTensor) for p in model.parameters())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_the_pool_takes_its_bytes_from_the_budget_and_unwrap_gives_them_back():
    model = _load("moe_mixtral")
    pool = _wrap_pooled(model, 4)
    pager = _pager(model)
    slot, resident = _expert_sizes(model)
    assert pool.slots == 4 and pool.nbytes == 4 * slot
    assert pager.budget_bytes == resident + slot + 4 * slot + slot // 2 - pool.nbytes
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        model(ids)  # prefill: 32 routed rows, more than the pool's slots: through the pager's cache
    s = ot.stats(model)
    assert s.peak_device_bytes <= s.budget_bytes
    ot.unwrap_model(model)
    assert pager.expert_pool is None


def test_a_write_to_a_pooled_stack_empties_the_pool_and_the_next_step_reads_the_new_bytes():
    plain = _load("moe_mixtral")
    pooled = copy.deepcopy(plain)
    pool = _wrap_pooled(pooled, 4)
    ids = torch.randint(0, plain.config.vocab_size, (1, 1), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        pooled(ids)
        assert (pool.slot_of >= 0).any()
        doubled = plain.model.layers[0].mlp.experts.down_proj * 2
        for model in (plain, pooled):
            model.model.layers[0].mlp.experts.down_proj.copy_(doubled)
        assert (pool.slot_of < 0).all()
        assert torch.equal(pooled(ids).logits, plain(ids).logits)


def test_an_interrupt_inside_the_pools_fetch_leaves_its_tables_consistent(monkeypatch):
    """The tensor-op admit (the GPU's form) stopped between its steps; the native admit of the
    emulated device is one call that checks everything before its first write."""
    monkeypatch.setattr(pool_ops, "NATIVE_ADMIT", False)
    plain = _load("moe_mixtral")
    pooled = copy.deepcopy(plain)
    pool = _wrap_pooled(pooled, 3)
    first = torch.tensor([[7]])
    with torch.no_grad():
        pooled(first)
        calls = {"n": 0}
        gather = pool_ops.masked_row_gather

        def interrupted(dst, host, dest):
            calls["n"] += 1
            if calls["n"] == 2:  # between the two stacks of a layer: one filled, one not
                raise KeyboardInterrupt
            gather(dst, host, dest)

        monkeypatch.setattr(pool_ops, "masked_row_gather", interrupted)
        with pytest.raises(KeyboardInterrupt):
            pooled(torch.tensor([[11]]))
        monkeypatch.setattr(pool_ops, "masked_row_gather", gather)
        assert _consistent(pool) and _bytes_match(pool, pooled)
        tokens = torch.tensor([[11, 3, 25, 40]])
        assert torch.equal(pooled(tokens[:, :1]).logits, plain(tokens[:, :1]).logits)
        for t in range(1, 4):
            assert torch.equal(pooled(tokens[:, t : t + 1]).logits, plain(tokens[:, t : t + 1]).logits)
    assert _consistent(pool) and _bytes_match(pool, pooled)


def test_pool_admit_is_a_custom_op_that_declares_what_it_mutates():
    schema = str(torch.ops.offtensor.pool_admit.default._schema)
    for name in ("slot_of", "expert_in", "stamp", "clock", "counts", "buffers"):
        assert f"(a" in schema and name in schema
    assert schema.count("!") == 6


@pytest.mark.skipif(pool_ops._NATIVE_ADMIT is None, reason="needs the native extension")
def test_the_native_admit_makes_the_tensor_op_admits_decisions():
    """Random routings, step after step, into two copies of one pool's tables, one admitted by the
    tensor ops (the GPU's form) and its plan, one by the emulated device's native call: the same
    plan, tables, stamps, counters and slot bytes after every step."""
    experts, slots, layers = 12, 5, 2
    hosts = [torch.randn(experts, 3, 4), torch.randn(experts, 2)]
    tables = []
    for _ in range(2):
        tables.append(dict(slot_of=torch.full((experts * layers + 1,), -1), expert_in=torch.full((slots + 1,), -1),
                           stamp=torch.full((slots + 1,), -1), clock=torch.zeros(1, dtype=torch.int64),
                           counts=torch.zeros(2, dtype=torch.int64), buffers=[torch.zeros(slots, 3, 4), torch.zeros(slots, 2)]))
    pool = type("Pool", (), {"slots": slots})()
    g = torch.Generator().manual_seed(0)
    for step in range(60):
        rows = int(torch.randint(1, slots + 1, (1,), generator=g))
        routed = torch.sort(torch.randint(0, experts, (rows,), generator=g)).values
        tail = int(torch.randint(0, 2, (1,), generator=g))  # rows past the routed ones (no expert)
        offs = torch.cumsum(torch.bincount(routed[: rows - tail], minlength=experts), 0).to(torch.int32)
        base = experts * (step % layers)
        t = tables[0]
        row_expert = pool_ops._row_expert_of(offs, rows)
        row_slot = pool_ops.pool_admit(row_expert, t["slot_of"], t["expert_in"], t["stamp"], t["clock"], t["counts"],
                                       t["buffers"], hosts, base, experts)
        expected = pool_ops._compact_plan(pool, row_expert, row_slot, experts)[1:]
        t = tables[1]
        got = pool_ops._NATIVE_ADMIT(offs, rows, t["slot_of"], t["expert_in"], t["stamp"], t["clock"], t["counts"],
                                     t["buffers"], hosts, base, experts)
        assert all(torch.equal(a, b) for a, b in zip(expected, got)), step
        for name in ("slot_of", "expert_in", "stamp", "clock", "counts"):
            assert torch.equal(tables[0][name], tables[1][name]), (step, name)
        for a, b in zip(tables[0]["buffers"], tables[1]["buffers"]):
            assert torch.equal(a, b)


@pytest.mark.skipif(pool_ops._NATIVE_GMM is None, reason="needs the native extension")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_grouped_gemm_on_pool_slots_gives_atens_bits_and_copies_no_slot(dtype):
    """The emulated device's pooled GEMM reads each group's slot in place: its rows are aten's
    ``_grouped_mm`` of the plain stack (empty groups, a group of several rows, rows past the last
    group left alone), bit for bit; a group naming a slot past the pool is refused before any GEMM."""
    torch.manual_seed(0)
    experts, slots, k, n = 8, 5, 16, 24
    stack = torch.randn(experts, n, k, dtype=dtype)  # as transformers stores gate_up_proj: (E, out, in)
    slot_of = torch.tensor([3, -1, 0, 4, -1, 1, 2, -1])  # experts 0, 2, 3, 5, 6 in slots 3, 0, 4, 1, 2
    pool = torch.empty(slots, n, k, dtype=dtype)
    for e, s in enumerate(slot_of.tolist()):
        if s >= 0:
            pool[s] = stack[e]
    rows_per_expert = torch.tensor([2, 0, 3, 0, 0, 1, 1, 0])
    x = torch.randn(int(rows_per_expert.sum()), k, dtype=dtype)
    offs = torch.cumsum(rows_per_expert, 0, dtype=torch.int32)
    expected = torch._grouped_mm(x, stack.transpose(-2, -1), offs)
    used = [e for e in range(experts) if rows_per_expert[e] > 0]
    group_slot = torch.tensor([int(slot_of[e]) for e in used] + [0, 0])  # two trailing empty groups
    group_ends = torch.tensor([int(offs[e]) for e in used] + [int(offs[-1])] * 2, dtype=torch.int32)
    pool_t = pool.transpose(-2, -1)
    before = pool.clone()
    got = pool_ops._NATIVE_GMM(x, pool_t, group_slot, group_ends)
    assert torch.equal(got, expected) and torch.equal(pool, before)
    with pytest.raises(RuntimeError, match=f"in slot {slots} of {slots}"):
        pool_ops._NATIVE_GMM(x, pool_t, torch.tensor([0, 1, 2, slots, 0, 0]), group_ends)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fallback", "grouped_mm"])
def test_the_capture_path_runs_a_pooled_compiled_expert_call_from_the_pool(dtype, monkeypatch):
    """What a CUDA graph records, on the emulated device: a compiled expert call of a pooled stack
    (transformers' fallback op in float32, ``_grouped_mm`` in bfloat16) runs from the pool under
    capture, with the plain result; today's row-selective path refuses to be captured."""
    from torch._dynamo.backends.debugging import aot_eager  # noqa: F401

    from offtensor.ops import compile as ot_compile

    plain = _load("moe_mixtral").to(dtype)
    pooled = copy.deepcopy(plain)
    pool = _wrap_pooled(pooled, 4)
    module, reference = pooled.model.layers[1].mlp.experts, plain.model.layers[1].mlp.experts
    hidden = torch.randn(1, plain.config.hidden_size, dtype=dtype)
    weights = torch.full((1, 2), 0.5, dtype=dtype)
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            run = torch.compile(module, backend="aot_eager", fullgraph=True)
            run(hidden, torch.tensor([[0, 1]]), weights)  # compiled, outside capture
            monkeypatch.setattr(ot_compile, "capturing", lambda pager: True)
            for index in ([[2, 5]], [[5, 9]], [[1, 12]]):
                index = torch.tensor(index)
                assert torch.equal(run(hidden, index, weights), reference(hidden, index, weights))
            if dtype == torch.bfloat16:
                today = copy.deepcopy(plain)
                ot.wrap_model(today, budget_gb=pool.nbytes * 4 / GiB + 0.01, device="cpu", prefetch=False,
                              policy=["*.experts.*"])
                other = torch.compile(today.model.layers[1].mlp.experts, backend="aot_eager", fullgraph=True)
                with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"):
                    other(hidden, torch.tensor([[2, 5]]), weights)
    finally:
        torch._dynamo.reset()
    assert _consistent(pool)


def test_threads_sharing_a_pooled_model_each_get_the_plain_logits():
    """Two threads decode different tokens through one small pool: each expert call's admit and
    GEMM hold the pager's lock, so no thread's slots are given away under its GEMM."""
    import threading

    plain = _load("moe_mixtral")
    pooled = copy.deepcopy(plain)
    pool = _wrap_pooled(pooled, 3)
    tokens = [torch.tensor([[t]]) for t in range(3, 43, 2)]
    with torch.no_grad():
        expected = [plain(t).logits for t in tokens]
    got, errors = {}, []

    def run(part):
        try:
            with torch.no_grad():
                for i in range(part, len(tokens), 2):
                    got[i] = pooled(tokens[i]).logits
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(p,)) for p in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(torch.equal(got[i], expected[i]) for i in range(len(tokens)))
    assert _consistent(pool)


def _count_admits(monkeypatch, pool) -> list:
    """Each admit of ``pool``, seen from outside the op: its tables before and after, its routing
    (counted by ``_seen`` after the calls: a host read here would count as the step's sync)."""
    admits = []
    plan = pool_ops.pooled_plan

    def counted(p, master_id, offs, rows, *rest):
        before, slot_of, calls = p.expert_in.clone(), p.slot_of.clone(), p.calls
        out = plan(p, master_id, offs, rows, *rest)
        if p is pool and p.calls != calls:
            admits.append((before, p.expert_in.clone(), slot_of, p.layers[master_id], offs.clone(), rows))
        return out

    monkeypatch.setattr(pool_ops, "pooled_plan", counted)
    return admits


def _seen(admits) -> dict:
    """``fetches``: the slots whose expert changed (a missed expert is held by no slot, so each fetch
    changes one); ``hits``: the experts a call routed rows to that a slot held before it."""
    seen = {"fetches": 0, "hits": 0, "admits": len(admits)}
    for before, after, slot_of, (_, base, experts, _), offs, rows in admits:
        ends = offs.clamp(max=rows)
        needed = torch.diff(ends, prepend=ends.new_zeros(1)) > 0
        seen["fetches"] += int((after != before).sum())
        seen["hits"] += int((needed & (slot_of[base : base + experts] >= 0)).sum())
    return seen


def _check_pool_stats(model, pool, admits) -> None:
    s, seen = ot.stats(model), _seen(admits)
    slot_bytes = sum(b[0].numel() * b.element_size() for b in pool.buffers)
    assert seen["admits"] > 0 and seen["fetches"] > 0 and seen["hits"] > 0
    assert (s.expert_pool["fetches"], s.expert_pool["hits"]) == (seen["fetches"], seen["hits"])
    assert s.expert_pool["bytes_h2d"] == seen["fetches"] * slot_bytes == s.expert_pool["pools"][0]["bytes_h2d"]
    assert s.bytes_h2d == _pager(model).stats.bytes_h2d + s.expert_pool["bytes_h2d"]  # the pool's bytes included
    ot.reset_stats(model)
    assert ot.stats(model).expert_pool["fetches"] == ot.stats(model).expert_pool["hits"] == 0


@pytest.mark.parametrize("native", [True, False], ids=["native", "tensor_ops"])
def test_the_pools_fetches_and_hits_in_stats_are_its_changed_slots_counted_with_no_host_sync(pair, native,
                                                                                            monkeypatch):
    """Decode steps (two calls per layer on the same experts: the second hits) and a generate:
    ``ot.stats``' expert_pool figures are the admits' changed slots and held experts, its bytes in
    ``bytes_h2d``; the steps read nothing on the host (the counters stay on the device)."""
    if native and pool_ops._NATIVE_ADMIT is None:
        pytest.skip("needs the native extension")
    monkeypatch.setattr(pool_ops, "NATIVE_ADMIT", native)
    plain, pooled, pool = pair
    experts = [m for n, m in pooled.named_modules() if n.endswith("mlp.experts")]
    top_k = plain.config.num_experts_per_tok
    ids = torch.randint(0, plain.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        pooled(ids)
        ot.reset_stats(pooled)
        seen = _count_admits(monkeypatch, pool)
        hidden, weights = torch.randn(1, plain.config.hidden_size), torch.full((1, top_k), 1.0 / top_k)
        for step in range(4):
            index = torch.randperm(experts[0].num_experts, generator=torch.Generator().manual_seed(step))[:top_k]
            before, counter = HOST_SYNCS[0], _SyncCounter()
            with counter:
                for module in experts:
                    module(hidden, index[None], weights)
                    module(hidden, index[None], weights)
            assert HOST_SYNCS[0] == before and counter.syncs == []
        assert torch.equal(pooled.generate(ids, max_new_tokens=6, do_sample=False),
                           plain.generate(ids, max_new_tokens=6, do_sample=False))
    _check_pool_stats(pooled, pool, seen)


@pytest.mark.parametrize("native", [True, False], ids=["native", "tensor_ops"])
def test_a_compiled_fullgraph_pooled_expert_call_counts_the_pools_fetches_and_hits(native, monkeypatch):
    if native and pool_ops._NATIVE_ADMIT is None:
        pytest.skip("needs the native extension")
    monkeypatch.setattr(pool_ops, "NATIVE_ADMIT", native)
    plain = _load("moe_mixtral")
    pooled = copy.deepcopy(plain)
    pool = _wrap_pooled(pooled, 4)
    experts = [m for n, m in pooled.named_modules() if n.endswith("mlp.experts")]
    hidden, weights = torch.randn(1, plain.config.hidden_size), torch.full((1, 2), 0.5)
    torch._dynamo.reset()
    try:
        with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=64):
            compiled = [torch.compile(m, backend="aot_eager", fullgraph=True) for m in experts]
            compiled[0](hidden, torch.tensor([[0, 1]]), weights)  # compiled before counting
            ot.reset_stats(pooled)
            seen = _count_admits(monkeypatch, pool)
            for index in ([[2, 5]], [[5, 9]], [[1, 12]], [[1, 12]]):
                before = HOST_SYNCS[0]
                for run in compiled:
                    run(hidden, torch.tensor(index), weights)
                    run(hidden, torch.tensor(index), weights)
                assert HOST_SYNCS[0] == before
    finally:
        torch._dynamo.reset()
    _check_pool_stats(pooled, pool, seen)


def test_the_pooled_decode_benchmark_gives_the_resident_tokens_in_every_variant_on_the_emulated_device(tmp_path):
    """benchmarks/pool_graph_decode.py (a step of the GPU suite), tiny, on the emulated device: every
    variant it can run here decodes the resident model's tokens, the pooled one fetches into its
    pool, and the GPU-only UVA baseline is reported as skipped, not lost."""
    import importlib.util

    path = os.path.join(os.path.dirname(DATA), "..", "benchmarks", "pool_graph_decode.py")
    spec = importlib.util.spec_from_file_location("pool_graph_decode", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    body = bench.main(["--device", "cpu", "--hidden", "64", "--layers", "2", "--experts", "8", "--vocab", "128",
                       "--tokens", "4", "--repeats", "2", "--out", str(tmp_path)])
    modes = body["modes"]
    assert {"resident", "wrapped", "pooled"} <= set(modes) and "skipped" in modes["uva"]
    assert all(modes[m]["tokens_match_resident"] for m in ("resident", "wrapped", "pooled"))
    assert modes["pooled"]["pool_fetches_per_token"] > 0 and body["pooled_over_resident_tok_s"] > 0
    assert (tmp_path / "pool_graph_decode_cpu.json").exists()


def _meta_twin(name: str):
    config = transformers.AutoConfig.from_pretrained(os.path.join(DATA, name))
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def test_a_plan_with_expert_pool_makes_the_pools_decisions_fetching_on_the_device_with_no_host_read(monkeypatch):
    """``ot.plan(..., expert_pool=True)`` of the Mixtral on meta: the pool has the slots wrap_model
    gives it at that budget; the admits' decisions on the host mirror are the tensor-op admit's on
    the same routing (its fetches and hits); each fetch is a device-side copy of one slot on the
    compute stream that the next op waits for; the expert path records no host sync and no page,
    where the same plan without the pool reads the routing on the host every MoE layer."""
    plain = _load("moe_mixtral")
    slot, resident = _expert_sizes(plain)
    budget = (resident + slot + 4 * slot + slot // 2) / GiB
    wrapped_pool = _wrap_pooled(copy.deepcopy(plain), 4)
    calls = []
    admit = pool_ops.mirror_admit

    def logged(pool, base, experts, ends, rows):
        calls.append((base, experts, list(ends), rows))
        return admit(pool, base, experts, ends, rows)

    monkeypatch.setattr(pool_ops, "mirror_admit", logged)
    meta, ids = _meta_twin("moe_mixtral"), torch.zeros(1, 1, dtype=torch.long)
    kwargs = dict(budget_gb=budget, example_inputs=(ids,), policy=["*.experts.*"], prefetch=False, profile="h200")
    tl = ot.plan(meta, expert_pool=True, **kwargs)
    info = tl.info["expert_pool"]
    assert info["slots"] == wrapped_pool.slots and info["bytes"] == wrapped_pool.nbytes
    # The same routing through the tensor-op admit (the GPU's form) on tables of the pool's shape.
    layers, slots = plain.config.num_hidden_layers, wrapped_pool.slots
    experts = plain.config.num_local_experts
    t = dict(slot_of=torch.full((experts * layers + 1,), -1), expert_in=torch.full((slots + 1,), -1),
             stamp=torch.full((slots + 1,), -1), clock=torch.zeros(1, dtype=torch.int64),
             counts=torch.zeros(2, dtype=torch.int64))
    for base, n, ends, rows in calls:
        row_expert = pool_ops._row_expert_of(torch.tensor(ends, dtype=torch.int32), rows)
        pool_ops.pool_admit(row_expert, t["slot_of"], t["expert_in"], t["stamp"], t["clock"], t["counts"],
                            [torch.zeros(slots, 1)], [torch.zeros(n, 1)], base, n)
    assert len(calls) == tl.steps * layers and (info["fetches"], info["hits"]) == tuple(t["counts"].tolist())
    fetches = [r for r in tl.records if r.name == "pool fetch"]
    assert len(fetches) == info["fetches"] > 0 and info["bytes_h2d"] == info["fetches"] * slot
    assert all(r.kind == "copy" and r.stream == "compute" and r.device_side and r.nbytes == slot for r in fetches)
    readers = {w for r in tl.records if r.kind == "op" for w in r.waits}
    assert all(r.id in readers for r in fetches)
    assert not any(r.kind == "sync" for r in tl.records)
    assert all(r.pages == 0 for r in tl.records if r.kind == "op")
    cached = ot.plan(_meta_twin("moe_mixtral"), **kwargs)  # the expert cache's path: a host read per layer
    assert sum(r.kind == "sync" for r in cached.records) == cached.steps * layers
    assert cached.info["expert_pool"] is None
