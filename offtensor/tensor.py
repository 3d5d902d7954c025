"""OffloadedTensor: a tensor whose bytes live in an exact-size host master and are paged onto the
device by the op that needs them.

The wrapper holds one inner tensor, ``_host``: a plain CPU tensor with exactly the wrapper's
shape, strides and storage offset, viewing the host master's storage. Every alias (view, detach,
Parameter) of a master is another ``_host`` view of the same storage, so view ops are plain view
ops on ``_host``, writes to ``_host`` are visible through every alias, and the byte range an op
needs is the range ``_host`` covers. ``_master`` names the allocation for the pager's cache.

This module owns construction, metadata, flatten/unflatten and pickling; the ``ops`` package owns
what ops do and registers it on the class, once (``set_op_handlers``), so this module imports
nothing of it: the import graph runs ops -> tensor -> pager.
"""

from __future__ import annotations

import sys as _sys
import weakref
from copy import deepcopy as _deepcopy

import torch

from . import _ext
from . import leaves as _leaves
from .pager import Master, Pager, master_for, pins_host_memory, registered_master, resolve_device

_is_compiling = torch.compiler.is_compiling
_disabled_torch_function_impl = torch._C._disabled_torch_function_impl
_Tensor = torch.Tensor

# The whole ops that __torch_function__ intercepts (torch function -> handler(args, kwargs)): ops.functions'
# table, installed by set_op_handlers. A module global: __torch_function__ reads it on every call.
_FUNCTION_TABLE: dict = {}
# What an exception that crossed a handler left behind (ops.paging.reclaim), set with the table.
_RECLAIM = None

# ``cast_views.resolve``, installed by that module: a lazy cast (``_cast`` in its ``__dict__``) is made
# an ordinary OffloadedTensor of its cast values before a method here reads its host bytes.
RESOLVE_CAST = [None]

# OffloadedTensors rebuilt for tracing (``__tensor_unflatten__`` with a fake host view) still alive:
# only while there are any does ops.torch_dispatch ask whether a trace is running.
TRACED_ALIVE = [0]


