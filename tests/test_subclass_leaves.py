"""Leaves of wrapper subclasses: offtensor offloads the plain tensors inside any traceable wrapper
subclass (``__tensor_flatten__`` / ``__tensor_unflatten__``), never wraps the subclass itself.

torch's own TwoTensor (two plain leaves ``a`` and ``b``, every op run on both) stands for DTensor
and torchao's tensors here; tests/test_distributed.py does the same with DTensor on 2 ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.testing._internal.two_tensor import TwoTensor

import offtensor as ot
from offtensor import leaves
from offtensor.tensor import OffloadedTensor
from offtensor.model.copies import is_wrapped

HIDDEN = 64
LINEAR_BYTES = HIDDEN * HIDDEN * 4


class Opaque(torch.Tensor):
    """A wrapper subclass without __tensor_flatten__: offtensor cannot see its values."""

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)

    def __init__(self, elem):
        self.elem = elem

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda a: a.elem if isinstance(a, Opaque) else a  # noqa: E731
        return func(*map(unwrap, args), **{k: unwrap(v) for k, v in (kwargs or {}).items()})


def _two_tensor_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN))
    w = model[0].weight.detach()
    model[0].weight = nn.Parameter(TwoTensor(w.clone(), w.clone() * 2))
    return model


def test_wrap_offloads_the_leaves_inside_the_subclass_and_keeps_the_outer_object(device):
    # On main: "Attempted to access the data pointer on an invalid python storage" at wrap.
    model = _two_tensor_model()
    param = model[0].weight
    param.loader_tag = tag = object()
    x = torch.randn(3, HIDDEN)
    ref = model(x)
    budget = LINEAR_BYTES + 2 * 1024  # one leaf of 16 KiB paged at a time, biases resident
    ot.wrap_model(model, budget_gb=budget / 2**30, device=device)
    assert model[0].weight is param and type(param) is TwoTensor and isinstance(param, nn.Parameter)
    assert param.loader_tag is tag
    assert isinstance(param.a, OffloadedTensor) and isinstance(param.b, OffloadedTensor)
    out = model(x)
    assert type(out) is TwoTensor
    assert torch.equal(out.a.cpu(), ref.a) and torch.equal(out.b.cpu(), ref.b)
    s = ot.stats(model)
    assert s.offloaded_bytes == 3 * LINEAR_BYTES  # both leaves and the plain second weight: leaf bytes
    assert s.resident_bytes == 2 * HIDDEN * 4  # the two biases
    assert 0 < s.peak_device_bytes <= budget
    ot.unwrap_model(model)
    assert model[0].weight is param and type(param.a) is torch.Tensor and torch.equal(model(x).b, ref.b)


def test_nested_subclasses_are_walked_to_their_plain_leaves(device):
    inner = TwoTensor(torch.randn(8, 8), torch.randn(8, 8))
    outer = TwoTensor(inner, TwoTensor(torch.randn(8, 8), torch.randn(8, 8)))
    assert [(type(o).__name__, a) for o, a, _ in leaves.leaves(outer)] == [("TwoTensor", n) for n in "abab"]
    model = nn.Linear(8, 8, bias=False)
    model.weight = nn.Parameter(outer)
    x = TwoTensor(TwoTensor(torch.randn(2, 8), torch.randn(2, 8)), TwoTensor(torch.randn(2, 8), torch.randn(2, 8)))
    ref = model(x)
    ot.wrap_model(model, budget_gb=1 / 1024, policy="*", device=device)
    assert all(isinstance(leaf, OffloadedTensor) for leaf in leaves.leaf_tensors(model.weight))
    assert ot.stats(model).offloaded_bytes == 4 * 8 * 8 * 4
    out = model(x)
    for got, want in zip(leaves.leaf_tensors(out), leaves.leaf_tensors(ref)):
        assert torch.equal(got.cpu(), want)


def test_offload_of_a_subclass_gives_its_class_with_offloaded_leaves(device):
    t = TwoTensor(torch.arange(6.0).view(2, 3), -torch.arange(6.0).view(2, 3))
    o = ot.offload(t, device=device)
    assert type(o) is TwoTensor and o is not t
    assert isinstance(o.a, OffloadedTensor) and isinstance(o.b, OffloadedTensor)
    assert type(t.a) is torch.Tensor  # the argument is left as it was
    assert torch.equal(o.a.cpu(), t.a) and torch.equal((o * 2).b.cpu(), t.b * 2)


def test_a_subclass_that_cannot_be_flattened_is_refused_naming_its_class(device):
    model = nn.Linear(4, 4)
    weight = model.weight.detach().clone()
    model.register_buffer("table", Opaque(weight))
    with pytest.raises(TypeError, match=r"'table' of shape \(4, 4\) \(64 bytes\): its class .*Opaque is a tensor "
                                        r"subclass without __tensor_flatten__"):
        ot.wrap_model(model, offload_gb=1e-9, device=device)
    assert not is_wrapped(model) and type(model.table) is Opaque and type(model.weight) is nn.Parameter
    with pytest.raises(TypeError, match="Opaque is a tensor subclass without __tensor_flatten__"):
        ot.offload(Opaque(weight), device=device)


def test_a_subclass_assigned_after_wrapping_has_its_leaves_placed(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN))
    x = torch.randn(3, HIDDEN)
    ref = model(x)
    ot.wrap_model(model, budget_gb=(LINEAR_BYTES + 2048) / 2**30, device=device)
    w = model[0].weight.detach().cpu()
    model[0].weight = nn.Parameter(TwoTensor(w.clone(), w.clone()))  # the way quantize_ swaps in its weights
    del w
    param = model[0].weight
    assert type(param) is TwoTensor and isinstance(param.a, OffloadedTensor) and isinstance(param.b, OffloadedTensor)
    out = model(x)
    assert torch.equal(out.a.cpu(), ref) and torch.equal(out.b.cpu(), ref)
    assert ot.stats(model).peak_device_bytes <= ot.stats(model).budget_bytes
