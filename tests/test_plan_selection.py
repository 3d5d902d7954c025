"""Plans of MoE layers that choose their experts one by one: the reference DeepSeek's
``for e in selected.unique().tolist(): torch.where(selected == e)`` and transformers' eager experts
(``expert_mask.sum(...).nonzero()``) read their routing on the host, which a meta tensor cannot
answer; inside an MoE block ``ot.plan`` answers those reads from the planned routing
(``sim.selection``), so such a model plans, and decides its expert placement, as a grouped-GEMM
model does."""

from __future__ import annotations

import warnings

import pytest
import torch

import offtensor as ot
from offtensor.models import DeepSeekConfig, DeepSeekForCausalLM
from offtensor.ops import planned

DEEPSEEK = dict(vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, q_lora_rank=0, kv_lora_rank=32,
                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=16, n_shared_experts=1,
                num_experts_per_tok=2, moe_intermediate_size=64, intermediate_size=128, first_k_dense_replace=1)


def _half(model) -> float:
    return 0.5 * sum(p.numel() * p.element_size() for p in model.parameters()) / (1 << 30)


@pytest.mark.parametrize("tokens", [1, 5])
def test_a_plan_of_the_reference_deepseek_pages_the_planned_experts_of_each_layer(tokens):
    with torch.device("meta"):
        model = DeepSeekForCausalLM(DeepSeekConfig(**DEEPSEEK))
    steps, warmup = 2, 1
    tl = ot.plan(model, budget_gb=_half(model), example_inputs=(torch.zeros(1, tokens, dtype=torch.long),),
                 steps=steps, warmup=warmup)
    experts = tl.info["experts"]
    assert experts, "no expert stack was paged"
    # Each layer's planned routing sends its tokens' rows to distinct experts: one page a stack each.
    for name, row in experts.items():
        assert row["hits"] + row["misses"] == (steps + warmup) * min(16, 2 * tokens), name
    assert sum(1 for r in tl.records if r.kind == "sync") >= (steps + warmup) * 3  # a host read per MoE layer
    assert tl.replay().step_ms > 0


def test_transformers_eager_experts_are_planned_from_the_same_routing_as_its_grouped_gemm(monkeypatch):
    """Both experts implementations of one Mixtral draw the same planned routing, layer by layer,
    and page one expert of each stack per routed row: only the order of the pages differs (the
    eager loop pages gate_up and down expert by expert)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                                        num_experts_per_tok=2)
    draw = planned._planned_ends
    draws, lookups = {}, {}
    for implementation in ("eager", "grouped_mm"):
        drawn = draws[implementation] = []
        monkeypatch.setattr(planned, "_planned_ends", lambda e, rows: drawn.append((e, rows, draw(e, rows))) or drawn[-1][2])
        with torch.device("meta"):
            model = transformers.MixtralForCausalLM._from_config(config, experts_implementation=implementation)
        planned._PLANNED_ROUTING.manual_seed(0)  # the same draws for both
        tl = ot.plan(model, budget_gb=_half(model), example_inputs=(torch.zeros(1, 3, dtype=torch.long),))
        lookups[implementation] = {name: row["hits"] + row["misses"] for name, row in tl.info["experts"].items()}
    assert draws["eager"] == draws["grouped_mm"]
    assert len(draws["eager"]) == 6 * 2  # a draw per MoE layer per forward: 3 warm-up and 3 planned
    assert all((e, rows) == (8, 3 * 2) for e, rows, _ in draws["eager"])
    assert lookups["eager"] == lookups["grouped_mm"] == {name: 6 * 3 * 2 for name in lookups["eager"]}


class _Experts(torch.nn.Module):
    def __init__(self, experts: int, width: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(experts, width, width))


class _ListRoutedMoE(torch.nn.Module):
    """An MoE block that reads each token's experts as a Python list (``topk(...).indices.tolist()``)."""

    top_k = 2

    def __init__(self, experts: int = 8, width: int = 16):
        super().__init__()
        self.gate = torch.nn.Linear(width, experts, bias=False)
        self.experts = _Experts(experts, width)

    def forward(self, x):
        out = torch.zeros_like(x)
        for t, row in enumerate(self.gate(x).topk(self.top_k).indices.tolist()):
            for e in row:
                out[t] = out[t] + x[t] @ self.experts.w[e]
        return out


def test_a_layer_that_reads_its_routing_as_a_list_is_planned_token_by_token():
    with torch.device("meta"):
        model = torch.nn.Sequential(_ListRoutedMoE(), _ListRoutedMoE())
    tl = ot.plan(model, budget_gb=_half(model), example_inputs=(torch.zeros(3, 16),), warmup=1, steps=1)
    experts = tl.info["experts"]
    assert set(experts) == {"0.experts.w", "1.experts.w"}
    # Every token's two slots page an expert each: 3 tokens x 2 slots, two forwards.
    assert all(row["hits"] + row["misses"] == 2 * 3 * 2 for row in experts.values())


def test_a_plan_still_refuses_a_read_of_values_outside_an_moe_block():
    class Reads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(8, 8))

        def forward(self, x):
            y = x @ self.weight
            return y[torch.nonzero(y > 0)[:, 0]]

    with torch.device("meta"):
        model = Reads()
    with pytest.raises((NotImplementedError, RuntimeError)):
        ot.plan(model, budget_gb=1.0, example_inputs=(torch.zeros(2, 8),), warmup=0, steps=1)


@torch.no_grad()
def test_the_reference_deepseek_decides_its_expert_placement_from_its_measured_routing(monkeypatch):
    monkeypatch.setenv("OFFTENSOR_ROUTING_WARMUP", "16")
    reference = DeepSeekForCausalLM.empty(DeepSeekConfig(**DEEPSEEK)).init_weights(seed=0).eval()
    model = DeepSeekForCausalLM.empty(DeepSeekConfig(**DEEPSEEK)).init_weights(seed=0).eval()
    ot.wrap_model(model, budget_gb=_half(reference), device="cpu")
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed replay warns
        for _ in range(4):
            assert torch.equal(model(ids), reference(ids))
    report = ot.stats(model).expert_placement
    assert report["chosen"] in ("default", "all_paged") and "default_step_ms" in report, report
