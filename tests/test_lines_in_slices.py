"""Ops along a dim of a weight larger than the budget's free room run in slices across that dim
(``softmax``, scans, ``sort``, ``topk``, ``argmax(dim)``, ``var(dim)``...), composites such as
``allclose`` run as their parts, and pointwise ops on a transposed weight slice it along its
outermost dim in memory. Before, each paged the weight whole and raised ``BudgetError`` at a budget
wrap had accepted: a weight stored transposed could not even take its optimizer's step."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
from torch import nn

import offtensor as ot
from offtensor import BudgetError

GiB = 1024**3
BUDGET = 12 * 1024  # room for a quarter of the 32 KiB weight, never the whole


class _Holder(nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.w = nn.Parameter(weight)

    def forward(self, x):
        return x @ self.w


def _weights():
    torch.manual_seed(0)
    return {"row-major": torch.randn(64, 128), "transposed": torch.randn(128, 64).t()}


def _wrapped(weight, device):
    model = _Holder(_plain(weight, "cpu"))
    ot.wrap_model(model, budget_gb=BUDGET / GiB, device=device)
    assert isinstance(model.w, ot.OffloadedTensor)
    assert model.w.numel() * 4 > model.w._master.pager.free_bytes()  # (what the test is about)
    return model


def _plain(weight, device):
    """A copy of ``weight`` in its own layout."""
    return (weight.clone() if weight.is_contiguous() else weight.t().clone().t()).to(device)


def _outputs(result):
    return list(result) if isinstance(result, (tuple, list)) else [result]


# Ops that select or compare: bit for bit, with no warning, in any layout.
SELECTIONS = {
    "sort(0, descending)": lambda w: w.sort(0, descending=True),
    "argsort(-1)": lambda w: w.argsort(-1),
    "topk(5, dim=0)": lambda w: w.topk(5, dim=0),
    "topk(3)": lambda w: w.topk(3),
    "kthvalue(3, 1)": lambda w: w.kthvalue(3, 1),
    "median(0)": lambda w: w.median(0),
    "mode(1)": lambda w: w.mode(1),
    "argmax(0)": lambda w: w.argmax(0),
    "argmax(1, keepdim)": lambda w: w.argmax(1, keepdim=True),
    "max(0)": lambda w: w.max(0),
    "min(1, keepdim)": lambda w: w.min(1, keepdim=True),
    "aminmax(dim=0)": lambda w: w.aminmax(dim=0),
    "cummax(0)": lambda w: w.cummax(0),
    "cummin(1)": lambda w: w.cummin(1),
}
# Ops that compute: bit for bit with no warning over whole rows of a row-major weight.
ROWS = {
    "softmax(-1)": lambda w: w.softmax(-1),
    "log_softmax(-1)": lambda w: w.log_softmax(-1),
    "cumsum(-1)": lambda w: w.cumsum(-1),
    "var(-1)": lambda w: w.var(-1),
    "logsumexp(-1)": lambda w: w.logsumexp(-1),
}
# Anywhere else a kernel may vectorise a narrower slice otherwise: close, and a warning names the weight.
ELSEWHERE = {
    "softmax(0)": lambda w: w.softmax(0),
    "cumsum(0)": lambda w: w.cumsum(0),
    "std(0, keepdim)": lambda w: w.std(0, keepdim=True),
    "prod(0)": lambda w: w.prod(0),
}


@pytest.mark.parametrize("layout", ["row-major", "transposed"])
@pytest.mark.parametrize("name", sorted(SELECTIONS))
def test_an_op_that_selects_along_a_dim_of_a_weight_larger_than_the_room_gives_its_result_bit_for_bit(name, layout, device):
    weight = _weights()[layout]
    model = _wrapped(weight, device)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # bit for bit: nothing to warn about
        got = SELECTIONS[name](model.w)
    expected = SELECTIONS[name](_plain(weight, device))
    for g, e in zip(_outputs(got), _outputs(expected)):
        assert type(g) is torch.Tensor and g.shape == e.shape and torch.equal(g, e)
    pager = model.w._master.pager
    assert pager.stats.peak_device_bytes <= pager.budget_bytes


@pytest.mark.parametrize("name", sorted(ROWS))
def test_an_op_over_whole_rows_of_a_weight_larger_than_the_room_gives_its_result_bit_for_bit(name, device):
    weight = _weights()["row-major"]
    model = _wrapped(weight, device)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        got = ROWS[name](model.w)
    assert torch.equal(got, ROWS[name](_plain(weight, device)))


@pytest.mark.parametrize("layout", ["row-major", "transposed"])
@pytest.mark.parametrize("name", sorted(ELSEWHERE))
def test_an_op_computing_across_slices_it_may_vectorise_otherwise_warns_naming_the_weight(name, layout, device):
    weight = _weights()[layout]
    model = _wrapped(weight, device)
    with torch.no_grad(), pytest.warns(UserWarning, match="'w'.*in slices across the lines"):
        got = ELSEWHERE[name](model.w)
    expected = ELSEWHERE[name](_plain(weight, device))
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_softmax_of_a_weight_larger_than_the_room_trains_as_the_unwrapped_one(device):
    """The forward runs in slices below autograd; its backward reads the saved output only."""
    weight = _weights()["row-major"]
    model = _wrapped(weight, device)
    plain = _plain(weight, device).requires_grad_()
    x = torch.randn(3, 64, device=device)
    (x @ model.w.softmax(-1)).square().sum().backward()
    (x @ plain.softmax(-1)).square().sum().backward()
    assert torch.equal(model.w.grad, plain.grad)


@pytest.mark.parametrize("layout", ["row-major", "transposed"])
def test_a_transposed_weight_larger_than_the_room_takes_its_optimizer_step_as_the_unwrapped_one(layout, device):
    """``param.add_(grad)`` in slices along its outermost dim in memory: a row of a transposed weight
    spans nearly all of it, so rows never fit where its columns do."""
    weight = _weights()[layout]
    model = _wrapped(weight, device)
    plain = _Holder(_plain(weight, device))
    x = torch.randn(3, 64, device=device)
    for m in (model, plain):
        optimizer = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        for _ in range(2):
            m(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        with torch.no_grad():
            m.w.mul_(0.5).clamp_(-1, 1)
    assert torch.equal(model(x), plain(x))
    if device == "cpu":  # the CPU generator draws slices in memory order as one draw does (a GPU's does not)
        for m in (model, plain):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (the warning that a GPU would draw other values)
                nn.init.uniform_(m.w, generator=torch.Generator().manual_seed(1))
    assert torch.equal(model(x), plain(x))
    assert torch.equal(model.w.materialize(), plain.w)


def test_allclose_and_isclose_of_a_weight_larger_than_the_room_run_as_their_parts(device):
    weight = _weights()["row-major"]
    model = _wrapped(weight, device)
    plain = _plain(weight, device)
    with torch.no_grad():
        assert torch.allclose(model.w, plain) and not torch.allclose(model.w, plain + 1e-3)
        assert torch.equal(torch.isclose(model.w, plain.round()), torch.isclose(plain, plain.round()))


def test_an_empty_out_tensor_of_a_pointwise_op_on_a_weight_larger_than_the_room_gets_the_whole_result(device):
    """The op sizes an empty ``out=`` as torch does; slices must not each resize it to their own shape
    (a composite's result reached the pieces as such an empty tensor: ``abs`` gave 14 of 64 rows)."""
    weight = _weights()["row-major"]
    model = _wrapped(weight, device)
    out = torch.empty(0, device=device)
    with torch.no_grad():
        torch.abs(model.w, out=out)
        assert torch.equal(out, weight.to(device).abs())
        assert torch.equal(model.w.abs(), weight.to(device).abs())


@pytest.mark.skipif(sys.version_info < (3, 11), reason="the points are 3.11's bytecodes")
@pytest.mark.parametrize("name", ["sort(0, descending)", "softmax(0)", "sum(1)", "abs()"])
def test_an_interrupt_at_any_point_of_an_op_in_slices_leaves_the_pager_free_for_the_next(name, device):
    """Ctrl-C anywhere in the slicing (its loop, a slice's page and release, the copy into the
    result), here and in the reductions and pointwise ops cut the same way: each slice's copy is
    released, so the same op run again pages within the budget and gives the result."""
    from test_interrupts_more import _Points, _points

    op = {**SELECTIONS, **ELSEWHERE, "sum(1)": lambda w: w.sum(1), "abs()": lambda w: w.abs()}[name]
    weight = _weights()["row-major"]
    model = _wrapped(weight, device)
    expected = _outputs(op(_plain(weight, device)))
    pager = model.w._master.pager

    def run():
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (softmax(0)'s and sum's: results may differ in the last bits)
            return _outputs(op(model.w))

    def ours(code) -> bool:
        return "offtensor" in code.co_filename and "ops" in code.co_filename

    points = _points(run, ours)
    assert points > 20
    struck = 0
    for n in range(1, points + 1):
        # (a run after the first finds copies cached and may pass fewer points: the last ones miss)
        struck += _Points(n, ours).run(run) is not None
        for got, e in zip(run(), expected):
            torch.testing.assert_close(got, e, rtol=1e-5, atol=1e-6)
        assert pager.stats.peak_device_bytes <= pager.budget_bytes
    assert struck > points // 2
