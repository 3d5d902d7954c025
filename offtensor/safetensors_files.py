"""Safetensors files, read and checked before anything is loaded: each file's header, and its
tensors read whole. (Which files a checkpoint path names is ``safetensors_paths``'.)

Every file header is parsed here (8-byte little-endian length + JSON) and checked against the file
size as safetensors checks it (UTF-8 JSON with no key twice, known dtypes, shapes and offsets, the
tensors tiling the data section exactly), so a bad checkpoint is refused before the model changes.
It sits at the bottom of the package, importing nothing of offtensor's, so that any reader of a
safetensors file, not only the loader, can go through the same checks.
"""

from __future__ import annotations

import json
import os
import re
import stat

import torch

# The learned look-ahead offtensor keeps beside a checkpoint (``moe.predictor`` saves it): a
# safetensors file in the directory that is not one of the checkpoint's shards.
LOOKAHEAD_FILE = "lookahead.safetensors"

# Every dtype safetensors writes, as ``safetensors.torch.load_file`` gives it. F4 packs two
# 4-bit values in a byte: its header counts 4-bit values, torch's float4_e2m1fn_x2 counts bytes,
# so the last dimension halves (``_torch_shape``).
_DTYPES = {name: dtype for name, dtype in {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "C64": torch.complex64,
    "F8_E4M3": getattr(torch, "float8_e4m3fn", None), "F8_E5M2": getattr(torch, "float8_e5m2", None),
    "F8_E4M3FNUZ": getattr(torch, "float8_e4m3fnuz", None), "F8_E5M2FNUZ": getattr(torch, "float8_e5m2fnuz", None),
    "F8_E8M0": getattr(torch, "float8_e8m0fnu", None), "F4": getattr(torch, "float4_e2m1fn_x2", None),
}.items() if dtype is not None}
_PACKED = {"F4": 2}  # values per byte of the dtypes whose header shape counts sub-byte values
# safetensors refuses headers above 100 MB; a larger length field means a corrupt file.
_MAX_HEADER_BYTES = 100_000_000
# A transformers config.json is as small: a larger one is not a config (configs.py, names.py).
MAX_CONFIG_BYTES = 100_000_000


# A shape longer than this is shown as its first dimensions and its rank: a header may give a
# tensor a 100,000-dimension shape, which printed whole made a 300 KB message.
_SHAPE_SHOWN = 8


def shape_text(shape) -> str:
    """``shape`` as a message shows it: the tuple, or for a shape of more than a few dimensions its
    first ones and its rank."""
    shape = tuple(shape)
    if len(shape) <= _SHAPE_SHOWN:
        return str(shape)
    return f"({', '.join(map(str, shape[:4]))}, ... {len(shape) - 4} more: rank {len(shape)})"


class CheckpointError(ValueError):
    """A checkpoint file is unreadable, or does not fit the model; nothing was changed."""


class FileTensor:
    """One tensor's entry in a safetensors header: where its bytes lie in the file."""

    __slots__ = ("file", "key", "dtype", "dtype_name", "shape", "begin", "nbytes", "identity")

    def __init__(self, file, key, dtype, dtype_name, shape, begin, nbytes, identity=None):
        self.file, self.key, self.dtype, self.dtype_name = file, key, dtype, dtype_name
        self.shape, self.begin, self.nbytes = shape, begin, nbytes
        self.identity = identity  # the file's ``identity`` when its header was read


def open_regular(path, what: str) -> int:
    """A read-only descriptor of ``path``, refused unless it is a regular file: a FIFO, a device or
    a socket named as a checkpoint would block a read or never end. ``O_NONBLOCK`` makes opening a
    FIFO return at once (so it can be refused) and changes nothing for a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        try:  # a directory's listing names it: a symlink whose target is gone (a half-removed cache)
            dangling = f" (a symlink to {os.readlink(path)!r}, which does not exist)"
        except (OSError, ValueError):
            dangling = ""
        raise FileNotFoundError(f"offtensor: {what} {os.fspath(path)!r} does not exist{dangling}") from None
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


def identity(fd: int) -> tuple:
    """What tells one state of an open file from another: its inode (a file replaced under the same
    name is another inode), size and modification time (a file rewritten in place)."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def open_unchanged(source: "FileTensor") -> int:
    """A descriptor of ``source``'s file, refused unless the file is the one whose header was
    checked. The data are read through a descriptor opened after the header's: a file replaced or
    rewritten meanwhile would be read at the old header's offsets, another file's bytes taken for
    weights without an error."""
    fd = open_regular(source.file, "safetensors file")
    if source.identity is not None and identity(fd) != source.identity:
        os.close(fd)
        raise CheckpointError(f"offtensor: {source.file!r} changed since its header was read (it was replaced or "
                              f"rewritten while loading): nothing was loaded from it; load it again once it is complete")
    return fd


