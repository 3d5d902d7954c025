"""Moving a model's tensors: a storage group offloaded into one host master or made resident on
the device, each Parameter object kept (swapped in place), every step recorded so that a failure
undoes them all (``Undo``); and the count of the device bytes resident tensors hold."""

from __future__ import annotations

import copyreg
import itertools
import threading
import weakref

import torch
from torch import nn

from .. import leaves
from ..pager import Pager, covering_range, master_for, pins_host_memory
from ..tensor import (
    OWN_ATTRS, OffloadedTensor, check_offloadable, guard_data_ptr, new_host_master, offloaded_class, user_attrs,
    user_class,
)
from .groups import Member, StorageGroup, attribute_tensors, compact_layout


class Undo:
    """What ``apply_placement`` changed so far, newest last, so that a failure at any step (an
    allocation, a read, a registration) puts the model back exactly as it was: the same tensor
    objects with the same classes, attributes and storages, masters on their old pagers. Until the
    placement completes, the record keeps the original tensors alive (the price of an exact undo:
    for a wrap of a host model, its offloaded bytes are held twice until ``wrap_model`` returns);
    dropping the record after an undo frees what the placement allocated.

    Exact under interrupts too (a ``KeyboardInterrupt`` raised at any bytecode, not only at a
    call): each step notes its undo *before* it changes anything, and every undo puts back the
    state it recorded, so undoing a step that did not happen, or happened in part, is right too.
    The roll-back survives a second interrupt: a step whose undo was interrupted is undone again,
    and the first exception raised meanwhile is raised once every step is undone.

    Python raises a signal's exception at the entry of ``__exit__`` before any of its code runs, so
    the block's last statement is ``commit()`` (its changes stand: the record is no longer active
    and lets go of the tensors it kept), and the caller's handler calls ``roll_back()`` again
    (a no-op after ``__exit__`` or ``commit``): an interrupt at that entry then neither leaves the
    record active, keeping the original tensors and whatever later steps note, nor skips the
    roll-back of a block cut short."""

    _active = threading.local()  # the record of the placement running in this thread, if any
    ATTEMPTS = 4  # undoes of one step that raise before the roll-back gives up on that step

    def __init__(self):
        self.steps = []

    @classmethod
    def note(cls, *step) -> None:
        record = getattr(cls._active, "record", None)
        if record is not None:
            record.steps.append(step)

    def __enter__(self):
        self.outer = getattr(Undo._active, "record", None)
        Undo._active.record = self
        return self

    def __exit__(self, kind, error, tb):
        Undo._active.record = self.outer
        if kind is not None:
            self.roll_back()
        elif self.outer is not None:  # inside another record: its failure undoes these steps too
            self.outer.steps.extend(self.steps)
        self.steps.clear()  # a failure's traceback holds this frame: the new tensors go now
        return False

    def commit(self) -> None:
        """The block is done. Two stores, with no point between them where Python raises a
        signal's exception: an interrupt before this call is rolled back, one after it keeps
        every change (and then ``roll_back`` has nothing left to undo)."""
        Undo._active.record = None
        self.steps = []

    @staticmethod
    def run(steps, *args):
        """``steps(*args)`` all or nothing: inside a new record, committed as its last statement;
        whatever cuts it short (an error, a Ctrl-C, one at the entry of ``__exit__`` too) is rolled
        back before it is raised again. Returns what ``steps`` returned."""
        undo = Undo()
        try:
            with undo:
                result = steps(*args)
                undo.commit()
        except BaseException:
            undo.roll_back()  # (where a second interrupt, at the entry of Undo.__exit__, skipped it)
            raise
        return result

    def roll_back(self) -> None:
        Undo._active.record = None
        steps, pending, failures = self.steps, None, 0
        while steps:
            try:
                while steps:
                    _undo(*steps[-1])
                    steps.pop()
                    failures = 0
            except BaseException as error:  # a second Ctrl-C, or an undo that failed: go on
                pending = error if pending is None else pending
                failures += 1
                if failures >= Undo.ATTEMPTS:
                    steps.pop()
                    failures = 0
        if pending is not None:
            try:
                raise pending
            finally:
                pending = None  # not a cycle through this frame: what it holds goes with the traceback


