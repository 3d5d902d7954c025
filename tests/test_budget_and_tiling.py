"""Any model, any budget (issue 10): working sets as ops really need them, ops over lists paged in
pieces, bit-identical linear for every input layout, identity of RNN and attention weights."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import offtensor as ot
from offtensor.pager import BudgetError, Pager
from offtensor.tensor import _wrap_host, new_host_master

GiB = 1 << 30


def _offload_under(pager, t):
    return _wrap_host(new_host_master(t, pin=False), pager)


def _weight_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in [*model.parameters(), *model.buffers()]}.values())


# ---------------------------------------------------------------------------- 3. bit-identical linear


@pytest.mark.parametrize("shape", [(256, 64, 4, 7), (512, 128, 3, 9)])
def test_linear_with_a_non_contiguous_3d_input_matches_a_weight_that_requires_grad(device, shape):
    # aten::matmul folds a non-contiguous 3-D input into one mm when the weight requires grad and
    # runs bmm otherwise, even under no_grad: the paged copy must require grad like the weight.
    k, n, b, s = shape
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(n, k, device=device))
    bias = nn.Parameter(torch.randn(n, device=device))
    x = torch.randn(s, b, k, device=device).transpose(0, 1)
    assert not x.is_contiguous() and x.dim() == 3
    offloaded_weight = nn.Parameter(ot.offload(weight.detach().cpu(), device=device))
    offloaded_bias = nn.Parameter(ot.offload(bias.detach().cpu(), device=device))
    with torch.no_grad():
        expected = F.linear(x, weight, bias)
        assert torch.equal(F.linear(x, offloaded_weight, offloaded_bias), expected)
        assert torch.equal(F.linear(x, offloaded_weight, bias), expected)
    assert offloaded_weight.requires_grad


# ---------------------------------------------------------------------------- 1. working sets, lists in pieces


def test_cat_of_two_offloaded_weights_larger_than_the_free_room_pages_one_at_a_time(device):
    # mobilebert: torch.cat([decoder.weight.t(), dense.weight]) with room for one weight only.
    pager = Pager(torch.device(device), 2048)  # holds b (1536 bytes), not a and b (2560)
    a, b = torch.randn(16, 16), torch.randn(24, 16)
    oa, ob = _offload_under(pager, a), _offload_under(pager, b)
    assert torch.equal(torch.cat([oa.t(), ob.t()], 1), torch.cat([a.t(), b.t()], 1).to(device))
    assert torch.equal(torch.cat([ob, oa]), torch.cat([b, a]).to(device))
    assert torch.equal(torch.stack([oa, ob[:16]], dim=1), torch.stack([a, b[:16]], dim=1).to(device))
    assert pager.stats.peak_device_bytes <= 2048


def test_foreach_op_over_offloaded_tensors_larger_than_the_free_room_runs_per_element(device):
    pager = Pager(torch.device(device), 1500)
    a, b = torch.randn(16, 16), torch.randn(16, 16)
    oa, ob = _offload_under(pager, a), _offload_under(pager, b)
    for got, want in zip(torch._foreach_mul([oa, ob], 2.0), [a * 2, b * 2]):
        assert torch.equal(got, want.to(device))
    torch._foreach_add_([oa, ob], [torch.ones(16, 16, device=device)] * 2)
    assert torch.equal(oa.cpu(), a + 1) and torch.equal(ob.cpu(), b + 1)
    assert pager.stats.peak_device_bytes <= 1500


def test_an_op_that_needs_more_than_the_budget_at_once_still_raises_budget_error(device):
    pager = Pager(torch.device(device), 1500)
    a, b = torch.randn(16, 16), torch.randn(16, 16)
    with pytest.raises(BudgetError, match="needs 1024 bytes"):
        _offload_under(pager, a) + _offload_under(pager, b)


class _CatHead(nn.Module):
    """mobilebert's prediction head: one op reads two weights of two modules."""

    def __init__(self):
        super().__init__()
        self.decoder = nn.Linear(64, 128, bias=False)
        self.dense = nn.Linear(128, 64, bias=False)
        self.small = nn.ModuleList(nn.Linear(8, 8) for _ in range(30))

    def forward(self, x):
        w = torch.cat([self.decoder.weight.t(), self.dense.weight], dim=0)
        for m in self.small:
            x = x + m(x[..., :8]).sum()
        return x @ w.t()


