"""load_safetensors / from_pretrained: fill a model built on meta straight from safetensors files.

Placement is planned from the meta shapes before a byte is read, so an offloaded weight goes from
the file into its exact-size host master in one pass (``os.preadv`` into the master's memory, which
is allocated without a first touch: the read is what faults each page in, once), and a resident
weight goes from the file to the device through a reused staging buffer, the copy of one chunk
overlapping the read of the next. Several threads read at once; ``preadv`` releases the GIL.

Every file header is parsed here (8-byte little-endian length + JSON) and checked against the file
size and the model first (missing and unexpected names, shapes, dtypes, offsets), so a bad
checkpoint is refused before the model changes; a read that fails later also leaves it unchanged,
because tensors are swapped into the model only after every byte has arrived.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import stat
import sys
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Optional

import torch
from torch import nn

from . import _ext
from . import placement
from .config import OffloadConfig
from .expert_choice import choose_expert_placement
from .model.groups import StorageGroup
from .model.prepare import check_wrappable, prepare
from .pager import Pager, format_bytes, master_for, pins_host_memory, resolve_device
from .pager.device import for_device
from .tensor import OffloadedTensor

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
}
# safetensors refuses headers above 100 MB; a larger length field means a corrupt file.
_MAX_HEADER_BYTES = 100_000_000
# An index is a small JSON file (one line per tensor); a larger one is not an index.
_MAX_INDEX_BYTES = 100_000_000
# One read or one staged copy moves at most this much, so threads share big tensors and the
# staging buffers stay small.
CHUNK_BYTES = 32 << 20
STAGING_SLOTS = 2
# Loads at least this large show a progress bar when OffloadConfig.progress is None (the default).
PROGRESS_MIN_BYTES = 256 << 20


class CheckpointError(ValueError):
    """A checkpoint file is unreadable, or does not fit the model; nothing was changed."""


# ---------------------------------------------------------------------------- files and headers


class _FileTensor:
    """One tensor's entry in a safetensors header: where its bytes lie in the file."""

    __slots__ = ("file", "key", "dtype", "dtype_name", "shape", "begin", "nbytes")

    def __init__(self, file, key, dtype, dtype_name, shape, begin, nbytes):
        self.file, self.key, self.dtype, self.dtype_name = file, key, dtype, dtype_name
        self.shape, self.begin, self.nbytes = shape, begin, nbytes


def _open_regular(path, what: str) -> int:
    """A read-only descriptor of ``path``, refused unless it is a regular file: a FIFO, a device or
    a socket named as a checkpoint would block a read or never end. ``O_NONBLOCK`` makes opening a
    FIFO return at once (so it can be refused) and changes nothing for a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        raise CheckpointError(f"offtensor: cannot open {what} {os.fspath(path)!r}: {e}") from None
    try:
        mode = os.fstat(fd).st_mode
    except OSError as e:
        os.close(fd)
        raise CheckpointError(f"offtensor: cannot stat {what} {os.fspath(path)!r}: {e}") from None
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode)
                else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
        raise CheckpointError(f"offtensor: {what} {os.fspath(path)!r} is {kind}, not a regular file: refusing to read it")
    return fd


def _read_exactly(fd: int, offset: int, count: int) -> bytes:
    """``count`` bytes at ``offset`` (fewer only at the end of the file)."""
    parts, done = [], 0
    while done < count:
        chunk = os.pread(fd, min(count - done, 1 << 26), offset + done)
        if not chunk:
            break
        parts.append(chunk)
        done += len(chunk)
    return b"".join(parts)


class _DuplicateKey(ValueError):
    pass


def _object_without_duplicates(pairs):
    """json object_pairs_hook: a key given twice is refused (json keeps the last silently)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return out


# A \uD800-\uDFFF escape: json decodes an unpaired one into a lone surrogate, which is not text
# (serde_json refuses it). Only texts holding one are checked in full.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _no_constant(name):
    raise ValueError(f"{name} is not JSON")


def _parse_json(raw: bytes, file, what: str):
    """The JSON value in ``raw``, parsed as safetensors parses headers: UTF-8 only (``json.loads`` of
    bytes would also take UTF-16 and UTF-32), no key twice in an object, no NaN or Infinity, no
    unpaired surrogate escape. Every failure is a CheckpointError naming ``file``."""
    name = os.fspath(file)
    try:
        text = raw.decode("utf-8")  # strict: invalid bytes, a UTF-16 text or stray surrogates fail
    except UnicodeDecodeError as e:
        raise CheckpointError(f"offtensor: the {what} of {name!r} is not UTF-8 ({e}); safetensors headers and "
                              f"indexes are UTF-8 JSON: the file is corrupt") from None
    try:
        value = json.loads(text, object_pairs_hook=_object_without_duplicates, parse_constant=_no_constant)
    except _DuplicateKey as e:
        raise CheckpointError(f"offtensor: the {what} of {name!r} gives the key {e.args[0]!r} twice (JSON would keep "
                              f"only the last one): the file is corrupt") from None
    except RecursionError:
        raise CheckpointError(f"offtensor: the {what} of {name!r} is nested deeper than any safetensors {what} "
                              f"(a {len(raw)}-byte JSON of nested arrays or objects): the file is corrupt") from None
    except ValueError as e:  # JSONDecodeError, and ints longer than Python's digit limit
        raise CheckpointError(f"offtensor: the {len(raw)}-byte {what} of {name!r} is not a safetensors JSON {what} "
                              f"({e}): the file is corrupt") from None
    if _SURROGATE_ESCAPE.search(text):
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise CheckpointError(f"offtensor: the {what} of {name!r} holds an unpaired UTF-16 surrogate escape "
                                  f"(\\uD800-\\uDFFF), which is not text: the file is corrupt") from None
        except RecursionError:
            raise CheckpointError(f"offtensor: the {what} of {name!r} is nested deeper than any safetensors "
                                  f"{what}: the file is corrupt") from None
    return value


