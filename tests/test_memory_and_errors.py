"""Memory and errors: no reference cycles, exact host bytes freed exactly when the last alias dies,
and clear errors for what cannot be offloaded.

The cycle tests follow subclass_zoo's ``test_no_cycle``: with the garbage collector off, an object
that is part of a reference cycle is never freed by ``del``, so a ``weakref.finalize`` that has not
run after ``del`` proves a cycle (one that would keep gigabytes of pinned host memory alive until
the next collection).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import io
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import offtensor as ot
from offtensor import OffloadedTensor, _ext
from offtensor.pager import Pager, resolve_device


@contextlib.contextmanager
def gc_disabled():
    gc.collect()  # start from a clean heap, so nothing unrelated is freed during the test
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


# ------------------------------------------------------------------------------------------------
# no reference cycles
# ------------------------------------------------------------------------------------------------


def _offloaded(device):
    x = ot.offload(torch.randn(4, 4), device=device)
    return x, [x]


def _parameter(device):
    p = nn.Parameter(ot.offload(torch.randn(4, 4), device=device))
    return p, [p]


def _view_only(device):
    view = ot.offload(torch.randn(4, 4), device=device)[1:].t()
    return view, [view]


def _after_compute_and_backward(device):
    p = nn.Parameter(ot.offload(torch.randn(5, 3), device=device))
    F.linear(torch.randn(2, 3, device=device), p).sum().backward()
    (p * 2).sum()
    return p, [p]


def _cached_under_a_budget(device):
    pager = Pager(resolve_device(device), budget_bytes=1 << 16)
    x = ot.offload(torch.randn(8, 8), pager=pager)
    x * 1  # leaves a cached copy keyed by the master
    return x, [x]


def _clone_and_deepcopy(device):
    x = ot.offload(torch.randn(3, 3), device=device)
    pair = [x.clone(), copy.deepcopy(x)]
    return pair[1], pair


def _loaded(device):
    buffer = io.BytesIO()
    torch.save(ot.offload(torch.randn(3, 3), device=device), buffer)
    buffer.seek(0)
    with ot.safe_globals():
        x = torch.load(buffer, weights_only=True)
    return x, [x]


def _wrapped_module(device):
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    # 2176 bytes of weights in a 1600-byte budget: both 1024-byte weights are offloaded.
    ot.wrap_model(model, budget_gb=1600 / 2**30, device=device)
    offloaded = [p for p in model.parameters() if isinstance(p, OffloadedTensor)]
    assert offloaded
    model(torch.randn(2, 16, device=device))
    return model, offloaded


@pytest.mark.parametrize(
    "make",
    [
        _offloaded,
        _parameter,
        _view_only,
        _after_compute_and_backward,
        _cached_under_a_budget,
        _clone_and_deepcopy,
        _loaded,
        _wrapped_module,
    ],
    ids=lambda f: f.__name__.strip("_"),
)
def test_no_reference_cycle_keeps_offloaded_tensors_alive(device, make):
    with gc_disabled():
        obj, tensors = make(device)
        masters = [t._master for t in tensors]
        freed = []
        weakref.finalize(obj, freed.append, "object")
        for master in masters:
            weakref.finalize(master, freed.append, "master")
        del obj, tensors, masters, master
        assert "object" in freed, "the object is kept alive by a reference cycle"
        assert freed.count("master") == len(freed) - 1 >= 1, "a host master outlived every tensor using it"


# ------------------------------------------------------------------------------------------------
# exact host bytes
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(7, 5),
        lambda: torch.randn(3, 1, 9).to(torch.bfloat16),
        lambda: torch.randint(0, 9, (13,)),
        lambda: torch.rand(11, 3) > 0.5,
        lambda: torch.randn(6, 8)[2:4],  # a slice offloads only its own bytes...
        lambda: torch.randn(6, 8)[:, ::3],  # ...also when strided
        lambda: torch.randn(9, 4).t(),
        lambda: torch.randn(4, 1).expand(4, 6),  # every logical element is stored
        lambda: torch.randn(0, 5),
        lambda: torch.tensor(2.5),
    ],
    ids=["float32", "bfloat16", "int64", "bool", "slice", "strided-slice", "transposed", "expanded", "empty", "0-d"],
)
def test_host_bytes_are_exact(device, make):
    t = make()
    expected = t.numel() * t.element_size()
    with gc_disabled():
        live_before = _ext.live_host_bytes()
        x = ot.offload(t, device=device)
        assert x.host_nbytes == expected
        assert x.untyped_storage().nbytes() == expected
        # The allocation is exactly the tensor's bytes: no rounding to a power of two, no base.
        assert _ext.live_host_bytes() - live_before == expected
        del x
        assert _ext.live_host_bytes() == live_before


def test_host_memory_is_freed_when_the_last_alias_dies_not_before(device):
    reference = torch.randn(32, 16)
    nbytes = reference.numel() * reference.element_size()
    pager = Pager(resolve_device(device))
    with gc_disabled():
        live_before = _ext.live_host_bytes()
        x = ot.offload(reference, pager=pager)
        view = x[8:12].t()
        parameter = nn.Parameter(x[0], requires_grad=False)
        assert pager.offloaded_bytes == nbytes
        del x
        # Aliases still alive: the master and its bytes stay, with the right values.
        assert _ext.live_host_bytes() - live_before == nbytes
        assert torch.equal(view.cpu(), reference[8:12].t())
        del view
        assert _ext.live_host_bytes() - live_before == nbytes
        assert torch.equal(parameter.cpu(), reference[0])
        del parameter
        assert _ext.live_host_bytes() == live_before
        assert pager.offloaded_bytes == 0


def test_cached_copies_are_dropped_when_their_master_dies(device):
    pager = Pager(resolve_device(device), budget_bytes=1 << 16)
    with gc_disabled():
        x = ot.offload(torch.randn(16, 16), pager=pager)
        x.sum()
        assert pager.paged_bytes == 16 * 16 * 4
        del x
        assert pager.paged_bytes == 0


def test_views_and_compute_allocate_no_host_memory(device):
    x = ot.offload(torch.randn(8, 8), device=device)
    with gc_disabled():
        live_before = _ext.live_host_bytes()
        views = [x.t(), x[2:5], x.view(-1), x.unsqueeze(0).expand(3, 8, 8)]
        results = [v.sum() for v in views] + [x @ x, F.embedding(torch.tensor([1, 2], device=device), x)]
        assert _ext.live_host_bytes() == live_before
        assert len(results) == 6


# ------------------------------------------------------------------------------------------------
# errors name what was wrong
# ------------------------------------------------------------------------------------------------

# ------------------------------------------------------------------------------------------------
# tensors that outlive their model
# ------------------------------------------------------------------------------------------------


def _wrapped_for_state_dict(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    ot.wrap_model(model, budget_gb=1600 / 2**30, device=device)  # both weights offloaded, cached copies kept
    model(torch.randn(2, 16, device=device))
    return model


def _uses(sd, view, x):
    """What users do with state-dict values and views: compute, matmul, clone, copies out."""
    clone = view.clone()
    return [sd["0.weight"].sum(), x @ view.t(), clone.cpu(), (clone * 2).cpu(), sd["2.weight"].materialize(),
            sd["2.bias"] + 1, sd["0.weight"].cpu()]


def test_state_dict_values_and_views_keep_working_after_their_model_and_pager_are_dropped(device):
    x = torch.randn(3, 16, device=device)
    with gc_disabled():
        model = _wrapped_for_state_dict(device)
        sd = model.state_dict()
        view = sd["0.weight"][2:]
        assert isinstance(view, OffloadedTensor) and isinstance(sd["2.weight"], OffloadedTensor)
        expected = [t.cpu().clone() for t in _uses(sd, view, x)]
        pager = sd["0.weight"].pager
        freed = []
        weakref.finalize(model, freed.append, "model")
        weakref.finalize(pager, freed.append, "pager")
        del model, pager
        # Nothing that outlives the model keeps it, its pager or its cached copies alive: no cycle either.
        assert freed == ["model", "pager"]
        got = [t.cpu() for t in _uses(sd, view, x)]
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


def test_orphaned_weights_are_charged_to_the_default_pager_until_they_die(device):
    with gc_disabled():
        model = _wrapped_for_state_dict(device)
        sd = {k: v for k, v in model.state_dict().items() if isinstance(v, OffloadedTensor)}
        nbytes = sum(v.host_nbytes for v in sd.values())
        del model
        default = Pager.default(resolve_device(device))
        before = default.offloaded_bytes
        live_before = _ext.live_host_bytes()
        for value in sd.values():
            assert value.pager is default  # the first use re-charges an orphan, once
            assert value.pager is default
        assert default.offloaded_bytes - before == nbytes
        assert default.paged_bytes == 0  # the default pager caches nothing: each op's copies die with it
        del value
        sd.clear()
        assert default.offloaded_bytes == before
        assert live_before - _ext.live_host_bytes() == nbytes


def test_a_weight_moved_to_another_pager_after_its_own_died_is_charged_there_once(device):
    with gc_disabled():
        model = _wrapped_for_state_dict(device)
        weight = model[0].weight
        del model
        other = Pager(resolve_device(device), budget_bytes=1 << 16)
        ot.offload(weight, pager=other)
        assert weight.pager is other and other.offloaded_bytes == weight.host_nbytes
        assert torch.equal((weight * 1).cpu(), weight.cpu())
        del weight
        assert other.offloaded_bytes == 0



def test_offloading_a_meta_tensor_names_shape_and_bytes(device):
    with pytest.raises(ValueError) as error:
        ot.offload(torch.empty(3, 4, device="meta"), device=device)
    message = str(error.value)
    assert "meta" in message and "(3, 4)" in message and "48 bytes" in message


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("to_sparse", [torch.Tensor.to_sparse, torch.Tensor.to_sparse_csr], ids=["coo", "csr"])
def test_offloading_a_sparse_tensor_names_layout_and_shape(device, to_sparse):
    sparse = to_sparse(torch.eye(3))
    with pytest.raises(ValueError) as error:
        ot.offload(sparse, device=device)
    message = str(error.value)
    assert str(sparse.layout) in message and "(3, 3)" in message and "to_dense" in message


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_offloading_a_nested_tensor_is_refused(device):
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.raises(ValueError, match="nested"):
        ot.offload(nested, device=device)


@pytest.mark.skipif(torch.cuda.device_count() > 7, reason="this machine has a cuda:7")
def test_offloading_to_a_missing_gpu_names_the_device(device):
    with pytest.raises(ValueError) as error:
        ot.offload(torch.ones(3), device="cuda:7")
    message = str(error.value)
    assert "cuda:7" in message and "does not exist" in message and f"{torch.cuda.device_count()} CUDA device" in message


@pytest.mark.parametrize("target", ["xla", "meta", "not-a-device"])
def test_offloading_to_an_unsupported_device_names_it(device, target):
    with pytest.raises(ValueError) as error:
        ot.offload(torch.ones(3), device=target)
    assert target in str(error.value)


@pytest.mark.parametrize("value", [[1.0, 2.0], None, 3, "weights"], ids=["list", "None", "int", "str"])
def test_offloading_a_non_tensor_names_its_type(device, value):
    with pytest.raises(TypeError) as error:
        ot.offload(value, device=device)
    assert type(value).__name__ in str(error.value)


def test_offloading_a_numpy_array_names_its_type(device):
    numpy = pytest.importorskip("numpy")
    with pytest.raises(TypeError, match="ndarray"):
        ot.offload(numpy.ones(3), device=device)


def test_offloading_another_tensor_subclass_names_it(device):
    # A wrapper subclass with __tensor_flatten__ (TwoTensor) has its leaves offloaded now
    # (tests/test_subclass_leaves.py); a subclass with storage of its own is refused by name.
    class Marked(torch.Tensor):
        pass

    with pytest.raises(TypeError, match="subclass Marked"):
        ot.offload(torch.ones(2).as_subclass(Marked), device=device)


def test_resize_names_the_fixed_host_bytes(device):
    x = ot.offload(torch.ones(3), device=device)
    assert x.resize_(3) is x  # same size: allowed, as plain resize_ is a no-op then
    with pytest.raises(RuntimeError) as error:
        x.resize_(5)
    assert "(5,)" in str(error.value) and "12 bytes" in str(error.value)


def test_out_variant_that_would_resize_names_shape_and_bytes(device):
    out = ot.offload(torch.zeros(2), device=device)
    with pytest.raises(RuntimeError) as error, pytest.warns(UserWarning):
        torch.add(torch.ones(3, device=device), 1, out=out)
    assert "(3,)" in str(error.value) and "8 bytes" in str(error.value)
    assert torch.equal(out.cpu(), torch.zeros(2))  # nothing was written


def test_set_is_refused_and_names_the_op(device):
    x = ot.offload(torch.ones(3), device=device)
    with pytest.raises(RuntimeError, match="set_"):
        x.set_(torch.zeros(3, device=device))
    assert torch.equal(x.cpu(), torch.ones(3))


def test_set_pointing_a_plain_tensor_at_an_offloaded_one_is_refused_naming_it(device):
    x = ot.offload(torch.ones(3), device=device)
    plain = torch.zeros(0, device=device)
    with pytest.raises(RuntimeError, match="plain tensor at an OffloadedTensor of shape \\(3,\\)"):
        plain.set_(x)
    assert plain.shape == (0,) and torch.equal(x.cpu(), torch.ones(3))


def test_out_of_range_row_index_names_index_and_size(device):
    x = ot.offload(torch.ones(3, 2), device=device)
    plain = torch.ones(3, 2)
    for index in (torch.tensor([1, 5], device=device), torch.tensor([-4], device=device)):
        with pytest.raises(IndexError) as error:
            x[index]
        with pytest.raises(IndexError):
            plain[index.cpu()]
        assert "size 3" in str(error.value)


def test_data_ptr_is_the_host_address_only_where_the_device_can_address_it(device):
    # Emulated device: the host master is the memory. GPU: pinned masters are mapped into the
    # unified address space; a master in pageable memory (as torch.load gives) has no device address.
    x = ot.offload(torch.ones(3), device=device)
    if x.device.type == "cpu" or x._host.is_pinned():
        assert x.data_ptr() == x.const_data_ptr() == x.untyped_storage().data_ptr() != 0
    buffer = io.BytesIO()
    torch.save(x, buffer)
    buffer.seek(0)
    with ot.safe_globals():
        loaded = torch.load(buffer, weights_only=True)
    if loaded.device.type == "cpu":
        assert loaded.data_ptr() == loaded.untyped_storage().data_ptr()
    else:
        assert not loaded._host.is_pinned()
        for pointer in (loaded.data_ptr, loaded.const_data_ptr):
            with pytest.raises(RuntimeError, match="materialize"):
                pointer()


def test_cpp_reading_a_weights_data_pointer_without_dispatch_raises_instead_of_crashing(device):
    # The wrapper's own storage is empty: C++ that reads its data pointer directly got null (on main,
    # to_dlpack then from_dlpack and a read segfaulted the process). The weight is unharmed.
    model = ot.wrap_model(nn.Linear(8, 8), offload_gb=1e-9, device=device)
    with pytest.raises(RuntimeError, match="Cannot access data pointer"):
        torch.utils.dlpack.to_dlpack(model.weight)
    assert isinstance(model.weight, OffloadedTensor) and torch.equal(model.weight.cpu(), model.weight.cpu())
    with pytest.raises(RuntimeError, match="Cannot access data pointer"):
        torch.utils.dlpack.to_dlpack(ot.offload(torch.ones(3), device=device))
