"""A model's tensors as placement sees them: each tensor object once (``Member``: its module slots
and names), grouped by the storage they share (``StorageGroup``: tied names and aliases of one
storage, placed together), with the ``placement.Weight`` each group is."""

from __future__ import annotations

import torch
from torch import nn

from .. import leaves
from ..pager import host_layout
from ..placement import Weight, working_set
from ..tensor import OffloadedTensor


class Member:
    """One tensor object and every (module, attribute, is_buffer) slot it is registered in;
    ``is_buffer`` is None for a plain tensor attribute.

    A leaf of a wrapper subclass (a DTensor's local shard, a torchao tensor's data) is a Member
    too: ``owners`` lists the (outer tensor, attribute) pairs holding it, and it is replaced there;
    ``slots`` and ``names`` are then those of the outer tensor, which stays registered as it is."""

    __slots__ = ("tensor", "slots", "names", "owners")

    def __init__(self, tensor):
        self.tensor = tensor
        self.slots = []
        self.names = []
        self.owners = []


class StorageGroup(list):
    """The ``Member`` s of a model that alias one storage (or one host master): placed together."""

    @property
    def tensor(self) -> torch.Tensor:
        return self[0].tensor

    @property
    def names(self) -> list:
        return [n for m in self for n in m.names]

    @property
    def is_offloaded(self) -> bool:
        return _is_offloaded(self[0].tensor)

    def element_range(self):
        """Elements [lo, hi) of the storage that the members cover together."""
        ranges = [host_layout(m.tensor)[:2] for m in self if m.tensor.numel()]
        if not ranges:
            return 0, 0
        return min(r[0] for r in ranges), max(r[1] for r in ranges)

    @property
    def nbytes(self) -> int:
        t = self[0].tensor
        if _is_offloaded(t):
            return t._master.nbytes
        if len(self) == 1 and (t.is_meta or not is_expanded(t)):
            return t.numel() * t.element_size()
        # Several aliases, or an expanded (stride-0) tensor: the storage range they cover, which is
        # what a host master or a resident copy of them holds (256 B for 256 B expanded to 16 KiB).
        lo, hi = self.element_range()
        return (hi - lo) * t.element_size()

    def weight(self) -> Weight:
        """This group as placement sees it."""
        names = self.names
        nbytes = self.nbytes
        slots = [(module, attr) for m in self for module, attr, _ in m.slots]
        # torch.nn's own modules (Linear, LSTM, MultiheadAttention...) may read all their tensors in one op.
        fused = any(type(module).__module__.startswith("torch.nn") for module, _ in slots)
        # An embedding table nothing else reads (a tied LM head registers it under a Linear too) is
        # only ever paged by rows. max_norm would renormalise the looked-up rows in place; rare, and
        # kept on the ordinary path.
        indexed = bool(slots) and all(
            isinstance(module, nn.Embedding) and attr == "weight" and module.max_norm is None for module, attr in slots
        )
        shape = tuple(self[0].tensor.shape)
        sliced = (not fused and len(shape) >= 2 and all(is_buffer for m in self for *_, is_buffer in m.slots)
                  and bool(slots))
        # An RNN reads its weights in its own kernels (cuDNN's _cudnn_rnn takes every layer's at once,
        # CPU's mkldnn_rnn_layer a layer's four), which dispatch cannot cut into output tiles.
        tileable = (all(leaf_is_tileable(m.tensor, m.owners) for m in self)
                    and not any(isinstance(module, nn.RNNBase) for module, _ in slots))
        return Weight(names, nbytes, shape, working_set(names[0], shape, nbytes, indexed), fused, indexed, sliced,
                      tileable)


def leaf_is_tileable(t: torch.Tensor, owners) -> bool:
    """``Weight.tileable`` for a tensor held by ``owners`` (outer tensor, attribute) pairs."""
    return all(t.dtype == owner.dtype for owner, _ in owners)


def is_expanded(t: torch.Tensor) -> bool:
    """Some dim of ``t`` repeats its elements (stride 0, size > 1), as ``expand`` makes."""
    return any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape))


def tensor_bytes(t: torch.Tensor) -> int:
    """The bytes ``t``'s values take: its covering storage range when expanded (offloading keeps
    the stride-0 layout), else numel bytes."""
    if t.layout == torch.strided and not t.is_meta and t.numel() and is_expanded(t):
        lo, hi = host_layout(t)[:2]
        return (hi - lo) * t.element_size()
    return t.numel() * t.element_size()


def collect_groups(model: nn.Module) -> list:
    """Every parameter and buffer of ``model`` once, grouped by storage: a list of StorageGroups."""
    members = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for table, is_buffer in ((module._parameters, False), (module._buffers, True)):
            for attr, t in table.items():
                if t is None:
                    continue
                name = f"{prefix}.{attr}" if prefix else attr
                for tensor, owner in _leaf_members(t, name):
                    member = members.get(id(tensor))
                    if member is None:
                        member = members[id(tensor)] = Member(tensor)
                    if (module, attr) not in [(m, a) for m, a, _ in member.slots]:
                        member.slots.append((module, attr, is_buffer))
                    if name not in member.names:
                        member.names.append(name)
                    if owner is not None and not any(o is owner[0] and a == owner[1] for o, a in member.owners):
                        member.owners.append(owner)
    groups = {}
    for member in members.values():
        groups.setdefault(_storage_key(member.tensor), StorageGroup()).append(member)
    return list(groups.values())


def _leaf_members(t: torch.Tensor, name: str):
    """``(tensor, None)`` for a plain (or offloaded) tensor, ``(leaf, (owner, attribute))`` for
    each plain leaf of a wrapper subclass: placement sees, and counts, the leaves' bytes."""
    if leaves.is_leaf(t):
        return [(t, None)]
    return [(leaf, (owner, attr)) for owner, attr, leaf in leaves.leaves(t, f"'{name}'")]


def _is_offloaded(t: torch.Tensor) -> bool:
    return isinstance(t, OffloadedTensor)


def _storage_key(t: torch.Tensor):
    if _is_offloaded(t):
        return ("master", t._master.id)
    if t.is_meta or t.layout != torch.strided or t.untyped_storage().data_ptr() == 0:
        return ("object", id(t))
    return (t.device, t.untyped_storage().data_ptr(), t.dtype)
