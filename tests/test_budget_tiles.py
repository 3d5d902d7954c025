"""Ops on a weight larger than the budget computed in tiles: linear, mm/addmm, bmm and conv past the
budget, planned 16 slices wide so they stay bit-identical (ultrabert's head), row tiles of a
matrix-vector product, a model whose largest weight is twice the budget, weights assigned after
wrap and tiled; placement's working set of one op and its room for a layer's routed experts."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import offtensor as ot
from offtensor.pager import BudgetError, Pager
from offtensor.model.copies import is_wrapped, state_of

from test_budget_and_tiling import _offload_under, _weight_bytes

GiB = 1 << 30


# ---------------------------------------------------------------------------- 2. tiling past the budget


def test_ops_with_a_weight_larger_than_the_budget_compute_in_tiles_bit_identically(device):
    torch.manual_seed(0)
    budget = 20 * 1024
    pager = Pager(torch.device(device), budget)
    w, b = torch.randn(384, 96), torch.randn(384)  # 147 KiB: 7x the budget
    ow, ob = _offload_under(pager, w), _offload_under(pager, b)
    w, b = w.to(device), b.to(device)
    x = torch.randn(5, 96, device=device)
    x3 = torch.randn(7, 2, 96, device=device).transpose(0, 1)
    with torch.no_grad():
        assert torch.equal(F.linear(x, ow, ob), F.linear(x, w, b))
        assert torch.equal(F.linear(x3, ow, ob), F.linear(x3, w, b))
        assert torch.equal(F.linear(x3, nn.Parameter(ow), ob), F.linear(x3, nn.Parameter(w), b))
    assert torch.equal(x @ ow.t(), x @ w.t())  # mm: columns of the transposed weight
    assert torch.equal(torch.addmm(ob, x, ow.t()), torch.addmm(b, x, w.t()))
    assert torch.equal(ow @ x.t(), w @ x.t())  # mm: rows of the first operand
    wt = w.t().contiguous()  # (96, 384): columns are strided in the master, gathered on the host
    assert torch.equal(x @ _offload_under(pager, wt.cpu()), x @ wt)
    conv_w, conv_b = torch.randn(64, 8, 3, 3), torch.randn(64)  # 18 KiB + bias, with the input beside
    img = torch.randn(2, 8, 16, 16, device=device)
    got = F.conv2d(img, _offload_under(pager, conv_w), _offload_under(pager, conv_b), padding=1)
    assert torch.equal(got, F.conv2d(img, conv_w.to(device), conv_b.to(device), padding=1))
    experts = torch.randn(8, 32, 40)  # 40 KiB, 5 KiB per batch
    xb = torch.randn(8, 3, 32, device=device)
    assert torch.equal(torch.bmm(xb, _offload_under(pager, experts)), torch.bmm(xb, experts.to(device)))
    assert pager.stats.peak_device_bytes <= budget


class _WideHead(nn.Module):
    """ultrabert's pattern (transformers 5.24): small resident layers, then a prediction head whose
    two 96 KiB weights are each larger than a 30% budget's room, read by 3-D activations."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(32, 32, bias=False) for _ in range(18)])
        self.up = nn.Linear(32, 768, bias=False)
        self.down = nn.Linear(768, 32, bias=False)

    def forward(self, x):
        return self.down(F.gelu(self.up(self.layers(x))))


def test_placement_leaves_room_for_tiles_wide_enough_to_be_bit_identical(device):
    # Planning room for one-row tiles left the 32-row head weight 4 rows a tile, which BLAS sums in
    # another order (2.3e-09 off on ultrabert); placement now offloads more so tiles are 16 rows.
    torch.manual_seed(0)
    model = _WideHead()
    reference = copy.deepcopy(model).to(device)
    budget = int(0.3 * _weight_bytes(model))
    ot.wrap_model(model, budget_gb=budget / GiB, device=device)
    x = torch.randn(2, 8, 32, device=device)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    s = ot.stats(model)
    assert s.peak_device_bytes <= budget
    assert s.budget_bytes - s.resident_bytes >= 16 * 768 * 4  # room for a 16-row tile of `down`


