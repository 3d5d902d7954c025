"""Hypothesis properties: an OffloadedTensor behaves like the plain tensor it was offloaded from.

Each property offloads a random small tensor (dtypes float32, bfloat16, float16, int64, bool;
contiguous, permuted, sliced, stepped or expanded originals), builds a plain reference with the
same shape and strides on the same device, applies the same random views, in-place ops, compute
ops, index ops, round trips or copies to both, and compares with ``torch.testing.assert_close``
(exact for integer and bool results).
"""

from __future__ import annotations

import copy
import io
import pickle

import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import offtensor as ot
from offtensor import OffloadedTensor
from offtensor.pager import Pager, resolve_device

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool)
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
LAYOUTS = ("contiguous", "permuted", "sliced", "stepped", "expanded")


# ------------------------------------------------------------------------------------------------
# strategies
# ------------------------------------------------------------------------------------------------


def make_values(shape, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    return torch.randint(-20, 21, shape, generator=generator, dtype=dtype)


@st.composite
def plain_tensors(draw, dtypes=DTYPES, min_dims=0, max_dims=3, max_side=4, layouts=LAYOUTS):
    """A small CPU tensor whose memory layout is one of LAYOUTS."""
    dtype = draw(st.sampled_from(dtypes))
    shape = tuple(draw(st.lists(st.integers(1, max_side), min_size=min_dims, max_size=max_dims)))
    seed = draw(st.integers(0, 2**16))
    layout = draw(st.sampled_from(layouts)) if shape else "contiguous"
    if layout == "permuted":
        order = draw(st.permutations(range(len(shape))))
        inverse = sorted(range(len(order)), key=order.__getitem__)
        return make_values(tuple(shape[d] for d in order), dtype, seed).permute(inverse)
    if layout == "sliced":  # gaps on every side
        base = make_values(tuple(s + 2 for s in shape), dtype, seed)
        return base[tuple(slice(1, 1 + s) for s in shape)]
    if layout == "stepped":
        base = make_values(tuple(2 * s for s in shape), dtype, seed)
        return base[tuple(slice(None, None, 2) for _ in shape)]
    if layout == "expanded":  # stride 0: the master gets one element per logical element
        dims = draw(st.sets(st.integers(0, len(shape) - 1), min_size=1))
        return make_values(tuple(1 if d in dims else s for d, s in enumerate(shape)), dtype, seed).expand(shape)
    return make_values(shape, dtype, seed)


def offloaded_and_reference(t, device, pager=None):
    """``offload(t)`` and a plain tensor on the device with the same values, shape and strides."""
    x = ot.offload(t, pager=pager) if pager is not None else ot.offload(t, device=device)
    reference = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device)
    reference.copy_(t)
    return x, reference


