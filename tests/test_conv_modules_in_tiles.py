"""torch.nn's transposed, grouped and depthwise convolutions are planned in tiles of their output
channels, as dispatch computes them (``ops.convolutions``), not counted whole: the smallest budget
wrap accepts is one output channel beside the bias, one byte less is refused naming the weight and
the bytes, and every budget from there to the whole model runs forward and backward within the
budget, giving the unwrapped outputs and gradients bit for bit, or with a warning that they may
differ in the last bits (tiles narrower than 16 channels; a grouped convolution a few groups at a
time)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import offtensor as ot
from test_budget_fuzz import _smallest_accepted

GiB = 1 << 30

CASES = {
    # name: (build the module, input shape)
    "ConvTranspose1d": (lambda: nn.ConvTranspose1d(16, 32, 5, stride=2, output_padding=1), (2, 16, 12)),
    "ConvTranspose2d": (lambda: nn.ConvTranspose2d(8, 32, 3, stride=2, padding=1), (2, 8, 6, 6)),
    "ConvTranspose2d without bias": (lambda: nn.ConvTranspose2d(8, 40, 3, bias=False), (2, 8, 5, 5)),
    "ConvTranspose2d grouped": (lambda: nn.ConvTranspose2d(8, 16, 3, groups=2), (2, 8, 6, 6)),
    "ConvTranspose3d": (lambda: nn.ConvTranspose3d(4, 16, 3, dilation=2), (2, 4, 4, 4, 4)),
    "Conv2d grouped": (lambda: nn.Conv2d(8, 32, 3, stride=2, groups=4), (2, 8, 9, 9)),
    "Conv1d grouped": (lambda: nn.Conv1d(12, 48, 3, padding=1, groups=3), (2, 12, 20)),
    "Conv2d depthwise": (lambda: nn.Conv2d(16, 16, 3, padding=1, groups=16), (2, 16, 7, 7)),
    "Conv2d depthwise multiplier": (lambda: nn.Conv2d(8, 32, 3, groups=8, bias=False), (2, 8, 7, 7)),
    # An ordinary one with fewer inputs than outputs: counted at 16 channels where one does.
    "Conv2d of few inputs": (lambda: nn.Conv2d(4, 64, 3, padding=1), (2, 4, 6, 6)),
}


def _build(case: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(CASES[case][0]())


def _wrap(model: nn.Module, budget: int, device) -> None:
    ot.wrap_model(model, budget_gb=budget / GiB, device=device, policy={"offload": ["*"]})


def _same(got, want, exact: bool, what):
    if exact:
        assert torch.equal(got, want), what
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_a_transposed_or_grouped_conv_module_runs_in_tiles_at_every_budget_wrap_accepts(case, device):
    conv = _build(case)[0]
    one_output = conv.weight.numel() * 4 // conv.out_channels
    bias = 0 if conv.bias is None else conv.bias.numel() * 4
    whole = sum(p.numel() * 4 for p in conv.parameters())
    smallest = _smallest_accepted(lambda: _build(case), 10**7, device)
    # Counted at one output channel beside its bias, not whole (as they were).
    assert smallest == one_output + bias < whole
    with pytest.raises(ot.BudgetError, match=rf"paging '0\.(weight|bias)'.* \({smallest} bytes\) in all"):
        _wrap(_build(case), smallest - 1, device)
    x0 = torch.randn(*CASES[case][1], generator=torch.Generator().manual_seed(2))
    for budget in sorted({smallest, smallest + 700, 3 * smallest, whole // 3, whole // 2 + 4096, whole}):
        if budget < smallest:
            continue
        model, reference = _build(case), _build(case).to(device)
        x = x0.clone().to(device).requires_grad_()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _wrap(model, budget, device)
            with torch.no_grad():
                out = model(x)
            model(x).square().sum().backward()
        exact = not any("last bits" in str(w.message) for w in caught)
        _same(out, reference(x), exact, (case, budget))
        grad, x.grad = x.grad, None
        reference(x).square().sum().backward()
        pairs = [(model[0].weight.grad, reference[0].weight.grad), (grad, x.grad)]
        if model[0].bias is not None:
            pairs.append((model[0].bias.grad, reference[0].bias.grad))
        for got, want in pairs:
            _same(got, want, exact, (case, budget))
        s = ot.stats(model)
        assert s.peak_device_bytes <= s.budget_bytes, (case, budget)