def read_exactly(fd: int, offset: int, count: int) -> bytes:
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


def parse_json(raw: bytes, file, what: str):
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


def read_small_file(path, what: str, limit: int, is_not: str, kind: str = "") -> bytes:
    """The whole of a small regular file (an index, a config.json), refused when it is larger than
    ``limit`` bytes: such a file ``is_not`` what it claims to be (any ``kind``, default ``what``)."""
    fd = open_regular(path, what)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise CheckpointError(f"offtensor: {path!r} is {size} bytes, larger than any {kind or what} "
                                  f"(at most {limit}): it is not {is_not}")
        return read_exactly(fd, 0, size)
    finally:
        os.close(fd)


_COUNT_LIMIT = 1 << 63  # torch sizes are int64


def read_header(file) -> dict:
    """key -> FileTensor for every tensor of one safetensors file, checked as safetensors checks
    it (and a little more), without reading any tensor data: UTF-8 JSON with no key twice, a
    string -> string ``__metadata__``, known dtypes, shapes and offsets of non-negative ints, each
    tensor's bytes matching its shape and dtype, and the tensors tiling the data section exactly:
    no overlap, no gap, nothing after the last one."""
    return read_header_and_metadata(file)[0]


def read_header_and_metadata(file) -> tuple:
    """(``read_header(file)``, the file's ``__metadata__``: strings -> strings, empty where absent)."""
    header, size, header_bytes, state = _read_header_json(file)
    data_start = 8 + header_bytes
    data_bytes = size - data_start
    entries, metadata = {}, {}
    for key, info in header.items():
        if key == "__metadata__":
            # safetensors: an optional map of strings to strings (null is its "absent").
            if info is not None and not (isinstance(info, dict) and all(isinstance(v, str) for v in info.values())):
                bad = (f"a JSON {type(info).__name__}" if not isinstance(info, dict) else
                       "{" + ", ".join(f"{k!r}: {v!r}" for k, v in info.items() if not isinstance(v, str))[:200] + "}")
                raise CheckpointError(f"offtensor: the __metadata__ of {file!r} must map strings to strings (as "
                                      f"safetensors requires), it is {bad}: the file is corrupt")
            metadata = dict(info or {})
            continue
        entries[key] = _header_entry(file, key, info, data_start, data_bytes)
        entries[key].identity = state
    _check_tiling(file, entries, data_start, size)
    return entries, metadata


def _read_header_json(file):
    """(the parsed JSON header, the file's size, the header's length, its ``identity``) of a
    safetensors file."""
    fd = open_regular(file, "safetensors file")
    try:
        state = identity(fd)
        size = state[2]
        head = read_exactly(fd, 0, 8)
        # A /proc file says it is 0 bytes and reads some: its size is what the checks below compare.
        if len(head) < 8 or size < 8:
            raise CheckpointError(f"offtensor: {file!r} is {size} bytes, too short for the 8-byte header length of a "
                                  f"safetensors file: it is truncated or not a safetensors file")
        header_bytes = int.from_bytes(head, "little")
        if header_bytes > min(size - 8, _MAX_HEADER_BYTES) and head.startswith((b"PK\x03\x04", b"\x80")):
            # A zip archive or a pickle: said so, or the length check below calls it truncated.
            raise CheckpointError(f"offtensor: {file!r} is a torch.save checkpoint (a "
                                  f"{'zip archive' if head[0] == 0x50 else 'pickle'}), not a safetensors file: "
                                  f"offtensor reads safetensors only; convert it with safetensors.torch.save_file")
        if header_bytes > min(size - 8, _MAX_HEADER_BYTES):
            raise CheckpointError(
                f"offtensor: {file!r} says its header is {header_bytes} bytes, but the file has {size - 8} bytes after "
                f"the length field (and headers are at most {_MAX_HEADER_BYTES}): the file is truncated or corrupt"
            )
        raw = read_exactly(fd, 8, header_bytes)
    finally:
        os.close(fd)
    if len(raw) < header_bytes:
        raise CheckpointError(f"offtensor: {file!r} ended after {len(raw)} of its {header_bytes} header bytes: "
                              f"the file was truncated while being read")
    header = parse_json(raw, file, "header")
    if not isinstance(header, dict):
        raise CheckpointError(f"offtensor: the {header_bytes}-byte header of {file!r} is not a safetensors JSON "
                              f"header (the header is a JSON {type(header).__name__}, not an object): the file is corrupt")
    return header, size, header_bytes, state


