"""``wrap_model``'s budget and placement: device bytes never exceed the budget across forwards, what
does not fit is paged again, a model that fits pages nothing, an impossible budget is refused naming
the tensor and bytes, ``offload_gb``; the default placement order (an embedding table read by rows
before dense weights, a tied one not) and policies by pattern, list and callable. The tiny model and
its helpers are test_wrap.py's."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

import offtensor as ot
from offtensor.pager import resolve_device
from offtensor.model.copies import state_of

from test_wrap import EXPERTS, HIDDEN, INTER, _budget_gb, _ids, _model, _offloaded_names, _run, _tensors_by_name, _weight_bytes, pair

GiB = 1 << 30


# ---------------------------------------------------------------------------- budget


def test_device_bytes_never_exceed_the_budget_across_forwards(pair, device):
    model, reference = pair
    budget = ot.stats(model).budget_bytes
    for seed in range(4):
        ids = _ids(device, seed)
        assert torch.equal(_run(model, ids), _run(reference, ids))
        s = ot.stats(model)
        assert s.peak_device_bytes <= budget
        assert s.resident_bytes + s.cached_bytes <= budget
    assert ot.stats(model).bytes_h2d > 0


def test_second_forward_pages_again_what_the_budget_cannot_hold(pair, device):
    model, _ = pair
    ids = _ids(device)
    _run(model, ids)
    first = ot.stats(model).bytes_h2d
    _run(model, ids)
    assert ot.stats(model).bytes_h2d > first


def test_a_model_that_fits_has_no_offloaded_tensors_and_pages_nothing(device):
    model = _model()
    reference = copy.deepcopy(model).to(device)
    ot.wrap_model(model, budget_gb=_budget_gb(model, 1.5), device=device)
    assert not any(isinstance(t, ot.OffloadedTensor) for t in _tensors_by_name(model).values())
    ids = _ids(device)
    assert torch.equal(_run(model, ids), _run(reference, ids))
    s = ot.stats(model)
    assert s.bytes_h2d == 0 and s.page_ins == 0 and s.offloaded_bytes == 0
    assert s.resident_bytes == _weight_bytes(model)


def test_impossible_budget_raises_budget_error_naming_the_tensor_and_bytes(device):
    model = _model()
    before = _tensors_by_name(model)
    with pytest.raises(ot.BudgetError) as info:
        ot.wrap_model(model, budget_gb=1000 / GiB, device=device)
    message = str(info.value)
    # The most one op must page: one expert of the larger stack of the experts module (ops page
    # routed experts one at a time, and gate_up and down in separate ops).
    assert "budget of 1.00 kB (1000 bytes)" in message
    assert "paging 'layers.0.moe.experts.gate_up_proj' (one op of module 'layers.0.moe.experts'" in message
    assert "needs 262.14 kB (262144 bytes)" in message
    assert EXPERTS * 2 * INTER * HIDDEN * 4 == 1048576
    # Nothing was moved, and the model can still be wrapped with a real budget.
    assert all(_tensors_by_name(model)[n] is t and not isinstance(t, ot.OffloadedTensor) for n, t in before.items())
    ot.wrap_model(model, budget_gb=_budget_gb(model, 0.4), device=device)


def test_placement_leaves_room_for_a_linear_weight_and_its_bias_paged_together(device):
    # F.linear pages weight and bias in one op: the room placement leaves must hold both, so the
    # smallest budget placement accepts also runs.
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    reference = copy.deepcopy(model).to(device)
    budget = 300  # bytes: everything offloaded; one weight (256) + its bias (32) must fit at once
    ot.wrap_model(model, budget_gb=budget / GiB, device=device)
    x = torch.randn(2, 8, device=device)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    assert ot.stats(model).peak_device_bytes <= budget
    # Below that, linear computes in output tiles: a row of the weight (32) and its bias slice.
    # Tiles 2 outputs wide make BLAS pick a matrix-vector kernel: equal up to rounding.
    tiled = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    tiled.load_state_dict(reference.state_dict())
    with pytest.warns(UserWarning, match="narrower than 16 slices"):
        ot.wrap_model(tiled, budget_gb=100 / GiB, device=device)
    with torch.no_grad():
        torch.testing.assert_close(tiled(x), reference(x), rtol=1e-5, atol=1e-6)
    assert ot.stats(tiled).peak_device_bytes <= 100
    with pytest.raises(ot.BudgetError, match="64 bytes"):
        ot.wrap_model(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), budget_gb=60 / GiB, device=device)


def test_offload_gb_offloads_at_least_that_many_bytes(device):
    model = _model()
    reference = copy.deepcopy(model).to(device)
    want = 0.5 * _weight_bytes(model)
    ot.wrap_model(model, offload_gb=want / GiB, device=device)
    s = ot.stats(model)
    assert s.offloaded_bytes >= want
    assert s.resident_bytes + s.offloaded_bytes == _weight_bytes(model)
    ids = _ids(device)
    assert torch.equal(_run(model, ids), _run(reference, ids))
    assert ot.stats(model).peak_device_bytes <= s.budget_bytes


def test_offloaded_weights_carry_their_names_into_reprs_and_budget_errors(device):
    model = _model()
    ot.wrap_model(model, budget_gb=_budget_gb(model, 0.3), device=device)
    name, weight = next((n, p) for n, p in model.named_parameters() if isinstance(p, ot.OffloadedTensor))
    assert repr(name) in repr(weight) and repr(name) in repr(weight.t())  # a view names its weight
    copy_of = copy.deepcopy(model)
    assert repr(name) in repr(dict(copy_of.named_parameters())[name])
    want = _run(model, _ids(device))
    state_of(model).pager.budget_bytes = 1  # a budget shrunk under the model: paging must fail
    with pytest.raises(ot.BudgetError, match=re.escape(repr(name))):
        torch.nn.functional.rrelu(weight, training=True)  # (random: not run on the host instead)
    # The forward's ops run on the host masters where nothing fits: the same logits on the emulated device.
    got = _run(model, _ids(device))
    assert torch.equal(got, want) if device == "cpu" else torch.allclose(got, want, atol=1e-4)


def test_budget_gb_and_offload_gb_together_raise(device):
    with pytest.raises(ValueError, match="budget_gb.*offload_gb|offload_gb.*budget_gb"):
        ot.wrap_model(_model(), budget_gb=1, offload_gb=1, device=device)


# ---------------------------------------------------------------------------- placement order and policy


def _class_bytes(model) -> dict:
    classes = {"experts": 0, "mlp": 0, "attn": 0}
    for name, p in model.named_parameters():
        for key, part in (("experts", ".experts."), ("mlp", ".mlp."), ("attn", ".self_attn.")):
            if part in name:
                classes[key] += p.numel() * p.element_size()
    return classes


@pytest.mark.parametrize("offloaded", [("experts",), ("experts", "mlp"), ("experts", "mlp", "attn")])
def test_default_order_offloads_experts_then_dense_mlp_then_attention_then_the_rest(device, offloaded):
    model = _model()
    sizes = _class_bytes(model)
    ot.wrap_model(model, offload_gb=sum(sizes[c] for c in offloaded) / GiB, device=device)
    names = _offloaded_names(model)
    for name, _ in model.named_parameters():
        cls = next((c for c, part in (("experts", ".experts."), ("mlp", ".mlp."), ("attn", ".self_attn.")) if part in name), None)
        assert (name in names) == (cls in offloaded), name


@pytest.mark.parametrize("tie", [False, True])
def test_an_embedding_table_read_only_by_rows_is_offloaded_before_dense_weights(device, tie):
    model = _model(tie=tie)
    reference = copy.deepcopy(model).to(device)
    sizes = _class_bytes(model)
    table = model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    ot.wrap_model(model, offload_gb=(sizes["experts"] + table) / GiB, device=device)
    names = _offloaded_names(model)
    experts = {n for n, _ in model.named_parameters() if ".experts." in n}
    if tie:
        # Tied to the LM head, the table is read whole every token: dense MLP weights go instead.
        assert "embed_tokens.weight" not in names and experts < names
        assert names - experts <= {n for n, _ in model.named_parameters() if ".mlp." in n}
        return
    assert names == experts | {"embed_tokens.weight"}  # the LM head and every dense weight stay resident
    ids = _ids(device)
    _run(model, ids)  # warm: the routed experts of these ids are cached now
    ot.reset_stats(model)
    assert torch.equal(_run(model, ids), _run(reference, ids))
    s = ot.stats(model)
    rows = ids.unique().numel() * HIDDEN * model.embed_tokens.weight.element_size()
    # A forward pages the looked-up rows of the table, never the table.
    table_bytes = s.bytes_h2d - sum(stack["bytes_h2d"] for stack in s.experts.values())
    assert 0 < table_bytes <= rows < table, (table_bytes, rows)


def test_policy_dict_offloads_and_keeps_by_pattern(device):
    model = _model()
    reference = copy.deepcopy(model).to(device)
    ot.wrap_model(model, budget_gb=_budget_gb(model, 0.6), device=device,
                  policy={"offload": ["*.experts.*"], "keep": ["*embed_tokens*"]})
    names = _offloaded_names(model)
    assert {n for n, _ in model.named_parameters() if ".experts." in n} <= names
    assert "embed_tokens.weight" not in names and model.embed_tokens.weight.device == resolve_device(device)
    ids = _ids(device)
    assert torch.equal(_run(model, ids), _run(reference, ids))


def test_policy_list_offloads_matching_weights_even_when_the_budget_would_hold_them(device):
    model = _model()
    ot.wrap_model(model, budget_gb=_budget_gb(model, 2.0), device=device, policy=["*.self_attn.*"])
    assert _offloaded_names(model) == {n for n, _ in model.named_parameters() if ".self_attn." in n}


def test_policy_callable_decides_per_name(device):
    model = _model()
    reference = copy.deepcopy(model).to(device)
    ot.wrap_model(model, budget_gb=_budget_gb(model, 2.0), device=device,
                  policy=lambda name: "offload" if name.endswith("o_proj.weight") else None)
    assert _offloaded_names(model) == {f"layers.{i}.self_attn.o_proj.weight" for i in range(2)}
    ids = _ids(device)
    assert torch.equal(_run(model, ids), _run(reference, ids))


def test_policy_keep_that_cannot_fit_raises_budget_error(device):
    model = _model()
    with pytest.raises(ot.BudgetError, match=r"the policy keeps 4\.60 MB \(4596736 bytes\) resident"):
        ot.wrap_model(model, budget_gb=_budget_gb(model, 0.3), device=device, policy={"keep": ["*"]})


def test_bad_policy_answer_raises(device):
    with pytest.raises(ValueError, match="policy"):
        ot.wrap_model(_model(), budget_gb=1, device=device, policy=lambda name: "maybe")
    with pytest.raises(ValueError, match="policy"):
        ot.wrap_model(_model(), budget_gb=1, device=device, policy={"evict": ["*"]})


class _WithTable(nn.Module):
    """Two linear layers and a plain tensor attribute of 512 KiB computed at init (as diffusers'
    QwenImage keeps its rope frequencies), read whole by forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(256, 256), nn.Linear(256, 256)
        self.table = torch.randn(512, 256)

    def forward(self, x):
        return self.b(self.a(x)) + self.table.sum(0)


