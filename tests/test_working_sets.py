"""Working sets from what ops read: a table that forward reads in slices (a
buffer of the model's own module: SD3's cropped ``pos_embed``, a causal mask) costs the slice it
reads, not the whole table, when the whole table would leave no budget."""

from __future__ import annotations

import copy

import pytest
import torch

import offtensor as ot

GiB = 1 << 30


class _Cropped(torch.nn.Module):
    """A positional table read as a crop, as diffusers' PatchEmbed.cropped_pos_embed does."""

    def __init__(self, grid=64, width=32, whole=False):
        super().__init__()
        self.register_buffer("table", torch.randn(1, grid * grid, width, generator=torch.Generator().manual_seed(0)))
        self.proj = torch.nn.Linear(width, width)
        self.grid, self.whole = grid, whole

    def forward(self, x):  # x: (batch, side * side, width)
        side = int(x.shape[1] ** 0.5)
        table = self.table.reshape(1, self.grid, self.grid, -1)
        if self.whole == "reduced":  # a reduction of the whole table: no slice of it computes this
            return self.proj(x + self.table.mean(1, keepdim=True))
        crop = table if self.whole else table[:, 5:5 + side, 7:7 + side, :]
        return self.proj(x + crop.reshape(1, -1, crop.shape[-1])[:, : x.shape[1]])


BUDGET = 200_000  # the table is 524288 bytes, the crop of 8 x 8 x 32 floats 8192


def test_a_table_read_in_slices_is_offloaded_and_pages_only_the_slice(device):
    model = _Cropped().eval()
    reference = copy.deepcopy(model).to(device)
    with pytest.warns(UserWarning, match=r"'table' \(524288 bytes\) cannot be paged whole within the budget"):
        ot.wrap_model(model, budget_gb=BUDGET / GiB, device=device)
    assert isinstance(model.table, ot.OffloadedTensor)
    x = torch.randn(3, 64, 32, generator=torch.Generator().manual_seed(1)).to(device)
    ot.reset_stats(model)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    s = ot.stats(model)
    assert s.bytes_h2d == 8 * 8 * 32 * 4, s
    assert s.peak_device_bytes <= s.budget_bytes


def test_a_table_read_whole_beyond_the_room_raises_naming_it_and_a_parameter_is_refused_at_wrap(device):
    # Read whole by a pointwise op (x + table), it runs in slices that fit, bit-identically.
    model = _Cropped(whole=True).eval()
    reference = copy.deepcopy(model).to(device)
    with pytest.warns(UserWarning, match="cannot be paged whole"):
        ot.wrap_model(model, budget_gb=BUDGET / GiB, device=device)
    x = torch.randn(1, 64 * 64, 32).to(device)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    assert ot.stats(model).peak_device_bytes <= BUDGET
    # Read whole by a sum, it runs on the host master: the op itself on the emulated device; on a GPU
    # the CPU's kernel, with a warning naming it.
    model = _Cropped(whole="reduced").eval()
    reference = copy.deepcopy(model).to(device)
    with pytest.warns(UserWarning, match="cannot be paged whole"):
        ot.wrap_model(model, budget_gb=BUDGET / GiB, device=device)
    if device == "cpu":
        with torch.no_grad():
            assert torch.equal(model(x), reference(x))
    else:
        with torch.no_grad(), pytest.warns(UserWarning, match=r"'table'.*on the host"):
            torch.testing.assert_close(model(x), reference(x))
    assert ot.stats(model).peak_device_bytes <= BUDGET
    assert torch.equal(model.table.cpu(), _Cropped().table)  # nothing lost
    # A Parameter is read whole by a model's own code as often as not (ViT's ``x + pos_embed``):
    # it keeps its whole working set, and the budget is refused at wrap, as before.
    as_parameter = _Cropped()
    as_parameter.table = torch.nn.Parameter(as_parameter.table)
    with pytest.raises(ot.BudgetError, match=r"paging 'table' needs 524\.29 kB \(524288 bytes\)"):
        ot.wrap_model(as_parameter, budget_gb=BUDGET / GiB, device=device)
