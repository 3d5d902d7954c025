"""Norms of a reduced-precision input (bfloat16, float16) with a float32 weight and bias larger than
the budget's room (a model keeping its norms in float32, as transformers' ``_keep_in_fp32_modules``
does, under bfloat16 activations). torch's mixed-dtype layer norm computes in float and rounds once:
the slices must do the same. Every budget from the smallest wrap accepts runs, forward and
backward, and gives the unwrapped model's outputs and gradients bit for bit, or a warning says they
may differ in the last bits (a group norm's weight applied after its normalisation, a layer norm's
input gradient)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import offtensor as ot
from test_budget_fuzz import _smallest_accepted

GiB = 1 << 30

READERS = {
    # name: (weight shape, bias shape or None, forward(module, x), input shape)
    "layer_norm 1-D weight and bias": ((64,), (64,), lambda m, x: F.layer_norm(x, (64,), m.w, m.b), (2, 5, 64)),
    "layer_norm 2-D weight": ((16, 32), None, lambda m, x: F.layer_norm(x, (16, 32), m.w), (3, 16, 32)),
    "layer_norm 2-D weight and bias": ((16, 32), (16, 32), lambda m, x: F.layer_norm(x, (16, 32), m.w, m.b), (3, 16, 32)),
    "layer_norm 2-D bias alone": ((16, 32), None, lambda m, x: F.layer_norm(x, (16, 32), None, m.w), (3, 16, 32)),
    "layer_norm of a stack": ((4, 8, 16), None, lambda m, x: F.layer_norm(x, (4, 8, 16), m.w, eps=1e-3), (2, 4, 8, 16)),
    "group_norm": ((64,), (64,), lambda m, x: F.group_norm(x, 4, m.w, m.b), (2, 64, 5)),
    "rms_norm 2-D weight": ((16, 32), None, lambda m, x: F.rms_norm(x, (16, 32), m.w), (3, 16, 32)),
}


class _Norm(nn.Module):
    """A model's own module holding a float32 weight (and bias) that its forward reads by a norm."""

    def __init__(self, case: str):
        super().__init__()
        shape, bias, self.read, _ = READERS[case]
        self.w = nn.Parameter(torch.randn(*shape) / 8 + 1)
        self.b = None if bias is None else nn.Parameter(torch.randn(*bias) / 8)

    def forward(self, x):
        return self.read(self, x)


def _raised(call):
    try:
        call()
    except RuntimeError as e:
        return type(e), str(e)
    return None


def _same(got, want, exact: bool, what):
    if exact:
        assert torch.equal(got, want), what
    else:
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(READERS))
def test_a_norm_of_a_half_precision_input_with_a_float_weight_runs_at_every_budget_wrap_accepts(case, dtype, device):
    def build():
        torch.manual_seed(0)
        return _Norm(case)

    smallest = _smallest_accepted(build, 10**7, device)
    whole = sum(p.numel() * 4 for p in build().parameters())
    shape = READERS[case][3]
    for budget in sorted({smallest, smallest + 700, 3 * smallest, whole // 3, whole // 2 + 4096, whole}):
        if budget < smallest:
            continue
        model, reference = build(), build().to(device)
        x = (torch.randn(*shape, generator=torch.Generator().manual_seed(2)) * 3 + 1).to(device, dtype)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ot.wrap_model(model, budget_gb=budget / GiB, device=device, policy={"offload": ["*"]})
            with torch.no_grad():
                out = model(x)
            exact = not any("last bits" in str(w.message) for w in caught)
            _same(out, reference(x), exact, (case, budget))
            x.requires_grad_()
            refused = _raised(lambda: model(x).float().square().sum().backward())
        exact = not any("last bits" in str(w.message) for w in caught)
        grad, x.grad = x.grad, None
        # torch's own backward refuses a float bias without a weight beside a half-precision input:
        # the wrapped model refuses it as torch does.
        assert refused == _raised(lambda: reference(x).float().square().sum().backward()), (case, budget)
        if refused:
            continue
        for got, want in ((model.w.grad, reference.w.grad), (grad, x.grad),
                          *(((model.b.grad, reference.b.grad),) if model.b is not None else ())):
            _same(got, want, exact, (case, budget))
        s = ot.stats(model)
        assert s.peak_device_bytes <= s.budget_bytes, budget


class _OwnGroupNorm(nn.Module):
    """A model's own module holding a group norm's weight and bias: placement counts the larger
    alone (a model's own module reads its tensors in separate ops), so the group norm reading both
    at once runs in slices at the smallest budget."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(256) / 4 + 1)
        self.b = nn.Parameter(torch.randn(256) / 4)

    def forward(self, x):
        return F.group_norm(x, 8, self.w, self.b)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_group_norms_weight_and_bias_in_slices_give_its_kernels_bits_without_a_warning(dtype, layout, device):
    # The slices applied weight and bias after a normalisation rounded apart, with a warning that
    # bits may differ; they now take the kernel's steps per channel (scale, shift, one fused
    # multiply-add), so the result is the unwrapped one bit for bit, in either memory layout.
    torch.manual_seed(0)
    model = _OwnGroupNorm()
    reference = _OwnGroupNorm().to(device)
    reference.load_state_dict(model.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ot.wrap_model(model, budget_gb=1024 / GiB, device=device, policy={"offload": ["*"]})
    x = (torch.randn(3, 256, 5, 7) * 3 + 1).to(device, dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            out = model(x)
    assert torch.equal(out, reference(x))
    assert ot.stats(model).peak_device_bytes <= 1024
