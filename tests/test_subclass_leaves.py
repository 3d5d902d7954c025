"""Leaves of wrapper subclasses: offtensor offloads the plain tensors inside any traceable wrapper
subclass (``__tensor_flatten__`` / ``__tensor_unflatten__``), never wraps the subclass itself.

torch's own TwoTensor (two plain leaves ``a`` and ``b``, every op run on both) stands for DTensor
and torchao's tensors here; tests/test_distributed.py does the same with DTensor on 2 ranks."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.testing._internal.two_tensor import TwoTensor

import offtensor as ot
from offtensor import leaves
from offtensor.tensor import OffloadedTensor
from offtensor.config import OffloadConfig
from offtensor.model import prepare as prepare_module
from offtensor.model.copies import is_wrapped
from offtensor.model.place import place
from offtensor.model.prepare import prepare
from offtensor.model.state import wrapped_state

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
    x = torch.randn(3, HIDDEN).to(device)
    ref = _two_tensor_model().to(device)(x)  # the same model unwrapped, on the same device
    budget = LINEAR_BYTES + 2 * 1024  # one leaf of 16 KiB paged at a time, biases resident
    ot.wrap_model(model, budget_gb=budget / 2**30, device=device)
    assert model[0].weight is param and type(param) is TwoTensor and isinstance(param, nn.Parameter)
    assert param.loader_tag is tag
    assert isinstance(param.a, OffloadedTensor) and isinstance(param.b, OffloadedTensor)
    out = model(x)
    assert type(out) is TwoTensor
    assert torch.equal(out.a, ref.a) and torch.equal(out.b, ref.b)
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
    x = x.to(device)
    ref = nn.functional.linear(x, outer.to(device))  # the unwrapped weight on the same device
    ot.wrap_model(model, budget_gb=1 / 1024, policy="*", device=device)
    assert all(isinstance(leaf, OffloadedTensor) for leaf in leaves.leaf_tensors(model.weight))
    assert ot.stats(model).offloaded_bytes == 4 * 8 * 8 * 4
    out = model(x)
    for got, want in zip(leaves.leaf_tensors(out), leaves.leaf_tensors(ref), strict=True):
        assert torch.equal(got, want)


def test_offload_of_a_subclass_gives_its_class_with_offloaded_leaves(device):
    t = TwoTensor(torch.arange(6.0).view(2, 3), -torch.arange(6.0).view(2, 3))
    o = ot.offload(t, device=device)
    assert type(o) is TwoTensor and o is not t
    assert isinstance(o.a, OffloadedTensor) and isinstance(o.b, OffloadedTensor)
    assert type(t.a) is torch.Tensor  # the argument is left as it was
    assert torch.equal(o.a.cpu(), t.a) and torch.equal((o * 2).b, (t.to(device) * 2).b)


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
    x = torch.randn(3, HIDDEN).to(device)
    ref = copy.deepcopy(model).to(device)(x)  # the same model unwrapped, on the same device
    ot.wrap_model(model, budget_gb=(LINEAR_BYTES + 2048) / 2**30, device=device)
    w = model[0].weight.detach().cpu()
    model[0].weight = nn.Parameter(TwoTensor(w.clone(), w.clone()))  # the way quantize_ swaps in its weights
    del w
    param = model[0].weight
    assert type(param) is TwoTensor and isinstance(param.a, OffloadedTensor) and isinstance(param.b, OffloadedTensor)
    out = model(x)
    assert param.device == ref.device  # on a GPU: the leaves' device, not the host it was made on
    assert torch.equal(out.a, ref) and torch.equal(out.b, ref)
    assert ot.stats(model).peak_device_bytes <= ot.stats(model).budget_bytes


# A GPU run moves the leaves from the host (cpu) to another device type (cuda). On the emulated
# device the target is the host's own device type, so an outer object left on the host looks
# right there. wrap_model's own pipeline (``prepare``) onto a meta pager is the same move from
# cpu to another device type, on any machine: what the tests below prove holds on a GPU too.

def _wrap_onto_meta(model):
    config = OffloadConfig(budget_gb=1.0, device=torch.device("meta"), policy="*", strict=False)
    return prepare(model, config, config.device).pager


def _wrappers(t):
    """``t`` and every wrapper subclass inside it."""
    if not isinstance(t, torch.Tensor) or leaves.is_leaf(t):  # DTensor names its device mesh too
        return []
    return [t, *(w for name in t.__tensor_flatten__()[0] for w in _wrappers(getattr(t, name)))]


def _assert_on_its_leaves_device(t, device):
    for w in _wrappers(t):
        assert w.device == device and w.untyped_storage().device == device, (type(w).__name__, w.device)
    assert all(leaf.device == device for leaf in leaves.leaf_tensors(t))
    view = t.t()  # the view F.linear takes first: torch aliases its storage to the weight's
    assert view.device == device and view.untyped_storage().device == device


def test_a_wrapped_subclass_is_on_its_leaves_device_when_they_move_to_another_device_type():
    # Before: TwoTensor.t() -> return_and_correct_aliasing -> "Attempted to set the storage of a
    # tensor on device "meta" to a storage on different device "cpu"" (on a GPU: "cuda:0", "cpu").
    model = _two_tensor_model()
    param = model[0].weight
    param.loader_tag = tag = object()
    _wrap_onto_meta(model)
    assert model[0].weight is param and type(param) is TwoTensor and isinstance(param, nn.Parameter)
    assert param.loader_tag is tag and param.requires_grad
    assert isinstance(param.a, OffloadedTensor) and isinstance(param.b, OffloadedTensor)
    _assert_on_its_leaves_device(param, torch.device("meta"))
    out = model(torch.randn(3, HIDDEN, device="meta"))
    assert type(out) is TwoTensor and out.device.type == "meta" and out.shape == (3, HIDDEN)
    ot.unwrap_model(model)
    assert model[0].weight is param and type(param.a) is torch.Tensor
    _assert_on_its_leaves_device(param, torch.device("meta"))


def test_nested_subclasses_are_each_on_their_leaves_device_when_they_move_to_another_device_type():
    outer = TwoTensor(TwoTensor(torch.randn(8, 8), torch.randn(8, 8)), TwoTensor(torch.randn(8, 8), torch.randn(8, 8)))
    model = nn.Linear(8, 8, bias=False)
    model.weight = param = nn.Parameter(outer)
    _wrap_onto_meta(model)
    assert model.weight is param and all(isinstance(leaf, OffloadedTensor) for leaf in leaves.leaf_tensors(param))
    _assert_on_its_leaves_device(param, torch.device("meta"))
    x = TwoTensor(*(TwoTensor(torch.randn(2, 8, device="meta"), torch.randn(2, 8, device="meta")) for _ in "ab"))
    assert model(x).device.type == "meta"


def test_a_subclass_assigned_after_wrapping_is_on_its_leaves_device_when_they_move_to_another_device_type():
    model = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN))
    _wrap_onto_meta(model)
    w = torch.randn(HIDDEN, HIDDEN)
    param = nn.Parameter(TwoTensor(w.clone(), w.clone()))
    # What ``model[0].weight = param`` runs on a wrapped model (a plan's meta model places nothing
    # assigned to it, so the test calls it): registration, then placement of the new weight.
    model[0]._parameters["weight"] = param
    assert place(wrapped_state(model), model[0], "weight", param, False) is None
    assert model[0].weight is param and isinstance(param.a, OffloadedTensor)
    _assert_on_its_leaves_device(param, torch.device("meta"))
    assert model(torch.randn(3, HIDDEN, device="meta")).device.type == "meta"


def test_a_failed_wrap_puts_the_subclass_back_on_the_host_with_its_host_leaves(monkeypatch):
    model = _two_tensor_model()
    param = model[0].weight
    a, b = param.a, param.b
    x = torch.randn(3, HIDDEN)
    ref = model(x)

    def fail(*args, **kwargs):
        raise RuntimeError("registration failed")

    monkeypatch.setattr(prepare_module, "register_wrapped", fail)
    with pytest.raises(RuntimeError, match="registration failed"):
        _wrap_onto_meta(model)
    assert model[0].weight is param and param.a is a and param.b is b
    _assert_on_its_leaves_device(param, torch.device("cpu"))
    out = model(x)
    assert torch.equal(out.a, ref.a) and torch.equal(out.b, ref.b)


@pytest.mark.parametrize("local", ["plain", "float8"])
def test_a_dtensor_and_its_quantised_local_shard_are_on_their_leaves_device_when_they_move(one_rank_mesh, local):
    """A DTensor's local shard, plain or a torchao Float8Tensor (a wrapper inside the wrapper)."""
    from torch.distributed.tensor import DTensor, Shard

    model = nn.Linear(32, 32).to(torch.bfloat16)
    if local == "float8":
        pytest.importorskip("torchao.quantization").quantize_(
            model, pytest.importorskip("torchao.quantization").Float8WeightOnlyConfig())
    shard = model.weight.detach()
    model.weight = param = nn.Parameter(DTensor.from_local(shard, one_rank_mesh, [Shard(0)], run_check=False),
                                        requires_grad=False)
    _wrap_onto_meta(model)
    assert model.weight is param and type(param) is DTensor
    assert all(isinstance(leaf, OffloadedTensor) for leaf in leaves.leaf_tensors(param))
    _assert_on_its_leaves_device(param, torch.device("meta"))
    assert param.detach().device.type == "meta"


