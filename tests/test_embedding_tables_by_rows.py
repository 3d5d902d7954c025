"""``nn.Embedding(max_norm=...)`` and ``nn.EmbeddingBag`` tables larger than the budget's room,
paged by the rows they look up: wrap plans them at one row, as it plans a plain embedding, and
their forward, backward (per-sample weights' gradient too) and optimizer steps give the unwrapped
model's results bit for bit, within the budget."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import offtensor as ot

GiB = 2**30
ROWS, WIDTH = 400, 32
TIGHT = 2048  # the 51,200-byte table, 16 of its rows at a time


class _Table(nn.Module):
    def __init__(self, table: nn.Module):
        super().__init__()
        self.table = table
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, *args, **kwargs):
        return self.head(self.table(*args, **kwargs)).square().mean()


def _ids(step):
    ids = torch.randint(0, ROWS, (60,), generator=torch.Generator().manual_seed(step))
    ids[:3] = 7
    return ids


OFFSETS = torch.tensor([0, 5, 20, 33, 41])


def _pair(table, device):
    torch.manual_seed(0)
    model = _Table(table)
    with torch.no_grad():
        model.table.weight.mul_(3)  # rows past max_norm, so it renormalises some
    reference = copy.deepcopy(model).to(device)
    ot.wrap_model(model, budget_gb=TIGHT / GiB, device=device, policy={"offload": ["*"]})
    assert isinstance(model.table.weight, ot.OffloadedTensor)
    return model, reference


def _train_alike(model, reference, inputs, steps=3, make=None):
    """``steps`` steps of each model on ``inputs(step)`` (SGD with momentum, or ``make(model)``'s
    optimizer): equal losses at every step, equal parameters after, within the budget."""
    make = make or (lambda m: torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9))
    optimizers = [make(m) for m in (model, reference)]
    for step in range(steps):
        losses = []
        for m, opt in zip((model, reference), optimizers):
            opt.zero_grad()
            loss = m(*inputs(step))
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        assert torch.equal(*losses), step
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.detach().cpu(), q.detach().cpu())
    stats = ot.stats(model)
    assert 0 < stats.peak_device_bytes <= stats.budget_bytes


def test_an_embedding_with_max_norm_larger_than_the_room_is_wrapped_and_trains_as_unwrapped(device):
    """max_norm renormalises the rows it looks up, in place, before each lookup: the whole table was
    paged for it, so wrap counted the table whole and refused this budget."""
    model, reference = _pair(nn.Embedding(ROWS, WIDTH, max_norm=1.0), device)
    _train_alike(model, reference, lambda step: (_ids(step).to(device),))


def test_a_max_norm_lookup_pages_and_writes_back_only_the_rows_it_looks_up(device):
    model, reference = _pair(nn.Embedding(ROWS, WIDTH, max_norm=1.0), device)
    ids = _ids(0).to(device)
    ot.reset_stats(model)
    with torch.no_grad():
        assert torch.equal(model.table(ids), reference.table(ids))
    looked_up = int(torch.unique(ids).numel())
    assert ot.stats(model).bytes_h2d == 2 * looked_up * WIDTH * 4  # the renorm's rows, then the lookup's
    assert torch.equal(model.table.weight.cpu(), reference.table.weight.detach().cpu())


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("max_norm", [None, 1.0], ids=["plain", "max-norm"])
def test_an_embedding_bag_larger_than_the_room_is_wrapped_and_trains_as_unwrapped(device, mode, max_norm):
    """nn.EmbeddingBag was counted whole at wrap time; its forward already paged only the rows it
    reduces for a table larger than the room."""
    model, reference = _pair(nn.EmbeddingBag(ROWS, WIDTH, mode=mode, max_norm=max_norm), device)
    _train_alike(model, reference, lambda step: (_ids(step).to(device), OFFSETS.to(device)))


@pytest.mark.parametrize("padding", [False, True], ids=["no-padding", "padding-index"])
def test_the_gradient_of_a_bags_per_sample_weights_reads_only_the_rows_looked_up(device, padding):
    """``_embedding_bag_per_sample_weights_backward`` takes the table: it was paged whole."""
    ids = _ids(0)
    table = nn.EmbeddingBag(ROWS, WIDTH, mode="sum", padding_idx=int(ids[10]) if padding else None)
    model, reference = _pair(table, device)
    grads = []
    for m in (model, reference):
        weights = torch.rand(ids.shape, generator=torch.Generator().manual_seed(4)).to(device).requires_grad_()
        m(ids.to(device), OFFSETS.to(device), per_sample_weights=weights).backward()
        grads.append(weights.grad)
    assert torch.equal(*grads)
    assert torch.equal(model.table.weight.grad, reference.table.weight.grad)
    stats = ot.stats(model)
    assert stats.peak_device_bytes <= stats.budget_bytes
