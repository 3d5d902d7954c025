"""OffloadedTensor semantics, the table's in-place and ``out=`` rows (docs/design.md, "The tensor
and its semantics"): writes reach the host master and every alias, an offloaded source is left
alone, ``out=`` writes through, every mutated argument of foreach, amp's unscale, a custom op and
batch norm's training step is written back, and in-place view ops change only metadata. As in
test_semantics.py, each test compares with the same ops on a plain tensor."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import offtensor as ot
from offtensor import OffloadedTensor

from test_semantics import assert_same_values, counters, fresh_pager, host_values


# ------------------------------------------------------------------------------------------------
# in-place and out= ops
# ------------------------------------------------------------------------------------------------


def test_inplace_writes_through_to_every_alias(device):
    reference = torch.randn(6, 8)
    x = ot.offload(reference, device=device)
    reference = reference.to(device)
    aliases = [x, x[1:3], x.t(), x.view(-1), x[:, ::3]]
    ref_aliases = [reference, reference[1:3], reference.t(), reference.view(-1), reference[:, ::3]]

    returned = x.mul_(2)
    reference.mul_(2)
    assert returned is x  # in-place ops return their input object
    returned = aliases[2][3:5].add_(torch.arange(6.0, device=device))
    ref_aliases[2][3:5].add_(torch.arange(6.0, device=device))
    assert isinstance(returned, OffloadedTensor)
    aliases[4].clamp_(max=0.5)
    ref_aliases[4].clamp_(max=0.5)

    for alias, ref in zip(aliases, ref_aliases):
        assert_same_values(host_values(alias), ref)
        assert_same_values(alias + 0, ref)


def test_inplace_op_with_offloaded_source_leaves_the_source_alone(device):
    reference = torch.randn(5)
    x = ot.offload(reference, device=device)
    target = torch.ones(5, device=device)
    target.add_(x)
    assert_same_values(target, 1 + reference)
    assert_same_values(host_values(x), reference)


def test_setitem_index_put_and_index_copy_write_through(device):
    reference = torch.zeros(5, 3, device=device)
    x = ot.offload(reference, device=device)
    view = x[2:]
    for target in (x, reference):
        target[1:3] = 5.0
        target[torch.tensor([0], device=device)] = torch.ones(3, device=device)
        target.index_copy_(0, torch.tensor([4], device=device), torch.full((1, 3), 7.0, device=device))
        target.masked_fill_(target > 6, -1.0)
    assert_same_values(host_values(x), reference)
    assert_same_values(host_values(view), reference[2:])


def test_copy_into_offloaded_writes_the_host_without_paging(device):
    pager = fresh_pager(device)
    x = ot.offload(torch.zeros(4, 3), pager=pager)
    source = torch.randn(4, 3, device=device)
    before = counters(pager)
    assert x.copy_(source) is x
    x[1].copy_(source[3])  # narrow().copy_, as weight loaders do
    expected = source.clone()
    expected[1] = source[3]
    assert_same_values(host_values(x), expected)
    assert counters(pager) == before


def test_non_blocking_copy_from_the_device_is_visible_at_once(device):
    # A weight loader's copy_(..., non_blocking=True) must not leave the master half written.
    source = torch.randn(256, 256, device=device)
    x = ot.offload(torch.zeros(256, 256), device=device)
    x.copy_(source, non_blocking=True)
    assert_same_values(x.cpu(), source)
    assert_same_values(x * 1, source)


def test_out_variant_writes_through(device):
    a, b = torch.randn(4, 3, device=device), torch.randn(4, 3, device=device)
    out = ot.offload(torch.zeros(4, 3), device=device)
    alias = out.t()
    returned = torch.add(a, b, out=out)
    assert returned is out
    assert_same_values(host_values(out), a + b)
    assert_same_values(host_values(alias), (a + b).t())
    # An out= view writes only its part of the master.
    torch.mul(a[1], 10, out=out[1])
    expected = a + b
    expected[1] = a[1] * 10
    assert_same_values(host_values(out), expected)


def test_out_variant_with_offloaded_inputs_and_output(device):
    reference = torch.randn(3, 3)
    x = ot.offload(reference, device=device)
    out = ot.offload(torch.zeros(3, 3), device=device)
    torch.matmul(x, x.t(), out=out)
    assert_same_values(host_values(out), reference @ reference.t())


def test_every_mutated_argument_is_written_back_by_foreach(device):
    first, second = torch.randn(3), torch.randn(2, 2)
    xs = [ot.offload(first, device=device), ot.offload(second, device=device)]
    torch._foreach_add_(xs, 1.5)
    torch._foreach_mul_(xs, [2.0, -1.0])
    assert_same_values(host_values(xs[0]), (first + 1.5) * 2)
    assert_same_values(host_values(xs[1]), (second + 1.5) * -1)


def test_every_mutated_argument_is_written_back_by_amp_unscale(device):
    # Three mutated arguments: both gradients and found_inf.
    grads = [torch.tensor([2.0, 4.0]), torch.tensor([6.0, float("inf")])]
    offloaded = [ot.offload(g, device=device) for g in grads]
    found_inf = ot.offload(torch.zeros(1), device=device)
    reference_found_inf = torch.zeros(1, device=device)
    reference_grads = [g.to(device) for g in grads]
    inv_scale = torch.tensor([0.5], device=device)
    torch._amp_foreach_non_finite_check_and_unscale_(offloaded, found_inf, inv_scale)
    torch._amp_foreach_non_finite_check_and_unscale_(reference_grads, reference_found_inf, inv_scale)
    for got, expected in zip(offloaded, reference_grads):
        assert_same_values(host_values(got), expected)
    assert_same_values(host_values(found_inf), reference_found_inf)


@torch.library.custom_op("offtensor_tests::add_one_and_double", mutates_args=("a", "b"))
def _add_one_and_double(a: torch.Tensor, b: torch.Tensor) -> None:
    a.add_(1)
    b.mul_(2)


def test_every_mutated_argument_is_written_back_by_a_custom_op(device):
    a, b = torch.randn(3), torch.randn(2, 3)
    xa, xb = ot.offload(a, device=device), ot.offload(b, device=device)
    view_of_b = xb[1]
    _add_one_and_double(xa, xb)
    assert_same_values(host_values(xa), a + 1)
    assert_same_values(host_values(xb), b * 2)
    assert_same_values(host_values(view_of_b), b[1] * 2)


def test_every_mutated_argument_is_written_back_by_batch_norm_training(device):
    torch.manual_seed(0)
    reference = nn.BatchNorm1d(3).to(device)
    with torch.no_grad():
        reference.weight.uniform_()
        reference.running_var.fill_(2.0)
    offloaded = copy.deepcopy(reference)
    for name in ("running_mean", "running_var"):
        setattr(offloaded, name, ot.offload(getattr(reference, name), device=device))
    offloaded.weight = nn.Parameter(ot.offload(reference.weight.detach(), device=device))
    for _ in range(2):
        inputs = torch.randn(6, 3, device=device)
        torch.testing.assert_close(offloaded(inputs), reference(inputs))
    # Training updated both running statistics in place: both were written back.
    torch.testing.assert_close(host_values(offloaded.running_mean), reference.running_mean.cpu())
    torch.testing.assert_close(host_values(offloaded.running_var), reference.running_var.cpu())
    offloaded.eval()
    reference.eval()
    inputs = torch.randn(4, 3, device=device)
    torch.testing.assert_close(offloaded(inputs), reference(inputs))


INPLACE_VIEW_OPS = {
    "t_": lambda a: a.t_(),
    "transpose_": lambda a: a.transpose_(0, 2),
    "swapdims_": lambda a: a.swapdims_(1, 2),
    "squeeze_": lambda a: a.squeeze_(),
    "squeeze_dim_": lambda a: a.squeeze_(1),
    "unsqueeze_": lambda a: a.unsqueeze_(0),
    "as_strided_": lambda a: a.as_strided_((2, 2), (1, 3), 1),
}


@pytest.mark.parametrize("op", list(INPLACE_VIEW_OPS))
def test_inplace_view_ops_change_metadata(device, op):
    inplace_view = INPLACE_VIEW_OPS[op]
    reference = torch.randn(3, 1, 4) if op != "t_" else torch.randn(3, 4)
    pager = fresh_pager(device)
    x = ot.offload(reference, pager=pager)
    other_alias = x[:]
    reference = reference.clone()
    ref_other_alias = reference[:]
    before = counters(pager)

    assert inplace_view(x) is x
    inplace_view(reference)
    assert (x.shape, x.stride(), x.storage_offset()) == (reference.shape, reference.stride(), reference.storage_offset())
    assert x._host.shape == reference.shape and x._host.stride() == reference.stride()
    assert_same_values(host_values(x), reference)
    assert_same_values(x * 1, reference)
    # Only self changes: another alias keeps its own metadata.
    assert (other_alias.shape, other_alias.stride()) == (ref_other_alias.shape, ref_other_alias.stride())
    assert counters(pager)[0] - before[0] == 1  # only the x * 1 above paged
