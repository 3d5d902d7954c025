"""An op computed in tiles because its weight is larger than the budget's room raises, for arguments
that are wrong for it, the error torch raises for the unwrapped op: the same type and message, not
one naming a tile's sizes or a tiling error, and never a result where torch refuses (a bias longer
than the weight's outputs fitted every tile's slice of it)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import offtensor as ot

GiB = 1 << 30


def _x(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1))


# name: forward(w, b, device): w is (256, 128) and b has 2048 elements, both offloaded, the budget
# holding about a quarter of w: every op below runs in tiles of w.
CASES = {
    "linear, bias one too long": lambda w, b, d: F.linear(_x(3, 128).to(d), w, b[:257]),
    "linear, bias one too short": lambda w, b, d: F.linear(_x(3, 128).to(d), w, b[:255]),
    "linear, 2-D bias of the wrong width": lambda w, b, d: F.linear(_x(3, 128).to(d), w, b[:771].view(3, 257)),
    "linear, input of the wrong width": lambda w, b, d: F.linear(_x(3, 100).to(d), w),
    "linear, a vector of the wrong width": lambda w, b, d: F.linear(_x(127).to(d), w),
    "linear with grad, bias one too short": lambda w, b, d: F.linear(_x(3, 128).to(d).requires_grad_(), w, b[:255]),
    "matmul, input of the wrong width": lambda w, b, d: _x(3, 100).to(d) @ w.t(),
    "addmm, bias one too long": lambda w, b, d: torch.addmm(b[:257], _x(3, 128).to(d), w.t()),
    "addmm, bias of too many rows": lambda w, b, d: torch.addmm(b[:1024].view(4, 256), _x(3, 128).to(d), w.t()),
    "mv, vector of the wrong length": lambda w, b, d: w @ _x(100).to(d),
    "addmv, bias one too short": lambda w, b, d: torch.addmv(b[:255], w, _x(128).to(d)),
    "conv1d, input of the wrong channels": lambda w, b, d: F.conv1d(_x(2, 7, 10).to(d), w.view(256, 8, 16)),
    "cdist, rows of the wrong width": lambda w, b, d: torch.cdist(_x(5, 31).to(d), w),
}


class _Reader(nn.Module):
    def __init__(self, case: str):
        super().__init__()
        self.case = case
        self.w = nn.Parameter(torch.randn(256, 128) / 16)
        self.b = nn.Parameter(torch.randn(2048) / 16)

    def forward(self):
        return CASES[self.case](self.w, self.b, self.w.device)


def _raised(call):
    try:
        call()
    except Exception as e:  # noqa: BLE001  (whatever torch raises is what is compared)
        return type(e), str(e)
    return None


@pytest.mark.parametrize("case", list(CASES))
def test_an_op_in_tiles_raises_torchs_own_error_for_wrong_arguments(case, device):
    torch.manual_seed(0)
    model = _Reader(case)
    reference = copy.deepcopy(model).to(device)
    expected = _raised(reference)
    assert expected is not None, "the case must be wrong for torch"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ot.wrap_model(model, budget_gb=40000 / GiB, device=device, policy={"offload": ["*"]})
    assert _raised(model) == expected
    # Nothing held on: a right op on the same weights runs in tiles, as the unwrapped one does.
    x = _x(3, 128).to(device)
    with torch.no_grad():
        assert torch.equal(F.linear(x, model.w, model.b[:256]), F.linear(x, reference.w, reference.b[:256]))
    s = ot.stats(model)
    assert s.peak_device_bytes <= s.budget_bytes
