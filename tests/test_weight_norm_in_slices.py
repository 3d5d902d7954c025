"""Weight normalisation (``torch.nn.utils.parametrizations.weight_norm``, and the older hook-based
``torch.nn.utils.weight_norm``) of offloaded weights larger than the budget's room: registered
before or after wrapping, forward, backward and AdamW steps give the unwrapped model's losses,
outputs and weights bit for bit, within the budget. Tiny models built here."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations

import offtensor as ot

GiB = 2**30
TIGHT = 4352  # one tile of 16 rows of the 64 x 64 weight, beside its g: each weight is larger than that


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 8))


def _conv():
    """HiFi-GAN's shape of layer: every convolution weight-normed over its output channels."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv1d(8, 32, 5, padding=2), nn.LeakyReLU(0.1), nn.Conv1d(32, 32, 7, padding=3),
                         nn.LeakyReLU(0.1), nn.Conv1d(32, 4, 3))


def _wrap(model, device, budget=TIGHT):
    ot.wrap_model(model, budget_gb=budget / GiB, device=device, policy={"offload": ["*"]})


def _train_alike(model, reference, x, steps=2):
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference)]
    for step in range(steps):
        losses = []
        for m, opt in zip((model, reference), optimizers):
            opt.zero_grad()
            loss = m(x).square().mean()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        assert torch.equal(*losses), step
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.detach().cpu(), q.detach().cpu()), name
    stats = ot.stats(model)
    assert 0 < stats.peak_device_bytes <= stats.budget_bytes


def _x(device):
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(1)).to(device)


def test_weight_norm_registered_after_wrapping_on_weights_larger_than_the_room_trains_as_unwrapped(device):
    """Registering split each weight with ``norm_except_dim`` and every forward and backward read
    ``v`` whole (``_weight_norm_interface``): a BudgetError for a weight larger than the room, and
    ``g`` was refused as it was assigned, its module counted as read whole. Both run in slices of
    the output rows now, and the parametrization's tensors are planned in tiles."""
    model = _mlp()
    reference = copy.deepcopy(model).to(device)
    _wrap(model, device)
    for m in (model, reference):
        parametrizations.weight_norm(m[0])
        parametrizations.weight_norm(m[2])
    assert isinstance(model[2].parametrizations.weight.original1, ot.OffloadedTensor)
    assert model[2].parametrizations.weight.original1.numel() * 4 > TIGHT
    _train_alike(model, reference, _x(device))


def test_weight_norm_registered_before_wrapping_is_planned_in_tiles_and_trains_as_unwrapped(device):
    """Wrap counted a weight-normed weight whole (a torch.nn module reading its tensors in one
    kernel): the same budget was refused at wrap time."""
    model = _mlp()
    for i in (0, 2):
        parametrizations.weight_norm(model[i])
    reference = copy.deepcopy(model).to(device)
    _wrap(model, device)
    _train_alike(model, reference, _x(device))


@pytest.mark.parametrize("before", [True, False], ids=["registered-before", "registered-after"])
def test_weight_normed_convolutions_larger_than_the_room_train_as_unwrapped(device, before):
    model = _conv()
    if before:
        for i in (0, 2, 4):
            parametrizations.weight_norm(model[i])
    reference = copy.deepcopy(model).to(device)
    _wrap(model, device, 14464)  # the 28 KiB middle weight in tiles
    if not before:
        for m in (model, reference):
            for i in (0, 2, 4):
                parametrizations.weight_norm(m[i])
    x = torch.randn(2, 8, 40, generator=torch.Generator().manual_seed(2)).to(device)
    _train_alike(model, reference, x)


def test_the_hook_based_weight_norm_registered_after_wrapping_trains_as_unwrapped(device):
    model = _mlp()
    reference = copy.deepcopy(model).to(device)
    _wrap(model, device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's own deprecation of the hook form
        for m in (model, reference):
            torch.nn.utils.weight_norm(m[2])
    _train_alike(model, reference, _x(device))