# ``ot.on_host`` lends a wrapper-subclass weight whose leaves are offloaded as its class rebuilt
# over the leaves' host masters. Before, it lent only OffloadedTensor parameters: a transform read
# the TwoTensor through paging (bytes_h2d > 0), each leaf copied onto the device whole.

def _offloaded_two_tensor_model(device):
    model = _two_tensor_model()
    param = model[0].weight
    param.loader_tag = object()
    ot.wrap_model(model, budget_gb=(LINEAR_BYTES + 2 * 1024) / 2**30, device=device)
    assert isinstance(param.a, OffloadedTensor) and isinstance(param.b, OffloadedTensor)
    ot.reset_stats(model)
    return model, param


def test_on_host_lends_a_subclass_over_its_leaves_host_masters_and_gives_it_back(device):
    model, param = _offloaded_two_tensor_model(device)
    a, b = param.a, param.b
    original = _two_tensor_model()[0].weight
    with torch.no_grad(), ot.on_host(model):
        lent = model[0].weight
        assert lent is not param and type(lent) is TwoTensor and isinstance(lent, nn.Parameter)
        assert lent.loader_tag is param.loader_tag and lent.requires_grad == param.requires_grad
        assert lent.device.type == "cpu" and type(lent.a) is torch.Tensor and type(lent.b) is torch.Tensor
        assert torch.equal(lent.a, original.a) and torch.equal(lent.b, original.b)
        summed = lent.a + lent.b  # what a transform computes, on the host
        assert ot.stats(model).bytes_h2d == 0, "reading the lent subclass paged its leaves onto the device"
    assert torch.equal(summed, original.a + original.b)
    assert model[0].weight is param and param.a is a and param.b is b
    x = torch.randn(3, HIDDEN).to(device)
    ref = _two_tensor_model().to(device)(x)
    out = model(x)
    assert torch.equal(out.a, ref.a) and torch.equal(out.b, ref.b)