class OffloadedTensor(torch.Tensor):
    """A ``torch.Tensor`` on ``device`` whose values live in host memory (see docs/design.md)."""

    _host: torch.Tensor
    _master: Master
    # A leaf to leaves.py although it has __tensor_flatten__: its inner host view is no device value.
    _OFFTENSOR_LEAF = True
    # What ops do (ops.torch_dispatch), set by the ops package: set_op_handlers.
    _op_dispatch = None
    # (data, requires_grad, caller frame) -> what ``type(p)(data, ...)`` makes, None for a plain
    # Parameter; set by the model package, which knows wrapped modules: set_remade.
    _remade = None

    @staticmethod
    def __new__(cls, host: torch.Tensor, master: Master = None, requires_grad: bool = False, **attributes):
        if master is None:
            # ``type(p)(data, requires_grad=...)``, nn.Parameter's constructor called through a
            # parameter's class, as accelerate (``set_module_tensor_to_device``, ``init_empty_weights``)
            # and peft re-create a parameter from moved data. An OffloadedTensor comes only from a
            # host master (``offload``, ``wrap_model``), so this makes what nn.Parameter makes of
            # ``data``: a plain Parameter, or of an OffloadedTensor a Parameter alias of it. The
            # ``attributes`` such callers pass are the old parameter's ``__dict__`` (its ``_host``
            # and ``_master`` among them): they describe the old tensor's storage, not ``data``'s.
            # Where the caller re-creates a wrapped module's offloaded weight, ``_remade`` decides.
            made = OffloadedTensor._remade(host, requires_grad, _sys._getframe(1)) if OffloadedTensor._remade else None
            return made if made is not None else torch.nn.Parameter(host, requires_grad)
        return _wrapper(cls, host, master, requires_grad)

    def __init__(self, host: torch.Tensor, master: Master = None, requires_grad: bool = False, **attributes):
        if master is None:  # a Parameter alias made by __new__ above: it is already whole
            return
        self._host = host
        self._master = master

    # Only whole ops that save a dispatch are intercepted (_FUNCTION_TABLE); everything else
    # goes straight to __torch_dispatch__ and results are never re-wrapped.
    # Every Python-level call on an OffloadedTensor runs this method, so it reads module globals
    # rather than attribute chains (torch.compiler.is_compiling is the same function object, which
    # Dynamo recognises).
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if _is_compiling():
            # Dynamo inlines this method: trace the plain function and let __torch_dispatch__ page
            # through the graph's opaque op (ops/compile.py) instead of the eager intercepts.
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        handler = _FUNCTION_TABLE.get(func)
        if handler is not None:
            try:
                result = handler(args, kwargs or {})
            except BaseException as error:
                # A Ctrl-C on the very call into a tile's ``release`` leaves its record holding the
                # pager's lock: released here, as ``torch_dispatch`` does for an aten op.
                _RECLAIM(error)
                raise
            if result is not NotImplemented:
                return result
        return _disabled_torch_function_impl(func, types, args, kwargs or {})

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return cls._op_dispatch(func, types, args, kwargs)

    @staticmethod
    def set_op_handlers(torch_dispatch, function_table: dict, reclaim) -> None:
        """Install what ops do: ``torch_dispatch(func, types, args, kwargs)`` for every aten op and
        the whole functions ``__torch_function__`` intercepts. Called once, by ops/__init__.py."""
        global _FUNCTION_TABLE, _RECLAIM
        if OffloadedTensor._op_dispatch is not None:
            raise RuntimeError("offtensor: OffloadedTensor's op handlers are already set")
        OffloadedTensor._op_dispatch = staticmethod(torch_dispatch)
        _FUNCTION_TABLE = function_table  # ops.functions' own table: one dict, read here on every call
        _RECLAIM = reclaim

    @staticmethod
    def set_remade(remade) -> None:
        """Install ``_remade``. Called once, by model/engines.py."""
        OffloadedTensor._remade = staticmethod(remade)

    # ------------------------------------------------------------------ public methods

    @property
    def pager(self) -> Pager:
        return self._master.pager

    @property
    def host_nbytes(self) -> int:
        """Bytes of the host master this tensor views (shared by all its aliases)."""
        return self._master.nbytes

    def materialize(self) -> torch.Tensor:
        """A plain tensor on ``self.device`` with this tensor's values (a copy, never cached)."""
        if "_cast" in self.__dict__:
            RESOLVE_CAST[0](self)
        host = self._host
        if _is_conj(host) or _is_neg(host):  # a view with lazy bits: the copy holds the values
            host = host.resolve_conj().resolve_neg()
        return self._master.pager.copy_out(host)

    def data_ptr(self) -> int:
        # On the emulated device the host master *is* the tensor's memory. On a GPU, pinned
        # (registered) host memory is mapped into the device's unified address space, so its
        # address is one a kernel may read, over PCIe; pageable memory has no device address.
        if "_cast" in self.__dict__:
            RESOLVE_CAST[0](self)
        if self.device.type == "cpu" or self._host.is_pinned():
            return self._host.data_ptr()
        raise RuntimeError(
            f"offtensor: an OffloadedTensor of shape {tuple(self.shape)} ({self.host_nbytes} bytes in pageable "
            f"host memory) has no device address; call .materialize() for a device copy or .cpu() for the host values"
        )

    # The same address read-only (the wrapper's own, which torch would give, is null).
    const_data_ptr = data_ptr

    def untyped_storage(self) -> torch.UntypedStorage:
        # The host master: lets storage-based tie detection (safetensors, transformers) see aliases.
        # Not while torch.compile or torch.export converts this tensor to a fake one: it would then
        # find the inner host view's storage twice and try to give the device wrapper a host
        # storage (non-strict export fakes parameters outside any tracing context: its converter,
        # meta_utils, is the caller).
        if "_cast" in self.__dict__:
            RESOLVE_CAST[0](self)
        if torch.compiler.is_compiling() or torch._guards.TracingContext.try_get() is not None \
                or _sys._getframe(1).f_globals.get("__name__") == "torch._subclasses.meta_utils":
            # (torch 2.11 reports is_compiling() only inside traced code, not while faking inputs)
            with torch._C.DisableTorchFunctionSubclass():
                return torch._C.TensorBase.untyped_storage(self)
        # The storage is writable, and a write through it (``plain.set_(w.untyped_storage())``
        # then an in-place op, ``storage.copy_``) dispatches nothing: the master's cached device
        # copies are dropped now, as before any write, so the next op pages what was written.
        # (Writes through a storage kept across later ops are not seen: docs/design.md.)
        master = self._master
        master.pager.before_write(master)
        return self._host.untyped_storage()

    def __repr__(self, *, tensor_contents=None) -> str:
        grad = ", requires_grad=True" if self.requires_grad else ""
        name = self._master.name
        return (
            f"OffloadedTensor({'' if name is None else repr(name) + ', '}shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"device={self.device}, host_bytes={self.host_nbytes}{grad})"
        )

    def __format__(self, format_spec: str) -> str:
        # torch.Tensor formats a 0-d value (f"{loss:.3f}") only for exact torch.Tensor objects.
        if "_cast" in self.__dict__:
            RESOLVE_CAST[0](self)
        if self.dim() == 0 and format_spec:
            return self._host.item().__format__(format_spec)
        return super().__format__(format_spec)

    # ------------------------------------------------------------------ flatten / pickling

    def __tensor_flatten__(self):
        own = self.__dict__
        if "_cast" in own:
            RESOLVE_CAST[0](self)
        # The room a page may take (the budget less the resident weights) decides what a traced
        # graph pages whole and what it cuts in slices (ops/compile.py), so it is part of the
        # metadata that torch.compile guards on and keys its caches by: a graph traced at another
        # budget, in this process or in an earlier one, is not reused. (Dynamo's guards call this
        # for every offloaded weight at every call of a compiled function: plain reads only.)
        master = own["_master"]
        pager = master.pager
        budget = None if pager is None else pager.budget
        room = None if budget is None or budget.budget_bytes is None else budget.budget_bytes - budget.resident_bytes
        return ["_host"], (master.id, self.requires_grad, room)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        master_id, requires_grad = meta[:2]
        master = registered_master(master_id)
        if master is None:
            raise KeyError(master_id)
        host = inner_tensors["_host"]
        t = OffloadedTensor(host, master, requires_grad)
        if type(host) is not _Tensor:  # a tracing stand-in: torch.compile, export or make_fx is tracing
            _count_traced(t)
        return t

    def __reduce_ex__(self, protocol):
        # Pickle the host view: torch.save then stores each host storage once, so tied tensors and
        # aliases are saved once and come back as aliases of one master.
        if "_cast" in self.__dict__:
            RESOLVE_CAST[0](self)
        if self.__dict__.get("_portable"):
            # A value of a wrapped model's state_dict() (model/loads.py marks them): saved as the plain CPU
            # tensor it holds, which any process loads, with or without offtensor, weights_only or
            # not; aliases still share one storage in the file. Nothing is paged.
            return self._host.__reduce_ex__(protocol)
        is_param = bool(getattr(self, "_is_param", False))
        rebuilt = (self._host, str(self.device), self.requires_grad, is_param)
        # The user's attributes come back, as torch.Tensor's and nn.Parameter's pickling keep them.
        attrs = user_attrs(self)
        return (_rebuild_offloaded, rebuilt + (attrs,) if attrs else rebuilt)

    def __deepcopy__(self, memo):
        if "_cast" in self.__dict__:
            RESOLVE_CAST[0](self)
        if id(self) in memo:
            return memo[id(self)]
        # Like torch.Tensor.__deepcopy__: each host master is copied once per deepcopy, so aliases
        # (tied weights held by separate Parameters, views) come back as aliases of one new master.
        master = self._master
        grad = torch.is_grad_enabled()
        try:  # a Ctrl-C at a no_grad's exit, before it ran, would leave grad off for the thread
            new_flat = memo.get(id(master))
            if new_flat is None:
                new_flat = _ext.alloc_host(master.nbytes, pin=pins_host_memory(master.pager.device))
                with torch.no_grad():
                    new_flat.copy_(master.flat)
                memo[id(master)] = new_flat
            with torch.no_grad():
                host = torch.empty(0, dtype=self.dtype).set_(
                    new_flat.untyped_storage(), self._host.storage_offset(), self.shape, self.stride()
                )
                if _is_conj(self._host):  # the copied bytes are raw: the view keeps its lazy bits
                    host = host.conj()
                if _is_neg(self._host):
                    host = torch._neg_view(host)
        except BaseException:
            torch.set_grad_enabled(grad)
            raise
        # A deepcopy of a wrapped model charges its copies to the copy's own pager (model.copies.StepHook).
        copy = wrap_host(host, memo.get(("offtensor.pager", id(master.pager))) or master.pager)
        copy._master.name = master.name
        if getattr(self, "_is_param", False):
            copy = torch.nn.Parameter(copy, requires_grad=self.requires_grad)
        else:
            copy.requires_grad_(self.requires_grad)
            # torch.Tensor.__deepcopy__ copies the user's attributes too (nn.Parameter's does not).
            copy.__dict__.update(_deepcopy(user_attrs(self), memo))
        if self.grad is not None:
            copy.grad = _deepcopy(self.grad, memo)
        memo[id(self)] = copy
        return copy


