"""One OpInfo sample run on OffloadedTensors against the same op on plain tensors, for
tests/test_opinfo.py's sweep: the sample plumbing (which tensors are offloaded, in which style:
``Offloader``), the comparison of results, inputs and views, and the four variants (``run_fn``,
``run_out``, ``run_inplace``, ``run_grad``), each seeded so random ops compare too. No tests here:
the sweep and its verdict are test_opinfo.py's."""

from __future__ import annotations

import contextlib
import itertools
import os

import pytest
import torch

import offtensor
from offtensor import OffloadedTensor, cast_views
from offtensor.pager import Pager, resolve_device


# ---------------------------------------------------------------------------- sample plumbing


def _test_device(request=None) -> str:
    if request is not None:
        with contextlib.suppress(pytest.FixtureLookupError):
            return str(request.getfixturevalue("device"))
    return os.environ.get("OFFTENSOR_TEST_DEVICE", "cpu")


def _full_name(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def _map_tensors(obj, fn):
    """``obj`` with every tensor (inside tuples, lists and dicts too) replaced by ``fn(t)``."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_map_tensors(x, fn) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(x, fn) for x in obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj


def _leaves(obj):
    if isinstance(obj, (list, tuple)):
        return [leaf for x in obj for leaf in _leaves(x)]
    if isinstance(obj, dict):
        return [leaf for v in obj.values() for leaf in _leaves(v)]
    return [obj]


def _sample_tensors(sample):
    return [x for x in _leaves([sample.input, sample.args, sample.kwargs]) if isinstance(x, torch.Tensor)]


def _input_tensor_count(sample) -> int:
    """How many of ``_sample_tensors(sample)`` (they come first) are the sample's input."""
    return sum(isinstance(x, torch.Tensor) for x in _leaves([sample.input]))


def _map_sample(sample, fn):
    """(input, args, kwargs) with the i-th tensor of the sample (in ``_sample_tensors`` order)
    replaced by ``fn(i, t)``."""
    counter = itertools.count()

    def each(t):
        return fn(next(counter), t)

    return _map_tensors(sample.input, each), _map_tensors(tuple(sample.args), each), _map_tensors(dict(sample.kwargs), each)


def _offloadable(t: torch.Tensor, device: str) -> bool:
    return (
        type(t) is torch.Tensor
        and t.layout == torch.strided
        and not t.is_nested
        and t.numel() > 0
        and t.device.type == torch.device(device).type
    )


def _storage_index(t: torch.Tensor, offset: int) -> torch.Tensor:
    """For every element of ``t`` (row-major), its position in a buffer laid out with ``t``'s
    strides starting at ``offset``."""
    index = torch.tensor(offset, dtype=torch.int64, device=t.device)
    for size, stride in zip(t.shape, t.stride()):
        index = index.unsqueeze(-1) + torch.arange(size, device=t.device) * stride
    return index.reshape(-1)


def _strided_copy(t: torch.Tensor, offset: int = 0):
    """A copy of ``t`` with exactly its strides (gaps and overlaps included) at ``offset`` in a
    zero-filled buffer; returns (copy, buffer, index of the copy's elements in the buffer)."""
    t = t.detach()
    if t.layout != torch.strided or t.is_nested or t.numel() == 0:
        return t.clone(), None, None
    index = _storage_index(t, offset)
    buffer = torch.zeros(int(index.max()) + 1, dtype=t.dtype, device=t.device)
    _bits(buffer)[index] = _bits(t).reshape(-1)
    return buffer.as_strided(t.shape, t.stride(), offset), buffer, index


def _bits(t: torch.Tensor) -> torch.Tensor:
    # Unsigned integer tensors lack index_put and count_nonzero; move their bits as signed ones.
    unsigned = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}
    return t.view(unsigned[t.dtype]) if t.dtype in unsigned else t


def _clone(t: torch.Tensor, style: str) -> torch.Tensor:
    """The reference's copy of a sample tensor: laid out exactly like its offloaded counterpart
    (same strides and storage offset), so that ops which see the layout (``as_strided``,
    ``view_as_complex``) behave alike."""
    t = t.detach()
    if style == "view":
        return _strided_copy(t, Offloader.PAD)[0]
    return t.clone()  # what offload() makes (of a cast copy too): dense layouts kept, others contiguous


# The wider dtype a ``cast`` style master holds a sample tensor's values in (every value exact).
_CAST_FROM = {torch.float32: torch.float64, torch.bfloat16: torch.float32, torch.float16: torch.float32}


