"""A model's tensors as placement sees them: each tensor object once (``Member``: its module slots
and names), grouped by the storage they share (``StorageGroup``: tied names and aliases of one
storage, placed together), with the ``placement.Weight`` each group is."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.nn.utils import parametrize

from .. import leaves
from ..pager import host_layout
from ..placement import SMALL_BYTES, Weight
from ..working_sets import working_set
from ..tensor import OffloadedTensor


class Member:
    """One tensor object and every (module, attribute, is_buffer) slot it is registered in;
    ``is_buffer`` is None for a plain tensor attribute.

    A leaf of a wrapper subclass (a DTensor's local shard, a torchao tensor's data) is a Member
    too: ``owners`` lists the (outer tensor, attribute) pairs holding it, and it is replaced there;
    ``slots`` and ``names`` are then those of the outer tensor, which stays registered as it is."""

    __slots__ = ("tensor", "slots", "names", "owners", "fast_path", "read_whole")

    def __init__(self, tensor):
        self.tensor = tensor
        self.slots = []
        self.names = []
        self.owners = []
        self.fast_path = None  # (path, class name) of a torch.nn module with a fused fast path that reads it
        # Bytes of every tensor of a parent whose fused kernel reads it with them whole
        # (LinearCrossEntropyLoss: its linear's weight and its class weights), else 0: never tiled.
        self.read_whole = 0


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

    def master_parts(self) -> list:
        """How offloading lays this group out in host masters: ``(members, lo, hi, compact)`` per
        master. One master over the storage range the members cover together, unless that range
        holds elements none of them views (a column shard of transformers' tensor parallelism is a
        view into the full weight's storage, twice its bytes): then, where the members' ranges are
        disjoint, each view gets a master of its own elements only (``compact``: a dense copy in
        its memory order, ``compact_layout``), so the host holds, and paging covers, what it is."""
        lo, hi = self.element_range()
        t = self[0].tensor
        if _is_offloaded(t) or t.is_meta or any(is_expanded(m.tensor) for m in self):
            return [(list(self), lo, hi, False)]
        layouts = {}
        for m in self:
            v = m.tensor
            layouts.setdefault((v.storage_offset(), tuple(v.shape), v.stride()), []).append(m)
        if sum(ms[0].tensor.numel() for ms in layouts.values()) >= hi - lo:
            return [(list(self), lo, hi, False)]
        parts = sorted(((host_layout(ms[0].tensor)[:2], ms) for ms in layouts.values() if ms[0].tensor.numel()),
                       key=lambda part: part[0])
        if any(a[0][1] > b[0][0] for a, b in zip(parts, parts[1:])):
            return [(list(self), lo, hi, False)]  # interleaved views: one master over their range
        empty = [m for ms in layouts.values() if not ms[0].tensor.numel() for m in ms]
        out = [(ms, plo, phi, phi - plo > ms[0].tensor.numel()) for (plo, phi), ms in parts]
        if empty:
            out = out or [([], lo, lo, False)]
            out[0] = (out[0][0] + empty, *out[0][1:])
        return out

    @property
    def nbytes(self) -> int:
        """The bytes of the host masters offloading makes (``master_parts``): the elements the
        members view where their range has gaps, else the storage range they cover (256 B for
        256 B expanded to 16 KiB)."""
        t = self[0].tensor
        if _is_offloaded(t):
            return t._master.nbytes
        if len(self) == 1 and (t.is_meta or not is_expanded(t)):
            return t.numel() * t.element_size()
        return sum((m[0].tensor.numel() if compact else hi - lo) for m, lo, hi, compact in self.master_parts()
                   if m) * t.element_size()

    @property
    def device_bytes(self) -> int:
        """The device bytes this group holds while resident: its storage's, where that already is
        one allocation larger than its masters would be (a shard viewing the full weight's
        storage), since keeping the view keeps the whole storage."""
        t = self[0].tensor
        nbytes = self.nbytes
        if _is_offloaded(t) or t.is_meta or t.layout != torch.strided or not t.untyped_storage().data_ptr():
            return nbytes
        return max(nbytes, t.untyped_storage().nbytes() // t.element_size() * t.element_size())

    def weight(self) -> Weight:
        """This group as placement sees it."""
        names = self.names
        nbytes = self.nbytes
        slots = [(module, attr) for m in self for module, attr, _ in m.slots]
        # torch.nn's own modules (Linear, LSTM, MultiheadAttention...) may read all their tensors in one op.
        fused = any(type(module).__module__.startswith("torch.nn") for module, _ in slots)
        # An embedding table (or bag's) nothing else reads (a tied LM head registers it under a
        # Linear too) is only ever paged by rows; with max_norm, the rows it looks up are
        # renormalised in place first, and only they are paged and written back (ops.row_writes).
        indexed = bool(slots) and all(isinstance(module, _TABLES) and attr == "weight" for module, attr in slots)
        shape = tuple(self[0].tensor.shape)
        sliced = (not fused and len(shape) >= 2 and all(is_buffer for m in self for *_, is_buffer in m.slots)
                  and bool(slots))
        # An RNN reads its weights in its own kernels (cuDNN's _cudnn_rnn takes every layer's at once,
        # CPU's mkldnn_rnn_layer a layer's four), which dispatch cannot cut into output tiles.
        tileable = (all(leaf_is_tileable(m.tensor, m.owners) and not m.read_whole for m in self)
                    and all(read_in_tiles(module, attr) for module, attr in slots))
        fast_path = next((m.fast_path for m in self if m.fast_path is not None), None)
        ws = max([working_set(names[0], shape, nbytes, indexed)] + [m.read_whole for m in self])
        return Weight(names, nbytes, shape, ws, fused, indexed, sliced, tileable, self.device_bytes, fast_path,
                      self[0].tensor.dtype, _conv_outputs(slots, shape), weight_norm_slices(slots, shape),
                      next((type(m[0]).__name__ for m, a in slots
                            if isinstance(m, _PARAMETRIZATIONS) and len(m) and not read_in_tiles(m, a)), None))


# torch.nn's modules whose weights dispatch computes in output tiles (ops.tiling: linear, mm; and
# ops.convolutions: every convolution, grouped, depthwise and transposed ones too). Every other
# torch.nn module reads its weights in a kernel dispatch cannot cut (an RNN's _cudnn_rnn,
# Bilinear's _trilinear, a norm's multi-dim weight), so they are paged whole. A model's own module
# is taken to read its weights by linear, mm, bmm or convolution (GPT-2's Conv1D: addmm), which
# tile. (RNN cells and attention's composite path read theirs by linear too.)
_TILED_MODULES = (nn.Linear, nn.Embedding, nn.EmbeddingBag, nn.RNNCellBase, nn.MultiheadAttention)
# Tables read by rows: embedding and embedding_bag (and the per-sample weights' gradient of a bag,
# and a max_norm's renormalisation) page only the rows their indices select (ops.rows, ops.row_writes).
_TABLES = (nn.Embedding, nn.EmbeddingBag)
_CONVS = nn.modules.conv._ConvNd  # Conv1d-3d and ConvTranspose1d-3d (and their lazy forms)
_PARAMETRIZATIONS = nn.utils.parametrize.ParametrizationList
_WEIGHT_NORM = nn.utils.parametrizations._WeightNorm
# torch's parametrizations whose ops on an offloaded original (and on their own tensors) all run
# within the room: orthogonal reads its original only by ``tril`` / ``triu`` / ``diagonal`` (whole,
# on the host: ops.host_compute) and multiplies its ``base`` into the result (mm, in tiles);
# spectral_norm reads its original by ``mv`` (in tiles) and divides it by its norm (in slices:
# ops.pieces), its ``_u`` and ``_v`` being vectors. Each computes the weight on the device as the
# unwrapped model does, outside the weight budget like any activation.
_IN_PIECES = tuple(c for c in (getattr(nn.utils.parametrizations, "_Orthogonal", None),
                               getattr(nn.utils.parametrizations, "_SpectralNorm", None)) if c is not None)
# torch.nn modules with a fused fast path that their forward takes only when no argument has a
# __torch_function__: with an offloaded weight they run the composite path, which sums in
# another order.
_FAST_PATHS = (nn.TransformerEncoderLayer, nn.TransformerEncoder, nn.MultiheadAttention)
# torch.nn modules whose own kernel reads their submodules' weights whole (F.linear_cross_entropy).
_FUSED_PARENTS = tuple(c for c in (getattr(nn, "LinearCrossEntropyLoss", None),) if c is not None)


def read_whole_after(module: nn.Module, attr: str, t: torch.Tensor, modules) -> tuple:
    """What the kernel of a ``_FUSED_PARENTS`` module among ``modules`` that holds ``module``
    pages at once when ``module.attr`` holds ``t`` offloaded (a weight assigned after wrapping,
    or attached with a new loss): the bytes of ``t`` and of the parent's other offloaded tensors,
    read whole beside it, and the parent; (0, None) where no such parent holds ``module``: its ops
    may tile it."""
    for parent in {id(m): m for m in modules if isinstance(m, _FUSED_PARENTS)}.values():
        inside = list(parent.modules())
        if not any(m is module for m in inside):
            continue
        tensors = {id(t): t}
        for m in inside:
            for a, v in (*m._parameters.items(), *m._buffers.items()):
                if isinstance(v, OffloadedTensor) and not (m is module and a == attr):
                    tensors.setdefault(id(v), v)
        return sum(tensor_bytes(v) for v in tensors.values()), parent
    return 0, None


def _batch_first(module: nn.Module) -> bool:
    """Whether ``module``'s fast path can be taken at all: only with batch-first attention."""
    if isinstance(module, nn.TransformerEncoder):
        return any(_batch_first(layer) for layer in module.layers)
    attention = module.self_attn if isinstance(module, nn.TransformerEncoderLayer) else module
    return bool(getattr(attention, "batch_first", False))


def read_in_tiles(module: nn.Module, attr: str) -> bool:
    """Whether dispatch may compute the ops reading ``module.attr`` in output tiles."""
    if not type(module).__module__.startswith("torch.nn"):
        return True
    if isinstance(module, _CONVS):
        return True
    if isinstance(module, _PARAMETRIZATIONS):
        # The first parametrization alone reads the originals (each later one reads what the one
        # before it returned, a plain tensor). weight_norm's g and v: dispatch normalises a weight in
        # slices of its dim (ops.weight_norms): rows for the default dim 0, as a linear's tiles are
        # cut; another dim is planned at slices of that dim (``weight_norm_slices``). A
        # parametrization of the user's own may read its original whole (an FFT of it, an op with
        # no slices and no host kernel): counted whole.
        return len(module) > 0 and (type(module[0]) is _WEIGHT_NORM or isinstance(module[0], _IN_PIECES))
    return isinstance(module, _TILED_MODULES + _IN_PIECES)


def weight_norm_slices(slots, shape: tuple) -> Optional[int]:
    """``Weight.norm_slices``: for weight_norm's ``v`` (or ``g``) over a dim other than 0 and other
    than every dim (wav2vec2's ``dim=2`` over kernel positions), the length of that dim. Dispatch
    normalises it in slices of that dim (ops.weight_norms), each ``nbytes // length`` bytes, not in
    tiles of its first two dims (one row of its first dim may be less than one slice of that dim).
    None otherwise."""
    counts = set()
    for module, attr in slots:
        if not isinstance(module, _PARAMETRIZATIONS) or not attr.startswith("original"):
            return None
        first = module[0] if len(module) else None
        if type(first) is not _WEIGHT_NORM or first.dim in (0, -1, None) or not shape:
            return None
        counts.add(shape[first.dim % len(shape)])
    return counts.pop() if len(counts) == 1 and min(counts) > 1 else None


def _conv_outputs(slots, shape: tuple) -> Optional[int]:
    """``Weight.conv_outputs``: the output channels of the torch.nn convolution(s) whose whole
    weight, of ``shape``, fills every one of ``slots``; else None (a shard of one, a DTensor's
    local tensor, keeps the rule of its first two dims)."""
    counts = set()
    for module, attr in slots:
        if not isinstance(module, _CONVS) or attr != "weight":
            return None
        kernel = tuple(module.kernel_size)
        rows, per_group = ((module.in_channels, module.out_channels) if module.transposed
                           else (module.out_channels, module.in_channels))
        if tuple(shape) != (rows, per_group // module.groups, *kernel):
            return None
        counts.add(module.out_channels)
    return counts.pop() if len(counts) == 1 and min(counts) > 0 else None


def compact_layout(t: torch.Tensor) -> torch.Tensor:
    """A dense copy of ``t``'s elements in its own memory order (strides sorted as ``t``'s are):
    the host master of a view whose storage range has gaps. Kernels then see the same
    transposition and order as for ``t`` itself."""
    order = sorted(range(t.dim()), key=lambda d: (t.stride(d), t.shape[d]))  # innermost first
    strides, step = [0] * t.dim(), 1
    for d in order:
        strides[d] = step
        step *= t.shape[d]
    out = torch.empty_strided(tuple(t.shape), strides, dtype=t.dtype, device=t.device)
    with torch.no_grad():
        out.copy_(t.detach())
    return out


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


def collect_groups(model: nn.Module, device: Optional[torch.device] = None) -> list:
    """Every parameter and buffer of ``model`` once, grouped by storage: a list of StorageGroups;
    with its plain tensor attributes that hold bytes on ``device`` or are offloaded (``_add_attributes``)."""
    members = {}
    fast = {}  # id(module) -> (path, class name) of the outermost module with a fused fast path holding it
    whole = {}  # id(module) -> bytes of every tensor of the _FUSED_PARENTS module holding it
    for prefix, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, _FAST_PATHS) and id(module) not in fast and _batch_first(module):
            for sub in module.modules():
                fast.setdefault(id(sub), (prefix, type(module).__name__))
        if isinstance(module, _FUSED_PARENTS):
            together = sum(tensor_bytes(t) for t in {id(t): t for t in [*module.parameters(), *module.buffers()]
                                                     if t.layout == torch.strided}.values())
            whole.update((id(sub), together) for sub in module.modules())
        _add_members(members, module, lambda attr, prefix=prefix: f"{prefix}.{attr}" if prefix else attr,
                     fast.get(id(module)), whole.get(id(module), 0))
    _add_aliases(members, model)
    _add_attributes(members, model, device)
    return _grouped(members)


def _add_aliases(members: dict, model: nn.Module) -> None:
    """Plain tensor attributes that view a registered tensor's storage, as Members beside it: the
    hook-based ``spectral_norm`` leaves ``module.weight = weight_orig.data`` until its first forward
    sets it again. Placed with that storage, such an alias becomes a view of the same host master
    where it is offloaded; left out, it kept the old device storage alive after the weight was
    offloaded, outside the budget wrap had planned (the next page-in found less room than none)."""
    keys = {_storage_key(m.tensor) for m in members.values() if not m.owners}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for attr, t in list(module.__dict__.items()):
            if (type(t) is torch.Tensor and t.grad_fn is None and t.layout == torch.strided and not t.is_meta
                    and id(t) not in members and _storage_key(t) in keys):
                member = members[id(t)] = Member(t)
                member.slots.append((module, attr, None))
                member.names.append(f"{prefix}.{attr}" if prefix else attr)


def _add_attributes(members: dict, model: nn.Module, device: Optional[torch.device]) -> None:
    """Plain tensor attributes of their own (not viewing a weight), as Members of groups of their
    own: a table a module computes at init (diffusers' QwenImage keeps its rope frequencies so, 512
    KiB at the tiny test size) holds device bytes that the budget must count. Those on ``device``
    of ``SMALL_BYTES`` or more are placed as weights are, resident or offloaded in place, as one
    assigned after wrapping is (``place.place_attribute``); left out, they stayed resident past a
    budget that wrap had accepted. The model's own code reads them, whole maybe, so each is planned
    paged whole. Offloaded ones are always collected, so that unwrap gives them back plain."""
    for prefix, module, attr, t in attribute_tensors(model):
        if id(t) in members:
            continue
        if not isinstance(t, OffloadedTensor):
            if (device is None or type(t) is not torch.Tensor or t.device != device
                    or t.numel() * t.element_size() < SMALL_BYTES):
                continue
        member = members[id(t)] = Member(t)
        member.slots.append((module, attr, None))
        member.names.append(f"{prefix}.{attr}" if prefix else attr)
        member.read_whole = t.numel() * t.element_size()


def attribute_tensors(model: nn.Module):
    """(module path, module, name, tensor) for tensors held as plain attributes (not Parameters or
    buffers, which nn.Module keeps out of ``__dict__``): weights computed after loading, like vLLM's
    W_UV, tables computed at init. Not those of parametrization functions
    (``_parametrization_functions``), found in the same walk: ``modules()`` lists a
    ParametrizationList before the functions it holds. Nor one autograd computed (it has a
    ``grad_fn``: ``moves.is_computed``)."""
    functions = set()
    for prefix, module in model.named_modules():
        if isinstance(module, parametrize.ParametrizationList):
            functions.update(_parametrization_functions(module))
        if module in functions:
            continue
        for name, t in module.__dict__.items():
            if isinstance(t, torch.Tensor) and not t.is_meta and t.layout == torch.strided and t.grad_fn is None:
                yield prefix, module, name, t


def _parametrization_functions(parametrizations: parametrize.ParametrizationList) -> set:
    """The modules ``torch.nn.utils.parametrize`` calls to compute a parametrized tensor from its
    ``original`` (each entry of ``parametrizations``), with their submodules. Their Parameters
    and buffers are weights like any (spectral_norm's ``_u``, placed and counted); a plain tensor
    attribute of theirs is an operand of that computation, which torch neither moves with the
    module nor saves: peft's summed LoRA delta for a ``target_parameters`` weight with several
    adapters active, built from the adapters at every forward and dropped after it. Such a tensor is
    what ops compute during a forward, counted as activations are (not in the weight budget)."""
    return {m for function in parametrizations for m in function.modules()}


def module_groups(module: nn.Module, name_of, skip=frozenset()) -> list:
    """``collect_groups`` of ``module``'s own tensors only (not its submodules'), each named
    ``name_of(attribute)``, leaving out the attributes in ``skip``. What an enclosing module adds
    (a fused fast path, a fused parent's whole read) is not seen."""
    members = {}
    _add_members(members, module, name_of, None, 0, skip)
    return _grouped(members)


def _add_members(members: dict, module: nn.Module, name_of, fast_path, read_whole: int, skip=frozenset()) -> None:
    """Each tensor of ``module``'s own (a wrapper subclass: each of its leaves) as a Member of
    ``members`` (id -> Member), with this slot and name added."""
    for table, is_buffer in ((module._parameters, False), (module._buffers, True)):
        for attr, t in table.items():
            if t is None or attr in skip:
                continue
            name = name_of(attr)
            for tensor, owner in _leaf_members(t, name):
                member = members.get(id(tensor))
                if member is None:
                    member = members[id(tensor)] = Member(tensor)
                member.fast_path = member.fast_path or fast_path
                member.read_whole = max(member.read_whole, read_whole)
                if (module, attr) not in [(m, a) for m, a, _ in member.slots]:
                    member.slots.append((module, attr, is_buffer))
                if name not in member.names:
                    member.names.append(name)
                if owner is not None and not any(o is owner[0] and a == owner[1] for o, a in member.owners):
                    member.owners.append(owner)


def _grouped(members: dict) -> list:
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