# ---------------------------------------------------------------------------- metadata reads

# Reads of a tensor's own metadata (``w.dtype``, ``w.shape``, ``w.size(-1)``, ``w.dim()``...) answered
# without __torch_function__: on a subclass that defines it, every one of them goes through Python's
# torch-function protocol (~1.8 µs each, however short the handler), and model code reads them often
# (a copy-free MoE decode step, ~80 times). Each read here is the same C read with subclass torch
# functions disabled (~0.2 µs), so it answers exactly what TensorBase's own would: the wrapper's
# metadata. None of them is a whole op the function table intercepts, nor may one be (tested), and
# torch function modes still see the C read. Under torch.compile Dynamo inlines these and traces the
# read as before, through __torch_function__.
METADATA_PROPERTIES = ("dtype", "shape", "device", "ndim", "layout", "is_cuda", "requires_grad")
METADATA_METHODS = ("dim", "size", "stride", "numel", "is_contiguous", "element_size", "is_floating_point",
                    "storage_offset")
_TYPES = (OffloadedTensor,)
_NO_KWARGS: dict = {}


def _metadata_property(name: str) -> property:
    descriptor = getattr(torch._C.TensorBase, name)
    get = descriptor.__get__

    def read(self):
        if _is_compiling():
            return get(self)
        return _disabled_torch_function_impl(get, _TYPES, (self,), _NO_KWARGS)

    def write(self, value):  # requires_grad only; through __torch_function__, as before
        descriptor.__set__(self, value)

    read.__name__ = read.__qualname__ = write.__name__ = write.__qualname__ = name
    settable = name == "requires_grad"
    return property(read, write if settable else None, doc=f"``Tensor.{name}`` of the wrapper, without __torch_function__.")