class Offloader:
    """Offloads sample tensors in one of three styles:

    - ``whole``: ``offtensor.offload(t)``, the tensor is its own master in the standalone
      (uncached) pager; gapped or overlapping strides become contiguous there;
    - ``view``: a master holding ``t`` with its exact strides after a few padding elements, and
      ``t`` as an ``as_strided`` view of it, so ops see storage offsets, gaps and overlaps. These
      masters belong to a pager with a budget, so paged copies stay cached between ops and a
      write that forgets to invalidate them shows up when the inputs are read back through the
      device. After the op, ``check_untouched`` verifies the padding and gaps of every master are
      still zero (writes went exactly where they belong);
    - ``cast``: a floating tensor as a lazy cast (``offtensor.cast_views``) of a master holding its
      values in a wider dtype (others as ``whole``), so every op meets the handlers' casts."""

    PAD = 2
    _cached_pagers: dict = {}

    def __init__(self, device: str, style: str):
        self.device = device
        self.style = style
        self.masters = []  # (offloaded buffer, index of the view's elements in it)
        self.pager = None
        if style == "view":
            self.pager = self._cached_pagers.get(device)
            if self.pager is None:
                self.pager = self._cached_pagers[device] = Pager(resolve_device(device), budget_bytes=1 << 30)

    def __call__(self, t: torch.Tensor) -> OffloadedTensor:
        t = t.detach()
        if self.style == "cast" and t.dtype in _CAST_FROM:
            # A lazy cast (cast_views, what autocast makes of a weight with grad on) of a master
            # holding the values in a wider dtype, exactly: its values are t's.
            return cast_views.cast_view(offtensor.offload(t.to(_CAST_FROM[t.dtype]), self.device), t.dtype)
        if self.style in ("whole", "cast"):
            return offtensor.offload(t, self.device)
        _, buffer, index = _strided_copy(t, self.PAD)
        master = offtensor.offload(buffer, self.device, pager=self.pager)
        self.masters.append((master, index))
        view = master.as_strided(t.shape, t.stride(), self.PAD)
        _paged_read(view)  # warm the cache, as a weight used before an op writes it would be
        return view

    def check_untouched(self) -> None:
        for i, (master, index) in enumerate(self.masters):
            outside = _bits(master.cpu().clone())
            outside[index.cpu()] = 0
            if outside.count_nonzero():
                raise Mismatch(f"offloaded tensor {i}: the op wrote outside the tensor into its master's other bytes")


def _paged_read(t: OffloadedTensor) -> torch.Tensor:
    # An op that pages its input (through the cache when the pager has one) and copies it out on
    # the device; .to() would read the host master on the emulated device.
    return torch.stack([t])[0]


def _plain(t):
    if isinstance(t, OffloadedTensor):
        return t.materialize()
    return t


# ---------------------------------------------------------------------------- comparison


class Mismatch(AssertionError):
    pass


def _compare(actual, expected, where: str = "result") -> None:
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            raise Mismatch(f"{where}: expected a tensor, got {type(actual).__name__}")
        actual = _plain(actual)
        if actual.dtype != expected.dtype or actual.shape != expected.shape:
            raise Mismatch(
                f"{where}: expected {expected.dtype} {tuple(expected.shape)}, got {actual.dtype} {tuple(actual.shape)}"
            )
        if (actual.layout == expected.layout == torch.strided and actual.device == expected.device
                and torch.equal(actual, expected)):
            return  # bit-identical, the usual case: assert_close's checks were a quarter of the sweep's time
        try:
            torch.testing.assert_close(actual, expected, equal_nan=True, check_stride=False, check_layout=False)
        except AssertionError as e:
            raise Mismatch(f"{where}: {e}") from None
        return
    if isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or len(actual) != len(expected):
            raise Mismatch(f"{where}: expected a sequence of {len(expected)}, got {type(actual).__name__}")
        for i, (a, e) in enumerate(zip(actual, expected)):
            _compare(a, e, f"{where}[{i}]")
        return
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or actual.keys() != expected.keys():
            raise Mismatch(f"{where}: dict keys differ")
        for k in expected:
            _compare(actual[k], expected[k], f"{where}[{k!r}]")
        return
    if isinstance(expected, (bool, int, float, complex)) and isinstance(actual, (bool, int, float, complex)):
        try:
            torch.testing.assert_close(actual, expected, equal_nan=True, check_dtype=False)
        except AssertionError as e:
            raise Mismatch(f"{where}: {e}") from None
        return
    if actual != expected:
        raise Mismatch(f"{where}: expected {expected!r}, got {actual!r}")


