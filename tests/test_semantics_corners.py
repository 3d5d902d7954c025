"""OffloadedTensor semantics in the corners of torch, against plain tensors:

- lazy conjugate and negative views;
- composites that take such views of their own intermediates;
- storages handed out;
- out= arguments that overlap an input;
- the numpy and DLPack exits;
- Python functions over each element (``apply_``, ``map_``, ``map2_``).

Each test does the same thing to a plain tensor and to an offloaded copy of it and compares values,
errors and what the master holds afterwards; most also read the offloaded tensor through a warm
cache (a pager with a budget), where a write that bypassed the pager would leave a stale copy.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import offtensor as ot
from offtensor import OffloadedTensor
from offtensor.pager import Pager, resolve_device


# The pagers of this test's tensors: a tensor holds its pager only weakly (a dropped pager's tensors
# move to the uncached default pager), and these tests need the cache.
_PAGERS: list = []


@pytest.fixture(autouse=True)
def _pagers_live_for_the_test():
    yield
    _PAGERS.clear()


def cached(reference: torch.Tensor, device) -> OffloadedTensor:
    """An offloaded copy of ``reference`` whose whole master is cached on the device."""
    _PAGERS.append(Pager(resolve_device(device), budget_bytes=1 << 20))
    x = ot.offload(reference.clone(), pager=_PAGERS[-1])
    x * 1  # warm the cache
    assert x.pager.stats.page_ins == 1 and x.pager.paged_bytes > 0
    return x


def assert_holds(x: OffloadedTensor, expected: torch.Tensor) -> None:
    """``x``'s master holds ``expected``, read from the host and through the cache alike."""
    assert torch.equal(x._host, expected)
    assert torch.equal((x * 1).cpu(), expected)


def complex_weight() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(4, 4, dtype=torch.complex64)


# ------------------------------------------------------------------------------------------------
# conjugate and negative views
# ------------------------------------------------------------------------------------------------


def test_a_conjugate_view_in_inference_mode_is_a_view_as_for_a_plain_tensor(device):
    """``x.conj()`` raised "Cannot set version_counter for inference tensor" in inference mode."""
    reference = complex_weight()
    x = cached(reference, device)
    with torch.inference_mode():
        view, expected = x.conj(), reference.conj()
        imag, expected_imag = x.conj().imag, reference.conj().imag
        values = (view * 1).cpu()
    assert isinstance(view, OffloadedTensor) and view.is_conj() and imag.is_neg()
    assert view.is_inference() == expected.is_inference()
    assert torch.equal(values, expected.resolve_conj())
    assert torch.equal(imag.cpu(), expected_imag.resolve_neg())


WRITES = {
    "mul_": lambda w: w.conj().mul_(2),
    "copy_": lambda w: w.conj().copy_(torch.arange(16.0).view(4, 4).to(torch.complex64) * 1j),
    "add_ on a slice": lambda w: w.conj()[1:3].add_(1j),
    "setitem": lambda w: w.conj().__setitem__(0, 3j),
    "imag.mul_ (a negative view)": lambda w: w.conj().imag.mul_(2),
    "addmm_ (the kernel takes the bit)": lambda w: w.conj().addmm_(torch.eye(4, dtype=torch.complex64), 1j * torch.eye(4, dtype=torch.complex64)),
    "out=": lambda w: torch.add(torch.ones(4, 4, dtype=torch.complex64), 1j, out=w.conj()),
    "mm out=": lambda w: torch.mm(torch.eye(4, dtype=torch.complex64), torch.ones(4, 4) * 1j, out=w.conj()),
    "transposed conj": lambda w: w.t().conj().mul_(3),
    "conj of conj": lambda w: w.conj().conj().mul_(3),
}


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("write", list(WRITES))
def test_writes_through_a_conjugate_view_reach_the_master(device, write, mode):
    """A conjugate view resolved to a copy, so a write through it was lost; now it is a view, and
    torch's Conjugate fallback writes through it to the master as for a plain tensor."""
    reference = complex_weight()
    x = cached(reference, device)
    with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
        WRITES[write](reference)
        WRITES[write](x)
    assert_holds(x, reference)