def _metadata_method(name: str):
    impl = getattr(torch._C.TensorBase, name)

    def method(self, *args, **kwargs):
        if _is_compiling():
            return impl(self, *args, **kwargs)
        return _disabled_torch_function_impl(impl, _TYPES, (self, *args), kwargs)

    method.__name__ = name
    method.__qualname__ = f"OffloadedTensor.{name}"
    method.__doc__ = f"``Tensor.{name}`` of the wrapper, without __torch_function__."
    return method


for _name in METADATA_PROPERTIES:
    setattr(OffloadedTensor, _name, _metadata_property(_name))
for _name in METADATA_METHODS:
    setattr(OffloadedTensor, _name, _metadata_method(_name))
del _name


# What an OffloadedTensor keeps in its own ``__dict__``; everything else there is the user's
# (vLLM's ``weight_loader``, ``output_dim``...), carried across wrap, re-placement and unwrap.
OWN_ATTRS = frozenset({"_host", "_master", "_layout", "_views", "_is_param", "_portable", "_cast"})

# User subclass of nn.Parameter -> the OffloadedTensor class whose instances are also instances of it.
_OFFLOADED_CLASSES: dict = {}


def offloaded_class(user_class: type) -> type:
    """The OffloadedTensor class for Parameters of ``user_class`` (a subclass of ``nn.Parameter``),
    made once per class.

    OffloadedTensor comes first in the bases, so construction, ``__torch_function__``,
    ``__torch_dispatch__``, repr, deepcopy and pickling are OffloadedTensor's (a copy or an unpickled
    one is a plain OffloadedTensor), while ``isinstance(p, user_class)``, the user's methods and
    properties keep working: a loader method writing through ``self.data`` or ``self[i]`` reaches the
    host master like any write to an OffloadedTensor. Views (``p.data``, ``p[i]``) are plain
    OffloadedTensors, as views of a Parameter are plain tensors."""
    combined = _OFFLOADED_CLASSES.get(user_class)
    if combined is None:
        if not (isinstance(user_class, type) and issubclass(user_class, torch.nn.Parameter)):
            raise TypeError(f"offtensor: offloaded_class takes a subclass of nn.Parameter, got {user_class!r}")
        if issubclass(user_class, OffloadedTensor):
            return user_class
        name = f"Offloaded{user_class.__name__}"
        combined = type(user_class)(name, (OffloadedTensor, user_class), {
            "__module__": user_class.__module__, "__qualname__": name, "_user_class": user_class,
        })
        _OFFLOADED_CLASSES[user_class] = combined
    return combined


