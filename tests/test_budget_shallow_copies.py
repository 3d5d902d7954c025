"""``copy.copy`` of a wrapped model is a second name for the same modules and weights: it shares the
original's pager, stats and step hook, unwrapping either name leaves both plain, wrapping it again
is refused naming the shared wrap, and deep and shallow copies of each other, pickles and an
orphaned shallow copy each get a pager of their own or share one as the original's would."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn

import offtensor as ot
from offtensor.model import copies as _copies
from offtensor.model.copies import is_wrapped, state_of

from test_budget_and_tiling import _weight_bytes

GiB = 1 << 30


# ---------------------------------------------------------------------------- copy.copy: a second name


def _wrapped_pair(device):
    """A wrapped model, the same model unwrapped, an input."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)).to(device)
    reference = copy.deepcopy(model)
    ot.wrap_model(model, budget_gb=0.7 * _weight_bytes(model) / GiB, device=device)
    return model, reference, torch.randn(3, 64, device=device)


def _same_outputs(x, reference, *models) -> bool:
    with torch.no_grad():
        want = reference(x)
        return all(torch.equal(m(x), want) for m in models)


def test_a_shallow_copy_of_a_wrapped_model_shares_its_pager_and_stats_and_leaves_its_step_hook(device):
    # The copy's module, parameter and hook tables are the original's dicts: before, its first use
    # adopted it as a deep copy, which took the original's step hook and masters to a new pager
    # (the original's stats then showed 0 page-ins while its forwards still paged).
    model, reference, x = _wrapped_pair(device)
    state = state_of(model)
    twin = copy.copy(model)
    assert twin._modules is model._modules and twin._forward_pre_hooks is model._forward_pre_hooks
    assert _same_outputs(x, reference, twin, model)
    assert is_wrapped(model) and is_wrapped(twin) and state_of(twin) is state_of(model) is state
    assert isinstance(model._forward_pre_hooks.get(state.step_hook.id), _copies.StepHook)
    assert all(p.pager is state.pager for p in model.parameters() if isinstance(p, ot.OffloadedTensor))
    ot.reset_stats(twin)
    for forward, page_ins in ((model, 0), (twin, 0)):
        with torch.no_grad():
            forward(x)
        s, t = ot.stats(model), ot.stats(twin)
        assert s.page_ins > page_ins and s.page_ins == t.page_ins and s.bytes_h2d == t.bytes_h2d
        assert s.budget_bytes == t.budget_bytes and s.offloaded_bytes == t.offloaded_bytes
        assert s.peak_device_bytes <= s.budget_bytes
        page_ins = s.page_ins
    assert ot.stats(model).page_ins == 4  # two forwards, two offloaded weights each, none left cached


@pytest.mark.parametrize("which", ["copy", "original"])
def test_unwrapping_either_name_of_a_shallow_copy_leaves_both_plain(device, which):
    model, reference, x = _wrapped_pair(device)
    twin = copy.copy(model)
    with torch.no_grad():
        twin(x)  # (before, this adopted the copy: unwrapping the original then found it not wrapped)
    ot.unwrap_model(twin if which == "copy" else model)
    for name in (model, twin):
        assert not is_wrapped(name) and type(name) is nn.Sequential
        assert not name._forward_pre_hooks and not any(m._state_dict_hooks for m in name.modules())
        assert [type(m) for m in name] == [nn.Linear, nn.ReLU, nn.Linear]
        assert not any(isinstance(p, ot.OffloadedTensor) for p in name.parameters())
    assert _same_outputs(x, reference, twin, model)
    ot.wrap_model(twin, budget_gb=0.7 * _weight_bytes(model) / GiB, device=device)  # wrapped again through the copy
    assert state_of(model) is state_of(twin) and _same_outputs(x, reference, model, twin)
    assert ot.stats(model).page_ins == ot.stats(twin).page_ins > 0


def test_wrapping_a_shallow_copy_of_a_wrapped_model_is_refused_naming_the_shared_wrap(device):
    model, _, _ = _wrapped_pair(device)
    budget = ot.stats(model).budget_bytes
    with pytest.raises(RuntimeError, match=rf"copy.copy of a wrapped Sequential .* \(budget {budget} bytes"):
        ot.wrap_model(copy.copy(model), budget_gb=1, device=device)
    assert is_wrapped(model) and ot.stats(model).budget_bytes == budget


def test_deep_and_shallow_copies_of_each_other_pickles_and_an_orphaned_shallow_copy(device, tmp_path):
    model, reference, x = _wrapped_pair(device)
    original = ot.stats(model)
    deep_of_shallow = copy.deepcopy(copy.copy(model))  # a deep copy: its own pager, as of the original
    shallow_of_deep = copy.copy(copy.deepcopy(model))  # a second name for that deep copy
    torch.save(copy.copy(model), tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)  # as a deep copy
    assert _same_outputs(x, reference, deep_of_shallow, shallow_of_deep, loaded, model)
    pagers = {id(state_of(m).pager) for m in (model, deep_of_shallow, shallow_of_deep, loaded)}
    assert len(pagers) == 4 and state_of(model).pager is model[0].weight.pager
    for m in (deep_of_shallow, shallow_of_deep, loaded):
        s = ot.stats(m)
        assert s.offloaded_bytes == original.offloaded_bytes and s.budget_bytes == original.budget_bytes
    assert ot.stats(model).offloaded_bytes == original.offloaded_bytes and ot.stats(model).page_ins == 2
    # The deep copy, adopted through its shallow copy's forward, is that copy's wrap under both names.
    deep = copy.deepcopy(model)
    second = copy.copy(deep)
    assert _same_outputs(x, reference, second) and state_of(deep) is state_of(second)
    assert _same_outputs(x, reference, deep) and ot.stats(deep).page_ins == ot.stats(second).page_ins == 4
    # A shallow copy that outlives its original has no one to share with: adopted on a pager of its own.
    orphan = copy.copy(model)
    del model
    gc.collect()
    assert _same_outputs(x, reference, orphan) and is_wrapped(orphan) and ot.stats(orphan).page_ins == 2
    ot.unwrap_model(orphan)
    assert not is_wrapped(orphan) and _same_outputs(x, reference, orphan)
