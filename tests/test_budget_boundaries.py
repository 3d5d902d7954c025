"""A budget that ``wrap_model`` accepts runs, and one it cannot run is refused at wrap time, with an
error naming the tensor or module and the bytes: each case at its boundary, the smallest budget
accepted (it runs, with the unwrapped model's results) and one byte less (refused)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import offtensor as ot
from offtensor.pager import BudgetError

GiB = 1 << 30


class _Stacked(torch.nn.Module):
    """A model's own module reading its 3-D weight (4 matrices of 64 x 64 floats, 65536 bytes) by
    ``op``: a stack of matrices, tiled a batch and then a few columns of one matrix at a time."""

    def __init__(self, op: str, shape=(4, 64, 64)):
        super().__init__()
        self.op = op
        self.w = torch.nn.Parameter(torch.randn(*shape, generator=torch.Generator().manual_seed(0)))
        self.register_buffer("bias", torch.randn(4, 8, shape[-1], generator=torch.Generator().manual_seed(1)),
                             persistent=False)

    def forward(self, x):
        if self.op == "bmm":
            return torch.bmm(x, self.w)
        if self.op == "baddbmm":
            return torch.baddbmm(self.bias.to(x.device), x, self.w, beta=0.5, alpha=2.0)
        if self.op == "baddbmm_row_bias":
            return torch.baddbmm(self.bias[0, 0].to(x.device), x, self.w)
        if self.op == "cdist":  # p=2 with more than 25 rows: the matrix-product form (_euclidean_dist)
            return torch.cdist(x, self.w)
        if self.op == "cdist_p1":  # _cdist_forward
            return torch.cdist(x, self.w, p=1.0)
        raise AssertionError(self.op)


def _wrap(model, budget: int, device):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # narrow-tile warnings: what is tested here is accept/refuse
        return ot.wrap_model(model, budget_gb=budget / GiB, device=device, prefetch=False, policy={"keep": ["bias"]})


# One column of one 64 x 64 float matrix: the least a tile of the stack pages; 16 of them (tiles
# TILE_ALIGN wide, bit-identical) the least that stays exact.
COLUMN = 64 * 4
EXACT = 16 * COLUMN


@pytest.mark.parametrize("op", ["bmm", "baddbmm", "baddbmm_row_bias", "cdist", "cdist_p1"])
def test_a_stacked_weight_read_by_bmm_baddbmm_or_cdist_runs_in_tiles_at_the_smallest_budget_wrap_accepts(op, device):
    x = torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(2)).to(device)
    resident = 4 * 8 * 64 * 4  # the bias, kept resident
    model = _Stacked(op).eval()
    reference = copy.deepcopy(model).to(device)
    model.bias = model.bias.to(device)
    _wrap(model, resident + EXACT, device)
    assert isinstance(model.w, ot.OffloadedTensor)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    assert ot.stats(model).peak_device_bytes <= resident + EXACT

    narrow = _Stacked(op).eval()
    narrow.bias = narrow.bias.to(device)
    _wrap(narrow, resident + COLUMN, device)  # one column at a time: runs, to BLAS's last bits
    with torch.no_grad():
        torch.testing.assert_close(narrow(x), reference(x), rtol=1e-5, atol=1e-5)

    with pytest.raises(BudgetError, match=rf"'w'.*needs .*\({COLUMN} bytes\)"):
        _wrap(_Stacked(op).eval(), resident + COLUMN - 1, device)


def test_a_stacked_weight_is_counted_at_a_tile_of_one_matrix_not_of_its_batches():
    from offtensor.placement import Weight, weight_tile

    own = Weight(["m.w"], 65536, (4, 64, 64), 65536, fused=False)
    assert weight_tile(own) == EXACT and weight_tile(own, 1) == COLUMN
    # A Conv1d's weight (out, in, kernel): convolution cuts output channels only.
    conv = Weight(["c.weight"], 65536, (4, 64, 64), 65536, fused=True)
    assert weight_tile(conv, 1) == 65536 // 4
    # Routed experts: _grouped_mm pages each expert whole.
    experts = Weight(["mlp.experts.w"], 65536, (4, 64, 64), 16384, fused=False)
    assert weight_tile(experts, 1) == 16384


def test_a_stacked_weight_of_four_or_five_dims_is_counted_at_no_less_than_one_convolution_kernel():
    # F.conv2d / F.conv3d may read a model's own 4-D or 5-D tensor: convolution cuts its weight down
    # to one input channel's kernel of one output channel, not within the kernel, so a tile of one
    # 3 x 3 matrix's rows (12 bytes) was accepted and the convolution raised BudgetError.
    from offtensor.placement import Weight, weight_tile

    conv2d = Weight(["m.w"], 32 * 8 * 9 * 4, (32, 8, 3, 3), 32 * 8 * 9 * 4, fused=False)
    assert weight_tile(conv2d, 1) == weight_tile(conv2d) == 9 * 4
    conv3d = Weight(["m.w"], 16 * 4 * 27 * 4, (16, 4, 3, 3, 3), 16 * 4 * 27 * 4, fused=False)
    assert weight_tile(conv3d, 1) == weight_tile(conv3d) == 27 * 4
    stack = Weight(["m.w"], 65536, (4, 64, 64), 65536, fused=False)  # three dims: a slice of a matrix, as before
    assert weight_tile(stack, 1) == COLUMN


TIGHT = 16 * 64 * 4 + 64 * 4  # a tile of 16 rows of a 64 x 64 linear weight, beside its whole bias


def _tight(device):
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)).eval()
    return ot.wrap_model(model, budget_gb=TIGHT / GiB, device=device, prefetch=False)


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_copy_of_a_tightly_wrapped_model_accepts_and_refuses_the_assignments_the_original_does(how, device, tmp_path):
    original = _tight(device)
    if how == "deepcopy":
        twin = copy.deepcopy(original)
    else:
        torch.save(original, tmp_path / "model.pt")
        twin = torch.load(tmp_path / "model.pt", weights_only=False)
    x = torch.randn(3, 64).to(device)
    for model in (original, twin):
        assert ot.stats(model).budget_bytes == TIGHT
        model[0].weight = torch.nn.Parameter(torch.randn(64, 64))  # a tile of it fits the room: accepted
        assert isinstance(model[0].weight, ot.OffloadedTensor)
        with torch.no_grad():
            model(x)
        # One row of 1024 inputs beside the bias fills the room (narrow tiles, warned); 1025 do not.
        with pytest.warns(UserWarning, match="narrow"):
            model[0].weight = torch.nn.Parameter(torch.randn(64, 1024))
        with torch.no_grad():
            model(torch.randn(3, 1024).to(device))
        with pytest.raises(BudgetError, match=r"0\.weight \(262400 bytes\) needs 4356 bytes.* 4352 of the budget"):
            model[0].weight = torch.nn.Parameter(torch.randn(64, 1025))
        assert model[0].weight.shape == (64, 1024)


def _linear_with_a_wide_bias(device, room=12000):
    """A 4 -> 1000 linear with a float64 bias, both offloaded: one column of its weight (4000 bytes)
    beside its bias (8000) fills a room of 12000 bytes."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 1000)).eval()
    model[0].bias.data = model[0].bias.data.double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ot.wrap_model(model, budget_gb=room / GiB, device=device, prefetch=False, policy={"offload": ["*"]})


