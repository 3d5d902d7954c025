"""Every device byte counted: plain tensor attributes (vLLM's MLA absorption) counted and
offloaded or reported as untracked resident bytes, a deleted submodule's bytes released at once,
and ``copy.deepcopy`` of a wrapped model wrapped on a pager of its own."""

from __future__ import annotations

import copy

import torch
from torch import nn

import offtensor as ot
from offtensor.model.copies import is_wrapped, state_of

from test_budget_and_tiling import _weight_bytes

GiB = 1 << 30


# ---------------------------------------------------------------------------- 5. every device byte counted


class _MLA(nn.Module):
    """vLLM's MLA post-processing: ``kv_b_proj`` (stored quantised: int8 values and a per-row scale)
    is dequantised and split into W_UK_T and W_UV, kept as plain tensor attributes, not Parameters."""

    def __init__(self, heads=4, nope=64, v=64, rank=128, hidden=128):
        super().__init__()
        self.heads, self.nope, self.v, self.rank = heads, nope, v, rank
        self.q_proj = nn.Linear(hidden, heads * nope, bias=False)
        self.kv_a = nn.Linear(hidden, rank, bias=False)
        weight = torch.randn(heads * (nope + v), rank)
        scale = weight.abs().amax(1, keepdim=True) / 127
        self.kv_b_proj = nn.Module()
        self.kv_b_proj.register_buffer("qweight", (weight / scale).round().to(torch.int8))
        self.kv_b_proj.register_buffer("scale", scale)
        self.o_proj = nn.Linear(heads * v, hidden, bias=False)

    def process_weights_after_loading(self):
        b = self.kv_b_proj
        weight = b.qweight.to(torch.float32) * b.scale  # the dequantise step
        w_uk, w_uv = weight.view(self.heads, self.nope + self.v, self.rank).split([self.nope, self.v], dim=1)
        self.W_UK_T = w_uk.permute(0, 2, 1).contiguous()  # (heads, rank, nope), a plain attribute
        self.W_UV = w_uv.transpose(1, 2).contiguous()  # (heads, rank, v)
        del self.kv_b_proj

    def forward(self, x):
        q = self.q_proj(x).view(x.shape[0], self.heads, self.nope).transpose(0, 1)  # (heads, T, nope)
        latent = self.kv_a(x)  # (T, rank)
        q_latent = torch.bmm(q, self.W_UK_T.transpose(1, 2))  # absorbed: (heads, T, rank)
        scores = (q_latent @ latent.t()).softmax(-1)
        out = torch.bmm(scores @ latent.expand(self.heads, -1, -1), self.W_UV)  # (heads, T, v)
        return self.o_proj(out.transpose(0, 1).reshape(x.shape[0], -1))


def test_mla_weights_absorbed_into_plain_attributes_are_counted_and_offloaded(device):
    torch.manual_seed(0)
    model = _MLA().to(device)
    reference = copy.deepcopy(model)
    reference.process_weights_after_loading()
    x = torch.randn(6, 128, device=device)
    expected = reference(x)
    total = _weight_bytes(model)
    ot.wrap_model(model, budget_gb=0.5 * total / GiB, device=device)
    before = ot.stats(model)
    model.process_weights_after_loading()
    s = ot.stats(model)
    # kv_b_proj's buffers are gone at once; W_UK_T and W_UV (128 KiB each) are held by the model
    assert "kv_b_proj" not in dict(model.named_modules())
    attributes = {"W_UK_T": model.W_UK_T, "W_UV": model.W_UV}
    resident = [n for n, t in attributes.items() if not isinstance(t, ot.OffloadedTensor)]
    assert s.untracked_bytes == sum(attributes[n].numel() * 4 for n in resident)
    assert s.resident_bytes <= s.budget_bytes and s.resident_bytes + s.cached_bytes <= s.budget_bytes
    # Both do not fit beside the resident weights and the room paging needs: one is offloaded.
    assert len(resident) < 2
    assert s.offloaded_bytes >= before.offloaded_bytes
    with torch.no_grad():
        assert torch.equal(model(x), expected.detach())
    assert ot.stats(model).peak_device_bytes <= s.budget_bytes


