"""config.json, checked before anything is allocated from it: the JSON and the fields transformers
would trip over (a negative size, no attention heads, a dtype torch does not have), then a build on
meta whose shapes are matched against the checkpoint's, so that an absurd size fails by arithmetic,
never by allocating it. Every failure is a ``CheckpointError`` naming config.json and the field.
"""

from __future__ import annotations

import contextlib
import json
import os
import re

import torch

from ..model.groups import collect_groups
from ..safetensors_files import MAX_CONFIG_BYTES, CheckpointError, physical_memory, read_small_file, shape_text
from .names import match, pieces_by_name
from .registrations import Registrations, counted
from .ties import decide as decide_ties

# Fields that hold a size or a count (hidden_size, num_hidden_layers, vocab_size, head_dim,
# n_routed_experts...): ints at least -1, the "none" some configs write (chunk_size=-1).
_SIZE = re.compile(r"(^|_)(size|sizes|dim|embeddings|layers|experts|heads|rank|channels|length|vocab)(_|$)|^(num|n)_")
# Counts of attention heads: at least 1 (sizes are divided by them).
_HEADS = re.compile(r"(^|_)heads$|^n_head$")


def read_config(root: str, trust_remote_code: bool):
    """The transformers config of the checkpoint directory ``root``, its config.json checked first."""
    import transformers

    path = os.path.join(root, "config.json")
    raw = read_small_file(path, "config", MAX_CONFIG_BYTES, "a transformers config", "config.json")
    try:
        fields = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"offtensor: {path!r} is not JSON ({e}): the checkpoint's config is corrupt") from None
    if not isinstance(fields, dict):
        raise CheckpointError(f"offtensor: {path!r} is a JSON {type(fields).__name__}, not the object of fields a "
                              f"transformers config is: the checkpoint's config is corrupt")
    _check_fields(fields, path, "")
    try:
        return transformers.AutoConfig.from_pretrained(root, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers' own validation: unknown model_type, a field of the wrong type...
        raise CheckpointError(f"offtensor: transformers refuses {path!r}: {type(e).__name__}: {_first_lines(e)}") from e


def _check_fields(fields: dict, path: str, prefix: str) -> None:
    """The fields of the config and of its model sub-configs (objects with a model_type); other
    objects (a quantization config, rope parameters) have their own meanings and are not checked."""
    is_config = not prefix or "model_type" in fields
    for key, value in fields.items():
        name = prefix + str(key)
        if isinstance(value, dict):
            _check_fields(value, path, name + ".")
            continue
        if not is_config:
            continue
        if key == "dtype" or (key == "torch_dtype" and "dtype" not in fields):  # the one transformers reads
            if isinstance(value, str) and value != "auto" and not isinstance(getattr(torch, value, None), torch.dtype):
                raise CheckpointError(f"offtensor: {path!r} gives {name} = {value!r}, which is not a torch dtype "
                                      f"(float32, bfloat16, float16...): the checkpoint's config is corrupt")
            continue
        if type(value) is not int or type(key) is not str or not _SIZE.search(key):
            continue
        if _HEADS.search(key) and value < 1:
            raise CheckpointError(f"offtensor: {path!r} gives {name} = {value}: a model needs at least one attention "
                                  f"head (sizes are divided by their count): the checkpoint's config is corrupt")
        if value < -1:
            raise CheckpointError(f"offtensor: {path!r} gives {name} = {value}: a size or count cannot be "
                                  f"negative: the checkpoint's config is corrupt")


@contextlib.contextmanager
def building(root: str, config):
    """Around building a model from ``config``: an error is a CheckpointError naming config.json and
    the fields whose values the error mentions."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as e:
        path = os.path.join(root, "config.json")
        numbers = set(re.findall(r"-?\d+", str(e)))
        if isinstance(e, ZeroDivisionError):
            numbers.add("0")
        named = [(n, v) for n, v in _int_fields(config) if str(v) in numbers or n.rpartition(".")[2] in str(e)]
        named = [f"{n} = {v}" for n, v in ([nv for nv in named if nv[1] <= 0] or named)]  # a zero or negative first
        which = f" (check {', '.join(named[:4])})" if named else ""
        raise CheckpointError(f"offtensor: transformers cannot build a model from {path!r}{which}: "
                              f"{type(e).__name__}: {_first_lines(e)}") from e


def check_on_meta(build, config, entries: dict, root: str, strict: bool):
    """Build the model from ``config`` with every tensor on meta (``build(config)``: nothing is
    allocated, whatever sizes config.json gives), decide its ties and match it against the files
    (``entries``): a size the files do not have, or buffers larger than this machine's memory, fail
    here by arithmetic, naming config.json's field; a build registering more parameters or modules
    than the files can fill is stopped as it goes (``registrations.py``). Returns the ties for the
    real build, or None when the model's own ``__init__`` cannot run on meta (it reads a value:
    ``.item()``)."""
    too_many = _layers_beyond_files(config, entries, root)
    if too_many:
        raise CheckpointError(f"offtensor: cannot load {root} (nothing was built): " + "; ".join(too_many))
    try:
        with torch.device("meta"), counted_build(entries, config, root):
            skeleton = build(config)
    except CheckpointError as e:
        if "meta" in str(e.__cause__):
            return None
        raise
    ties = decide_ties(skeleton, entries)
    names = {n for n, _ in skeleton.named_parameters(remove_duplicate=False)}
    names |= {n for n, _ in skeleton.named_buffers(remove_duplicate=False)}
    pieces, _, _ = pieces_by_name(entries, skeleton, names)
    problems = _computed_buffers(skeleton, pieces, config, root)
    _, mismatches = match(entries, skeleton, collect_groups(skeleton), True, root, strict)
    problems += shape_problems(skeleton, pieces, config, root) + mismatches if mismatches else []
    if problems:
        raise CheckpointError(f"offtensor: cannot load {root} into {type(skeleton).__name__} (nothing was "
                              f"allocated):\n  " + "\n  ".join(problems))
    return ties


def counted_build(entries: dict, config, root: str):
    """``with counted_build(...):`` stops this thread's build from ``config`` once it registers more
    parameters or modules than the files (``entries``) can fill (``registrations.py``)."""
    return counted(Registrations(entries, root, lambda: _int_fields(config)))


# The layer counts transformers builds from: ``num_hidden_layers`` and its other names (``n_layer``,
# ``num_layers``), an encoder-decoder's ``encoder_layers`` / ``decoder_layers`` /
# ``num_decoder_layers``, a sub-stack's ``decoder_num_hidden_layers``. (``max_window_layers`` is
# no count of layers built, and may exceed a tiny checkpoint's tensors.)
_LAYER_COUNT = re.compile(r"(^|\.)(n_layers?|([a-z_]*_)?num_[a-z_]*layers|([a-z_]*_)?(encoder|decoder)_layers)$")


# Above this many layers in one count, the meta build alone (milliseconds and tens of KB a layer)
# takes minutes and gigabytes, whatever the files hold: no transformers model comes near it (the
# deepest published ones have a few hundred), and a header can list a million tiny tensors.
MAX_LAYERS = 4096
# The width every layer of a model spans (a norm's weight, a projection's rows): each layer holds
# at least this many values, and a stored value takes at least one bit.
_WIDTH = ("hidden_size", "d_model", "n_embd", "n_embed", "embed_dim")


def _layers_beyond_files(config, entries: dict, root: str) -> list:
    """Layer counts the files cannot hold. Sizes cost the meta build only arithmetic, but each layer
    is built, modules and all (milliseconds and tens of KB each): a config.json giving a million
    layers would run for an hour, out of memory, before its weights were matched against the files.
    So a count is refused where it is more than the tensors in the files that hold bytes (every
    layer has weights of its own; a million empty entries vouch for nothing), more than the files'
    bits can give each layer the config's width in, or more than ``MAX_LAYERS``."""
    stored = sum(1 for e in entries.values() if e.nbytes)
    bits = 8 * sum(e.nbytes for e in entries.values())
    empty = f" that are not empty (and {len(entries) - stored} empty ones)" if stored < len(entries) else ""
    config_file = repr(os.path.join(root, "config.json"))
    files = f"{len({e.file for e in entries.values()})} file(s) of {root!r}"
    fields = dict(_int_fields(config))
    problems = []
    for name, value in fields.items():
        if not _LAYER_COUNT.search(name) or value <= 0:
            continue
        prefix = name.rpartition(".")[0] + "." if "." in name else ""
        width = next((fields[prefix + w] for w in _WIDTH if fields.get(prefix + w, 0) > 0), 1)
        if value > stored:
            problems.append(f"{config_file} gives {name} = {value}, but the checkpoint holds {stored} tensors in all"
                            f"{empty}, fewer than one a layer: the config is not this checkpoint's")
        elif value * width > bits:
            problems.append(f"{config_file} gives {name} = {value} layers of width {width}, at least {value * width} "
                            f"values at one bit or more each, but the {files} hold {bits // 8} bytes of tensors in "
                            f"all: the config is not this checkpoint's")
        elif value > MAX_LAYERS:
            problems.append(f"{config_file} gives {name} = {value}, more layers than offtensor builds in one stack "
                            f"(at most {MAX_LAYERS}; the {files} list {stored} tensors): building each layer's "
                            f"modules would take minutes and gigabytes before a weight is matched")
    return problems


