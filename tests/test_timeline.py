"""Timelines: what a recording holds, what a replay computes, what ot.plan decides on meta, and the
placement and prefetch schedule judged by the replay (the H200 workload's bar)."""

import dataclasses
import json

import pytest
import torch
from torch import nn

import offtensor as ot
from offtensor import _optional, placement
from offtensor.models.dense import DenseStack
from offtensor.sim.profiles import Profile
from offtensor.sim.timeline import Timeline

GiB = 1 << 30


def _linear_stack(n=6, width=256):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(n)])


def _stack_budget_gb(model, offloaded_weights, room_weights=2):
    weight = model[0].weight.numel() * 4
    total = weight * len(model)
    return (total - offloaded_weights * weight + room_weights * weight) / GiB


# ---------------------------------------------------------------------------- recording a real run


def test_recording_holds_every_op_every_copy_and_what_each_waits_for(device):
    model = _linear_stack()
    x = torch.randn(8, 256)
    ot.wrap_model(model, budget_gb=_stack_budget_gb(model, 3), device=device)
    x = x.to(device)
    before = ot.stats(model).bytes_h2d
    with torch.no_grad(), ot.timeline(model) as tl:
        for _ in range(3):
            model(x)
    moved = ot.stats(model).bytes_h2d - before
    ops = [r for r in tl.records if r.kind == "op"]
    copies = [r for r in tl.records if r.kind == "copy"]
    assert tl.steps == 3
    # One GEMM per layer per step, resident layers included (they never reach the pager).
    assert len(ops) == 3 * 6 and all(r.name == "mm" and r.flops == 2 * 8 * 256 * 256 for r in ops)
    assert sum(r.nbytes for r in copies) == moved > 0
    by_id = {r.id: r for r in tl.records}
    readers = [r for r in ops if r.waits]
    # Three offloaded layers per step: each of their GEMMs waits for a copy of exactly its weight.
    assert len(readers) == 3 * 3
    for r in readers:
        assert [by_id[w].kind for w in r.waits] == ["copy"] and by_id[r.waits[0]].nbytes == 256 * 256 * 4
    # The cache holds two of the three: some copy reuses a block and waits for the op that read it.
    assert any(by_id[w].kind == "op" for c in copies for w in c.waits)
    # Waits point backwards: a replay can order them.
    position = {r.id: i for i, r in enumerate(tl.records)}
    assert all(position[w] < position[r.id] for r in tl.records for w in r.waits)
    ot.unwrap_model(model)


def test_chrome_trace_has_one_complete_event_per_record_on_named_streams(tmp_path):
    model = _linear_stack(4)
    ot.wrap_model(model, budget_gb=_stack_budget_gb(model, 3), device="cpu")
    with torch.no_grad(), ot.timeline(model) as tl:
        model(torch.randn(4, 256))
        model(torch.randn(4, 256))
    path = tl.save(str(tmp_path / "trace.json"), profile="h200")
    trace = json.load(open(path))
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert sorted(names.values()) == ["compute", "copy"]
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == len(tl.records) and {r.stream for r in tl.records} == {"copy", "compute"}
    replay = tl.replay("h200")
    for e, r in zip(events, tl.records):
        assert set(e["args"]) >= {"id", "bytes", "flops", "step", "waits"}
        assert e["args"]["id"] == r.id and e["args"]["waits"] == r.waits and names[e["tid"]] == r.stream
        assert e["ts"] == pytest.approx(replay.starts[r.id] * 1e3) and e["dur"] > 0

    png = tl.plot(str(tmp_path / "trace.png"), profile="h200")
    if _optional.pyplot() is None:  # matplotlib is optional: without it the plot is skipped (warned once)
        assert png is None and not list(tmp_path.glob("*.png"))
    else:
        assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    ot.unwrap_model(model)


# ---------------------------------------------------------------------------- replay

# Round numbers: a copy of 1e9 bytes and an op of 1e12 FLOPs take one second each.
TOY = Profile("toy", h2d_gbps=1.0, tflops={"float32": 1.0}, hbm_gbps=1e9, launch_us=0.0)