def _header_entry(file, key: str, info, data_start: int, data_bytes: int) -> "FileTensor":
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
    torch_shape = _torch_shape(where, dtype_name, shape, numel)
    nbytes = numel // _PACKED.get(dtype_name, 1) * dtype.itemsize
    if end - begin != nbytes:
        raise CheckpointError(
            f"offtensor: {where} spans bytes [{begin}, {end}) = {end - begin} bytes of the data section, but its "
            f"shape {shape_text(shape)} in {dtype_name} needs {nbytes} bytes: the file is corrupt"
        )
    if end > data_bytes:
        raise CheckpointError(
            f"offtensor: {where} ({nbytes} bytes) lies at bytes [{begin}, {end}) of the data section, past the "
            f"end of the file ({data_bytes} bytes of data): the file is truncated"
        )
    return FileTensor(file, key, dtype, dtype_name, tuple(torch_shape), data_start + begin, nbytes)


def _torch_shape(where: str, dtype_name: str, shape: list, numel: int) -> list:
    """The torch shape of a header's shape: the same, except for packed dtypes (F4), whose last
    dimension counts values, ``_PACKED`` of them per torch element; refused, as safetensors refuses
    it, when the values do not fill whole bytes or the last dimension does not divide."""
    per = _PACKED.get(dtype_name)
    if per is None:
        return shape
    if numel % per or not shape or shape[-1] % per:
        raise CheckpointError(
            f"offtensor: {where} has shape {shape_text(shape)} in {dtype_name}, {per} values per byte: "
            f"{'its values do not fill whole bytes' if numel % per else 'its last dimension is not a multiple of ' + str(per)}"
            f", which safetensors refuses: the file is corrupt")
    return shape[:-1] + [shape[-1] // per]


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


def headers(files) -> dict:
    """key -> FileTensor over every shard; a key in two shards is refused."""
    entries = {}
    for file in files:
        for key, entry in read_header(file).items():
            if key in entries:
                raise CheckpointError(f"offtensor: tensor {key!r} is in both {entries[key].file!r} and {file!r}")
            entries[key] = entry
    return entries



# ---------------------------------------------------------------------------- whole tensors


def tensors(entries: dict):
    """(key, CPU tensor) for each entry of one file's checked header (``read_header``), in file
    order, each read whole through one descriptor of the file as its header found it.

    Never through a memory map (safetensors' ``safe_open``): a mapped file truncated after its
    header was read kills the whole process with SIGBUS at the first read past its new end. Here a
    short read is a ``CheckpointError`` naming the file, the tensor and the bytes, and a file
    replaced or rewritten meanwhile is refused (its identity is checked around every tensor)."""
    ordered = sorted(entries.values(), key=lambda e: e.begin)
    if not ordered:
        return
    fd = open_unchanged(ordered[0])
    try:
        for entry in ordered:
            yield entry.key, read_tensor(fd, entry)
    finally:
        os.close(fd)


def pread_into(fd: int, offset: int, dst: torch.Tensor, what) -> None:
    """Reads ``dst.numel()`` bytes at ``offset`` straight into the CPU uint8 tensor ``dst``; a short
    read (the file truncated meanwhile) or a failed one is a CheckpointError naming ``what()``."""
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


def read_tensor(fd: int, entry: FileTensor) -> torch.Tensor:
    """``entry``'s tensor, read whole from ``fd`` (its file, as its header found it) into new memory:
    ``entry.nbytes``, which the header check bounded by the file's size, and which is refused
    before it is allocated where it is more than this machine's memory (a sparse file can be
    any size on a small disk: its reads would fault the allocation in until the kernel kills the
    process)."""
    where = f"tensor {entry.key!r} of {entry.file!r} (file bytes [{entry.begin}, {entry.begin + entry.nbytes}))"
    _unchanged_since_header(fd, entry, where)
    memory = physical_memory()
    if memory is not None and entry.nbytes > memory:
        raise CheckpointError(f"offtensor: {where} is {entry.nbytes} bytes, more than this machine's {memory} bytes "
                              f"of memory: nothing was allocated for it")
    raw = torch.empty(entry.nbytes, dtype=torch.uint8)
    pread_into(fd, entry.begin, raw, lambda: where)
    _unchanged_since_header(fd, entry, where)  # no byte of it from a rewrite
    if not entry.nbytes:
        return torch.empty(entry.shape, dtype=entry.dtype)
    return raw.view(entry.dtype).view(entry.shape)


def physical_memory():
    """This machine's memory in bytes, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _unchanged_since_header(fd: int, entry: FileTensor, where: str) -> None:
    if entry.identity is not None and identity(fd) != entry.identity:
        raise CheckpointError(f"offtensor: {entry.file!r} changed since its header was read (it was replaced, "
                              f"truncated or rewritten), while reading {where}: load it again once it is complete")