def _computed_buffers(skeleton, pieces: dict, config, root: str) -> list:
    """Drop from ``skeleton`` the buffers the files do not hold: the real build computes them (rotary
    frequencies), so the loader needs no values for them. A problem if together they would not fit
    in this machine's memory (the real build would allocate them)."""
    computed = []
    for prefix, module in skeleton.named_modules(remove_duplicate=False):
        for name, buffer in list(module._buffers.items()):
            full = f"{prefix}.{name}" if prefix else name
            if buffer is not None and full not in pieces:
                computed.append((full, buffer))
                del module._buffers[name]
    nbytes = sum({id(b): b.numel() * b.element_size() for _, b in computed}.values())
    memory = physical_memory()
    if memory is None or nbytes <= memory:
        return []
    name, largest = max(computed, key=lambda nb: nb[1].numel() * nb[1].element_size())
    fields = [f"{n} = {v}" for n, v in _int_fields(config) if v in set(largest.shape) and v > 1]
    return [f"{os.path.join(root, 'config.json')!r} makes the buffers the model computes at build {nbytes} bytes, more "
            f"than this machine's {memory} bytes of memory: {name!r} alone is {tuple(largest.shape)}"
            f"{' (' + ', '.join(fields[:3]) + ')' if fields else ''}"]


