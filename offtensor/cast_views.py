"""Lazy casts of an offloaded weight: what ``torch.autocast`` makes of it when grad is on.

Autocast casts a float32 weight to its lower precision before each op that runs in it
(``weight.to(torch.bfloat16)``). With grad on, autocast's cast cache keeps that cast until the
autocast region ends and autograd keeps it for backward: made as a plain device tensor, every
offloaded weight of the forward would stay on the device in the lower precision, outside the
budget, and a weight larger than the room would be cast whole. Here the cast is an OffloadedTensor
of the new dtype over the same host bytes (a *cast view*): nothing is copied until an op pages it,
and each op then casts the copy it pages (a tile of it where the weight is tiled), freed with the op.

A cast is a copy, not a view: a later write of the weight must not change it. Before a master is
written (``Pager.before_write``) the cast views of it move to a copy of its bytes as they are
(``_before_write``), so they keep the values torch's cast would have kept (also across an optimizer
step inside one autocast region, where torch's cache keeps the cast made before the step). Where
an op would read a cast view's host bytes as they are, or write it (anything but paging, views and
casts: ``ops.torch_dispatch`` asks ``resolve_args`` while any cast view is alive), the cast and
every view of it first become ordinary OffloadedTensors of one master of their own, holding the
cast values (``resolve``).

Casts made with grad on, of a weight that requires grad, are made lazily (``lazily``): autocast's,
and a model's own ``weight.half()`` in a forward, which autograd would keep just the same. Under
``torch.no_grad()`` a cast is the plain device tensor it always was, except autocast's of a weight
that requires grad: torch makes that cast with grad on even inside ``no_grad`` (``generate``'s), to
cache it, so it is lazy there too."""

from __future__ import annotations

import weakref

import torch

from . import _ext
from .pager import master_for, observe_writes, pins_host_memory
from .tensor import RESOLVE_CAST, OffloadedTensor, new_host_master, new_view

# Cast views alive: while none is (always, outside autocast with grad on), ops pay one list read.
ALIVE = [0]

_grad = torch.is_grad_enabled


class CastSource:
    """What the cast views of one cast share: the dtype, the master they read (their weight's until
    it is written, then a copy of its bytes) and the views themselves (weakly)."""

    __slots__ = ("dtype", "master", "views", "__weakref__")

    def __init__(self, dtype: torch.dtype, master):
        # views: id -> weak reference (a WeakSet would compare tensors with ==, elementwise)
        self.dtype, self.master, self.views = dtype, master, {}

    def live_views(self) -> list:
        return [v for v in (r() for r in list(self.views.values())) if v is not None]


_BY_MASTER: dict = {}  # master id -> WeakSet of the CastSources reading it


def lazily(t: OffloadedTensor, kwargs: dict) -> bool:
    """Whether ``_to_copy(t, **kwargs)`` is to be a cast view: a change of floating dtype only, with
    grad on, of an ordinary OffloadedTensor that requires grad, the cast autocast makes of a weight
    and keeps (its cache, autograd). (Inside the op autocast's own state reads as off: its kernel
    excludes it while it casts, so the cast is told by its shape, not by autocast.)"""
    dtype = kwargs.get("dtype")
    return (dtype is not None and len(kwargs) == 1 and dtype != t.dtype and dtype.is_floating_point
            and t.dtype.is_floating_point and _grad() and t.requires_grad
            and type(t.__dict__["_host"]) is torch.Tensor and "_cast" not in t.__dict__
            and not (t.is_conj() or t.is_neg()))


def cast_view(t: OffloadedTensor, dtype: torch.dtype) -> OffloadedTensor:
    """A lazy cast of ``t`` to ``dtype``."""
    own = t.__dict__
    return _tracked(new_view(own["_host"], own["_master"], cast=CastSource(dtype, own["_master"])))


def derived(t: OffloadedTensor, host: torch.Tensor) -> OffloadedTensor:
    """An OffloadedTensor over ``host`` (a view of ``t``'s host view), of ``t``'s master and, for a
    cast view, its cast: what a handler cuts out of ``t`` to page a part of it."""
    own = t.__dict__
    cast = own.get("_cast")
    if cast is None:
        return OffloadedTensor(host, own["_master"])
    return _tracked(new_view(host, own["_master"], cast=cast))