def _same(a, b) -> bool:
    try:
        _compare(a, b)
        return True
    except Exception:
        return False


def _check_views_stay_offloaded(actual, expected, ref_inputs, offloaded_flags) -> None:
    """A result that shares memory with an offloaded input must itself be an OffloadedTensor."""
    storages = {
        t.untyped_storage().data_ptr()
        for t, offloaded in zip(ref_inputs, offloaded_flags)
        if offloaded and t.layout == torch.strided and t.numel()
    }
    for i, (a, e) in enumerate(zip(_leaves(actual), _leaves(expected))):
        if (
            isinstance(e, torch.Tensor)
            and e.layout == torch.strided
            and e.numel()
            and e.untyped_storage().data_ptr() in storages
            and not isinstance(a, OffloadedTensor)
        ):
            raise Mismatch(f"result {i} is a view of an offloaded input but came back as a plain {type(a).__name__}")


def _check_inputs(offloaded, ref_inputs, offloader) -> None:
    for i, (a, e) in enumerate(zip(offloaded, ref_inputs)):
        _compare(a, e, f"input tensor {i} after the op")  # read from the host master
        if isinstance(a, OffloadedTensor):
            # Read through the pager too: a cached device copy must not be stale.
            _compare(_paged_read(a), e, f"input tensor {i} after the op, paged")
    offloader.check_untouched()


# ---------------------------------------------------------------------------- one sample, one variant


class Skip(Exception):
    pass


SEED = 1234


def _seed() -> None:
    # Not torch.manual_seed: without an initialised CUDA it queues a lazy CUDA/XPU/MTIA seeding
    # call with a formatted stack trace every time, which costs more than many ops here.
    torch.default_generator.manual_seed(SEED)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(SEED)


def _seeded(fn):
    _seed()
    return fn()


def _reference(run):
    """Run ``run()`` twice under one seed; skip if it raises or differs between the runs. ``run``
    returns (what must be deterministic, anything else)."""
    try:
        first = _seeded(run)
        second = _seeded(run)
    except Skip:
        raise
    except Exception as e:
        raise Skip(f"reference raises {type(e).__name__}") from None
    if not _same(first[0], second[0]):
        raise Skip("reference is nondeterministic")
    return first


def _offloaded_sample(sample, tensors, flags, offloader):
    offloaded = [offloader(t) if f else _clone(t, offloader.style) for t, f in zip(tensors, flags)]
    return offloaded, _map_sample(sample, lambda i, t: offloaded[i])


def run_fn(op, sample, device, style):
    tensors = _sample_tensors(sample)
    flags = [_offloadable(t, device) for t in tensors]
    if not any(flags):
        raise Skip("no offloadable tensor")

    def reference():
        clones = [_clone(t, style) for t in tensors]
        inp, args, kwargs = _map_sample(sample, lambda i, t: clones[i])
        return (op.op(inp, *args, **kwargs), clones), None

    (expected, ref_inputs), _ = _reference(reference)
    offloader = Offloader(device, style)
    offloaded, (inp, args, kwargs) = _offloaded_sample(sample, tensors, flags, offloader)
    actual = _seeded(lambda: op.op(inp, *args, **kwargs))
    _compare(actual, expected)
    _check_views_stay_offloaded(actual, expected, ref_inputs, flags)
    _check_inputs(offloaded, ref_inputs, offloader)


def run_inplace(op, sample, device, style):
    if sample.broadcasts_input:
        raise Skip("in-place op would broadcast its input")
    tensors = _sample_tensors(sample)
    flags = [_offloadable(t, device) for t in tensors]
    if not any(flags[: _input_tensor_count(sample)]):
        raise Skip("input not offloadable")  # the tensor (or _foreach_ list) the op writes

    def reference():
        clones = [_clone(t, style) for t in tensors]
        inp, args, kwargs = _map_sample(sample, lambda i, t: clones[i])
        out = op.inplace_variant(inp, *args, **kwargs)
        return (out, clones), out is inp

    (expected, ref_inputs), returns_self = _reference(reference)
    offloader = Offloader(device, style)
    offloaded, (inp, args, kwargs) = _offloaded_sample(sample, tensors, flags, offloader)
    actual = _seeded(lambda: op.inplace_variant(inp, *args, **kwargs))
    if returns_self and actual is not inp:
        raise Mismatch(f"the in-place op returned a {type(actual).__name__}, not its input object")
    _compare(actual, expected)
    _check_inputs(offloaded, ref_inputs, offloader)


