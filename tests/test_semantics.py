"""OffloadedTensor semantics, one or more tests per row of the semantics table in docs/design.md
("The tensor and its semantics"): metadata, views, index ops and the pager's cache and budget here;
in-place and ``out=`` ops, copies and host reads, pickling and saving, autograd and
``__torch_function__`` in test_semantics_<topic>.py beside it, which share this file's helpers.

Every test builds a plain tensor, offloads a copy of it, does the same thing to both and compares;
byte counts are derived from shapes. Pager counters (``page_ins``, ``bytes_h2d``) show what was
paged. Tests that count bytes use a fresh pager of their own so that no other tensor shares the
counters. The emulated device (cpu) takes the same code path as cuda; ``OFFTENSOR_TEST_DEVICE=cuda``
runs the same tests on a GPU.
"""

from __future__ import annotations

import copy
import gc

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
    """Only what cannot run elsewhere is refused: a random op, whose host generator is not the
    device's. An op with a CPU kernel runs on the host masters (``glu``, ``grid_sample``: before,
    these were refused too)."""
    pager = fresh_pager(device, budget_bytes=1000)
    values = torch.randn(20, 15)
    big = ot.offload(values, pager=pager)  # 1200 bytes
    with pytest.raises(BudgetError) as error:
        torch.nn.functional.rrelu(big, training=True)  # neither cut in slices nor run on the host
    message = str(error.value)
    assert "1200 bytes" in message and "1000 bytes" in message and "(20, 15)" in message
    # Two tensors that fit alone but not together.
    a = ot.offload(torch.rand(10, 15) + 1, pager=pager)
    b = ot.offload(torch.rand(10, 15), pager=pager)
    with pytest.raises(BudgetError, match="600 bytes"):
        torch.normal(a, b)
    # The failed ops released what they had paged: each tensor alone still fits.
    assert_same_values(a * 1, a._host)
    assert_same_values(b * 1, b._host)
    assert pager.stats.peak_device_bytes <= 1000
    assert_same_values(torch.nn.functional.glu(big.flatten()), torch.nn.functional.glu(values.flatten()))
    image, grid = ot.offload(torch.randn(1, 1, 10, 15), pager=pager), ot.offload(torch.rand(1, 5, 15, 2), pager=pager)
    assert_same_values(torch.nn.functional.grid_sample(image, grid, align_corners=False),
                       torch.nn.functional.grid_sample(image._host, grid._host, align_corners=False))
    assert pager.stats.peak_device_bytes <= 1000