def _undo(what, *args) -> None:
    """Undo one noted step; a no-op when the step did not happen."""
    if what == "swapped":  # swap_tensors exchanged (some of) the contents: put each back
        old, new, old_state, new_state = args
        _restore(old, old_state, new)
        _restore(new, new_state, old)
    elif what == "slots":  # the slots took the new object: give them the old one
        member, old = args
        _register(member, old)
    elif what == "leaf":  # the outer tensors took the new leaf: give them the old one
        member, old = args
        for owner, attr in member.owners:
            leaves.replace_leaf(owner, attr, old)
        member.tensor = old
    elif what == "data":
        t, data = args
        t.data = data
    elif what == "moved":
        master, pager = args
        if pager is not None:
            master.move_to(pager)
    elif what == "call":  # a registration's own undo (idempotent)
        undo, *call_args = args
        undo(*call_args)


def _tensor_state(t: torch.Tensor) -> tuple:
    """What ``torch.utils.swap_tensors`` exchanges between two tensor objects: class, attribute
    dict, slots and the C++ tensor (``_cdata``)."""
    slots = {name: getattr(t, name, _MISSING) for name in copyreg._slotnames(type(t))}
    return type(t), t.__dict__, slots, t._cdata


_MISSING = object()


def _restore(t: torch.Tensor, state: tuple, other: torch.Tensor) -> None:
    """Give ``t`` back what ``_tensor_state`` recorded, taking what it lost from ``other`` (its
    partner in the swap); each part only if it changed, so a swap interrupted half-way is undone."""
    cls, attrs, slots, cdata = state
    if t._cdata != cdata:  # one C call exchanges them: either both moved or neither did
        torch._C._swap_tensor_impl(t, other)
    if type(t) is not cls:
        t.__class__ = cls
    if t.__dict__ is not attrs:
        t.__dict__ = attrs
    for name, value in slots.items():
        if getattr(t, name, _MISSING) is not value:
            if value is _MISSING:
                delattr(t, name)
            else:
                setattr(t, name, value)


def _register(member: Member, t: torch.Tensor) -> None:
    """``t`` in every slot of ``member`` (its modules' parameters, buffers or attributes)."""
    for module, attr, is_buffer in member.slots:
        if is_buffer is None:  # a plain tensor attribute
            module.__dict__[attr] = t
        else:
            (module._buffers if is_buffer else module._parameters)[attr] = t
    member.tensor = t


def swap(member: Member, new: torch.Tensor) -> None:
    """Make ``member.tensor`` become ``new`` in place, so its identity survives; if PyTorch refuses
    (other C++ references exist), register ``new`` in every slot instead."""
    old = member.tensor
    if member.owners:
        _swap_leaf(member, new)
        return
    # nn.LSTM/GRU/RNN keep weak references to their weights (to notice a re-assigned weight), and
    # swap_tensors refuses a tensor with weak references: drop them for the swap and point them at
    # the same objects afterwards, so the modules see no change of weights.
    rnns = [m for m, _, _ in member.slots if isinstance(m, nn.RNNBase) and getattr(m, "_flat_weight_refs", None)]
    for rnn in rnns:
        rnn._flat_weight_refs = []
    try:
        Undo.note("swapped", old, new, _tensor_state(old), _tensor_state(new))
        torch.utils.swap_tensors(old, new)  # ``new`` now holds the old contents
        return
    except RuntimeError:
        pass  # e.g. a live autograd graph still references the tensor (nothing was exchanged)
    finally:
        for rnn in rnns:
            rnn._flat_weight_refs = [weakref.ref(w) if w is not None else None for w in rnn._flat_weights]
    Undo.note("slots", member, old)
    _register(member, new)


def _swap_leaf(member: Member, new: torch.Tensor) -> None:
    """A leaf of a wrapper subclass (a DTensor's local shard...) becomes ``new`` in every outer
    tensor holding it; the outer objects, registered in the modules, stay as they are."""
    old = member.tensor
    if new.requires_grad != old.requires_grad:
        new.requires_grad_(old.requires_grad)  # DTensor keeps its local shard's flag equal to its own
    Undo.note("leaf", member, old)
    for owner, attr in member.owners:
        leaves.replace_leaf(owner, attr, new)
    member.tensor = new


def refit_wrappers(members) -> None:
    """Each wrapper subclass holding a leaf of ``members`` (replaced by ``_swap_leaf``, or moved by
    ``make_resident``) brought onto its leaves' device, the nested ones first: the registered outer
    object in place (``swap``: same object, class and attributes, its C++ tensor now on the device),
    a nested one replaced in its owner as a leaf is. See ``leaves.refitted`` for why."""
    roots = {}
    for member in members:
        for module, attr, is_buffer in member.slots if member.owners else ():
            if is_buffer is None:  # a plain tensor attribute: never a wrapper's leaf
                continue
            t = (module._buffers if is_buffer else module._parameters).get(attr)
            if t is not None and leaves.is_wrapper(t):
                root = roots.setdefault(id(t), Member(t))
                if (module, attr, is_buffer) not in root.slots:
                    root.slots.append((module, attr, is_buffer))
    for root in roots.values():
        refit(root)


