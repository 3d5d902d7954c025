"""Cold experts computed where they live: ``expert_compute="host"`` computes a routed expert that is
not cached from its host master (no weight byte copied, activations to the host and back), "auto"
chooses per layer and step shape by replay, both with the unwrapped model's logits."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import offtensor as ot
from offtensor.model.copies import state_of
from offtensor.sim import host_compute
from offtensor.sim.profiles import PROFILES

from test_moe import _budget_gb, _build, _Decoder

DECODE_STEPS = 6
MODELS = ["reference", "qwen3_moe", "mixtral"]


def _run(name, device, **wrap):
    """(per-step logits, decode bytes copied, stats) of ``name`` wrapped at 25% of its experts cached."""
    model, reference, ids = _build(name, device)
    ot.wrap_model(model, budget_gb=_budget_gb(model, 0.25), device=device, **wrap)
    run = _Decoder(model, reference, ids)
    logits = [run.step()]
    before = ot.stats(model).bytes_h2d
    logits += [run.step() for _ in range(DECODE_STEPS)]
    return logits, ot.stats(model).bytes_h2d - before, ot.stats(model)


def _reference(name, device):
    model, reference, ids = _build(name, device)
    run = _Decoder(model, reference, ids)
    return [run.step() for _ in range(1 + DECODE_STEPS)]


@pytest.mark.parametrize("name", MODELS)
def test_host_compute_copies_at_most_5_percent_of_the_default_decode_bytes_with_identical_logits(name, device):
    expected = _reference(name, device)
    default_logits, default_bytes, _ = _run(name, device)
    host_logits, host_bytes, stats = _run(name, device, expert_compute="host")
    for want, got_default, got_host in zip(expected, default_logits, host_logits):
        assert torch.equal(got_default, want)
        _assert_host_computed(got_host, want, device)
    assert default_bytes > 0
    assert host_bytes <= 0.05 * default_bytes, (host_bytes, default_bytes)
    assert stats.host_experts > 0 and stats.host_activation_bytes > 0


def _assert_host_computed(got, want, device):
    """Logits with some experts computed on the host against the device's own. The emulated device
    runs the same kernels on the same values, so they are bit-identical; a GPU's host experts run
    the CPU's kernels, which round differently in the last bits (a documented limit), so there they
    agree within float tolerance."""
    if torch.device(device).type == "cpu":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want)


def _profile(host_wins: bool):
    """The H200 profile with host figures that make the host (or the device) the faster side."""
    base = PROFILES["h200"]
    if host_wins:
        return base.with_host({"float32": 1e3, "bfloat16": 1e3}, 1e6)
    return base.with_host({"float32": 1e-6, "bfloat16": 1e-6}, 1e-3)


@pytest.mark.parametrize("host_wins", [True, False])
def test_auto_chooses_the_side_the_profiles_make_faster(host_wins):
    stacks = [("layers.1.mlp.experts.gate_up_proj", (16, 128, 64), torch.float32),
              ("layers.1.mlp.experts.down_proj", (16, 64, 64), torch.float32)]
    profile = _profile(host_wins)
    table = dict(host_compute.choose_expert_compute(stacks, profile, 4, 0.25)["layers.1.mlp.experts"])
    replays = host_compute.choose_layer(host_compute.layer_shapes(stacks)[0], profile, 4, 0.25)
    # The op's table says, for each step shape, the side whose replay is the shorter one...
    for c in replays:
        if c.rows_per_expert in table:
            assert table[c.rows_per_expert] == (c.host_ms < c.device_ms)
    # ...which for a one-token decode is the host exactly where its figures make it faster (a long
    # prefill sends back more activation bytes than its experts weigh: the device wins there).
    assert table[1.0] == host_wins
    if not host_wins:
        assert not any(table.values())


def test_auto_takes_the_host_for_a_decode_and_the_device_for_a_prefill_where_the_profile_says_so():
    # A host that streams weights fast but computes slowly: one row per expert is cheaper there,
    # hundreds of rows are cheaper copied. The experts are 16 MB, so that copying one (0.3 ms on
    # the H200) weighs more than offtensor's own host time per copy, which both sides pay.
    stacks = [("m.experts.w", (16, 2048, 2048), torch.float32)]
    profile = PROFILES["h200"].with_host({"float32": 0.05}, 500.0)
    decode, prefill = host_compute.choose_layer(host_compute.layer_shapes(stacks)[0], profile, 2, 0.25, (1, 4096))
    assert decode.on_host and not prefill.on_host


@pytest.mark.parametrize("host_wins", [True, False])
@pytest.mark.parametrize("name", ["reference", "qwen3_moe"])
def test_auto_gives_identical_logits_and_computes_where_the_profile_says(name, host_wins, device, monkeypatch):
    expected = _reference(name, device)
    monkeypatch.setenv("OFFTENSOR_PLACEMENT_PROFILE", "h200")
    monkeypatch.setattr(host_compute, "with_host_figures", lambda profile: _profile(host_wins))
    logits, moved, stats = _run(name, device, expert_compute="auto")
    for want, got in zip(expected, logits):
        _assert_host_computed(got, want, device)
    assert (stats.host_experts > 0) == host_wins


def test_unknown_expert_compute_is_refused_naming_the_choices(device):
    model, _, _ = _build("reference", device)
    with pytest.raises(ValueError, match="expert_compute must be one of 'device', 'host', 'auto'"):
        ot.wrap_model(model, budget_gb=1.0, device=device, expert_compute="gpu")


def test_host_computed_experts_are_recorded_on_the_host_lane_and_replayed(device):
    model, reference, ids = _build("qwen3_moe", device)
    ot.wrap_model(model, budget_gb=_budget_gb(model, 0.25), device=device, expert_compute="host")
    run = _Decoder(model, reference, ids)
    run.step()
    with ot.timeline(model) as tl:
        run.step()
    host_ops = [r for r in tl.records if r.stream == "host" and r.kind == "op"]
    assert host_ops and all(r.flops > 0 for r in host_ops)
    profile = _profile(True)
    replay = tl.replay(profile)
    assert all(replay.ends[r.id] > replay.starts[r.id] for r in host_ops)