READS = {
    "mul": lambda w: w.conj() * 1,
    "mm": lambda w: w.conj() @ w,
    "mm of a transposed conj": lambda w: torch.mm(w, w.conj().t()),
    "F.linear": lambda w: F.linear(torch.ones(2, 4, dtype=torch.complex64), w.conj()),
    "addmm": lambda w: torch.addmm(w, w.conj(), w),
    "vdot": lambda w: torch.vdot(w[0], w.conj()[1]),
    "resolve_conj": lambda w: w.conj().resolve_conj(),
    "imag": lambda w: w.conj().imag * 1,
    "cpu": lambda w: w.conj().cpu(),
    "clone": lambda w: w.conj().clone(),
    "deepcopy": lambda w: copy.deepcopy(w.conj()),
    "item": lambda w: torch.tensor(w.conj()[1, 2].item()),
}


@pytest.mark.parametrize("read", list(READS))
def test_reads_of_a_conjugate_view_give_the_plain_values(device, read):
    """The device copy of a conjugate view is the master's raw bytes with the view's bit, so kernels
    that take the bit themselves (mm, addmm, vdot, F.linear's) and the fallback read what a plain
    view holds; the cached copy stays the unconjugated one every other reader shares."""
    reference = complex_weight()
    x = cached(reference, device)
    expected = READS[read](reference)
    got = READS[read](x)
    if isinstance(got, OffloadedTensor):
        got = got.cpu()
    assert torch.equal(got.cpu().resolve_conj().resolve_neg(), expected.resolve_conj().resolve_neg())
    assert_holds(x, reference)
    assert torch.equal(x.conj().materialize().cpu(), reference.conj().resolve_conj())


# ------------------------------------------------------------------------------------------------
# composites that take lazy views of their own intermediates
# ------------------------------------------------------------------------------------------------

COMPOSITES = {
    "fft.hfft2": (torch.float32, lambda a: torch.fft.hfft2(a)),
    "fft.hfftn": (torch.float32, lambda a: torch.fft.hfftn(a)),
    "linalg.pinv": (torch.complex64, lambda a: torch.linalg.pinv(a)),
    "linalg.lstsq's residuals": (torch.complex64, lambda a: torch.linalg.lstsq(
        a[:, :3], torch.eye(5, 2, dtype=torch.complex64), driver="gelsd").residuals),
}


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("name", list(COMPOSITES))
def test_composites_that_conjugate_their_intermediates_match_plain_tensors(device, name, mode):
    """Inside ``__torch_dispatch__`` torch turns the Conjugate and Negative keys off, so a C++
    composite decomposed there (``fft_hfft2`` under inference mode, ``linalg_pinv``) had its kernels
    read the raw values of the lazy views it made itself: hfft2/hfftn of a real weight and pinv of a
    complex one gave other values."""
    dtype, op = COMPOSITES[name]
    torch.manual_seed(0)
    reference = torch.randn(5, 5, dtype=dtype)
    x = ot.offload(reference.clone(), device)
    with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
        expected, got = op(reference), op(x)
    # Default tolerances: LAPACK's results move in the last bits with the input's alignment, for
    # plain tensors too; the values read raw were off by more than the values themselves.
    torch.testing.assert_close(got.cpu(), expected)


def test_a_composite_out_variant_writes_the_plain_values(device):
    """``fft.hfft2(..., out=)`` under inference mode: the out= op is decomposed inside the writing
    op's handler, with the lazy-bit fallbacks on too."""
    torch.manual_seed(0)
    reference = torch.randn(4, 5)
    plain_out = torch.zeros(4, 8)
    out = cached(plain_out, device)
    with torch.inference_mode():
        torch.fft.hfft2(reference, out=plain_out)
        torch.fft.hfft2(ot.offload(reference, device), out=out)
    assert_holds(out, plain_out)


