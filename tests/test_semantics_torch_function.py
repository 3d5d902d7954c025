"""OffloadedTensor semantics, the table's ``__torch_function__`` rows (docs/design.md, "The tensor
and its semantics"): linear and the matrix products are intercepted with one page-in each, agree
with the dispatch path, and return plain tensors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import offtensor as ot
from offtensor import OffloadedTensor
from offtensor import ops as ot_ops

from test_semantics import assert_same_values, counters, fresh_pager, nbytes


# ------------------------------------------------------------------------------------------------
# __torch_function__
# ------------------------------------------------------------------------------------------------


def test_torch_function_intercepts_linear_with_one_page_in(device, monkeypatch):
    weight, bias = torch.randn(5, 3), torch.randn(5)
    pager = fresh_pager(device)
    offloaded = ot.offload(weight, pager=pager)
    inputs = torch.randn(2, 3, device=device)
    dispatched = []
    real_dispatch = ot_ops.torch_dispatch

    def counting_dispatch(func, types, args, kwargs):
        dispatched.append(func)
        return real_dispatch(func, types, args, kwargs)

    monkeypatch.setattr(OffloadedTensor, "_op_dispatch", staticmethod(counting_dispatch))
    before = counters(pager)
    with torch.no_grad():
        result = F.linear(inputs, offloaded, bias.to(device))
    # One page-in of the weight and no aten op dispatched on the OffloadedTensor (not t + addmm).
    assert dispatched == []
    assert counters(pager)[0] - before[0] == 1
    assert counters(pager)[1] - before[1] == nbytes(weight)
    assert type(result) is torch.Tensor
    assert_same_values(result, F.linear(inputs, weight.to(device), bias.to(device)))


MATRIX_PRODUCTS = {
    # name: (fn(x2, x3, x3_strided, v, w, w_t, stack), intercepted at __torch_function__)
    "x @ w.t()": (lambda x2, x3, x3s, v, w, wt, st: x2 @ wt, True),
    "matmul": (lambda x2, x3, x3s, v, w, wt, st: torch.matmul(x2, wt), True),
    "mm": (lambda x2, x3, x3s, v, w, wt, st: torch.mm(x2, wt), True),
    "Tensor.mm": (lambda x2, x3, x3s, v, w, wt, st: x2.mm(wt), True),
    "3-D contiguous @ w.t()": (lambda x2, x3, x3s, v, w, wt, st: x3 @ wt, True),
    "1-D @ w.t()": (lambda x2, x3, x3s, v, w, wt, st: v @ wt, True),
    "w @ 1-D": (lambda x2, x3, x3s, v, w, wt, st: w @ v, True),
    "w @ w.t(), both offloaded": (lambda x2, x3, x3s, v, w, wt, st: w @ wt, True),
    "3-D strided @ w.t()": (lambda x2, x3, x3s, v, w, wt, st: x3s @ wt, False),
    "w @ 3-D": (lambda x2, x3, x3s, v, w, wt, st: w @ x3.transpose(1, 2), False),
    "2-D @ 3-D stack": (lambda x2, x3, x3s, v, w, wt, st: x2 @ st, False),
    "mm of a vector": (lambda x2, x3, x3s, v, w, wt, st: _error_of(lambda: torch.mm(v, wt)), False),
}


def _error_of(fn):
    try:
        fn()
    except RuntimeError as error:
        return str(error)
    raise AssertionError("expected an error")


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("name", list(MATRIX_PRODUCTS))
def test_matmul_intercept_matches_the_dispatch_path(device, monkeypatch, name, requires_grad):
    """torch.matmul / mm / @ of an OffloadedTensor, intercepted at __torch_function__ where that
    pages the same bytes in one op: the results (bitwise), page-ins, bytes and cache hits are those
    of the same call with the intercept removed, and of plain tensors."""
    fn, intercepted = MATRIX_PRODUCTS[name]
    weight, stack = torch.randn(6, 5), torch.randn(3, 5, 6)
    inputs = [t.to(device) for t in (torch.randn(4, 5), torch.randn(2, 4, 5), torch.randn(4, 2, 5).transpose(0, 1), torch.randn(5))]

    def run(intercept: bool):
        pager = fresh_pager(device, budget_bytes=1 << 20)
        w = ot.offload(weight, pager=pager)
        w = nn.Parameter(w) if requires_grad else w  # matmul's folding reads requires_grad even under no_grad
        st = ot.offload(stack, pager=pager)
        with torch.no_grad():
            args = (*inputs, w, w.t(), st)
            fn(*args)  # the first call pages; the second hits the cache
            before = (*counters(pager), pager.stats.hits)
            dispatched = []
            real_dispatch = ot_ops.torch_dispatch
            with monkeypatch.context() as patch:
                if not intercept:
                    for function in (torch.matmul, torch.Tensor.matmul, torch.mm, torch.Tensor.mm):
                        patch.delitem(ot_ops.FUNCTION_TABLE, function)
                patch.setattr(OffloadedTensor, "_op_dispatch",
                              staticmethod(lambda f, *a: dispatched.append(f) or real_dispatch(f, *a)))
                result = fn(*args)
        after = (*counters(pager), pager.stats.hits)
        return result, [a - b for a, b in zip(after, before)], dispatched

    result, paged, dispatched = run(intercept=True)
    expected, expected_paged, expected_dispatched = run(intercept=False)
    assert paged == expected_paged
    if isinstance(expected, str):
        assert result == expected
        return
    assert expected_dispatched, "the dispatch path dispatches on the OffloadedTensor"
    assert (dispatched == []) == intercepted
    assert type(result) is torch.Tensor and result.dtype == expected.dtype
    assert torch.equal(result, expected)
    plain = fn(*inputs, weight.to(device), weight.to(device).t(), stack.to(device))
    assert_same_values(result, plain)


def test_torch_function_is_disabled_so_results_are_plain_tensors(device):
    x = ot.offload(torch.randn(3, 3), device=device)
    for result in (x + 1, torch.matmul(x, x), x.sum(), torch.cat([x, x]), F.softmax(x, -1), torch.stack([x, x])):
        assert type(result) is torch.Tensor
        assert result.device == x.device
