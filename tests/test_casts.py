"""Casts, moves and swaps of a wrapped model: ``module.to(dtype)``, ``.half()``,
``.float()``, ``.bfloat16()`` and ``module.to(device)`` keep offloaded weights offloaded, the same
objects, at the new dtype, converted host master to host master with nothing paged, and the room is
planned again for the new sizes; with and without ``set_swap_module_params_on_conversion``."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch

import offtensor as ot

GiB = 1 << 30


@pytest.fixture(params=[False, True], ids=["set_data", "swap_tensors"])
def swap_on_conversion(request):
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(request.param)
    yield request.param
    torch.__future__.set_swap_module_params_on_conversion(before)


class _Loaded(torch.nn.Parameter):
    """A vLLM-style Parameter subclass with an attribute, to see both survive a cast."""


def _stack(dtype=torch.float32, width=128, depth=3):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(width, width) for _ in range(depth)]
    model = torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.GELU())]).to(dtype)
    return model.eval()


def _weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _offloaded(model) -> list:
    return [p for p in model.parameters() if isinstance(p, ot.OffloadedTensor)]


CASTS = {
    "to(float16)": (lambda m: m.to(torch.float16), torch.float16),
    "half()": (lambda m: m.half(), torch.float16),
    "bfloat16()": (lambda m: m.bfloat16(), torch.bfloat16),
    "to(dtype=bfloat16)": (lambda m: m.to(dtype=torch.bfloat16), torch.bfloat16),
}


@pytest.mark.parametrize("cast", list(CASTS))
def test_a_cast_converts_offloaded_weights_host_side_keeping_objects_and_attributes(cast, swap_on_conversion, device):
    model = _stack()
    reference = copy.deepcopy(model).to(device)
    layer = model[0]
    layer.weight = _Loaded(layer.weight.detach().clone())
    layer.weight.weight_loader = loader = object()
    reference[0].weight = _Loaded(reference[0].weight.detach().clone())
    ot.wrap_model(model, budget_gb=0.5 * _weight_bytes(model) / GiB, device=device)
    offloaded = _offloaded(model)
    assert model[0].weight in offloaded
    objects = [id(p) for p in model.parameters()]
    ot.reset_stats(model)
    apply, dtype = CASTS[cast]
    apply(model)
    apply(reference)
    s = ot.stats(model)
    assert s.bytes_h2d == 0, "a cast paged weights instead of converting their host masters"
    assert [id(p) for p in model.parameters()] == objects
    assert all(isinstance(p, ot.OffloadedTensor) and p.dtype == dtype for p in offloaded)
    assert isinstance(model[0].weight, _Loaded) and model[0].weight.weight_loader is loader
    assert s.offloaded_bytes == sum(p.numel() * p.element_size() for p in offloaded)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    s = ot.stats(model)
    assert s.bytes_h2d > 0 and s.peak_device_bytes <= s.budget_bytes, s


def test_an_upcast_past_the_budget_offloads_resident_weights_and_plans_the_room_at_the_new_size(
        swap_on_conversion, device):
    """bf16 weights wrapped at 60 %, then ``.float()``: the resident weights would double past the
    budget and the offloaded ones need twice the room to page. On main the fp32 weights stayed
    resident and the peak overran the budget."""
    model = _stack(torch.bfloat16, depth=4)
    reference = copy.deepcopy(model).float().to(device)
    ot.wrap_model(model, budget_gb=0.6 * _weight_bytes(model) / GiB, device=device)
    budget = ot.stats(model).budget_bytes
    assert any(not isinstance(p, ot.OffloadedTensor) and p.dim() == 2 for p in model.parameters())
    model.float()
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    s = ot.stats(model)
    assert s.resident_bytes <= budget, s
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(2)).to(device)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    s = ot.stats(model)
    assert s.peak_device_bytes <= budget, s
    # and back down: the same values as the reference cast down
    model.bfloat16()
    reference.bfloat16()
    with torch.no_grad():
        assert torch.equal(model(x.bfloat16()), reference(x.bfloat16()))
    assert ot.stats(model).peak_device_bytes <= budget


def test_module_to_its_own_device_leaves_offloaded_weights_as_they_are_even_with_weak_references(
        swap_on_conversion, device):
    """peft calls ``module.to(weight.device)``; torch swapped every OffloadedTensor parameter with
    ``swap_tensors``, which refuses a tensor that has weak references (and drops a Parameter
    subclass's class): on main this raised "Couldn't swap Linear.weight"."""
    model = _stack()
    ot.wrap_model(model, budget_gb=0.5 * _weight_bytes(model) / GiB, device=device)
    weight = _offloaded(model)[0]
    ref = weakref.ref(weight)
    host = weight._host
    ot.reset_stats(model)
    model.to(device)
    model.to(torch.device(device), dtype=torch.float32)
    assert ref() is weight and weight._host is host
    assert ot.stats(model).bytes_h2d == 0


def test_a_weight_the_policy_keeps_assigned_after_wrapping_replans_the_paging_room(device):
    """A kept weight that eats into the room planned for paging: the room is planned again (the
    offloaded weights page in tiles) and the forward stays within budget and exact."""
    model = _stack(depth=3)
    reference = copy.deepcopy(model).to(device)
    nbytes = _weight_bytes(model)
    ot.wrap_model(model, budget_gb=0.75 * nbytes / GiB, device=device, policy=lambda n: "keep" if n[0] == "5" else None)
    budget = ot.stats(model).budget_bytes
    new = torch.nn.Linear(128, 128)
    reference[5] = copy.deepcopy(new).to(device)
    model[5] = new
    assert not isinstance(model[5].weight, ot.OffloadedTensor)
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(3)).to(device)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    s = ot.stats(model)
    assert s.peak_device_bytes <= budget, s


