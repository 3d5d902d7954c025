"""Output tiles of a bfloat16 product keep the whole product's CPU kernel. torch's CPU matmul runs
oneDNN's bf16 GEMM only for products of 16**3 multiply-adds or more and another kernel below, and
the two round some sums otherwise (about one product in a few hundred, in the last bit). A tile of
a product above that size cut below it differed from the whole op without a warning: beam search
on a bfloat16 granite model at 12 % of its bytes, whose 3-beam decode step multiplies a (3, 32)
input by a (96, 32) LM head, paged in tiles of 64 and 32 rows. Tiles are cut evenly now, each
above that size where the room allows (48 and 48 rows there), and where it does not, a tile's
input is grown with rows of zeros past that size, so the tile runs the whole product's kernel."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import offtensor as ot


@pytest.fixture
def one_thread():
    """One compute thread, as the tests run on two cores (two threads showed the same)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class _Head(nn.Module):
    """A (96, 32) LM head, read by F.linear, or as a row-major (32, 96) weight by mm (addmm: with a
    bias of 96)."""

    def __init__(self, weight: torch.Tensor, op: str, bias=None):
        super().__init__()
        self.weight, self.op = nn.Parameter(weight), op
        self.bias = None if bias is None else nn.Parameter(bias)

    def forward(self, x):
        if self.op == "linear":
            return nn.functional.linear(x, self.weight)
        return torch.mm(x, self.weight) if self.op == "mm" else torch.addmm(self.bias, x, self.weight)


def _exact_within(model: nn.Module, x: torch.Tensor, budget_bytes: int, device) -> None:
    """``model`` wrapped at ``budget_bytes``, every tensor offloaded, gives its unwrapped copy's
    output bit for bit within the budget."""
    reference = copy.deepcopy(model)
    ot.wrap_model(model, budget_gb=budget_bytes / 2**30, device=device, policy={"offload": ["*"]})
    with torch.no_grad():
        got, expected = model(x), reference(x)
    assert torch.equal(got, expected)
    stats = ot.stats(model)
    assert 0 < stats.peak_device_bytes <= stats.budget_bytes


@pytest.mark.parametrize("op, seed", [("linear", 356), ("mm", 1254)])
def test_bfloat16_tiles_of_a_product_large_enough_for_onednn_give_the_whole_ops_bits(op, seed, device, one_thread):
    if device != "cpu":
        pytest.skip("the kernel choice is torch's CPU matmul's")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 32, generator=g).bfloat16()  # (seeds at which the two kernels differ for these values)
    weight = torch.randn(*((96, 32) if op == "linear" else (32, 96)), generator=g).bfloat16()
    # Room for 64 of the 96 rows (or columns) of 64 bytes: tiles of 64 and 32 before, 48 and 48 now.
    _exact_within(_Head(weight, op), x, 5000, device)


def test_tiles_below_onednn_size_and_float32_tiles_are_cut_as_before(device):
    """Cuts change only where the whole product is large enough and its dtype is bfloat16 or
    float16: a float32 head, and a single decode row (3 x 32 x 96 / 3 multiply-adds), keep their
    tiles of 64 and 32."""
    from offtensor.ops import tiling

    weight = ot.offload(torch.randn(96, 32))
    assert tiling._same_kernel_width(weight, 3 * 32, 96) == 0
    half = ot.offload(torch.randn(96, 32).bfloat16())
    assert tiling._same_kernel_width(half, 1 * 32, 96) == 0  # 3072 multiply-adds: no oneDNN for the whole op
    assert tiling._same_kernel_width(half, 3 * 32, 96) == (43 if half._master.pager.device.type == "cpu" else 0)
    assert tiling._even_bounds(96, 2, 64, 43) == [0, 48, 96]
    assert tiling._even_bounds(200, 4, 64, 43) == [0, 48, 96, 144, 200]
    assert tiling._even_bounds(96, 2, 40, 43) is None  # no room for such tiles: cut as before


@pytest.mark.parametrize("op, seed", [("linear", 32), ("mm", 612), ("addmm", 10)])
def test_bfloat16_tiles_the_room_leaves_below_onednn_size_run_its_kernel_on_rows_grown_with_zeros(op, seed, device,
                                                                                                 one_thread):
    """A 2-beam decode step's (2, 32) input against a (96, 32) LM head (6144 multiply-adds, oneDNN's)
    in a room for 64 rows: tiles wide enough for oneDNN (65 rows each) do not fit, and tiles of 64
    and 32 rows (48 and 48 beside addmm's bias) ran the other kernel. On a CPU with AMX nearly every output of the first 64 then
    differed from the whole op's in the last bit (a bfloat16 arcee model's beam sampling at 12 % of
    its bytes). Each tile's input now has rows of zeros up to oneDNN's size, and keeps its own. (Seeds
at which those tiles differ from the whole product on such a CPU, one draw in a thousand.)"""
    if device != "cpu":
        pytest.skip("the kernel choice is torch's CPU matmul's")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 32, generator=g).bfloat16()
    weight = torch.randn(*((96, 32) if op == "linear" else (32, 96)), generator=g).bfloat16()
    bias = torch.randn(96, generator=g).bfloat16() if op == "addmm" else None
    _exact_within(_Head(weight, op, bias), x, 64 * 64 + 60, device)  # room for 64 rows (or columns) of 64 bytes


def test_a_product_of_exactly_onednn_size_runs_the_other_kernel_whole_and_in_tiles(device):
    """torch runs oneDNN for more than 16**3 multiply-adds: a product of exactly that many runs the
    other kernel whole, so its tiles are left as they are (grown, they would run oneDNN)."""
    from offtensor.ops import tiling

    half = ot.offload(torch.randn(64, 32).bfloat16())
    assert tiling._same_kernel_width(half, 2 * 32, 64) == 0  # 4096 multiply-adds: not oneDNN's
    assert tiling._same_kernel_width(half, 2 * 32, 65) == (65 if half._master.pager.device.type == "cpu" else 0)
    grown = tiling._with_rows(torch.ones(2, 4), 5)
    assert grown.shape == (5, 4) and torch.equal(grown[:2], torch.ones(2, 4)) and not grown[2:].any()
