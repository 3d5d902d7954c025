"""torch.distributed with offloaded weights, on 2 ranks over gloo: collectives and point-to-point
transfers on OffloadedTensors, tensor parallelism with DTensor (``parallelize_module`` on a
transformers Llama and on the reference DeepSeek) and by hand (Megatron-style), and FSDP2 in
either order (with peft LoRA too).

One pair of processes runs every scenario (starting processes costs far more than the scenarios),
each rank records what it saw, and the tests below check those records. A scenario that raises is
recorded as its error, so one failure does not hide the others; every collective has a short
timeout, so a hang fails the run instead of stalling CI. The scenarios are in
tests/distributed_scenarios.py; the runner, the checks on their records and FSDP2 in this process
are here."""

from __future__ import annotations

import datetime
import os
import traceback

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distributed_scenarios import (WORLD, _collectives, _deepseek_tp, _fsdp, _fsdp_then_wrap, _llama_tp,
                                   _llama_wrap_then_parallelize, _manual_tp, _peft_fsdp, _point_to_point, _seed)

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

RUN_TIMEOUT_S = 240
GiB = 2 ** 30


def _run_ranks(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    scenarios = {
        "collectives": lambda: _collectives(rank), "llama_tp": lambda: _llama_tp(rank, mesh),
        "wrap_then_parallelize": lambda: _llama_wrap_then_parallelize(rank, mesh),
        "deepseek_tp": lambda: _deepseek_tp(rank, mesh), "manual_tp": lambda: _manual_tp(rank),
        "fsdp": lambda: _fsdp(rank, mesh), "fsdp_then_wrap": lambda: _fsdp_then_wrap(rank, mesh),
        "peft_fsdp": lambda: _peft_fsdp(rank, mesh), "point_to_point": lambda: _point_to_point(rank),
        "seed": lambda: _seed(rank, out_dir),
    }
    _run_scenarios(rank, out_dir, scenarios)


def _run_scenarios(rank: int, out_dir: str, scenarios: dict) -> None:
    """Run each scenario on this rank in order (both ranks in step), record its result or its
    exception, save them for the pytest process and leave the process group."""
    results = {}
    for name, scenario in scenarios.items():
        try:
            results[name] = scenario()
        except Exception:  # recorded; the test of this scenario shows it
            results[name] = {"exception": traceback.format_exc()}
        dist.barrier()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


# ---------------------------------------------------------------------------- the tests (in the pytest process)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("ranks")
    # Both ranks fork from one server that imported torch, transformers and offtensor once, instead
    # of each importing them (seconds each) in a fresh interpreter.
    mp.set_forkserver_preload([__name__, "transformers.models.llama.modeling_llama"])
    context = mp.start_processes(_run_ranks, args=(str(out / "init"), str(out)), nprocs=WORLD, join=False,
                                 start_method="forkserver")
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=RUN_TIMEOUT_S)
    while not context.join(timeout=5):
        if datetime.datetime.now() > deadline:
            for p in context.processes:
                p.kill()
            pytest.fail(f"the 2-rank run did not finish in {RUN_TIMEOUT_S} s")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _result(ranks, name):
    for r, results in enumerate(ranks):
        assert "exception" not in results[name], f"rank {r}: {results[name].get('exception')}"
    return [results[name] for results in ranks]


def test_in_place_collectives_write_back_to_the_master_on_every_rank(ranks):
    # On main: broadcast and all_reduce ran on a paged copy and were lost; scatter and all_gather
    # with nested list arguments reached gloo with a null data pointer.
    for rank, r in enumerate(_result(ranks, "collectives")):
        assert r["broadcast"] == ("OffloadedTensor", [0.0] * 4, [0.0] * 4), rank  # cached copy dropped too
        assert r["all_reduce"] == [3.0] * 4 and r["all_reduce_async"] == [3.0] * 2
        assert r["all_gather"] == [[0.0, 0.0], [1.0, 1.0]]
        assert r["scatter"] == [10.0 + rank] * 2
        assert r["all_gather_into_tensor"] == [0.0, 0.0, 1.0, 1.0]
        assert r["send_recv"] == ([0.0] * 3 if rank == 0 else [7.0] * 3)
        assert r["functional_all_reduce"] == [3.0, 3.0] and r["functional_all_reduce_"] == [3.0, 3.0]


def test_collectives_find_offloaded_tensors_passed_only_inside_nested_lists(ranks):
    # On main: rank 0's scatter failed inside gloo ("writev: Bad address": it read the wrapper's
    # null data pointer; a larger read segfaults) and rank 1 lost its peer.
    for rank, r in enumerate(_result(ranks, "collectives")):
        for mode in ("nested", "nested_inference"):
            scattered, all_gathered, gathered = r[mode]
            assert scattered == [20.0 + rank] * 2, (rank, mode)
            assert all_gathered == [[3.0, 3.0], [4.0, 4.0]], (rank, mode)
            assert gathered == (None if rank == 0 else [("OffloadedTensor", [5.0, 5.0]), ("OffloadedTensor", [6.0, 6.0])])