def shape_problems(model, pieces: dict, config, root: str) -> list:
    """For each weight of ``model`` (built on meta) stored whole in the files with another shape,
    the config.json fields whose values are the dimensions the files do not have."""
    path = os.path.join(root, "config.json")
    fields = _int_fields(config)
    problems = []
    for name, t in model.named_parameters(remove_duplicate=False):
        found = pieces.get(name)
        if not found or len(found) != 1 or found[0].index is not None or found[0].source.shape == tuple(t.shape):
            continue
        stored = found[0].source.shape
        dims = {d for d in t.shape if d not in stored}
        named = [f"{n} = {v}" for n, v in fields if v in dims and v > 1]
        if named:
            problems.append(f"{path!r} gives {', '.join(named[:3])}, which makes {name!r} {tuple(t.shape)} "
                            f"({t.numel() * t.element_size()} bytes); the checkpoint stores {shape_text(stored)}")
    return problems


def _int_fields(config) -> list:
    """(dotted name, value) of every int field of a transformers config, sub-configs included."""
    try:
        fields = config.to_dict()
    except Exception:
        return []
    out = []

    def walk(d, prefix):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            elif type(v) is int and isinstance(k, str):
                out.append((prefix + k, v))

    walk(fields, "")
    return out


def _first_lines(e: BaseException) -> str:
    text = " ".join(line.strip() for line in str(e).splitlines()[:3] if line.strip())
    return text[:400]