def test_a_large_plain_attribute_that_fits_is_counted_as_untracked_resident_bytes(device):
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    ot.wrap_model(model, budget_gb=1, device=device)
    before = ot.stats(model)
    model[0].table = torch.randn(128, 256, device=device)
    s = ot.stats(model)
    assert s.untracked_bytes == 128 * 256 * 4
    assert s.resident_bytes == before.resident_bytes + 128 * 256 * 4
    model[0].alias = model[0].weight.detach()  # shares a weight's storage: counted once, not untracked
    assert ot.stats(model).untracked_bytes == 128 * 256 * 4


def test_deleting_a_submodule_releases_its_bytes_at_once(device):
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 256), nn.Linear(256, 64), nn.Linear(64, 64))
    ot.wrap_model(model, budget_gb=0.7 * _weight_bytes(model) / GiB, device=device, policy={"keep": ["3.*"]})
    pager = state_of(model).pager
    kinds = {i: isinstance(model[i].weight, ot.OffloadedTensor) for i in range(4)}
    assert True in kinds.values() and False in kinds.values()
    for i in (3, 1):  # one resident, one offloaded (largest first)
        before = pager.resident_bytes + pager.offloaded_bytes
        gone = _weight_bytes(model[i])
        del model[i]
        # The pager's own counts, without a recount by ot.stats.
        assert pager.resident_bytes + pager.offloaded_bytes == before - gone
    assert pager.resident_bytes + pager.offloaded_bytes == _weight_bytes(model)


def test_deepcopy_of_a_wrapped_model_is_wrapped_on_its_own_pager(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)).to(device)
    x = torch.randn(3, 64, device=device)
    expected = model(x).detach()
    ot.wrap_model(model, budget_gb=0.7 * _weight_bytes(model) / GiB, device=device)
    original = ot.stats(model)
    twin = copy.deepcopy(model)
    assert ot.stats(model).offloaded_bytes == original.offloaded_bytes  # nothing charged to the original
    assert is_wrapped(twin)
    s = ot.stats(twin)
    assert s.offloaded_bytes == original.offloaded_bytes and s.budget_bytes == original.budget_bytes
    offloaded = [p for p in twin.parameters() if isinstance(p, ot.OffloadedTensor)]
    assert offloaded and all(p.pager is not model[0].weight.pager for p in offloaded)
    assert all(p.pager is offloaded[0].pager for p in offloaded)
    with torch.no_grad():
        assert torch.equal(twin(x), expected) and torch.equal(model(x), expected)
    ot.unwrap_model(twin)
    assert ot.stats(model).offloaded_bytes == original.offloaded_bytes
    assert not any(isinstance(p, ot.OffloadedTensor) for p in twin.parameters())


def test_a_wrapped_models_deep_copy_inside_a_model_wrapped_later_is_paged_under_its_budget(device):
    """``AveragedModel(wrapped)`` deep-copies the wrapped model into ``.module``; wrapping the
    averaged model places that copy's weights under the new (smaller) budget, once. Before, the
    copy's first use adopted it onto a pager of its own at the original's budget, beside the new
    wrap: the device held more than the new budget while its stats counted nothing offloaded."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 200), nn.ReLU(), nn.Linear(200, 8)).to(device)
    reference = AveragedModel(copy.deepcopy(model), multi_avg_fn=get_ema_multi_avg_fn(0.9))
    ot.wrap_model(model, budget_gb=0.6 * _weight_bytes(model) / GiB, device=device)
    averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    ot.wrap_model(averaged, budget_gb=0.2 * _weight_bytes(model) / GiB, device=device)
    pager = state_of(averaged).pager
    assert all(p.pager is pager for p in averaged.parameters() if isinstance(p, ot.OffloadedTensor))
    x = torch.randn(4, 16, device=device)
    with torch.no_grad():
        for _ in range(2):
            reference.update_parameters(reference.module)
            averaged.update_parameters(model)
            assert torch.equal(averaged(x), reference(x))
    s = ot.stats(averaged)
    assert s.offloaded_bytes > 0 and s.peak_device_bytes <= s.budget_bytes
    assert len([h for h in averaged.module._forward_pre_hooks.values() if type(h).__name__ == "StepHook"]) == 0
    ot.unwrap_model(averaged)
    assert not any(isinstance(p, ot.OffloadedTensor) for p in averaged.parameters())
    with torch.no_grad():
        assert torch.equal(averaged(x), reference(x))
