"""Any model, any budget: working sets as ops really need them, ops over lists paged in
pieces, bit-identical linear for every input layout, identity of RNN and attention weights."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import offtensor as ot
from offtensor.pager import BudgetError, Pager
from offtensor.tensor import new_host_master, wrap_host
from offtensor.model import copies as _copies
from offtensor.model.copies import is_wrapped, state_of

GiB = 1 << 30


def _offload_under(pager, t):
    return wrap_host(new_host_master(t, pin=False), pager)


def _weight_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in [*model.parameters(), *model.buffers()]}.values())


# ---------------------------------------------------------------------------- 3. bit-identical linear


@pytest.mark.parametrize("shape", [(256, 64, 4, 7), (512, 128, 3, 9)])
def test_linear_with_a_non_contiguous_3d_input_matches_a_weight_that_requires_grad(device, shape):
    # aten::matmul folds a non-contiguous 3-D input into one mm when the weight requires grad and
    # runs bmm otherwise, even under no_grad: the paged copy must require grad like the weight.
    k, n, b, s = shape
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(n, k, device=device))
    bias = nn.Parameter(torch.randn(n, device=device))
    x = torch.randn(s, b, k, device=device).transpose(0, 1)
    assert not x.is_contiguous() and x.dim() == 3
    offloaded_weight = nn.Parameter(ot.offload(weight.detach().cpu(), device=device))
    offloaded_bias = nn.Parameter(ot.offload(bias.detach().cpu(), device=device))
    with torch.no_grad():
        expected = F.linear(x, weight, bias)
        assert torch.equal(F.linear(x, offloaded_weight, offloaded_bias), expected)
        assert torch.equal(F.linear(x, offloaded_weight, bias), expected)
    assert offloaded_weight.requires_grad


def test_linear_with_a_contiguous_3d_input_whose_unit_dim_has_another_stride_matches_a_weight_that_requires_grad(device):
    # fsmt on transformers 5.17: a (2, 1, 32) decoder state with strides (32, 64, 1) counts as
    # contiguous, yet aten::matmul folds it only when the weight requires grad (2.98e-08 apart).
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(96, 32, device=device))
    x = torch.randn(1, 2, 32, device=device).transpose(0, 1)
    assert x.is_contiguous() and x.stride() == (32, 64, 1)
    offloaded_weight = nn.Parameter(ot.offload(weight.detach().cpu(), device=device))
    with torch.no_grad():
        assert torch.equal(F.linear(x, offloaded_weight), F.linear(x, weight))
        assert torch.equal(x @ offloaded_weight.t(), x @ weight.t())


# ---------------------------------------------------------------------------- 1. working sets, lists in pieces


def test_cat_of_two_offloaded_weights_larger_than_the_free_room_pages_one_at_a_time(device):
    # mobilebert: torch.cat([decoder.weight.t(), dense.weight]) with room for one weight only.
    pager = Pager(torch.device(device), 2048)  # holds b (1536 bytes), not a and b (2560)
    a, b = torch.randn(16, 16), torch.randn(24, 16)
    oa, ob = _offload_under(pager, a), _offload_under(pager, b)
    assert torch.equal(torch.cat([oa.t(), ob.t()], 1), torch.cat([a.t(), b.t()], 1).to(device))
    assert torch.equal(torch.cat([ob, oa]), torch.cat([b, a]).to(device))
    assert torch.equal(torch.stack([oa, ob[:16]], dim=1), torch.stack([a, b[:16]], dim=1).to(device))
    assert pager.stats.peak_device_bytes <= 2048


def test_foreach_op_over_offloaded_tensors_larger_than_the_free_room_runs_per_element(device):
    pager = Pager(torch.device(device), 1500)
    a, b = torch.randn(16, 16), torch.randn(16, 16)
    oa, ob = _offload_under(pager, a), _offload_under(pager, b)
    for got, want in zip(torch._foreach_mul([oa, ob], 2.0), [a * 2, b * 2]):
        assert torch.equal(got, want.to(device))
    t1, t2 = [torch.randn(16, 16, device=device) for _ in range(2)], [torch.randn(16, 16, device=device) for _ in range(2)]
    scalars = torch.tensor([2.0, 3.0])  # one per element, as a tensor: split with the lists
    for got, want in zip(torch._foreach_addcmul([oa, ob], t1, t2, scalars), torch._foreach_addcmul([a.to(device), b.to(device)], t1, t2, scalars)):
        assert torch.equal(got, want)
    # The functional fused Adam step gives five lists back: joined per return, not mixed.
    state = dict(lr=0.1, beta1=0.9, beta2=0.99, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
    lists = lambda *ts: ([t.to(device) for t in ts], [torch.ones(16, 16, device=device)] * 2,
                         [torch.zeros(16, 16, device=device)] * 2, [torch.zeros(16, 16, device=device)] * 2, [],
                         [torch.tensor(1.0, device=device)] * 2)
    got, want = torch.ops.aten._fused_adam([oa, ob], *lists()[1:], **state), torch.ops.aten._fused_adam(*lists(a, b), **state)
    assert [len(g) for g in got] == [len(w) for w in want] == [2, 2, 2, 2, 0]
    assert all(torch.equal(g, w) for gs, ws in zip(got, want) for g, w in zip(gs, ws))
    torch._foreach_add_([oa, ob], [torch.ones(16, 16, device=device)] * 2)
    assert torch.equal(oa.cpu(), a + 1) and torch.equal(ob.cpu(), b + 1)
    assert pager.stats.peak_device_bytes <= 1500


def test_an_op_that_needs_more_than_the_budget_at_once_still_raises_budget_error(device):
    pager = Pager(torch.device(device), 1500)
    a, b = torch.randn(256), torch.randn(256)
    with pytest.raises(BudgetError, match="needs 1024 bytes"):  # a reduction cannot be cut into slices
        torch.dot(_offload_under(pager, a), _offload_under(pager, b))


def test_a_pointwise_op_whose_arguments_exceed_the_budget_together_runs_in_slices(device):
    pager = Pager(torch.device(device), 1500)
    a, b = torch.randn(16, 16), torch.randn(16, 16)
    assert torch.equal((_offload_under(pager, a) + _offload_under(pager, b)).cpu(), a + b)
    assert pager.stats.peak_device_bytes <= 1500


class _CatHead(nn.Module):
    """mobilebert's prediction head: one op reads two weights of two modules."""

    def __init__(self):
        super().__init__()
        self.decoder = nn.Linear(64, 128, bias=False)
        self.dense = nn.Linear(128, 64, bias=False)
        self.small = nn.ModuleList(nn.Linear(8, 8) for _ in range(30))

    def forward(self, x):
        w = torch.cat([self.decoder.weight.t(), self.dense.weight], dim=0)
        for m in self.small:
            x = x + m(x[..., :8]).sum()
        return x @ w.t()