def user_class(t: torch.Tensor):
    """The user's own Parameter subclass behind ``t``'s class (offloaded or not), or None for plain
    tensors, plain Parameters and plain OffloadedTensors."""
    cls = type(t)
    cls = cls.__dict__.get("_user_class", cls)
    if cls is torch.nn.Parameter or not issubclass(cls, torch.nn.Parameter) or issubclass(cls, OffloadedTensor):
        return None
    return cls


def user_attrs(t: torch.Tensor) -> dict:
    """The attributes the user set on ``t`` (its ``__dict__`` less OffloadedTensor's bookkeeping)."""
    return {k: v for k, v in t.__dict__.items() if k not in OWN_ATTRS}


_make_wrapper_subclass = torch.Tensor._make_wrapper_subclass


def _wrapper(cls, host: torch.Tensor, master: Master, requires_grad: bool = False, dtype=None):
    """The wrapper tensor: ``host``'s metadata on the pager's device, no storage of its own (of
    ``dtype`` for a lazy cast of ``host``: ``cast_views``)."""
    t = _make_wrapper_subclass(
        cls,
        host.shape,
        strides=host.stride(),
        storage_offset=host.storage_offset(),
        dtype=host.dtype if dtype is None else dtype,
        device=master.pager.device,
        requires_grad=requires_grad,
    )
    if _is_conj(host) or _is_neg(host):
        # A conjugate or negative view (``w.conj()``, ``w.conj().imag``) of the master: the wrapper
        # carries the host view's lazy bits, so torch's Conjugate and Negative fallbacks resolve
        # it (and write back through it) as they do for a plain view.
        _set_conj(t, _is_conj(host))
        _set_neg(t, _is_neg(host))
    return t


_is_conj = torch._C.TensorBase.is_conj
_is_neg = torch._C.TensorBase.is_neg
_set_conj = torch._C._set_conj
_set_neg = torch._C._set_neg


def _count_traced(t: torch.Tensor) -> None:
    TRACED_ALIVE[0] += 1
    weakref.finalize(t, _traced_died)


def _traced_died() -> None:
    TRACED_ALIVE[0] -= 1


def tracing_now() -> bool:
    """Whether an OffloadedTensor traced by torch.compile (a fake host view) is alive."""
    return TRACED_ALIVE[0] > 0


