"""Metadata reads and memoized transposes of an OffloadedTensor (tensor.py, ops/views.py): the same
answers as a plain tensor's, without a trip through ``__torch_function__`` for the reads, and the
same view object for a repeated transpose of a weight only while that is indistinguishable from a
new one (nothing changed in place, no gradient, no mode that must see the op)."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import offtensor as ot
from offtensor import OffloadedTensor
from offtensor.ops.functions import FUNCTION_TABLE
from offtensor.tensor import METADATA_METHODS, METADATA_PROPERTIES


def _subjects(device):
    plain = torch.randn(3, 4, 5)
    views = {"whole": lambda t: t, "transposed": lambda t: t.transpose(-2, -1), "sliced": lambda t: t[1:, ::2]}
    return [(name, make(plain), make(ot.offload(plain, device))) for name, make in views.items()]


_CALLS = {"size": [((), {}), ((-1,), {}), ((0,), {})], "stride": [((), {}), ((1,), {})],
          "is_contiguous": [((), {}), ((), {"memory_format": torch.channels_last})]}


def _reads(t) -> dict:
    out = {p: getattr(t, p) for p in METADATA_PROPERTIES}
    for m in METADATA_METHODS:
        for args, kwargs in _CALLS.get(m, [((), {})]):
            out[(m, args, tuple(kwargs.items()))] = getattr(t, m)(*args, **kwargs)
    return out


def test_metadata_reads_answer_what_a_plain_tensor_does_without_torch_function(device, monkeypatch):
    seen = []
    original = OffloadedTensor.__dict__["__torch_function__"].__func__

    def counting(cls, func, types, args=(), kwargs=None):
        seen.append(func)
        return original(cls, func, types, args, kwargs)

    for name, plain, off in _subjects(device):
        monkeypatch.setattr(OffloadedTensor, "__torch_function__", classmethod(counting))
        got = _reads(off)
        monkeypatch.undo()
        assert seen == [], (name, seen)  # none of them entered __torch_function__
        expected = _reads(plain)
        expected["device"], expected["is_cuda"] = off.device, off.device.type == "cuda"
        with torch._C.DisableTorchFunctionSubclass():  # the wrapper's own device, read the slow way
            assert torch.Tensor.device.__get__(off) == off.device
        assert got == expected, name


def test_no_metadata_read_is_a_whole_op_the_function_table_intercepts():
    reads = [getattr(torch.Tensor, p).__get__ for p in METADATA_PROPERTIES]
    reads += [getattr(torch.Tensor, m) for m in METADATA_METHODS]
    assert not [f for f in reads if f in FUNCTION_TABLE]


def test_torch_function_modes_still_see_metadata_reads(device):
    class Record(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.funcs = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.funcs.append(func)
            return func(*args, **(kwargs or {}))

    t = ot.offload(torch.randn(2, 3), device)
    with Record() as mode:
        assert t.dtype == torch.float32 and t.size(1) == 3 and t.dim() == 2
    assert torch.Tensor.dtype.__get__ in mode.funcs and torch.Tensor.size in mode.funcs
    assert torch.Tensor.dim in mode.funcs


def test_requires_grad_is_read_and_set_on_the_wrapper(device):
    t = ot.offload(torch.randn(2, 3), device)
    assert t.requires_grad is False
    t.requires_grad = True
    assert t.requires_grad is True and t.is_leaf
    t.requires_grad_(False)
    assert t.requires_grad is False
    with pytest.raises(AttributeError):
        t.dtype = torch.float16


# ---------------------------------------------------------------------------- memoized transposes


@torch.no_grad()
def test_a_repeated_transpose_of_a_weight_is_one_view_with_the_plain_values(device):
    plain = torch.randn(4, 3, 5)
    w = ot.offload(plain, device)
    a, b = w.transpose(-2, -1), w.transpose(-2, -1)
    assert a is b and isinstance(a, OffloadedTensor)
    assert torch.equal(a.cpu(), plain.transpose(-2, -1)) and a.untyped_storage() is not None
    assert w.transpose(0, 1) is not a and torch.equal(w.transpose(0, 1).cpu(), plain.transpose(0, 1))
    m = ot.offload(plain[0], device)
    assert m.t() is m.t() and torch.equal(m.t().cpu(), plain[0].t())
    x = torch.randn(2, 3).to(device)
    assert torch.equal(x @ m.t().t(), x @ plain[0].to(device))
    with torch.enable_grad():
        assert w.transpose(-2, -1) is not a  # grad on: a new view each call, as before
    assert w.transpose(-2, -1) is a


@torch.no_grad()
def test_a_memoized_transpose_is_made_again_after_any_in_place_metadata_change(device):
    plain = torch.randn(3, 5)
    w = ot.offload(plain, device)
    a = w.t()
    a.t_()  # the view handed out changes in place
    assert w.t() is not a and w.t().shape == (5, 3) and torch.equal(w.t().cpu(), plain.t())
    w.t_()  # the weight itself
    assert w.t().shape == (3, 5) and torch.equal(w.t().cpu(), plain)
    w.data = torch.randn(2, 7)  # the .data setter repoints the weight
    assert w.t().shape == (7, 2)
    v = w.t()
    v.requires_grad_()
    assert w.t() is not v and not w.t().requires_grad


@torch.no_grad()
def test_a_memoized_transpose_does_not_keep_its_weights_host_memory_alive(device):
    w = ot.offload(torch.randn(64, 32), device)
    w.t(), w.transpose(0, 1)
    master = weakref.ref(w._master)
    del w
    assert master() is None  # freed at once: no reference cycle through the memo


def test_a_weight_that_needs_a_gradient_is_memoized_only_with_grad_off(device):
    """transformers' weights need a gradient even in eval: with grad off their transposes are
    memoized like any other's (and need no gradient, as a plain view made there); with grad on
    each call is a new autograd view, and training is unchanged."""
    plain = torch.randn(3, 5)
    w = ot.offload(plain, device).requires_grad_()
    with torch.no_grad():
        v = w.t()
        reference = plain.requires_grad_().t()
        assert v is w.t() and torch.equal(v.cpu(), plain.t())
        assert (v.requires_grad, v.is_leaf) == (reference.requires_grad, reference.is_leaf) == (True, True)
    x = torch.randn(2, 5).to(device)
    (x @ v).sum().backward()  # a leaf: its gradient is its own, as the plain view's
    torch.testing.assert_close(v.grad.cpu(), x.cpu().sum(0).unsqueeze(1).expand(5, 3))
    assert w.grad is None
    with torch.no_grad():
        assert w.t() is not v and w.t().grad is None  # a view holding a gradient is made again
    assert w.t() is not v and w.t().requires_grad
    for _ in range(2):  # each step's graph has its own view node: backward twice works
        (x @ w.t()).sum().backward()
    torch.testing.assert_close(w.grad.cpu(), 2 * x.cpu().sum(0).expand(3, 5))


def test_modes_see_every_transpose(device):
    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    w = ot.offload(torch.randn(3, 5), device)
    with torch.no_grad():
        first = w.t()
        with Record() as mode:
            again = w.t()
    assert again is not first and torch.ops.aten.t.default in mode.ops
