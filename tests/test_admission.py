"""Admission by the bytes that will move: placement and the pager count the same bytes (the storage
range that a tensor's paging covers, per view and per tile), so a budget that ``wrap_model``
accepts runs, and runs bit-identically. A view into a bigger storage is offloaded as its own
elements; a cast of an offloaded leaf inside another subclass is what the cast really is; tiles of
row-major weights and of the backward are sized by the bytes they cover; ``_foreach_*`` ops chunk
down to one tensor, then raise a BudgetError naming it."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_map

import offtensor as ot
from offtensor.pager import BudgetError

GiB = 1 << 30


def _own_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


# ---------------------------------------------------------------------------- views into bigger storages


class _ShardedMLP(nn.Module):
    """transformers' tensor parallelism leaves a column-sharded weight (``down_proj``, ``o_proj``)
    as a view into the full weight's storage: twice its bytes."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(64, 128, bias=False)
        full = torch.randn(64, 256)
        self.down = nn.Linear(128, 64, bias=False)
        self.down.weight = nn.Parameter(full[:, 128:])  # this rank's columns of the full weight
        self.out = nn.Linear(64, 64)

    def forward(self, x):
        return self.out(self.down(F.gelu(self.up(x))))


def _sharded():
    torch.manual_seed(0)
    return _ShardedMLP()


@pytest.mark.parametrize("fraction", [0.7, 0.5, 0.4, 0.3, 0.2])
def test_a_view_into_a_bigger_storage_is_offloaded_as_its_own_elements_and_every_accepted_budget_runs(device, fraction):
    # On main: the master held the view's whole covering range (65,024 bytes for a 32,768-byte
    # shard) while placement counted 32,768, so wrap accepted 0.5 and below and every forward raised.
    reference = _sharded().to(device)
    model = _sharded().to(device)
    assert model.down.weight.untyped_storage().nbytes() == 2 * model.down.weight.numel() * 4
    budget = int(fraction * _own_bytes(model))
    ot.wrap_model(model, budget_gb=budget / GiB, device=device)
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    w = model.down.weight
    assert isinstance(w, ot.OffloadedTensor) and w.host_nbytes == w.numel() * 4  # its own elements only
    s = ot.stats(model)
    assert s.peak_device_bytes <= s.budget_bytes == budget
    assert s.offloaded_bytes == sum({id(t._master): t._master.nbytes for t in model.parameters()
                                     if isinstance(t, ot.OffloadedTensor)}.values())


def test_a_resident_view_into_a_bigger_storage_counts_the_storage_it_keeps(device):
    # Kept resident, the shard keeps the whole storage on the device: placement counts that, so
    # the budget the stats report holds what is really resident.
    model = _sharded().to(device)
    budget = int(0.9 * _own_bytes(model))
    ot.wrap_model(model, budget_gb=budget / GiB, device=device, policy={"keep": ["down.weight"]})
    assert not isinstance(model.down.weight, ot.OffloadedTensor)
    s = ot.stats(model)
    assert s.resident_bytes >= 2 * model.down.weight.numel() * 4
    x = torch.randn(2, 64).to(device)
    with torch.no_grad():
        model(x)
    assert ot.stats(model).peak_device_bytes <= budget


def test_views_of_one_storage_all_offloaded_count_its_bytes_once(device):
    # A fused qkv sliced into three parameters: one storage, one master, its bytes once.
    torch.manual_seed(0)
    qkv = torch.randn(3 * 64, 64)
    model = nn.ModuleDict({n: nn.Linear(64, 64, bias=False) for n in "qkv"})
    for i, n in enumerate("qkv"):
        model[n].weight = nn.Parameter(qkv[i * 64:(i + 1) * 64])
    reference = copy.deepcopy(model)
    ot.wrap_model(model, offload_gb=qkv.numel() * 4 / GiB, device=device)
    masters = {id(model[n].weight._master): model[n].weight._master for n in "qkv"}
    assert len(masters) == 1 and next(iter(masters.values())).nbytes == qkv.numel() * 4
    assert ot.stats(model).offloaded_bytes == qkv.numel() * 4
    x = torch.randn(2, 64).to(device)
    with torch.no_grad():
        for n in "qkv":
            assert torch.equal(model[n](x), reference[n].to(device)(x))


def test_disjoint_views_of_a_storage_with_gaps_get_masters_of_their_own_elements(device):
    # Two of a storage's three row blocks are parameters: their masters hold those blocks only.
    torch.manual_seed(0)
    storage = torch.randn(3 * 32, 64)
    model = nn.ModuleDict({n: nn.Linear(64, 32, bias=False) for n in "ab"})
    model["a"].weight = nn.Parameter(storage[:32])
    model["b"].weight = nn.Parameter(storage[64:])
    reference = copy.deepcopy(model)
    ot.wrap_model(model, offload_gb=1, device=device)
    assert [model[n].weight.host_nbytes for n in "ab"] == [32 * 64 * 4] * 2
    assert ot.stats(model).offloaded_bytes == 2 * 32 * 64 * 4
    x = torch.randn(2, 64).to(device)
    with torch.no_grad():
        for n in "ab":
            assert torch.equal(model[n](x), reference[n].to(device)(x))


