"""Differential semantics: the same program run on plain tensors and on offloaded ones, compared bit
for bit after every step, the host master included.

What tests/test_properties.py leaves out: ops whose arguments alias each other (a write through one
alias read or written through another in the same op), writes through expanded views, out= outputs
that an op resizes, index writes with a whole dimension before the index, memory questions
(``is_set_to``), the layout of a clone, the attributes a tensor carries through pickling and
deepcopy, a master whose bytes ``share_memory_`` moved, and random programs of the views it does not draw (``unfold``, ``as_strided``,
``view_as_complex``, ``.data``...) with writes through any alias, checked through the host master, a
fresh page and a cached one.
"""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import offtensor as ot
from offtensor import OffloadedTensor
from offtensor.pager import Pager, resolve_device


def offloaded_and_plain(values: torch.Tensor, device, pager=None):
    x = ot.offload(values.clone(), pager=pager) if pager is not None else ot.offload(values.clone(), device=device)
    return x, values.clone().to(device)


def assert_same(offloaded: torch.Tensor, plain: torch.Tensor) -> None:
    """Same values, bit for bit: through the host master and through a paged copy."""
    assert isinstance(offloaded, OffloadedTensor)
    expected = plain.detach().cpu()
    assert torch.equal(offloaded._host, expected), (offloaded._host, expected)
    assert torch.equal(offloaded.materialize().cpu(), expected)


def outcome(program, *tensors):
    """What ``program`` returned, or the type and message of the error it raised."""
    try:
        return program(*tensors), None
    except RuntimeError as error:
        return None, str(error).split("\n")[0]


@st.composite
def aliased_programs(draw):
    """A 1-D length, and a list of steps; each step names two (possibly overlapping) windows of the
    one base tensor and an op that writes the first while reading the second, or both at once."""
    n = draw(st.integers(2, 8))

    def window():
        start = draw(st.integers(0, n - 1))
        length = draw(st.integers(1, n - start))
        return start, length

    steps = []
    for _ in range(draw(st.integers(1, 4))):
        steps.append((draw(st.sampled_from(["add_", "mul_", "copy_", "foreach_add_", "addcmul_", "index_add_"])),
                      window(), window()))
    return n, steps


def run_step(base: torch.Tensor, step) -> None:
    name, (s0, n0), (s1, n1) = step
    a, b = base.narrow(0, s0, n0), base.narrow(0, s1, n1)
    if name == "foreach_add_":
        torch._foreach_add_([a, b], 1.0)
        return
    b = b[: min(n0, n1)]
    a = a[: min(n0, n1)]
    if name == "add_":
        a.add_(b, alpha=2)
    elif name == "mul_":
        a.mul_(b)
    elif name == "copy_":
        a.copy_(b)
    elif name == "addcmul_":
        a.addcmul_(b, b, value=0.5)
    elif name == "index_add_":
        a.index_add_(0, torch.arange(a.shape[0], device=a.device).flip(0), b)


@given(program=aliased_programs(), seed=st.integers(0, 2**16))
@settings(max_examples=120)
def test_ops_whose_arguments_alias_each_other_match_plain_tensors(device, program, seed):
    n, steps = program
    values = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    x, plain = offloaded_and_plain(values, device)
    for step in steps:
        _, error = outcome(run_step, plain, step)
        _, offloaded_error = outcome(run_step, x, step)
        assert offloaded_error == error, step
        assert_same(x, plain)


def test_foreach_write_through_a_weight_and_its_alias_keeps_both_writes(device):
    # Two Parameters over one storage (a tie made with .data) in one foreach optimizer step.
    x, plain = offloaded_and_plain(torch.arange(6.0), device)
    torch._foreach_add_([x, x.detach()], [torch.ones(6, device=x.device), torch.full((6,), 10.0, device=x.device)])
    torch._foreach_add_([plain, plain.detach()], [torch.ones(6, device=plain.device), torch.full((6,), 10.0, device=plain.device)])
    assert_same(x, plain)