@pytest.mark.filterwarnings("ignore:offtensor. the budget of 67328 bytes leaves room for output tiles narrower")
def test_a_kept_weight_that_leaves_no_room_to_page_raises_naming_it_and_the_bytes(device):
    """The kept weight would fit the budget, but leave 256 bytes for paging, less than one 512-byte
    row of the offloaded weights: a clear error, and the slot goes back to what it held."""
    model = _stack(depth=2)
    kept = 128 * 128 * 4 + 128 * 4  # the new Linear's weight and bias
    budget = 2 * 128 * 4 + kept + 256  # the resident biases, the kept Linear and 256 bytes
    ot.wrap_model(model, budget_gb=budget / GiB, device=device,
                  policy=lambda n: "keep" if n[0] == "3" or n.endswith("bias") else None)
    assert ot.stats(model).resident_bytes == 2 * 128 * 4
    with pytest.raises(ot.BudgetError, match=r"keeping 3\.(weight|bias) \(\d+ bytes\) resident, as the policy says, "
                                             r"leaves \d+ of the budget's 67328 bytes for paging, but the offloaded "
                                             r"'0\.weight' \(65536 bytes\) needs 512 bytes"):
        model[3] = torch.nn.Linear(128, 128)
    assert isinstance(model[3], torch.nn.GELU)
    assert ot.stats(model).resident_bytes == 2 * 128 * 4


# Casts of a wrapper-subclass weight whose leaves are offloaded (TwoTensor here; torchao's below).
# Before: torch's own path ran the class's cast as an op, paging every leaf onto the device and
# keeping the results as plain device tensors outside the budget, then failed counting them
# ("Attempted to access the data pointer on an invalid python storage").

def _two_tensor_stack(dtype=torch.float32, width=128):
    from torch.testing._internal.two_tensor import TwoTensor

    model = _stack(dtype, width=width, depth=2)
    w = model[0].weight.detach()
    model[0].weight = torch.nn.Parameter(TwoTensor(w.clone(), w.clone() * 2))
    return model


def _leaf_bytes(model) -> int:
    from offtensor import leaves

    return sum(t.numel() * t.element_size() for p in model.parameters() for t in leaves.leaf_tensors(p))


WRAPPER_CASTS = {
    "half()": (torch.float32, lambda m: m.half(), torch.float16),
    "to(bfloat16)": (torch.float32, lambda m: m.to(torch.bfloat16), torch.bfloat16),
    "float()": (torch.bfloat16, lambda m: m.float(), torch.float32),
}


@pytest.mark.parametrize("cast", list(WRAPPER_CASTS))
def test_a_cast_of_a_subclass_with_offloaded_leaves_casts_them_host_side_keeping_the_object(
        cast, swap_on_conversion, device):
    from offtensor import leaves

    start, apply, dtype = WRAPPER_CASTS[cast]
    model = _two_tensor_stack(start)
    reference = apply(_two_tensor_stack(start)).to(device)
    param = model[0].weight
    param.loader_tag = tag = object()
    ot.wrap_model(model, budget_gb=0.5 * _leaf_bytes(model) / GiB, device=device, policy="*")
    assert all(isinstance(leaf, ot.OffloadedTensor) for leaf in leaves.leaf_tensors(param))
    ot.reset_stats(model)
    apply(model)
    s = ot.stats(model)
    assert s.bytes_h2d == 0, "the cast paged the leaves instead of casting their host masters"
    assert model[0].weight is param and type(param).__name__ == "TwoTensor" and isinstance(param, torch.nn.Parameter)
    assert param.loader_tag is tag and param.dtype == dtype and param.device == torch.device(device)
    assert all(isinstance(leaf, ot.OffloadedTensor) and leaf.dtype == dtype for leaf in leaves.leaf_tensors(param))
    assert torch.equal(param.a.cpu(), reference[0].weight.a.cpu()) and torch.equal(param.b.cpu(),
                                                                                   reference[0].weight.b.cpu())
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    with torch.no_grad():
        out, ref = model(x), reference(x)
    assert torch.equal(out.a, ref.a) and torch.equal(out.b, ref.b)
    s = ot.stats(model)
    assert s.bytes_h2d > 0 and s.peak_device_bytes <= s.budget_bytes, s
    gc_collect()
    assert ot.stats(model).offloaded_bytes == _leaf_bytes(model)  # the old leaves' masters are gone


