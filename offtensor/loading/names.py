"""How the files' names and dtypes map onto the model: each file tensor -> the model tensor (or
the part of a stacked one) it fills, transformers' renamings and expert stackings applied, and
every mismatch (missing and unexpected names, shapes, dtypes, another architecture) reported.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Optional

import torch
from torch import nn

from ..safetensors_files import (MAX_CONFIG_BYTES, FileTensor, open_unchanged, read_exactly, read_small_file,
                                 shape_text)
from ..safetensors_paths import index_claims

# Equal-values checks read both tensors this many bytes at a time (each).
COMPARE_BYTES = 16 << 20


class Piece:
    """A file tensor and the part of a model tensor it fills: the whole tensor, or (for checkpoints
    that store stacked experts one by one) ``target[index]``, narrowed along ``dim`` to
    ``[offset, offset + length)`` when several file tensors are concatenated into one."""

    __slots__ = ("source", "target", "index", "part", "dim", "offset")

    def __init__(self, source: FileTensor, target: str, index=None, part=0, dim=None):
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
                # ASCII digits, at most 18: int() of any such index fits, where a hostile name's
                # thousands of digits raised Python's digit-limit ValueError naming no tensor.
                patterns = [re.compile(re.escape(s).replace(r"\*", r"([0-9]{1,18})")) for s in sources]
                self.stacks.append((scope, patterns, targets[0], cat_dim))
            else:
                self.unsupported.append(f"{sources} -> {targets}: {ops}")

    def piece(self, source: FileTensor, model_names) -> Optional[Piece]:
        key = source.key
        for scope, pattern, replacement in self.renames:
            if key.startswith(scope):
                key = pattern.sub(replacement, key)
        if key in model_names:
            return Piece(source, key)
        for scope, patterns, target, cat_dim in self.stacks:
            if not key.startswith(scope):
                continue
            for part, pattern in enumerate(patterns):
                m = pattern.search(key)
                if m is not None:
                    name = key[: m.start()] + target + key[m.end():]
                    if name in model_names:
                        return Piece(source, name, index=int(m.group(1)), part=part, dim=cat_dim)
        return None


def match(entries: dict, model: nn.Module, groups, convert_dtypes: bool, path, strict: bool):
    """name of each model tensor -> its pieces, and the problems found (all of them, not the first)."""
    members = {}  # model name -> (group, member)
    for group in groups:
        for member in group:
            for name in member.names:
                members[name] = (group, member)
    pieces, unmatched, conversions = pieces_by_name(entries, model, members)

    # transformers models name checkpoint tensors they deliberately skip (DeepSeek-V3's MTP layer 61).
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    unmatched = [k for k in unmatched if not any(p.search(k) for p in ignored)]
    problems, missing, missing_names = [], [], []
    chosen = {}  # id(member) -> (member, [pieces])
    for group in groups:
        for member in group:
            names = [n for n in member.names if n in pieces]
            if not names:
                if member.tensor.is_meta:
                    t = member.tensor
                    missing.append(f"{member.names[0]} ({tuple(t.shape)}, {t.dtype}, {t.numel() * t.element_size()} bytes)")
                    missing_names += member.names
                continue
            # Tied names stored more than once: one is read (a tie's source, as transformers ties its
            # target to the source's values), the others are checked against it.
            if len(names) > 1:
                names.sort(key=tie_targets(model).__contains__)
            chosen[id(member)] = (member, pieces[names[0]])
            problems += _check_pieces(names[0], member.tensor, pieces[names[0]], convert_dtypes)
            problems += _check_copies(names, member.tensor, pieces, convert_dtypes) if len(names) > 1 else []
    if strict and unmatched:
        problems.append(f"the files hold {len(unmatched)} tensors the model does not have: {sorted(unmatched)[:8]}"
                        f"{' ...' if len(unmatched) > 8 else ''} (pass strict=False to ignore them)")
    if missing:
        problems.append(f"the files lack {len(missing)} weights the model has no values for: {missing[:8]}"
                        f"{' ...' if len(missing) > 8 else ''}{_index_says(path, missing_names)}")
    if conversions is not None and conversions.unsupported and (unmatched or missing):
        problems.append(f"transformers converts this checkpoint with steps offtensor does not do: "
                        f"{conversions.unsupported[:4]}")
    named = [n for n in members if members[n][1].tensor.is_meta]
    found = sum(1 for n in named if n in pieces)
    if named and found < len(named) / 2:
        problems.append(f"only {found} of the model's {len(named)} weights are in {os.fspath(path)!r}: it looks like "
                        f"a checkpoint of another architecture (file: {sorted(entries)[:3]}, model: {named[:3]})")
    return chosen, problems


def _index_says(path, names) -> str:
    """What the index says of missing weights it lists: the shard it puts each in, whose header
    (what is read, as transformers reads it) does not hold it."""
    claims = index_claims(path, names)
    if not claims:
        return ""
    said = ", ".join(f"{key!r} in {shard!r}" for key, shard in claims[:4])
    return (f"; the index puts {said}{' ...' if len(claims) > 4 else ''}, but no shard's header holds "
            f"{'it' if len(claims) == 1 else 'them'}: the index and its shards disagree (a shard replaced by "
            f"another checkpoint's?)")


def pieces_by_name(entries: dict, model: nn.Module, names):
    """(model name -> the pieces of the files that fill it, the file keys no name in ``names``
    takes, the conversions used or None): file keys as they are, else as transformers renames or
    stacks them for ``model``."""
    conversions = None
    pieces: dict = {}
    unmatched = []
    for key, source in entries.items():
        if key in names:
            pieces.setdefault(key, []).append(Piece(source, key))
            continue
        if conversions is None:
            conversions = _Conversions(model)
        piece = conversions.piece(source, names)
        if piece is None:
            unmatched.append(key)
        else:
            pieces.setdefault(piece.target, []).append(piece)
    return pieces, unmatched, conversions


def tie_targets(model: nn.Module) -> set:
    """The names a transformers model ties to another weight (``all_tied_weights_keys``' keys)."""
    return set(getattr(model, "all_tied_weights_keys", None) or ())


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
            problems.append(f"{name}: {pieces[0].describe()} has shape {shape_text(s.shape)} ({s.nbytes} bytes), the model "
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
        # A part's width along the concatenated dim, where its tensors have that dim (a hostile
        # file's scalars have none: indexing their shape raised a bare IndexError).
        shape = next(iter(shapes))
        width = shape[dim] if dim is not None and len(shapes) == 1 and dim < len(shape) else None
        for ps in got.values():
            ps[0].offset = offset
        expected = slice_shape if dim is None else (
            slice_shape[:dim] + ("n" if width is None else width,) + slice_shape[dim + 1:])
        if len(shapes) != 1 or shape != expected:
            return [f"{name}: expert tensors such as {got[0][0].describe()} have shapes "
                    f"[{', '.join(shape_text(s) for s in sorted(shapes)[:3])}], the model's {tuple(t.shape)} ({model_bytes} bytes) "
                    f"needs {shape_text(expected)}"]
        offset += width or 0
    dim = pieces[0].dim
    if dim is not None and offset != slice_shape[dim]:
        problems.append(f"{name}: the parts {sorted(by_part)} concatenate to {offset} along dim {dim + 1}, the model "
                        f"has {slice_shape[dim]} ({tuple(t.shape)}, {model_bytes} bytes)")
    return problems


def _check_copies(names, t: torch.Tensor, pieces, convert_dtypes: bool) -> list:
    """Problems of the other stored names of one tied tensor: each must fit the model as the one
    read does and hold the same values in the model's dtype. Only one is read, so a copy of another
    shape or with other values would otherwise be dropped unseen, and the model would get one of
    two contradicting weights (torch's ``load_state_dict`` keeps whichever it copies last). Equal
    as numbers (``torch.equal``, so +0 and -0 alike) or as bits (so NaNs in the same places, which
    ``torch.equal`` calls different, are the same weight)."""
    problems = []
    for name in names[1:]:
        fit = _check_pieces(name, t, pieces[name], convert_dtypes)
        if not fit and not stored_equal(pieces[names[0]], pieces[name], t.dtype, or_same_bits=True):
            fit = [f"{names[0]} and {name} are one tied tensor of the model, but the files store them with "
                   f"different values ({pieces[names[0]][0].describe()}, {pieces[name][0].describe()}, "
                   f"{t.numel() * t.element_size()} bytes): store one, or untie them in the model"]
        problems += fit
    return problems


def stored_equal(a_pieces, b_pieces, dtype: torch.dtype, or_same_bits: bool = False) -> bool:
    """Whether two stored tensors hold equal values in ``dtype`` (``torch.equal``, as transformers
    compares them once loaded; with ``or_same_bits``, also where they hold the same bytes once in
    ``dtype``, NaNs included), read a chunk at a time. Values spread over several pieces (stacked experts) count as different: ``ties.decide``
    then loads each from its own pieces, which is right either way, and a model tied for good
    refuses them."""
    if len(a_pieces) != 1 or len(b_pieces) != 1 or a_pieces[0].index is not None or b_pieces[0].index is not None:
        return False
    a, b = a_pieces[0].source, b_pieces[0].source
    if a.shape != b.shape:
        return False
    if a.identity is None or b.identity is None:
        return _either(_read_equal(a, b, dtype), or_same_bits)
    key = (a.file, a.begin, a.identity, b.file, b.begin, b.identity, dtype)
    if key not in _COMPARED:
        if len(_COMPARED) >= 64:
            _COMPARED.clear()
        _COMPARED[key] = _read_equal(a, b, dtype)
    return _either(_COMPARED[key], or_same_bits)


def _either(compared: tuple, or_same_bits: bool) -> bool:
    equal, same = compared
    return equal or (or_same_bits and same)


# (both copies' places in their unchanged files, dtype) -> (equal, bitwise equal). from_pretrained
# asks about a tie's copies when it decides the tie (by value, as transformers), checks the build
# on meta, and loads (by value or bits): the copies are read once.
_COMPARED: dict = {}


def _read_equal(a: FileTensor, b: FileTensor, dtype: torch.dtype) -> tuple:
    """(equal values, the same bits) of ``a`` and ``b`` in ``dtype``."""
    numel = math.prod(a.shape)
    step = max(1, COMPARE_BYTES // max(a.dtype.itemsize, b.dtype.itemsize))
    fds = []
    equal = same = True
    try:
        for t in (a, b):
            fds.append(open_unchanged(t))  # the files whose headers were checked, or an error
        for lo in range(0, numel, step):
            n = min(step, numel - lo)
            x, y = (_values(fd, t, lo, n) for fd, t in zip(fds, (a, b)))
            equal, same = _equal_chunk(x, y, dtype, equal, same)
            if not equal and not same:
                break
        return equal, same
    finally:
        for fd in fds:
            os.close(fd)


def _values(fd: int, t: FileTensor, lo: int, n: int) -> torch.Tensor:
    size = t.dtype.itemsize
    raw = read_exactly(fd, t.begin + lo * size, n * size)
    if len(raw) != n * size:
        return torch.empty(0)  # the file shrank: counted as different, and the load reports it
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(t.dtype)


def _equal_chunk(x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype, equal: bool, same: bool) -> tuple:
    """(``equal`` and the chunks' values are equal, ``same`` and their bits are), in ``dtype``."""
    if x.numel() != y.numel():
        return False, False
    try:
        x, y = x.to(dtype), y.to(dtype)
        equal = equal and torch.equal(x, y)
    except (RuntimeError, TypeError):  # a dtype without conversions or comparisons (float4): compare bits
        equal = None
    same = same and x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    return (same if equal is None else equal), same


def architecture_problem(model: nn.Module, files) -> Optional[str]:
    """The config.json beside the files names another model type than the model's config."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    config_file = os.path.join(os.path.dirname(os.path.abspath(files[0])), "config.json")
    if not model_type or not os.path.exists(config_file):
        return None
    try:
        # Never blocks on a FIFO named config.json, and never reads a giant one whole (a file beside
        # the checkpoint, of any size): one larger than any config is not read, and not compared.
        theirs = json.loads(read_small_file(config_file, "config", MAX_CONFIG_BYTES, "a transformers config",
                                            "config.json")).get("model_type")
    except (OSError, ValueError, AttributeError, RecursionError):  # CheckpointError is a ValueError
        return None
    if theirs and theirs != model_type:
        return (f"{config_file!r} describes a {theirs!r} checkpoint but the model is a {model_type!r} "
                f"({type(model).__name__}): load it into a {theirs} model (ot.from_pretrained builds the right one)")
    return None