# ------------------------------------------------------------------------------------------------
# storages handed out
# ------------------------------------------------------------------------------------------------

STORAGE_WRITES = {
    "set_ then fill_": lambda w: torch.tensor([], dtype=w.dtype).set_(w.untyped_storage()).fill_(7),
    "set_ then a slice written": lambda w: torch.tensor([], dtype=w.dtype).set_(w.untyped_storage())[2:5].zero_(),
    "storage copy_": lambda w: w.untyped_storage().copy_(torch.full((8,), 3.0).untyped_storage()),
    "storage fill_": lambda w: w.untyped_storage().fill_(0),
    "TypedStorage": lambda w: w.storage().fill_(2.5),
}


@pytest.mark.parametrize("write", list(STORAGE_WRITES))
def test_writes_through_a_handed_out_storage_are_seen_by_the_next_op(device, write):
    """A write through ``untyped_storage()`` dispatches nothing: the next op read the stale cached
    copy. Handing the storage out drops the master's cached copies, as before any write."""
    reference = torch.arange(8.0)
    x = cached(reference, device)
    STORAGE_WRITES[write](reference)
    STORAGE_WRITES[write](x)
    assert_holds(x, reference)


# ------------------------------------------------------------------------------------------------
# out= arguments that overlap an input
# ------------------------------------------------------------------------------------------------

OUT_OPS = {
    "add": lambda i, o: torch.add(i, 1, out=o),
    "mul": lambda i, o: torch.mul(i, i, out=o),
    "exp": lambda i, o: torch.exp(i, out=o),
    "cumsum": lambda i, o: torch.cumsum(i, 0, out=o),
    "cat": lambda i, o: torch.cat([i[:2], i[2:]], out=o),
    "index_select": lambda i, o: torch.index_select(i, 0, torch.tensor([3, 0, 1, 2]), out=o),
    "where": lambda i, o: torch.where(i > 0, i, torch.zeros(()), out=o),
}


@pytest.mark.parametrize("op", list(OUT_OPS))
@pytest.mark.parametrize("input_at, out_at", [(0, 2), (2, 0), (1, 3), (0, 0), (0, 4)], ids=["partial", "partial_before", "partial_odd", "same", "disjoint"])
def test_an_out_argument_overlapping_an_input_does_what_torch_does(device, op, input_at, out_at):
    """An out= argument got a device copy of its own, so one partly overlapping an input was
    computed (and written back over the input) where torch refuses: "some elements of the input
    tensor and the written-to tensor refer to a single memory location". It now shares one device
    copy with the arguments it overlaps, so the op sees the same aliasing as on the host."""
    plain = torch.arange(12.0) - 5
    x = cached(plain, device)

    def run(buffer):
        try:
            with torch.no_grad():
                return OUT_OPS[op](buffer[input_at : input_at + 4], buffer[out_at : out_at + 4])
        except RuntimeError as error:
            return error

    expected, got = run(plain), run(x)
    if isinstance(expected, RuntimeError):
        assert isinstance(got, RuntimeError) and str(got) == str(expected)
    else:
        assert torch.equal(got.cpu(), expected)
    assert_holds(x, plain)


# ------------------------------------------------------------------------------------------------
# numpy and DLPack
# ------------------------------------------------------------------------------------------------