def _read_index(path) -> dict:
    """The ``weight_map`` of a safetensors index: tensor name -> shard file name, both strings."""
    fd = _open_regular(path, "safetensors index")
    try:
        size = os.fstat(fd).st_size
        if size > _MAX_INDEX_BYTES:
            raise CheckpointError(f"offtensor: {path!r} is {size} bytes, larger than any safetensors index "
                                  f"(at most {_MAX_INDEX_BYTES}): it is not an index")
        raw = _read_exactly(fd, 0, size)
    finally:
        os.close(fd)
    index = _parse_json(raw, path, "index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        got = f"is a JSON {type(index).__name__}" if not isinstance(index, dict) else (
            "has no weight_map" if "weight_map" not in index
            else f"has a weight_map that is a JSON {type(weight_map).__name__}")
        raise CheckpointError(f"offtensor: {path!r} is not a safetensors index: an index is a JSON object whose "
                              f"weight_map maps tensor names to shard files, this one {got}")
    bad = [(k, v) for k, v in weight_map.items() if not isinstance(v, str) or not v]
    if bad:
        raise CheckpointError(f"offtensor: index {path!r} maps {len(bad)} tensors to something other than a shard file "
                              f"name, e.g. {bad[0][0]!r} -> {bad[0][1]!r}: the index is corrupt")
    return weight_map


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def _shard_path(root: str, name: str, index, allow_outside_paths: bool) -> str:
    """The shard an index names, kept inside the index's directory unless ``allow_outside_paths``:
    no absolute path, no ``..``, and no symlink that resolves outside it, except the
    huggingface_hub cache layout, where ``snapshots/<rev>/<file>`` links to ``../../blobs/<hash>``."""
    if "\x00" in name:
        raise CheckpointError(f"offtensor: index {index!r} names a shard {name!r} with a NUL byte: the index is corrupt")
    if allow_outside_paths:
        return os.path.join(root, name)
    escape = None
    if os.path.isabs(name):
        escape = "is an absolute path"
    elif ".." in name.replace(os.sep, "/").split("/"):
        escape = "climbs out with '..'"
    path = os.path.join(root, name)
    if escape is None:
        real_root = os.path.realpath(root or ".")
        real = os.path.realpath(path)
        allowed = [real_root]
        parent = os.path.dirname(os.path.abspath(root or "."))
        if os.path.basename(parent) == "snapshots":  # huggingface_hub: <repo>/snapshots/<rev> -> <repo>/blobs
            allowed.append(os.path.realpath(os.path.join(parent, os.pardir, "blobs")))
        if not any(_inside(real, a) for a in allowed):
            escape = f"resolves through a symlink to {real!r}"
    if escape is not None:
        raise CheckpointError(
            f"offtensor: index {index!r} names the shard {name!r}, which {escape}, outside the checkpoint directory "
            f"{root or '.'!r}; pass allow_outside_paths=True to load shards from elsewhere if you trust this index"
        )
    return path