def new_view(host: torch.Tensor, master: Master, requires_grad: bool = False, cast=None) -> OffloadedTensor:
    """``OffloadedTensor(host, master)`` without the Python ``__new__`` and ``__init__`` calls: view
    ops make one per call, and the two calls cost about 0.5 µs of a view op's 12. With ``cast`` (a
    ``cast_views.CastSource``), a view of a lazy cast: of the cast's dtype, ``host`` in the master's."""
    t = _wrapper(OffloadedTensor, host, master, requires_grad, None if cast is None else cast.dtype)
    own = t.__dict__
    own["_host"] = host
    own["_master"] = master
    if cast is not None:
        own["_cast"] = cast
    return t


def wrap_host(host: torch.Tensor, pager: Pager, requires_grad: bool = False) -> OffloadedTensor:
    """An OffloadedTensor viewing ``host`` (host memory), of its storage's master."""
    return guard_data_ptr(OffloadedTensor(host, master_for(host, pager), requires_grad))


def guard_data_ptr(t: torch.Tensor) -> torch.Tensor:
    """``t``, whose data pointer now raises when C++ reads it without dispatching.

    A wrapper's own storage is empty: C++ that reads it directly (``torch.utils.dlpack.to_dlpack``,
    an extension's kernel) got null and crashed. FakeTensor guards its own the same way. Only
    long-lived tensors get it (weights, as placement installs them, and ``ot.offload``'s): it costs
    ~0.4 µs, a few per cent of a view op, and view ops make a short-lived wrapper per call."""
    _throw_on_data_ptr(t)
    return t


_throw_on_data_ptr = torch._C._set_throw_on_mutable_data_ptr


def _is_dense(t: torch.Tensor) -> bool:
    """``t``'s elements fill exactly numel slots of its storage: no gaps, no overlap."""
    order = sorted((st, n) for st, n in zip(t.stride(), t.shape) if n != 1)
    expected = 1
    for st, n in order:
        if st != expected:
            return False
        expected *= n
    return True


def _dense_strides(t: torch.Tensor):
    """Strides that keep ``t``'s memory order in a buffer of exactly numel elements, or None if
    ``t`` overlaps itself or has gaps (then the master is contiguous). A dense ``t`` keeps its own
    strides, those of its size-1 dims too, as torch's ``clone`` keeps them: kernels read a memory
    format off them (a 1x1 convolution weight in channels-last is also contiguous by
    ``is_contiguous()``, and a convolution given it returns a channels-last output)."""
    return list(t.stride()) if t.numel() > 1 and _is_dense(t) else None


def new_host_master(t: torch.Tensor, pin: bool, dtype: torch.dtype | None = None, strides=None) -> torch.Tensor:
    """An exact-size host copy of ``t`` (same shape, dtype and memory order), backed by the
    extension's page-aligned allocation. With ``dtype``: ``t``'s values cast to it, the copy
    converting element by element (no whole temporary of either dtype). With ``strides`` (dense
    ones): the copy's layout, instead of ``t``'s memory order."""
    dtype = t.dtype if dtype is None else dtype
    nbytes = t.numel() * dtype.itemsize
    raw = _ext.alloc_host(nbytes, pin=pin)
    flat = raw.view(dtype) if nbytes else torch.empty(0, dtype=dtype)
    strides = _dense_strides(t) if strides is None else strides
    host = flat.as_strided(t.shape, strides) if strides is not None else flat.view(t.shape)
    with torch.no_grad():
        host.copy_(t.detach())
    return host


