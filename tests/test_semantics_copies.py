"""OffloadedTensor semantics, the table's rows on copies and host reads (docs/design.md, "The tensor
and its semantics"): ``nn.Parameter`` and ``detach`` keep the type, ``clone`` and ``deepcopy`` get
their own master (aliases and ties kept), ``.data`` assignment and ``module.half()`` stay
consistent, and ``.cpu()`` reads the host master without paging. As in test_semantics.py, each
test compares with the same ops on a plain tensor."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import offtensor as ot
from offtensor import OffloadedTensor
from offtensor.pager import resolve_device

from test_semantics import assert_same_values, counters, fresh_pager, host_values, nbytes


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