def test_a_write_through_a_lent_subclass_reaches_its_masters_and_the_next_forward(device):
    model, param = _offloaded_two_tensor_model(device)
    x = torch.randn(3, HIDDEN).to(device)
    with torch.no_grad():
        model(x)  # caches device copies of the offloaded leaves
        ot.reset_stats(model)
        with ot.on_host(model):
            model[0].weight.mul_(2)
        assert ot.stats(model).bytes_h2d == 0, "the write paged the leaves instead of writing their masters"
        reference = _two_tensor_model()
        reference[0].weight.mul_(2)
        ref = reference.to(device)(x)
        out = model(x)
    assert model[0].weight is param and isinstance(param.a, OffloadedTensor)
    assert torch.equal(out.a, ref.a) and torch.equal(out.b, ref.b)


def test_a_subclass_replaced_inside_on_host_is_placed_and_an_error_inside_gives_every_weight_back(device):
    model, param = _offloaded_two_tensor_model(device)
    second = model[1].weight
    with pytest.raises(RuntimeError, match="the transform failed"), torch.no_grad():
        with ot.on_host(model):
            model[0].weight.fill_(1)  # what it wrote before failing stays written, as without the block
            assert ot.stats(model).bytes_h2d == 0
            raise RuntimeError("the transform failed")
    assert model[0].weight is param and isinstance(param.a, OffloadedTensor) and model[1].weight is second
    assert torch.equal(param.a.cpu(), torch.ones(HIDDEN, HIDDEN))
    with torch.no_grad(), ot.on_host(model):
        lent = model[0].weight
        model[0].weight = nn.Parameter(lent.a + lent.b)  # e.g. a transform merging the two
        assert ot.stats(model).bytes_h2d == 0
    merged = model[0].weight
    assert isinstance(merged, nn.Parameter) and merged is not param
    assert isinstance(merged, OffloadedTensor)  # placed as usual: it does not fit beside the resident weights
    assert torch.equal(merged.detach().cpu(), torch.full((HIDDEN, HIDDEN), 2.0))
    x = torch.randn(3, HIDDEN).to(device)
    with torch.no_grad():
        model(x)
    s = ot.stats(model)
    assert s.peak_device_bytes <= s.budget_bytes, s


def test_a_dtensor_with_an_offloaded_shard_is_lent_by_on_host_and_cast_on_the_host(one_rank_mesh, device):
    """A DTensor weight whose local shard is offloaded: ``ot.on_host`` lends it over the shard's
    host master, and ``.half()`` casts the shard host side into a new master, the DTensor object
    kept; nothing paged in either."""
    from torch.distributed.tensor import DTensor, Shard

    if device != "cpu":
        pytest.skip("the one-rank mesh is a cpu mesh")
    torch.manual_seed(0)
    model = nn.Linear(HIDDEN, HIDDEN, bias=False)
    shard = model.weight.detach().clone()
    model.weight = param = nn.Parameter(DTensor.from_local(shard.clone(), one_rank_mesh, [Shard(0)], run_check=False),
                                        requires_grad=False)
    ot.wrap_model(model, offload_gb=1e-9, device=device, policy="*")
    leaf = param._local_tensor
    assert isinstance(leaf, OffloadedTensor)
    ot.reset_stats(model)
    with torch.no_grad(), ot.on_host(model):
        lent = model.weight
        assert type(lent) is DTensor and lent is not param and type(lent._local_tensor) is torch.Tensor
        assert torch.equal(lent.to_local(), shard)
    assert model.weight is param and param._local_tensor is leaf
    model.half()
    assert ot.stats(model).bytes_h2d == 0
    assert model.weight is param and type(param) is DTensor and param.dtype == torch.float16
    assert isinstance(param._local_tensor, OffloadedTensor) and param._local_tensor.dtype == torch.float16
    assert torch.equal(param._local_tensor.cpu(), shard.half())