def test_load_state_dict_with_assign_checks_the_whole_state_dict_against_the_room_first(device):
    # Fine as a whole (a float64 weight's column, 8000 bytes, beside a float16 bias, 2000), but the
    # weight beside the old float64 bias (16000) is not: each key is placed beside the new bias.
    model = _linear_with_a_wide_bias(device)
    fits = {"0.weight": torch.randn(1000, 4, dtype=torch.float64), "0.bias": torch.randn(1000, dtype=torch.float16)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.load_state_dict(fits, assign=True)
    assert (model[0].weight.dtype, model[0].bias.dtype) == (torch.float64, torch.float16)
    assert torch.equal(model[0].weight.cpu(), fits["0.weight"]) and torch.equal(model[0].bias.cpu(), fits["0.bias"])

    # Over as a whole (a complex128 bias, 16000 bytes, beside a float16 column of 2000): refused
    # before anything changes, naming the module and the bytes; the float16 weight that would fit is
    # not assigned either.
    model = _linear_with_a_wide_bias(device)
    before = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    over = {"0.weight": torch.randn(1000, 4, dtype=torch.float16), "0.bias": torch.randn(1000, dtype=torch.complex128)}
    with pytest.raises(BudgetError, match=r"'0\.bias' \(16000 bytes\) into module '0' needs 18000 bytes.* 12000 of"):
        model.load_state_dict(over, assign=True)
    after = model.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k].cpu(), v) for k, v in before.items())
    model.load_state_dict(fits, assign=True)  # the model still loads what fits
    assert model[0].bias.dtype == torch.float16


