"""An ``nn.Embedding(sparse=True)`` trained on a wrapped model: its gradient is a sparse COO
tensor, which SGD, Adagrad and SparseAdam add into the table (``param.add_(grad)``). Against the
same model unwrapped, bit for bit, within the budget, with the table larger than the room."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import offtensor as ot
from test_embedding_tables_by_rows import _train_alike

GiB = 2**30
# torch's own note when Adagrad makes a sparse tensor without checking it
pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")


class _Bag(nn.Module):
    """A sparse embedding table read by a small head: the table is the model's largest weight."""

    def __init__(self, rows=400, width=32):
        super().__init__()
        self.embed = nn.Embedding(rows, width, sparse=True)
        self.head = nn.Linear(width, 4)

    def forward(self, ids):
        return self.head(self.embed(ids)).square().mean()


def _ids(step, rows=400):
    ids = torch.randint(0, rows, (6, 10), generator=torch.Generator().manual_seed(step))
    ids[0, :3] = 7  # a row looked up three times: its gradient names it three times, uncoalesced
    return ids


def _pair(device, budget_bytes):
    torch.manual_seed(0)
    model = _Bag()
    reference = copy.deepcopy(model).to(device)
    ot.wrap_model(model, budget_gb=budget_bytes / GiB, device=device, policy={"offload": ["*"]})
    return model, reference


def _sparse_adam(m):
    return _Both(torch.optim.SparseAdam(list(m.embed.parameters()), lr=1e-2),
                 torch.optim.Adam(list(m.head.parameters()), lr=1e-2))


class _Both:
    def __init__(self, *optimizers):
        self.optimizers = optimizers

    def step(self):
        for o in self.optimizers:
            o.step()

    def zero_grad(self):
        for o in self.optimizers:
            o.zero_grad()


@pytest.mark.parametrize("make", [
    lambda m: torch.optim.SGD(m.parameters(), lr=0.5),
    lambda m: torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9),
    lambda m: torch.optim.Adagrad(m.parameters(), lr=0.1),
    _sparse_adam,
], ids=["sgd", "sgd-momentum", "adagrad", "sparse-adam"])
def test_a_sparse_embedding_larger_than_the_room_trains_as_unwrapped_paging_only_the_rows_it_looked_up(device, make):
    """The step added the sparse gradient to the whole table: paged whole where it fit, and where
    it did not, cut in slices, which a sparse tensor has none of (``NotImplementedError`` from
    ``as_strided`` on SparseCPU). Now only the rows the gradient names are paged, updated and
    written back, in the gradient's own order of entries."""
    model, reference = _pair(device, 2048)  # the 51,200-byte table, 16 of its rows at a time
    assert isinstance(model.embed.weight, ot.OffloadedTensor)
    _train_alike(model, reference, lambda step: (_ids(step).to(device),), make=make)


def test_a_sparse_update_pages_and_writes_back_only_the_rows_it_names(device):
    model, reference = _pair(device, 1 << 20)  # room for the whole table: still only the rows
    for m in (model, reference):
        m(_ids(0).to(device)).backward()
    grad = reference.embed.weight.grad
    touched = int(torch.unique(grad._indices()[0]).numel())
    ot.reset_stats(model)
    with torch.no_grad():
        model.embed.weight.add_(model.embed.weight.grad, alpha=-0.5)
        reference.embed.weight.add_(grad, alpha=-0.5)
    row = 32 * 4
    stats = ot.stats(model)
    assert stats.bytes_h2d == touched * row < 400 * row
    assert stats.bytes_d2h <= touched * row  # (the emulated device writes back from host memory: 0)
    assert torch.equal(model.embed.weight.cpu(), reference.embed.weight.detach().cpu())
    with torch.no_grad():
        assert torch.equal(model(_ids(5).to(device)), reference(_ids(5).to(device)))  # no stale copy read


def test_a_dense_table_plus_a_sparse_tensor_out_of_place_larger_than_the_room_runs_in_slices(device):
    model, reference = _pair(device, 2048)
    for m in (model, reference):
        m(_ids(0).to(device)).backward()
    grad = reference.embed.weight.grad
    with torch.no_grad():
        assert torch.equal(torch.add(model.embed.weight, grad, alpha=-0.5).cpu(),
                           torch.add(reference.embed.weight, grad, alpha=-0.5).cpu())
        assert torch.equal(model.embed.weight.sub(grad).cpu(), reference.embed.weight.sub(grad).cpu())


def test_a_sparse_tensor_of_another_shape_gets_torchs_own_refusal_and_changes_nothing(device):
    model, reference = _pair(device, 2048)
    before = model.embed.weight.cpu()
    wrong = torch.sparse_coo_tensor(torch.tensor([[1]]), torch.ones(1, 5), (400, 5)).to(device)
    with pytest.raises(RuntimeError) as plain:
        with torch.no_grad():
            reference.embed.weight.add_(wrong)
    with pytest.raises(RuntimeError) as wrapped:
        with torch.no_grad():
            model.embed.weight.add_(wrong)
    assert str(wrapped.value) == str(plain.value)
    assert torch.equal(model.embed.weight.cpu(), before)
