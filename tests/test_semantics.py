"""OffloadedTensor semantics, one or more tests per row of the semantics table in docs/design.md
("The tensor and its semantics").

Every test builds a plain tensor, offloads a copy of it, does the same thing to both and compares;
byte counts are derived from shapes. Pager counters (``page_ins``, ``bytes_h2d``) show what was
paged. Tests that count bytes use a fresh pager of their own so that no other tensor shares the
counters. The emulated device (cpu) takes the same code path as cuda; ``OFFTENSOR_TEST_DEVICE=cuda``
runs the same tests on a GPU.
"""

from __future__ import annotations

import copy
import gc
import io
import pickle
import zipfile

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import offtensor as ot
from offtensor import OffloadedTensor, _ext
from offtensor import ops as ot_ops
from offtensor.pager import BudgetError, Pager, resolve_device


def fresh_pager(device, budget_bytes=None) -> Pager:
    return Pager(resolve_device(device), budget_bytes=budget_bytes)


def counters(pager: Pager):
    # pager.stats is replaced by reset_stats, so always read it through the pager.
    return pager.stats.page_ins, pager.stats.bytes_h2d


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def host_values(t: OffloadedTensor) -> torch.Tensor:
    """The values in the host master, read without any op on the OffloadedTensor."""
    return t._host.clone()