def test_a_model_whose_op_concatenates_two_offloaded_weights_runs_within_the_budget(device):
    torch.manual_seed(0)
    model = _CatHead().eval().to(device)
    x = torch.randn(3, 128, device=device)
    with torch.no_grad():  # the plain model on the same device: the same kernels, the same bits
        expected = model(x)
    ot.wrap_model(model, budget_gb=0.6 * _weight_bytes(model) / GiB, device=device, prefetch=False)
    assert isinstance(model.decoder.weight, ot.OffloadedTensor) and isinstance(model.dense.weight, ot.OffloadedTensor)
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    s = ot.stats(model)
    assert s.peak_device_bytes <= s.budget_bytes


def test_every_tensor_of_one_module_counts_in_one_working_set():
    from offtensor.placement import Weight, choose_placement

    def weight(name, nbytes):
        return Weight([name], nbytes, (nbytes // 4, 1), nbytes)

    lstm = [weight(f"rnn.{n}", 100_000) for n in ("weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0")]
    p = choose_placement(lstm + [weight("other.weight", 150_000)], budget_bytes=10**7, offload_bytes=10**6, prefetch=False)
    assert p.working_set_bytes == 400_000  # the cuDNN LSTM op reads all four at once


class _StackedLSTMs(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnns = nn.ModuleList(nn.LSTM(32, 32) for _ in range(3))

    def forward(self, x):
        for rnn in self.rnns:
            x = rnn(x)[0]
        return x


@pytest.mark.parametrize("fraction", [0.5, 0.8])
def test_an_rnn_whose_weights_together_exceed_the_budget_is_refused_at_wrap_not_in_forward(device, fraction):
    # An RNN's kernel reads its weights itself (cuDNN every layer's at once), so dispatch cannot tile
    # it. On main placement planned tiles for them and forward raised BudgetError in mkldnn_rnn_layer.
    lstm = nn.LSTM(64, 64, num_layers=2)
    total = _weight_bytes(lstm)
    with pytest.raises(ot.BudgetError, match=rf"needs .* \({total} bytes\) on the device at once"):
        ot.wrap_model(lstm, budget_gb=fraction * total / 2**30, device=device)
    assert not any(isinstance(p, ot.OffloadedTensor) for p in lstm.parameters())  # left as it was


def test_rnns_offloaded_one_by_one_run_bit_identically_within_the_budget(device):
    torch.manual_seed(0)
    model = _StackedLSTMs().eval()
    x = torch.randn(5, 2, 32)
    reference = copy.deepcopy(model).to(device)
    ot.wrap_model(model, budget_gb=0.6 * _weight_bytes(model) / 2**30, device=device)
    assert sum(isinstance(p, ot.OffloadedTensor) for p in model.parameters()) >= 4
    with torch.no_grad():
        assert torch.equal(model(x.to(device)), reference(x.to(device)))
    s = ot.stats(model)
    assert s.peak_device_bytes <= s.budget_bytes


def test_stacked_experts_count_as_the_experts_one_op_pages_at_once():
    from offtensor.placement import Weight, choose_placement, working_set

    shape = (64, 32, 16)
    nbytes = 64 * 32 * 16 * 4
    assert working_set("model.layers.0.mlp.experts.down_proj", shape, nbytes) == nbytes // 64
    experts = [Weight([f"l.experts.{n}"], nbytes, shape, nbytes // 64) for n in ("gate_up_proj", "down_proj")]
    p = choose_placement(experts, budget_bytes=nbytes // 8, prefetch=False)
    # gate_up and down of one expert (two slices), not 8 routed experts of each stack
    assert p.working_set_bytes == 2 * nbytes // 64


# ---------------------------------------------------------------------------- 4. identity for every module


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn", "mha"])
def test_rnn_and_attention_modules_keep_their_parameter_objects_through_wrap_and_unwrap(device, kind):
    torch.manual_seed(0)
    if kind == "mha":
        module = nn.MultiheadAttention(32, 4)
        x = (torch.randn(5, 2, 32),) * 3
    else:
        module = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}[kind](16, 32, num_layers=2)
        x = (torch.randn(5, 2, 16),)
    module.eval()
    objects = dict(module.named_parameters())
    expected = module(*x)[0].detach()
    reference = copy.deepcopy(module).to(device)
    ot.wrap_model(module, offload_gb=1, device=device)  # every weight offloaded
    assert all(isinstance(p, ot.OffloadedTensor) for p in module.parameters())
    assert all(p is objects[n] for n, p in module.named_parameters())
    with torch.no_grad():
        got = module(*(t.to(device) for t in x))[0]
        assert torch.equal(got, reference(*(t.to(device) for t in x))[0])
    torch.testing.assert_close(got.cpu(), expected)
    assert ot.stats(module).peak_device_bytes <= ot.stats(module).budget_bytes
    ot.unwrap_model(module)
    assert all(p is objects[n] for n, p in module.named_parameters())
    assert not any(isinstance(p, ot.OffloadedTensor) for p in module.parameters())
    if kind != "mha":
        assert all(w is objects[n] for w, n in zip(module._flat_weights, module._flat_weights_names))


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


# ---------------------------------------------------------------------------- 2. tiling past the budget


def test_ops_with_a_weight_larger_than_the_budget_compute_in_tiles_bit_identically(device):
    torch.manual_seed(0)
    budget = 20 * 1024
    pager = Pager(torch.device(device), budget)
    w, b = torch.randn(384, 96), torch.randn(384)  # 147 KiB: 7x the budget
    ow, ob = _offload_under(pager, w), _offload_under(pager, b)
    w, b = w.to(device), b.to(device)
    x = torch.randn(5, 96, device=device)
    x3 = torch.randn(7, 2, 96, device=device).transpose(0, 1)
    with torch.no_grad():
        assert torch.equal(F.linear(x, ow, ob), F.linear(x, w, b))
        assert torch.equal(F.linear(x3, ow, ob), F.linear(x3, w, b))
        assert torch.equal(F.linear(x3, nn.Parameter(ow), ob), F.linear(x3, nn.Parameter(w), b))
    assert torch.equal(x @ ow.t(), x @ w.t())  # mm: columns of the transposed weight
    assert torch.equal(torch.addmm(ob, x, ow.t()), torch.addmm(b, x, w.t()))
    assert torch.equal(ow @ x.t(), w @ x.t())  # mm: rows of the first operand
    wt = w.t().contiguous()  # (96, 384): columns are strided in the master, gathered on the host
    assert torch.equal(x @ _offload_under(pager, wt.cpu()), x @ wt)
    conv_w, conv_b = torch.randn(64, 8, 3, 3), torch.randn(64)  # 18 KiB + bias, with the input beside
    img = torch.randn(2, 8, 16, 16, device=device)
    got = F.conv2d(img, _offload_under(pager, conv_w), _offload_under(pager, conv_b), padding=1)
    assert torch.equal(got, F.conv2d(img, conv_w.to(device), conv_b.to(device), padding=1))
    experts = torch.randn(8, 32, 40)  # 40 KiB, 5 KiB per batch
    xb = torch.randn(8, 3, 32, device=device)
    assert torch.equal(torch.bmm(xb, _offload_under(pager, experts)), torch.bmm(xb, experts.to(device)))
    assert pager.stats.peak_device_bytes <= budget


class _WideHead(nn.Module):
    """ultrabert's pattern (transformers 5.24): small resident layers, then a prediction head whose
    two 96 KiB weights are each larger than a 30% budget's room, read by 3-D activations."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(32, 32, bias=False) for _ in range(18)])
        self.up = nn.Linear(32, 768, bias=False)
        self.down = nn.Linear(768, 32, bias=False)

    def forward(self, x):
        return self.down(F.gelu(self.up(self.layers(x))))


def test_placement_leaves_room_for_tiles_wide_enough_to_be_bit_identical(device):
    # Planning room for one-row tiles left the 32-row head weight 4 rows a tile, which BLAS sums in
    # another order (2.3e-09 off on ultrabert); placement now offloads more so tiles are 16 rows.
    torch.manual_seed(0)
    model = _WideHead()
    reference = copy.deepcopy(model).to(device)
    budget = int(0.3 * _weight_bytes(model))
    ot.wrap_model(model, budget_gb=budget / GiB, device=device)
    x = torch.randn(2, 8, 32, device=device)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    s = ot.stats(model)
    assert s.peak_device_bytes <= budget
    assert s.budget_bytes - s.resident_bytes >= 16 * 768 * 4  # room for a 16-row tile of `down`


@pytest.mark.parametrize("rows", [32, 40, 500])
def test_a_decode_step_through_a_tiled_head_of_an_odd_vocabulary_is_bit_identical(device, rows):
    # The last tile of a 1001-row head took 16 rows from the one before it (starting at 985): for a
    # single input row MKL sums outputs in blocks of 16 from a tile's first, so the outputs of the
    # two last tiles came out in another order than the whole op's (2.4e-07 apart).
    torch.manual_seed(0)
    pager = Pager(torch.device(device), rows * 64 * 4)
    w = torch.randn(1001, 64)
    ow = _offload_under(pager, w)
    with torch.no_grad():
        for _ in range(4):  # four decode steps: a last-bit difference shows for most inputs, not all
            x = torch.randn(1, 64, device=device)
            assert torch.equal(F.linear(x, ow), F.linear(x, w.to(device)))
    assert pager.stats.peak_device_bytes <= rows * 64 * 4


def test_tiles_narrower_than_the_kernel_blocks_agree_to_rounding(device):
    # Room for 2 rows of 8: BLAS runs a matrix-vector kernel per tile, summing in another order.
    torch.manual_seed(0)
    pager = Pager(torch.device(device), 2 * 256 * 4)
    w = torch.randn(64, 256)
    x = torch.randn(3, 256, device=device)
    torch.testing.assert_close(F.linear(x, _offload_under(pager, w)), F.linear(x, w.to(device)), rtol=1e-5, atol=1e-5)
    assert pager.stats.peak_device_bytes <= 2 * 256 * 4


def test_an_op_whose_single_slice_exceeds_the_room_raises_a_clear_budget_error(device):
    pager = Pager(torch.device(device), 128)
    experts = _offload_under(pager, torch.randn(2, 64, 32))  # one column of a batch is 256 bytes
    with pytest.raises(BudgetError, match=r"aten.bmm.default cannot be tiled.*is 256 bytes.*128 bytes"):
        torch.bmm(torch.randn(2, 3, 64, device=device), experts)


def test_a_weight_larger_than_the_room_times_a_vector_runs_in_row_tiles(device):
    # weight @ v (matmul of a 2-D weight and a 1-D input) runs mv, which paged the weight whole:
    # BudgetError at a budget that placement accepted for tiles of its rows.
    torch.manual_seed(0)
    budget = 40 * 1024  # room for 16 rows of the transpose, 1.5 KiB each
    pager = Pager(torch.device(device), budget)
    w, b = torch.randn(384, 96), torch.randn(384)  # 147 KiB: 3.6x the budget
    ow, ob = _offload_under(pager, w), _offload_under(pager, b)
    w, b = w.to(device), b.to(device)
    v, u = torch.randn(96, device=device), torch.randn(384, device=device)
    assert torch.equal(ow @ v, w @ v)
    assert torch.equal(torch.addmv(ob, ow, v, beta=0.5, alpha=2.0), torch.addmv(b, w, v, beta=0.5, alpha=2.0))
    assert torch.equal(ow.t() @ u, w.t() @ u)  # rows of the transpose: gathered column-major on the host
    weight = nn.Parameter(ow)
    (weight @ v).square().sum().backward()  # autograd's mv: its backward is an outer product
    reference = nn.Parameter(w.clone())
    (reference @ v).square().sum().backward()
    assert torch.equal(weight.grad, reference.grad)
    assert pager.stats.peak_device_bytes <= budget


@pytest.mark.parametrize("both", [False, True])
def test_a_bmm_whose_one_batch_exceeds_the_room_runs_in_tiles_of_each_batch(device, both):
    # bmm was tiled by batch only: one batch of an input and a weight larger than the room (an
    # einsum of an input and a weight runs bmm on a batch of one) raised BudgetError at a budget
    # that placement accepted for tiles of the weight's rows; with both operands offloaded, one
    # batch of each had to fit together.
    torch.manual_seed(0)
    budget = 6 * 1024
    pager = Pager(torch.device(device), budget)
    a, b = torch.randn(2, 24, 64), torch.randn(2, 64, 200)  # 12 and 100 KiB
    xa = _offload_under(pager, a) if both else a.to(device)
    assert torch.equal(torch.bmm(xa, _offload_under(pager, b)), torch.bmm(a, b).to(device))
    assert torch.equal(torch.bmm(_offload_under(pager, b).transpose(1, 2), xa.transpose(1, 2)),
                       torch.bmm(b.transpose(1, 2), a.transpose(1, 2)).to(device))  # rows of the first
    x = torch.randn(1, 3, 64, device=device)  # a decode-sized input
    w = torch.randn(256, 64)
    assert torch.equal(torch.einsum("bsk,nk->bsn", x, _offload_under(pager, w)),
                       torch.einsum("bsk,nk->bsn", x, w.to(device)))
    assert pager.stats.peak_device_bytes <= budget


class _TiedLM(nn.Module):
    """A tied embedding used as the output layer is the model's largest weight, and a conv stem."""

    def __init__(self, vocab=2048, hidden=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.conv = nn.Conv1d(hidden, hidden, 3, padding=1)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.conv(h.transpose(1, 2)).transpose(1, 2)
        h = h + self.mlp(h)
        return self.head(self.norm(h))


def test_a_model_whose_largest_weight_is_twice_the_budget_runs_with_identical_outputs(device):
    torch.manual_seed(0)
    model = _TiedLM().eval().to(device)
    reference = copy.deepcopy(model)
    largest = model.embed.weight.numel() * 4  # 512 KiB
    budget = largest // 2
    with pytest.raises(BudgetError):
        ot.wrap_model(copy.deepcopy(model), budget_gb=64 / GiB, device=device)  # not even a tile fits
    ot.wrap_model(model, budget_gb=budget / GiB, device=device)
    assert model.head.weight is model.embed.weight and isinstance(model.embed.weight, ot.OffloadedTensor)
    ids = torch.randint(0, 2048, (2, 12), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        expected = reference(ids)
        assert torch.equal(model(ids), expected)
        assert torch.equal(model(ids), expected)
    s = ot.stats(model)
    assert s.peak_device_bytes <= budget == s.budget_bytes


def test_a_weight_assigned_after_wrap_larger_than_the_budget_is_offloaded_and_tiled(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    ot.wrap_model(model, budget_gb=16 * 1024 / GiB, device=device)
    head = nn.Linear(32, 512, bias=False)  # 64 KiB: 4x the budget
    expected_head = copy.deepcopy(head).to(device)
    with pytest.warns(UserWarning, match="narrower than 16 slices"):  # room for a few rows only
        model.head = head
    assert isinstance(model.head.weight, ot.OffloadedTensor) and model.head is head
    x = torch.randn(3, 32, device=device)
    with torch.no_grad():
        assert torch.equal(model.head(x), expected_head(x))
    assert ot.stats(model).peak_device_bytes <= 16 * 1024


def test_a_weight_assigned_after_wrap_with_room_for_narrow_tiles_only_warns_as_wrap_does(device):
    model = nn.Sequential(nn.Linear(32, 32, bias=False))
    ot.wrap_model(model, budget_gb=6 * 1024 / GiB, device=device)  # 4 KiB resident, 2 KiB of room
    with pytest.warns(UserWarning, match=r"narrower than 16 slices of head\.weight"):
        model.head = nn.Linear(32, 512, bias=False)  # 16 rows of 128 B need 2 KiB: room for 15
    assert isinstance(model.head.weight, ot.OffloadedTensor)


def test_a_wrapped_model_pickles_whole_and_loads_back_wrapped(device, tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)).to(device)
    x = torch.randn(3, 64, device=device)
    expected = model(x).detach()
    ot.wrap_model(model, budget_gb=0.7 * _weight_bytes(model) / GiB, device=device)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert is_wrapped(loaded) and ot.stats(loaded).budget_bytes == ot.stats(model).budget_bytes
    with torch.no_grad():
        assert torch.equal(loaded(x), expected)


def test_setting_a_submodule_or_attribute_to_none_releases_its_bytes(device):
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    ot.wrap_model(model, budget_gb=1, device=device)
    pager = state_of(model).pager
    before = pager.resident_bytes
    model[0].table = torch.randn(128, 256, device=device)  # 128 KiB, resident
    assert pager.resident_bytes == before + 128 * 256 * 4
    model[0].table = None
    assert pager.resident_bytes == before
    setattr(model, "1", None)
    assert pager.resident_bytes == before - (64 * 64 + 64) * 4


def test_spread_placement_reports_the_working_set_of_one_op_not_a_sum_over_its_replans():
    # A layer of the model's own (x @ w1 @ w2) reads its weights in separate ops: one weight is the
    # working set, however often placement re-plans which equal layers to spread the offload over.
    from offtensor import placement

    layer_weights = [
        placement.Weight([f"layers.{i}.{name}"], 100_000, (100, 250), 100_000, fused=False)
        for i in range(12) for name in ("w1", "w2")
    ]
    total = 24 * 100_000
    plan = placement.choose_placement(layer_weights, budget_bytes=total - 6 * 100_000 + 2 * 100_000)
    assert plan.working_set_bytes == 100_000
    assert len(plan.offload) == 6
    offloaded_layers = sorted({int(w.name.split(".")[1]) for w in plan.offload})
    assert offloaded_layers != list(range(len(offloaded_layers)))  # spread, not the first layers

    # torch.nn's own modules may read all their tensors in one op (an LSTM layer's two weights);
    # a model's own module reads its same-rank weights one op at a time.
    for fused, expected in ((True, 200_000), (False, 100_000)):
        pair = [
            placement.Weight([f"rnn.weight_{part}_l0"], 100_000, (100, 250), 100_000, fused=fused)
            for part in ("ih", "hh")
        ]
        plan = placement.choose_placement(pair, budget_bytes=200_000, policy=["rnn.*"], prefetch=False)
        assert plan.working_set_bytes == expected and len(plan.offload) == 2


def test_placement_prefers_room_for_a_layers_routed_experts_but_runs_with_one():
    # One op pages one expert, so a budget with room for one expert is accepted; with prefetch,
    # when the budget allows, placement offloads more stacks to leave room for a layer's routed
    # experts (8 of each stack of the layer), which the expert cache fills in one go.
    from offtensor import placement

    expert = 10_000
    stacks = [
        placement.Weight([f"layers.{i}.mlp.experts.{name}"], 16 * expert, (16, 50, 50), expert, fused=False)
        for i in range(4) for name in ("gate_up_proj", "down_proj")
    ]
    total = sum(w.nbytes for w in stacks)
    roomy = placement.choose_placement(stacks, budget_bytes=total - 2 * 16 * expert + expert)
    assert roomy.working_set_bytes == expert
    assert total - roomy.offloaded_bytes + expert + 2 * 8 * expert <= roomy.budget_bytes
    tight = placement.choose_placement(stacks, budget_bytes=2 * expert)  # everything offloaded, one expert of room
    assert len(tight.offload) == len(stacks) and tight.working_set_bytes == expert


# ---------------------------------------------------------------------------- training past the room


def _tiled_mlp(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8)).to(device)
    return model, copy.deepcopy(model)


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
        lambda p: torch.optim.Adam(p, lr=1e-3),
        lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1, foreach=True),
    ],
    ids=["sgd-momentum-decay", "adam", "adamw-foreach"],
)
def test_an_optimizer_step_on_a_weight_larger_than_the_room_runs_in_slices_bit_identically(device, make):
    # Forward and backward tile the 256 KiB weight under a 128 KiB budget; the step's in-place updates
    # (add_, addcdiv_, lerp_, _foreach_mul_) and zeros_like(param) must run within it too.
    model, reference = _tiled_mlp(device)
    budget = 128 * 1024
    ot.wrap_model(model, budget_gb=budget / GiB, device=device)
    assert isinstance(model[0].weight, ot.OffloadedTensor)
    assert model[0].weight.numel() * 4 > budget
    opt, ref_opt = make(model.parameters()), make(reference.parameters())
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(1)).to(device)
    for _ in range(3):
        for m, o in ((model, opt), (reference, ref_opt)):
            o.zero_grad()
            m(x).square().sum().backward()
            o.step()
    assert torch.equal(model[0].weight.cpu(), reference[0].weight.cpu())
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    assert ot.stats(model).peak_device_bytes <= budget


def test_zeros_like_of_an_offloaded_weight_copies_nothing_to_the_device(device):
    pager = Pager(torch.device(device), 1 << 20)
    weight = _offload_under(pager, torch.randn(64, 32).t())
    for make in (torch.zeros_like, torch.empty_like, lambda w: torch.full_like(w, 3.0), lambda w: w.new_zeros(5)):
        out = make(weight)
        assert type(out) is torch.Tensor and out.device.type == torch.device(device).type
    zeros = torch.zeros_like(weight)
    assert zeros.stride() == weight.stride() and torch.equal(zeros.cpu(), torch.zeros(32, 64))
    assert pager.stats.bytes_h2d == 0


def test_a_pointwise_read_of_a_weight_larger_than_the_room_runs_in_slices(device):
    pager = Pager(torch.device(device), 16 * 1024)
    values = torch.randn(64, 128)  # 32 KiB
    weight = _offload_under(pager, values)
    mask = (torch.arange(128) % 3 == 0).to(device)
    assert torch.equal((weight * mask).cpu(), values * mask.cpu())
    # torch.equal (tagged pointwise, no meta kernel) raised NotImplementedError; it compares slices.
    other = values.clone()
    assert torch.equal(weight, other.to(device)) and torch.equal(other.to(device), weight)
    other[-1, -1] += 1
    assert not torch.equal(weight, other.to(device)) and not torch.equal(weight, values[:32].to(device))
    assert pager.stats.peak_device_bytes <= 16 * 1024
    with pytest.warns(UserWarning, match="summed over slices.*last bits"):  # partial sums add in another order
        total = weight.sum()
    torch.testing.assert_close(total.cpu(), values.sum())
    assert torch.equal(weight.max().cpu(), values.max())  # each element read once: exact, no warning
    assert pager.stats.peak_device_bytes <= 16 * 1024