def test_numpy_views_the_master_read_only_on_the_emulated_device(device):
    """``.numpy()`` and ``np.asarray`` raised torch's ".numpy() is not supported for tensor
    subclasses". On the emulated device (a plain CPU tensor's array shares its memory) the array
    views the host master, read-only: a write into it, which would leave cached copies stale, is
    refused by numpy instead of lost. On a GPU it refuses as for any device tensor, naming it."""
    reference = torch.arange(6.0).view(2, 3)
    x = cached(reference, device)
    x._master.name = "layer.weight"
    if x.device.type != "cpu":
        with pytest.raises(TypeError, match=r"'layer.weight' of shape \(2, 3\).*24 bytes.*\.cpu\(\)"):
            x.numpy()
        assert np.array_equal(x.numpy(force=True), reference.numpy())
        return
    for array in (x.numpy(), np.asarray(x), x.t().numpy(), x.numpy(force=True)):
        assert not array.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            array[0] = 1
    assert np.array_equal(x.numpy(), reference.numpy()) and np.array_equal(x.t().numpy(), reference.t().numpy())
    assert np.array_equal(np.asarray(x, dtype=np.float64), reference.numpy().astype(np.float64))
    x.mul_(2)  # the array is the master's memory: it sees later writes, as a plain one does
    assert np.array_equal(np.asarray(x), reference.numpy() * 2)
    assert_holds(x, reference * 2)
    with pytest.raises(RuntimeError, match="requires grad"):
        torch.nn.Parameter(x).numpy()


def test_a_dlpack_export_copies_only_when_asked_and_names_the_tensor(device):
    """``__dlpack__`` reached C++ that read the wrapper's data pointer: "Cannot access data pointer
    of Tensor (e.g. FakeTensor, FunctionalTensor)", naming nothing. An OffloadedTensor has no memory
    of its own to share, so an export without ``copy=True`` is a BufferError naming the weight, its
    bytes and what to do; with it, the export is a device copy."""
    reference = torch.arange(6.0).view(2, 3)
    x = ot.offload(reference.clone(), device)
    x._master.name = "layer.weight"
    with pytest.raises(BufferError, match=r"'layer.weight' of shape \(2, 3\).*24 bytes.*copy=True"):
        x.__dlpack__()
    with pytest.raises(BufferError, match="layer.weight"):
        torch.from_dlpack(x)
    assert torch.equal(torch.from_dlpack(x.__dlpack__(copy=True)).cpu(), reference)
    if x.device.type == "cpu":
        assert np.array_equal(np.from_dlpack(x, copy=True), reference.numpy())


# ------------------------------------------------------------------------------------------------
# Python functions over each element
# ------------------------------------------------------------------------------------------------

ELEMENTWISE = {
    "apply_": lambda w, other: w.apply_(lambda v: v * 2 + 1),
    "map_": lambda w, other: w.map_(other, lambda a, b: a - b),
    "map2_": lambda w, other: w.map2_(other, other, lambda a, b, c: a + b * c),
    "a plain tensor's map_ reading it": lambda w, other: other.map_(w, lambda a, b: a + b),
    "apply_ to a row": lambda w, other: w[1].apply_(lambda v: 0.0),
}


@pytest.mark.parametrize("case", list(ELEMENTWISE))
def test_python_functions_over_elements_run_on_the_master_and_are_seen_by_the_next_op(device, case):
    """``apply_`` / ``map_`` / ``map2_`` read the wrapper's data pointer in C++: "Cannot access data
    pointer", naming nothing. On the emulated device they run on the host master, as on a plain CPU
    tensor's memory, and the warm cache sees the write; on a GPU, torch's CPU-only rule, naming the
    weight."""
    reference, other = torch.arange(6.0).view(2, 3), torch.full((2, 3), 0.5)
    x, x_other = cached(reference.clone(), device), other.clone()
    if x.device.type != "cpu":
        with pytest.raises(TypeError, match=r"of shape \(2, 3\).*only for CPU tensors"):
            ELEMENTWISE[case](x, x_other.to(x.device) if case.startswith("a plain") else x_other)
        assert_holds(x, reference)
        return
    ELEMENTWISE[case](reference, other)
    ELEMENTWISE[case](x, x_other)
    assert_holds(x, reference)
    assert torch.equal(x_other, other)
    with pytest.raises(RuntimeError, match="requires grad"):
        torch.nn.Parameter(x).apply_(lambda v: v)