def assert_same_values(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # Default tolerances (exact for integers): a reference computed on the CPU may round
    # differently from the same op on a GPU.
    torch.testing.assert_close(actual.detach().cpu(), expected.detach().cpu())


# ------------------------------------------------------------------------------------------------
# metadata
# ------------------------------------------------------------------------------------------------


def test_metadata_is_answered_without_paging(device):
    # A transposed original: the host master keeps its memory order, so strides match too.
    reference = torch.randn(8, 6).t()
    pager = fresh_pager(device)
    x = ot.offload(reference, pager=pager)
    before = counters(pager)
    assert x.shape == reference.shape
    assert x.size(1) == reference.size(1)
    assert x.stride() == reference.stride()
    assert x.storage_offset() == reference.storage_offset()
    assert x.dtype == reference.dtype
    assert x.dim() == reference.dim()
    assert x.numel() == reference.numel()
    assert x.element_size() == reference.element_size()
    assert x.is_contiguous() == reference.is_contiguous()
    assert x.requires_grad == reference.requires_grad
    assert x.device == resolve_device(device)
    assert len(x) == len(reference)
    assert counters(pager) == before


def test_device_is_the_target_device_and_results_land_there(device):
    target = resolve_device(device)
    x = ot.offload(torch.randn(3, 4), device=device)
    assert x.device == target
    assert x.is_cuda == (target.type == "cuda")
    # The emulated device takes the cuda code path; results are plain tensors on the target device.
    result = x * 2
    assert type(result) is torch.Tensor
    assert result.device == target


def test_requires_grad_is_kept_from_the_original(device):
    x = ot.offload(torch.randn(3, requires_grad=True), device=device)
    assert x.requires_grad and x.is_leaf


# ------------------------------------------------------------------------------------------------
# view ops
# ------------------------------------------------------------------------------------------------

SINGLE_VIEWS = {
    "view": lambda a: a.view(4, 12),
    "reshape_viewable": lambda a: a.reshape(2, 24),
    "t": lambda a: a.t(),
    "transpose": lambda a: a.transpose(0, 1),
    "permute": lambda a: a.permute(1, 0),
    "select": lambda a: a.select(0, 2),
    "slice": lambda a: a[1:5:2],
    "narrow": lambda a: a.narrow(1, 2, 3),
    "getitem_ints_and_slices": lambda a: a[2, 1:7:3],
    "getitem_none_ellipsis": lambda a: a[None, ..., 3],
    "expand": lambda a: a[:1].expand(3, 8),
    "detach": lambda a: a.detach(),
    "alias": lambda a: torch.ops.aten.alias(a),
    "unflatten": lambda a: a.unflatten(1, (2, 4)),
    "unsqueeze": lambda a: a.unsqueeze(1),
    "diagonal": lambda a: a.diagonal(),
    "movedim": lambda a: a.movedim(0, 1),
    "as_strided": lambda a: a.as_strided((3, 3), (8, 1), 2),
    "view_as_bytes": lambda a: a.view(torch.uint8),
}

MULTI_VIEWS = {
    "split": lambda a: a.split(4),
    "split_with_sizes": lambda a: a.split([1, 2, 3]),
    "unbind": lambda a: a.unbind(1),
    "chunk": lambda a: a.chunk(3, dim=1),
    "tensor_split": lambda a: a.tensor_split(3),
}


@pytest.mark.parametrize("op", list(SINGLE_VIEWS) + list(MULTI_VIEWS))
def test_view_ops_return_offloaded_aliases_without_copying(device, op):
    view_op = SINGLE_VIEWS.get(op) or MULTI_VIEWS[op]
    reference = torch.randn(6, 8)
    pager = fresh_pager(device)
    x = ot.offload(reference, pager=pager)
    gc.collect()  # earlier tests' garbage in cycles, freed by a collection in the middle, would count
    before, host_before = counters(pager), _ext.live_host_bytes()

    views = view_op(x)
    expected = view_op(reference)
    if op in SINGLE_VIEWS:
        views, expected = [views], [expected]
    assert len(views) == len(expected)
    for view, ref in zip(views, expected):
        assert isinstance(view, OffloadedTensor)
        assert view._master is x._master
        assert view.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        assert (view.shape, view.stride(), view.storage_offset()) == (ref.shape, ref.stride(), ref.storage_offset())
        assert view.dtype == ref.dtype
        assert_same_values(host_values(view), ref)
    # Nothing was paged and no host memory was allocated: a view is metadata over the same master.
    assert counters(pager) == before
    assert _ext.live_host_bytes() == host_before


@pytest.mark.parametrize("op", list(SINGLE_VIEWS) + list(MULTI_VIEWS))
def test_view_ops_in_inference_mode_give_what_plain_views_do(device, op):
    """In ``torch.inference_mode()`` a view of a normal tensor is a normal tensor sharing its
    base's version counter; a view of a weight offloaded outside it raised "Cannot set
    version_counter for inference tensor". A view of a tensor made inside is an inference tensor."""
    view_op = SINGLE_VIEWS.get(op) or MULTI_VIEWS[op]
    reference = torch.randn(6, 8)
    x = ot.offload(reference, device)
    with torch.inference_mode():
        views, expected = view_op(x), view_op(reference)
        inside = ot.offload(torch.randn(6, 8), device)
        inner, inner_expected = view_op(inside), view_op(inside.cpu())
    for got, want in [(views, expected), (inner, inner_expected)]:
        got, want = ([got], [want]) if op in SINGLE_VIEWS else (got, want)
        for view, ref in zip(got, want):
            assert isinstance(view, OffloadedTensor)
            assert view.is_inference() == ref.is_inference()
            assert (view.shape, view.stride(), view.storage_offset()) == (ref.shape, ref.stride(), ref.storage_offset())
    for view, ref in zip([views] if op in SINGLE_VIEWS else views, [expected] if op in SINGLE_VIEWS else expected):
        assert_same_values(host_values(view), ref)


class _TransposedHead(nn.Module):
    """``x @ w.T`` and a reshape of the weight: model code that takes views of its weights."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 8))

    def forward(self, x):
        return x @ self.weight.T + self.weight.reshape(8, 16)[0]


def test_a_wrapped_model_runs_in_inference_mode_with_the_plain_outputs(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.GELU(), _TransposedHead()).eval()
    ids = torch.randint(0, 16, (2, 5), device=device)
    wrapped = copy.deepcopy(model)
    with torch.inference_mode():  # the plain model on the same device: the same kernels, the same bits
        expected = model.to(device)(ids)
    ot.wrap_model(wrapped, budget_gb=1e-6, device=device, policy=["*"])
    assert all(isinstance(p, OffloadedTensor) for p in wrapped.parameters())
    with torch.inference_mode():
        got = wrapped(ids)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_conjugate_and_negative_views_read_resolved_values(device):
    # Conjugate/negative bits are resolved when such a view is taken: a kernel run on paged bytes
    # must see the conjugated values, not the raw ones.
    reference = torch.randn(3, 2, dtype=torch.complex64)
    x = ot.offload(reference, device=device)
    reference = reference.to(device)
    assert_same_values(x.conj() * 1, reference.conj().resolve_conj())
    assert_same_values(x.conj().imag + 0, reference.conj().imag.resolve_neg())
    assert_same_values(x.t().conj() @ x, reference.t().conj() @ reference)
    assert_same_values(x.mH.cpu(), reference.mH.resolve_conj())
    assert_same_values(torch.vdot(x[:, 0], x[:, 1]), torch.vdot(reference[:, 0], reference[:, 1]))


def test_views_share_the_host_master(device):
    reference = torch.randn(6, 8)
    x = ot.offload(reference, device=device)
    rows, columns, transposed = x[1:4], x[:, 2], x.t()
    ref_rows, ref_columns, ref_transposed = reference[1:4], reference[:, 2], reference.t()
    # A write through one view is seen by every other alias, as with plain views.
    rows.fill_(7.0)
    ref_rows.fill_(7.0)
    transposed[5].mul_(-1)
    ref_transposed[5].mul_(-1)
    for view, ref in ((x, reference), (rows, ref_rows), (columns, ref_columns), (transposed, ref_transposed)):
        assert_same_values(host_values(view), ref)
        assert_same_values(view * 1, ref)
    assert {id(v._master) for v in (x, rows, columns, transposed)} == {id(x._master)}


def test_transposed_view_pages_its_covering_range_once(device):
    reference = torch.randn(10, 8)
    pager = fresh_pager(device)
    x = ot.offload(reference, pager=pager)
    view = x[2:5].t()  # rows 2..4: a contiguous range of the master, read transposed
    before = counters(pager)
    result = view @ torch.ones(3, 2, device=device)
    assert_same_values(result, reference[2:5].t() @ torch.ones(3, 2))
    page_ins, bytes_h2d = counters(pager)
    assert page_ins - before[0] == 1
    assert bytes_h2d - before[1] == 3 * 8 * reference.element_size()


def test_slice_pages_only_its_bytes(device):
    reference = torch.randn(10, 8)
    pager = fresh_pager(device)
    x = ot.offload(reference, pager=pager)
    before = counters(pager)
    assert_same_values(x[3:5] + 1, reference[3:5] + 1)
    assert counters(pager)[1] - before[1] == 2 * 8 * reference.element_size()


def test_strided_column_slice_pages_its_covering_range(device):
    # Columns 2..3 of every row cover elements 2 .. (9*8 + 3) of the master: (10-1)*8 + 2 elements.
    reference = torch.randn(10, 8)
    pager = fresh_pager(device)
    x = ot.offload(reference, pager=pager)
    before = counters(pager)
    assert_same_values(x[:, 2:4] * 3, reference[:, 2:4] * 3)
    assert counters(pager)[1] - before[1] == ((10 - 1) * 8 + 2) * reference.element_size()


# ------------------------------------------------------------------------------------------------
# index ops on stacked tensors: only the selected rows are paged
# ------------------------------------------------------------------------------------------------


def stacked(device):
    reference = torch.randn(8, 4, 5)  # 8 "experts" of 4x5
    pager = fresh_pager(device)
    return reference, pager, ot.offload(reference, pager=pager)


def row_bytes(t: torch.Tensor) -> int:
    return nbytes(t[0])


def test_index_select_pages_only_selected_rows(device):
    reference, pager, x = stacked(device)
    index = torch.tensor([6, 1, 6, 3], device=device)
    before = counters(pager)
    assert_same_values(x.index_select(0, index), reference.index_select(0, index.cpu()))
    # Three distinct rows, the repeated one paged once.
    assert counters(pager)[1] - before[1] == 3 * row_bytes(reference)


def test_embedding_pages_only_looked_up_rows(device):
    reference = torch.randn(50, 6)
    pager = fresh_pager(device)
    weight = ot.offload(reference, pager=pager)
    tokens = torch.tensor([[4, 9, 4], [49, 0, 9]], device=device)
    before = counters(pager)
    assert_same_values(F.embedding(tokens, weight), F.embedding(tokens.cpu(), reference))
    assert counters(pager)[1] - before[1] == 4 * row_bytes(reference)


def test_embedding_module_with_offloaded_weight_pages_only_looked_up_rows(device):
    module = nn.Embedding(40, 3)
    reference = module.weight.detach().clone()
    pager = fresh_pager(device)
    module.weight = nn.Parameter(ot.offload(reference, pager=pager), requires_grad=False)
    tokens = torch.tensor([1, 2, 2, 39], device=device)
    before = counters(pager)
    assert_same_values(module(tokens), reference[tokens.cpu()])
    assert counters(pager)[1] - before[1] == 3 * row_bytes(reference)


def test_advanced_index_pages_only_selected_rows(device):
    reference, pager, x = stacked(device)
    index = torch.tensor([[7, 0], [0, 2]], device=device)
    before = counters(pager)
    assert_same_values(x[index], reference[index.cpu()])
    assert counters(pager)[1] - before[1] == 3 * row_bytes(reference)


def test_negative_indices_select_rows_from_the_end(device):
    reference, pager, x = stacked(device)
    index = torch.tensor([-1, 2, -8], device=device)
    assert_same_values(x[index], reference[index.cpu()])
    assert_same_values(x.index_select(0, index % 8), reference.index_select(0, index.cpu() % 8))


def test_select_by_int_pages_only_that_row(device):
    reference, pager, x = stacked(device)
    before = counters(pager)
    row = x[5]
    assert isinstance(row, OffloadedTensor)  # select is a view: nothing paged yet
    assert counters(pager) == before
    assert_same_values(row * 2, reference[5] * 2)
    assert counters(pager)[1] - before[1] == row_bytes(reference)


def test_select_by_0d_tensor_pages_only_that_row(device):
    reference, pager, x = stacked(device)
    before = counters(pager)
    expert = torch.tensor(6, device=device)  # e.g. a router's argmax
    assert_same_values(x[expert] - 1, reference[6] - 1)
    assert_same_values(torch.select(x, 0, expert) + 1, reference[6] + 1)
    assert counters(pager)[1] - before[1] == 2 * row_bytes(reference)


def test_large_expert_rows_are_paged_through_the_cache_once(device):
    # Rows of at least CACHED_SLICE_BYTES are paged one by one through the cache, so an expert
    # chosen again by the next token is a hit, not a second copy.
    rows, cols = 4, ot_ops.CACHED_SLICE_BYTES // 4 // 256
    reference = torch.randn(rows, 256, cols)
    expert_bytes = row_bytes(reference)
    assert expert_bytes >= ot_ops.CACHED_SLICE_BYTES
    pager = fresh_pager(device, budget_bytes=3 * expert_bytes)
    experts = ot.offload(reference, pager=pager)
    routed = torch.tensor([3, 1, 3], device=device)
    assert_same_values(experts[routed], reference[routed.cpu()])
    assert pager.stats.bytes_h2d == 2 * expert_bytes
    hits = pager.stats.hits
    assert_same_values(experts.index_select(0, routed), reference.index_select(0, routed.cpu()))
    assert pager.stats.bytes_h2d == 2 * expert_bytes
    assert pager.stats.hits > hits
    assert pager.stats.peak_device_bytes <= 3 * expert_bytes


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


# ------------------------------------------------------------------------------------------------
# Parameter, detach, clone, deepcopy
# ------------------------------------------------------------------------------------------------


def test_parameter_and_detach_keep_the_type(device):
    x = ot.offload(torch.randn(4, 3), device=device)
    parameter = nn.Parameter(x)
    assert isinstance(parameter, nn.Parameter) and isinstance(parameter, OffloadedTensor)
    assert parameter.requires_grad
    assert parameter._master is x._master  # a Parameter is an alias, not a copy
    frozen = nn.Parameter(x, requires_grad=False)
    assert isinstance(frozen, nn.Parameter) and not frozen.requires_grad
    for detached in (x.detach(), parameter.detach(), parameter.data):
        assert type(detached) is OffloadedTensor
        assert not detached.requires_grad
        assert detached._master is x._master
    module = nn.Linear(3, 4)
    module.weight = parameter
    assert module.weight is parameter
    assert dict(module.named_parameters())["weight"] is parameter


def test_clone_and_deepcopy_get_their_own_master(device):
    reference = torch.randn(4, 3)
    x = ot.offload(reference, device=device)
    clone, deep = x.clone(), copy.deepcopy(x)
    for duplicate in (clone, deep):
        assert type(duplicate) is OffloadedTensor
        assert duplicate._master is not x._master
        assert duplicate.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
        assert duplicate.device == x.device
        assert_same_values(host_values(duplicate), reference)
    clone.add_(1)
    deep.mul_(0)
    assert_same_values(host_values(x), reference)
    assert_same_values(host_values(clone), reference + 1)
    x.fill_(3.0)
    assert_same_values(host_values(deep), torch.zeros(4, 3))


def test_clone_of_a_view_allocates_only_the_view(device):
    x = ot.offload(torch.randn(10, 8), device=device)
    clone = x[2:4].clone()
    assert clone.host_nbytes == 2 * 8 * x.element_size()


def test_deepcopy_keeps_aliases_aliased_and_parameters_parameters(device):
    reference = torch.randn(5, 4)
    x = ot.offload(reference, device=device)
    weight = nn.Parameter(x, requires_grad=False)
    tied = nn.Parameter(x.t(), requires_grad=False)  # a separate Parameter over the same master
    copied = copy.deepcopy({"weight": weight, "tied": tied, "rows": x[1:3]})
    assert isinstance(copied["weight"], nn.Parameter) and isinstance(copied["weight"], OffloadedTensor)
    assert not copied["weight"].requires_grad
    masters = {id(t._master) for t in copied.values()}
    assert len(masters) == 1 and id(x._master) not in masters
    copied["weight"].mul_(-1)  # write through one copy: the other copied aliases see it
    assert_same_values(host_values(copied["tied"]), -reference.t())
    assert_same_values(host_values(copied["rows"]), -reference[1:3])
    assert_same_values(host_values(x), reference)


def test_deepcopy_of_a_module_with_tied_offloaded_weights_stays_tied(device):
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    model[0].weight = nn.Parameter(ot.offload(model[0].weight.detach(), device=device), requires_grad=False)
    model[1].weight = model[0].weight
    copied = copy.deepcopy(model)
    assert copied[0].weight is copied[1].weight
    assert isinstance(copied[0].weight, OffloadedTensor)
    assert copied[0].weight._master is not model[0].weight._master
    tokens = torch.tensor([1, 5], device=device)
    assert_same_values(copied(tokens), model(tokens))


def test_data_assignment_repoints_the_wrapper_at_a_consistent_master(device):
    weight = torch.randn(2, 3)
    x = ot.offload(weight, device=device)
    old_view = x.t()
    # A plain value is offloaded to a new exact-size master; dtype and shape follow it.
    replacement = torch.arange(8, dtype=torch.int64).view(2, 4)
    x.data = replacement
    assert type(x) is OffloadedTensor and x.device == resolve_device(device)
    assert (x.shape, x.dtype, x.host_nbytes) == (replacement.shape, replacement.dtype, nbytes(replacement))
    assert_same_values(host_values(x), replacement)
    assert_same_values(x * 1, replacement)
    assert_same_values(host_values(old_view), weight.t())  # as with plain .data: old views keep old values
    # An OffloadedTensor value is aliased, not copied.
    other = ot.offload(torch.randn(5), device=device)
    x.data = other
    assert x._master is other._master and x.shape == other.shape


def test_module_half_keeps_offloaded_parameters_consistent(device):
    module = nn.Linear(3, 2).to(device)
    weight = module.weight.detach().clone()
    parameter = nn.Parameter(ot.offload(weight, device=device), requires_grad=False)
    module.weight = parameter
    module.half()
    assert module.weight is parameter and isinstance(parameter, OffloadedTensor)
    assert parameter.dtype == torch.float16 and parameter._host.dtype == torch.float16
    assert parameter.host_nbytes == nbytes(weight.half())
    inputs = torch.randn(4, 3, device=device).half()
    assert_same_values(module(inputs), F.linear(inputs, weight.half(), module.bias))


# ------------------------------------------------------------------------------------------------
# reading values on the host
# ------------------------------------------------------------------------------------------------


def test_cpu_reads_the_host_master_without_paging(device):
    reference = torch.randn(6, 4)
    pager = fresh_pager(device)
    x = ot.offload(reference, pager=pager)
    before = counters(pager)
    for offloaded, expected in ((x, reference), (x.t(), reference.t()), (x[1:5:2], reference[1:5:2])):
        host = offloaded.cpu()
        assert type(host) is torch.Tensor and host.device.type == "cpu"
        assert host.stride() == expected.clone().stride()  # a copy in preserve_format, as from a GPU
        assert_same_values(host, expected)
    on_cpu = x.to("cpu")
    assert on_cpu.device.type == "cpu"
    assert_same_values(on_cpu._host if isinstance(on_cpu, OffloadedTensor) else on_cpu, reference)
    assert x.tolist() == reference.tolist()
    assert x[2, 3].item() == reference[2, 3].item()
    assert counters(pager) == before


def test_zero_dim_offloaded_tensor_formats_like_a_number(device):
    value = torch.tensor(1.23456)
    x = ot.offload(value, device=device)
    assert f"{x:.3f}" == f"{value.item():.3f}"
    assert f"{x[None][0]:>8.2f}" == f"{value.item():>8.2f}"


def test_cpu_returns_a_copy_that_does_not_write_back(device):
    reference = torch.randn(3)
    x = ot.offload(reference, device=device)
    host = x.cpu()
    host.fill_(0)
    assert_same_values(host_values(x), reference)


def test_cpu_of_a_trainable_offloaded_parameter_is_differentiable(device):
    parameter = nn.Parameter(ot.offload(torch.randn(3, 2), device=device))
    (parameter.cpu() * 3).sum().backward()
    assert_same_values(parameter.grad, torch.full((3, 2), 3.0))


def test_materialize_returns_a_plain_copy(device):
    reference = torch.randn(5, 6).t()  # non-contiguous: the copy keeps the strides
    pager = fresh_pager(device, budget_bytes=1 << 20)
    x = ot.offload(reference, pager=pager)
    before = counters(pager)
    plain = x.materialize()
    assert type(plain) is torch.Tensor
    assert plain.device == x.device
    assert plain.stride() == reference.stride()
    assert_same_values(plain, reference)
    assert counters(pager)[1] - before[1] == nbytes(reference)
    assert pager.paged_bytes == 0  # the caller owns it: never cached, outside the budget
    plain.fill_(0)
    assert_same_values(host_values(x), reference)


# ------------------------------------------------------------------------------------------------
# pickling and saving
# ------------------------------------------------------------------------------------------------


def _storages_in_torch_save(buffer: io.BytesIO) -> list:
    """Byte size of every storage record in a torch.save archive."""
    archive = zipfile.ZipFile(buffer)
    return [info.file_size for info in archive.infolist() if "/data/" in info.filename and "/.data/" not in info.filename]


@pytest.mark.parametrize("weights_only", [True, False])
def test_pickle_torch_save_and_weights_only_load_round_trip(device, weights_only):
    reference = torch.randn(16, 8)
    x = ot.offload(reference, device=device)
    saved = {
        "weight": x,
        "rows": x[2:6],
        "transposed": x.t(),
        "parameter": nn.Parameter(x, requires_grad=False),
        "trainable": nn.Parameter(x[0]),
    }
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    # Five aliases of one master are stored as one storage of exactly the master's bytes.
    assert _storages_in_torch_save(buffer) == [x.host_nbytes]
    buffer.seek(0)
    with ot.safe_globals():  # weights_only rebuilds OffloadedTensors only where the user allows it
        loaded = torch.load(buffer, weights_only=weights_only)

    for name, original in saved.items():
        got = loaded[name]
        assert isinstance(got, OffloadedTensor), name
        assert got.device == x.device
        assert (got.shape, got.stride(), got.storage_offset()) == (original.shape, original.stride(), original.storage_offset())
        assert got.requires_grad == original.requires_grad
        assert isinstance(got, nn.Parameter) == isinstance(original, nn.Parameter)
        assert_same_values(host_values(got), original._host)
    # They come back as aliases of one (new) master: a write through one is seen by all.
    assert len({id(t._master) for t in loaded.values()}) == 1
    loaded["rows"].fill_(0)
    assert_same_values(host_values(loaded["weight"])[2:6], torch.zeros(4, 8))
    assert_same_values(host_values(loaded["transposed"])[:, 2:6], torch.zeros(8, 4))
    assert_same_values(host_values(x), reference)


def test_pickle_round_trip_keeps_values_types_and_device(device):
    # Plain pickle copies a storage per tensor (as it does for plain tensors); values, type and
    # device must still survive.
    reference = torch.randn(4, 3)
    x = ot.offload(reference, device=device)
    parameter = nn.Parameter(ot.offload(reference, device=device))
    loaded_x, loaded_param = pickle.loads(pickle.dumps((x.t(), parameter)))
    assert type(loaded_x) is OffloadedTensor and loaded_x.device == x.device
    assert loaded_x.stride() == x.t().stride()
    assert_same_values(host_values(loaded_x), reference.t())
    assert isinstance(loaded_param, nn.Parameter) and loaded_param.requires_grad
    assert_same_values(loaded_param.cpu(), reference)


def test_state_dict_of_a_model_with_offloaded_tied_weights_saves_them_once(device):
    model = nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 32, bias=False))
    model[0].weight = nn.Parameter(ot.offload(model[0].weight.detach(), device=device), requires_grad=False)
    model[1].weight = model[0].weight
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    assert _storages_in_torch_save(buffer) == [model[0].weight.host_nbytes]
    buffer.seek(0)
    with ot.safe_globals():  # not a wrapped model: its state dict holds OffloadedTensors as they are
        loaded = torch.load(buffer, weights_only=True)
    assert loaded["0.weight"]._master is loaded["1.weight"]._master
    fresh = nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 32, bias=False))
    fresh.load_state_dict(loaded)
    tokens = torch.tensor([3, 31], device=device)
    assert_same_values(fresh.to(device)(tokens), model(tokens))


def test_safetensors_save_stores_tied_tensors_once(device, tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    model = nn.Sequential(nn.Embedding(12, 4), nn.Linear(4, 12, bias=False))
    model[0].weight = nn.Parameter(ot.offload(model[0].weight.detach(), device=device), requires_grad=False)
    model[1].weight = model[0].weight
    reference = model[0].weight._host.clone()
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_model(model, str(path))
    loaded = safetensors_torch.load_file(str(path))
    assert len(loaded) == 1  # the tie is detected through the host storage and stored once
    assert_same_values(next(iter(loaded.values())), reference)


def test_load_state_dict_writes_through_to_offloaded_parameter(device):
    module = nn.Linear(4, 3).to(device)
    parameter = nn.Parameter(ot.offload(module.weight.detach(), device=device), requires_grad=False)
    module.weight = parameter
    alias = parameter.t()
    new_weight, new_bias = torch.randn(3, 4), torch.randn(3)
    module.load_state_dict({"weight": new_weight, "bias": new_bias})
    assert module.weight is parameter  # identity kept, so ties and optimizer references survive
    assert_same_values(host_values(parameter), new_weight)
    assert_same_values(host_values(alias), new_weight.t())
    x = torch.randn(2, 4)
    assert_same_values(module(x.to(device)), F.linear(x, new_weight, new_bias))


# ------------------------------------------------------------------------------------------------
# autograd
# ------------------------------------------------------------------------------------------------


def test_gradients_flow_to_inputs_through_frozen_offloaded_weights(device):
    torch.manual_seed(0)
    weight, bias, other = torch.randn(5, 3), torch.randn(5), torch.randn(5, 5)
    frozen = [ot.offload(t, device=device) for t in (weight, bias, other)]
    plain = [t.to(device) for t in (weight, bias, other)]
    inputs = torch.randn(2, 3, device=device)

    def forward(w, b, o, x):
        hidden = F.linear(x, w, b).relu()
        return (hidden @ o.t()).softmax(-1)[:, 0].sum() + (hidden * o[1:3, :]).sum()

    x_off = inputs.clone().requires_grad_()
    forward(*frozen, x_off).backward()
    x_ref = inputs.clone().requires_grad_()
    forward(*plain, x_ref).backward()
    torch.testing.assert_close(x_off.grad, x_ref.grad)
    assert all(f.grad is None for f in frozen)


def _saved_tensors(grad_fn, seen=None):
    """Every tensor the autograd graph below ``grad_fn`` saved for backward."""
    seen = set() if seen is None else seen
    if grad_fn is None or grad_fn in seen:
        return []
    seen.add(grad_fn)
    found = []
    for name in dir(grad_fn):
        if name.startswith("_saved_"):
            value = getattr(grad_fn, name)
            if isinstance(value, torch.Tensor):
                found.append(value)
    for next_fn, _ in grad_fn.next_functions:
        found += _saved_tensors(next_fn, seen)
    return found


def test_backward_pages_again_instead_of_keeping_copies(device):
    weight = torch.randn(6, 4)
    pager = fresh_pager(device)
    frozen = ot.offload(weight, pager=pager)
    inputs = torch.randn(3, 4, device=device, requires_grad=True)
    before = counters(pager)
    out = F.linear(inputs, frozen).tanh().sum()
    forward_bytes = counters(pager)[1] - before[1]
    assert forward_bytes == nbytes(weight)
    # The graph holds the OffloadedTensor (a view of the host master), never a device copy of it.
    saved_weights = [t for t in _saved_tensors(out.grad_fn) if t.numel() == weight.numel()]
    assert saved_weights and all(isinstance(t, OffloadedTensor) for t in saved_weights)
    assert pager.paged_bytes == 0
    out.backward()
    assert counters(pager)[1] - before[1] == 2 * nbytes(weight)
    expected = inputs.detach().clone().requires_grad_()
    F.linear(expected, weight.to(device)).tanh().sum().backward()
    torch.testing.assert_close(inputs.grad, expected.grad)


@pytest.mark.parametrize(
    "optimizer_name, options",
    [
        ("SGD", {"lr": 0.1}),
        ("SGD", {"lr": 0.1, "momentum": 0.9, "foreach": True}),
        ("AdamW", {"lr": 0.05}),
        ("AdamW", {"lr": 0.05, "foreach": True}),
    ],
    ids=["sgd", "sgd-momentum-foreach", "adamw", "adamw-foreach"],
)
def test_trainable_offloaded_parameter_gets_grad_and_optimizer_writes_through(device, optimizer_name, options):
    torch.manual_seed(0)
    weight, bias = torch.randn(4, 3), torch.randn(4)
    plain = [nn.Parameter(weight.to(device)), nn.Parameter(bias.to(device))]
    offloaded = [nn.Parameter(ot.offload(weight, device=device)), nn.Parameter(ot.offload(bias, device=device))]
    aliases = [offloaded[0].t(), offloaded[1][1:]]  # e.g. a tied view elsewhere in a model
    optimizers = [getattr(torch.optim, optimizer_name)(ps, **options) for ps in (plain, offloaded)]
    for _ in range(3):
        inputs = torch.randn(2, 3, device=device)
        for params, optimizer in zip((plain, offloaded), optimizers):
            optimizer.zero_grad()
            F.linear(inputs, *params).pow(2).sum().backward()
            optimizer.step()
        for p, q in zip(plain, offloaded):
            assert type(q.grad) is torch.Tensor and q.grad.device == q.device
            torch.testing.assert_close(q.grad, p.grad)
    for p, q in zip(plain, offloaded):
        assert isinstance(q, OffloadedTensor) and isinstance(q, nn.Parameter)
        torch.testing.assert_close(host_values(q), p.detach().cpu())
    torch.testing.assert_close(host_values(aliases[0]), plain[0].detach().cpu().t())
    torch.testing.assert_close(host_values(aliases[1]), plain[1].detach().cpu()[1:])


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


# ------------------------------------------------------------------------------------------------
# the pager's cache and budget
# ------------------------------------------------------------------------------------------------


def test_cache_hits_on_second_use(device):
    reference = torch.randn(10, 10)
    pager = fresh_pager(device, budget_bytes=4 * nbytes(reference))
    x = ot.offload(reference, pager=pager)
    assert_same_values(x * 2, reference * 2)
    page_ins, bytes_h2d = counters(pager)
    hits = pager.stats.hits
    assert_same_values(x + 1, reference + 1)
    # A view inside the cached range is served from the same copy.
    assert_same_values(x[3:5].t() - 1, reference[3:5].t() - 1)
    assert counters(pager) == (page_ins, bytes_h2d)
    assert pager.stats.hits == hits + 2


@pytest.mark.parametrize(
    "write",
    [
        lambda x, values: x.copy_(values),
        lambda x, values: x.mul_(0).add_(values),
        lambda x, values: x[2:4].copy_(values[2:4]),
        lambda x, values: torch.add(values, 0, out=x),
    ],
    ids=["copy_", "mul_-add_", "slice-copy_", "out="],
)
def test_write_invalidates_cached_copies(device, write):
    reference = torch.randn(10, 10)
    pager = fresh_pager(device, budget_bytes=4 * nbytes(reference))
    x = ot.offload(reference, pager=pager)
    rows = x[2:4]
    x * 1
    rows * 1  # both the whole tensor and a sub-range are cached (a hit of the whole copy)
    assert pager.paged_bytes > 0
    new_values = torch.randn(10, 10, device=device)
    write(x, new_values)
    expected = reference.to(device).clone()
    write(expected, new_values)
    assert_same_values(x * 1, expected)
    assert_same_values(rows * 1, expected[2:4])


def test_eviction_respects_budget(device):
    tensors = [torch.randn(10, 10) for _ in range(4)]
    budget = 2 * nbytes(tensors[0]) + nbytes(tensors[0]) // 2
    pager = fresh_pager(device, budget_bytes=budget)
    offloaded = [ot.offload(t, pager=pager) for t in tensors]
    for _ in range(3):
        for x, reference in zip(offloaded, tensors):
            assert_same_values(x.sum(0), reference.sum(0).to(device))
        assert_same_values(offloaded[0] @ offloaded[1], (tensors[0] @ tensors[1]).to(device))
    assert pager.stats.evictions > 0
    assert pager.stats.peak_device_bytes <= budget
    assert pager.paged_bytes <= budget


def test_budget_too_small_for_one_op_raises_naming_bytes(device):
    pager = fresh_pager(device, budget_bytes=1000)
    big = ot.offload(torch.randn(20, 15), pager=pager)  # 1200 bytes
    with pytest.raises(BudgetError) as error:
        big.cumsum(0)  # a scan over the whole tensor; a pointwise op or a reduction would run in slices
    message = str(error.value)
    assert "1200 bytes" in message and "1000 bytes" in message and "(20, 15)" in message
    # Two tensors that fit alone but not together.
    a = ot.offload(torch.randn(15, 10), pager=pager)
    b = ot.offload(torch.randn(15, 10), pager=pager)
    with pytest.raises(BudgetError, match="600 bytes"):
        torch.dot(a.flatten(), b.flatten())
    # The failed op released what it had paged: each tensor alone still fits.
    assert_same_values(a * 1, a._host)
    assert_same_values(b * 1, b._host)
    assert pager.stats.peak_device_bytes <= 1000
