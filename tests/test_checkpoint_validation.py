"""Checkpoint validation at least as strict as safetensors' own.

Every malformed safetensors header or index is refused with ``ot.CheckpointError`` naming the file,
before the model changes: overlapping, duplicated or gapped tensor ranges, trailing bytes, headers
that are not UTF-8 JSON, a ``__metadata__`` that is not a map of strings to strings, entries of the
wrong JSON types, nesting deep enough to exhaust Python's recursion. Where safetensors is installed,
each refused file is also shown to be refused by ``safetensors.torch.load_file``, and each accepted
one to be accepted by it. No read blocks on a FIFO or device, and the shards an index names stay
inside its directory unless ``allow_outside_paths=True``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import struct
import types

import pytest
import torch
from torch import nn

import offtensor as ot
from offtensor.model.copies import is_wrapped

GiB = 1 << 30


class Tiny(nn.Module):
    """embed.weight and head.weight: 32 bytes each (4 x 2 float32); scale: 4 bytes."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(4, 2)
        self.head = nn.Linear(2, 4, bias=False)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, ids):
        return self.head(self.embed(ids)) * self.scale


def _meta():
    with torch.device("meta"):
        return Tiny().eval()


def _unchanged(model) -> bool:
    return all(p.is_meta and not isinstance(p, ot.OffloadedTensor) for p in model.parameters()) \
        and not is_wrapped(model)


VALUES = torch.arange(17, dtype=torch.float32)  # embed = 0..7, head = 8..15, scale = 16
DATA = VALUES.numpy().tobytes()


def _entries(**changes):
    entries = {
        "embed.weight": {"dtype": "F32", "shape": [4, 2], "data_offsets": [0, 32]},
        "head.weight": {"dtype": "F32", "shape": [4, 2], "data_offsets": [32, 64]},
        "scale": {"dtype": "F32", "shape": [1], "data_offsets": [64, 68]},
    }
    for key, value in changes.items():
        key = key.replace("__", ".")
        if value is None:
            del entries[key]
        else:
            entries[key] = value
    return entries


def _write(path, header, data: bytes = DATA) -> str:
    """A safetensors file: ``header`` (a dict, a JSON text or raw bytes) then ``data``."""
    if isinstance(header, dict):
        header = json.dumps(header)
    raw = header.encode() if isinstance(header, str) else header
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)
    return str(path)


class Blocked(BaseException):
    """Raised into a call that blocked; a BaseException, so no ``except OSError`` or ``except
    Exception`` on the way swallows it (TimeoutError is an OSError)."""


@contextlib.contextmanager
def _no_hang(seconds: float = 20.0):
    """Fails, instead of hanging the suite, a call that blocks (an open() of a FIFO waits for a writer)."""
    def alarm(signum, frame):
        raise Blocked(f"blocked for {seconds} s: a read waited on a FIFO or device")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _refused(path, match, device, **kwargs):
    model = _meta()
    with _no_hang(), pytest.raises(ot.CheckpointError, match=match) as info:
        ot.load_safetensors(model, path, budget_gb=1, device=device, **kwargs)
    assert _unchanged(model)
    return str(info.value)


def _safetensors_refuses(path) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    with pytest.raises(Exception):
        safetensors_torch.load_file(path)


def _loads(path, device, **kwargs):
    model = _meta()
    with _no_hang():
        ot.load_safetensors(model, path, budget_gb=1, device=device, **kwargs)
    assert torch.equal(model.embed.weight.cpu(), VALUES[:8].view(4, 2))
    assert torch.equal(model.head.weight.cpu(), VALUES[8:16].view(4, 2))
    assert torch.equal(model.scale.cpu(), VALUES[16:])
    return model


# ---------------------------------------------------------------------------- headers


def _text_with(entries: dict, duplicate: str, value: dict) -> str:
    """The header's JSON text with ``duplicate`` given a second time (json.dumps cannot write that)."""
    text = json.dumps(entries)
    return text[:-1] + ", " + json.dumps(duplicate) + ": " + json.dumps(value) + "}"


def _deep(depth: int, open_: str = "[", close: str = "]") -> str:
    return '{"embed.weight": {"dtype": "F32", "shape": [4, 2], "data_offsets": [0, 32], "x": ' \
        + open_ * depth + close * depth + "}}"