def _shard_files(path, allow_outside_paths: bool = False) -> list:
    """The safetensors files behind ``path``: a file, a directory, or an ``*.index.json``."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"offtensor: no safetensors checkpoint at {path!r}: the path does not exist")
    if os.path.isdir(path):
        indexes = sorted(f for f in os.listdir(path) if f.endswith(".safetensors.index.json"))
        if indexes:
            return _shard_files(os.path.join(path, indexes[0]), allow_outside_paths)
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"offtensor: directory {path!r} holds no *.safetensors file and no index")
        return files
    if path.endswith(".json"):
        weight_map = _read_index(path)
        root = os.path.dirname(path)
        by_name = {name: _shard_path(root, name, path, allow_outside_paths) for name in dict.fromkeys(weight_map.values())}
        files = list(by_name.values())
        missing = [f for f in files if not os.path.exists(f)]
        if missing:
            lost = [name for name, file in weight_map.items() if by_name[file] in missing]
            raise FileNotFoundError(
                f"offtensor: index {path!r} names shards that do not exist: {missing}; they hold {len(lost)} tensors, "
                f"e.g. {lost[:4]}. Download the missing shards or point at a complete checkpoint."
            )
        return files
    return [path]


_COUNT_LIMIT = 1 << 63  # torch sizes are int64


def read_header(file) -> dict:
    """key -> _FileTensor for every tensor of one safetensors file, checked as safetensors checks
    it (and a little more), without reading any tensor data: UTF-8 JSON with no key twice, a
    string -> string ``__metadata__``, known dtypes, shapes and offsets of non-negative ints, each
    tensor's bytes matching its shape and dtype, and the tensors tiling the data section exactly:
    no overlap, no gap, nothing after the last one."""
    header, size, header_bytes = _read_header_json(file)
    data_start = 8 + header_bytes
    data_bytes = size - data_start
    entries = {}
    for key, info in header.items():
        if key == "__metadata__":
            # safetensors: an optional map of strings to strings (null is its "absent").
            if info is not None and not (isinstance(info, dict) and all(isinstance(v, str) for v in info.values())):
                bad = (f"a JSON {type(info).__name__}" if not isinstance(info, dict) else
                       "{" + ", ".join(f"{k!r}: {v!r}" for k, v in info.items() if not isinstance(v, str))[:200] + "}")
                raise CheckpointError(f"offtensor: the __metadata__ of {file!r} must map strings to strings (as "
                                      f"safetensors requires), it is {bad}: the file is corrupt")
            continue
        entries[key] = _header_entry(file, key, info, data_start, data_bytes)
    _check_tiling(file, entries, data_start, size)
    return entries


def _read_header_json(file):
    """(the parsed JSON header, the file's size, the header's length) of a safetensors file."""
    fd = _open_regular(file, "safetensors file")
    try:
        size = os.fstat(fd).st_size
        head = _read_exactly(fd, 0, 8)
        if len(head) < 8:
            raise CheckpointError(f"offtensor: {file!r} is {size} bytes, too short for the 8-byte header length of a "
                                  f"safetensors file: it is truncated or not a safetensors file")
        header_bytes = int.from_bytes(head, "little")
        if header_bytes > min(size - 8, _MAX_HEADER_BYTES):
            raise CheckpointError(
                f"offtensor: {file!r} says its header is {header_bytes} bytes, but the file has {size - 8} bytes after "
                f"the length field (and headers are at most {_MAX_HEADER_BYTES}): the file is truncated or corrupt"
            )
        raw = _read_exactly(fd, 8, header_bytes)
    finally:
        os.close(fd)
    if len(raw) < header_bytes:
        raise CheckpointError(f"offtensor: {file!r} ended after {len(raw)} of its {header_bytes} header bytes: "
                              f"the file was truncated while being read")
    header = _parse_json(raw, file, "header")
    if not isinstance(header, dict):
        raise CheckpointError(f"offtensor: the {header_bytes}-byte header of {file!r} is not a safetensors JSON "
                              f"header (the header is a JSON {type(header).__name__}, not an object): the file is corrupt")
    return header, size, header_bytes


def _header_entry(file, key: str, info, data_start: int, data_bytes: int) -> "_FileTensor":
    """One tensor's header entry, checked: known dtype, non-negative int shape and offsets, bytes
    matching shape and dtype, inside the data section."""
    try:
        dtype_name, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    except (KeyError, TypeError):
        raise CheckpointError(f"offtensor: tensor {key!r} in {file!r} has a malformed header entry {info!r:.200}: "
                              f"an entry is an object with dtype, shape and data_offsets: the file is corrupt") from None
    dtype = _DTYPES.get(dtype_name) if type(dtype_name) is str else None
    if dtype is None:
        if type(dtype_name) is not str:
            raise CheckpointError(f"offtensor: tensor {key!r} in {file!r} has dtype {dtype_name!r:.200}, not a "
                                  f"dtype name: the file is corrupt")
        raise CheckpointError(f"offtensor: tensor {key!r} in {file!r} has dtype {dtype_name!r}, which offtensor "
                              f"cannot load (known: {sorted(_DTYPES)})")
    # Integers that fit safetensors' usize and torch's int64; a JSON true is not a 1 here,
    # though Python's bool is an int.
    numel = 1
    if type(shape) is list:
        for d in shape:
            if type(d) is not int or not 0 <= d < _COUNT_LIMIT:
                numel = -1
                break
            numel *= d
    if type(shape) is not list or numel < 0:
        raise CheckpointError(f"offtensor: tensor {key!r} in {file!r} has shape {shape!r:.200}: the file is corrupt")
    if type(offsets) is not list or len(offsets) != 2 or type(offsets[0]) is not int \
            or type(offsets[1]) is not int or not 0 <= offsets[0] <= offsets[1] < _COUNT_LIMIT:
        raise CheckpointError(f"offtensor: tensor {key!r} in {file!r} has data offsets {offsets!r:.200}: "
                              f"the file is corrupt")
    begin, end = offsets
    where = f"tensor {key!r} in {file!r}"
    nbytes = numel * dtype.itemsize
    if end - begin != nbytes:
        raise CheckpointError(
            f"offtensor: {where} spans bytes [{begin}, {end}) = {end - begin} bytes of the data section, but its "
            f"shape {tuple(shape)} in {dtype_name} needs {nbytes} bytes: the file is corrupt"
        )
    if end > data_bytes:
        raise CheckpointError(
            f"offtensor: {where} ({nbytes} bytes) lies at bytes [{begin}, {end}) of the data section, past the "
            f"end of the file ({data_bytes} bytes of data): the file is truncated"
        )
    return _FileTensor(file, key, dtype, dtype_name, tuple(shape), data_start + begin, nbytes)


def _check_tiling(file, entries: dict, data_start: int, size: int) -> None:
    """The tensors tile the data section exactly, in offset order (safetensors' validate): an
    overlap would give two tensors the same bytes, a gap or trailing bytes mean the header and data
    disagree. Empty tensors at the same offset share no byte and are accepted, as safetensors
    accepts them."""
    at, previous = data_start, None
    for e in sorted(entries.values(), key=lambda e: (e.begin, e.begin + e.nbytes)):
        if e.begin != at:
            span = f"{e.key!r} at bytes [{e.begin - data_start}, {e.begin - data_start + e.nbytes})"
            if previous is None:
                problem = f"the data section starts with {e.begin - data_start} bytes that belong to no tensor before {span}"
            elif e.begin < at:
                problem = (f"{span} overlaps {previous.key!r} at bytes [{previous.begin - data_start}, "
                           f"{at - data_start}): two tensors would share bytes")
            else:
                problem = (f"bytes [{at - data_start}, {e.begin - data_start}) between {previous.key!r} and {span} "
                           f"belong to no tensor")
            raise CheckpointError(f"offtensor: in {file!r}, {problem}; safetensors refuses such a file: it is corrupt")
        at, previous = e.begin + e.nbytes, e
    if at != size:
        after = f"the last tensor, {previous.key!r}," if previous is not None else "the header"
        raise CheckpointError(f"offtensor: {file!r} has {size - at} bytes after {after} that belong to no tensor; "
                              f"safetensors refuses such a file: it is corrupt or was written by another tool")


def _headers(files) -> dict:
    """key -> _FileTensor over every shard; a key in two shards is refused."""
    entries = {}
    for file in files:
        for key, entry in read_header(file).items():
            if key in entries:
                raise CheckpointError(f"offtensor: tensor {key!r} is in both {entries[key].file!r} and {file!r}")
            entries[key] = entry
    return entries


# ---------------------------------------------------------------------------- names: file -> model


class _Piece:
    """A file tensor and the part of a model tensor it fills: the whole tensor, or (for checkpoints
    that store stacked experts one by one) ``target[index]``, narrowed along ``dim`` to
    ``[offset, offset + length)`` when several file tensors are concatenated into one."""

    __slots__ = ("source", "target", "index", "part", "dim", "offset")

    def __init__(self, source: _FileTensor, target: str, index=None, part=0, dim=None):
        self.source, self.target, self.index, self.part, self.dim = source, target, index, part, dim
        self.offset = 0

    def region(self, t: torch.Tensor) -> torch.Tensor:
        if self.index is None:
            return t
        t = t[self.index]
        return t if self.dim is None else t.narrow(self.dim, self.offset, self.source.shape[self.dim])

    def describe(self) -> str:
        return f"{self.source.key!r} in {self.source.file!r}"


class _Conversions:
    """The key renamings and expert stackings transformers applies to a checkpoint of this model
    (``save_pretrained`` writes Mixtral / DeepSeek / Qwen-MoE experts one tensor per expert, the
    models hold them stacked). Only renames and stack-then-concatenate are understood; anything
    else is reported, never guessed."""

    def __init__(self, model: nn.Module):
        self.renames, self.stacks, self.unsupported = [], [], []
        try:
            from transformers import PreTrainedModel
            from transformers import conversion_mapping
        except ImportError:
            return  # no transformers, or one from before checkpoint conversions (v4): names are used as they are
        if not isinstance(model, PreTrainedModel):
            return
        try:
            if hasattr(conversion_mapping, "get_model_conversion_mapping"):
                transforms = conversion_mapping.get_model_conversion_mapping(model)
            else:
                transforms = conversion_mapping.get_checkpoint_conversion_mapping(model.config.model_type) or []
        except Exception as e:  # an API change in transformers: say so instead of failing the load
            self.unsupported.append(f"transformers' conversion mapping could not be read ({e})")
            return
        for t in transforms:
            ops = [type(op).__name__ for op in getattr(t, "operations", ())]
            sources, targets = list(t.source_patterns), list(t.target_patterns)
            scope = getattr(t, "scope_prefix", None) or ""
            if not ops:
                for i, source in enumerate(sources):  # several sources may share one target
                    self.renames.append((scope, re.compile(source), targets[min(i, len(targets) - 1)]))
            elif ops[0] == "MergeModulelist" and len(targets) == 1 and (
                len(ops) == 1 or (len(ops) == 2 and ops[1] == "Concatenate")
            ):
                if getattr(t.operations[0], "dim", 0) != 0:
                    self.unsupported.append(f"{sources} -> {targets}: MergeModulelist(dim={t.operations[0].dim})")
                    continue
                cat_dim = t.operations[1].dim - 1 if len(ops) == 2 else None  # dims of one expert's slice
                patterns = [re.compile(re.escape(s).replace(r"\*", r"(\d+)")) for s in sources]
                self.stacks.append((scope, patterns, targets[0], cat_dim))
            else:
                self.unsupported.append(f"{sources} -> {targets}: {ops}")

    def piece(self, source: _FileTensor, model_names) -> Optional[_Piece]:
        key = source.key
        for scope, pattern, replacement in self.renames:
            if key.startswith(scope):
                key = pattern.sub(replacement, key)
        if key in model_names:
            return _Piece(source, key)
        for scope, patterns, target, cat_dim in self.stacks:
            if not key.startswith(scope):
                continue
            for part, pattern in enumerate(patterns):
                m = pattern.search(key)
                if m is not None:
                    name = key[: m.start()] + target + key[m.end():]
                    if name in model_names:
                        return _Piece(source, name, index=int(m.group(1)), part=part, dim=cat_dim)
        return None


def _match(entries: dict, model: nn.Module, groups, convert_dtypes: bool, path, strict: bool):
    """name of each model tensor -> its pieces, and the problems found (all of them, not the first)."""
    members = {}  # model name -> (group, member)
    for group in groups:
        for member in group:
            for name in member.names:
                members[name] = (group, member)
    conversions = None
    pieces: dict = {}
    unmatched = []
    for key, source in entries.items():
        if key in members:
            pieces.setdefault(key, []).append(_Piece(source, key))
            continue
        if conversions is None:
            conversions = _Conversions(model)
        piece = conversions.piece(source, members)
        if piece is None:
            unmatched.append(key)
        else:
            pieces.setdefault(piece.target, []).append(piece)

    # transformers models name checkpoint tensors they deliberately skip (DeepSeek-V3's MTP layer 61).
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    unmatched = [k for k in unmatched if not any(p.search(k) for p in ignored)]
    problems, missing = [], []
    chosen = {}  # id(member) -> (member, [pieces])
    for group in groups:
        for member in group:
            names = [n for n in member.names if n in pieces]
            if not names:
                if member.tensor.is_meta:
                    t = member.tensor
                    missing.append(f"{member.names[0]} ({tuple(t.shape)}, {t.dtype}, {t.numel() * t.element_size()} bytes)")
                continue
            # Tied names stored more than once: the first is read, the others are only known.
            chosen[id(member)] = (member, pieces[names[0]])
            problems += _check_pieces(names[0], member.tensor, pieces[names[0]], convert_dtypes)
    if strict and unmatched:
        problems.append(f"the files hold {len(unmatched)} tensors the model does not have: {sorted(unmatched)[:8]}"
                        f"{' ...' if len(unmatched) > 8 else ''} (pass strict=False to ignore them)")
    if missing:
        problems.append(f"the files lack {len(missing)} weights the model has no values for: {missing[:8]}"
                        f"{' ...' if len(missing) > 8 else ''}")
    if conversions is not None and conversions.unsupported and (unmatched or missing):
        problems.append(f"transformers converts this checkpoint with steps offtensor does not do: "
                        f"{conversions.unsupported[:4]}")
    named = [n for n in members if members[n][1].tensor.is_meta]
    found = sum(1 for n in named if n in pieces)
    if named and found < len(named) / 2:
        problems.append(f"only {found} of the model's {len(named)} weights are in {os.fspath(path)!r}: it looks like "
                        f"a checkpoint of another architecture (file: {sorted(entries)[:3]}, model: {named[:3]})")
    return chosen, problems


def _check_pieces(name, t: torch.Tensor, pieces, convert_dtypes: bool) -> list:
    problems = []
    model_bytes = t.numel() * t.element_size()
    for p in pieces:
        s = p.source
        if s.dtype != t.dtype and not (convert_dtypes and s.dtype.is_floating_point and t.dtype.is_floating_point):
            problems.append(f"{name}: {p.describe()} has dtype {s.dtype_name} ({s.nbytes} bytes), the model expects "
                            f"{t.dtype} ({model_bytes} bytes); build the model with the checkpoint's dtype")
            return problems
    if len(pieces) == 1 and pieces[0].index is None:
        s = pieces[0].source
        if s.shape != tuple(t.shape):
            problems.append(f"{name}: {pieces[0].describe()} has shape {s.shape} ({s.nbytes} bytes), the model "
                            f"expects {tuple(t.shape)} ({model_bytes} bytes)")
        return problems
    # Stacked from per-expert tensors: every (expert, part) once, parts laid end to end along dim.
    if any(p.index is None for p in pieces) or t.dim() == 0:
        return [f"{name}: {len(pieces)} file tensors map onto it ({[p.describe() for p in pieces[:3]]})"]
    by_part: dict = {}
    for p in pieces:
        by_part.setdefault(p.part, {}).setdefault(p.index, []).append(p)
    experts = t.shape[0]
    slice_shape = tuple(t.shape[1:])
    offset = 0
    for part in sorted(by_part):
        got = by_part[part]
        bad = sorted(i for i, ps in got.items() if len(ps) > 1 or not 0 <= i < experts)
        if bad or len(got) != experts:
            return [f"{name} ({experts} experts): the files give part {part} for experts {sorted(got)[:8]}"
                    f"{' ...' if len(got) > 8 else ''}; each expert must appear exactly once"]
        shapes = {ps[0].source.shape for ps in got.values()}
        dim = got[0][0].dim
        width = next(iter(shapes))[dim] if dim is not None and len(shapes) == 1 else None
        for ps in got.values():
            ps[0].offset = offset
        expected = slice_shape if dim is None else slice_shape[:dim] + (width,) + slice_shape[dim + 1:]
        if len(shapes) != 1 or next(iter(shapes)) != expected:
            return [f"{name}: expert tensors such as {got[0][0].describe()} have shapes {sorted(shapes)[:3]}, "
                    f"the model's {tuple(t.shape)} ({model_bytes} bytes) needs {expected}"]
        offset += width or 0
    dim = pieces[0].dim
    if dim is not None and offset != slice_shape[dim]:
        problems.append(f"{name}: the parts {sorted(by_part)} concatenate to {offset} along dim {dim + 1}, the model "
                        f"has {slice_shape[dim]} ({tuple(t.shape)}, {model_bytes} bytes)")
    return problems


def _architecture_problem(model: nn.Module, files) -> Optional[str]:
    """The config.json beside the files names another model type than the model's config."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    config_file = os.path.join(os.path.dirname(os.path.abspath(files[0])), "config.json")
    if not model_type or not os.path.exists(config_file):
        return None
    try:
        fd = _open_regular(config_file, "config")  # never blocks on a FIFO named config.json
        try:
            theirs = json.loads(_read_exactly(fd, 0, os.fstat(fd).st_size)).get("model_type")
        finally:
            os.close(fd)
    except (OSError, ValueError, AttributeError, RecursionError):  # CheckpointError is a ValueError
        return None
    if theirs and theirs != model_type:
        return (f"{config_file!r} describes a {theirs!r} checkpoint but the model is a {model_type!r} "
                f"({type(model).__name__}): load it into a {theirs} model (ot.from_pretrained builds the right one)")
    return None


# ---------------------------------------------------------------------------- progress


class _Progress:
    """Bytes read so far, shown with tqdm when the load is large enough (thread-safe)."""

    def __init__(self, total: int, enabled: Optional[bool], what: str):
        """``enabled``: True, False, or None for loads of ``PROGRESS_MIN_BYTES`` or more."""
        self.total, self.start = total, time.perf_counter()
        if enabled is None:
            enabled = total >= PROGRESS_MIN_BYTES
        self.enabled = enabled
        self.bar = None
        self.lock = threading.Lock()
        if enabled:
            from ._optional import optional_import

            tqdm_auto = optional_import("tqdm.auto", "progress bars")
            if tqdm_auto is None:
                return  # a one-line summary is printed at the end instead
            tqdm = tqdm_auto.tqdm
            # unit_scale with base 1000 turns B/s into MB/s and GB/s, the units the README uses.
            self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc=what, leave=False,
                            dynamic_ncols=True)

    def update(self, nbytes: int) -> None:
        if self.bar is not None:
            with self.lock:
                self.bar.update(nbytes)

    def close(self, ok: bool) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.enabled and ok:
            seconds = max(time.perf_counter() - self.start, 1e-9)
            print(f"offtensor: loaded {format_bytes(self.total)} in {seconds:.2f} s "
                  f"({self.total / seconds / 1e9:.2f} GB/s)", file=sys.stderr)