def run_out(op, sample, device, style):
    tensors = _sample_tensors(sample)
    flags = [_offloadable(t, device) for t in tensors]

    def reference():
        clones = [_clone(t, style) for t in tensors]
        inp, args, kwargs = _map_sample(sample, lambda i, t: clones[i])
        result = op.op(inp, *args, **kwargs)
        is_tuple = isinstance(result, (list, tuple))
        results = list(result) if is_tuple else [result]
        if not results or not all(isinstance(r, torch.Tensor) and _offloadable(r, device) for r in results):
            raise Skip("a result cannot be an offloaded out= tensor")
        outs = [torch.zeros_like(r) for r in results]
        # Fresh inputs: ops like batch_norm update some of them (running stats) on every call.
        clones = [_clone(t, style) for t in tensors]
        inp, args, kwargs = _map_sample(sample, lambda i, t: clones[i])
        returned = op.op(inp, *args, out=tuple(outs) if is_tuple else outs[0], **kwargs)
        returned = list(returned) if isinstance(returned, (list, tuple)) else [returned]
        return (outs, clones), (is_tuple, [r is o for r, o in zip(returned, outs)])

    (expected, ref_inputs), (is_tuple, returns_out) = _reference(reference)
    offloader = Offloader(device, style)
    offloaded, (inp, args, kwargs) = _offloaded_sample(sample, tensors, flags, offloader)
    outs = [offloader(torch.zeros_like(e)) for e in expected]
    returned = _seeded(lambda: op.op(inp, *args, out=tuple(outs) if is_tuple else outs[0], **kwargs))
    returned = list(returned) if isinstance(returned, (list, tuple)) else [returned]
    for i, (r, o, should) in enumerate(zip(returned, outs, returns_out)):
        if should and r is not o:
            raise Mismatch(f"return {i} is a {type(r).__name__}, not the out= tensor")
    _compare(outs, expected, "out")
    _compare([_paged_read(o) for o in outs], expected, "out, paged")
    _check_inputs(offloaded, ref_inputs, offloader)


def _differentiable_outputs(out):
    return [
        o
        for o in _leaves(out)
        if isinstance(o, torch.Tensor) and o.requires_grad and (o.is_floating_point() or o.is_complex())
    ]


def run_grad(op, sample, device, style, input_is_frozen: bool):
    """Gradients of the plain (trained) tensors with the frozen ones offloaded. Either the sample's
    input (a tensor, or a list for _foreach_ ops) is trained and its other tensors frozen, or the
    reverse."""
    tensors = _sample_tensors(sample)
    inputs = _input_tensor_count(sample)
    frozen = []
    for i, t in enumerate(tensors):
        is_input = i < inputs
        frozen.append((is_input if input_is_frozen else not is_input) and _offloadable(t, device))
    trained = [t.requires_grad and not f for t, f in zip(tensors, frozen)]
    if not any(frozen):
        raise Skip("no offloadable frozen tensor")
    if not any(trained):
        raise Skip("no plain tensor requires grad")

    def grads(offloader, cotangents=None):
        leaves, values = [], []
        for t, f, g in zip(tensors, frozen, trained):
            if f and offloader is not None:
                values.append(offloader(t))
            elif f:
                values.append(_clone(t, style))
            elif g:
                leaves.append(_clone(t, style).requires_grad_())
                values.append(leaves[-1])
            else:
                values.append(_clone(t, style))
        inp, args, kwargs = _map_sample(sample, lambda i, t: values[i])
        out = sample.output_process_fn_grad(op.op(inp, *args, **kwargs))
        outs = _differentiable_outputs(out)
        if not outs:
            raise Skip("no differentiable output")
        if cotangents is None:
            generator = torch.Generator().manual_seed(SEED)
            cotangents = [torch.randn(o.shape, generator=generator).to(o.device, o.dtype) for o in outs]
        return (out, torch.autograd.grad(outs, leaves, cotangents, allow_unused=True)), cotangents

    (expected_out, expected_grads), cotangents = _reference(lambda: grads(None))
    (actual_out, actual_grads), _ = _seeded(lambda: grads(Offloader(device, style), cotangents))
    _compare(actual_out, expected_out, "output")
    for i, (a, e) in enumerate(zip(actual_grads, expected_grads)):
        if (a is None) != (e is None):
            raise Mismatch(f"gradient {i}: expected {'None' if e is None else 'a tensor'}, got {'None' if a is None else 'a tensor'}")
        if e is not None:
            _compare(a, e, f"gradient {i}")
