"""Recording a real run into a Timeline: a TorchDispatchMode sees every op (its FLOPs and bytes from
shapes), the pager reports every copy, use, release and eviction; ``recording.timeline`` (``ot.timeline``)
installs it."""

from __future__ import annotations

import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from ..tensor import OffloadedTensor, new_view
from .timeline import Timeline


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _op_cost(func, args, kwargs, out):
    """(FLOPs, device bytes read + written, dtype) of one op, from shapes only."""
    flops = 0
    counter = flop_registry.get(func._overloadpacket)
    if func is torch.ops.aten._grouped_mm.default and isinstance(out, torch.Tensor) and args[0].dim() == 2:
        # torch's flop counter has no formula for it: every row of x meets one group's [K, N] matrix.
        flops = 2 * args[0].shape[0] * args[0].shape[1] * out.shape[-1]
    elif counter is not None:
        try:
            flops = int(counter(*args, **kwargs, out_val=out))
        except Exception:
            flops = 0  # a formula that does not take this overload's arguments: count bytes only
    nbytes, dtype = 0, None
    selects = func in _ROW_SELECTS
    grouped = func is torch.ops.aten._grouped_mm.default and len(args) > 1 and isinstance(args[1], torch.Tensor) \
        and args[1].dim() == 3
    for t in _tensors((args, kwargs, out)):
        if grouped and t is args[1]:
            # A grouped GEMM reads the matrices of the groups that have rows, at most one per row
            # (8 of 64 experts at a one-token decode), not the whole stack.
            groups = min(t.shape[0], args[0].shape[0])
            nbytes += groups * (_tensor_bytes(t) // max(t.shape[0], 1))
            continue
        if selects and hasattr(t, "_master"):
            # An offloaded stack indexed by rows: the kernel reads the selected rows (as many
            # bytes as the output), not the whole stack (64 experts where 8 were routed).
            nbytes += _tensor_bytes(out) if isinstance(out, torch.Tensor) else 0
            continue
        nbytes += _tensor_bytes(t)
        if dtype is None and t.is_floating_point():
            dtype = str(t.dtype).removeprefix("torch.")
    return flops, nbytes, dtype


def _tensors(value):
    """The tensors in an op's arguments or results (tuples, lists and dicts of them), in order:
    what ``tree_leaves`` finds that are tensors, at a fraction of its cost per op."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


_COPIES = (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)
_ROW_SELECTS = (torch.ops.aten.index_select.default, torch.ops.aten.index.Tensor, torch.ops.aten.embedding.default)


def _host_to_device_bytes(func, args, out) -> int:
    """Bytes of a host -> GPU copy (``_to_copy`` or ``copy_`` from a CPU tensor), else 0."""
    if func not in _COPIES:
        return 0
    src = args[1] if func is torch.ops.aten.copy_.default else args[0]
    dst = args[0] if func is torch.ops.aten.copy_.default else out
    if isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor) and src.device.type == "cpu" \
            and dst.device.type == "cuda":
        return _tensor_bytes(dst)
    return 0


def _launches_nothing(func) -> bool:
    """Views and metadata ops alias their input: no kernel runs on the device. (Read from the
    schema once per op: a plan asks for every op it records.)"""
    known = _NO_LAUNCH.get(func)
    if known is None:
        schema = func._schema
        known = _NO_LAUNCH[func] = bool(schema.returns) and all(
            r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
    return known


_NO_LAUNCH: dict = {}


def _is_meta_grouped_mm(func, args) -> bool:
    return (func is torch.ops.aten._grouped_mm.default and len(args) > 1 and isinstance(args[0], torch.Tensor)
            and args[0].is_meta and args[0].dtype != torch.bfloat16)


def _meta_grouped_mm(func, args, kwargs):
    """``_grouped_mm`` of a plan of a float32 (or float16) model: torch's meta kernel accepts
    bf16 only, though the CPU and CUDA kernels take other dtypes, so the shapes come from a bf16
    call and the result takes the inputs' dtype (meta: nothing is computed either way). The cost
    is counted on the real arguments."""
    dtype = args[0].dtype
    cast = [_as_bf16(a) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    kw = {k: _as_bf16(v) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
          for k, v in kwargs.items() if k != "out_dtype"}
    return func(*cast, **kw).to(kwargs.get("out_dtype") or dtype)


def _as_bf16(t: torch.Tensor) -> torch.Tensor:
    """``t`` as bf16 for the meta kernel. An offloaded stack stays an OffloadedTensor over its
    master (meta values: nothing to convert), so the grouped GEMM still pages only the routed
    experts; a cast (``.to``) would be a new tensor, paging the whole stack."""
    if isinstance(t, OffloadedTensor):
        return new_view(t._host.to(torch.bfloat16), t._master)
    return t.to(torch.bfloat16)


class Recorder(TorchDispatchMode):
    """Fills a Timeline from a running model: ops through this dispatch mode, copies and their
    lifetimes through the pager's ``recorder`` call sites."""

    def __init__(self, timeline: Timeline, measure: bool = False):
        super().__init__()
        self.tl = timeline
        self._copy_of = {}  # id(pager entry) -> the record id of the copy that filled it
        self._last_use = {}  # id(pager entry) -> the record id of the last op that read it
        self._pending_waits = []  # copies the next op reads
        self._pending_pages = 0  # offloaded arguments the next op paged (cache hits included)
        self._pending_pooled = 0  # grouped GEMMs the next op ran from an expert pool
        self._pending_releases = 0  # records of paged arguments given back since the last op recorded
        self._pending_frees = []  # ops whose blocks the next copy reuses
        self._open_ops = []  # ids reserved for ops running now (their pages are released inside)
        self._last_op = None
        self._measure = measure and torch.cuda.is_available()
        self._events = []  # (record id, start event, end event) when measuring
        # Inside the pager (allocating a copy's buffer, the copy itself): its work is recorded by
        # its call sites as copies, not as ops. Set by quietly().
        self._quiet = 0
        self._kernel_depth = {}  # open op's record id -> the mode stack's depth below its kernels' pushes
        self._split = set()  # open ops whose handler runs their kernels one by one (kernels())
        self.clock = None  # PolicyClock: the expert policy's host time, given to the next record

    def _policy_ms(self) -> float:
        return self.clock.take() if self.clock is not None else 0.0

    def quietly(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` (the pager's own work: ``Observers.quiet``) with this mode's op
        recording paused. The count is set back to what it was, not decremented: a Ctrl-C anywhere
        leaves it as before."""
        depth = self._quiet
        try:
            self._quiet = depth + 1
            return fn(*args, **kwargs)
        finally:
            self._quiet = depth

    def quiet(self, method):
        """``method`` with this mode's op recording paused while it runs (``quietly``)."""
        return functools.partial(self.quietly, method)

    def kernels(self) -> "_Kernels":
        """Inside an op being recorded, whose handler splits it into kernels that each read only
        their own paged copies (``_grouped_mm``: one expert at a time): the kernels run in the
        block are recorded as ops of their own, each waiting for its own copies, as the compute
        stream runs them on a GPU (expert j computes while expert j+1 is still copying). The op
        itself is then recorded without cost (its kernels carry it) and with what its handler
        does after them (the concatenation of the pieces)."""
        return _Kernels(self)

    # -------------------------------------------------------------- ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        clock = self.clock
        if clock is None:
            return self._dispatch(func, args, kwargs)
        t0 = clock.open()  # (an op, and recording it, are not the expert policy's host time)
        try:
            return self._dispatch(func, args, kwargs)
        finally:
            clock.close(t0)

    def _dispatch(self, func, args, kwargs):
        kwargs = kwargs or {}
        if self._quiet or _launches_nothing(func):
            return func(*args, **kwargs)
        rid = self.tl.new_id()
        self._open_ops.append(rid)
        start = end = None
        if self._measure:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        try:
            out = _meta_grouped_mm(func, args, kwargs) if _is_meta_grouped_mm(func, args) else func(*args, **kwargs)
        finally:
            depth = self._kernel_depth.pop(rid, None)
            if depth is not None:  # a kernels block cut short at its exit's entry left this mode pushed
                pop_to(self, depth)
            self._open_ops.pop()
        if self._measure:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((rid, start, end))
        h2d = _host_to_device_bytes(func, args, out)
        if h2d:
            # A `.to(device)` / `copy_` of host memory outside the pager (vLLM-style offloading): an
            # H2D copy on the stream that issued it, which is the compute stream here.
            self.tl.add_copy(h2d, name=str(func.overloadpacket.__name__), stream="compute", id=rid,
                             policy_ms=self._policy_ms())
            self._last_op = rid
            return out
        if rid in self._split:
            self._split.discard(rid)
            flops, nbytes = 0, 0
            dtype = next((str(t.dtype).removeprefix("torch.") for t in torch.utils._pytree.tree_leaves(out)
                          if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
        else:
            flops, nbytes, dtype = _op_cost(func, args, kwargs, out)
        waits, self._pending_waits = self._pending_waits, []
        pages, self._pending_pages = self._pending_pages, 0
        pooled, self._pending_pooled = self._pending_pooled, 0
        releases, self._pending_releases = self._pending_releases, 0
        self.tl.add_op(flops, nbytes, dtype, waits=_unique(waits), name=str(func.overloadpacket.__name__), id=rid,
                       pages=pages, pooled=pooled, releases=releases, policy_ms=self._policy_ms())
        self._last_op = rid
        return out

    # -------------------------------------------------------------- pager call sites

    def copied(self, pager, entry, nbytes: int, stream: str, prefetch: bool) -> None:
        waits, self._pending_frees = self._pending_frees, []
        key = getattr(entry, "key", None)
        rid = self.tl.add_copy(nbytes, waits=_unique(waits), name="prefetch" if prefetch else "page", stream=stream,
                               key=(id(pager),) + tuple(key) if key is not None else None, policy_ms=self._policy_ms())
        self._copy_of[id(entry)] = rid

    def used(self, entry) -> None:
        self._pending_pages += 1
        rid = self._copy_of.get(id(entry))
        if rid is not None:
            self._pending_waits.append(rid)

    def released(self, entries) -> None:
        # The host work of giving the record back goes to the op recorded next: the op running
        # now, or, inside an op split into kernels, its next kernel or the op itself.
        self._pending_releases += 1
        # The last reader is the op running now, or, inside an op split into kernels, the kernel
        # just recorded.
        op = self._open_ops[-1] if self._open_ops and self._open_ops[-1] not in self._split else self._last_op
        if op is None:
            return
        for entry in entries:
            self._last_use[id(entry)] = op

    def freed(self, entry) -> None:
        """A cached copy is dropped: the next copy may take its block once its last reader is done."""
        op = self._last_use.pop(id(entry), None)
        self._copy_of.pop(id(entry), None)
        if op is not None:
            self._pending_frees.append(op)

    def host_computed(self, flops: int, nbytes: int, dtype: str, moved: int) -> None:
        """A routed expert computed on the host (ops.host_experts): an op on the host lane after the
        device op that made its activations, and its result's copy back, which the next op waits for."""
        waits = [self._last_op] if self._last_op is not None else []
        rid = self.tl.add_op(flops, nbytes, dtype, waits=waits, name="host expert", stream="host")
        back = self.tl.add_copy(moved, waits=[rid], name="host result")
        self._pending_waits.append(back)

    def host_op(self, name: str, nbytes: int, dtype, measured_ms, result_bytes: int, synced: bool) -> None:
        """An op over an offloaded tensor larger than the room, computed from its host master
        (ops.host_compute): an op on the host lane taking ``measured_ms`` (None: the profile's host
        figures), after the device op that made its other arguments where it read any (``synced``),
        then its results' copy to the device, which the op dispatched now waits for. That op is
        recorded without a device cost of its own, as an op split into kernels is: the device reads
        none of the tensor."""
        waits = [self._last_op] if synced and self._last_op is not None else []
        rid = self.tl.add_op(0, nbytes, dtype, waits=waits, name=name, stream="host", measured_host_ms=measured_ms)
        if result_bytes:
            self._pending_waits.append(self.tl.add_copy(result_bytes, waits=[rid], name="host result"))
        if self._open_ops:
            self._split.add(self._open_ops[-1])

    def pool_called(self) -> None:
        """The op running now is a grouped GEMM served from a device-side expert pool: its host work
        (the pool's lookup, admit and plan) is the profile's ``host_us["pool"]``, not a page."""
        self._pending_pooled += 1

    def pool_fetched(self, nbytes: int) -> None:
        """An expert copied into a slot of a device-side expert pool (ops/expert_pool.py): the pool's
        gather kernel, issued by the device where its admit runs (the compute stream), so it runs in
        order with the ops and the next one reads it; no page and no host read (no host decision)."""
        self._pending_waits.append(self.tl.add_copy(nbytes, name="pool fetch", stream="compute", device_side=True))

    def host_sync(self) -> None:
        """The host reads a device value (ops.rows.read_to_host) and waits for the compute stream."""
        self.tl.add_sync()

    def finish(self) -> None:
        if not self._events:
            return
        torch.cuda.synchronize()
        t0 = self._events[0][1]
        by_id = {r.id: r for r in self.tl.records}
        for rid, start, end in self._events:
            by_id[rid].measured_ms = (t0.elapsed_time(start), t0.elapsed_time(end))


class _Kernels:
    """``Recorder.kernels``' block: this mode pushed again (torch takes a mode off its stack while
    its handler runs) and popped back to the depth it found. A class, not a ``contextlib``
    generator: a Ctrl-C at the entry of its exit, before any of its code runs, leaves the push to
    the recorded op that holds the block, which pops back to that depth on its way out (and the
    recording's own exit takes every push of its mode off the stack)."""

    __slots__ = ("recorder", "depth")

    def __init__(self, recorder: Recorder):
        self.recorder, self.depth = recorder, None

    def __enter__(self) -> None:
        recorder = self.recorder
        self.depth = depth = torch._C._len_torch_dispatch_stack()
        if recorder._open_ops:
            rid = recorder._open_ops[-1]
            recorder._split.add(rid)
            recorder._kernel_depth.setdefault(rid, depth)
        torch._C._push_on_torch_dispatch_stack(recorder)

    def __exit__(self, *exc) -> bool:
        pop_to(self.recorder, self.depth)
        return False


def pop_to(mode, depth: int) -> None:
    """Pop ``mode`` off the top of this thread's dispatch mode stack while the stack is deeper than
    ``depth``; a mode above it stays."""
    n = torch._C._len_torch_dispatch_stack()
    while n > depth and torch._C._get_dispatch_stack_at(n - 1) is mode:
        torch._C._pop_torch_dispatch_stack(None)
        n -= 1


def _unique(ids):
    return list(dict.fromkeys(ids))
