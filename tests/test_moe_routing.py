"""One reader of router outputs: the experts the expert cache expects a layer to page, the experts
the routing recorder records and the experts a router's guess names follow the router's own
selection rule, DeepSeek-V3's ``e_score_correction_bias`` included (sigmoid scores plus the bias,
as transformers' ``DeepseekV3TopkRouter`` selects)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import offtensor as ot
from offtensor.moe import ExpertStacks, RoutingRecorder, routed_experts, select_experts

EXPERTS, HIDDEN, TOP_K = 8, 16, 2
BOOSTED = {5, 6, 7}  # experts whose correction bias outweighs any sigmoid score


class BiasedGate(nn.Module):
    """A router that returns only its logits; its layer selects on sigmoid + correction bias."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(EXPERTS, HIDDEN))
        self.top_k = TOP_K
        bias = torch.zeros(EXPERTS)
        bias[sorted(BOOSTED)] = 10.0
        self.register_buffer("e_score_correction_bias", bias)

    def forward(self, x):
        return F.linear(x, self.weight)


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(EXPERTS, HIDDEN, HIDDEN) / HIDDEN ** 0.5)


class MoE(nn.Module):
    """Selects its experts one by one (integer indexing): nothing announces them, so the expert
    cache learns what the layer pages from its router's output."""

    def __init__(self):
        super().__init__()
        self.gate, self.experts = BiasedGate(), Experts()

    def forward(self, x):
        logits = self.gate(x)
        picked = (logits.sigmoid() + self.gate.e_score_correction_bias).topk(TOP_K, dim=-1).indices
        out = torch.zeros_like(x)
        for row, ids in enumerate(picked.tolist()):
            for e in ids:
                out[row] = out[row] + x[row] @ self.experts.w1[e]
        return out


class Model(nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        self.layers = nn.ModuleList([MoE() for _ in range(layers)])

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_select_experts_follows_the_correction_bias():
    torch.manual_seed(0)
    gate = BiasedGate()
    logits = gate(torch.randn(3, HIDDEN))
    ids = select_experts(logits, TOP_K, gate)
    assert ids.shape == (3, TOP_K) and all(set(row) <= BOOSTED for row in ids.tolist())
    # Without a bias the selection is the logits' top-k; returned ids win over logits.
    plain = nn.Linear(HIDDEN, EXPERTS, bias=False)
    assert torch.equal(select_experts(logits, TOP_K, plain), logits.topk(TOP_K, dim=-1).indices)
    given = torch.tensor([[0, 1], [2, 3], [4, 5]])
    assert torch.equal(routed_experts((logits, given), EXPERTS, TOP_K, gate), given)


def test_expected_experts_and_recorded_routing_follow_the_correction_bias(monkeypatch):
    torch.manual_seed(0)
    model = Model()
    x = torch.randn(1, HIDDEN)
    expert_bytes = HIDDEN * HIDDEN * 4
    ot.wrap_model(model, budget_gb=6 * expert_bytes / 2**30, device="cpu", policy={"offload": ["*.experts.*"]})
    expected = []
    original = ExpertStacks.expect

    def spy(self, stacks, experts):
        expected.append(sorted(int(e) for e in experts))
        return original(self, stacks, experts)

    monkeypatch.setattr(ExpertStacks, "expect", spy)
    recorder = RoutingRecorder(model, 100)
    try:
        model(x)
        recorded = [sorted(layer) for layer in recorder.trace()[0]]
    finally:
        recorder.remove()
    # The speculator tells the expert cache what the router selects, the recorder records it, and
    # both are what the layer really routed to (the boosted experts), not the logits' top-k.
    assert len(expected) == len(model.layers), expected
    assert expected == recorded, (expected, recorded)
    assert all(set(ids) <= BOOSTED for ids in recorded), recorded


# ---------------------------------------------------------------------------- hit rate against slots


def test_hit_curve_rises_with_slots_and_bends_at_the_largest_gain_over_the_average_slot():
    from offtensor.moe import RoutingStats
    from offtensor.sim.hit_curve import hit_curve

    skewed = RoutingStats([[0.3, 0.2, 0.1] + [0.4 / 13] * 13] * 2, [0.4, 0.5], 2)
    curve = hit_curve(skewed, tokens=400)
    assert curve["slots"] == list(range(2, 17))
    for name in ("lru", "belady"):
        assert all(b >= a - 1e-9 for a, b in zip(curve[name], curve[name][1:])), (name, curve[name])
    assert all(b >= a - 1e-9 for a, b in zip(curve["lru"], curve["belady"]))  # the optimum bounds LRU
    # Every expert cached: only each expert's first use misses.
    assert curve["lru"][-1] == curve["belady"][-1] > 0.95
    knee = max(zip(curve["slots"], curve["lru"]), key=lambda p: p[1] - p[0] / 16)[0]
    assert curve["knee_slots"] == knee
    uniform = hit_curve(RoutingStats.uniform(16, 2, 2), tokens=400)
    # Skewed routing with locality reaches a given hit rate with fewer slots than uniform routing.
    assert curve["lru"][4] > uniform["lru"][4] + 0.1, (curve["lru"][4], uniform["lru"][4])


def test_plan_with_routing_prints_the_hit_curve_and_where_it_bends(tmp_path, capsys):
    pytest.importorskip("transformers")
    import os

    from offtensor.__main__ import main

    here = os.path.dirname(os.path.abspath(__file__))
    config = os.path.join(here, "data", "moe_qwen3")
    routing = os.path.join(here, "..", "benchmarks", "results", "moe_routing_qwen3.json")
    if not os.path.exists(os.path.join(config, "config.json")):
        pytest.skip("no trained checkpoint")
    args = ["plan", "--config", config, "--routing", routing, "--prefill-tokens", "8", "--steps", "1",
            "--budget-gb", "0.01", "--png", str(tmp_path / "p.png")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "| slots/layer | cached | hit (LRU) | hit (Belady) | budget |" in out
    assert "(knee)" in out and "the curve bends at " in out


def test_plan_with_expert_pool_plans_the_pool_and_a_pooled_decode_step_reads_no_routing_on_the_host(tmp_path, capsys):
    """``python -m offtensor plan --expert-pool``: the decode phase is served from the pool (no
    host sync on the expert path, no copy stream), so its step is shorter than the expert cache's."""
    pytest.importorskip("transformers")
    import os
    import re

    from offtensor.__main__ import main

    here = os.path.dirname(os.path.abspath(__file__))
    config = os.path.join(here, "data", "moe_qwen3")
    if not os.path.exists(os.path.join(config, "config.json")):
        pytest.skip("no trained checkpoint")
    rows = {}
    for pooled in (False, True):
        args = ["plan", "--config", config, "--prefill-tokens", "8", "--steps", "1", "--budget-gb", "0.01",
                "--png", str(tmp_path / "p.png")] + (["--expert-pool"] if pooled else [])
        assert main(args) == 0
        out = capsys.readouterr().out
        decode = re.split(r"\s*\|\s*", next(line for line in out.splitlines() if line.startswith("| decode |")))
        rows[pooled] = {"ms": float(decode[3]), "copy busy": decode[7], "host ms": float(decode[9])}
    # No routing read on the host and no copy stream: the step waits for neither. (Its host lane is
    # longer than the cache's under the H200's measured eager admit, 649 us per pooled GEMM.)
    assert rows[True]["ms"] < rows[False]["ms"] and rows[True]["copy busy"] == "0%", rows
    assert rows[True]["host ms"] > 0