def test_an_in_place_op_reading_a_partly_overlapping_alias_is_refused_as_on_a_plain_tensor(device):
    x, plain = offloaded_and_plain(torch.arange(5.0), device)
    with pytest.raises(RuntimeError, match="refer to a single memory location") as expected:
        plain[1:].add_(plain[:-1])
    with pytest.raises(RuntimeError) as error:
        x[1:].add_(x[:-1])
    assert str(error.value) == str(expected.value)
    assert_same(x, plain)  # nothing written


@pytest.mark.parametrize("write", ["fill_", "zero_", "masked_fill_", "index_fill_"])
def test_writes_a_plain_tensor_allows_through_an_expanded_view_reach_the_host_master(device, write):
    # Elements of a stride-0 dimension share memory; these ops write them all with one value.
    x, plain = offloaded_and_plain(torch.arange(4.0).view(1, 4), device)
    ops = {
        "fill_": lambda a: a.fill_(7.0),
        "zero_": lambda a: a.zero_(),
        "masked_fill_": lambda a: a.masked_fill_(torch.ones(3, 4, dtype=torch.bool, device=a.device), 3.0),
        "index_fill_": lambda a: a.index_fill_(1, torch.tensor([0, 2], device=a.device), 5.0),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # masked_fill_ and index_fill_ on expanded tensors are deprecated
        ops[write](plain.expand(3, 4))
        ops[write](x.expand(3, 4))
    assert_same(x, plain)


def test_an_out_op_resizing_its_offloaded_output_leaves_other_cached_copies_intact(device):
    pager = Pager(resolve_device(device), budget_bytes=1 << 16)
    weights = [ot.offload(torch.arange(64.0) + 100 * i, pager=pager) for i in range(8)]
    out = ot.offload(torch.zeros(2), pager=pager)
    for w in weights:
        w + 0  # each cached, side by side in the arena
    weights[0].copy_(torch.zeros(64))  # a host write: the first range is free again
    with pytest.raises(RuntimeError, match="host master is exactly 8 bytes"), pytest.warns(UserWarning):
        torch.mul(torch.ones(1000, device=out.device), 5, out=out)
    assert torch.equal(out.cpu(), torch.zeros(2))
    for i, w in enumerate(weights[1:], 1):  # cached copies, read again: none written over
        assert torch.equal((w + 0).cpu(), torch.arange(64.0) + 100 * i)


def test_an_out_op_growing_a_view_within_its_master_writes_what_a_plain_op_writes(device):
    pager = Pager(resolve_device(device), budget_bytes=1 << 16)
    x, plain = offloaded_and_plain(torch.arange(8.0), device, pager)
    other = ot.offload(torch.arange(64.0), pager=pager)
    other + 0
    with pytest.warns(UserWarning):
        torch.mul(torch.arange(6.0, device=x.device), 5, out=plain[:2])
    with pytest.warns(UserWarning):
        torch.mul(torch.arange(6.0, device=x.device), 5, out=x[:2])
    assert_same(x, plain)
    assert torch.equal((other + 0).cpu(), torch.arange(64.0))


@pytest.mark.parametrize("index", ["columns", "mask_after_slice", "rows_and_columns"])
def test_index_writes_with_a_whole_dimension_before_the_index_reach_the_host_master(device, index):
    # Weight loaders write column blocks: ``param.data[:, cols] = loaded``.
    x, plain = offloaded_and_plain(torch.zeros(3, 4), device)
    columns = torch.tensor([0, 2], device=plain.device)
    for t in (x, plain):
        if index == "columns":
            t[:, columns] = torch.tensor([1.0, 2.0], device=t.device)
        elif index == "mask_after_slice":
            t[1:, torch.tensor([True, False, True, True], device=t.device)] = 7.0
        else:
            t[torch.tensor([0, 2], device=t.device)[:, None], columns] = 3.0
    assert_same(x, plain)


def test_is_set_to_answers_for_the_memory_a_tensor_views(device):
    x, plain = offloaded_and_plain(torch.arange(12.0).reshape(3, 4), device)

    def others(t):
        return {"itself": t, "detached": t.detach(), "reshaped": t.view(12), "rows": t[1:], "clone": t.clone()}

    offloaded_others, plain_others = others(x), others(plain)
    for name in plain_others:
        assert x.is_set_to(offloaded_others[name]) == plain.is_set_to(plain_others[name]), name
    assert x.is_set_to(x.detach())


@pytest.mark.parametrize("layout", ["transposed_and_stepped", "column_slice", "expanded", "permuted", "size_one_dims"])
@pytest.mark.parametrize("memory_format", [torch.preserve_format, torch.contiguous_format])
def test_clone_has_the_strides_of_a_plain_clone(device, layout, memory_format):
    base = torch.arange(24.0)
    views = {
        "transposed_and_stepped": lambda b: b.view(4, 6).t()[::2],
        "column_slice": lambda b: b.view(4, 6)[:, 1:4],
        "expanded": lambda b: b[:4].view(1, 4).expand(3, 4),
        "permuted": lambda b: b.view(2, 3, 4).permute(2, 0, 1),
        "size_one_dims": lambda b: b.view(2, 1, 12).transpose(0, 1),
    }
    x, plain = offloaded_and_plain(base, device)
    offloaded_clone = views[layout](x).clone(memory_format=memory_format)
    plain_clone = views[layout](plain).clone(memory_format=memory_format)
    # The same strides, so what the layout allows next works (or fails) alike: the clone of a
    # transposed view, transposed back, is contiguous and views as 1-D.
    assert offloaded_clone.stride() == plain_clone.stride()
    assert_same(offloaded_clone, plain_clone)


def _round_trips(t):
    def saved(weights_only):
        buffer = io.BytesIO()
        torch.save(t, buffer)
        buffer.seek(0)
        with ot.safe_globals():
            return torch.load(buffer, weights_only=weights_only)

    return {
        "pickle": lambda: pickle.loads(pickle.dumps(t)),
        "torch.save": lambda: saved(False),
        "torch.save weights_only": lambda: saved(True),
        "deepcopy": lambda: copy.deepcopy(t),
    }


@pytest.mark.parametrize("parameter", [False, True])
def test_pickling_and_deepcopy_keep_the_attributes_a_plain_tensor_keeps(device, parameter):
    x, plain = offloaded_and_plain(torch.arange(3.0), device)
    if parameter:
        x, plain = torch.nn.Parameter(x), torch.nn.Parameter(plain)
    for t in (x, plain):
        t.output_dim = 1
        t.note = "kept"
    offloaded_copies, plain_copies = _round_trips(x), _round_trips(plain)
    for how in plain_copies:
        plain_copy, offloaded_copy = plain_copies[how](), offloaded_copies[how]()
        assert isinstance(offloaded_copy, OffloadedTensor)
        for name in ("output_dim", "note"):
            assert getattr(offloaded_copy, name, None) == getattr(plain_copy, name, None), (how, name)
        assert torch.equal(offloaded_copy.cpu(), plain_copy.detach().cpu())


def test_resize_as_past_the_host_master_names_the_tensor_and_within_it_resizes_as_plain(device):
    x, plain = offloaded_and_plain(torch.arange(6.0), device)
    with pytest.raises(RuntimeError, match=r"cannot resize .* to \(9,\): its host master is exactly 24 bytes"):
        x.resize_as_(torch.zeros(9))
    offloaded_view, plain_view = x[:2].resize_as_(torch.zeros(2, 2)), plain[:2].resize_as_(torch.zeros(2, 2))
    assert (offloaded_view.shape, offloaded_view.stride()) == (plain_view.shape, plain_view.stride())
    assert_same(offloaded_view, plain_view)


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as bytes, in row-major order: NaNs and signed zeros compare exactly."""
    dense = torch.empty(t.shape, dtype=t.dtype)
    dense.copy_(t.detach().cpu())
    return dense.reshape(-1).view(torch.uint8)


def draw_view(data, ref: torch.Tensor):
    """A view op valid for ``ref``: ones test_properties.py does not draw, and aliases."""
    dim, shape = ref.dim(), ref.shape
    names = ["data", "detach", "ellipsis", "unsqueeze"]
    if dim:
        names += ["unfold", "stepped", "as_strided"]
    if dim >= 2:
        names += ["mT", "diagonal"]
    if ref.dtype == torch.float32 and dim and shape[-1] % 2 == 0 and ref.stride(-1) == 1:
        names += ["view_as_complex", "view_int32"]
    if ref.dtype == torch.complex64:
        names.append("view_as_real")
    name = data.draw(st.sampled_from(names), label="view")
    if name in ("unfold", "stepped"):
        d = data.draw(st.integers(0, dim - 1))
        size, step = data.draw(st.integers(0, shape[d])), data.draw(st.integers(1, 3))
        if name == "unfold":
            return lambda a: a.unfold(d, size, step)
        return lambda a: a[(slice(None),) * d + (slice(size, None, step),)]
    if name == "as_strided":  # within the elements the view covers, overlapping or not
        sizes = (data.draw(st.integers(0, 2)), data.draw(st.integers(0, 2)))
        strides = (data.draw(st.integers(0, 2)), data.draw(st.integers(0, 2)))
        return lambda a: a.as_strided(sizes, strides, a.storage_offset())
    if name == "diagonal":
        offset = data.draw(st.integers(-1, 1))
        return lambda a: a.diagonal(offset)
    return {
        "data": lambda a: a.data, "detach": lambda a: a.detach(), "ellipsis": lambda a: a[...],
        "unsqueeze": lambda a: a.unsqueeze(0), "mT": lambda a: a.mT,
        "view_as_complex": lambda a: torch.view_as_complex(a.unflatten(-1, (-1, 2))),
        "view_int32": lambda a: a.view(torch.int32), "view_as_real": lambda a: torch.view_as_real(a),
    }[name]


def draw_write(data, ref: torch.Tensor, count: int):
    """A write of ``ref`` (an alias) as a function of (target, every alias), possibly reading another alias."""
    source = (torch.randn(ref.shape, dtype=ref.dtype) if ref.dtype.is_floating_point or ref.dtype.is_complex
              else torch.randint(-5, 5, ref.shape, dtype=ref.dtype))
    mask = torch.randint(0, 2, ref.shape, generator=torch.Generator().manual_seed(count)).bool()
    other = data.draw(st.integers(0, count - 1), label="other alias")
    name = data.draw(st.sampled_from(["fill_", "copy_", "add_", "neg_", "masked_fill_", "out=", "foreach_mul_",
                                      "add_other_", "copy_other_", "index_put_"]), label="write")

    def read_other(a, aliases):
        b = aliases[other]
        return b if b.dtype == a.dtype and b.shape == a.shape else a.detach()

    return name, {
        "fill_": lambda a, aliases: a.fill_(2),
        "copy_": lambda a, aliases: a.copy_(source.to(a.device)),
        "add_": lambda a, aliases: a.add_(source.to(a.device)),
        "neg_": lambda a, aliases: a.neg_(),
        "masked_fill_": lambda a, aliases: a.masked_fill_(mask.to(a.device), 1),
        "out=": lambda a, aliases: torch.mul(source.to(a.device), 2, out=a),
        "foreach_mul_": lambda a, aliases: torch._foreach_mul_([a, read_other(a, aliases)], 2),
        "add_other_": lambda a, aliases: a.add_(read_other(a, aliases)),
        "copy_other_": lambda a, aliases: a.copy_(read_other(a, aliases)),
        "index_put_": lambda a, aliases: a.index_put_((mask.to(a.device),), torch.tensor(5, dtype=a.dtype)),
    }[name]


@given(data=st.data(), dtype=st.sampled_from([torch.float32, torch.complex64, torch.int64, torch.float16]),
       budget=st.sampled_from([None, 1 << 14]))
@settings(max_examples=150)
def test_random_programs_of_views_and_writes_through_aliases_match_plain_tensors(device, data, dtype, budget):
    rows, columns = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 6))
    values = (torch.randn(rows, columns, dtype=dtype) if dtype.is_floating_point or dtype.is_complex
              else torch.randint(-9, 9, (rows, columns), dtype=dtype))
    x, plain = offloaded_and_plain(values, device, Pager(resolve_device(device), budget_bytes=budget))
    pairs = [(x, plain)]
    for _ in range(data.draw(st.integers(1, 4))):
        base_x, base_plain = pairs[data.draw(st.integers(0, len(pairs) - 1))]
        view = draw_view(data, base_plain)
        try:
            plain_view = view(base_plain)
        except RuntimeError:
            continue
        offloaded_view = view(base_x)
        assert isinstance(offloaded_view, OffloadedTensor)
        assert (offloaded_view.shape, offloaded_view.stride(), offloaded_view.storage_offset(), offloaded_view.dtype) == (
            plain_view.shape, plain_view.stride(), plain_view.storage_offset(), plain_view.dtype)
        pairs.append((offloaded_view, plain_view))
    for _ in range(data.draw(st.integers(1, 4))):
        target = data.draw(st.integers(0, len(pairs) - 1))
        name, write = draw_write(data, pairs[target][1], len(pairs))
        _, error = outcome(write, pairs[target][1], [p for _, p in pairs])
        _, offloaded_error = outcome(write, pairs[target][0], [o for o, _ in pairs])
        assert (offloaded_error is None) == (error is None), (name, error, offloaded_error)
        if error is not None:
            return  # both refused; a plain op may have written part before its error
        for offloaded, reference in pairs:  # the host master, a fresh page and a cached one
            expected = as_bits(reference)
            assert torch.equal(as_bits(offloaded._host), expected), name
            assert torch.equal(as_bits(offloaded.materialize()), expected), name
            assert torch.equal(as_bits(torch.ops.aten.alias_copy.default(offloaded)), expected), name


def test_a_tensor_offloaded_where_a_shared_master_was_allocated_is_no_alias_of_it(device):
    # share_memory_ (model.share_memory() for Hogwild) moves a host master's bytes into shared
    # memory and frees its allocation; the next allocation of that size takes the same address
    # (here, as the allocator reuses it).
    pager = Pager(resolve_device(device), budget_bytes=1 << 16)
    x, plain = offloaded_and_plain(torch.arange(6.0), device, pager)
    x + 0  # a cached copy of x
    try:
        x.share_memory_()
    except RuntimeError as error:  # where torch cannot share pinned host memory, nothing moves
        pytest.skip(f"share_memory_ of this device's host masters: {error}")
    assert x.is_shared()
    later = [ot.offload(torch.full((6,), 10.0 + i), pager=pager) for i in range(4)]
    for i, y in enumerate(later):
        assert y._master is not x._master
        assert torch.equal((y + 0).cpu(), torch.full((6,), 10.0 + i))
    x.add_(1)
    plain.add_(1)
    assert_same(x, plain)
    assert torch.equal((later[0] + 0).cpu(), torch.full((6,), 10.0))


def test_ops_whose_arguments_alias_each_other_run_on_a_meta_pager():
    # ot.plan runs a model on meta, its masters meta bytes: a forward that writes a weight through
    # two of its aliases in one op pages them together there too.
    pager = Pager(torch.device("meta"), budget_bytes=1 << 16)
    flat = torch.empty(6, device="meta")
    master = pager.new_master(flat.numel() * flat.element_size())
    master.flat = flat.view(torch.uint8)
    x = OffloadedTensor(flat, master)
    torch._foreach_add_([x, x.detach()], 1.0)
    x[2:].mul_(x[2:].detach())
    assert x.device.type == "meta" and x.shape == (6,)
