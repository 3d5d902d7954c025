"""The results of ops on meta tensors, remembered for the rest of a plan.

A plan runs its model on meta several times (warm-up and replayed decode steps), and a model
repeats its layers: the same ops with the same shapes, over and over. On meta an op computes only
its result's metadata, but many of torch's meta kernels are Python (its reference implementations
and decompositions: a ``mul`` takes about 0.5 ms, a ``mean`` over a dim 1.5 ms, a softmax 6), so
they were most of a plan's time on the host: 1.1 of 1.7 s for the placement decision's two plans
of a two-layer MoE model (``benchmarks/plan_speed.py``).

``MetaMemo``, entered innermost while a plan records, answers an op it has seen with the same
arguments (each tensor's shape, strides, offset, dtype and conjugate/negative bits; every other
argument by type and value) with fresh meta tensors of the same metadata. Only where that is what
the kernel would give: ops whose schema has no alias (no in-place, ``out=`` or view ops, whose
results share their arguments' storage), all of whose tensor arguments and results are plain meta
tensors with no conjugate or negative bit and results at offset 0. Any other op, an argument the
key cannot hold (an unhashable object, a host tensor, whose values an op may read) or an op that
raises runs its kernel every time. A meta kernel's result depends only on that metadata, so the
plan's ops see the same results as without it (``tests/test_plan_meta_memo.py`` replays plans both
ways and compares every record).
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Off: every op runs its kernel (what benchmarks/plan_speed.py and the tests compare with).
ENABLED = True
# Entries kept per plan: a model's distinct (op, shapes) pairs, a few thousand for a large one.
LIMIT = 1 << 16
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # a resident weight on meta is a Parameter, and plain below autograd
_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def memo():
    """A ``MetaMemo`` to enter, or where ``ENABLED`` is off a context that does nothing."""
    return MetaMemo() if ENABLED else contextlib.nullcontext()


class MetaMemo(TorchDispatchMode):
    """While entered (innermost: entered before the plan's other modes), ops on meta tensors that
    were seen with the same arguments get their results' metadata from memory (module docstring)."""

    def __init__(self):
        super().__init__()
        self._results = {}  # key -> ((shape, stride, dtype), ...) and the result's type (a tensor, tuple or list)
        self._fresh = {}  # op -> whether its schema gives fresh results (no alias anywhere)
        self.hits = self.misses = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        fresh = self._fresh.get(func)
        if fresh is None:
            fresh = self._fresh[func] = _fresh_results(func)
        key = _key(func, args, kwargs) if fresh else None
        if key is None:
            return func(*args, **kwargs)
        known = self._results.get(key)
        if known is not None:
            self.hits += 1
            specs, kind = known
            out = [torch.empty_strided(shape, stride, dtype=dtype, device="meta") for shape, stride, dtype in specs]
            return out[0] if kind is torch.Tensor else kind(out)
        out = func(*args, **kwargs)
        self.misses += 1
        specs = _specs(out)
        if specs is not None and len(self._results) < LIMIT:
            self._results[key] = (specs, torch.Tensor if isinstance(out, torch.Tensor) else type(out))
        return out


def _fresh_results(func) -> bool:
    """Whether ``func``'s results are new tensors whose metadata its arguments' decide: no argument
    or result of its schema has an alias annotation (in-place, ``out=``, views), and it is not
    mutable."""
    schema = getattr(func, "_schema", None)
    if schema is None or schema.is_mutable:
        return False
    return not any(a.alias_info is not None for a in (*schema.arguments, *schema.returns))


def _key(func, args, kwargs):
    """A hashable key for ``func`` on these arguments, or None where one cannot stand for them."""
    parts = [func]
    if not _add(parts, args):
        return None
    for name, value in kwargs.items():
        parts.append(name)
        if not _add(parts, value):
            return None
    return tuple(parts)


def _add(parts: list, value) -> bool:
    if type(value) in _PLAIN:
        if not value.is_meta or value.is_conj() or value.is_neg():
            return False
        parts.append((torch.Tensor, tuple(value.shape), value.stride(), value.storage_offset(), value.dtype))
        return True
    if isinstance(value, (tuple, list)):
        parts.append((type(value), len(value)))
        return all(_add(parts, v) for v in value)
    if isinstance(value, _SCALARS):
        parts.append((type(value), value))  # the type too: 1, 1.0 and True are equal keys otherwise
        return True
    return False  # another tensor type, a SymInt, an object: run the kernel


def _specs(out):
    """(shape, stride, dtype) of each of ``out``'s tensors, or None where a remade one would differ."""
    tensors = (out,) if isinstance(out, torch.Tensor) else out
    if type(tensors) not in (tuple, list) or not tensors:  # (not a named tuple: remade as a plain one)
        return None
    specs = []
    for t in tensors:
        if type(t) is not torch.Tensor or not t.is_meta or t.storage_offset() or t.is_conj() or t.is_neg():
            return None
        specs.append((tuple(t.shape), t.stride(), t.dtype))
    return tuple(specs)