def test_a_plain_tensor_attribute_present_at_wrap_is_counted_placed_and_given_back_at_unwrap(device):
    # Only attributes assigned after wrapping were placed: one set at init stayed resident beside a
    # placement that had not counted it, and a forward at a budget wrap accepted went past it.
    model, reference = _WithTable(), _WithTable().to(device)
    model.table, reference.table = model.table.to(device), reference.table.to(device)
    budget = 600 * 1024  # the table and the paging room of one linear, not the table and a linear too
    ot.wrap_model(model, budget_gb=budget / GiB, device=device)
    x = torch.randn(4, 256, device=device)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    assert ot.stats(model).peak_device_bytes <= budget
    ot.unwrap_model(model)
    assert type(model.table) is torch.Tensor and torch.equal(model.table, reference.table)

    # Read whole by forward, it needs room for all of it: a budget without that is refused at wrap.
    with pytest.raises(ot.BudgetError, match=r"'table'.*524288 bytes"):
        ot.wrap_model(_WithTable().to(device), budget_gb=400 * 1024 / GiB, device=device)


def test_an_attribute_offloaded_after_wrapping_is_given_back_plain_at_unwrap(device):
    model = _WithTable().to(device)
    del model.table
    ot.wrap_model(model, budget_gb=300 * 1024 / GiB, device=device)
    model.a.extra = torch.randn(512, 256, device=device)  # does not fit beside the room: offloaded in place
    assert isinstance(model.a.extra, ot.OffloadedTensor)
    values = model.a.extra.materialize().cpu()
    ot.unwrap_model(model)
    assert type(model.a.extra) is torch.Tensor and torch.equal(model.a.extra.cpu(), values)
