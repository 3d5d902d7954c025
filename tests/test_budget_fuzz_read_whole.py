"""Budgets near the smallest one ``wrap_model`` accepts, on a model's own tensors read whole
(gather, a layer norm's weight and bias, group and RMS norms, bilinear, reductions; attention over
its own key and value): each budget wrap accepts runs forward and backward and gives the unwrapped
model's outputs and gradients bit for bit, or a warning says the slices are summed in another order.
The searches and readers are test_budget_fuzz.py's."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import offtensor as ot

from test_budget_fuzz import _OwnReader, _refused_below_then_budgets, _same, _smallest_accepted

GiB = 1 << 30


# ---------------------------------------------------------------------------- a model's own tensors read whole
# Ops that read their argument whole, on a model's own tensor that placement counts at one slice:
# gather, a layer norm's weight and bias, bilinear, reductions. Each raised BudgetError in forward
# at budgets near the smallest wrap accepted; now they run on slices that fit, bit for bit unless a
# warning says the slices are summed in another order.


def _gather_input(shape, dim):
    def make(device):
        size = list(shape)
        size[dim] = 7
        return torch.randint(0, shape[dim], size, generator=torch.Generator().manual_seed(3)).to(device)
    return make


WHOLE_READERS = {
    # name: (weight shape, bias size or None, forward(module, x), input shape, or a function of the device)
    "gather": ((200, 32), None, lambda m, x: m.w.gather(0, x), _gather_input((200, 32), 0)),
    "gather along columns": ((200, 32), None, lambda m, x: torch.gather(m.w, 1, x), _gather_input((200, 32), 1)),
    "gather of a stack": ((40, 16, 24), None, lambda m, x: m.w.gather(0, x), _gather_input((40, 16, 24), 0)),
    "gather of a narrower index": ((200, 32), None, lambda m, x: m.w.gather(0, x[:, :5]), _gather_input((200, 32), 0)),
    "layer_norm 2-D weight": ((16, 32), None, lambda m, x: F.layer_norm(x, (16, 32), m.w), (3, 16, 32)),
    "layer_norm 2-D weight and bias": ((16, 32), (16, 32), lambda m, x: F.layer_norm(x, (16, 32), m.w, m.b), (3, 16, 32)),
    "layer_norm of a stack": ((4, 8, 16), None, lambda m, x: F.layer_norm(x, (4, 8, 16), m.w, eps=1e-3), (2, 4, 8, 16)),
    "layer_norm 1-D weight and bias": ((64,), 64, lambda m, x: F.layer_norm(x, (64,), m.w, m.b), (2, 5, 64)),
    "group_norm": ((64,), 64, lambda m, x: F.group_norm(x, 4, m.w, m.b), (2, 64, 5)),
    "gather 1-D": ((512,), None, lambda m, x: m.w.gather(0, x), _gather_input((512,), 0)),
    "rms_norm 2-D weight": ((16, 32), None, lambda m, x: F.rms_norm(x, (16, 32), m.w), (3, 16, 32)),
    "bilinear": ((32, 16, 24), 32, lambda m, x: F.bilinear(x[:, :16], x[:, 16:40], m.w, m.b), (5, 40)),
    "sum": ((200, 32), None, lambda m, x: x * m.w.sum(), (3,)),
    "sum of rows": ((200, 32), None, lambda m, x: x * m.w.sum(1).sum(), (3,)),
    "mean over the first dim": ((200, 32), None, lambda m, x: x * m.w.mean(0), (3, 32)),
    "norm": ((200, 32), None, lambda m, x: x * m.w.norm(), (3,)),
    "norm inf of a stack": ((40, 16, 24), None, lambda m, x: x * torch.linalg.vector_norm(m.w, float("inf")), (3,)),
    "max of abs": ((200, 32), None, lambda m, x: x * m.w.abs().max(), (3,)),
    "max and min": ((200, 32), None, lambda m, x: x * (m.w.max() - m.w.min()), (3,)),
    "amax of a stack": ((40, 16, 24), None, lambda m, x: x * m.w.amax((0, 2), keepdim=True), (3, 1, 16, 1)),
    "any and all": ((200, 32), None, lambda m, x: x * ((m.w > 0).any() & (m.w < 9).all()), (3,)),
}


class _WholeReader(_OwnReader):
    def __init__(self, case: str):
        nn.Module.__init__(self)
        shape, bias, self.read, _ = WHOLE_READERS[case]
        self.w = nn.Parameter(torch.randn(*shape) / 8)
        self.b = None if bias is None else nn.Parameter(torch.randn(bias) / 8)


@pytest.mark.parametrize("case", list(WHOLE_READERS))
def test_a_model_tensor_read_whole_by_gather_a_norm_bilinear_or_a_reduction_runs_forward_and_backward_at_every_budget_wrap_accepts(case, device):
    def build():
        torch.manual_seed(0)
        return _WholeReader(case)

    smallest, budgets = _refused_below_then_budgets(build, device)
    shape = WHOLE_READERS[case][3]
    x = shape(device) if callable(shape) else torch.randn(*shape, generator=torch.Generator().manual_seed(2)).to(device)
    for budget in sorted(b for b in budgets if b >= smallest):
        model, reference = build(), build().to(device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ot.wrap_model(model, budget_gb=budget / GiB, device=device, policy={"offload": ["*"]})
            with torch.no_grad():
                out = model(x)
            _same(out, reference(x), not any("last bits" in str(w.message) for w in caught), (case, budget))
            if x.is_floating_point():
                x.requires_grad_()  # the input's gradient too: the backward's other half
            model(x).square().sum().backward()
        exact = not any("last bits" in str(w.message) for w in caught)
        grad = x.grad if x.is_floating_point() else None
        x.grad = None
        reference(x).square().sum().backward()
        for got, want in ((model.w.grad, reference.w.grad), (grad, x.grad),
                          *(((model.b.grad, reference.b.grad),) if model.b is not None else ())):
            _same(got, want, exact, (case, budget))
        x = x.detach()
        s = ot.stats(model)
        assert s.peak_device_bytes <= s.budget_bytes, budget


class _AttendToOwn(nn.Module):
    """Attention over a model's own key and value (learned memory slots, prefix tuning's keys)."""

    def __init__(self, shared: bool):
        super().__init__()
        self.k = nn.Parameter(torch.randn(2, 32, 16) / 4)
        self.v = self.k if shared else nn.Parameter(torch.randn(2, 32, 16) / 4)

    def forward(self, q):
        return F.scaled_dot_product_attention(q, self.k, self.v)


@pytest.mark.parametrize("shared", [True, False])
def test_attention_over_a_model_tensor_larger_than_the_room_is_refused_naming_the_budget_that_runs_it(shared, device):
    # Placement counts a model's own 3-D tensor at a slice of one matrix, but attention's math path
    # reads one matrix of its key at least (k.transpose(-2, -1) * scale): the forward raised a
    # paging error naming no budget that would run it. Now the op names the tensor, its bytes and
    # that budget, and runs there bit for bit.
    def build():
        torch.manual_seed(0)
        return _AttendToOwn(shared)

    smallest = _smallest_accepted(build, 10**7, device)
    q = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(2)).to(device)
    model = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ot.wrap_model(model, budget_gb=smallest / GiB, device=device, policy={"offload": ["*"]})
    roles = "key and value" if shared else "key"
    with pytest.raises(ot.BudgetError, match=rf"'k'.* \(4096 bytes\) as its {roles}, .* one matrix of it \(2048 bytes\) fits, from a budget of (\d+) bytes") as refused:
        with torch.no_grad():
            model(q)
    runs = int(re.search(r"from a budget of (\d+) bytes", str(refused.value)).group(1))
    for budget in (runs, runs + 700, 4 * runs):
        model, reference = build(), build().to(device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ot.wrap_model(model, budget_gb=budget / GiB, device=device, policy={"offload": ["*"]})
            with torch.no_grad():
                out = model(q)
        _same(out, reference(q), not any("last bits" in str(w.message) for w in caught), budget)
        s = ot.stats(model)
        assert s.peak_device_bytes <= s.budget_bytes, budget