# ---------------------------------------------------------------------------- reading


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a 1-D uint8 view of the same memory."""
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def _pread_into(fd: int, offset: int, dst: torch.Tensor, what) -> None:
    """Reads ``dst.numel()`` bytes at ``offset`` straight into the CPU uint8 tensor ``dst``."""
    view = memoryview(dst.numpy()).cast("B")
    done = 0
    while done < len(view):
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except OSError as e:
            raise CheckpointError(f"offtensor: reading {what()} failed at byte {offset + done} of its file, "
                                  f"{len(view) - done} of {len(view)} bytes still to read: {e}") from e
        if n == 0:
            raise CheckpointError(f"offtensor: reading {what()} stopped at byte {offset + done} of its file, "
                                  f"{len(view) - done} of {len(view)} bytes short: the file was truncated while loading")
        done += n


def _stages_resident(device: torch.device) -> bool:
    """Whether resident weights go through the staging buffers. On the emulated device the device's
    memory is host memory, so a read lands in it directly; tests force staging there to run the GPU
    path's pipeline (same slots, same copy engine, same waits)."""
    return device.type != "cpu"


class _Reader:
    """Reads pieces into their destinations with a pool of threads. Offloaded destinations (CPU,
    contiguous) are read into directly; device destinations go through ``STAGING_SLOTS`` reused
    (pinned on a GPU) staging buffers, each chunk's copy overlapping the next chunk's read."""

    def __init__(self, device: torch.device, threads: int, progress: _Progress):
        self.device, self.threads, self.progress = device, threads, progress
        self.staged = _stages_resident(device)
        self.fds: dict = {}
        self.jobs: list = []
        # Staged copies go through the pager's device layer, the one owner of copies on a side stream
        # (pager/device.py says why): a copy, then a wait before the staging buffer is reused.
        self.copies = for_device(device, strict=False)
        self.slots: Optional[queue.Queue] = None
        self.submit_lock = threading.Lock()
        self.pin_lock = threading.Lock()
        self.pending_pins: dict = {}  # id(raw) -> [chunks left, raw]

    def fd(self, file) -> int:
        if file not in self.fds:
            self.fds[file] = _open_regular(file, "safetensors file")  # still a regular file, never a FIFO
        return self.fds[file]

    def add(self, piece: _Piece, dest: torch.Tensor, offloaded: bool, pin_after: Optional[torch.Tensor] = None) -> None:
        """Schedule ``piece`` into ``dest``, its region of a host master (``offloaded``) or of a
        device tensor. ``pin_after``: the master's allocation, pinned once all its pieces are in."""
        s, what = piece.source, piece.describe
        self.fd(s.file)  # opened here, on one thread, so the jobs only look it up
        if not dest.is_contiguous() or dest.dtype != s.dtype:
            self._expect(pin_after, 1)
            self.jobs.append(lambda: self._read_converted(s, dest, what, pin_after))
        elif not offloaded and self.staged:
            self._add_staged(s, _as_bytes(dest), what)
        else:
            target = _as_bytes(dest)
            chunks = range(0, s.nbytes, CHUNK_BYTES)
            self._expect(pin_after, len(chunks))
            for lo in chunks:
                hi = min(lo + CHUNK_BYTES, s.nbytes)
                self.jobs.append(self._direct_job(s, target[lo:hi], lo, what, pin_after))

    def _expect(self, raw: Optional[torch.Tensor], jobs: int) -> None:
        if raw is not None:
            self.pending_pins.setdefault(id(raw), [0, raw])[0] += jobs

    def _direct_job(self, s, target, lo, what, pin_after):
        def job():
            _pread_into(self.fd(s.file), s.begin + lo, target, what)
            self.progress.update(target.numel())
            if pin_after is not None:
                self._chunk_done(pin_after)
        return job

    def _chunk_done(self, raw: torch.Tensor) -> None:
        with self.pin_lock:
            entry = self.pending_pins[id(raw)]
            entry[0] -= 1
            last = entry[0] == 0
        if last:
            _ext.pin_host(raw)  # filled: registering now only locks the pages, it does not fault them

    def _add_staged(self, s: _FileTensor, target: torch.Tensor, what) -> None:
        if self.slots is None:
            self.slots = queue.Queue()
            pin = pins_host_memory(self.device)
            for _ in range(STAGING_SLOTS):
                self.slots.put((_ext.alloc_host(CHUNK_BYTES, pin=pin), None))
        for lo in range(0, s.nbytes, CHUNK_BYTES):
            hi = min(lo + CHUNK_BYTES, s.nbytes)
            self.jobs.append(self._staged_job(s, target[lo:hi], lo, what))

    def _staged_job(self, s, target, lo, what):
        def job():
            buf, ticket = self.slots.get()
            try:
                if ticket is not None:
                    self.copies.block(ticket)  # the slot's previous copy has left it
                    ticket = None
                chunk = buf[: target.numel()]
                _pread_into(self.fd(s.file), s.begin + lo, chunk, what)
                with self.submit_lock:
                    ticket = self.copies.load_copy(target, chunk)
            finally:
                self.slots.put((buf, ticket))
            self.progress.update(target.numel())
        return job

    def _read_converted(self, s: _FileTensor, dest: torch.Tensor, what, pin_after) -> None:
        """A destination that is strided, of another dtype, or not on the CPU: read into a temporary
        of the file's layout, then one ``copy_`` converts and places it."""
        raw = _ext.alloc_host(s.nbytes, pin=False, touch=False)
        for lo in range(0, s.nbytes, CHUNK_BYTES):
            hi = min(lo + CHUNK_BYTES, s.nbytes)
            _pread_into(self.fd(s.file), s.begin + lo, raw[lo:hi], what)
            self.progress.update(hi - lo)
        values = raw.view(s.dtype).view(s.shape) if s.nbytes else torch.empty(s.shape, dtype=s.dtype)
        with torch.no_grad():
            dest.copy_(values)
        if pin_after is not None:
            self._chunk_done(pin_after)

    def run(self) -> None:
        try:
            if self.threads <= 1 or len(self.jobs) <= 1:
                for job in self.jobs:
                    job()
            else:
                with ThreadPoolExecutor(self.threads, thread_name_prefix="offtensor-load") as pool:
                    futures = [pool.submit(job) for job in self.jobs]
                    done, _ = wait(futures, return_when=FIRST_EXCEPTION)
                    failed = next((f for f in done if f.exception() is not None), None)
                    if failed is not None:
                        for f in futures:
                            f.cancel()
                        raise failed.exception()
            self.drain()
        finally:
            self.discard()

    def discard(self) -> None:
        """Close the files and drop the jobs. Each job's closure holds this reader and a view of its
        destination (a cycle): dropped here, a failed load frees the memory it allocated at once
        rather than at the next garbage collection."""
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
        self.jobs.clear()
        self.pending_pins.clear()

    def drain(self) -> None:
        """Waits for every staged copy, so the staging buffers and the device tensors are settled."""
        if self.slots is None:
            return
        held = [self.slots.get() for _ in range(STAGING_SLOTS)]
        for buf, ticket in held:
            if ticket is not None:
                self.copies.block(ticket)
        for buf, _ in held:
            self.slots.put((buf, None))


