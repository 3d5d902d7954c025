"""Paging for one op: OffloadedTensor arguments in, device tensors out, pages released once the op is
enqueued, and what the op wrote back in its host masters. Every handler pages through ``Paged``."""

from __future__ import annotations

import torch
from torch.utils._mode_utils import no_dispatch

from .. import cast_views
from ..pager import page_layout
from ..tensor import OffloadedTensor
from . import compile as _compile
from .views import resize_within_master


class Paged:
    """Replaces OffloadedTensor arguments of one op by device tensors and releases their pages
    once the op is enqueued.

    The op's record, made before anything is paged: the pager appends each hold to ``entries``
    itself, as its last step, so no exception can fall between a hold and its record; ``release``
    gives back exactly what the record holds, and after an exception at any point of its own, the
    lock holds too, by the depth the record kept (the pager package's "Exceptions")."""

    __slots__ = ("entries", "private")

    def __init__(self):
        self.entries = []  # (pager, entry, the pager's lock depth before this hold)
        self.private = []  # (OffloadedTensor, its private device copy), for arguments the op writes

    def page(self, t: OffloadedTensor, private: bool = False, out: bool = False) -> torch.Tensor:
        # Every compute op runs this once per offloaded argument: one __dict__ read instead of
        # three attribute lookups through torch.Tensor's type.
        own = t.__dict__
        host, master = own["_host"], own["_master"]
        pager = master.pager
        if type(host) is not torch.Tensor:  # compile.is_traced, inlined
            # Being traced by torch.compile: the graph calls the pager at run time through an
            # opaque op (compile.py) and owns its result, so there is no entry to release.
            return _compile.page_traced(t, host, master, pager)
        if out:
            if "_cast" in own:
                cast_views.resolve(t)
                host, master = own["_host"], own["_master"]
            # An out= argument may be resized by its op. A range of the arena would grow in place,
            # over other weights' cached copies (the arena's storage is large enough); a device
            # copy of its own is reallocated instead, and write_back sees the new shape. Outside
            # the budget, like the op's output it stands for.
            view = with_bits(pager.copy_out(raw(host)), host)
            self.private.append((t, view))
            return view
        layout = own.get("_layout")
        if layout is None:
            if _is_conj(host) or _is_neg(host):
                return self._page_with_bits(t, host, private)
            cast = own.get("_cast")
            if cast is not None:  # a lazy cast (cast_views): never memoized, so every page comes here
                if private:
                    cast_views.resolve(t)  # written: a master of its own first
                    return self.page(t, private)
                return pager.page(host, master, t, False, page_layout(host, master.id), self.entries)[0].to(cast.dtype)
            layout = own["_layout"] = page_layout(host, master.id)
        view = pager.page(host, master, t, private, layout, self.entries)[0]  # t's repr names it in a BudgetError
        if private:
            self.private.append((t, view))
        return view

    def _page_with_bits(self, t: OffloadedTensor, host: torch.Tensor, private: bool) -> torch.Tensor:
        """A page of a conjugate or negative view: the master's raw bytes, cached as any page of
        them, viewed with the host view's bits. Never memoized (``layout_of``), so a page of such a
        view always comes here; no weight of a model has the bits, only views taken of one."""
        view = with_bits(t._master.pager.page(raw(host), t._master, t, private, None, self.entries)[0], host)
        if private:
            self.private.append((t, view))
        return view

    def arg(self, a, written: bool = False):
        if isinstance(a, OffloadedTensor):
            return self.page(a, written)
        if isinstance(a, (list, tuple)) and any(isinstance(x, OffloadedTensor) for x in a):
            return type(a)(self.page(x, written) if isinstance(x, OffloadedTensor) else x for x in a)
        return a

    def release(self) -> None:
        """Give back the record's holds; idempotent (a second call finds the record empty)."""
        entries = self.entries
        if not entries:
            return
        try:
            if len(entries) == 1:  # most ops page one weight
                pager, entry, _ = entries[0]
                pager.release((entry,))
            else:
                first = entries[0][0]
                if all(item[0] is first for item in entries):
                    first.release([item[1] for item in entries])
                else:
                    by_pager = {}
                    for pager, entry, _ in entries:
                        by_pager.setdefault(pager, []).append(entry)
                    for pager, group in by_pager.items():
                        pager.release(group)
            self.entries = []
        except BaseException:
            # Cut short: each pager's lock goes back to its depth before this op's first hold, and its
            # counts are recounted (now if no op holds it, else once none does).
            self.entries = []
            for pager, _, depth in entries:  # the first item of a pager has the lowest depth
                pager.cut_short(depth)
            raise


