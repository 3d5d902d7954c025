"""Parameters stored in other layouts than their module makes (a transposed linear weight, a
channels-last convolution, a strided or offset view of a bigger storage), at the smallest budget
``wrap_model`` accepts and above: the forward, the backward, optimizer steps, a re-initialisation
and the ops users run on weights (a norm, a softmax, a sort along a dim, a clone) give the unwrapped
model's results, within the budget. A layout changes which slices of a weight are contiguous: a
row of a transposed weight spans nearly all of it, so an op cut by rows never fit."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import offtensor as ot
from test_budget_fuzz import _smallest_accepted

GiB = 1 << 30


def _relayout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """``t``'s values in ``layout``: the same shape, other strides (or a view into a bigger storage)."""
    if layout == "contiguous":
        return t.clone()
    if layout == "reversed":  # every dim's order reversed in memory: column-major for a matrix
        return t.permute(*reversed(range(t.dim()))).contiguous().permute(*reversed(range(t.dim())))
    if layout == "channels_last" and t.dim() == 4:
        return t.contiguous(memory_format=torch.channels_last)
    if layout == "strided":  # every other element of a storage twice the size
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        wide[..., ::2] = t
        return wide[..., ::2]
    if layout == "offset":  # a view starting inside a bigger storage
        flat = torch.zeros(t.numel() + 13, dtype=t.dtype)
        flat[13:] = t.reshape(-1)
        return flat[13:].view(t.shape)
    return t.clone()


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(96, 32)
        self.up = nn.Linear(32, 256)
        self.conv = nn.Conv2d(4, 32, 3, padding=1)
        self.norm = nn.LayerNorm(256)
        self.down = nn.Linear(256, 32)

    def forward(self, ids, image):
        h = self.embed(ids) + self.conv(image).mean((-1, -2))[:, None, :]
        return self.down(self.norm(torch.relu(self.up(h))))


def _build(layout: str) -> nn.Module:
    torch.manual_seed(0)
    model = _Model()
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(_relayout(p.detach(), layout)))
    return model


LAYOUTS = ["contiguous", "reversed", "channels_last", "strided", "offset"]
WEIGHT_OPS = {
    "norm(dim=1)": lambda w: w.norm(dim=1),
    "softmax(-1)": lambda w: w.softmax(-1),
    "sort(0)": lambda w: w.sort(0).values,
    "argmax(1)": lambda w: w.argmax(1),
    "clone": lambda w: w.clone(),
    "abs().amax()": lambda w: w.abs().amax(),
}


def _inputs(device):
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, 96, (3, 5), generator=g).to(device), torch.randn(3, 4, 6, 6, generator=g).to(device))


def _close(got, want, what):
    if isinstance(got, ot.OffloadedTensor):
        got = got.materialize()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def _train(model, device):
    ids, image = _inputs(device)
    # (SGD, not Adam: Adam's step divides by the root of a near-zero second moment, which turns a
    # gradient summed over tiles in another order, warned at wrap, into a visibly different update)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    for _ in range(2):
        model(ids, image).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        model.up.weight.mul_(0.5)
        nn.init.zeros_(model.down.bias)
    return model(ids, image)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("above", [0, 96 * 1024])
def test_a_model_whose_weights_are_stored_in_another_layout_trains_at_every_budget_wrap_accepts(layout, above, device):
    smallest = _smallest_accepted(lambda: _build(layout), 1 << 22, device)
    model, reference = _build(layout), _build(layout).to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (tiles summed in another order: compared as close below)
        ot.wrap_model(model, budget_gb=(smallest + above) / GiB, device=device, policy={"offload": ["*"]})
        offloaded = [n for n, p in model.named_parameters() if isinstance(p, ot.OffloadedTensor)]
        assert "up.weight" in offloaded and "conv.weight" in offloaded
        for name, op in WEIGHT_OPS.items():
            with torch.no_grad():
                _close(op(model.up.weight), op(reference.up.weight), f"{name} of up.weight ({layout})")
        _close(_train(model, device), _train(reference, device), f"training ({layout})")
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        _close(p, q, f"{name} after training ({layout})")
    stats = ot.stats(model)
    assert stats.peak_device_bytes <= stats.budget_bytes