def _tracked(view: OffloadedTensor) -> OffloadedTensor:
    cast = view.__dict__["_cast"]
    if not cast.views:
        _BY_MASTER.setdefault(cast.master.id, weakref.WeakSet()).add(cast)
    key = id(view)
    cast.views[key] = weakref.ref(view)
    ALIVE[0] += 1
    weakref.finalize(view, _died, cast.views, key)
    return view


def _died(views: dict, key: int) -> None:
    ALIVE[0] -= 1
    views.pop(key, None)


def cast_of(t: OffloadedTensor, device: torch.Tensor) -> torch.Tensor:
    """``device`` (``t``'s host values, uploaded by a handler itself), cast where ``t`` is a cast view."""
    cast = t.__dict__.get("_cast")
    return device if cast is None else device.to(cast.dtype)


def _before_write(master) -> None:
    """``master`` is about to be written: the cast views reading it move to a copy of its bytes.

    Cut short (a Ctrl-C) it raises out of ``Pager.before_write``, so the write does not happen:
    each view reads either bytes (the same), and the ones not moved yet are still registered, to be
    moved at the next write. Each view moves in one call (its host view and master together)."""
    sources = _BY_MASTER.get(master.id)
    if not sources:
        return
    live = []
    for source in list(sources):
        views = [v for v in source.live_views() if v.__dict__["_master"] is master]
        if views:
            live.append((source, views))
    if live:
        raw = _ext.alloc_host(master.nbytes, pin=pins_host_memory(master.pager.device))
        with torch.no_grad():
            raw.copy_(master.flat)
        copy = master_for(raw, master.pager)
        for source, views in live:
            _BY_MASTER.setdefault(copy.id, weakref.WeakSet()).add(source)
            for view in views:
                _move(view, raw, copy)
            source.master = copy
    _BY_MASTER.pop(master.id, None)


observe_writes(_before_write)


def resolve(t: OffloadedTensor) -> None:
    """Make the cast view ``t``, and every view of the same cast with it, ordinary OffloadedTensors
    of one master of their own holding the cast values: before an op reads ``t``'s host bytes as
    they are, or writes it. The whole master is cast on the host, so each view keeps its offset
    and strides, and views of one cast stay aliases of each other (a write through one is seen
    through the others, as for views of a plain tensor)."""
    cast = t.__dict__.get("_cast")
    if cast is None:
        return
    views = [v for v in cast.live_views() if v.__dict__.get("_cast") is cast]
    if not any(v is t for v in views):  # (by identity: ``in`` would compare tensors with ==)
        views.append(t)
    master = t.__dict__["_master"]
    whole = master.flat.view(t.__dict__["_host"].dtype)
    values = new_host_master(whole, pin=pins_host_memory(master.pager.device), dtype=cast.dtype)
    own_master = master_for(values, master.pager)
    for view in views:
        _move(view, values, own_master, cast.dtype)
        # (then the cast goes: cut short between, a page of it casts to the dtype it already has)
        view.__dict__.pop("_cast", None)
        cast.views.pop(id(view), None)


def _move(view: OffloadedTensor, memory: torch.Tensor, master, dtype=None) -> None:
    """Point ``view`` at ``memory``'s storage (``master``'s), at its host view's offset and strides,
    in ``dtype`` (None: its host view's). Its host view and master change in one call: cut short,
    never one without the other."""
    own = view.__dict__
    host = own["_host"]
    own.pop("_layout", None)
    own.pop("_views", None)
    moved = torch.empty(0, dtype=host.dtype if dtype is None else dtype).set_(
        memory.untyped_storage(), host.storage_offset(), host.shape, host.stride())
    own.update(_host=moved, _master=master)


RESOLVE_CAST[0] = resolve


def resolve_args(args, kwargs) -> None:
    """``resolve`` every cast view among an op's arguments."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, OffloadedTensor):
            if "_cast" in a.__dict__:
                resolve(a)
        elif isinstance(a, (list, tuple)):
            for x in a:
                if isinstance(x, OffloadedTensor) and "_cast" in x.__dict__:
                    resolve(x)