def test_interleaved_column_slices_that_cover_their_storage_share_one_master(device):
    torch.manual_seed(0)
    storage = torch.randn(32, 128)
    model = nn.ModuleDict({n: nn.Linear(64, 32, bias=False) for n in "ab"})
    model["a"].weight = nn.Parameter(storage[:, :64])
    model["b"].weight = nn.Parameter(storage[:, 64:])
    reference = copy.deepcopy(model)
    ot.wrap_model(model, offload_gb=1, device=device)
    assert model["a"].weight._master is model["b"].weight._master
    assert model["a"].weight.host_nbytes == storage.numel() * 4  # its bytes once
    x = torch.randn(2, 64).to(device)
    with torch.no_grad():
        for n in "ab":
            assert torch.equal(model[n](x), reference[n].to(device)(x))


# ---------------------------------------------------------------------------- casts inside other subclasses


class _Dequantising(torch.Tensor):
    """A wrapper subclass whose kernels cast its leaf to float32 first, as torchao's do."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=torch.float32, device=inner.device)

    def __init__(self, inner):
        self.inner = inner

    seen = []

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        def unwrap(a):
            if isinstance(a, _Dequantising):
                cast = a.inner.to(torch.float32)
                cls.seen.append(cast)
                return cast
            return a

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


def test_a_cast_of_an_offloaded_leaf_inside_another_subclass_is_a_plain_tensor_with_the_cast_values(device):
    # On main: aten.to.dtype (its schema returns an alias) took the view path and came back as an
    # OffloadedTensor claiming float32 over the float8 master, paging 4x the bytes planned.
    fp8 = torch.randn(64, 64).to(torch.float8_e4m3fn)
    leaf = ot.offload(fp8, device=device)
    _Dequantising.seen.clear()
    got = _Dequantising(leaf) + 1
    cast = _Dequantising.seen[0]
    assert type(cast) is torch.Tensor and cast.dtype == torch.float32
    assert torch.equal(cast.cpu(), fp8.to(torch.float32))
    assert torch.equal(got.cpu(), fp8.to(torch.float32) + 1)
    assert leaf.to(leaf.dtype) is leaf  # a no-op cast is the tensor itself, as for a plain tensor


# ---------------------------------------------------------------------------- tiles sized by what they cover


class _RowMajor(nn.Module):
    """``x @ W`` with a row-major (in, out) weight, as GPT-2's Conv1D and many research models."""

    def __init__(self, fan_in, fan_out):
        super().__init__()
        self.w = nn.Parameter(torch.randn(fan_in, fan_out))
        self.b = nn.Parameter(torch.randn(fan_out))
        self.small = nn.Linear(8, 8)

    def forward(self, x):
        return torch.addmm(self.b, x, self.w) + (x @ self.w)


@pytest.mark.parametrize("shape", [(256, 192), (96, 384)])
@pytest.mark.parametrize("fraction", [0.6, 0.8, 0.95])
def test_column_tiles_of_a_row_major_weight_are_sized_by_the_bytes_they_cover(device, shape, fraction):
    # On main: a column tile was sized by its elements but paged its covering range, nearly all of
    # W: wrap accepted and every forward raised BudgetError.
    torch.manual_seed(0)
    model = _RowMajor(*shape)
    reference = copy.deepcopy(model).to(device)
    budget = int(fraction * shape[0] * shape[1] * 4)
    ot.wrap_model(model, budget_gb=budget / GiB, device=device, prefetch=False)
    x = torch.randn(5, shape[0]).to(device)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    assert ot.stats(model).peak_device_bytes <= budget


@pytest.mark.parametrize("fraction", [0.6, 0.9])
def test_the_backward_of_linear_with_a_frozen_offloaded_weight_tiles_by_the_bytes_it_covers(device, fraction):
    # grad_input = grad_output @ W pages column tiles of the (out, in) weight.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 192), nn.Linear(8, 8))
    model[0].weight.requires_grad_(False)
    reference = copy.deepcopy(model).to(device)
    budget = int(fraction * 256 * 192 * 4)
    ot.wrap_model(model, budget_gb=budget / GiB, device=device, prefetch=False)
    x = torch.randn(5, 256, device=device, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    model[0](x).square().sum().backward()
    reference[0](x_ref).square().sum().backward()
    assert torch.equal(x.grad, x_ref.grad) and torch.equal(model[0].bias.grad, reference[0].bias.grad)
    assert ot.stats(model).peak_device_bytes <= budget


def test_gpt2_at_nine_tenths_of_its_largest_weight_runs_bit_identically(device):
    # GPT-2's Conv1D computes x @ W with a row-major (in, out) W; on main it raised BudgetError.
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=64, n_layer=2, n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval().to(device)
    reference = copy.deepcopy(model)
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    ot.wrap_model(model, budget_gb=0.9 * largest / GiB, device=device)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    s = ot.stats(model)
    assert s.peak_device_bytes <= s.budget_bytes


# ---------------------------------------------------------------------------- foreach optimizers


def _trainable(device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 48), nn.GELU(), nn.Linear(48, 8)).to(device)