def check_offloadable(t, what: str = "tensor") -> None:
    """Raise a clear error when ``t`` cannot become an OffloadedTensor (meta, nested, sparse, a subclass)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"offtensor: can only offload a torch.Tensor, got {type(t).__name__}")
    if t.is_meta:
        raise ValueError(
            f"offtensor: cannot offload {what} of shape {tuple(t.shape)} on the meta device: it has no values "
            f"({t.numel() * t.element_size()} bytes would be needed). Load its weights first, or use "
            f"ot.load_safetensors(model, path) for a model built on meta."
        )
    if t.is_nested:
        raise ValueError(
            f"offtensor: cannot offload nested {what} with {t.size(0)} components: nested tensors are not "
            f"supported; offload each component (t.unbind()) instead"
        )
    if t.layout != torch.strided:
        raise ValueError(
            f"offtensor: cannot offload {what} of shape {tuple(t.shape)} with layout {t.layout}: only dense strided "
            f"tensors are supported; "
            f"call .to_dense() first"
        )
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        _leaves.check_flattenable(t, what)  # a wrapper without the protocol: that error names the class
        raise TypeError(
            f"offtensor: cannot offload {what} of subclass {type(t).__name__} as it is: only plain tensors, "
            f"Parameters and the plain leaves of traceable wrapper subclasses (ot.offload and wrap_model walk "
            f"__tensor_flatten__) are offloaded; pass a plain tensor (t.as_subclass(torch.Tensor))"
        )


def offload(t: torch.Tensor, device=None, *, pager: Pager | None = None) -> OffloadedTensor:
    """An OffloadedTensor on ``device`` whose host master is an exact-size (pinned) copy of ``t``.

    ``device=None`` is the current CUDA device when there is one, else the emulated device (cpu).
    Offloading an OffloadedTensor already on that device returns it unchanged.
    """
    if isinstance(t, OffloadedTensor):
        target = resolve_device(device) if device is not None else t.device
        if target == t.device and (pager is None or pager is t.pager):
            return t
        if target == t.device:
            t._master.move_to(pager)
            return t
        raise ValueError(
            f"offtensor: tensor of shape {tuple(t.shape)} is already offloaded to {t.device}; "
            f"cannot offload it again to {target}"
        )
    if pager is None:
        pager = Pager.default(resolve_device(device))
    elif device is not None and resolve_device(device) != pager.device:
        raise ValueError(f"offtensor: device {device} does not match the pager's device {pager.device}")
    if _leaves.is_wrapper(t):
        # A DTensor, a torchao tensor...: a new object of its class whose plain leaves are offloaded
        # (the OffloadedTensor is the leaf, never around the subclass).
        return _leaves.rebuild(t, lambda leaf: offload(leaf, pager=pager))
    check_offloadable(t)
    host = new_host_master(t, pin=pins_host_memory(pager.device))
    return wrap_host(host, pager, requires_grad=t.requires_grad)


def _rebuild_offloaded(host: torch.Tensor, device: str, requires_grad: bool, is_param: bool, attrs=None):
    try:
        target = resolve_device(device)
    except ValueError:
        # Saved on a GPU, loaded without one: the values are all in ``host``, so keep them and
        # emulate the device rather than refuse to load.
        target = resolve_device(None)
    t = wrap_host(host, Pager.default(target), requires_grad and not is_param)
    if is_param:
        t = torch.nn.Parameter(t, requires_grad=requires_grad)
    if attrs:
        t.__dict__.update(attrs)
    return t


# What torch.load(weights_only=True) must allow to rebuild a pickled OffloadedTensor. Importing
# offtensor allows nothing process-wide; the user opts in (safe_globals / add_safe_globals).
SAFE_GLOBALS = (OffloadedTensor, _rebuild_offloaded)


def safe_globals():
    """A context manager under which ``torch.load(..., weights_only=True)`` rebuilds pickled
    OffloadedTensors (``torch.save`` of an OffloadedTensor keeps its class); outside it, such a
    file is refused as weights_only refuses any unknown global. A wrapped model's ``state_dict()``
    needs no opt-in: its values are saved as plain CPU tensors.

    ``with ot.safe_globals(): x = torch.load(path, weights_only=True)``"""
    return torch.serialization.safe_globals(list(SAFE_GLOBALS))


def add_safe_globals() -> None:
    """Allow ``torch.load(weights_only=True)`` to rebuild OffloadedTensors in this whole process
    (``torch.serialization.add_safe_globals``): the process-wide form of :func:`safe_globals`."""
    torch.serialization.add_safe_globals(list(SAFE_GLOBALS))