def draw_view_op(data, ref, dtype_views=True, detach=True):
    """A random view op valid for ``ref``'s shape, as a function applied to both tensors."""
    dim, shape = ref.dim(), ref.shape
    choices = ["detach", "alias"] if detach else ["alias"]
    if dim < 4:
        choices.append("unsqueeze")
    if dim >= 1:
        choices += ["permute", "slice", "narrow", "unflatten", "movedim", "split"]
        if any(s > 0 for s in shape):
            choices += ["select", "unbind"]
    if dim >= 2:
        choices += ["transpose", "diagonal"]
    if dim <= 2:
        choices.append("t")
    if any(s == 1 for s in shape):
        choices += ["squeeze", "expand"]
    if ref.is_contiguous():
        choices.append("view_flat")
    if dtype_views and ref.dtype in (torch.float16, torch.bfloat16):
        choices.append("view_dtype")
    name = data.draw(st.sampled_from(choices), label="view op")

    def a_dim(condition=lambda d: True):
        return data.draw(st.sampled_from([d for d in range(dim) if condition(d)]))

    if name == "detach":
        return name, lambda a: a.detach()
    if name == "alias":
        return name, lambda a: torch.ops.aten.alias(a)
    if name == "unsqueeze":
        d = data.draw(st.integers(-dim - 1, dim))
        return name, lambda a: a.unsqueeze(d)
    if name == "permute":
        order = data.draw(st.permutations(range(dim)))
        return name, lambda a: a.permute(order)
    if name == "slice":
        d = a_dim()
        start = data.draw(st.integers(0, shape[d]))
        stop = data.draw(st.integers(start, shape[d]))
        step = data.draw(st.integers(1, 3))
        index = (slice(None),) * d + (slice(start, stop, step),)
        return name, lambda a: a[index]
    if name == "narrow":
        d = a_dim()
        start = data.draw(st.integers(0, shape[d]))
        length = data.draw(st.integers(0, shape[d] - start))
        return name, lambda a: a.narrow(d, start, length)
    if name == "unflatten":
        d = a_dim()
        return name, lambda a: a.unflatten(d, (1, shape[d]))
    if name == "movedim":
        source, destination = a_dim(), a_dim()
        return name, lambda a: a.movedim(source, destination)
    if name == "split":
        d = a_dim()
        size = data.draw(st.integers(1, max(shape[d], 1)))
        pieces = max(-(-shape[d] // size), 1)
        piece = data.draw(st.integers(0, pieces - 1))
        return name, lambda a: a.split(size, d)[piece]
    if name == "select":
        d = a_dim(lambda d: shape[d] > 0)
        i = data.draw(st.integers(-shape[d], shape[d] - 1))
        return name, lambda a: a.select(d, i)
    if name == "unbind":
        d = a_dim(lambda d: shape[d] > 0)
        i = data.draw(st.integers(0, shape[d] - 1))
        return name, lambda a: a.unbind(d)[i]
    if name == "transpose":
        d0, d1 = a_dim(), a_dim()
        return name, lambda a: a.transpose(d0, d1)
    if name == "diagonal":
        d0 = a_dim()
        d1 = a_dim(lambda d: d != d0)
        offset = data.draw(st.integers(-1, 1))
        return name, lambda a: a.diagonal(offset, d0, d1)
    if name == "t":
        return name, lambda a: a.t()
    if name == "squeeze":
        d = a_dim(lambda d: shape[d] == 1)
        return name, lambda a: a.squeeze(d)
    if name == "expand":
        d = a_dim(lambda d: shape[d] == 1)
        sizes = list(shape)
        sizes[d] = data.draw(st.integers(1, 3))
        return name, lambda a: a.expand(sizes)
    if name == "view_flat":
        return name, lambda a: a.view(-1)
    if name == "view_dtype":
        other = torch.bfloat16 if ref.dtype == torch.float16 else torch.float16
        return name, lambda a: a.view(other)
    raise AssertionError(name)


def view_chain(data, x, ref, max_length=4, dtype_views=True):
    """Pairs (offloaded alias, reference alias): x itself and each step of a random view chain."""
    pairs = [(x, ref)]
    for _ in range(data.draw(st.integers(0, max_length), label="chain length")):
        name, view = draw_view_op(data, pairs[-1][1], dtype_views)
        pairs.append((view(pairs[-1][0]), view(pairs[-1][1])))
    return pairs


def assert_values(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same shape and values; exact for integer and bool results."""
    actual, expected = actual.detach().cpu(), expected.detach().cpu()
    assert type(actual) is torch.Tensor
    if expected.dtype.is_floating_point or expected.dtype.is_complex:
        torch.testing.assert_close(actual, expected, equal_nan=True)
    else:
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def assert_alias_matches(offloaded, reference) -> None:
    assert isinstance(offloaded, OffloadedTensor)
    assert (offloaded.shape, offloaded.stride(), offloaded.storage_offset()) == (
        reference.shape,
        reference.stride(),
        reference.storage_offset(),
    )
    assert offloaded.dtype == reference.dtype
    assert_values(offloaded.cpu(), reference)  # the host master
    assert_values(offloaded.materialize(), reference)  # a paged copy


def is_non_overlapping_and_dense(t: torch.Tensor) -> bool:
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda pair: pair[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def has_internal_overlap(t: torch.Tensor) -> bool:
    # PyTorch refuses in-place writes to tensors whose elements share memory (expanded views).
    return torch._debug_has_internal_overlap(t) != 0


# ------------------------------------------------------------------------------------------------
# properties
# ------------------------------------------------------------------------------------------------


@given(t=plain_tensors())
def test_offload_keeps_shape_values_and_memory_order(device, t):
    x = ot.offload(t, device=device)
    assert x.shape == t.shape and x.dtype == t.dtype and x.device == resolve_device(device)
    assert x.host_nbytes == t.numel() * t.element_size()
    if is_non_overlapping_and_dense(t):
        # A dense (e.g. permuted) original keeps its memory order (strides of size-1 dims are free)...
        assert [s for s, n in zip(x.stride(), x.shape) if n != 1] == [s for s, n in zip(t.stride(), t.shape) if n != 1]
    else:
        # ...one with gaps or overlaps becomes a contiguous master of exactly numel elements.
        assert x.is_contiguous()
    assert_values(x.cpu(), t)
    assert_values(x.materialize(), t)


@given(t=plain_tensors(), data=st.data())
def test_random_view_chains_stay_offloaded_aliases_with_the_same_values(device, t, data):
    pager = Pager(resolve_device(device))
    x, ref = offloaded_and_reference(t, device, pager)
    pairs = view_chain(data, x, ref)
    paged_before = pager.stats.page_ins
    for offloaded, reference in pairs:
        assert isinstance(offloaded, OffloadedTensor)
        assert offloaded._master is x._master
        assert (offloaded.shape, offloaded.stride(), offloaded.storage_offset()) == (
            reference.shape,
            reference.stride(),
            reference.storage_offset(),
        )
        assert_values(offloaded.cpu(), reference)
    assert pager.stats.page_ins == paged_before  # views and .cpu() never page
    assert_values(pairs[-1][0].materialize(), pairs[-1][1])


def draw_inplace_op(data, ref, device):
    """A random in-place (or out=) op valid for ``ref``'s dtype, as a function of the target."""
    dtype, shape = ref.dtype, ref.shape
    seed = data.draw(st.integers(0, 2**16))
    source = make_values(tuple(shape), dtype, seed).to(device)
    mask = make_values(tuple(shape), torch.bool, seed + 1).to(device)
    if dtype.is_floating_point:
        constant = data.draw(st.sampled_from([-2.0, -0.5, 0.0, 1.5, 3.0]))
    elif dtype == torch.bool:
        constant = data.draw(st.booleans())
    else:
        constant = data.draw(st.integers(-3, 3))
    ops = {
        "fill_": lambda a: a.fill_(constant),
        "zero_": lambda a: a.zero_(),
        "copy_": lambda a: a.copy_(source),
        "masked_fill_": lambda a: a.masked_fill_(mask, constant),
        "setitem": lambda a: a.__setitem__(..., constant),
    }
    if dtype == torch.bool:
        ops["logical_not_"] = lambda a: a.logical_not_()
        ops["bitwise_and_"] = lambda a: a.bitwise_and_(source)
        ops["out="] = lambda a: torch.logical_or(source, mask, out=a)
    else:
        ops["add_"] = lambda a: a.add_(constant)
        ops["mul_"] = lambda a: a.mul_(constant)
        ops["neg_"] = lambda a: a.neg_()
        ops["clamp_"] = lambda a: a.clamp_(min=constant)
        ops["add_tensor_"] = lambda a: a.add_(source, alpha=2)
        ops["out="] = lambda a: torch.mul(source, constant, out=a)
        ops["foreach_add_"] = lambda a: torch._foreach_add_([a], constant)
    if dtype.is_floating_point:
        ops["addcmul_"] = lambda a: a.addcmul_(source, source, value=0.5)
    if ref.dim() and ref.shape[-1] > 0:
        count = ref.shape[-1]
        index = torch.tensor(data.draw(st.lists(st.integers(0, count - 1), min_size=1, max_size=3)), device=device)
        ops["index_fill_"] = lambda a: a.index_fill_(-1, index, constant)
    name = data.draw(st.sampled_from(sorted(ops)), label="in-place op")
    return name, ops[name]


@given(t=plain_tensors(), data=st.data())
def test_random_inplace_sequences_write_through_to_every_alias(device, t, data):
    x, ref = offloaded_and_reference(t, device)
    pairs = view_chain(data, x, ref, max_length=3)
    writable = [i for i, (_, r) in enumerate(pairs) if not has_internal_overlap(r)]
    for _ in range(data.draw(st.integers(1, 4), label="writes")):
        offloaded, reference = pairs[data.draw(st.sampled_from(writable), label="target")]
        name, write = draw_inplace_op(data, reference, device)
        returned = write(offloaded)
        write(reference)
        if name != "foreach_add_" and name != "setitem":
            assert returned is offloaded  # in-place and out= ops return the object they wrote
        for off, ref_alias in pairs:  # every alias sees the write
            assert_alias_matches(off, ref_alias)


def draw_compute_op(data, ref):
    dtype, dim = ref.dtype, ref.dim()
    ops = {
        "sum": lambda a: a.sum(),
        "to_float32": lambda a: a.to(torch.float32),
        "clone": lambda a: a.clone(),
        "contiguous": lambda a: a.contiguous(),
        "reshape": lambda a: a.reshape(-1),
        "where": lambda a: torch.where(a.to(torch.float32) > 0, a, a.flip(list(range(dim)))),
    }
    if dtype == torch.bool:
        ops.update({"not": lambda a: ~a, "and": lambda a: a & a.flip(list(range(dim))), "any": lambda a: a.any()})
    else:
        ops.update({"affine": lambda a: a * 2 + 1, "abs": lambda a: a.abs(), "square": lambda a: a * a})
    if dtype.is_floating_point:
        ops.update({"exp": lambda a: a.exp(), "sigmoid": lambda a: a.sigmoid(), "mean": lambda a: a.float().mean()})
    if dim >= 1:
        ops.update({"cat": lambda a: torch.cat([a, a]), "flip": lambda a: a.flip(0)})
        if dtype != torch.bool:
            ops["cumsum"] = lambda a: a.cumsum(0)
            ops["sort"] = lambda a: a.sort(dim=-1, stable=True).values
        if dtype.is_floating_point:
            ops["softmax"] = lambda a: F.softmax(a.float(), -1)
    if dim >= 2 and dtype.is_floating_point:
        ops["matmul"] = lambda a: a @ a.mT
    if ref.numel() > 0 and dtype != torch.bool:
        ops["max"] = lambda a: a.max()
    name = data.draw(st.sampled_from(sorted(ops)), label="compute op")
    return name, ops[name]


@given(t=plain_tensors(), data=st.data())
def test_random_compute_ops_on_views_match_plain_tensors(device, t, data):
    x, ref = offloaded_and_reference(t, device)
    offloaded, reference = view_chain(data, x, ref, max_length=3)[-1]
    name, compute = draw_compute_op(data, reference)
    result, expected = compute(offloaded), compute(reference)
    if name in ("clone", "contiguous", "reshape") or result is offloaded:
        # Host-side copies stay offloaded, no-ops (.to(own dtype)) return the input; everything
        # else is a plain device tensor.
        assert isinstance(result, OffloadedTensor) or result is offloaded
        result = result.cpu()
    else:
        assert type(result) is torch.Tensor and result.device == resolve_device(device)
    assert_values(result, expected)
    assert_values(offloaded.cpu(), reference)  # computing never changes the input


@given(t=plain_tensors(min_dims=1, max_side=5), data=st.data())
def test_row_index_ops_match_and_page_only_the_selected_rows(device, t, data):
    pager = Pager(resolve_device(device))
    x, ref = offloaded_and_reference(t, device, pager)
    if x.dim() >= 2 and data.draw(st.booleans(), label="transposed"):
        x, ref = x.transpose(0, -1), ref.transpose(0, -1)
    rows = x.shape[0]
    index_list = data.draw(st.lists(st.integers(0, rows - 1), min_size=1, max_size=6), label="rows")
    index = torch.tensor(index_list, device=device)
    negative = torch.tensor([i - rows if data.draw(st.booleans()) else i for i in index_list], device=device)
    ops = {
        "index_select": lambda a: a.index_select(0, index),
        "getitem": lambda a: a[negative],
        "getitem_2d": lambda a: a[index.view(-1, 1)],
    }
    if x.dim() == 2 and x.dtype.is_floating_point:
        ops["embedding"] = lambda a: F.embedding(index.view(1, -1), a)
    name = data.draw(st.sampled_from(sorted(ops)), label="index op")
    before = pager.stats.bytes_h2d
    result = ops[name](x)
    assert type(result) is torch.Tensor
    assert_values(result, ops[name](ref))
    row_bytes = (x.numel() // rows) * x.element_size()
    assert pager.stats.bytes_h2d - before == len(set(index_list)) * row_bytes


@given(t=plain_tensors(min_dims=1, max_dims=3), data=st.data())
def test_other_index_ops_match_plain_tensors(device, t, data):
    x, ref = offloaded_and_reference(t, device)
    d = data.draw(st.integers(0, x.dim() - 1))
    size = x.shape[d]
    index = torch.tensor(data.draw(st.lists(st.integers(0, size - 1), min_size=1, max_size=5)), device=device)
    mask = make_values((x.shape[0],), torch.bool, data.draw(st.integers(0, 99))).to(device)
    gather_index = torch.randint(0, size, x.shape, generator=torch.Generator().manual_seed(size)).to(device)
    ops = {
        "index_select_dim": lambda a: a.index_select(d, index),
        "getitem_later_dim": lambda a: a[(slice(None),) * d + (index,)],
        "boolean_mask": lambda a: a[mask],
        "gather": lambda a: torch.gather(a, d, gather_index),
        "take_along_dim": lambda a: torch.take_along_dim(a, gather_index, d),
    }
    name = data.draw(st.sampled_from(sorted(ops)), label="index op")
    assert_values(ops[name](x), ops[name](ref))


@given(t=plain_tensors(), data=st.data())
def test_torch_save_and_pickle_round_trips_keep_values_and_aliasing(device, t, data):
    x, ref = offloaded_and_reference(t, device)
    # torch.save refuses views of one storage with different dtypes, for plain tensors too.
    pairs = view_chain(data, x, ref, max_length=3, dtype_views=False)
    buffer = io.BytesIO()
    torch.save([off for off, _ in pairs], buffer)
    buffer.seek(0)
    with ot.safe_globals():
        loaded = torch.load(buffer, weights_only=True)
    assert len({id(t._master) for t in loaded}) == 1  # aliases come back as aliases of one master
    assert loaded[0]._master is not x._master
    for got, (_, reference) in zip(loaded, pairs):
        assert_alias_matches(got, reference)
    unpickled = pickle.loads(pickle.dumps(pairs[-1][0]))
    assert_alias_matches(unpickled, pairs[-1][1])


@given(t=plain_tensors(), data=st.data())
def test_clone_and_deepcopy_are_independent_of_the_original(device, t, data):
    x, ref = offloaded_and_reference(t, device)
    offloaded, reference = view_chain(data, x, ref, max_length=3)[-1]
    expected = reference.clone()
    duplicate = offloaded.clone() if data.draw(st.booleans(), label="clone") else copy.deepcopy(offloaded)
    assert isinstance(duplicate, OffloadedTensor) and duplicate._master is not x._master
    x.zero_()  # writing the original does not reach the copy...
    assert_values(duplicate.cpu(), expected)
    if not has_internal_overlap(duplicate):
        duplicate.fill_(True if t.dtype == torch.bool else 1)  # ...and writing the copy does not reach the original
    assert_values(x.cpu(), torch.zeros_like(ref))


@given(t=plain_tensors(), data=st.data())
def test_cpu_equals_the_plain_tensor_without_paging(device, t, data):
    pager = Pager(resolve_device(device))
    x, ref = offloaded_and_reference(t, device, pager)
    offloaded, reference = view_chain(data, x, ref, max_length=3)[-1]
    host = offloaded.cpu()
    assert type(host) is torch.Tensor and host.device.type == "cpu"
    assert_values(host, reference)
    assert pager.stats.page_ins == 0


@given(t=plain_tensors(), data=st.data())
def test_reductions_match_plain_tensors(device, t, data):
    x, ref = offloaded_and_reference(t, device)
    dtype = x.dtype
    ops = {"sum": torch.sum}
    if dtype == torch.bool:
        ops.update({"any": torch.any, "all": torch.all})
    else:
        ops.update({"amax": torch.amax, "amin": torch.amin, "prod": torch.prod})
    if dtype.is_floating_point:
        ops.update({"mean": torch.mean, "logsumexp": lambda a, dim=None, keepdim=False: torch.logsumexp(a.float(), dim if dim is not None else tuple(range(a.dim())), keepdim)})
    name = data.draw(st.sampled_from(sorted(ops)), label="reduction")
    reduce = ops[name]
    if x.dim() and data.draw(st.booleans(), label="along a dim"):
        dim = data.draw(st.integers(-x.dim(), x.dim() - 1))
        keepdim = data.draw(st.booleans())
        result, expected = reduce(x, dim=dim, keepdim=keepdim), reduce(ref, dim=dim, keepdim=keepdim)
    else:
        result, expected = reduce(x), reduce(ref)
    assert type(result) is torch.Tensor
    assert_values(result, expected)
    if x.dim() and x.numel() and dtype != torch.bool:
        dim = data.draw(st.integers(0, x.dim() - 1))
        assert_values(x.argmax(dim), ref.argmax(dim))


@st.composite
def broadcastable_shapes(draw):
    a = draw(st.lists(st.integers(1, 4), min_size=0, max_size=3))
    b = [draw(st.sampled_from([s, 1])) for s in a]
    b = b[draw(st.integers(0, len(b))) :]  # maybe fewer leading dims
    if draw(st.booleans()):
        a, b = b, a
    return tuple(a), tuple(b)


@given(shapes=broadcastable_shapes(), data=st.data())
def test_broadcasting_binary_ops_between_offloaded_and_plain_match(device, shapes, data):
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    other_dtype = data.draw(st.sampled_from([dtype, torch.float32]), label="other dtype")  # type promotion too
    left = make_values(shapes[0], dtype, data.draw(st.integers(0, 99)))
    right = make_values(shapes[1], other_dtype, data.draw(st.integers(0, 99)))
    ops = {"add": torch.add, "mul": torch.mul, "maximum": torch.maximum, "eq": torch.eq, "lt": torch.lt}
    if torch.bool not in (dtype, other_dtype):
        ops["sub"] = torch.sub
    ops["where"] = lambda a, b: torch.where(a.to(torch.float32) > 0.5, a, b)
    name = data.draw(st.sampled_from(sorted(ops)), label="op")
    arrangement = data.draw(st.sampled_from(["both", "left", "right"]), label="offloaded")
    x_left = ot.offload(left, device=device) if arrangement in ("both", "left") else left.to(device)
    x_right = ot.offload(right, device=device) if arrangement in ("both", "right") else right.to(device)
    result = ops[name](x_left, x_right)
    assert type(result) is torch.Tensor
    assert_values(result, ops[name](left.to(device), right.to(device)))


@given(data=st.data())
def test_cached_paging_under_a_budget_matches_plain_tensors(device, data):
    # Random reads and writes on a few tensors sharing one small budget: values always match the
    # plain references (writes invalidate cached copies), and the budget is never exceeded.
    tensors = [
        data.draw(plain_tensors(dtypes=(torch.float32, torch.int64), min_dims=1, layouts=("contiguous", "permuted")))
        for _ in range(3)
    ]
    largest = sorted(t.numel() * t.element_size() for t in tensors)
    budget = largest[-1] + largest[-2]  # an op pages at most two of them
    pager = Pager(resolve_device(device), budget_bytes=budget)
    pairs = [offloaded_and_reference(t, device, pager) for t in tensors]
    for _ in range(data.draw(st.integers(1, 8), label="steps")):
        i = data.draw(st.integers(0, 2), label="tensor")
        offloaded, reference = pairs[i]
        action = data.draw(st.sampled_from(["sum", "rows", "pair", "add_", "copy_"]), label="action")
        if action == "sum":
            assert_values(offloaded.sum(0), reference.sum(0))
        elif action == "rows":
            assert_values(offloaded[: max(1, offloaded.shape[0] // 2)] * 2, reference[: max(1, reference.shape[0] // 2)] * 2)
        elif action == "pair":
            other, other_ref = pairs[(i + 1) % 3]
            assert_values(offloaded.sum() + other.sum(), reference.sum() + other_ref.sum())
        elif action == "add_":
            offloaded.add_(3)
            reference.add_(3)
        else:
            values = make_values(tuple(reference.shape), reference.dtype, i).to(device)
            offloaded.copy_(values)
            reference.copy_(values)
    for offloaded, reference in pairs:
        assert_values(offloaded * 1, reference)
    assert pager.stats.peak_device_bytes <= budget


@given(t=plain_tensors(max_dims=3), data=st.data())
def test_random_inplace_view_ops_change_metadata_like_plain_tensors(device, t, data):
    x, ref = offloaded_and_reference(t, device)
    for _ in range(data.draw(st.integers(1, 4), label="ops")):
        dim = ref.dim()
        choices = ["unsqueeze_"] if dim < 4 else []
        if dim >= 1:
            choices += ["transpose_", "swapdims_", "squeeze_dim_", "squeeze_"]
        if dim <= 2:
            choices.append("t_")
        name = data.draw(st.sampled_from(choices), label="in-place view op")
        if name == "unsqueeze_":
            d = data.draw(st.integers(-dim - 1, dim))
            op = lambda a: a.unsqueeze_(d)  # noqa: E731
        elif name in ("transpose_", "swapdims_"):
            d0, d1 = data.draw(st.integers(0, dim - 1)), data.draw(st.integers(0, dim - 1))
            op = (lambda a: a.transpose_(d0, d1)) if name == "transpose_" else (lambda a: a.swapdims_(d0, d1))
        elif name == "squeeze_dim_":
            d = data.draw(st.integers(0, dim - 1))
            op = lambda a: a.squeeze_(d)  # noqa: E731
        elif name == "squeeze_":
            op = lambda a: a.squeeze_()  # noqa: E731
        else:
            op = lambda a: a.t_()  # noqa: E731
        assert op(x) is x
        op(ref)
        assert_alias_matches(x, ref)


@given(t=plain_tensors(dtypes=(torch.float32,), min_dims=1), data=st.data())
def test_gradients_through_random_views_match_plain_tensors(device, t, data):
    # A trainable offloaded parameter gets the plain parameter's gradient through any view chain
    # and compute op; a frozen one passes the same gradient on to a plain input.
    x, ref = offloaded_and_reference(t, device)
    parameter, reference = torch.nn.Parameter(x), torch.nn.Parameter(ref)
    chain = [(parameter, reference)]
    for _ in range(data.draw(st.integers(0, 3), label="chain length")):
        _, view = draw_view_op(data, chain[-1][1], dtype_views=False, detach=False)
        chain.append((view(chain[-1][0]), view(chain[-1][1])))
    offloaded_view, reference_view = chain[-1]
    scale = make_values(tuple(reference_view.shape), torch.float32, data.draw(st.integers(0, 99))).to(device)
    frozen = data.draw(st.booleans(), label="frozen")
    if frozen:
        parameter.requires_grad_(False)
        reference.requires_grad_(False)
        scale.requires_grad_()
    ops = {
        "weighted_sum": lambda v: (v * scale).sum(),
        "tanh": lambda v: (v.tanh() * scale).sum(),
        "softmax": lambda v: (F.softmax(v.reshape(-1), 0) * scale.reshape(-1)).sum(),
        "clone_square": lambda v: (v.clone() ** 2 * scale).sum(),
    }
    name = data.draw(st.sampled_from(sorted(ops)), label="loss")
    offloaded_loss = ops[name](offloaded_view)
    if frozen:
        (offloaded_grad,) = torch.autograd.grad(offloaded_loss, scale)
        (reference_grad,) = torch.autograd.grad(ops[name](reference_view), scale)
        assert_values(offloaded_grad, reference_grad)
        return
    offloaded_loss.backward()
    ops[name](reference_view).backward()
    assert type(parameter.grad) is torch.Tensor and parameter.grad.device == resolve_device(device)
    assert_values(parameter.grad, reference.grad)