@pytest.mark.parametrize("rows", [32, 40, 500])
def test_a_decode_step_through_a_tiled_head_of_an_odd_vocabulary_is_bit_identical(device, rows):
    # The last tile of a 1001-row head took 16 rows from the one before it (starting at 985): for a
    # single input row MKL sums outputs in blocks of 16 from a tile's first, so the outputs of the
    # two last tiles came out in another order than the whole op's (2.4e-07 apart).
    torch.manual_seed(0)
    pager = Pager(torch.device(device), rows * 64 * 4)
    w = torch.randn(1001, 64)
    ow = _offload_under(pager, w)
    with torch.no_grad():
        for _ in range(4):  # four decode steps: a last-bit difference shows for most inputs, not all
            x = torch.randn(1, 64, device=device)
            assert torch.equal(F.linear(x, ow), F.linear(x, w.to(device)))
    assert pager.stats.peak_device_bytes <= rows * 64 * 4


def test_tiles_narrower_than_the_kernel_blocks_agree_to_rounding(device):
    # Room for 2 rows of 8: BLAS runs a matrix-vector kernel per tile, summing in another order.
    torch.manual_seed(0)
    pager = Pager(torch.device(device), 2 * 256 * 4)
    w = torch.randn(64, 256)
    x = torch.randn(3, 256, device=device)
    torch.testing.assert_close(F.linear(x, _offload_under(pager, w)), F.linear(x, w.to(device)), rtol=1e-5, atol=1e-5)
    assert pager.stats.peak_device_bytes <= 2 * 256 * 4


def test_a_product_whose_single_tile_exceeds_the_room_runs_on_the_host_masters(device):
    """One column of a batch is 256 bytes where the room holds 128: no tile fits, so the ``bmm`` runs
    on the host master (before, ``BudgetError``), the plain result, nothing paged."""
    pager = Pager(torch.device(device), 128)
    experts = torch.randn(2, 64, 32)
    x = torch.randn(2, 3, 64, device=device)
    assert torch.equal(torch.bmm(x, _offload_under(pager, experts)), torch.bmm(x, experts.to(device)))
    assert pager.stats.host_ops == 1 and pager.stats.peak_device_bytes == 0


def test_a_linear_whose_offloaded_input_leaves_no_room_for_a_weight_tile_runs(device):
    """F.linear of an offloaded input of 96 bytes where the room holds 48: no tile of the weight
    fits beside it (before, ``BudgetError``), so linear's aten ops run, cutting the input's rows;
    rows narrower than 16 may round otherwise in the last bits, as narrow tiles do."""
    pager = Pager(torch.device(device), 48)
    x, w, b = torch.randn(8, 3), torch.randn(4, 3), torch.randn(4)
    got = F.linear(*(_offload_under(pager, t) for t in (x, w, b)))
    torch.testing.assert_close(got.cpu(), F.linear(x, w, b), rtol=1e-5, atol=1e-6)
    assert pager.stats.peak_device_bytes <= 48


def test_a_weight_larger_than_the_room_times_a_vector_runs_in_row_tiles(device):
    # weight @ v (matmul of a 2-D weight and a 1-D input) runs mv, which paged the weight whole:
    # BudgetError at a budget that placement accepted for tiles of its rows.
    torch.manual_seed(0)
    budget = 40 * 1024  # room for 16 rows of the transpose, 1.5 KiB each
    pager = Pager(torch.device(device), budget)
    w, b = torch.randn(384, 96), torch.randn(384)  # 147 KiB: 3.6x the budget
    ow, ob = _offload_under(pager, w), _offload_under(pager, b)
    w, b = w.to(device), b.to(device)
    v, u = torch.randn(96, device=device), torch.randn(384, device=device)
    assert torch.equal(ow @ v, w @ v)
    assert torch.equal(torch.addmv(ob, ow, v, beta=0.5, alpha=2.0), torch.addmv(b, w, v, beta=0.5, alpha=2.0))
    assert torch.equal(ow.t() @ u, w.t() @ u)  # rows of the transpose: gathered column-major on the host
    weight = nn.Parameter(ow)
    (weight @ v).square().sum().backward()  # autograd's mv: its backward is an outer product
    reference = nn.Parameter(w.clone())
    (reference @ v).square().sum().backward()
    assert torch.equal(weight.grad, reference.grad)
    assert pager.stats.peak_device_bytes <= budget