def refit(root: Member) -> torch.Tensor:
    """``refit_wrappers`` for one registered wrapper (``root.tensor`` in ``root.slots``); returns
    the object now registered there (``root.tensor`` itself unless torch refused to swap it)."""
    for owner, attr, inner in leaves.nested_wrappers(root.tensor):
        new = leaves.refitted(inner)
        if new is not None:
            nested = Member(inner)
            nested.owners.append((owner, attr))
            _swap_leaf(nested, _dressed_as(inner, new))
    new = leaves.refitted(root.tensor)
    if new is not None:
        swap(root, _dressed_as(root.tensor, new))
    return root.tensor


def _dressed_as(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``new`` (``old`` rebuilt by its class) with ``old``'s attributes (its leaves, which ``new``
    holds too, Parameter-ness, ``weight_loader``...) and ``requires_grad``: ``swap`` moves them onto
    ``old``'s object with the rebuilt C++ tensor."""
    new.__dict__.update(old.__dict__)
    if new.requires_grad != old.requires_grad:
        new.requires_grad_(old.requires_grad)
    return new


def check_attribute_names(t: torch.Tensor, what: str) -> None:
    clash = sorted(OWN_ATTRS & t.__dict__.keys()) if not isinstance(t, OffloadedTensor) else ()
    if clash:
        raise ValueError(
            f"offtensor: {what} of shape {tuple(t.shape)} ({t.numel() * t.element_size()} bytes) has attributes "
            f"{clash}, the names an OffloadedTensor keeps its host master under; rename them before wrapping"
        )