# ---------------------------------------------------------------------------- public API


def load_safetensors(model: nn.Module, path, budget_gb: Optional[float] = None, device=None, *,
                     offload_gb: Optional[float] = None, prefetch: bool = True, policy=None,
                     strict: bool = True, progress: Optional[bool] = None, threads: Optional[int] = None,
                     convert_dtypes: bool = False, allow_outside_paths: bool = False, routing=None) -> nn.Module:
    """Load ``model``'s weights (usually built on meta) from safetensors and wrap it for a budget.

    ``path`` is a ``.safetensors`` file, a directory of shards, or a ``*.safetensors.index.json``.
    Tied names need to be in the files once. With ``strict`` every weight the model lacks values
    for must be in the files and every tensor in the files must belong to the model.
    ``progress``: None shows a bar for loads of at least 256 MB (``OFFTENSOR_PROGRESS=0`` silences
    it, ``=1`` forces it), True/False force it. ``threads``: readers (default: the CPU count, 4..8,
    since they mostly wait on page faults; ``OFFTENSOR_LOAD_THREADS``). ``convert_dtypes``: floating
    tensors of another dtype in the files are converted to the model's instead of refused.
    ``allow_outside_paths``: an index may name shards outside its own directory (absolute paths,
    ``..``, symlinks leading elsewhere); by default such an index is refused, except for
    huggingface_hub's cache layout (``snapshots/<rev>/*`` linking to ``../../blobs``). The
    placement arguments, ``progress`` and ``threads`` make an ``OffloadConfig``; ``routing`` (an MoE
    model's measured routing, as for ``wrap_model``) decides the expert placement before any byte
    is read, else the loaded model decides from its own routing.
    """
    check_wrappable(model)
    config = OffloadConfig.from_arguments(budget_gb=budget_gb, offload_gb=offload_gb, device=device, prefetch=prefetch,
                                          policy=policy, progress=progress, load_threads=threads, routing=routing)
    return _load(model, path, config, strict, convert_dtypes, allow_outside_paths)