@pytest.mark.parametrize("both", [False, True])
def test_a_bmm_whose_one_batch_exceeds_the_room_runs_in_tiles_of_each_batch(device, both):
    # bmm was tiled by batch only: one batch of an input and a weight larger than the room (an
    # einsum of an input and a weight runs bmm on a batch of one) raised BudgetError at a budget
    # that placement accepted for tiles of the weight's rows; with both operands offloaded, one
    # batch of each had to fit together.
    torch.manual_seed(0)
    budget = 6 * 1024
    pager = Pager(torch.device(device), budget)
    a, b = torch.randn(2, 24, 64), torch.randn(2, 64, 200)  # 12 and 100 KiB
    xa = _offload_under(pager, a) if both else a.to(device)
    assert torch.equal(torch.bmm(xa, _offload_under(pager, b)), torch.bmm(a, b).to(device))
    assert torch.equal(torch.bmm(_offload_under(pager, b).transpose(1, 2), xa.transpose(1, 2)),
                       torch.bmm(b.transpose(1, 2), a.transpose(1, 2)).to(device))  # rows of the first
    x = torch.randn(1, 3, 64, device=device)  # a decode-sized input
    w = torch.randn(256, 64)
    assert torch.equal(torch.einsum("bsk,nk->bsn", x, _offload_under(pager, w)),
                       torch.einsum("bsk,nk->bsn", x, w.to(device)))
    assert pager.stats.peak_device_bytes <= budget