def as_param_like(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``new`` (an OffloadedTensor, or a plain device tensor when unwrapping) dressed as ``old``: a
    Parameter of ``old``'s own class (vLLM's ``ModelWeightParameter``...) holding the same attribute
    objects (``weight_loader``, ``output_dim``...). ``swap`` then moves class and ``__dict__`` onto
    ``old``'s object, so the user's references see them too."""
    check_attribute_names(old, f"a {type(old).__name__}")
    cls = user_class(old)
    if cls is not None:
        # The user's __new__/__init__ may demand arguments (vLLM's weight_loader); bypass them,
        # as attributes are copied below anyway.
        if isinstance(new, OffloadedTensor):
            result = offloaded_class(cls)(new._host, new._master, old.requires_grad)
        else:
            result = torch.Tensor._make_subclass(cls, new, old.requires_grad)
    elif isinstance(old, nn.Parameter):
        result = nn.Parameter(new, requires_grad=old.requires_grad)
    else:
        result = new
    attrs = user_attrs(old)
    if attrs:
        result.__dict__.update(attrs)
    return guard_data_ptr(result) if isinstance(result, OffloadedTensor) else result


def offload_group(group: StorageGroup, pager: Pager) -> None:
    first = group[0].tensor
    if isinstance(first, OffloadedTensor):
        Undo.note("moved", first._master, first._master.pager)
        first._master.move_to(pager)
        return
    if first.is_meta and pager.device.type == "meta":
        _offload_on_meta(group, pager)
        return
    for member in group:
        check_offloadable(member.tensor, f"'{member.names[0]}'")
    for members, lo, hi, compact in group.master_parts():  # one master, or one per view of a gapped storage
        if compact:  # a view into a bigger storage: a master of its own elements only
            host_flat = new_host_master(compact_layout(members[0].tensor), pin=pins_host_memory(pager.device))
        else:
            flat = members[0].tensor.detach().as_strided((hi - lo,), (1,), lo)  # members not swapped yet
            host_flat = new_host_master(flat, pin=pins_host_memory(pager.device))
        master = master_for(host_flat, pager)
        master.name = next((n for m in members for n in m.names), None)
        for member in members:
            t = member.tensor
            if not t.numel():  # an empty view: no elements to place
                host = host_flat.as_strided(t.shape, t.stride(), 0)
            else:
                host = host_flat if compact else host_flat.as_strided(t.shape, t.stride(), t.storage_offset() - lo)
            swap(member, as_param_like(t, OffloadedTensor(host, master)))


def _offload_on_meta(group: StorageGroup, pager: Pager) -> None:
    """``offload_group`` for a model built on meta, on a meta pager (``ot.plan``): views of a master
    of meta bytes, nothing allocated or copied, so the plan pages what a GPU run would page."""
    first = group[0].tensor
    lo, hi = group.element_range()
    flat = torch.empty(hi - lo, dtype=first.dtype, device="meta")
    master = pager.new_master((hi - lo) * first.element_size())
    master.name = group.names[0]
    master.flat = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device="meta")
    for member in group:
        t = member.tensor
        host = flat.as_strided(t.shape, t.stride(), t.storage_offset() - lo)
        swap(member, as_param_like(t, OffloadedTensor(host, master)))


def make_resident(group: StorageGroup, device: torch.device) -> None:
    first = group[0].tensor
    if isinstance(first, OffloadedTensor):
        host_group = [(m, m.tensor._host) for m in group]
        lo = min(covering_range(h)[0] for _, h in host_group)
        hi = max(covering_range(h)[1] for _, h in host_group)
        flat = first._master.pager.copy_out(first._host.as_strided((hi - lo,), (1,), lo))
        for member, host in host_group:
            view = flat.as_strided(host.shape, host.stride(), host.storage_offset() - lo)
            swap(member, as_param_like(member.tensor, view))
        return
    if first.device == device:
        return
    if first.is_meta:
        raise ValueError(
            f"offtensor: '{group[0].names[0]}' ({group.nbytes} bytes) is on the meta device and has no values; "
            f"load its weights first (ot.load_safetensors) or build the model on cpu"
        )
    lo, hi = group.element_range()
    flat = first.detach().as_strided((hi - lo,), (1,), lo).to(device)
    for member in group:
        t = member.tensor
        Undo.note("data", t, t.data)
        t.data = flat.as_strided(t.shape, t.stride(), t.storage_offset() - lo)


def resident_bytes(model: nn.Module, device: torch.device, skip=frozenset(), extra=()) -> int:
    """Device bytes held by the plain device tensors of ``model`` and of ``extra`` (modules being
    attached, tensors being placed), each storage once; ``skip``: (module, attribute) slots whose
    tensor is being replaced."""
    return sum(resident_storages(model, device, skip, extra).values())


def resident_storages(model: nn.Module, device: torch.device, skip=frozenset(), extra=()) -> dict:
    """Storage key -> bytes for the tensors ``resident_bytes`` counts."""
    sources = [weight_tensors(model, skip), (t for *_, t in attribute_tensors(model))]
    sources += [weight_tensors(e, skip) if isinstance(e, nn.Module) else (e,) for e in extra]
    return resident_storages_of(itertools.chain.from_iterable(sources), device)


def storage_bytes(t: torch.Tensor):
    storage = t.untyped_storage()
    if storage.data_ptr():
        return storage.data_ptr(), storage.nbytes()
    return id(t), t.numel() * t.element_size()


def is_computed(t: torch.Tensor) -> bool:
    """``t`` is what autograd computed from weights during a forward (it has a ``grad_fn``), held as
    a plain attribute: ``torch.nn.utils.prune``'s ``weight = weight_orig * weight_mask``, which its
    forward pre-hook sets again before every forward (the hook-based ``weight_norm`` and
    ``spectral_norm`` likewise). It cannot be offloaded (the graph holds it) and is no weight:
    counted as activations are, not in the weight budget. Counted there, one would leave the
    budget short of the room paging needs, and the next weight placed would be refused."""
    return t.grad_fn is not None


def untracked_bytes(model: nn.Module, device: torch.device) -> int:
    """Device bytes of plain tensor attributes whose storage no Parameter or buffer shares."""
    weights = resident_storages_of(weight_tensors(model), device)
    attributes = resident_storages_of((t for *_, t in attribute_tensors(model)), device)
    return sum(n for key, n in attributes.items() if key not in weights)


def resident_storages_of(tensors, device: torch.device) -> dict:
    storages = {}
    for t in itertools.chain.from_iterable(map(leaves.leaf_tensors, tensors)):  # a subclass holds its leaves' bytes
        if not isinstance(t, OffloadedTensor) and t.device == device and not t.is_meta:
            key, nbytes = storage_bytes(t)
            storages[key] = nbytes
    return storages


def weight_tensors(model: nn.Module, skip=frozenset()):
    """The plain tensors holding ``model``'s parameters and buffers: each registered tensor, or
    the leaves of one that is a wrapper subclass (a DTensor's local shard)."""
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for attr, t in table.items():
                if t is not None and (not skip or (module, attr) not in skip):
                    if leaves.is_leaf(t):
                        yield t
                    else:
                        yield from leaves.leaf_tensors(t)


def check_offloadable_quietly(t: torch.Tensor) -> bool:
    try:
        check_offloadable(t, "attribute")
    except (TypeError, ValueError, RuntimeError):
        return False
    return True