def _deep_objects(depth: int) -> str:
    return '{"__metadata__": ' + '{"a": ' * depth + '"b"' + "}" * depth + "}"


# id -> (header, data, what the message says). Each was accepted silently, or raised a raw
# TypeError / RecursionError, before; safetensors refuses every one of them.
REFUSED = {
    # Ranges: the tensors must tile the data section exactly, in offset order (safetensors' validate()).
    "overlap_same_range": (_entries(head__weight={"dtype": "F32", "shape": [4, 2], "data_offsets": [0, 32]},
                                    scale={"dtype": "F32", "shape": [1], "data_offsets": [32, 36]}),
                           DATA[:36], r"'head\.weight' at bytes \[0, 32\) overlaps 'embed\.weight'.*share bytes"),
    "overlap_partial": (_entries(head__weight={"dtype": "F32", "shape": [4, 2], "data_offsets": [16, 48]},
                                 scale={"dtype": "F32", "shape": [1], "data_offsets": [48, 52]}),
                        DATA[:52], r"overlaps 'embed\.weight' at bytes \[0, 32\)"),
    "duplicate_key": (_text_with(_entries(), "head.weight", {"dtype": "F32", "shape": [4, 2], "data_offsets": [0, 32]}),
                      DATA, r"gives the key 'head\.weight' twice"),
    "gap": (_entries(head__weight={"dtype": "F32", "shape": [4, 2], "data_offsets": [40, 72]},
                     scale={"dtype": "F32", "shape": [1], "data_offsets": [72, 76]}),
            DATA[:32] + bytes(8) + DATA[32:], r"bytes \[32, 40\) between 'embed\.weight' and 'head\.weight'.* no tensor"),
    "gap_at_start": ({k: {**v, "data_offsets": [v["data_offsets"][0] + 8, v["data_offsets"][1] + 8]}
                      for k, v in _entries().items()},
                     bytes(8) + DATA, r"starts with 8 bytes that belong to no tensor"),
    "trailing_bytes": (_entries(), DATA + bytes(16), r"has 16 bytes after the last tensor, 'scale', that belong to no tensor"),
    "trailing_bytes_no_tensor": ({}, bytes(8), r"has 8 bytes after the header that belong to no tensor"),
    # Text: UTF-8 JSON only (json.loads of bytes would guess UTF-16 or UTF-32, and skip a BOM).
    "utf16_bom": (json.dumps(_entries()).encode("utf-16"), DATA, r"header of .* is not UTF-8"),
    "utf16le": (json.dumps(_entries()).encode("utf-16-le"), DATA, r"header of .* is not a safetensors JSON header"),
    "utf32": (json.dumps(_entries()).encode("utf-32"), DATA, r"header of .* is not UTF-8"),
    "utf8_bom": (b"\xef\xbb\xbf" + json.dumps(_entries()).encode(), DATA, r"is not a safetensors JSON header.*BOM"),
    "latin1_key": (json.dumps({**_entries(), "__metadata__": {"caf\u00e9": "x"}}).replace("\\u00e9", "\u00e9")
                   .encode("latin-1"), DATA, r"is not UTF-8"),
    "lone_surrogate": (json.dumps({"__metadata__": {"\ud800": "x"}, **_entries()}), DATA, r"unpaired UTF-16 surrogate"),
    "nan": (json.dumps(_entries(scale={"dtype": "F32", "shape": [1], "data_offsets": [64, 68], "note": float("nan")})),
            DATA, r"NaN is not JSON"),
    # __metadata__: safetensors reads it as Option<HashMap<String, String>>.
    "metadata_int_value": ({"__metadata__": {"format": 1}, **_entries()}, DATA, r"__metadata__ .* strings to strings.*'format': 1"),
    "metadata_nested": ({"__metadata__": {"a": {"b": "c"}}, **_entries()}, DATA, r"__metadata__ .* strings to strings"),
    "metadata_null_value": ({"__metadata__": {"a": None}, **_entries()}, DATA, r"__metadata__ .* strings to strings"),
    "metadata_list": ({"__metadata__": ["pt"], **_entries()}, DATA, r"__metadata__ .* it is a JSON list"),
    "metadata_string": ({"__metadata__": "pt", **_entries()}, DATA, r"__metadata__ .* it is a JSON str"),
    # Entries of the wrong JSON types.
    "dtype_list": (_entries(scale={"dtype": ["F32"], "shape": [1], "data_offsets": [64, 68]}), DATA,
                   r"tensor 'scale' .* has dtype \['F32'\], not a dtype name"),
    "dtype_int": (_entries(scale={"dtype": 7, "shape": [1], "data_offsets": [64, 68]}), DATA, r"has dtype 7, not a dtype name"),
    "shape_bool": (_entries(scale={"dtype": "F32", "shape": [True], "data_offsets": [64, 68]}), DATA,
                   r"tensor 'scale' .* has shape \[True\]"),
    "offsets_bool": (_entries(embed__weight={"dtype": "BOOL", "shape": [1], "data_offsets": [False, True]},
                              head__weight={"dtype": "F32", "shape": [4, 2], "data_offsets": [1, 33]},
                              scale={"dtype": "F32", "shape": [1], "data_offsets": [33, 37]}),
                     DATA[:37], r"tensor 'embed\.weight' .* has data offsets \[False, True\]"),
    "shape_string": (_entries(scale={"dtype": "F32", "shape": "1", "data_offsets": [64, 68]}), DATA, r"has shape '1'"),
    "shape_too_large": (_entries(scale={"dtype": "F32", "shape": [1 << 64, 0], "data_offsets": [64, 64]}), DATA[:64],
                        r"has shape \[18446744073709551616, 0\]"),
    "offsets_three": (_entries(scale={"dtype": "F32", "shape": [1], "data_offsets": [64, 68, 72]}), DATA,
                      r"has data offsets \[64, 68, 72\]"),
    "entry_null": (_entries(scale=None) | {"scale": None}, DATA[:64], r"tensor 'scale' .* malformed header entry None"),
    "entry_missing_field": (_entries(scale={"dtype": "F32", "shape": [1]}), DATA, r"malformed header entry"),
    "header_list": ("[1, 2]", DATA, r"the header is a JSON list, not an object"),
    # F4 packs two values per byte: safetensors refuses values that do not fill whole bytes, and a last
    # dimension torch's float4_e2m1fn_x2 (one byte per element) cannot halve.
    "f4_odd_value_count": (_entries(scale={"dtype": "F4", "shape": [1], "data_offsets": [64, 65]}), DATA[:65],
                           r"tensor 'scale' .* shape \(1,\) in F4.*do not fill whole bytes"),
    "f4_zero_dim": (_entries(scale={"dtype": "F4", "shape": [], "data_offsets": [64, 65]}), DATA[:65],
                    r"tensor 'scale' .* shape \(\) in F4.*do not fill whole bytes"),
    "f4_odd_last_dim": (_entries(scale={"dtype": "F4", "shape": [2, 1], "data_offsets": [64, 65]}), DATA[:65],
                        r"tensor 'scale' .* shape \(2, 1\) in F4.*last dimension is not a multiple of 2"),
    # Nesting: Python's json recurses, safetensors' serde_json stops at 128 levels.
    "nested_100k_arrays": (_deep(100_000), DATA, r"nested deeper than any safetensors header"),
    "nested_100k_objects": (_deep_objects(100_000), DATA, r"nested deeper than any safetensors header"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_malformed_header_is_refused_naming_the_file_as_safetensors_refuses_it(tmp_path, device, case):
    header, data, match = REFUSED[case]
    path = _write(tmp_path / "model.safetensors", header, data)
    message = _refused(path, match, device)
    assert "model.safetensors" in message
    _safetensors_refuses(path)


def test_the_valid_file_these_cases_are_made_from_loads(tmp_path, device):
    path = _write(tmp_path / "model.safetensors", _entries())
    _loads(path, device)
    pytest.importorskip("safetensors.torch").load_file(path)


# Cases a strict reader could refuse but that are safe, and that safetensors accepts as well.
ACCEPTED = {
    # safetensors' __metadata__ is an Option: null means absent.
    "metadata_null": {"__metadata__": None, **_entries()},
    # Strings to strings, as save_file writes it.
    "metadata_strings": {"__metadata__": {"format": "pt", "note": "\u00e9\u4e2d"}, **_entries()},
    # An entry's unknown fields are ignored by safetensors (its TensorInfo denies none); they
    # describe nothing offtensor reads, so they cannot change a value.
    "unknown_entry_field": _entries(scale={"dtype": "F32", "shape": [1], "data_offsets": [64, 68], "note": [1, {"a": 2}]}),
    # The header lists tensors in any order; safetensors sorts them by offset, and so does the check.
    "entries_out_of_offset_order": dict(reversed(list(_entries().items()))),
}


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_headers_safe_to_accept_load(tmp_path, device, case):
    path = _write(tmp_path / "model.safetensors", ACCEPTED[case])
    _loads(path, device)
    pytest.importorskip("safetensors.torch").load_file(path)


def test_header_padded_with_spaces_as_safetensors_writes_it_loads(tmp_path, device):
    # safetensors pads its header with spaces to a multiple of 8 bytes: JSON whitespace.
    path = _write(tmp_path / "model.safetensors", json.dumps(_entries()) + " " * 7)
    _loads(path, device)


def test_nesting_safetensors_refuses_but_python_parses_is_accepted_only_where_nothing_reads_it(tmp_path, device):
    # serde_json stops at 128 levels; Python's json parses up to its recursion limit (deeper is
    # refused above). A valid value can only be that deep in an entry's unknown field, which
    # nothing reads (dtype, shape, offsets and __metadata__ refuse any nesting), so accepting it
    # cannot change a weight. This is the one file here that safetensors refuses and offtensor loads.
    deep = "[" * 300 + "]" * 300
    text = json.dumps(_entries())[:-2] + ', "note": ' + deep + "}}"
    path = _write(tmp_path / "model.safetensors", text)
    _loads(path, device)
    _safetensors_refuses(path)


class WithEmpty(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.empty(0))
        self.b = nn.Parameter(torch.empty(0, 3))
        self.c = nn.Parameter(torch.ones(2))


def test_empty_tensors_at_one_offset_are_accepted_they_share_no_byte(tmp_path, device):
    # Zero-byte tensors at the same offset (or at another tensor's start) overlap in no byte; safetensors
    # accepts them (its validate() checks begin == previous end only), and so does offtensor.
    header = {"a": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]},
              "b": {"dtype": "F32", "shape": [0, 3], "data_offsets": [0, 0]},
              "c": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    path = _write(tmp_path / "model.safetensors", header, torch.tensor([3.0, 4.0]).numpy().tobytes())
    with torch.device("meta"):
        model = WithEmpty()
    ot.load_safetensors(model, path, budget_gb=1, device=device)
    assert model.a.shape == (0,) and model.b.shape == (0, 3)
    assert torch.equal(model.c.cpu(), torch.tensor([3.0, 4.0]))
    pytest.importorskip("safetensors.torch").load_file(path)


# ---------------------------------------------------------------------------- special files


def test_a_fifo_named_as_the_checkpoint_is_refused_without_blocking(tmp_path, device):
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    _refused(fifo, r"model\.safetensors' is a FIFO, not a regular file", device)


def test_a_fifo_among_a_directorys_shards_is_refused_without_blocking(tmp_path, device):
    _write(tmp_path / "a.safetensors", _entries())
    os.mkfifo(tmp_path / "b.safetensors")
    _refused(tmp_path, r"b\.safetensors' is a FIFO", device)


def test_an_index_naming_a_fifo_is_refused_without_blocking(tmp_path, device):
    _write(tmp_path / "a.safetensors", _entries(scale=None), DATA[:64])
    os.mkfifo(tmp_path / "b.safetensors")
    _index(tmp_path, {"embed.weight": "a.safetensors", "head.weight": "a.safetensors", "scale": "b.safetensors"})
    _refused(tmp_path, r"b\.safetensors' is a FIFO", device)


def test_an_index_that_is_a_fifo_is_refused_without_blocking(tmp_path, device):
    os.mkfifo(tmp_path / "model.safetensors.index.json")
    _refused(tmp_path, r"index .*model\.safetensors\.index\.json' is a FIFO", device)


def test_a_character_device_is_refused_even_where_outside_paths_are_allowed(tmp_path, device):
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero")
    _index(tmp_path, {"embed.weight": "/dev/zero"})
    _refused(tmp_path, r"'/dev/zero' is a character device", device, allow_outside_paths=True)


def test_a_fifo_named_config_json_does_not_block_the_architecture_check(tmp_path, device):
    # load_safetensors reads the config.json beside the files to name a checkpoint of another
    # architecture, for models that have a config (transformers models).
    path = _write(tmp_path / "model.safetensors", _entries())
    os.mkfifo(tmp_path / "config.json")
    model = _meta()
    model.config = types.SimpleNamespace(model_type="tiny")
    with _no_hang():
        ot.load_safetensors(model, path, budget_gb=1, device=device)
    assert torch.equal(model.scale.cpu(), VALUES[16:])


@pytest.mark.parametrize("kind", ["fifo", "directory", "character_device"])
def test_a_config_json_that_is_no_regular_file_is_refused_as_such_not_called_missing(tmp_path, device, kind):
    """``from_pretrained`` of a directory whose config.json is a FIFO, a directory or a symlink to
    /dev/zero: a CheckpointError naming config.json and what it is, without blocking. It said the
    directory had no config.json, of a directory holding one."""
    pytest.importorskip("transformers")
    _write(tmp_path / "model.safetensors", _entries())
    config = tmp_path / "config.json"
    if kind == "fifo":
        os.mkfifo(config)
    elif kind == "directory":
        config.mkdir()
    else:
        os.symlink("/dev/zero", config)
    what = {"fifo": "a FIFO", "directory": "a directory", "character_device": "a character device"}[kind]
    with _no_hang(), pytest.raises(ot.CheckpointError, match=rf"config\.json' is {what}, not a regular file"):
        ot.from_pretrained(tmp_path, budget_gb=1, device=device, progress=False)


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs procfs")
def test_a_file_whose_size_is_0_but_reads_bytes_is_refused_by_its_size(device):
    """A /proc file reports 0 bytes yet reads some: refused as too short for the header length, the
    model unchanged. It was read, and refused as a header longer than "-8 bytes after the length field"."""
    message = _refused("/proc/self/stat", r"is 0 bytes, too short for the 8-byte header length", device)
    assert "-8" not in message


# ---------------------------------------------------------------------------- indexes


def _index(root, weight_map, name="model.safetensors.index.json", raw=None):
    with open(os.path.join(root, name), "wb") as f:
        f.write(raw if raw is not None else json.dumps({"metadata": {}, "weight_map": weight_map}).encode())
    return os.path.join(root, name)


def _two_shards(root):
    _write(os.path.join(root, "a.safetensors"), _entries(scale=None), DATA[:64])
    _write(os.path.join(root, "b.safetensors"), {"scale": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
           DATA[64:])
    return {"embed.weight": "a.safetensors", "head.weight": "a.safetensors", "scale": "b.safetensors"}


INDEX_REFUSED = {
    "weight_map_list": (json.dumps({"weight_map": ["a.safetensors"]}).encode(), r"weight_map that is a JSON list"),
    "weight_map_int_value": (json.dumps({"weight_map": {"embed.weight": 3}}).encode(),
                             r"maps 1 tensors to something other than a shard file name, e.g. 'embed\.weight' -> 3"),
    "weight_map_null_value": (json.dumps({"weight_map": {"embed.weight": None}}).encode(), r"'embed\.weight' -> None"),
    "weight_map_empty_name": (json.dumps({"weight_map": {"embed.weight": ""}}).encode(), r"'embed\.weight' -> ''"),
    "no_weight_map": (b'{"metadata": {}}', r"this one has no weight_map"),
    "not_an_object": (b'["a.safetensors"]', r"this one is a JSON list"),
    "duplicate_tensor": (b'{"weight_map": {"scale": "a.safetensors", "scale": "b.safetensors"}}',
                         r"index of .* gives the key 'scale' twice"),
    "utf16": (json.dumps({"weight_map": {"scale": "b.safetensors"}}).encode("utf-16"), r"index of .* is not UTF-8"),
    "nested_100k": (b'{"weight_map": {}, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", r"nested deeper"),
    "not_json": (b'{"weight_map": {', r"index of .* is not a safetensors JSON index"),
    "nul_in_name": (json.dumps({"weight_map": {"scale": "b.safe\x00tensors"}}).encode(), r"with a NUL byte"),
}


@pytest.mark.parametrize("case", sorted(INDEX_REFUSED))
def test_malformed_index_is_refused_naming_the_index(tmp_path, device, case):
    _two_shards(tmp_path)
    raw, match = INDEX_REFUSED[case]
    _index(tmp_path, None, raw=raw)
    message = _refused(tmp_path, match, device)
    assert "model.safetensors.index.json" in message


def test_a_well_formed_index_loads(tmp_path, device):
    _index(tmp_path, _two_shards(tmp_path))
    _loads(tmp_path, device)


def test_a_tensor_the_index_puts_in_another_shard_loads_from_the_shard_that_holds_it(tmp_path, device):
    # The shards' headers are what is read, as transformers reads them (it loads every key of every
    # shard the index names): an index that misplaces a tensor loses nothing and loads no wrong bytes.
    weight_map = _two_shards(tmp_path)
    weight_map["embed.weight"], weight_map["scale"] = "b.safetensors", "a.safetensors"
    _index(tmp_path, weight_map)
    _loads(tmp_path, device)


def test_a_tensor_a_shard_holds_that_its_index_does_not_list_is_loaded(tmp_path, device):
    weight_map = _two_shards(tmp_path)
    del weight_map["head.weight"]
    _index(tmp_path, weight_map)
    _loads(tmp_path, device)


def test_a_weight_the_index_puts_in_a_shard_that_lacks_it_is_named_with_the_index_and_the_shard(tmp_path, device):
    # "the files lack 1 weights" said nothing of the index that promised it.
    weight_map = _two_shards(tmp_path)
    weight_map["scale"] = "a.safetensors"  # b, which holds it, is not named: no shard read holds it
    _index(tmp_path, weight_map)
    _refused(tmp_path, r"lack 1 weights .*scale.*; the index puts 'scale' in 'a\.safetensors', but no shard's "
                       r"header holds it", device)


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink_file", "symlink_dir"])
def test_index_paths_stay_inside_the_checkpoint_directory_unless_allowed(tmp_path, device, kind):
    root, outside = tmp_path / "ckpt", tmp_path / "elsewhere"
    root.mkdir()
    outside.mkdir()
    weight_map = _two_shards(outside)  # the shards live outside the checkpoint directory
    if kind == "dotdot":
        weight_map = {k: f"../elsewhere/{v}" for k, v in weight_map.items()}
    elif kind == "absolute":
        weight_map = {k: str(outside / v) for k, v in weight_map.items()}
    elif kind == "symlink_file":
        for name in set(weight_map.values()):
            os.symlink(outside / name, root / name)
    else:
        os.symlink(outside, root / "sub")
        weight_map = {k: f"sub/{v}" for k, v in weight_map.items()}
    _index(root, weight_map)
    expected = {"dotdot": r"climbs out with '\.\.'", "absolute": "is an absolute path",
                "symlink_file": "resolves through a symlink to", "symlink_dir": "resolves through a symlink to"}[kind]
    message = _refused(root, expected + r".*outside the checkpoint directory.*allow_outside_paths=True", device)
    assert "model.safetensors.index.json" in message
    _loads(root, device, allow_outside_paths=True)  # the caller's explicit choice


def test_symlinks_inside_the_checkpoint_directory_are_followed(tmp_path, device):
    weight_map = _two_shards(tmp_path)
    (tmp_path / "shards").mkdir()
    for name in set(weight_map.values()):
        os.rename(tmp_path / name, tmp_path / "shards" / name)
        os.symlink(os.path.join("shards", name), tmp_path / name)
    _index(tmp_path, weight_map)
    _loads(tmp_path, device)


def test_the_huggingface_hub_cache_layout_loads(tmp_path, device):
    # huggingface_hub stores models--org--name/blobs/<hash> and links snapshots/<rev>/<file> -> ../../blobs/<hash>.
    repo = tmp_path / "models--org--tiny"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    weight_map = _two_shards(blobs)
    index = _index(blobs, weight_map, name="index-blob")
    os.symlink("../../blobs/index-blob", snapshot / "model.safetensors.index.json")
    for name in set(weight_map.values()):
        os.symlink(f"../../blobs/{name}", snapshot / name)
    assert os.path.exists(index)
    _loads(snapshot, device)


def _other_values(root, name):
    """A shard named ``name`` holding the three tensors with other values than VALUES."""
    return _write(os.path.join(root, name), _entries(), (VALUES + 100).numpy().tobytes())


def test_of_several_indexes_the_one_transformers_reads_is_loaded(tmp_path, device):
    # The first index in alphabetical order was read: here another checkpoint's, whose values
    # loaded without a word. transformers reads model.safetensors.index.json.
    _index(tmp_path, _two_shards(tmp_path))
    _other_values(tmp_path, "other.safetensors")
    _index(tmp_path, dict.fromkeys(_entries(), "other.safetensors"), name="a-draft.safetensors.index.json")
    _loads(tmp_path, device)


def test_several_indexes_none_of_them_transformers_is_refused_naming_them(tmp_path, device):
    weight_map = _two_shards(tmp_path)
    _index(tmp_path, weight_map, name="b.safetensors.index.json")
    _other_values(tmp_path, "other.safetensors")
    _index(tmp_path, dict.fromkeys(_entries(), "other.safetensors"), name="a.safetensors.index.json")
    _refused(tmp_path, r"holds 2 safetensors indexes, none of them 'model\.safetensors\.index\.json': "
                       r"\['a\.safetensors\.index\.json', 'b\.safetensors\.index\.json'\].*ambiguous", device)
    _loads(os.path.join(tmp_path, "b.safetensors.index.json"), device)  # named, it is not ambiguous


def test_a_model_safetensors_beside_an_index_is_loaded_as_transformers_loads_it(tmp_path, device):
    # transformers looks for model.safetensors first and never reads the index beside it; the
    # index's shards (other values here) were loaded instead.
    _write(os.path.join(tmp_path, "model.safetensors"), _entries())
    _other_values(tmp_path, "other.safetensors")
    _index(tmp_path, dict.fromkeys(_entries(), "other.safetensors"))
    _loads(tmp_path, device)


@pytest.mark.parametrize("spelling", ["./a.safetensors", ".//a.safetensors", "./././a.safetensors"])
def test_one_shard_spelled_two_ways_in_an_index_is_read_once(tmp_path, device, spelling):
    # './a.safetensors' and 'a.safetensors' were two shards, and every tensor of a was refused as
    # "in both" of them.
    weight_map = _two_shards(tmp_path)
    weight_map["head.weight"] = spelling
    _index(tmp_path, weight_map)
    _loads(tmp_path, device)


def test_a_shard_and_a_symlink_to_it_in_one_index_are_one_shard(tmp_path, device):
    weight_map = _two_shards(tmp_path)
    os.symlink("a.safetensors", tmp_path / "alias.safetensors")
    weight_map["head.weight"] = "alias.safetensors"
    _index(tmp_path, weight_map)
    _loads(tmp_path, device)


@pytest.mark.parametrize("name", ["./../elsewhere/a.safetensors", "sub/../../elsewhere/a.safetensors"])
def test_a_shard_path_that_climbs_out_after_normalising_is_refused_naming_it(tmp_path, device, name):
    root = tmp_path / "ckpt"
    (root / "sub").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    _two_shards(tmp_path / "elsewhere")
    _index(root, dict.fromkeys(_entries(), name))
    _refused(root, rf"names the shard '{name}', which climbs out with '\.\.', outside the checkpoint directory", device)


# ---------------------------------------------------------------------------- bounded messages


@pytest.mark.parametrize("case", ["shape_the_model_lacks", "bytes_the_shape_lacks", "f4_odd_last_dim"])
def test_a_shape_of_100000_dimensions_is_shown_by_its_rank_and_first_dimensions(tmp_path, device, case):
    # The whole shape was printed: a 300 KB message of "1, 1, 1, ...".
    rank = 100_000
    scale = {"shape_the_model_lacks": {"dtype": "F32", "shape": [1] * rank, "data_offsets": [64, 68]},
             "bytes_the_shape_lacks": {"dtype": "F32", "shape": [1] * (rank - 1) + [2], "data_offsets": [64, 68]},
             "f4_odd_last_dim": {"dtype": "F4", "shape": [2] * (rank - 1) + [1], "data_offsets": [64, 68]}}[case]
    path = _write(tmp_path / "m.safetensors", _entries(scale=scale))
    message = _refused(path, rf"'scale' .* shape \([12], [12], [12], [12], \.\.\. 9999[67] more: rank {rank}\)", device)
    assert f"rank {rank}" in message and len(message) < 1000, message[:2000]
