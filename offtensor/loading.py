"""load_safetensors: fill a model built on meta straight from safetensors files, shard by shard.

Placement is planned from the meta shapes before a byte is read, so an offloaded weight goes from
the file into its exact-size host master and never touches the device, and a resident weight goes
from the file to the device. Every file header is checked against the model first (missing and
unexpected names, shapes, dtypes), so a bad checkpoint is refused before the model changes.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import torch
from torch import nn

from . import wrap
from .pager import Pager, resolve_device
from .tensor import OffloadedTensor, _master_for
from . import _ext

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def _shard_files(path) -> list:
    """The safetensors files behind ``path``: a file, a directory, or an ``*.index.json``."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"offtensor: no safetensors checkpoint at {path!r}: the path does not exist")
    if os.path.isdir(path):
        indexes = sorted(f for f in os.listdir(path) if f.endswith(".safetensors.index.json"))
        if indexes:
            return _shard_files(os.path.join(path, indexes[0]))
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"offtensor: directory {path!r} holds no *.safetensors file and no index")
        return files
    if path.endswith(".json"):
        with open(path) as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ValueError(f"offtensor: {path!r} is not a safetensors index (no weight_map): {e}") from None
        root = os.path.dirname(path)
        files = [os.path.join(root, name) for name in dict.fromkeys(weight_map.values())]
        missing = [f for f in files if not os.path.exists(f)]
        if missing:
            raise FileNotFoundError(f"offtensor: index {path!r} names shards that do not exist: {missing}")
        return files
    return [path]


def _headers(files) -> dict:
    """name -> (file, shape, dtype) for every tensor in every shard, without reading data."""
    from safetensors import safe_open

    entries = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                view = f.get_slice(name)
                dtype = _DTYPES.get(view.get_dtype())
                if name in entries:
                    raise ValueError(f"offtensor: tensor {name!r} is in both {entries[name][0]!r} and {file!r}")
                entries[name] = (file, tuple(view.get_shape()), dtype, view.get_dtype())
    return entries


def load_safetensors(model: nn.Module, path, budget_gb: Optional[float] = None, device=None, *,
                     offload_gb: Optional[float] = None, prefetch: bool = True, policy=None,
                     strict: bool = True) -> nn.Module:
    """Load ``model``'s weights (usually built on meta) from safetensors and wrap it for a budget.

    ``path`` is a ``.safetensors`` file, a directory of shards, or a ``*.safetensors.index.json``.
    Tied names need to be in the files once. With ``strict`` every weight the model lacks values
    for must be in the files and every tensor in the files must belong to the model.
    """
    wrap._check_wrappable(model, budget_gb, offload_gb)
    device = resolve_device(device)
    entries = _headers(_shard_files(path))
    groups = wrap._collect(model)

    sources = {}  # id(group) -> [(member, file name)]
    problems, missing, used = [], [], set()
    for group in groups:
        found = []
        for member in group:
            name = next((n for n in member.names if n in entries), None)
            if name is None:
                if member.tensor.is_meta:
                    missing.append(f"{member.names[0]} ({tuple(member.tensor.shape)}, {member.tensor.dtype})")
                continue
            used.update(n for n in member.names if n in entries)
            file, shape, dtype, dtype_name = entries[name]
            t = member.tensor
            if shape != tuple(t.shape):
                problems.append(f"{name}: the file has shape {shape}, the model expects {tuple(t.shape)}")
            elif dtype != t.dtype:
                problems.append(f"{name}: the file has dtype {dtype_name}, the model expects {t.dtype} "
                                f"({t.numel() * t.element_size()} bytes); build the model with the checkpoint's dtype")
            found.append((member, name))
        sources[id(group)] = found
    unexpected = sorted(set(entries) - used)
    if strict and unexpected:
        problems.append(f"the files hold {len(unexpected)} tensors the model does not have: {unexpected[:8]}"
                        f"{' ...' if len(unexpected) > 8 else ''} (pass strict=False to ignore them)")
    if missing:
        problems.append(f"the files lack {len(missing)} weights the model has no values for: {missing[:8]}"
                        f"{' ...' if len(missing) > 8 else ''}")
    if problems:
        raise ValueError("offtensor: cannot load " + os.fspath(path) + " into " + type(model).__name__ + ":\n  "
                         + "\n  ".join(problems))

    plan, by_weight = wrap._plan(groups, device, budget_gb, offload_gb, policy, prefetch)
    pager = Pager(device, plan.budget_bytes)
    offloaded = {id(by_weight[id(w)]) for w in plan.offload}
    targets = {}  # id(group) -> (member -> destination tensor)
    for group in groups:
        if not sources[id(group)]:
            # Not in the files but has values (a buffer computed at init): place it as wrap_model does.
            if id(group) in offloaded:
                wrap._offload_group(group, pager)
            else:
                wrap._make_resident(group, device)
            continue
        targets[id(group)] = _destinations(group, pager if id(group) in offloaded else None, device)

    # Shard by shard: each tensor is read once, straight into its master or onto the device.
    from safetensors import safe_open

    by_file = {}
    for group in groups:
        for member, name in sources[id(group)]:
            by_file.setdefault(entries[name][0], []).append((group, member, name))
    with torch.no_grad():
        for file, items in by_file.items():
            with safe_open(file, framework="pt") as f:
                for group, member, name in items:
                    dest = targets[id(group)][id(member)]
                    dest.copy_(f.get_tensor(name))
    for group in groups:
        if id(group) in targets:
            for member in group:
                dest = targets[id(group)][id(member)]
                wrap._swap(member, wrap._as_param_like(member.tensor, dest))
    wrap._register(model, pager, plan, policy, prefetch)
    return model


def _destinations(group, pager: Optional[Pager], device: torch.device) -> dict:
    """id(member) -> the tensor its values are loaded into: views of one new host master (offloaded)
    or of one device buffer (resident), laid out like the group's storage so aliases stay aliases."""
    first = group[0].tensor
    dense = len(group) == 1
    if dense:
        numel = first.numel()
        layouts = {id(first): (tuple(first.shape), None, 0)}  # the file's values are contiguous
    else:
        lo, hi = wrap._group_range(group)
        numel = hi - lo
        layouts = {id(m): (tuple(m.tensor.shape), m.tensor.stride(), m.tensor.storage_offset() - lo) for m in group}
    if pager is not None:
        raw = _ext.alloc_host(numel * first.element_size(), pin=pager.device.type == "cuda")
        flat = raw.view(first.dtype) if numel else torch.empty(0, dtype=first.dtype)
    else:
        flat = torch.empty(numel, dtype=first.dtype, device=device)
    out = {}
    master = _master_for(flat, pager) if pager is not None else None
    for member in group:
        shape, stride, offset = layouts[id(member.tensor)]
        view = flat.view(shape) if stride is None else flat.as_strided(shape, stride, offset)
        out[id(member)] = OffloadedTensor(view, master) if master is not None else view
    return out