def _load(model: nn.Module, path, config: OffloadConfig, strict: bool, convert_dtypes: bool,
          allow_outside_paths: bool) -> nn.Module:
    """``load_safetensors`` once its arguments are settings: check every header against the model,
    choose the placement, read every byte into its destination, and only then change the model."""
    device = resolve_device(config.device)
    files = _shard_files(path, allow_outside_paths)
    entries = _headers(files)
    chosen = {}

    def check(groups):
        matched, problems = _match(entries, model, groups, convert_dtypes, path, strict)
        architecture = _architecture_problem(model, files)
        if architecture:
            problems.insert(0, architecture)
        if problems:
            raise CheckpointError("offtensor: cannot load " + os.fspath(path) + " into " + type(model).__name__
                                  + " (the model is unchanged):\n  " + "\n  ".join(problems))
        chosen.update(matched)

    def read(groups, placed, pager, config):
        # The expert placement too is chosen before a byte is read: the reads fill what it places.
        total = sum(p.source.nbytes for _, ps in chosen.values() for p in ps)
        progress_bar = _Progress(total, config.progress, f"offtensor: loading {os.path.basename(os.fspath(path))}")
        ok = False
        try:
            loaded = _read(groups, chosen, placed, pager, _Reader(device, config.load_threads, progress_bar))
            ok = True
        finally:
            progress_bar.close(ok)
        return loaded  # every byte is in place: only now does the model change

    prepare(model, config, device, check=check, choose_experts=choose_expert_placement, read=read)
    return model


