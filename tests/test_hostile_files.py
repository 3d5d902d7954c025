"""Hostile and damaged checkpoints beyond a malformed header: tied names stored twice with other
values or shapes, files swapped or rewritten while a load runs, an index that names nothing, a
giant config.json beside the files, per-expert names with absurd indexes or shapes, a torch.save
file named as safetensors, a load larger than the machine's memory, a config with a million
layers and one with a billion experts of a module each. Each is refused with ``ot.CheckpointError`` before the model changes (the file beside it
is never read whole); none loads wrong weights, raises a bare Python error, or runs out of memory."""

from __future__ import annotations

import contextlib
import json
import os
import types

import pytest
import torch
from torch import nn

import offtensor as ot
from offtensor import safetensors_files as loading_files
from offtensor.loading import read as loading_read
from offtensor.model.copies import is_wrapped

safetensors_torch = pytest.importorskip("safetensors.torch")


class Tied(nn.Module):
    """An embedding and a head that share one weight (4 x 2 float32), and a scale."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(4, 2)
        self.head = nn.Linear(2, 4, bias=False)
        self.head.weight = self.embed.weight
        self.scale = nn.Parameter(torch.ones(1))


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.zeros(64))
        self.b = nn.Parameter(torch.zeros(64))


def _meta(cls):
    with torch.device("meta"):
        return cls().eval()


def _unchanged(model) -> bool:
    return all(p.is_meta and not isinstance(p, ot.OffloadedTensor) for p in model.parameters()) \
        and not is_wrapped(model)


def _refused(model, path, match, device, **kwargs) -> str:
    with pytest.raises(ot.CheckpointError, match=match) as info:
        ot.load_safetensors(model, path, budget_gb=1, device=device, **kwargs)
    assert _unchanged(model)
    return str(info.value)


# ---------------------------------------------------------------------------- tied names stored twice


def test_a_tie_stored_twice_with_different_values_is_refused_naming_both(tmp_path, device):
    # torch's load_state_dict would keep whichever name it copies last; offtensor read one name and
    # ignored the other's values, so the model silently got one of two contradicting weights.
    path = str(tmp_path / "model.safetensors")
    safetensors_torch.save_file({"embed.weight": torch.zeros(4, 2), "head.weight": torch.ones(4, 2),
                                 "scale": torch.ones(1)}, path)
    message = _refused(_meta(Tied), path, r"different values", device)
    assert "embed.weight" in message and "head.weight" in message


def test_a_tie_stored_twice_with_another_shape_is_refused_naming_the_copy(tmp_path, device):
    # The second copy's shape was never checked: a (3, 2) head beside a (4, 2) embedding loaded.
    path = str(tmp_path / "model.safetensors")
    safetensors_torch.save_file({"embed.weight": torch.zeros(4, 2), "head.weight": torch.zeros(3, 2),
                                 "scale": torch.ones(1)}, path)
    _refused(_meta(Tied), path, r"head\.weight: 'head\.weight' in .* has shape \(3, 2\)", device)


def test_a_tie_stored_twice_with_equal_values_loads(tmp_path, device):
    path = str(tmp_path / "model.safetensors")
    values = torch.arange(8.0).view(4, 2)
    safetensors_torch.save_file({"embed.weight": values, "head.weight": values.clone(), "scale": torch.ones(1)}, path)
    model = _meta(Tied)
    ot.load_safetensors(model, path, budget_gb=1, device=device)
    assert model.head.weight is model.embed.weight
    assert torch.equal(model.embed.weight.cpu(), values)


def test_a_tie_stored_twice_with_nans_in_the_same_places_loads_bit_for_bit(tmp_path, device):
    # The copies were compared with torch.equal, where NaN != NaN: two byte-identical copies of a
    # weight holding a NaN were refused as "different values".
    path = str(tmp_path / "model.safetensors")
    values = torch.arange(8.0).view(4, 2)
    values[1, 0] = float("nan")
    safetensors_torch.save_file({"embed.weight": values, "head.weight": values.clone(), "scale": torch.ones(1)}, path)
    model = _meta(Tied)
    ot.load_safetensors(model, path, budget_gb=1, device=device)
    assert model.head.weight is model.embed.weight
    assert torch.equal(model.embed.weight.cpu().view(torch.int32), values.view(torch.int32))


def test_a_tie_stored_twice_as_equal_numbers_of_other_bits_still_loads(tmp_path, device):
    # +0 and -0 are equal as numbers, as transformers compares ties: such copies loaded before the
    # bitwise check for NaNs was added, and still do (the first stored name's bytes are loaded).
    path = str(tmp_path / "model.safetensors")
    safetensors_torch.save_file({"embed.weight": torch.zeros(4, 2), "head.weight": -torch.zeros(4, 2),
                                 "scale": torch.ones(1)}, path)
    model = _meta(Tied)
    ot.load_safetensors(model, path, budget_gb=1, device=device)
    assert model.head.weight is model.embed.weight and torch.equal(model.embed.weight.cpu(), torch.zeros(4, 2))


# ---------------------------------------------------------------------------- files that change under a load


def _swap_after_header(monkeypatch, path, replacement):
    """The file at ``path`` is replaced by ``replacement`` once its header has been checked."""
    real = loading_files.read_header

    def then_replace(file):
        entries = real(file)
        if os.path.exists(replacement):
            os.replace(replacement, path)
        return entries

    monkeypatch.setattr(loading_files, "read_header", then_replace)


def test_a_file_replaced_after_its_header_was_checked_is_refused_not_read(tmp_path, device, monkeypatch):
    # The reader opened the path again: a new file of another layout was read at the old header's
    # offsets, and the model silently got bytes of its header as weights.
    path = str(tmp_path / "model.safetensors")
    safetensors_torch.save_file({"a": torch.ones(64), "b": torch.full((64,), 2.0)}, path)
    other = str(tmp_path / "other.safetensors")
    safetensors_torch.save_file({"a": torch.full((64,), 9.0), "b": torch.full((64,), 7.0)}, other,
                                metadata={"note": "x" * 40})  # a longer header: every offset moves
    _swap_after_header(monkeypatch, path, other)
    _refused(_meta(Pair), path, r"model\.safetensors.*changed since its header was read", device, threads=1)


def test_a_file_rewritten_in_place_while_being_read_is_refused(tmp_path, device, monkeypatch):
    path = str(tmp_path / "model.safetensors")
    safetensors_torch.save_file({"a": torch.ones(64), "b": torch.full((64,), 2.0)}, path)
    real = loading_read.pread_into

    def read_then_rewrite(fd, offset, dst, what):
        real(fd, offset, dst, what)
        with open(path, "r+b") as f:  # another writer zeroes the bytes not read yet
            f.seek(offset + dst.numel())
            f.write(bytes(os.path.getsize(path) - offset - dst.numel()))
        stat = os.stat(path)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # a clock tick later

    monkeypatch.setattr(loading_read, "pread_into", read_then_rewrite)
    _refused(_meta(Pair), path, r"model\.safetensors.*changed while it was read", device, threads=1)


# ---------------------------------------------------------------------------- indexes and files beside


def test_an_index_whose_weight_map_is_empty_is_a_checkpoint_error(tmp_path, device):
    # It raised a bare IndexError from the architecture check (files[0] of no files).
    # (a shard it does not name: a model.safetensors beside the index would be loaded instead, as transformers does)
    safetensors_torch.save_file({"a": torch.ones(64), "b": torch.ones(64)}, str(tmp_path / "shard.safetensors"))
    with open(tmp_path / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": {}}, f)
    _refused(_meta(Pair), str(tmp_path), r"model\.safetensors\.index\.json.*names no shard", device)


def test_a_dangling_symlink_among_the_shards_is_named_with_its_target(tmp_path, device):
    # os.open's bare "[Errno 2] No such file or directory" of a file the directory listing had just
    # given: a half-removed huggingface_hub cache (snapshots linking to deleted blobs) looks so.
    safetensors_torch.save_file({"a": torch.ones(64), "b": torch.ones(64)}, str(tmp_path / "1.safetensors"))
    os.symlink(str(tmp_path / "gone.safetensors"), str(tmp_path / "2.safetensors"))
    with pytest.raises(FileNotFoundError, match=r"offtensor: safetensors file '.*2\.safetensors' does not exist "
                                                r"\(a symlink to '.*gone\.safetensors', which does not exist\)"):
        ot.load_safetensors(_meta(Pair), str(tmp_path), budget_gb=1, device=device)


class Configured(Pair):
    """A model with a transformers-style config, so the config.json beside the files is compared."""

    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(model_type="llama")


def test_a_giant_config_json_beside_the_files_is_not_read_whole(tmp_path, device, monkeypatch):
    # The architecture check read config.json whole, whatever its size: a sparse 1 TiB file beside
    # the shards made the load allocate until the machine ran out of memory.
    safetensors_torch.save_file({"a": torch.ones(64), "b": torch.ones(64)}, str(tmp_path / "model.safetensors"))
    config = tmp_path / "config.json"
    with open(config, "wb") as f:
        f.truncate(1 << 40)  # sparse: takes no disk
    real_pread, read = os.pread, [0]

    def counted(fd, count, offset):
        chunk = real_pread(fd, count, offset)
        read[0] += len(chunk)
        assert read[0] < 1 << 30, "the load read a gigabyte: it is reading config.json whole"
        return chunk

    monkeypatch.setattr(os, "pread", counted)
    model = _meta(Configured)
    ot.load_safetensors(model, str(tmp_path), budget_gb=1, device=device)
    assert torch.equal(model.a.cpu(), torch.ones(64))


# ---------------------------------------------------------------------------- names


def test_an_expert_index_too_long_for_an_int_is_an_unexpected_tensor_not_a_bare_value_error(tmp_path, device):
    # A per-expert name's index was converted with int(): 5000 digits raised Python's "Exceeds the
    # limit (4300 digits)" ValueError, naming neither the file nor the tensor.
    transformers = pytest.importorskip("transformers")
    from test_transformers_models import _config

    model = transformers.AutoModelForCausalLM.from_config(_config("mixtral")).eval()
    model.save_pretrained(tmp_path)
    path = str(tmp_path / "model.safetensors")
    state = safetensors_torch.load_file(path)
    key = next(k for k in state if ".experts.0." in k)
    state[key.replace(".experts.0.", ".experts." + "9" * 5000 + ".")] = state.pop(key)
    safetensors_torch.save_file(state, path, metadata={"format": "pt"})
    unexpected = r"tensors the model does not have: \['model\.layers\.0\..*experts\.999"
    with pytest.raises(ot.CheckpointError, match=unexpected):
        ot.from_pretrained(tmp_path, budget_gb=1, device=device, progress=False)


def test_scalar_per_expert_tensors_are_a_checkpoint_error_naming_their_shapes(tmp_path, device):
    # Scalars in place of the per-expert tensors concatenated into a stack have no dimension to
    # concatenate along: reading their width raised a bare IndexError.
    transformers = pytest.importorskip("transformers")
    from test_transformers_models import _config

    model = transformers.AutoModelForCausalLM.from_config(_config("mixtral")).eval()
    model.save_pretrained(tmp_path)
    path = str(tmp_path / "model.safetensors")
    state = safetensors_torch.load_file(path)
    for key in [k for k in state if k.startswith("model.layers.0.") and k.endswith(".w1.weight")]:
        state[key] = torch.tensor(1.0)
    safetensors_torch.save_file(state, path, metadata={"format": "pt"})
    shapes = r"gate_up_proj: expert tensors such as .*w1\.weight.* have shapes \[\(\)\]"
    with pytest.raises(ot.CheckpointError, match=shapes):
        ot.from_pretrained(tmp_path, budget_gb=1, device=device, progress=False)


# ---------------------------------------------------------------------------- sizes


def test_a_load_larger_than_the_machines_memory_is_refused_before_anything_is_allocated(tmp_path, device, monkeypatch):
    # Host masters are allocated untouched, so each allocation succeeded however many there were;
    # the reads then faulted them in past the machine's memory, until the kernel killed the process.
    import importlib

    from offtensor import _ext

    loading_load = importlib.import_module("offtensor.loading.load")
    path = str(tmp_path / "model.safetensors")
    safetensors_torch.save_file({"a": torch.ones(64), "b": torch.ones(64)}, path)  # 512 bytes
    monkeypatch.setattr(loading_load, "physical_memory", lambda: 300, raising=False)
    allocated = []
    real_alloc = _ext.alloc_host
    monkeypatch.setattr(_ext, "alloc_host", lambda nbytes, **kw: allocated.append(nbytes) or real_alloc(nbytes, **kw))
    model = _meta(Pair)
    with pytest.raises(ot.CheckpointError, match=r"would take .*\(512 bytes\) of host memory, more than this "
                                                 r"machine's .*\(300 bytes\)"):
        ot.load_safetensors(model, path, offload_gb=1, device=device)  # every weight offloaded: host masters
    assert _unchanged(model) and allocated == []


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy_pickle"])
def test_a_torch_save_checkpoint_is_named_as_one_not_as_a_truncated_safetensors_file(tmp_path, device, zipped):
    # Its first 8 bytes, read as a header length, gave "the file is truncated or corrupt", which sent
    # users looking for a damaged download instead of a conversion.
    path = str(tmp_path / "pytorch_model.bin")
    torch.save({"a": torch.ones(64), "b": torch.ones(64)}, path, _use_new_zipfile_serialization=zipped)
    _refused(_meta(Pair), path, r"pytorch_model\.bin.* torch\.save checkpoint.*not a safetensors file", device)


def test_from_pretrained_reads_the_two_stored_copies_of_a_tie_once(tmp_path, device, monkeypatch):
    # Deciding the tie, checking the build on meta and loading each compare the copies; reading a
    # large embedding twice over three times would triple what checking costs.
    transformers = pytest.importorskip("transformers")
    from test_transformers_models import _config

    from offtensor.loading import names as loading_names

    transformers.AutoModelForCausalLM.from_config(_config("llama_tied")).save_pretrained(tmp_path)
    path = str(tmp_path / "model.safetensors")
    state = safetensors_torch.load_file(path)
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    safetensors_torch.save_file(state, path, metadata={"format": "pt"})
    reads, real = [], loading_names._read_equal
    monkeypatch.setattr(loading_names, "_read_equal", lambda *args: reads.append(args) or real(*args))
    model = ot.from_pretrained(tmp_path, budget_gb=1, device=device, progress=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert len(reads) == 1


class TooSlow(BaseException):  # not an Exception: nothing on the way turns it into a CheckpointError
    pass


@contextlib.contextmanager
def _within(seconds: float, what: str):
    import signal

    def alarm(signum, frame):
        raise TooSlow(f"{what} after {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _llama_with_layers(tmp_path, layers: int, extra=None):
    transformers = pytest.importorskip("transformers")
    from test_transformers_models import _config

    transformers.AutoModelForCausalLM.from_config(_config("llama_tied")).save_pretrained(tmp_path)
    if extra:
        path = str(tmp_path / "model.safetensors")
        safetensors_torch.save_file(safetensors_torch.load_file(path) | extra, path, metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (tmp_path / "config.json").write_text(json.dumps(config))


def test_a_config_with_a_million_layers_is_refused_before_any_layer_is_built(tmp_path, device):
    # The meta build made every layer's modules (about 3 ms and 80 KB each): a config.json giving
    # num_hidden_layers = 1,000,000 beside a 2-layer checkpoint ran for an hour, and out of memory,
    # before the files were matched against it.
    _llama_with_layers(tmp_path, 1_000_000)
    with _within(20, "from_pretrained was still building layers"):
        with pytest.raises(ot.CheckpointError, match=r"config\.json.*num_hidden_layers = 1000000.*holds \d+ tensors"):
            ot.from_pretrained(tmp_path, budget_gb=1, device=device, progress=False)


def test_empty_tensors_do_not_vouch_for_layers_of_a_config(tmp_path, device):
    # The layer count was checked against every tensor the files list: a header listing 50,000 empty
    # tensors (no data at all) let num_hidden_layers = 50,000 through, and the meta build then made
    # 50,000 layers (minutes; a million-entry header, an hour) before the files were matched.
    _llama_with_layers(tmp_path, 50_000, {f"empty.{i}": torch.empty(0) for i in range(50_000)})
    with _within(20, "from_pretrained was still building layers"):
        with pytest.raises(ot.CheckpointError, match=r"num_hidden_layers = 50000, but the checkpoint holds \d+ tensors "
                                                     r"in all that are not empty \(and 50000 empty ones\)"):
            ot.from_pretrained(tmp_path, budget_gb=1, device=device, progress=False)


def _one_byte_tensors(path, count: int) -> None:
    """A safetensors file of ``count`` one-byte tensors, its header written directly (fast)."""
    import struct

    header = json.dumps({f"t{i}": {"dtype": "U8", "shape": [1], "data_offsets": [i, i + 1]} for i in range(count)},
                        separators=(",", ":")).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + bytes(count))


@pytest.mark.parametrize("width", ["the_checkpoints", "one"])
def test_a_header_of_tiny_tensors_does_not_vouch_for_as_many_layers(tmp_path, device, width):
    # Every tensor holding a byte vouched for a layer: a shard of 300,000 one-byte tensors (a
    # million fit in a header) let num_hidden_layers = 300,000 through to a meta build of about
    # 15 minutes and 15 GB. With the config's width, the files' bytes cannot give each layer one
    # row; a config shrunk to width 1 still may not ask for more than MAX_LAYERS (past it, 20,000
    # layers show that as well as 300,000, and their header is checked in a fraction of the time).
    count = 300_000 if width == "the_checkpoints" else 20_000
    _llama_with_layers(tmp_path, count)
    _one_byte_tensors(tmp_path / "tiny.safetensors", count)
    expected = rf"num_hidden_layers = {count} layers of width 64, at least {count * 64} values.*2 file\(s\)"
    if width == "one":
        config = json.loads((tmp_path / "config.json").read_text())
        config.update(hidden_size=1, num_attention_heads=1, num_key_value_heads=1, head_dim=1, intermediate_size=1)
        (tmp_path / "config.json").write_text(json.dumps(config))
        expected = rf"num_hidden_layers = {count}, more layers than offtensor builds in one stack \(at most 4096; " \
                   rf"the 2 file\(s\) of .* list \d+ tensors\)"
    with _within(30, "from_pretrained was still building layers"):
        with pytest.raises(ot.CheckpointError, match=r"config\.json.*" + expected):
            ot.from_pretrained(tmp_path, budget_gb=1, device=device, progress=False)


# ---------------------------------------------------------------------------- paths this user may not read


@pytest.fixture(params=["chmod", "simulated"])
def deny(request, monkeypatch):
    """``deny(directory)``: this user may no longer list ``directory`` or reach anything in it. By
    ``chmod 000`` where that denies (not to root, who reads anything: skipped there), else by
    making ``os`` answer as the kernel answers such a user, EACCES."""
    denied = []
    if request.param == "chmod":
        if os.geteuid() == 0:
            pytest.skip("root reads a chmod 000 directory: the simulated case stands in")
        yield lambda d: denied.append(d) or os.chmod(d, 0)
        for d in denied:
            os.chmod(d, 0o755)  # so that tmp_path can be removed
        return

    def refused(path):
        path = os.path.abspath(os.fspath(path))
        return any(path.startswith(d + os.sep) for d in denied)

    def guard(real, inside_only=True):
        def call(path, *args, **kwargs):
            if not isinstance(path, int) and (refused(path) or not inside_only and
                                              os.path.abspath(os.fspath(path)) in denied):
                raise PermissionError(13, "Permission denied", os.fspath(path))
            return real(path, *args, **kwargs)
        return call

    for name in ("stat", "lstat", "open"):
        monkeypatch.setattr(os, name, guard(getattr(os, name)))
    monkeypatch.setattr(os, "listdir", guard(os.listdir, inside_only=False))
    yield lambda d: denied.append(os.path.abspath(d))


def test_a_directory_this_user_may_not_list_is_a_checkpoint_error_naming_it(tmp_path, device, deny):
    # os.listdir's bare PermissionError came out of the load.
    root = tmp_path / "ckpt"
    root.mkdir()
    safetensors_torch.save_file({"a": torch.ones(64), "b": torch.ones(64)}, str(root / "model.safetensors"))
    deny(str(root))
    _refused(_meta(Pair), str(root), r"cannot list the checkpoint directory '.*ckpt': Permission denied", device)


def test_a_file_in_a_directory_this_user_may_not_search_is_not_called_missing(tmp_path, device, deny):
    # os.path.exists said False, and the load said "the path does not exist" of a file that is there.
    root = tmp_path / "ckpt"
    root.mkdir()
    safetensors_torch.save_file({"a": torch.ones(64), "b": torch.ones(64)}, str(root / "model.safetensors"))
    deny(str(root))
    _refused(_meta(Pair), str(root / "model.safetensors"),
             r"cannot reach the checkpoint '.*model\.safetensors': Permission denied", device)


def test_an_index_naming_shards_this_user_may_not_reach_says_so_not_that_they_are_missing(tmp_path, device, deny):
    (tmp_path / "shards").mkdir()
    safetensors_torch.save_file({"a": torch.ones(64), "b": torch.ones(64)}, str(tmp_path / "shards" / "1.safetensors"))
    with open(tmp_path / "model.safetensors.index.json", "w") as f:
        json.dump({"weight_map": {"a": "shards/1.safetensors", "b": "shards/1.safetensors"}}, f)
    deny(str(tmp_path / "shards"))
    _refused(_meta(Pair), str(tmp_path), r"cannot reach the shard index .* names '.*shards/1\.safetensors': "
                                         r"Permission denied", device)


def test_from_pretrained_on_a_directory_this_user_may_not_read_names_it_and_the_reason(tmp_path, device, deny):
    # "not a transformers checkpoint directory (no config.json)", of a directory holding one.
    transformers = pytest.importorskip("transformers")
    from test_transformers_models import _config

    root = tmp_path / "ckpt"
    transformers.AutoModelForCausalLM.from_config(_config("llama_tied")).save_pretrained(root)
    deny(str(root))
    with pytest.raises(ot.CheckpointError, match=r"cannot reach the config '.*ckpt/config\.json': Permission denied"):
        ot.from_pretrained(root, budget_gb=1, device=device, progress=False)


@pytest.mark.parametrize("field", ["encoder_layers", "decoder_layers"])
def test_an_encoder_decoder_config_with_a_million_layers_is_refused_before_any_layer_is_built(tmp_path, device, field):
    # Only num_hidden_layers, n_layer and num_layers were checked: BART's decoder_layers =
    # 1,000,000 made the meta build run for over an hour (4 ms a layer).
    transformers = pytest.importorskip("transformers")
    config = transformers.BartConfig(vocab_size=96, d_model=32, encoder_layers=1, decoder_layers=1,
                                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, max_position_embeddings=64)
    transformers.BartForConditionalGeneration(config).save_pretrained(tmp_path)
    fields = json.loads((tmp_path / "config.json").read_text())
    fields[field] = 1_000_000
    (tmp_path / "config.json").write_text(json.dumps(fields))
    with _within(20, "from_pretrained was still building layers"):
        with pytest.raises(ot.CheckpointError, match=rf"config\.json.*{field} = 1000000.*holds \d+ tensors"):
            ot.from_pretrained(tmp_path, budget_gb=1, device=device, progress=False)


def _per_expert(tmp_path, kind: str, experts: int, stored: int = 4) -> None:
    """A tiny checkpoint of a model that builds one module per expert (``stored`` experts in its
    files), its config.json then giving ``experts`` experts."""
    transformers = pytest.importorskip("transformers")
    if kind == "switch_transformers":
        config = transformers.SwitchTransformersConfig(
            vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2, num_experts=stored,
            num_sparse_encoder_layers=1, num_sparse_decoder_layers=1)
        transformers.SwitchTransformersForConditionalGeneration(config).save_pretrained(tmp_path)
    else:
        config = transformers.NllbMoeConfig(
            vocab_size=64, d_model=16, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
            encoder_attention_heads=2, decoder_attention_heads=2, num_experts=stored, encoder_sparse_step=2,
            decoder_sparse_step=2, max_position_embeddings=64)
        transformers.NllbMoeForConditionalGeneration(config).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_experts"] = experts
    (tmp_path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("kind", ["switch_transformers", "nllb_moe"])
def test_a_config_with_a_billion_experts_of_a_module_each_is_refused_within_seconds(tmp_path, device, kind):
    # Expert counts were not bounded before the meta build, and these models build one module per
    # expert: num_experts = 20,000 beside a 4-expert checkpoint built every expert first (35 s);
    # 10**9 ran until memory was gone. The build is now stopped once it registers more parameters
    # than the files can give a tensor each.
    from offtensor import _ext
    from offtensor.loading.registrations import counted

    _per_expert(tmp_path, kind, 10**9)
    live = _ext.live_host_bytes()
    with _within(5, "from_pretrained was still building experts"):
        with pytest.raises(ot.CheckpointError, match=r"config\.json' \(check num_experts = 1000000000\) makes the "
                                                     r"model register more than \d+ parameters, but the 1 file\(s\) "
                                                     r"of .* hold \d+ tensors.*stopped after \w+Experts\.expert_\d+"):
            ot.from_pretrained(tmp_path, budget_gb=1, device=device, progress=False)
    assert _ext.live_host_bytes() == live
    assert counted.hook is None and not counted.blocks  # (the counting hooks go with the build)


def test_a_per_expert_checkpoint_beyond_the_fixed_allowance_loads(tmp_path, device):
    # The other side of the bound: 300 experts (1,200 expert parameters, more than the allowance of
    # 1,024 a checkpoint of few tensors gets), every one stored, load as transformers loads them.
    transformers = pytest.importorskip("transformers")
    from offtensor.loading.registrations import PARAMETER_ALLOWANCE

    _per_expert(tmp_path, "switch_transformers", 300, stored=300)
    reference = transformers.SwitchTransformersForConditionalGeneration.from_pretrained(tmp_path).eval()
    assert sum(1 for n, _ in reference.named_parameters() if ".expert_" in n) > PARAMETER_ALLOWANCE
    model = ot.from_pretrained(tmp_path, budget_gb=1, device=device, progress=False)
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        got = model(input_ids=ids, decoder_input_ids=ids).logits.cpu()
        assert torch.equal(got, reference(input_ids=ids, decoder_input_ids=ids).logits)


def test_a_config_repeating_modules_without_parameters_is_refused_within_seconds(tmp_path, device):
    # Modules are counted too: a field that repeats parameterless modules (here a model class's
    # num_taps) would build them all, whatever the files hold.
    transformers = pytest.importorskip("transformers")

    class Tapped(transformers.LlamaForCausalLM):
        def __init__(self, config):
            super().__init__(config)
            self.taps = nn.ModuleList(nn.Identity() for _ in range(config.num_taps))

    _llama_with_layers(tmp_path, 2)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"num_taps": 10**9}))
    with _within(5, "from_pretrained was still building modules"):
        with pytest.raises(ot.CheckpointError, match=r"config\.json' \(check num_taps = 1000000000\) makes the model "
                                                     r"register more than \d+ modules.*stopped after ModuleList\.\d+"):
            ot.from_pretrained(tmp_path, budget_gb=1, device=device, progress=False, model_class=Tapped)


def test_a_header_of_tiny_tensors_vouches_for_no_more_parameters_than_the_ceiling(tmp_path, device, monkeypatch):
    # Each tensor a header lists vouches for two parameters, and a header holds a million one-byte
    # tensors: past MAX_PARAMETERS (lowered here, so that the test builds a few hundred) the build
    # is stopped whatever the files list.
    from offtensor.loading import registrations

    monkeypatch.setattr(registrations, "MAX_PARAMETERS", 300)
    _per_expert(tmp_path, "switch_transformers", 10**9)
    _one_byte_tensors(tmp_path / "tiny.safetensors", 5000)
    with _within(5, "from_pretrained was still building experts"):
        with pytest.raises(ot.CheckpointError, match=r"num_experts = 1000000000\) makes the model register more than "
                                                     r"300 parameters, more than offtensor builds for any checkpoint "
                                                     r"\(at most 300; the 2 file\(s\) list 5061 tensors\)"):
            ot.from_pretrained(tmp_path, budget_gb=1, device=device, progress=False)