def test_replay_overlaps_streams_and_honours_waits():
    tl = Timeline()
    a = tl.add_copy(1e9)
    x = tl.add_op(1e12, 0, "float32", waits=[a])
    b = tl.add_copy(1e9)  # a second slot: overlaps x
    tl.add_op(1e12, 0, "float32", waits=[b])
    r = tl.replay(TOY)
    assert (r.step_ms, r.bound_ms) == pytest.approx((3000.0, 2000.0))
    assert r.copy_busy == pytest.approx(2 / 3) and r.compute_busy == pytest.approx(2 / 3)

    one_slot = Timeline()
    a = one_slot.add_copy(1e9)
    x = one_slot.add_op(1e12, 0, "float32", waits=[a])
    b = one_slot.add_copy(1e9, waits=[x])  # reuses x's block: no overlap left
    one_slot.add_op(1e12, 0, "float32", waits=[b])
    assert one_slot.replay(TOY).step_ms == pytest.approx(4000.0)


def test_replay_step_boundaries_follow_the_host_synchronisation():
    # Step 1's copy is issued in step 0 (a prefetch across the boundary).
    tl = Timeline()
    c0 = tl.add_copy(1e9)
    tl.add_op(1e12, 0, "float32", waits=[c0])
    c1 = tl.add_copy(1e9)
    tl.next_step()
    tl.add_op(1e12, 0, "float32", waits=[c1])
    assert tl.replay(TOY, sync=None).steps_ms == pytest.approx([2000.0, 1000.0])
    # A device sync waits for the prefetch too: step 0 lasts until it lands.
    assert tl.replay(TOY, sync="device").steps_ms == pytest.approx([2000.0, 1000.0])
    assert tl.replay(TOY, sync="compute").steps_ms == pytest.approx([2000.0, 1000.0])
    late = Timeline()
    c0 = late.add_copy(1e9)
    late.add_op(1e12, 0, "float32", waits=[c0])
    late.next_step()
    c1 = late.add_copy(1e9)  # issued only after the sync: nothing overlaps the step boundary
    late.add_op(1e12, 0, "float32", waits=[c1])
    assert late.replay(TOY).steps_ms == pytest.approx([2000.0, 2000.0])


def test_replay_refuses_a_wait_on_a_record_issued_later():
    tl = Timeline()
    tl.add_op(1.0, 0, waits=[5])
    with pytest.raises(ValueError, match="waits for 5"):
        tl.replay(TOY)


def test_built_in_profiles_name_their_source():
    for name in ("h200", "h100"):
        profile = ot.get_profile(name)
        assert profile.h2d_gbps > 0 and profile.tflops["bfloat16"] > 0 and profile.source
    assert ot.get_profile("h200").h2d_gbps == 55.3
    with pytest.raises(ValueError, match="unknown device profile"):
        ot.get_profile("tpu")


def test_measure_profile_on_the_emulated_device_gives_positive_rates():
    profile = ot.measure_profile("cpu")
    assert profile.h2d_gbps > 0 and profile.hbm_gbps > 0 and profile.launch_us > 0
    assert all(v > 0 for v in profile.tflops.values())
    # offtensor's own host time per page, per copy and per pooled expert GEMM, measured on this host
    # (a cache hit costs more than the plain op); the h200 profile's was measured on the H200's host.
    # (and what each further expert of a grouped GEMM on cached experts costs, "expert").
    assert set(profile.host_us) == {"page", "copy", "pool", "expert"} and profile.host_us["page"] > 0
    assert profile.host_us["pool"] > 0 and profile.host_us["expert"] >= 0
    h200 = ot.get_profile("h200")
    assert "measured" in profile.host_source and h200.host_source.startswith("measured") and "H200" in h200.host_source
    assert set(h200.host_us) == {"page", "copy", "pool"}


# ---------------------------------------------------------------------------- planning on meta


def _meta_stack(layers, hidden=128, ffn=256, dtype=torch.float32):
    with torch.device("meta"):
        return DenseStack(layers, hidden, ffn, dtype)


