"""Tied weights of a transformers checkpoint, decided as transformers decides them when it loads
one: the config's ties (``all_tied_weights_keys``, target -> source), each checked against what
the files hold.

transformers 5 (``PreTrainedModel.tie_weights(missing_keys=...)``) builds the model untied, loads
every stored tensor, then for each tie, in order:

- source stored, target not: the target becomes the source;
- target stored, source not: the source becomes the target (the tie is kept, the other way round);
- both stored: tied only if their values are equal (``torch.equal`` in the model's dtype); else the
  tie is dropped (``all_tied_weights_keys`` loses it) and each keeps its own stored values;
- neither stored: tied to another target of the same source that is stored, else tied anyway
  (transformers initializes both randomly; offtensor's loader then refuses the missing weight).

``decide`` runs that on a model built on meta and returns the ties it made, which ``apply`` replays
on another build of the same config, so the files are compared once.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from .names import pieces_by_name, stored_equal


def tie_pairs(model: nn.Module) -> list:
    """(target, source) names of the ties the model's config declares, in transformers' order."""
    keys = getattr(model, "all_tied_weights_keys", None)
    if keys is None and hasattr(model, "get_expanded_tied_weights_keys"):
        keys = model.get_expanded_tied_weights_keys(all_submodels=True)
    return list((keys or {}).items())


def decide(model: nn.Module, entries: dict) -> list:
    """Tie ``model``'s weights (parameters on meta) as transformers would for the files ``entries``
    (key -> FileTensor); returns what it did, for ``apply``: ``(target, source)`` for a tie made,
    ``(target, None)`` for one dropped. A tie the files contradict is dropped with a warning, as
    transformers drops it."""
    pairs = tie_pairs(model)
    if not pairs:
        return []
    _untie(model, pairs)
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    names |= {n for n, _ in model.named_buffers(remove_duplicate=False)}
    pieces, _, _ = pieces_by_name(entries, model, names)
    stored = set(pieces)
    made = []
    for i, (target, source) in enumerate(pairs):
        if source in stored and target in stored:
            if not stored_equal(pieces[source], pieces[target], _tensor(model, target).dtype):
                warnings.warn(
                    f"offtensor: the config ties {target!r} to {source!r}, but the checkpoint stores both with "
                    f"different values: loading them untied, as transformers does (set tie_word_embeddings=False "
                    f"in config.json to say so)", UserWarning, stacklevel=3)
                model.all_tied_weights_keys.pop(target, None)
                made.append((target, None))
                continue
        elif target in stored:
            target, source = source, target
        elif source not in stored:
            source = next((t for t, s in pairs[i + 1:] if s == source and t in stored), source)
        _tie(model, target, source)
        made.append((target, source))
        stored.add(target)
    return made


def apply(model: nn.Module, made: list) -> None:
    """Make on ``model`` (another build of the same config) the ties ``decide`` made and dropped."""
    pairs = tie_pairs(model)
    if not pairs:
        return
    _untie(model, pairs)
    for target, source in made:
        if source is None:
            model.all_tied_weights_keys.pop(target, None)
        else:
            _tie(model, target, source)


def _untie(model: nn.Module, pairs) -> None:
    """Give every tie's target a meta tensor of its own, as transformers builds the model untied."""
    for target, _ in pairs:
        parent, name = _slot(model, target)
        old = getattr(parent, name)
        fresh = torch.empty_like(old, device="meta")
        if isinstance(old, nn.Parameter):
            fresh = nn.Parameter(fresh, requires_grad=old.requires_grad)
        setattr(parent, name, fresh)


def _tie(model: nn.Module, target: str, source: str) -> None:
    parent, name = _slot(model, target)
    tensor = _tensor(model, source)
    setattr(parent, name, tensor)
    if hasattr(model, "_adjust_bias"):
        model._adjust_bias(parent, tensor)


def _tensor(model: nn.Module, name: str) -> torch.Tensor:
    parent, attr = _slot(model, name)
    return getattr(parent, attr)


def _slot(model: nn.Module, name: str):
    parent, _, attr = name.rpartition(".")
    return (model.get_submodule(parent) if parent else model), attr