class _Body(torch.nn.Module):
    """A body whose LinearCrossEntropyLoss head (chunked: one kernel reads its linear's weight whole)
    comes after wrapping: attached, or given a new, larger weight."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(64, 64, bias=False)  # 16384 bytes

    def forward(self, x, y):
        return self.loss(self.body(x), y)


def _chunked_loss(classes: int) -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.LinearCrossEntropyLoss(64, classes, options=torch.nn.LinearCrossEntropyOptions())


def _loss_runs_as_unwrapped(model, reference, device) -> None:
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(2)).to(device)
    y = torch.randint(0, model.loss.num_classes, (8,), generator=torch.Generator().manual_seed(3)).to(device)
    with torch.no_grad():
        assert torch.equal(model(x, y), reference(x, y))
    assert ot.stats(model).peak_device_bytes <= ot.stats(model).budget_bytes


@pytest.mark.parametrize("how", ["attached", "assigned"])
def test_a_weight_a_fused_loss_reads_whole_placed_after_wrapping_is_counted_whole(device, how):
    # Its own Linear would be tiled (a tile of 16 rows is 4096 bytes), but the loss's chunked kernel
    # (torch_nn._linear_cross_entropy_batch_chunked) reads the 256 x 64 weight, 65536 bytes, whole:
    # the smallest budget that takes it is that, and one byte less is refused where it is placed.
    for budget in (65_535, 65_536):
        model = _Body()
        if how == "assigned":
            model.loss = _chunked_loss(64)  # 16384 bytes: wrap counts it whole beside the body
        ot.wrap_model(model, budget_gb=budget / GiB, device=device, prefetch=False, policy=["*"])
        head = _chunked_loss(256)
        reference = ot.unwrap_model(copy.deepcopy(model)).to(device)
        if how == "attached":
            reference.loss = copy.deepcopy(head).to(device)
        else:
            reference.loss.num_classes = 256
            reference.loss.linear.weight = torch.nn.Parameter(head.linear.weight.detach().clone().to(device))

        def place():
            if how == "attached":
                model.loss = head
            else:
                model.loss.num_classes = 256
                model.loss.linear.weight = head.linear.weight

        if budget < 65_536:
            with pytest.raises(BudgetError, match=r"loss\.linear\.weight \(65536 bytes\) needs 65536 bytes.*read whole"
                                                  r".*'loss'.*LinearCrossEntropyLoss.*only 65535"):
                place()
            if how == "assigned":  # nothing lost: the loss keeps its weight, and runs
                model.loss.num_classes = 64
                assert model.loss.linear.weight.shape == (64, 64)
                _loss_runs_as_unwrapped(model, ot.unwrap_model(copy.deepcopy(model)).to(device), device)
            continue
        place()
        assert isinstance(model.loss.linear.weight, ot.OffloadedTensor)
        _loss_runs_as_unwrapped(model, reference, device)


def test_an_offloaded_table_tied_into_a_fused_loss_after_wrapping_is_counted_whole(device):
    # An embedding table is paged by rows (256 bytes a row); tied as the chunked loss's linear
    # weight after wrapping, the loss's one kernel reads all of it, 65536 bytes: one byte less is
    # refused at the tie, naming both names, and the loss keeps its own weight.
    for budget in (65_535, 65_536):
        model = torch.nn.Module()
        model.embed = torch.nn.Embedding(256, 64)
        ot.wrap_model(model, budget_gb=budget / GiB, device=device, prefetch=False, policy=["*"])
        model.loss = torch.nn.LinearCrossEntropyLoss(64, 256, options=torch.nn.LinearCrossEntropyOptions(),
                                                     device="meta")
        assert isinstance(model.embed.weight, ot.OffloadedTensor)
        if budget < 65_536:
            with pytest.raises(BudgetError, match=r"loss\.linear\.weight \(65536 bytes, offloaded as 'embed\.weight'\)"
                                                  r" would be read whole.*LinearCrossEntropyLoss.*only 65535"):
                model.loss.linear.weight = model.embed.weight
            assert model.loss.linear.weight.is_meta
            continue
        model.loss.linear.weight = model.embed.weight
        reference = ot.unwrap_model(copy.deepcopy(model)).to(device)
        x = torch.randint(0, 256, (8,), generator=torch.Generator().manual_seed(2)).to(device)
        y = torch.randint(0, 256, (8,), generator=torch.Generator().manual_seed(3)).to(device)
        with torch.no_grad():
            assert torch.equal(model.loss(model.embed(x), y), reference.loss(reference.embed(x), y))
        assert ot.stats(model).peak_device_bytes <= budget