@pytest.mark.parametrize("optimizer", ["SGD", "AdamW"])
def test_foreach_optimizers_step_offloaded_weights_as_unwrapped_ones(device, optimizer):
    model, reference = _trainable(device), _trainable(device)
    budget = int(0.9 * _own_bytes(model))  # room to page the offloaded weight whole, as its step does
    ot.wrap_model(model, budget_gb=budget / GiB, device=device, policy={"offload": ["0.weight"]})
    assert isinstance(model[0].weight, ot.OffloadedTensor)
    make = getattr(torch.optim, optimizer)
    opt, ref_opt = make(model.parameters(), lr=1e-2, foreach=True), make(reference.parameters(), lr=1e-2, foreach=True)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)).to(device)
    for _ in range(2):
        for m, o in ((model, opt), (reference, ref_opt)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.detach().cpu(), q.detach().cpu())


@pytest.mark.parametrize("optimizer", ["SGD", "AdamW"])
@pytest.mark.parametrize("mode", ["foreach", "fused"])
def test_a_multi_tensor_step_over_weights_that_do_not_fit_together_runs_per_weight_as_the_unwrapped_step(
        device, optimizer, mode):
    # The fused steps (``_fused_adamw_``, what transformers' Trainer runs by default) paged every
    # offloaded weight at once and raised BudgetError past a budget wrap had accepted.
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(64, 64, bias=False) for _ in range(4)))
    reference = copy.deepcopy(model).to(device)
    budget = int(1.5 * 64 * 64 * 4)  # one weight's copy at a time
    ot.wrap_model(model, budget_gb=budget / GiB, device=device, prefetch=False)
    assert all(isinstance(m.weight, ot.OffloadedTensor) for m in model)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)).to(device)
    for m in (model, reference):
        opt = getattr(torch.optim, optimizer)(m.parameters(), lr=0.1, **{mode: True})
        for _ in range(2):
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.detach().cpu(), q.detach().cpu())
    assert ot.stats(model).peak_device_bytes <= budget


@pytest.mark.parametrize("optimizer", ["SGD", "AdamW"])
@pytest.mark.parametrize("mode", ["foreach", "fused"])
def test_a_foreach_step_on_a_weight_larger_than_the_free_room_runs_in_slices_as_the_unwrapped_step(device, optimizer, mode):
    # Once: ForeachInPieces split the list down to one element and called itself again, forever
    # (RecursionError); then a BudgetError. The element now runs in slices that fit.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 192), nn.Linear(8, 8)).to(device)
    reference = copy.deepcopy(model)
    budget = 0.5 * 256 * 192 * 4
    ot.wrap_model(model, budget_gb=budget / GiB, device=device, prefetch=False, policy={"offload": ["0.weight"]})
    for m in (model, reference):
        opt = getattr(torch.optim, optimizer)(m.parameters(), lr=0.1, **{mode: True})
        for p in m.parameters():
            p.grad = torch.ones(p.shape, device=device)
        opt.step()
    assert torch.equal(model[0].weight.detach().cpu(), reference[0].weight.detach().cpu())
    assert ot.stats(model).peak_device_bytes <= budget


def test_the_backward_of_a_convolution_larger_than_the_room_runs_in_tiles_and_warns(device):
    # On main: convolution_backward paged the whole weight, and raised BudgetError after wrap accepted.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(16, 64, 3, padding=1), nn.Linear(8, 8))
    model[0].weight.requires_grad_(False)
    reference = copy.deepcopy(model).to(device)
    budget = int(0.6 * model[0].weight.numel() * 4)
    ot.wrap_model(model, budget_gb=budget / GiB, device=device, prefetch=False)
    x = torch.randn(2, 16, 8, 8, device=device, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    with pytest.warns(UserWarning, match=r"backward of a convolution with .*'0\.weight'.*output-channel tiles"):
        model[0](x).square().sum().backward()
    reference[0](x_ref).square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    assert torch.equal(model[0].bias.grad, reference[0].bias.grad)
    assert ot.stats(model).peak_device_bytes <= budget
