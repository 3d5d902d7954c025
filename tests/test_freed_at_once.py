"""A weight's host master is freed the moment its last reference dies, not at the next garbage
collection: the hand-made offloaders offtensor replaces needed ``gc.collect()`` against running out
of memory. Each test runs with Python's cyclic collector off, so anything kept alive only by a
reference cycle (an error object kept in a frame its own traceback holds, with that frame's
callers: the model, its groups, the tensors they name) shows up as a live weak reference."""

from __future__ import annotations

import contextlib
import gc
import warnings
import weakref

import pytest
import torch
from torch import nn

import offtensor as ot

GiB = 1 << 30


@contextlib.contextmanager
def _no_cyclic_collection():
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _wrapped(budget_fraction: float, device) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the narrowest budget warns about narrow tiles
        ot.wrap_model(model, budget_gb=total * budget_fraction / GiB, device=device, policy={"offload": ["*"]})
    assert isinstance(model[0].weight, ot.OffloadedTensor)
    return model


def _replace(model: nn.Module, how: str) -> None:
    if how == "assignment":
        model[0].weight = nn.Parameter(torch.randn(256, 256))
    elif how == "assigned load":
        model.load_state_dict({k: torch.randn(v.shape) for k, v in model.state_dict().items()}, assign=True)
    elif how == "submodule swap":
        model[0] = nn.Linear(256, 256)
    elif how == "cast":
        model.half()


# 0.9: every weight paged whole; 0.3: in tiles (placement tried whole working sets first and
# caught their BudgetError); 0.03: in tiles of one slice (two plans failed before it).
BUDGETS = [0.9, 0.3, 0.03]


@pytest.mark.parametrize("how", ["assignment", "assigned load", "submodule swap", "cast"])
@pytest.mark.parametrize("fraction", BUDGETS)
def test_a_replaced_weights_master_is_freed_without_a_garbage_collection(fraction, how, device):
    with _no_cyclic_collection():
        model = _wrapped(fraction, device)
        old = model[0].weight
        # A cast keeps the Parameter object and gives it a new master; the others replace both.
        refs = ([] if how == "cast" else [weakref.ref(old)]) + [weakref.ref(old._master)]
        del old
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _replace(model, how)
        assert all(r() is None for r in refs), (fraction, how)
        with torch.no_grad():  # and the model still runs
            model(torch.randn(2, 256, device=device, dtype=model[1].weight.dtype))


@pytest.mark.parametrize("fraction", BUDGETS)
def test_a_deleted_wrapped_models_masters_are_freed_without_a_garbage_collection(fraction, device):
    with _no_cyclic_collection():
        model = _wrapped(fraction, device)
        refs = [weakref.ref(model)] + [weakref.ref(p._master) for p in model.parameters()]
        del model
        assert all(r() is None for r in refs), fraction


@pytest.mark.parametrize("fraction", BUDGETS)
def test_a_model_loaded_from_safetensors_frees_its_masters_without_a_garbage_collection(fraction, device, tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    path = tmp_path / "model.safetensors"
    safetensors.save_file({k: v.contiguous() for k, v in plain.state_dict().items()}, str(path))
    total = sum(p.numel() * p.element_size() for p in plain.parameters())
    with _no_cyclic_collection():
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ot.load_safetensors(model, path, budget_gb=total * fraction / GiB, device=device, policy={"offload": ["*"]})
        refs = [weakref.ref(p._master) for p in model.parameters()]
        del model
        assert all(r() is None for r in refs), fraction