def _read(groups, chosen: dict, placed: placement.ModelPlacement, pager: Pager, reader: "_Reader") -> dict:
    """Read every chosen piece into a new destination; id(member) -> its destination tensor, for
    every member of the groups read (aliases read under another name included)."""
    device = pager.device
    pin_late = pins_host_memory(device) and _ext.can_pin_after_fill()
    targets = {}
    try:
        _schedule(groups, chosen, placed, pager, reader, pin_late, targets)
        with torch.no_grad():
            reader.run()
    except BaseException:
        reader.discard()  # a failed allocation or read: the files opened and the jobs scheduled go,
        targets.clear()  # and what was allocated is freed now, not when the traceback is
        raise
    return targets


def _schedule(groups, chosen: dict, placed: placement.ModelPlacement, pager: Pager, reader: "_Reader",
              pin_late: bool, targets: dict) -> None:
    """``_read``'s first half: allocate each group's destinations into ``targets`` and schedule
    its pieces on ``reader``."""
    device = pager.device
    for group in groups:
        if not any(id(m) in chosen for m in group):
            continue
        is_offloaded = placed.offloads(group)
        dests, raw = _destinations(group, pager if is_offloaded else None, device, pin_late)
        targets.update(dests)  # every alias of the storage, read under its name or not
        for member in group:
            if id(member) not in chosen:
                continue  # an alias whose values arrive through another member's name
            dest = dests[id(member)]
            host = dest._host if isinstance(dest, OffloadedTensor) else dest
            for piece in chosen[id(member)][1]:
                reader.add(piece, piece.region(host), is_offloaded, raw if is_offloaded and pin_late else None)