def test_a_model_whose_op_concatenates_two_offloaded_weights_runs_within_the_budget(device):
    torch.manual_seed(0)
    model = _CatHead().eval()
    x = torch.randn(3, 128)
    expected = model(x)
    model.to(device)
    ot.wrap_model(model, budget_gb=0.6 * _weight_bytes(model) / GiB, device=device, prefetch=False)
    assert isinstance(model.decoder.weight, ot.OffloadedTensor) and isinstance(model.dense.weight, ot.OffloadedTensor)
    with torch.no_grad():
        assert torch.equal(model(x.to(device)).cpu(), expected.detach())
    s = ot.stats(model)
    assert s.peak_device_bytes <= s.budget_bytes


def test_every_tensor_of_one_module_counts_in_one_working_set():
    from offtensor.placement import Weight, plan

    def weight(name, nbytes):
        return Weight([name], nbytes, (nbytes // 4, 1), nbytes)

    lstm = [weight(f"rnn.{n}", 100_000) for n in ("weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0")]
    p = plan(lstm + [weight("other.weight", 150_000)], budget_bytes=10**7, offload_bytes=10**6, prefetch=False)
    assert p.working_set_bytes == 400_000  # the cuDNN LSTM op reads all four at once


def test_stacked_experts_count_as_the_experts_one_op_pages_at_once():
    from offtensor.placement import Weight, plan, working_set

    shape = (64, 32, 16)
    nbytes = 64 * 32 * 16 * 4
    assert working_set("model.layers.0.mlp.experts.down_proj", shape, nbytes) == nbytes // 64
    experts = [Weight([f"l.experts.{n}"], nbytes, shape, nbytes // 64) for n in ("gate_up_proj", "down_proj")]
    p = plan(experts, budget_bytes=nbytes // 8, prefetch=False)
    # gate_up and down of one expert (two slices), not 8 routed experts of each stack
    assert p.working_set_bytes == 2 * nbytes // 64


# ---------------------------------------------------------------------------- 4. identity for every module


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn", "mha"])
def test_rnn_and_attention_modules_keep_their_parameter_objects_through_wrap_and_unwrap(device, kind):
    torch.manual_seed(0)
    if kind == "mha":
        module = nn.MultiheadAttention(32, 4)
        x = (torch.randn(5, 2, 32),) * 3
    else:
        module = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}[kind](16, 32, num_layers=2)
        x = (torch.randn(5, 2, 16),)
    module.eval()
    objects = dict(module.named_parameters())
    expected = module(*x)[0].detach()
    reference = copy.deepcopy(module).to(device)
    ot.wrap_model(module, offload_gb=1, device=device)  # every weight offloaded
    assert all(isinstance(p, ot.OffloadedTensor) for p in module.parameters())
    assert all(p is objects[n] for n, p in module.named_parameters())
    with torch.no_grad():
        got = module(*(t.to(device) for t in x))[0]
        assert torch.equal(got, reference(*(t.to(device) for t in x))[0])
    torch.testing.assert_close(got.cpu(), expected)
    assert ot.stats(module).peak_device_bytes <= ot.stats(module).budget_bytes
    ot.unwrap_model(module)
    assert all(p is objects[n] for n, p in module.named_parameters())
    assert not any(isinstance(p, ot.OffloadedTensor) for p in module.parameters())
    if kind != "mha":
        assert all(w is objects[n] for w, n in zip(module._flat_weights, module._flat_weights_names))