def gc_collect():
    import gc

    gc.collect()


@pytest.mark.filterwarnings("ignore:offtensor. the budget of")
def test_an_upcast_of_a_subclass_whose_leaves_cannot_be_paged_at_the_new_size_raises_before_changing_it(device):
    """bf16 leaves paged a row at a time in an 800-byte budget (a row of each leaf and of the bias:
    768 bytes); at float64 a row of each leaf is 1024 bytes, 2304 with the bias (one op of the Linear
    reads them together). A BudgetError naming the leaf and its bytes, and the weight is left as it
    was, still usable."""
    from offtensor import leaves

    model = _two_tensor_stack(torch.bfloat16)
    ot.wrap_model(model, budget_gb=800 / GiB, device=device, policy="*")
    param = model[0].weight
    before = leaves.leaf_tensors(param)
    assert all(isinstance(leaf, ot.OffloadedTensor) for leaf in before)
    with pytest.raises(ot.BudgetError, match=r"0\.weight \(its leaf a\) \(131072 bytes\) needs 2304 bytes on the "
                                             r"device to be paged with the other offloaded tensors of its module '0'"):
        model.double()
    assert model[0].weight is param and param.dtype == torch.bfloat16
    assert all(a is b for a, b in zip(leaves.leaf_tensors(param), before, strict=True))
    reference = _two_tensor_stack(torch.bfloat16).to(device)
    x = torch.randn(2, 128).to(device, torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(model(x).a, reference(x).a)


class _NoCast(torch.Tensor):
    """A wrapper subclass whose class has no cast kernel: its ``_to_copy`` raises."""

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device,
                                                   strides=elem.stride())

    def __init__(self, elem):
        self.elem = elem

    def __tensor_flatten__(self):
        return ["elem"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, size, stride):
        return _NoCast(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default:
            raise NotImplementedError("_NoCast has no cast kernel")
        unwrap = lambda a: a.elem if isinstance(a, _NoCast) else a  # noqa: E731
        out = func(*map(unwrap, args), **{k: unwrap(v) for k, v in (kwargs or {}).items()})
        return _NoCast(out) if isinstance(out, torch.Tensor) and func.overloadpacket in (
            torch.ops.aten.detach, torch.ops.aten.alias) else out


def test_a_cast_the_subclass_cannot_do_on_its_host_leaves_raises_naming_it_before_changing_anything(device):
    model = torch.nn.Linear(64, 64, bias=False)
    model.weight = param = torch.nn.Parameter(_NoCast(model.weight.detach().clone()), requires_grad=False)
    ot.wrap_model(model, offload_gb=1e-9, device=device, policy="*")
    leaf = param.elem
    assert isinstance(leaf, ot.OffloadedTensor)
    ot.reset_stats(model)
    with pytest.raises(RuntimeError, match=r"cannot cast 'weight' \(a _NoCast of 16384 bytes in its leaves, 16384 of "
                                           r"them offloaded\) to torch.float16: .*_NoCast has no cast kernel.*Nothing "
                                           r"was cast"):
        model.half()
    assert model.weight is param and param.elem is leaf and param.dtype == torch.float32
    assert ot.stats(model).bytes_h2d == 0


def test_a_cast_of_a_resident_subclass_takes_torchs_path_and_counts_its_leaves(swap_on_conversion, device):
    """A wrapper subclass with no offloaded leaf is cast by torch as usual. Before, counting its
    device bytes afterwards raised "Attempted to access the data pointer on an invalid python
    storage" (the outer object has no storage of its own)."""
    model = _two_tensor_stack()
    reference = _two_tensor_stack().half().to(device)
    ot.wrap_model(model, budget_gb=4 * _leaf_bytes(model) / GiB, device=device)
    assert not _offloaded(model)
    model.half()
    assert model[0].weight.a.dtype == torch.float16
    assert ot.stats(model).resident_bytes == _leaf_bytes(model)
    x = torch.randn(2, 128).to(device, torch.float16)
    with torch.no_grad():
        assert torch.equal(model(x).b, reference(x).b)