_is_conj = torch._C.TensorBase.is_conj
_is_neg = torch._C.TensorBase.is_neg


def raw(host: torch.Tensor) -> torch.Tensor:
    """``host`` without its conjugate and negative bits: the bytes as the master holds them, what a
    copy to the device moves."""
    if not (_is_conj(host) or _is_neg(host)):
        return host
    bare = torch.ops.aten.alias.default(host)
    torch._C._set_conj(bare, False)
    torch._C._set_neg(bare, False)
    return bare


def with_bits(device: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    """``device`` (a copy of ``raw(host)``) with ``host``'s conjugate and negative bits: a new alias,
    since a cached copy's view is shared by the ops that read it."""
    if not (_is_conj(host) or _is_neg(host)):
        return device
    view = torch.ops.aten.alias.default(device)
    torch._C._set_conj(view, _is_conj(host))
    torch._C._set_neg(view, _is_neg(host))
    return view


_MATH_BIT_KEYS = (torch._C.DispatchKey.Conjugate, torch._C.DispatchKey.Negative, torch._C.DispatchKey.ZeroTensor)
_is_excluded = torch._C._dispatch_tls_is_dispatch_key_excluded
_set_excluded = torch._C._dispatch_tls_set_dispatch_key_excluded


def with_math_bits(fn, args, kwargs):
    """``fn(*args, **kwargs)`` with the Conjugate, Negative and ZeroTensor keys on. Inside
    ``__torch_dispatch__`` they are off, so a composite op decomposed there (``fft_hfftn``, which
    conjugates an intermediate of its own before ``_fft_c2r``, reached whole under inference mode
    or as an out= op) would have its kernels read raw values where a plain tensor's fallbacks
    resolve the lazy bit first. Only composites need it: a kernel of its own takes the bits of its
    arguments into account, or the fallback resolved them before the op reached offtensor."""
    excluded = [_is_excluded(key) for key in _MATH_BIT_KEYS]
    for key in _MATH_BIT_KEYS:
        _set_excluded(key, False)
    try:
        return fn(*args, **kwargs)
    finally:
        for key, was in zip(_MATH_BIT_KEYS, excluded):
            _set_excluded(key, was)


_COMPOSITES = (torch._C.DispatchKey.CompositeImplicitAutograd, torch._C.DispatchKey.CompositeExplicitAutograd,
               torch._C.DispatchKey.CompositeExplicitAutogradNonFunctional)
_BACKENDS = (torch._C.DispatchKey.CPU, torch._C.DispatchKey.CUDA)


def decomposes(func) -> bool:
    """Whether ``func`` runs as a C++ composite of other ops (``linalg_pinv``, ``linalg_lstsq``,
    ``fft_hfft2.out``): no kernel of its own on the CPU or a GPU. Its parts may take lazy views of
    its own intermediates, so offtensor runs it with ``with_math_bits``."""
    return any(native_kernel(func, k) for k in _COMPOSITES) and not any(native_kernel(func, k) for k in _BACKENDS)


def native_kernel(func, key) -> bool:
    """Whether ``func`` has a kernel for ``key`` in the C++ dispatcher, which eager calls reach. Not
    ``func.has_kernel_for_dispatch_key``, which counts Python kernels too: torch.export's
    ``run_decompositions`` registers some on the CPU and CUDA keys of the composites it keeps
    (``linear``) while it runs, and an op classified then kept a handler that pages it whole."""
    return _has_kernel(func.name(), key)


_has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key


def layout_of(t: OffloadedTensor):
    """``page_layout`` of ``t``, memoized on the tensor unless it is a view with conjugate or
    negative bits, which ``Paged.page`` pages only when no layout is memoized."""
    own = t.__dict__
    layout = own.get("_layout")
    if layout is None:
        host = own["_host"]
        layout = page_layout(host, own["_master"].id)
        if not (_is_conj(host) or _is_neg(host) or "_cast" in own):
            own["_layout"] = layout
    return layout


def reclaim(error: BaseException) -> None:
    """An exception crossed an op's dispatch: release the records it left behind in the frames it
    unwound, those whose ``release`` it cut off at the call, before a line of it ran. Runs only on
    the exceptional path, so the per-op path pays nothing for it."""
    # The first frame is the caller's own, still running its ``except ... as error``: reading its
    # f_locals would snapshot ``error`` into the frame (error -> traceback -> frame -> error, a
    # cycle that keeps everything the unwound frames held until the garbage collector runs), and
    # it holds no record of its own.
    tb = error.__traceback__.tb_next if error.__traceback__ is not None else None
    while tb is not None:
        for value in tb.tb_frame.f_locals.values():
            # (getattr: an interrupt inside ``Paged.__init__`` leaves a record with no slot set)
            if type(value) is Paged and getattr(value, "entries", None):
                value.release()
        tb = tb.tb_next


def describe(t: OffloadedTensor) -> str:
    name = t._master.name
    return f"an OffloadedTensor{'' if name is None else ' of ' + repr(name)} of shape {tuple(t.shape)} and dtype {t.dtype}"


def run(func, args, kwargs, written=(), outs=(), composite=False):
    """Page every OffloadedTensor argument (privately where ``written``; ``outs``, the written
    out= arguments, each into a device copy of its own), run ``func`` on plain tensors, write
    mutated arguments back to their host masters; ``composite``: ``func`` is decomposed here, with
    the lazy-bit fallbacks on (``with_math_bits``)."""
    paged = Paged()
    try:
        if written:
            shared = _page_aliases(paged, args, kwargs, written, outs)
            new_args = [_written_arg(paged, a, i in written, i in outs, shared) for i, a in enumerate(args)]
            new_kwargs = ({k: _written_arg(paged, v, k in written, k in outs, shared) for k, v in kwargs.items()}
                          if kwargs else kwargs)
        else:  # the common case, without the per-argument membership tests
            arg = paged.arg
            new_args = [arg(a) for a in args]
            new_kwargs = {k: arg(v) for k, v in kwargs.items()} if kwargs else kwargs
        out = func(*new_args, **new_kwargs) if not composite else with_math_bits(func, new_args, new_kwargs)
        for t, device_copy in paged.private:
            write_back(t, device_copy)
    finally:
        paged.release()
    return out


def _written_arg(paged: Paged, a, written: bool, out: bool, shared: dict):
    """The device argument of a writing op: the view into a copy shared with its aliases, else a
    page of its own (private where written)."""
    if isinstance(a, OffloadedTensor):
        view = shared.get(id(a))
        return view if view is not None else paged.page(a, written, out and written)
    if isinstance(a, (list, tuple)) and any(isinstance(x, OffloadedTensor) for x in a):
        return type(a)(_written_arg(paged, x, written, out, shared) for x in a)
    return a


def _byte_range(t: OffloadedTensor):
    """The bytes of its master that ``t`` covers, from the layout ``Paged.page`` keeps on the tensor
    (made here when absent, so the page that follows does not make it again)."""
    layout = layout_of(t)
    size = t.__dict__["_host"].element_size()
    return layout[0] * size, layout[1] * size


def _page_aliases(paged: Paged, args, kwargs, written, outs) -> dict:
    """``id(argument) -> device view`` for the OffloadedTensor arguments of a writing op whose
    bytes overlap those of an argument it writes.

    Paged one by one, each would get a copy of its own: a write through one (``_foreach_add_`` of
    a weight and its alias) would not reach the other, and the last write-back would undo the
    first; an overlap torch refuses (``x[1:].add_(x[:-1])``, ``torch.add(x[:4], 1, out=x[2:6])``)
    would pass. Overlapping arguments instead view one private copy of the bytes they cover
    together, as they view one host master, so the op sees them alias as a plain op does (and
    raises where it raises); that copy is written back whole."""
    by_master = {}
    for key, a in (*enumerate(args), *kwargs.items()):
        for t in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(t, OffloadedTensor) and t._host.numel():
                by_master.setdefault(id(t._master), []).append((*_byte_range(t), key in written, t, key in outs))
    shared = {}
    for members in by_master.values():
        if len(members) < 2 or not any(m[2] for m in members):
            continue
        members.sort(key=lambda m: m[0])
        group, end = [], -1
        for m in members + [(float("inf"), 0, False, None, False)]:  # a sentinel closes the last group
            if m[0] >= end:
                if len(group) > 1 and any(g[2] for g in group):
                    shared.update(_page_together(paged, group))
                group, end = [], -1
            group.append(m)
            end = max(end, m[1])
    return shared


def _page_together(paged: Paged, group) -> dict:
    """One private device copy of the bytes the group's tensors (of one master) cover, and each
    tensor's view into it at its own offset, dtype, shape and strides."""
    lo = group[0][0] // 16 * 16  # a whole number of elements of any dtype: each view below is aligned
    hi = max(m[1] for m in group)
    first = group[0][3]
    host = first._host  # on meta too (ot.plan), where the master is meta bytes
    span = OffloadedTensor(
        torch.empty(0, dtype=torch.uint8, device=host.device).set_(host.untyped_storage(), lo, (hi - lo,), (1,)),
        first._master)
    outs = [m[3] for m in group if m[4]]
    # With an out= argument, which its op may resize: a device copy of its own, as ``page`` gives
    # one, rather than a range of the arena.
    device = paged.page(span, True, out=bool(outs))
    views = {}
    for start, stop, _, t, _ in group:
        host = t._host
        views[id(t)] = with_bits(device[start - lo : stop - lo].view(host.dtype).as_strided(host.shape, host.stride()), host)
    # Written back after the span: the same bytes again, unless the op resized the out= view
    # (then out of the span), which only its own write-back can reach.
    paged.private.extend((t, views[id(t)]) for t in outs)
    return views


def write_back(t: OffloadedTensor, values: torch.Tensor, from_host: bool = False) -> None:
    """Write ``values`` into ``t``'s bytes of its host master; every alias sees them and every
    cached device copy of the master is dropped. ``from_host``: values the host computed
    (host_compute.py, which counts its own bytes): no device->host copy to count."""
    if values.shape != t.shape and not resize_within_master(t, values.shape):
        raise resize_error(t, values.shape)
    host = t._host
    if 0 in host.stride() and host.numel() > 1:
        # An expanded view that its op may write (fill_, zero_, masked_fill_ allow it, as on a
        # plain tensor): the elements of a stride-0 dimension are one element in memory, on the
        # device too, and copy_ refuses such a destination. Index 0 of the dimension holds it.
        keep = tuple(0 if step == 0 and size > 1 else slice(None) for size, step in zip(host.shape, host.stride()))
        host, values = host[keep], values[keep]
    write_master(t._master, host, values, not from_host)


def write_master(master, host: torch.Tensor, values: torch.Tensor, from_device: bool) -> None:
    """``host.copy_(values)``, ``host`` memory of ``master``: under the pager's lock, so no other
    thread's op pages the master between the wait and the write, after the copies still reading
    it (``before_write``, which also drops its cached device copies). Never non_blocking: a
    device->host copy still in flight would let ``.cpu()`` and the next page-in read the old bytes.
    ``from_device``: counted as bytes written back from the device."""
    pager = master.pager
    with pager.lock:
        pager.before_write(master)
        with no_dispatch():
            host.copy_(values)
        if from_device:
            pager.count_write_back(host.numel() * host.element_size())


def resize_error(t: OffloadedTensor, shape) -> RuntimeError:
    """An out= op resized its output beyond what the fixed-size host master holds."""
    return RuntimeError(
        f"offtensor: an op would resize {describe(t)} to {tuple(shape)}: its host master is exactly "
        f"{t.host_nbytes} bytes. Pass an out= tensor of the result's shape, or assign a new tensor instead.")
