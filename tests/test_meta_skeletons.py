"""Model ensembling as torch.func's tutorial runs it, on wrapped models: ``stack_module_state`` of
several wrapped copies, a skeleton made by ``copy.deepcopy(model).to("meta")``, and
``vmap(functional_call(skeleton, ...))`` over the stacked weights. Against the same models
unwrapped, bit for bit, with every weight larger than the room."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call, stack_module_state

import offtensor as ot

GiB = 2**30


def _wrapped(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 8))
    reference = copy.deepcopy(model).to(device)
    # 4,352 bytes: each 8 and 16 KiB weight is larger than the room, computed in tiles
    ot.wrap_model(model, budget_gb=4352 / GiB, device=device, policy={"offload": ["*"]})
    return model, reference


def test_an_offloaded_weight_moved_to_meta_is_its_meta_tensor_with_nothing_paged(device):
    """``w.to("meta")`` paged the weight to copy it to meta: a weight larger than the room was cut
    in slices, whose copy out of meta failed ("Cannot copy out of meta tensor; no data!")."""
    model, reference = _wrapped(device)
    ot.reset_stats(model)
    for p, q in zip(model.parameters(), reference.parameters()):
        on_meta = p.to("meta")
        assert type(on_meta) is torch.Tensor and on_meta.is_meta
        expected = q.to("meta")
        assert (on_meta.shape, on_meta.stride(), on_meta.dtype) == (expected.shape, expected.stride(), expected.dtype)
    assert ot.stats(model).bytes_h2d == 0


@pytest.mark.parametrize("copies_of_copies", [False, True], ids=["copies", "copies-of-a-copy"])
def test_an_ensemble_of_wrapped_copies_runs_through_a_meta_skeleton_under_vmap_as_unwrapped(device, copies_of_copies):
    """The skeleton, a deep copy not yet used when it was moved to meta, was adopted as a wrapped
    copy at its first forward, inside ``functional_call``: adoption read the batched weights vmap
    had put in its tables (``Cannot access storage of BatchedTensorImpl``). A deep copy whose
    offloaded weights all died before its first use is a plain model now, not adopted."""
    model, reference = _wrapped(device)
    members, plain = [], []
    for i, m in enumerate((model, reference)):
        made = []
        for k in range(3):
            c = copy.deepcopy(copy.deepcopy(m) if copies_of_copies else m)
            with torch.no_grad():
                for p in c.parameters():
                    p.mul_(1 + 0.1 * k)
            made.append(c)
        (members if i == 0 else plain).append(made)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(1)).to(device)
    outputs = []
    for made in (members[0], plain[0]):
        params, buffers = stack_module_state(made)
        skeleton = copy.deepcopy(made[0]).to("meta")

        def call(p, b, x):
            return functional_call(skeleton, (p, b), (x,))

        outputs.append(torch.vmap(call, in_dims=(0, 0, None))(params, buffers, x))
        assert all(p.is_meta for p in skeleton.parameters())
        assert not ot.OffloadedTensor in {type(p) for p in skeleton.parameters()}
    assert torch.equal(*outputs)
    for c in members[0]:  # the members themselves are wrapped copies, within their budget
        with torch.no_grad():
            c(x)
        stats = ot.stats(c)
        assert stats.offloaded_bytes > 0 and stats.peak_device_bytes <= stats.budget_bytes


def test_a_deep_copy_still_holding_its_offloaded_weights_is_adopted_at_its_first_use(device):
    """The skeleton rule takes only copies whose offloaded weights are gone: a copy used as it is
    is wrapped on its own pager, with its original's budget."""
    model, reference = _wrapped(device)
    c = copy.deepcopy(model)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        assert torch.equal(c(x), reference(x))
    stats = ot.stats(c)
    assert stats.budget_bytes == 4352 and stats.offloaded_bytes == ot.stats(model).offloaded_bytes


def test_an_ensemble_of_wrapped_models_whose_weights_all_fit_runs_through_a_meta_skeleton_under_vmap(device):
    """The same ensemble where the budget holds every weight (none offloaded): the skeleton, no
    offloaded weight of its own to lose, was adopted inside ``functional_call`` and read vmap's
    batched weights (``Cannot access storage of BatchedTensorImpl``). A copy whose weights are all
    on meta is a plain model too."""
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).to(device)
    members = []
    for k in range(3):
        member = copy.deepcopy(reference)
        with torch.no_grad():
            for p in member.parameters():
                p.mul_(1 + 0.1 * k)
        members.append(member)
    plain = copy.deepcopy(members)
    for member in members:
        ot.wrap_model(member, budget_gb=1 / 1024, device=device)
        assert ot.stats(member).offloaded_bytes == 0
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(1)).to(device)
    outputs = []
    for made in (members, plain):
        params, buffers = stack_module_state(made)
        skeleton = copy.deepcopy(made[0]).to("meta")
        outputs.append(torch.vmap(lambda p, b, x: functional_call(skeleton, (p, b), (x,)), in_dims=(0, 0, None))(
            params, buffers, x))
        assert all(p.is_meta for p in skeleton.parameters())
    assert torch.equal(*outputs)


def test_a_deep_copy_run_first_by_functional_call_is_adopted_at_its_own_first_forward_within_the_budget(device):
    """``functional_call(copy, params, x)`` as a copy's first use: its tables hold the caller's
    tensors during that call. Adopting it then counted the caller's 27,680 bytes as its resident
    weights, past its 4,352-byte budget; now the call runs with the caller's tensors, and the copy is
    adopted at its own first forward, its weights offloaded, within the budget."""
    model, reference = _wrapped(device)
    c = copy.deepcopy(model)
    params = {name: p.detach().clone() * 2 for name, p in reference.named_parameters()}
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        assert torch.equal(functional_call(c, params, (x,)), functional_call(reference, params, (x,)))
        assert torch.equal(c(x), reference(x))
    stats = ot.stats(c)
    assert stats.offloaded_bytes == ot.stats(model).offloaded_bytes and stats.peak_device_bytes <= stats.budget_bytes
