"""The seed's scenario at TP=2 (issue 18, item 8), two gloo ranks on the emulated device:
``benchmarks/seed_tp.py``'s run, small. Each rank builds its part of the vLLM-style DeepSeek (MLA
absorption, routed and shared experts, tied embeddings, attention and expert weights FP8 with block
scales), wraps it with its own ``offload_gb``, loads the sharded checkpoint through the weight
loaders reading only its rows, post-processes, and decodes the tokens its unwrapped part decodes."""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

import offtensor as ot
from offtensor.models import vllm_deepseek as vd

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import seed_tp  # noqa: E402

GiB = 1 << 30


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
def test_seed_at_tp2_fp8_tied_offloaded_per_rank_gives_the_unwrapped_tokens_reading_only_its_shard():
    result = seed_tp.run(world=2, tokens=4, offload_fraction=0.5)
    ranks = result["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["tokens_equal"], r
        assert r["peak_device_bytes"] <= r["budget_bytes"], r
        # vLLM's cpu_offload_gb is per GPU: each rank offloads at least what it asked, of its own part.
        assert r["offload_bytes_asked"] <= r["offloaded_bytes"] < r["rank_weight_bytes"], r
        assert "torch.float8_e4m3fn" in r["fp8_offloaded"], r
        # Loading writes host masters and device weights in place: nothing is paged to load.
        assert r["paged_while_loading"] == 0, r
        # Each rank read exactly its own part of the file (its split rows plus the replicated ones).
        assert r["checkpoint_bytes_read"] == r["rank_weight_bytes"] < result["checkpoint_bytes"], r
        assert r["bytes_h2d"] > 0
    assert ranks[0]["tokens"] == ranks[1]["tokens"]  # tensor parallelism: every rank decodes the same tokens


def test_fp8_block_tied_model_in_one_process_wrapped_before_loading_gives_unwrapped_tokens(tmp_path, device):
    """The same model at TP=1: FP8 weights stay float8 OffloadedTensors, the tie holds through
    wrap and load (one Parameter, loaded once), and lazily read loads equal eager ones."""
    config = seed_tp.seed_config()
    par = vd.Parallel(fp8_block=seed_tp.BLOCK)
    vd.write_sharded_checkpoint(vd.random_checkpoint(config, seed=0, fp8_block=seed_tp.BLOCK), tmp_path, 64 << 10)
    ids = torch.randint(0, config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(2)).to(device)
    with torch.device(device):
        reference = vd.DeepseekForCausalLM(config, par)
    reference.load_weights(vd.iterate_checkpoint(str(tmp_path)))
    reference.process_weights_after_loading()
    expected = reference.generate(ids, max_new_tokens=5)

    model = vd.DeepseekForCausalLM(config, par)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ot.wrap_model(model, budget_gb=0.4 * seed_tp.rank_bytes(model) / GiB, device=device)
    log = {}
    model.load_weights(vd.iterate_checkpoint(str(tmp_path), lazy=True, log=log))
    assert log["bytes"] == seed_tp.rank_bytes(model)
    model.process_weights_after_loading()
    assert torch.equal(model.generate(ids, max_new_tokens=5), expected)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    fp8 = [n for n, p in model.named_parameters() if isinstance(p, ot.OffloadedTensor) and p.dtype == vd.FP8]
    assert any("experts.w13_weight" in n for n in fp8), fp8
    s = ot.stats(model)
    assert s.peak_device_bytes <= s.budget_bytes


def test_a_split_that_is_not_even_names_what_and_the_sizes():
    config = dataclasses.replace(seed_tp.seed_config(), num_heads=3)
    with pytest.raises(ValueError, match=r"attention heads: 3 does not split evenly over tensor_parallel_size=2"):
        vd.DeepseekForCausalLM(config, vd.Parallel(rank=0, size=2))
    with pytest.raises(ValueError, match=r"FP8 weight \[.*\] does not tile into 7-blocks"):
        vd.DeepseekForCausalLM(seed_tp.seed_config(), vd.Parallel(fp8_block=7))
