"""``unwrap_model`` and refusals: unwrap restores plain tensors with the same identities and outputs
and removes every hook, wrap and unwrap change nothing in ``nn.Module`` or torch's global hooks and
give every module its class back; wrapping twice, around a wrapped submodule or with bad arguments
is refused with a clear error. The tiny model and its helpers are test_wrap.py's."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import offtensor as ot
from offtensor.pager import resolve_device

from test_wrap import HIDDEN, TinyLM, VOCAB, _budget_gb, _ids, _model, _run, _tensors_by_name, pair


# ---------------------------------------------------------------------------- unwrap, twice, bad inputs


def test_unwrap_restores_plain_tensors_with_the_same_identities_and_outputs(pair, device):
    model, reference = pair
    before = _tensors_by_name(model)
    ids = _ids(device)
    wrapped_out = _run(model, ids)
    ot.unwrap_model(model)
    after = _tensors_by_name(model)
    assert all(after[n] is t for n, t in before.items())
    assert model.lm_head.weight is model.embed_tokens.weight
    for name, t in after.items():
        assert type(t) in (torch.Tensor, nn.Parameter) and not isinstance(t, ot.OffloadedTensor), name
        assert t.device == resolve_device(device), name
    assert torch.equal(_run(model, ids), wrapped_out)
    assert torch.equal(_run(model, ids), _run(reference, ids))
    with pytest.raises(ValueError, match="not wrapped"):
        ot.stats(model)
    # A new parameter assigned after unwrapping is left alone.
    plain = nn.Parameter(torch.randn(HIDDEN, HIDDEN))
    model.layers[0].self_attn.q_proj.weight = plain
    assert model.layers[0].self_attn.q_proj.weight is plain
    ot.wrap_model(model, budget_gb=_budget_gb(model, 0.4), device=device)


def test_wrapping_twice_raises(pair, device):
    model, _ = pair
    with pytest.raises(RuntimeError, match="already wrapped"):
        ot.wrap_model(model, budget_gb=1, device=device)


def _two_linears():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))


def test_wrapping_a_model_around_a_wrapped_submodule_is_refused_naming_it(device):
    # Wrapping the parent of a submodule wrapped on its own was accepted: the submodule's weights
    # stayed on its own pager, outside the parent's budget, and its own stats went stale; likewise
    # a module shared with another wrapped model, whose weights moved to the new pager.
    model, reference = _two_linears(), _two_linears().to(device)
    ot.wrap_model(model[0], budget_gb=32 * 1024 / 2**30, device=device, policy={"offload": ["*"]})
    with pytest.raises(RuntimeError, match=r"Linear '0' of this Sequential is wrapped on its own \(budget 32768 bytes"
                                           r".*ot.unwrap_model\(model.get_submodule\('0'\)\)"):
        ot.wrap_model(model, budget_gb=80 * 1024 / 2**30, device=device, policy={"offload": ["*"]})
    assert not isinstance(model[2].weight, ot.OffloadedTensor) and ot.stats(model[0]).budget_bytes == 32 * 1024
    shared = nn.Sequential(model[0])  # a second model holding the wrapped submodule
    with pytest.raises(RuntimeError, match=r"Linear '0' of this Sequential is wrapped on its own"):
        ot.wrap_model(shared, budget_gb=1, device=device)
    ot.unwrap_model(model[0])
    ot.wrap_model(model, budget_gb=80 * 1024 / 2**30, device=device, policy={"offload": ["*"]})
    with pytest.raises(RuntimeError, match=r"Linear '0' of this Sequential is a module of another wrapped model, a "
                                           r"Sequential \(budget 81920 bytes"):
        ot.wrap_model(shared, budget_gb=1, device=device)
    with pytest.raises(RuntimeError, match=r"this Linear is a module of a wrapped Sequential \(budget 81920 bytes"):
        ot.wrap_model(model[2], budget_gb=1, device=device)
    x = torch.randn(3, 64, device=device)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    s = ot.stats(model)
    assert s.peak_device_bytes <= s.budget_bytes


def test_assigning_a_module_wrapped_on_its_own_into_a_wrapped_model_is_refused(device):
    # It was accepted: its weights moved to the model's pager while it stayed wrapped on its own,
    # with its own pager, hooks and stats, and what was later assigned into it went to that pager.
    model = _two_linears()
    ot.wrap_model(model, budget_gb=80 * 1024 / 2**30, device=device, policy={"offload": ["*"]})
    other = nn.Linear(64, 64)
    ot.wrap_model(other, budget_gb=8 * 1024 / 2**30, device=device, policy={"offload": ["*"]})
    pager = other.weight._master.pager
    for assign in (lambda: setattr(model, "extra", other), lambda: model.add_module("extra", other),
                   lambda: model.append(nn.Sequential(other))):
        with pytest.raises(RuntimeError, match=r"Linear .*is wrapped on its own \(budget 8192 bytes.*before assigning "
                                               r"it into this wrapped model"):
            assign()
        assert not hasattr(model, "extra") and len(model) == 3
        assert other.weight._master.pager is pager
    ot.unwrap_model(other)
    model.extra = other  # placed under the model's budget, as any new submodule
    assert isinstance(other.weight, ot.OffloadedTensor) and other.weight._master.pager is model[0].weight._master.pager


@pytest.mark.parametrize("budget", [-1, -0.5, float("nan"), "1"])
def test_bad_budget_raises(device, budget):
    with pytest.raises((ValueError, TypeError), match="budget_gb"):
        ot.wrap_model(_model(), budget_gb=budget, device=device)


def test_negative_offload_gb_raises(device):
    with pytest.raises(ValueError, match="offload_gb"):
        ot.wrap_model(_model(), offload_gb=-1, device=device)


def test_non_module_raises():
    with pytest.raises(TypeError, match="nn.Module"):
        ot.wrap_model({"weight": torch.zeros(2)}, budget_gb=1)


def test_meta_parameters_raise_naming_the_parameter(device):
    with torch.device("meta"):
        model = TinyLM()
    with pytest.raises(ValueError, match=r"embed_tokens\.weight.*meta|meta.*embed_tokens\.weight"):
        ot.wrap_model(model, budget_gb=1, device=device)


@pytest.mark.parametrize("bad", ["cuda:64", "npu", "not a device"])
def test_nonexistent_device_raises(bad):
    with pytest.raises(ValueError, match="device"):
        ot.wrap_model(_model(), budget_gb=1, device=bad)


def test_unwrap_removes_every_hook_it_added(device):
    model = _model()
    ot.wrap_model(model, budget_gb=_budget_gb(model, 0.4), device=device)
    ot.unwrap_model(model)
    for name, module in model.named_modules():
        assert not module._forward_pre_hooks, name
        assert not module._load_state_dict_post_hooks, name


def _module_machinery():
    """Everything torch keeps process-wide about modules: nn.Module's attributes and the global
    registration hooks."""
    from torch.nn.modules import module as module_mod

    hooks = (module_mod._global_parameter_registration_hooks, module_mod._global_buffer_registration_hooks,
             module_mod._global_module_registration_hooks)
    return dict(vars(nn.Module)), [dict(h) for h in hooks]


def test_wrap_and_unwrap_change_nothing_in_nn_module_and_give_every_module_its_class_back(device):
    pristine = {name: getattr(nn.Module, name).__module__
                for name in ("__setattr__", "__delattr__", "register_parameter", "register_buffer", "add_module")}
    assert set(pristine.values()) == {"torch.nn.modules.module"}
    before = _module_machinery()
    model = _model()
    classes = {name: type(m) for name, m in model.named_modules()}
    ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0)).to(device)
    expected = _run(copy.deepcopy(model).to(device), ids)
    ot.wrap_model(model, budget_gb=_budget_gb(model, 0.3), device=device)
    assert _module_machinery() == before
    # Only the wrapped model's own modules place what is assigned into them: a module built now is untouched.
    outside = nn.Linear(HIDDEN, HIDDEN)
    assert type(outside) is nn.Linear and type(outside).__setattr__ is nn.Module.__setattr__
    assert all(isinstance(m, classes[name]) and type(m).__name__ == classes[name].__name__
               for name, m in model.named_modules())
    model.layers[0].mlp.table = torch.randn(128, 256, device=device)  # seen while wrapped
    assert ot.stats(model).untracked_bytes == 128 * 256 * 4
    assert torch.equal(_run(model, ids), expected)
    ot.unwrap_model(model)
    assert {name: type(m) for name, m in model.named_modules()} == classes
    assert _module_machinery() == before
    assert torch.equal(_run(model, ids), expected)


def test_introspecting_a_wrapped_module_finds_no_distribute_marker_and_raises_nothing():
    """Readers of every attribute in ``dir(module)`` (``inspect.getmembers``, a shell's completion)
    are not refused as ``distribute_module`` is: they find no ``_distribute_module_applied``."""
    import inspect

    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    ot.wrap_model(model, budget_gb=24e3 / 2**30, device="cpu")
    assert isinstance(model[0].weight, ot.OffloadedTensor)
    assert not hasattr(model, "_distribute_module_applied")
    assert dict(inspect.getmembers(model))["training"] is True