def test_dtensor_tp_llama_parallelized_then_wrapped_is_bit_identical_within_each_ranks_budget(ranks):
    # On main: "Attempted to access the data pointer on an invalid python storage" at wrap.
    for rank, r in enumerate(_result(ranks, "llama_tp")):
        assert r["logits_equal"] and r["tokens_equal"], rank
        assert r["same_parameter"] and r["outer_class"] == "DTensor"
        assert r["sharded_offloaded"] > 0 and r["shard_masters"]
        assert r["offloaded_bytes"] == r["master_bytes"] > 0  # stats: this rank's leaf bytes
        assert r["peak"] <= r["budget"]
        assert r["full_tensor_equal"]  # all-gathering an offloaded shard gives the whole weight


def test_wrapping_before_parallelizing_is_refused_with_the_order_to_use(ranks):
    # On main: rank 0 died of SIGSEGV inside c10d.scatter_.
    for r in _result(ranks, "wrap_then_parallelize"):
        assert r["error"] is not None and "parallelize first, then call ot.wrap_model on each rank" in r["error"]
        assert r["dtensors"] == 0  # refused before the first module was parallelized


def test_reference_deepseek_with_a_tp_plan_gives_the_unwrapped_tp_tokens(ranks):
    for rank, r in enumerate(_result(ranks, "deepseek_tp")):
        assert r["tokens_equal"] and r["tied"], rank
        assert r["offloaded_bytes"] >= 0.15 / 1024 * GiB and r["peak"] <= r["budget"]


def test_manual_megatron_tp_stays_bit_identical_with_offload_gb_per_rank(ranks):
    for r in _result(ranks, "manual_tp"):
        assert r["equal"] and r["offloaded_bytes"] >= 32768 and r["peak"] <= r["budget"]


def test_fsdp2_lora_over_an_offloaded_frozen_base_matches_and_sharding_offloaded_weights_is_refused(ranks):
    # On main: fully_shard made every weight a DTensor with a plain local shard (resident over the
    # budget) and ot.stats raised.
    for r in _result(ranks, "fsdp"):
        assert r["losses_equal"] and r["adapters_equal"]
        assert r["base_offloaded"] and r["offloaded_bytes"] == 2 * 64 * 64 * 4 and r["peak"] <= r["budget"]
        assert r["refusal"] is not None and "'l1.base.weight' is offloaded" in r["refusal"]
        assert "ignored_params" in r["refusal"] and r["base_still_offloaded"]


def test_fsdp2_first_then_wrap_offloads_the_ignored_base_bit_identically_and_refuses_what_fsdp2_manages(ranks):
    # On main: the wrap offloaded the weights FSDP2 shards and training went silently wrong (FSDP2
    # all-gathered its own stale copy after each optimizer step).
    fsdp_first_refusals = []
    for rank, r in enumerate(_result(ranks, "fsdp_then_wrap")):
        assert r["losses_equal"] and r["adapters_equal"], rank
        assert r["base_offloaded"] and r["offloaded_bytes"] == 2 * 64 * 64 * 4
        assert r["refusal"] is not None and "'l1.base.weight' is managed by FSDP2" in r["refusal"], r["refusal"]
        assert "Nothing was offloaded" in r["refusal"] and r["offloaded_leaves"] == 0 and not r["wrapped"]
        assert r["refused_model_trains_as_unwrapped"]
        fsdp_first_refusals.append(r["refusal"])
    # the same reason and remedy as fully_shard after wrap_model
    same = "FSDP2 over offloaded weights is not supported: keep them out of it with fully_shard(module, ignored_params="
    for r, refusal in zip(_result(ranks, "fsdp"), fsdp_first_refusals):
        assert same in r["refusal"] and same in refusal


def test_fsdp2_with_peft_lora_over_an_offloaded_ignored_base_matches_the_unwrapped_run_in_either_order(ranks):
    for rank, r in enumerate(_result(ranks, "peft_fsdp")):
        for order in ("wrap_first", "fsdp_first"):
            assert r[order] == (True, True, 4), (rank, order)  # both base layers' weight and bias offloaded


def _exchanged(rank: int, n: int = 5) -> list:
    """What a rank receives from its peer in ``_point_to_point``'s exchanges (the peer's send buffer)."""
    return (torch.arange(n, dtype=torch.float32) + 10.0 * (1 - rank)).tolist()


