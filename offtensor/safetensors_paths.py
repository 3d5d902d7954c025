"""Which safetensors files a checkpoint path names: a file, a directory (chosen as transformers
chooses in one: ``model.safetensors``, else ``model.safetensors.index.json``), or an index, whose
shards are kept inside its directory and each read once; and the whole tensors of such a path.
Each file's header is ``safetensors_files``' to parse and check.
"""

from __future__ import annotations

import os
import stat

from .safetensors_files import (LOOKAHEAD_FILE, CheckpointError, headers, parse_json, read_small_file,
                                tensors)

# An index is a small JSON file (one line per tensor); a larger one is not an index.
_MAX_INDEX_BYTES = 100_000_000


def read_index(path) -> dict:
    """The ``weight_map`` of a safetensors index: tensor name -> shard file name, both strings."""
    raw = read_small_file(path, "safetensors index", _MAX_INDEX_BYTES, "an index")
    index = parse_json(raw, path, "index")
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
    huggingface_hub cache layout, where ``snapshots/<rev>/<file>`` links to ``../../blobs/<hash>``.
    Inside, the name is normalised (``./a.safetensors``, ``sub//a.safetensors``): with no ``..`` in
    it, that changes no file it names, and one shard given two spellings is one shard."""
    if "\x00" in name:
        raise CheckpointError(f"offtensor: index {index!r} names a shard {name!r} with a NUL byte: the index is corrupt")
    if allow_outside_paths:
        return os.path.join(root, name)
    escape = None
    if os.path.isabs(name):
        escape = "is an absolute path"
    elif ".." in name.replace(os.sep, "/").split("/"):
        escape = "climbs out with '..'"
    path = os.path.join(root, os.path.normpath(name)) if escape is None else name
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


def stat_or_none(path, what: str):
    """``os.stat(path)``, or None where nothing is there. Where that cannot be told (a directory on
    the way that this user may not search, a symlink loop), a CheckpointError naming the path and
    the reason: ``os.path.exists`` says False there, and "does not exist" sent users looking for a
    file that is there."""
    try:
        return os.stat(path)
    except (FileNotFoundError, NotADirectoryError, ValueError):  # ValueError: a NUL byte in the path
        return None
    except OSError as e:
        raise CheckpointError(f"offtensor: cannot reach {what} {os.fspath(path)!r}: {e.strerror or e}") from None


def list_directory(path, what: str = "checkpoint directory") -> list:
    """The names in the directory ``path``; one this user may not list is a CheckpointError naming it."""
    try:
        return os.listdir(path)
    except OSError as e:
        raise CheckpointError(f"offtensor: cannot list the {what} {os.fspath(path)!r}: {e.strerror or e}") from None


# The names transformers looks for in a checkpoint directory, in its order: one whole file, then
# an index of shards.
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def directory_checkpoint(path: str, names=None):
    """What the checkpoint directory ``path`` holds, chosen as transformers chooses it: its
    ``model.safetensors`` where there is one beside an index (transformers loads that file and
    never reads the index), else its ``model.safetensors.index.json``, else its one other
    ``*.safetensors.index.json``. (the path of the index, None) or (None, the files) where there is
    no index: every ``*.safetensors`` file in it. Several indexes, none of them transformers', is
    a CheckpointError naming them: taking the first in alphabetical order loaded whichever
    checkpoint sorted first."""
    names = list_directory(path) if names is None else names
    indexes = sorted(f for f in names if f.endswith(".safetensors.index.json"))
    if indexes and SINGLE_FILE in names:
        return None, [os.path.join(path, SINGLE_FILE)]
    if INDEX_FILE in indexes:
        return os.path.join(path, INDEX_FILE), None
    if len(indexes) > 1:
        raise CheckpointError(f"offtensor: directory {path!r} holds {len(indexes)} safetensors indexes, none of them "
                              f"{INDEX_FILE!r}: {indexes[:8]}{' ...' if len(indexes) > 8 else ''}; which "
                              f"checkpoint to load is ambiguous: pass the path of the index to load")
    if indexes:
        return os.path.join(path, indexes[0]), None
    # (not the learned look-ahead that offtensor keeps beside a checkpoint: moe.predictor)
    files = sorted(os.path.join(path, f) for f in names if f.endswith(".safetensors") and f != LOOKAHEAD_FILE)
    if not files:
        raise FileNotFoundError(f"offtensor: directory {path!r} holds no *.safetensors file and no index")
    return None, files


def index_of(path):
    """The index a checkpoint path reads its shard names from, or None (a file, a directory without one)."""
    path = os.fspath(path)
    found = stat_or_none(path, "the checkpoint")
    if found is not None and stat.S_ISDIR(found.st_mode):
        return directory_checkpoint(path)[0]
    return path if path.endswith(".json") else None


def shard_files(path, allow_outside_paths: bool = False) -> list:
    """The safetensors files behind ``path``: a file, a directory, or an ``*.index.json``."""
    path = os.fspath(path)
    found = stat_or_none(path, "the checkpoint")
    if found is None:
        raise FileNotFoundError(f"offtensor: no safetensors checkpoint at {path!r}: the path does not exist")
    if stat.S_ISDIR(found.st_mode):
        index, files = directory_checkpoint(path)
        return files if index is None else shard_files(index, allow_outside_paths)
    if path.endswith(".json"):
        return _index_shards(path, allow_outside_paths)
    return [path]


def _index_shards(path: str, allow_outside_paths: bool) -> list:
    """The shard files the index ``path`` names, each once: names that reach one file (``a``,
    ``./a``, a symlink to it) are one shard, read once."""
    weight_map = read_index(path)
    if not weight_map:  # no file to read, and nothing to say what the checkpoint is
        raise CheckpointError(f"offtensor: index {path!r} names no shard (its weight_map is empty): the index "
                              f"is corrupt or was written before its shards")
    root = os.path.dirname(path)
    by_name = {name: _shard_path(root, name, path, allow_outside_paths) for name in dict.fromkeys(weight_map.values())}
    files, seen, missing = [], {}, []
    for file in dict.fromkeys(by_name.values()):
        st = stat_or_none(file, f"the shard index {path!r} names")
        if st is None:
            missing.append(file)
        elif seen.setdefault((st.st_dev, st.st_ino), file) is file:
            files.append(file)
    if missing:
        lost = [name for name, file in weight_map.items() if by_name[file] in missing]
        raise FileNotFoundError(
            f"offtensor: index {path!r} names shards that do not exist: {missing}; they hold {len(lost)} tensors, "
            f"e.g. {lost[:4]}. Download the missing shards or point at a complete checkpoint."
        )
    return files


def index_claims(path, keys) -> list:
    """(key, shard name) for each of ``keys`` that the index behind ``path`` (``index_of``) lists:
    where the index puts tensors that the shards' headers, which are what is read, do not hold.
    Empty where there is no index or it cannot be read (this only adds to another error)."""
    try:
        index = index_of(path)
        weight_map = read_index(index) if index is not None else {}
    except (OSError, ValueError):  # CheckpointError is a ValueError
        return []
    return [(key, weight_map[key]) for key in keys if key in weight_map]


def checkpoint_tensors(path, allow_outside_paths: bool = False):
    """(name, CPU tensor) for every tensor of the checkpoint at ``path`` (as ``shard_files`` finds
    its files), shard after shard, one tensor in memory at a time. Every shard's header is checked
    first (and no name in two shards), so a damaged shard is refused before any tensor is given."""
    files = shard_files(path, allow_outside_paths)
    by_file: dict = {}
    for entry in headers(files).values():
        by_file.setdefault(entry.file, {})[entry.key] = entry
    for file in files:
        yield from tensors(by_file.get(file, {}))