class _TiedLM(nn.Module):
    """A tied embedding used as the output layer is the model's largest weight, and a conv stem."""

    def __init__(self, vocab=2048, hidden=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.conv = nn.Conv1d(hidden, hidden, 3, padding=1)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.conv(h.transpose(1, 2)).transpose(1, 2)
        h = h + self.mlp(h)
        return self.head(self.norm(h))


def test_a_model_whose_largest_weight_is_twice_the_budget_runs_with_identical_outputs(device):
    torch.manual_seed(0)
    model = _TiedLM().eval().to(device)
    reference = copy.deepcopy(model)
    largest = model.embed.weight.numel() * 4  # 512 KiB
    budget = largest // 2
    with pytest.raises(BudgetError):
        ot.wrap_model(copy.deepcopy(model), budget_gb=64 / GiB, device=device)  # not even a tile fits
    ot.wrap_model(model, budget_gb=budget / GiB, device=device)
    assert model.head.weight is model.embed.weight and isinstance(model.embed.weight, ot.OffloadedTensor)
    ids = torch.randint(0, 2048, (2, 12), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        expected = reference(ids)
        assert torch.equal(model(ids), expected)
        assert torch.equal(model(ids), expected)
    s = ot.stats(model)
    assert s.peak_device_bytes <= budget == s.budget_bytes


def test_a_weight_assigned_after_wrap_larger_than_the_budget_is_offloaded_and_tiled(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    ot.wrap_model(model, budget_gb=16 * 1024 / GiB, device=device)
    head = nn.Linear(32, 512, bias=False)  # 64 KiB: 4x the budget
    expected_head = copy.deepcopy(head).to(device)
    with pytest.warns(UserWarning, match="narrower than 16 slices"):  # room for a few rows only
        model.head = head
    assert isinstance(model.head.weight, ot.OffloadedTensor) and model.head is head
    x = torch.randn(3, 32, device=device)
    with torch.no_grad():
        assert torch.equal(model.head(x), expected_head(x))
    assert ot.stats(model).peak_device_bytes <= 16 * 1024


def test_a_weight_assigned_after_wrap_with_room_for_narrow_tiles_only_warns_as_wrap_does(device):
    model = nn.Sequential(nn.Linear(32, 32, bias=False))
    ot.wrap_model(model, budget_gb=6 * 1024 / GiB, device=device)  # 4 KiB resident, 2 KiB of room
    with pytest.warns(UserWarning, match=r"narrower than 16 slices of head\.weight"):
        model.head = nn.Linear(32, 512, bias=False)  # 16 rows of 128 B need 2 KiB: room for 15
    assert isinstance(model.head.weight, ot.OffloadedTensor)


def test_a_wrapped_model_pickles_whole_and_loads_back_wrapped(device, tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)).to(device)
    x = torch.randn(3, 64, device=device)
    expected = model(x).detach()
    ot.wrap_model(model, budget_gb=0.7 * _weight_bytes(model) / GiB, device=device)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert is_wrapped(loaded) and ot.stats(loaded).budget_bytes == ot.stats(model).budget_bytes
    with torch.no_grad():
        assert torch.equal(loaded(x), expected)


def test_setting_a_submodule_or_attribute_to_none_releases_its_bytes(device):
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    ot.wrap_model(model, budget_gb=1, device=device)
    pager = state_of(model).pager
    before = pager.resident_bytes
    model[0].table = torch.randn(128, 256, device=device)  # 128 KiB, resident
    assert pager.resident_bytes == before + 128 * 256 * 4
    model[0].table = None
    assert pager.resident_bytes == before
    setattr(model, "1", None)
    assert pager.resident_bytes == before - (64 * 64 + 64) * 4


def test_spread_placement_reports_the_working_set_of_one_op_not_a_sum_over_its_replans():
    # A layer of the model's own (x @ w1 @ w2) reads its weights in separate ops: one weight is the
    # working set, however often placement re-plans which equal layers to spread the offload over.
    from offtensor import placement

    layer_weights = [
        placement.Weight([f"layers.{i}.{name}"], 100_000, (100, 250), 100_000, fused=False)
        for i in range(12) for name in ("w1", "w2")
    ]
    total = 24 * 100_000
    plan = placement.choose_placement(layer_weights, budget_bytes=total - 6 * 100_000 + 2 * 100_000)
    assert plan.working_set_bytes == 100_000
    assert len(plan.offload) == 6
    offloaded_layers = sorted({int(w.name.split(".")[1]) for w in plan.offload})
    assert offloaded_layers != list(range(len(offloaded_layers)))  # spread, not the first layers

    # torch.nn's own modules may read all their tensors in one op (an LSTM layer's two weights);
    # a model's own module reads its same-rank weights one op at a time.
    for fused, expected in ((True, 200_000), (False, 100_000)):
        pair = [
            placement.Weight([f"rnn.weight_{part}_l0"], 100_000, (100, 250), 100_000, fused=fused)
            for part in ("ih", "hh")
        ]
        plan = placement.choose_placement(pair, budget_bytes=200_000, policy=["rnn.*"], prefetch=False)
        assert plan.working_set_bytes == expected and len(plan.offload) == 2


def test_placement_prefers_room_for_a_layers_routed_experts_but_runs_with_one():
    # One op pages one expert, so a budget with room for one expert is accepted; with prefetch,
    # when the budget allows, placement offloads more stacks to leave room for a layer's routed
    # experts (8 of each stack of the layer), which the expert cache fills in one go.
    from offtensor import placement

    expert = 10_000
    stacks = [
        placement.Weight([f"layers.{i}.mlp.experts.{name}"], 16 * expert, (16, 50, 50), expert, fused=False)
        for i in range(4) for name in ("gate_up_proj", "down_proj")
    ]
    total = sum(w.nbytes for w in stacks)
    roomy = placement.choose_placement(stacks, budget_bytes=total - 2 * 16 * expert + expert)
    assert roomy.working_set_bytes == expert
    assert total - roomy.offloaded_bytes + expert + 2 * 8 * expert <= roomy.budget_bytes
    tight = placement.choose_placement(stacks, budget_bytes=2 * expert)  # everything offloaded, one expert of room
    assert len(tight.offload) == len(stacks) and tight.working_set_bytes == expert


def test_a_last_tile_narrower_than_tile_align_keeps_the_whole_ops_bits(device):
    # 200 outputs in tiles of 16 left a last tile 8 wide, which MKL computes with another kernel on
    # some CPUs (an AVX-512 EPYC's float32 product of 24 rows summed it in another order): the last
    # tile is computed 16 wide, reaching back into the one before, and keeps its own 8 outputs.
    torch.manual_seed(0)
    budget = 16 * 64 * 4 + 256  # room for 16 rows (or columns) of 64 floats
    pager = Pager(torch.device(device), budget)
    x = torch.randn(24, 64, device=device)
    w = torch.randn(200, 64)
    ow = _offload_under(pager, w)
    w = w.to(device)
    assert torch.equal(F.linear(x, ow), F.linear(x, w))  # rows of a linear weight
    assert torch.equal(x @ ow.t(), x @ w.t())  # columns of mm's second operand
    assert torch.equal(ow @ x.t(), w @ x.t())  # rows of mm's first operand
    conv = torch.randn(200, 64, 1)
    oconv = _offload_under(pager, conv)
    image = x.t().unsqueeze(0)
    assert torch.equal(F.conv1d(image, oconv), F.conv1d(image, conv.to(device)))  # output channels
    before = pager.stats.bytes_h2d
    F.linear(x, ow)
    assert pager.stats.bytes_h2d - before == (200 + 8) * 64 * 4  # the 8 rows paged again, no more
    assert pager.stats.peak_device_bytes <= budget