def _plan(model, offloaded_layers, tokens, room_weights=2, hidden=None, **kwargs):
    layer = model.layer_bytes()
    total = layer * len(model.layers)
    budget = (total - offloaded_layers * layer + room_weights * layer // 2) / GiB
    hidden = hidden or model.layers[0].w1.shape[0]
    x = torch.empty(tokens, hidden, dtype=model.layers[0].w1.dtype, device="meta")
    return ot.plan(model, budget_gb=budget, example_inputs=(x,), **kwargs)


def test_plan_leaves_the_meta_model_as_it_was():
    model = _meta_stack(8)
    params = [(n, p) for n, p in model.named_parameters()]
    tl = _plan(model, 4, tokens=16)
    assert [(n, p) for n, p in model.named_parameters()] == params  # the same objects
    assert all(type(p) is nn.Parameter and p.is_meta for _, p in params)
    assert len(tl.info["offloaded"]) == 8 and tl.info["peak_device_bytes"] <= tl.info["budget_bytes"]


def test_plan_takes_the_decisions_a_real_run_takes():
    # The same model and budget, once on meta and once wrapped on the emulated device: the same
    # copies, ops, steps and dependencies, record for record.
    def shape_of(tl):
        index = {r.id: i for i, r in enumerate(tl.records)}
        return [(r.kind, r.stream, r.name, r.nbytes, r.flops, r.step, [index[w] for w in r.waits]) for r in tl.records]

    meta = _meta_stack(8)
    planned = _plan(meta, 4, tokens=16, steps=2, warmup=3)
    torch.manual_seed(0)
    real = DenseStack(8, 128, 256, torch.float32)
    for p in real.parameters():
        p.data.normal_()
    budget = planned.info["budget_bytes"] / GiB
    ot.wrap_model(real, budget_gb=budget, device="cpu")
    x = torch.randn(16, 128)
    with torch.no_grad(), ot.timeline(real) as recorded:
        for _ in range(5):
            real(x)
    assert shape_of(recorded) == shape_of(planned)
    ot.unwrap_model(real)


class _TableLM(nn.Module):
    def __init__(self, vocab=1000, hidden=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        return self.head(self.embed(ids))


def test_plan_pages_an_offloaded_embedding_as_one_row_per_token_with_its_host_sync():
    # On meta the token ids have no values: the plan takes each to select its own row, which is
    # what a real run with distinct ids pages, sync and bytes alike.
    def table_copies(tl):
        return [(r.step, r.nbytes) for r in tl.records if r.kind == "copy"]

    def syncs(tl):
        return [r.step for r in tl.records if r.kind == "sync"]

    with torch.device("meta"):
        meta = _TableLM()
    budget = 1.25 * meta.head.weight.numel() * 4 / GiB  # the head stays, the table is offloaded first
    ids = torch.randperm(1000, generator=torch.Generator().manual_seed(0))[:16].reshape(2, 8)
    planned = ot.plan(meta, budget_gb=budget, example_inputs=(ids,), steps=2, warmup=1)
    assert planned.info["offloaded"] == ["embed.weight"]
    assert table_copies(planned) == [(s, 16 * 64 * 4) for s in range(3)]
    assert syncs(planned) == [0, 1, 2]

    real = _TableLM()
    ot.wrap_model(real, budget_gb=budget, device="cpu")
    with torch.no_grad(), ot.timeline(real) as recorded:
        for _ in range(3):
            real(ids)
    assert table_copies(recorded) == table_copies(planned) and syncs(recorded) == syncs(planned)


H200_LAYERS, H200_HIDDEN, H200_FFN = 24, 8192, 24576


@pytest.fixture(scope="module")
def h200_workload():
    with torch.device("meta"):
        return DenseStack(H200_LAYERS, H200_HIDDEN, H200_FFN, torch.bfloat16)


@pytest.mark.parametrize("offloaded", [6, 12, 18])
@pytest.mark.parametrize("phase,tokens", [("prefill", 4096), ("decode", 1)])
def test_default_placement_and_prefetch_reach_the_pcie_bound_on_h200(h200_workload, offloaded, phase, tokens):
    tl = _plan(h200_workload, offloaded, tokens, profile="h200", steps=3)
    assert len(tl.info["offloaded"]) == 2 * offloaded
    r = tl.replay()
    assert r.ratio_to_bound <= 1.03, f"{offloaded} of 24 offloaded, {phase}: {r}"
    # Steady state: the last two steps take the same time.
    assert r.steps_ms[-1] == pytest.approx(r.steps_ms[-2], rel=0.005)


def test_a_step_of_many_small_paged_ops_is_bound_by_the_host_lane():
    # 100 one-page ops of 1 us each: the device would take 100 us, the host needs 10 us per page to
    # issue them, so the step is the host's 1 ms, and the replay says so.
    host_bound = Profile("toy-host", h2d_gbps=1.0, tflops={"float32": 1.0}, hbm_gbps=1e9, launch_us=1.0,
                         host_us={"page": 10.0})
    tl = Timeline()
    for _ in range(100):
        tl.add_op(0, 0, "float32", pages=1)
    r = tl.replay(host_bound)
    assert r.bound_by == "host" and r.host_bound
    assert r.step_ms == pytest.approx(1.0 + 0.001) and r.host_ms == pytest.approx(1.0)
    assert r.compute_busy == pytest.approx(0.1, rel=0.01)
    free_host = dataclasses.replace(host_bound, host_us={})
    assert tl.replay(free_host).step_ms == pytest.approx(0.1) and tl.replay(free_host).bound_by == "compute"


def test_an_op_that_gives_back_one_record_of_many_pages_pays_one_page_and_an_expert_for_each_other():
    # A grouped GEMM on 4 cached experts (one record, one release) against 4 ops of one page each:
    # with an "expert" figure the first costs 10 + 3 x 2 us, the others 4 x 10; without one, both
    # cost 10 us a page. Split into kernels (the pages on the kernels, the release after them), the
    # grouped GEMM's host lane is the same.
    base = Profile("toy-host", h2d_gbps=1.0, tflops={"float32": 1.0}, hbm_gbps=1e9, launch_us=0.0,
                   host_us={"page": 10.0, "expert": 2.0})
    assert base.host_ms("op", pages=4, releases=1) == pytest.approx(16e-3)
    assert base.host_ms("op", pages=1, releases=1) == pytest.approx(10e-3)
    split = Timeline()
    for _ in range(4):
        split.add_op(0, 0, "float32", pages=1)
    split.add_op(0, 0, "float32", releases=1)
    assert split.replay(base).host_ms == pytest.approx(16e-3)
    each = Timeline()
    for _ in range(4):
        each.add_op(0, 0, "float32", pages=1, releases=1)
    assert each.replay(base).host_ms == pytest.approx(40e-3)
    no_expert = dataclasses.replace(base, host_us={"page": 10.0})
    assert split.replay(no_expert).host_ms == pytest.approx(40e-3) == each.replay(no_expert).host_ms
    # An expert dearer than a page: a one-page op still costs a page, a record after its kernels no
    # less than nothing.
    dear = dataclasses.replace(base, host_us={"page": 10.0, "expert": 12.0})
    assert dear.host_ms("op", pages=1, releases=1) == pytest.approx(10e-3)
    assert dear.host_ms("op", pages=0, releases=1) == 0.0


@pytest.mark.parametrize("phase,tokens", [("prefill", 4096), ("decode", 1)])
def test_the_host_lane_leaves_the_dense_plans_where_it_is_not_the_bound(h200_workload, phase, tokens):
    # `python -m offtensor plan --offload-layers 12`: the H200's measured host cost per page is far
    # below its copies and GEMMs, so the replay gives the step of a host that issues for free, but
    # for the first copy of the step, which starts only once the host has issued it (~50 us).
    tl = _plan(h200_workload, 12, tokens, profile="h200", steps=2)
    with_host = tl.replay("h200")
    without = tl.replay(dataclasses.replace(ot.get_profile("h200"), host_us={}))
    assert with_host.host_ms > 0 and with_host.bound_by != "host"
    first_issue_ms = (ot.get_profile("h200").host_us["page"] + ot.get_profile("h200").host_us["copy"]) * 1e-3
    assert without.step_ms <= with_host.step_ms <= without.step_ms + first_issue_ms
    assert with_host.steps_ms == pytest.approx(without.steps_ms, abs=first_issue_ms)


def test_name_order_placement_would_miss_the_bound(h200_workload):
    # What the H200 calibration found: ties broken by name offload layers 0, 1 and 10-19 as one block, and the
    # copy stream idles behind the resident block. Forcing that placement shows what the fix buys.
    name_order = sorted(range(24), key=str)[:12]
    def policy(name):
        return "offload" if int(name.split(".")[1]) in name_order else "keep"

    block = _plan(h200_workload, 12, 4096, policy=policy, profile="h200")
    assert sorted(int(n.split(".")[1]) for n in block.info["offloaded"][::2]) == sorted(name_order)
    assert block.replay().ratio_to_bound > 1.15
    spread = _plan(h200_workload, 12, 4096, profile="h200")
    assert spread.replay().ratio_to_bound < 1.03


def test_placement_offloads_equal_weights_evenly_spread_in_forward_order():
    mb = 1 << 20
    names = [f"layers.{i}.mlp.weight" for i in range(24)]
    weights = [placement.Weight([n], mb, (512, 512), mb) for n in names]
    plan = placement.choose_placement(weights, budget_bytes=(24 - 12 + 2) * mb)
    assert sorted(int(w.name.split(".")[1]) for w in plan.offload) == list(range(1, 24, 2))
    quarter = placement.choose_placement(weights, budget_bytes=(24 - 6 + 2) * mb)
    assert sorted(int(w.name.split(".")[1]) for w in quarter.offload) == [2, 6, 10, 14, 18, 22]
    # Forward order, not name order: of layers 0-11, a third spread out is 1, 4, 7, 10 (by name
    # order "layers.10" and "layers.11" would come third and fourth).
    third = placement.choose_placement(weights[:12], budget_bytes=(12 - 4 + 2) * mb)
    assert sorted(int(w.name.split(".")[1]) for w in third.offload) == [1, 4, 7, 10]


def _max_prefetched_ahead(tl):
    """The most copies issued and not yet read at the moment an op that reads a copy is issued."""
    pending, most = set(), 0
    for r in tl.records:
        if r.kind == "copy":
            pending.add(r.id)
        elif r.waits:
            pending.difference_update(r.waits)
            most = max(most, len(pending))
    return most


def test_prefetch_depth_is_the_bytes_the_budget_holds_not_a_count():
    # Every weight offloaded (the policy), so the budget beyond the copy in use is all prefetch room.
    model = _meta_stack(12)
    shallow = _plan(model, 12, tokens=4, room_weights=2, policy=["*"])
    assert _max_prefetched_ahead(shallow) == 1
    deep = _plan(model, 12, tokens=4, room_weights=6, policy=["*"])
    assert deep.info["resident_bytes"] == 0
    assert _max_prefetched_ahead(deep) == 5
    assert deep.info["peak_device_bytes"] <= deep.info["budget_bytes"]


def test_the_tail_of_a_step_prefetches_the_head_of_the_next(h200_workload):
    tl = _plan(h200_workload, 12, 1, profile="h200", steps=2)
    by_id = {r.id: r for r in tl.records}
    last = tl.steps - 1
    first_reader = next(r for r in tl.records if r.step == last and r.kind == "op" and r.waits)
    assert by_id[first_reader.waits[0]].step == last - 1


def test_a_step_function_is_recorded_with_the_pagers_named():
    # What benchmarks/offload_bench.py does: no model to hook, steps marked by hand.
    model = _linear_stack(4)
    ot.wrap_model(model, budget_gb=_stack_budget_gb(model, 3), device="cpu")
    pager = next(p.pager for p in model.parameters() if isinstance(p, ot.OffloadedTensor))
    x = torch.randn(4, 256)
    with torch.no_grad(), ot.timeline(pagers=[pager]) as tl:
        model(x)
        tl.next_step()
        model(x)
    assert tl.steps == 2
    assert sum(r.kind == "copy" for r in tl.records) == 2 * 3 and sum(r.kind == "op" for r in tl.records) == 8
    assert pager.recorder is None and "page" not in vars(pager)  # the pager is as it was
    ot.unwrap_model(model)


def test_plan_command_plans_a_whole_transformers_model_from_its_config(tmp_path, capsys):
    pytest.importorskip("transformers")
    from offtensor.__main__ import main

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 2048, "hidden_size": 64,
              "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 128, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    png = str(tmp_path / "plan.png")
    assert main(["plan", "--config", str(tmp_path), "--dtype", "fp32", "--prefill-tokens", "32", "--png", png]) == 0
    out = capsys.readouterr().out
    # The default budget is half the weights: the 512 KiB embedding table goes first, the head stays.
    assert "LlamaForCausalLM: 2 layers" in out and "| prefill | 32 |" in out and "| decode | 1 |" in out
    assert " of 21 weights offloaded" in out
    if _optional.pyplot() is not None:  # matplotlib is optional: without it no PNG is written
        assert open(tmp_path / "plan-decode.png", "rb").read(4) == b"\x89PNG"
    with pytest.raises(SystemExit):
        main(["plan", "--config", str(tmp_path), "--offload-layers", "1"])


def test_plan_routes_a_transformers_moe_on_meta_to_top_k_experts_per_token():
    # Routing has no values on meta: each token's rows go to distinct experts drawn at random, so
    # a one-token decode pages at most top_k experts per offloaded stack, after one host sync per
    # MoE layer (the routing read a GPU pays).
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         num_experts=16, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    stacks = {n: p for n, p in model.named_parameters() if ".experts." in n}
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    expert_bytes = sum(p.numel() * p.element_size() for p in stacks.values())
    budget = (total - expert_bytes + expert_bytes // 4) / GiB
    tl = ot.plan(model, budget_gb=budget, example_inputs=(torch.zeros(1, 1, dtype=torch.long),), steps=2, warmup=1)
    offloaded = [n for n in tl.info["offloaded"] if n in stacks]
    assert offloaded and set(tl.info["offloaded"]) <= set(stacks) | {"model.embed_tokens.weight"}
    layers = {n.rsplit(".", 2)[0] for n in offloaded}
    table = "model.embed_tokens.weight" in tl.info["offloaded"]  # one more read: the token's row
    for step in range(tl.steps):
        assert sum(1 for r in tl.records if r.kind == "sync" and r.step == step) == len(layers) + table
        per_expert = sum(stacks[n].numel() // 16 * 2 for n in offloaded)
        assert 0 < tl.step_copy_bytes(step) <= 2 * per_expert + 2 * 64 * 2  # top-2 experts, one embedding row
    assert tl.replay("h200").ratio_to_bound >= 1.0


def test_plan_command_prints_the_table_and_writes_the_pngs(tmp_path, capsys):
    from offtensor.__main__ import main

    png = str(tmp_path / "plan.png")
    args = ["plan", "--layers", "6", "--hidden", "128", "--ffn", "256", "--dtype", "fp32", "--offload-layers", "3",
            "--prefill-tokens", "64", "--png", png, "--trace", str(tmp_path / "plan.json")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "| prefill | 64 |" in out and "| decode | 1 |" in out and "6 of 12 weights offloaded" in out
    for phase in ("prefill", "decode"):
        if _optional.pyplot() is not None:  # matplotlib is optional: without it no PNG is written
            assert open(tmp_path / f"plan-{phase}.png", "rb").read(4) == b"\x89PNG"
        assert json.load(open(tmp_path / f"plan-{phase}.json"))["traceEvents"]


# ------------------------------------------------------------------------------------ measured routing


def _small_qwen3_moe(layers=2, experts=16, top_k=2):
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, num_experts=experts, num_experts_per_tok=top_k,
                                         decoder_sparse_step=1, mlp_only_layers=[])
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()


def test_routing_stats_from_a_trace_measure_skew_and_locality_and_scale_to_more_experts():
    from offtensor import RoutingStats

    # One layer of 8 experts, top-2: expert 0 at every step, its partner alternating 1, 2, 1, 2.
    steps = [[[0, 1 + t % 2]] for t in range(4)]
    stats = RoutingStats.from_trace(steps, num_experts=8)
    assert stats.top_k == 2 and stats.popularity[0][:3] == [0.5, 0.25, 0.25] and sum(stats.popularity[0]) == 1.0
    assert stats.locality == [0.5]  # the previous token's expert 0 again, never its partner
    # At 32 experts the top eighth (4 experts) takes the top expert's share, and the curve sums to 1.
    shares = stats.layer_shares(0, 1, 32)
    assert len(shares) == 32 and abs(sum(shares) - 1.0) < 1e-9 and abs(sum(shares[:4]) - 0.5) < 1e-9
    uniform = RoutingStats.uniform(8, 2)
    assert uniform.summary()["entropy_bits"] == [3.0] and uniform.locality == [0.25]
    with pytest.raises(ValueError, match="layer 0"):
        RoutingStats.from_trace([[[0, 9]]], num_experts=8)


def test_a_plan_under_uniform_routing_is_the_same_whatever_was_planned_before_it():
    """Uniform planned routing drew from one generator seeded once per process, so the same plan
    gave 0.125, then 0.0, then 0.0 of expert hits in three calls (and a suite's test of it depended
    on which tests its worker ran first). Each plan seeds it anew."""
    from offtensor.sim.plan import EXPERTS_PAGED

    model = _small_qwen3_moe(layers=1)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    x = torch.zeros(1, 1, dtype=torch.long)

    def expert_copies():
        tl = ot.plan(model, budget_gb=(total - experts + experts // 4) / GiB, example_inputs=(x,), steps=2, warmup=2,
                     policy=EXPERTS_PAGED)
        return [(e["hits"], e["misses"]) for e in tl.info["experts"].values()], tl.step_copy_bytes(tl.steps - 1)

    first = expert_copies()
    assert all(expert_copies() == first for _ in range(2))


def test_a_plan_under_measured_routing_reuses_experts_that_a_uniform_plan_does_not():
    from offtensor.sim.plan import EXPERTS_PAGED, plan_expert_paging
    from offtensor import RoutingStats

    model = _small_qwen3_moe(layers=1)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    budget = (total - experts + experts // 4) / GiB
    # Two hot experts per layer, reused from token to token (what a trained router does, in the extreme).
    hot = RoutingStats([[0.45, 0.45] + [0.1 / 14] * 14], [0.9], 2, source="test")
    x = torch.zeros(1, 1, dtype=torch.long)
    plans = {name: ot.plan(model, budget_gb=budget, example_inputs=(x,), steps=2, warmup=2, policy=EXPERTS_PAGED,
                           routing=routing) for name, routing in (("uniform", None), ("hot", hot))}
    hit = {name: sum(e["hits"] for e in tl.info["experts"].values()) /
           sum(e["hits"] + e["misses"] for e in tl.info["experts"].values()) for name, tl in plans.items()}
    assert hit["hot"] > hit["uniform"] + 0.3, hit
    moved = {name: sum(tl.step_copy_bytes(s) for s in range(1, tl.steps)) for name, tl in plans.items()}
    assert moved["hot"] < moved["uniform"], moved
    assert plans["hot"].info["routing"]["source"] == "test" and plans["uniform"].info["routing"] == "uniform"
    # The placement of the stacks is the replay's verdict: the faster of the two plans.
    verdict = plan_expert_paging(model, budget, (x,), routing=hot, steps=1, warmup=1)
    assert verdict["paged"] == (verdict["all_paged"].step_ms < verdict["default"].step_ms)
    assert verdict["policy"] == (EXPERTS_PAGED if verdict["paged"] else None)