def test_isend_irecv_and_batch_isend_irecv_with_offloaded_buffers_return_at_once_and_receive_the_peers_values(ranks):
    # On main: an offloaded send buffer made isend wait for the peer's irecv, which the peer posts only
    # after its own isend returned: both ranks blocked until gloo's timeout.
    for rank, r in enumerate(_result(ranks, "point_to_point")):
        for send_off in (False, True):
            for recv_off in (False, True):
                kind = "OffloadedTensor" if recv_off else "Tensor"
                plain = _exchanged(rank)
                assert r[("isend_irecv", send_off, recv_off)] == (kind, plain, plain), (rank, send_off, recv_off)
                assert r[("batch", send_off, recv_off)] == (kind, plain), (rank, send_off, recv_off)
        assert r["view"] == [0.0, 0.0, *_exchanged(rank), 0.0]
        peer = 1 - rank
        assert r["two_each_way"] == [[1.0 + peer] * 3, [2.0 + peer] * 3]


def test_the_seed_at_tp2_fp8_loaded_slice_by_slice_gives_the_unwrapped_tp_tokens_within_each_ranks_budget(ranks):
    for rank, r in enumerate(_result(ranks, "seed")):
        assert r["tokens_equal"] and r["distinct_tokens"] > 1, rank
        assert r["tied"] and r["absorbed"] and r["fp8_offloaded"]
        # host masters: exactly its offloaded bytes (absorption freed kv_b_proj's, so a little under offload_gb)
        assert r["offloaded_bytes"] == r["master_bytes"] > 0.9 * 0.1 / 1024 * GiB
        assert r["peak"] <= r["budget"]
        # each rank read its slices only: a little over half of the file (replicated tensors read whole)
        assert r["read_bytes"] < 0.75 * r["file_bytes"]


def test_the_seed_loader_names_a_checkpoint_tensor_it_cannot_place():
    from offtensor.models import tp_deepseek

    bogus = r"checkpoint tensor 'model\.bogus\.weight' of shape \(4, 2\) matches no parameter"
    with pytest.raises(KeyError, match=bogus):
        tp_deepseek.load_weights(torch.nn.Linear(2, 4), [("model.bogus.weight", torch.zeros(4, 2))])


# ---------------------------------------------------------------------------- FSDP2 in this process (one rank)


def _fsdp2_mlp_upcast(mesh, wrap_first: bool, budget_bytes=None):
    """A bfloat16 MLP under FSDP2 whose unsharded parameters are float32 (MixedPrecisionPolicy), so
    the parameters FSDP2 assigns before each forward are twice the bytes of the ones it wraps;
    wrapped (before or after ``fully_shard``) unless ``budget_bytes`` is None."""
    import offtensor as ot
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)).to(torch.bfloat16)
    if wrap_first and budget_bytes is not None:
        ot.wrap_model(model, budget_gb=budget_bytes / GiB, device="cpu")
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32))
    if not wrap_first and budget_bytes is not None:
        ot.wrap_model(model, budget_gb=budget_bytes / GiB, device="cpu")
    return model


@pytest.mark.parametrize("wrap_first", [True, False], ids=["wrap_first", "fsdp_first"])
def test_fsdp2_assigning_a_parameter_that_placement_would_offload_is_refused_naming_it(one_rank_mesh, wrap_first):
    # On main: the forward's re-assignment of FSDP2's unsharded (float32) '2.weight' did not fit and
    # was offloaded, so the layer computed with a copy FSDP2 never sees; only the reshard after the
    # forward then failed, blaming a fully_shard of an offloaded weight.
    from offtensor.tensor import OffloadedTensor

    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    wrapped_bytes = 2 * (64 * 64 + 64) * 2  # both layers in bfloat16, all resident
    model = _fsdp2_mlp_upcast(one_rank_mesh, wrap_first, budget_bytes=int(1.5 * wrapped_bytes))
    seen = []
    model[2].register_forward_pre_hook(lambda m, args: seen.append(type(m.weight)))
    with pytest.raises(RuntimeError, match=r"'2\.weight' \(Linear\.weight\) is managed by FSDP2 \(fully_shard\)"
                                           r".* \(\d+ bytes, torch\.float32\).*'2\.weight' was left as it was"):
        model(x)
    assert OffloadedTensor not in seen  # no layer ever computed with an offloaded copy
    assert not any(isinstance(leaf, OffloadedTensor) for p in model.parameters()
                   for leaf in (p, getattr(p, "_local_tensor", p)))

    # With room for the unsharded parameters, the wrapped FSDP2 model computes what the unwrapped one does.
    reference = _fsdp2_mlp_upcast(one_rank_mesh, wrap_first)
    roomy = _fsdp2_mlp_upcast(one_rank_mesh, wrap_first, budget_bytes=4 * wrapped_bytes)
    assert torch.equal(roomy(x), reference(x))