def _destinations(group: StorageGroup, pager: Optional[Pager], device: torch.device, pin_late: bool):
    """(id(member) -> the tensor its values are loaded into, the raw host allocation or None):
    views of one new host master (offloaded) or of one device buffer (resident), laid out like the
    group's storage so aliases stay aliases. A master's memory is not touched before the read."""
    first = group[0].tensor
    dense = len(group) == 1
    if dense:
        numel = first.numel()
        layouts = {id(first): (tuple(first.shape), None, 0)}  # the file's values are contiguous
    else:
        lo, hi = group.element_range()
        numel = hi - lo
        layouts = {id(m.tensor): (tuple(m.tensor.shape), m.tensor.stride(), m.tensor.storage_offset() - lo)
                   for m in group}
    raw = None
    if pager is not None:
        pin_now = pins_host_memory(pager.device) and not pin_late
        raw = _ext.alloc_host(numel * first.element_size(), pin=pin_now, touch=False)
        flat = raw.view(first.dtype) if numel else torch.empty(0, dtype=first.dtype)
    elif device.type == "cpu":
        # The emulated device's memory: allocated like a master, so the read is its first touch too.
        raw_resident = _ext.alloc_host(numel * first.element_size(), pin=False, touch=False)
        flat = raw_resident.view(first.dtype) if numel else torch.empty(0, dtype=first.dtype)
    else:
        flat = torch.empty(numel, dtype=first.dtype, device=device)
    out = {}
    master = master_for(flat, pager) if pager is not None else None
    if master is not None:
        master.name = next((n for m in group for n in m.names), None)
    for member in group:
        shape, stride, offset = layouts[id(member.tensor)]
        view = flat.view(shape) if stride is None else flat.as_strided(shape, stride, offset)
        out[id(member)] = OffloadedTensor(view, master) if master is not None else view
    return out, raw


# ---------------------------------------------------------------------------- from_pretrained


class _ParametersOnMeta:
    """``with _parameters_on_meta():`` builds parameters on meta and leaves buffers real, like
    accelerate's ``init_empty_weights(include_buffers=False)``: buffers computed at init (rotary
    frequencies) are not in checkpoints, so they must keep their values.

    Only the thread inside the block is affected: a parameter registration hook (torch's public
    ``register_module_parameter_registration_hook``) acts for threads that are building, and is
    registered only while one is (``nn.Module`` itself is never changed). A module built meanwhile
    in another thread gets ordinary weights; concurrent builds each see their own."""

    def __init__(self):
        self.building = threading.local()
        self.lock = threading.Lock()
        self.threads_building = 0
        self.hook = None

    @contextlib.contextmanager
    def __call__(self):
        with self.lock:
            self.threads_building += 1
            if self.hook is None:
                from torch.nn.modules import module as module_mod

                self.hook = module_mod.register_module_parameter_registration_hook(self.on_meta)
        depth = getattr(self.building, "depth", 0)
        self.building.depth = depth + 1
        try:
            yield
        finally:
            self.building.depth = depth
            with self.lock:
                self.threads_building -= 1
                if not self.threads_building:
                    self.hook.remove()
                    self.hook = None

    def on_meta(self, module, name, param):
        if not getattr(self.building, "depth", 0) or param is None or param.is_meta:
            return None
        on_meta = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        on_meta.__dict__.update(param.__dict__)
        return on_meta


_parameters_on_meta = _ParametersOnMeta()


def from_pretrained(path, budget_gb: Optional[float] = None, device=None, dtype: Optional[torch.dtype] = None, *,
                    offload_gb: Optional[float] = None, prefetch: bool = True, policy=None,
                    progress: Optional[bool] = None, threads: Optional[int] = None, model_class=None,
                    trust_remote_code: bool = False, strict: bool = True,
                    allow_outside_paths: bool = False, routing=None) -> nn.Module:
    """A transformers checkpoint directory -> its model built on meta from ``config.json``, every
    shard read through ``load_safetensors``, wrapped for the budget, in eval mode.

    ``dtype``: None keeps the checkpoint's floating dtype; another floating dtype converts while
    loading. ``model_class``: a transformers class to build instead of ``config.architectures[0]``
    (or ``AutoModelForCausalLM`` when the config names none). ``allow_outside_paths``: as for
    ``load_safetensors``. transformers is needed only here.
    """
    try:
        import transformers
    except ImportError:
        raise ImportError(
            "offtensor.from_pretrained needs transformers (pip install transformers) to build the model from "
            "config.json; without it, build the model on meta yourself and call ot.load_safetensors(model, path)"
        ) from None
    root = os.fspath(path)
    if not os.path.isdir(root) or not os.path.isfile(os.path.join(root, "config.json")):  # isfile: not a FIFO
        raise FileNotFoundError(f"offtensor: {root!r} is not a transformers checkpoint directory (no config.json)")
    config = OffloadConfig.from_arguments(budget_gb=budget_gb, offload_gb=offload_gb, device=device, prefetch=prefetch,
                                          policy=policy, progress=progress, load_threads=threads, routing=routing)
    model_config = transformers.AutoConfig.from_pretrained(root, local_files_only=True,
                                                           trust_remote_code=trust_remote_code)
    files = _shard_files(root, allow_outside_paths)
    if dtype is None:
        by_dtype: dict = {}
        for entry in _headers(files).values():
            if entry.dtype.is_floating_point:
                by_dtype[entry.dtype] = by_dtype.get(entry.dtype, 0) + entry.nbytes
        dtype = max(by_dtype, key=by_dtype.get) if by_dtype else torch.get_default_dtype()
    cls = model_class
    if cls is None:
        names = getattr(model_config, "architectures", None) or []
        cls = next((getattr(transformers, n) for n in names if hasattr(transformers, n)), None)
    with _parameters_on_meta():
        if cls is None:
            model = transformers.AutoModelForCausalLM.from_config(model_config, dtype=dtype,
                                                                  trust_remote_code=trust_remote_code)
        else:
            model = cls._from_config(model_config, dtype=dtype)
    model.tie_weights()  # ties declared by the config (tie_word_embeddings), bound before loading
    model.eval()
    index = next((os.path.join(root, f) for f in sorted(os.listdir(root)) if f.endswith(".safetensors.index.json")),
                 None)
    return _load(model, index or root, config, strict, convert_dtypes=True, allow_outside_paths=allow_outside_paths)
