"""wrap_model / unwrap_model on a small plain-PyTorch model with tied embeddings, dense MLPs and
stacked MoE experts: identities and ties, state dicts, post-load rewrites, the budget, policies,
placement order and error messages."""

from __future__ import annotations

import copy
import re
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import offtensor as ot
from offtensor.pager import resolve_device
from offtensor.model.copies import is_wrapped, state_of
from offtensor.model.state import wrapped_state

GiB = 1 << 30
VOCAB, HIDDEN, INTER, EXPERTS = 256, 128, 256, 4


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.k_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.v_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.o_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self.o_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.up_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.down_proj = nn.Linear(INTER, HIDDEN, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """Stacked experts as transformers v5 stores them, run one routed expert at a time."""

    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(EXPERTS, 2 * INTER, HIDDEN) * 0.05)
        self.down_proj = nn.Parameter(torch.randn(EXPERTS, HIDDEN, INTER) * 0.05)

    def forward(self, x, expert_ids):
        out = torch.zeros_like(x)
        for e in expert_ids.unique().tolist():
            rows = (expert_ids == e).nonzero().squeeze(1)
            gate, up = F.linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            out[rows] = F.linear(F.silu(gate) * up, self.down_proj[e])
        return out


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = Experts()

    def forward(self, x):
        flat = x.reshape(-1, HIDDEN)
        return self.experts(flat, self.gate(flat).argmax(-1)).reshape(x.shape)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(HIDDEN)
        self.self_attn = Attention()
        self.post_attention_layernorm = nn.LayerNorm(HIDDEN)
        self.mlp = MLP()
        self.moe = MoE()

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        h = self.post_attention_layernorm(x)
        return x + self.mlp(h) + self.moe(h)


class TinyLM(nn.Module):
    def __init__(self, layers: int = 2, tie: bool = True):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        if tie:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def _model(seed: int = 0, **kwargs) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(**kwargs).eval()


def _weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights, each storage (host master for offloaded ones) once."""
    seen = {}
    for t in list(model.parameters()) + list(model.buffers()):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _ids(device, seed: int = 1):
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed)).to(device)


def _offloaded_names(model: nn.Module) -> set:
    return {n for n, p in model.named_parameters() if isinstance(p, ot.OffloadedTensor)}


def _tensors_by_name(model: nn.Module) -> dict:
    return dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))


def _budget_gb(model: nn.Module, fraction: float) -> float:
    return fraction * _weight_bytes(model) / GiB


def _run(model, ids):
    with torch.no_grad():
        return model(ids)


@pytest.fixture
def pair(device):
    """(wrapped at 40% of its weight bytes, unwrapped reference on the device)."""
    model = _model()
    reference = copy.deepcopy(model).to(device)
    ot.wrap_model(model, budget_gb=_budget_gb(model, 0.4), device=device)
    yield model, reference
    if is_wrapped(model):
        ot.unwrap_model(model)


# ---------------------------------------------------------------------------- identity and ties


def test_wrap_keeps_every_parameter_object_and_tied_weights_stay_the_same_object(device):
    model = _model()
    before = _tensors_by_name(model)
    # Offload the tied embedding so the tie has to survive becoming an OffloadedTensor.
    ot.wrap_model(model, budget_gb=_budget_gb(model, 0.4), device=device, policy={"offload": ["embed_tokens.*"]})
    after = _tensors_by_name(model)
    assert after.keys() == before.keys()
    assert all(after[name] is before[name] for name in before)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert isinstance(model.embed_tokens.weight, ot.OffloadedTensor)
    assert isinstance(model.embed_tokens.weight, nn.Parameter)


def test_wrapped_model_gives_the_same_outputs(pair, device):
    model, reference = pair
    ids = _ids(device)
    assert torch.equal(_run(model, ids), _run(reference, ids))
    assert _offloaded_names(model)


def test_state_dict_keys_and_values_unchanged_by_wrap(device):
    model = _model()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    ot.wrap_model(model, budget_gb=_budget_gb(model, 0.4), device=device)
    state = model.state_dict()
    assert list(state) == list(expected)
    for key, value in state.items():
        assert torch.equal(value.cpu(), expected[key]), key
    kept = model.state_dict(keep_vars=True)
    assert kept["lm_head.weight"] is kept["embed_tokens.weight"]


def test_tied_weights_stay_tied_after_load_state_dict(pair, device):
    model, reference = pair
    tied = model.embed_tokens.weight
    source = _model(seed=7)
    model.load_state_dict(source.state_dict())
    reference.load_state_dict(source.state_dict())
    assert model.embed_tokens.weight is tied and model.lm_head.weight is tied
    ids = _ids(device)
    assert torch.equal(_run(model, ids), _run(reference, ids))
    assert ot.stats(model).peak_device_bytes <= ot.stats(model).budget_bytes


def test_load_state_dict_assign_true_places_the_new_tensors_under_the_budget(pair, device):
    model, reference = pair
    source = _model(seed=7)
    model.load_state_dict(source.state_dict(), assign=True)
    reference.load_state_dict({k: v.to(device) for k, v in source.state_dict().items()}, assign=True)
    s = ot.stats(model)
    for name, p in model.named_parameters():
        assert isinstance(p, ot.OffloadedTensor) or p.device == resolve_device(device), name
    assert s.resident_bytes <= s.budget_bytes
    assert s.resident_bytes + s.offloaded_bytes == _weight_bytes(model)
    ids = _ids(device)
    assert torch.equal(_run(model, ids), _run(reference, ids))
    assert ot.stats(model).peak_device_bytes <= s.budget_bytes


def test_load_state_dict_assign_true_keeps_a_tie_that_the_state_dict_shares(device):
    model = _model()
    ot.wrap_model(model, budget_gb=_budget_gb(model, 0.4), device=device, policy={"offload": ["embed_tokens.*"]})
    state = _model(seed=7).state_dict()
    assert state["lm_head.weight"].data_ptr() == state["embed_tokens.weight"].data_ptr()
    model.load_state_dict(state, assign=True)
    embed, head = model.embed_tokens.weight, model.lm_head.weight
    assert isinstance(embed, ot.OffloadedTensor) and isinstance(head, ot.OffloadedTensor)
    # Two Parameters (load_state_dict wraps each key in its own) over one host master, as plain
    # PyTorch leaves two Parameters over one storage.
    assert embed._master is head._master
    assert ot.stats(model).offloaded_bytes + ot.stats(model).resident_bytes == _weight_bytes(model)


@pytest.fixture
def swap_on_conversion():
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    yield
    torch.__future__.set_swap_module_params_on_conversion(before)


@pytest.mark.parametrize("assign", [True, False])
def test_load_state_dict_with_swap_tensors_places_what_it_swaps_in(device, swap_on_conversion, assign):
    # This mode swaps loaded values into the existing Parameters: no registration hook sees them.
    model = _model()
    reference = copy.deepcopy(model).to(device)
    ot.wrap_model(model, budget_gb=_budget_gb(model, 0.3), device=device)
    before = _tensors_by_name(model)
    state = _model(seed=7).state_dict()
    model.load_state_dict(state, assign=assign)
    reference.load_state_dict({k: v.to(device) for k, v in state.items()}, assign=assign)
    assert all(_tensors_by_name(model)[n] is t for n, t in before.items())
    assert model.lm_head.weight is model.embed_tokens.weight
    s = ot.stats(model)
    assert s.resident_bytes <= s.budget_bytes
    for name, t in _tensors_by_name(model).items():
        assert isinstance(t, ot.OffloadedTensor) or t.device == resolve_device(device), name
    ids = _ids(device)
    assert torch.equal(_run(model, ids), _run(reference, ids))
    assert ot.stats(model).peak_device_bytes <= s.budget_bytes


def test_assigning_a_new_parameter_after_wrap_places_it_under_the_budget(pair, device):
    model, reference = pair
    s = ot.stats(model)
    new = nn.Parameter(torch.randn(HIDDEN, INTER) * 0.05)
    model.layers[1].mlp.down_proj.weight = new
    reference.layers[1].mlp.down_proj.weight = nn.Parameter(new.detach().to(device))
    placed = model.layers[1].mlp.down_proj.weight
    assert isinstance(placed, ot.OffloadedTensor) or placed.device == resolve_device(device)
    after = ot.stats(model)
    assert after.resident_bytes <= after.budget_bytes
    assert after.resident_bytes + after.offloaded_bytes == _weight_bytes(model)
    ids = _ids(device)
    assert torch.equal(_run(model, ids), _run(reference, ids))
    assert ot.stats(model).peak_device_bytes <= s.budget_bytes


def test_a_new_parameter_too_big_to_keep_is_offloaded_not_left_plain(device):
    model = _model()
    ot.wrap_model(model, budget_gb=_budget_gb(model, 0.3), device=device)
    s = ot.stats(model)
    room = s.budget_bytes - s.resident_bytes
    # Too big to keep beside the room paging needs, small enough to be paged.
    rows = (room - state_of(model).working_set_bytes) // (HIDDEN * 4) + 1
    assert rows * HIDDEN * 4 <= room
    assert s.resident_bytes + rows * HIDDEN * 4 + state_of(model).working_set_bytes > s.budget_bytes
    model.extra = nn.Linear(HIDDEN, rows, bias=False)
    assert isinstance(model.extra.weight, ot.OffloadedTensor)
    model.layers[0].mlp.gate_proj.weight = nn.Parameter(torch.randn(INTER, HIDDEN))
    weight = model.layers[0].mlp.gate_proj.weight
    assert isinstance(weight, ot.OffloadedTensor) or weight.device == resolve_device(device)
    assert ot.stats(model).resident_bytes <= s.budget_bytes


def test_reassigning_the_tie_after_wrap_keeps_the_same_object(pair, device):
    model, reference = pair
    model.lm_head.weight = model.embed_tokens.weight
    assert model.lm_head.weight is model.embed_tokens.weight
    ids = _ids(device)
    assert torch.equal(_run(model, ids), _run(reference, ids))


def test_a_submodule_assigned_after_wrap_has_its_tensors_placed(pair, device):
    model, reference = pair
    torch.manual_seed(3)
    fresh = MLP()
    reference.layers[0].mlp = copy.deepcopy(fresh).to(device)
    model.layers[0].mlp = fresh
    for name, p in model.layers[0].mlp.named_parameters():
        assert isinstance(p, ot.OffloadedTensor) or p.device == resolve_device(device), name
    s = ot.stats(model)
    assert s.resident_bytes + s.offloaded_bytes == _weight_bytes(model)
    ids = _ids(device)
    assert torch.equal(_run(model, ids), _run(reference, ids))
    assert ot.stats(model).peak_device_bytes <= s.budget_bytes


# ---------------------------------------------------------------------------- writes (weight loaders)


def test_param_data_copy_and_narrow_copy_reach_the_host_master(pair, device):
    model, reference = pair
    name = "layers.0.moe.experts.gate_up_proj"
    assert name in _offloaded_names(model)
    ids = _ids(device)
    _run(model, ids)  # fill the cache, so a stale copy would show
    for m in (model, reference):
        p = m.get_parameter(name)
        torch.manual_seed(5)
        p.data.copy_(torch.randn(p.shape))
        with torch.no_grad():  # as weight loaders run
            p.narrow(0, 1, 2).copy_(torch.full((2,) + tuple(p.shape[1:]), 0.01))
            m.get_parameter("embed_tokens.weight").narrow(0, 3, 4).copy_(torch.ones(4, HIDDEN))
    assert torch.equal(model.get_parameter(name).cpu(), reference.get_parameter(name).cpu())
    assert torch.equal(model.lm_head.weight.cpu(), reference.lm_head.weight.cpu())
    assert torch.equal(_run(model, ids), _run(reference, ids))


# ---------------------------------------------------------------------------- safetensors


def test_safetensors_save_and_load_model_on_a_wrapped_model_with_tied_weights(pair, device, tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    model, reference = pair
    path = str(tmp_path / "model.safetensors")
    safetensors_torch.save_model(model, path)
    unique = _weight_bytes(model)
    with safetensors_torch.safe_open(path, "pt") as f:
        keys = set(f.keys())
        loaded = {k: f.get_tensor(k) for k in keys}
    state_keys = set(model.state_dict())
    assert len(keys) == len(state_keys) - 1
    assert keys < state_keys and ({"embed_tokens.weight", "lm_head.weight"} & keys)
    assert sum(t.numel() * t.element_size() for t in loaded.values()) == unique
    assert unique <= os.path.getsize(path) < unique + 64 * 1024
    for key, value in loaded.items():
        assert torch.equal(value, reference.state_dict()[key].cpu()), key

    other = _model(seed=9)
    ot.wrap_model(other, budget_gb=_budget_gb(other, 0.4), device=device)
    tied = other.embed_tokens.weight
    missing, unexpected = safetensors_torch.load_model(other, path)
    assert not missing and not unexpected
    assert other.embed_tokens.weight is tied and other.lm_head.weight is tied
    ids = _ids(device)
    assert torch.equal(_run(other, ids), _run(reference, ids))


# ---------------------------------------------------------------------------- budget


def test_device_bytes_never_exceed_the_budget_across_forwards(pair, device):
    model, reference = pair
    budget = ot.stats(model).budget_bytes
    for seed in range(4):
        ids = _ids(device, seed)
        assert torch.equal(_run(model, ids), _run(reference, ids))
        s = ot.stats(model)
        assert s.peak_device_bytes <= budget
        assert s.resident_bytes + s.cached_bytes <= budget
    assert ot.stats(model).bytes_h2d > 0


def test_second_forward_pages_again_what_the_budget_cannot_hold(pair, device):
    model, _ = pair
    ids = _ids(device)
    _run(model, ids)
    first = ot.stats(model).bytes_h2d
    _run(model, ids)
    assert ot.stats(model).bytes_h2d > first


def test_a_model_that_fits_has_no_offloaded_tensors_and_pages_nothing(device):
    model = _model()
    reference = copy.deepcopy(model).to(device)
    ot.wrap_model(model, budget_gb=_budget_gb(model, 1.5), device=device)
    assert not any(isinstance(t, ot.OffloadedTensor) for t in _tensors_by_name(model).values())
    ids = _ids(device)
    assert torch.equal(_run(model, ids), _run(reference, ids))
    s = ot.stats(model)
    assert s.bytes_h2d == 0 and s.page_ins == 0 and s.offloaded_bytes == 0
    assert s.resident_bytes == _weight_bytes(model)


def test_impossible_budget_raises_budget_error_naming_the_tensor_and_bytes(device):
    model = _model()
    before = _tensors_by_name(model)
    with pytest.raises(ot.BudgetError) as info:
        ot.wrap_model(model, budget_gb=1000 / GiB, device=device)
    message = str(info.value)
    # The most one op must page: one expert of the larger stack of the experts module (ops page
    # routed experts one at a time, and gate_up and down in separate ops).
    assert "budget of 1.00 kB (1000 bytes)" in message
    assert "paging 'layers.0.moe.experts.gate_up_proj' (one op of module 'layers.0.moe.experts'" in message
    assert "needs 262.14 kB (262144 bytes)" in message
    assert EXPERTS * 2 * INTER * HIDDEN * 4 == 1048576
    # Nothing was moved, and the model can still be wrapped with a real budget.
    assert all(_tensors_by_name(model)[n] is t and not isinstance(t, ot.OffloadedTensor) for n, t in before.items())
    ot.wrap_model(model, budget_gb=_budget_gb(model, 0.4), device=device)


def test_placement_leaves_room_for_a_linear_weight_and_its_bias_paged_together(device):
    # F.linear pages weight and bias in one op: the room placement leaves must hold both, so the
    # smallest budget placement accepts also runs.
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    reference = copy.deepcopy(model).to(device)
    budget = 300  # bytes: everything offloaded; one weight (256) + its bias (32) must fit at once
    ot.wrap_model(model, budget_gb=budget / GiB, device=device)
    x = torch.randn(2, 8, device=device)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    assert ot.stats(model).peak_device_bytes <= budget
    # Below that, linear computes in output tiles: a row of the weight (32) and its bias slice.
    # Tiles 2 outputs wide make BLAS pick a matrix-vector kernel: equal up to rounding.
    tiled = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    tiled.load_state_dict(reference.state_dict())
    with pytest.warns(UserWarning, match="narrower than 16 slices"):
        ot.wrap_model(tiled, budget_gb=100 / GiB, device=device)
    with torch.no_grad():
        torch.testing.assert_close(tiled(x), reference(x), rtol=1e-5, atol=1e-6)
    assert ot.stats(tiled).peak_device_bytes <= 100
    with pytest.raises(ot.BudgetError, match="64 bytes"):
        ot.wrap_model(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), budget_gb=60 / GiB, device=device)


def test_offload_gb_offloads_at_least_that_many_bytes(device):
    model = _model()
    reference = copy.deepcopy(model).to(device)
    want = 0.5 * _weight_bytes(model)
    ot.wrap_model(model, offload_gb=want / GiB, device=device)
    s = ot.stats(model)
    assert s.offloaded_bytes >= want
    assert s.resident_bytes + s.offloaded_bytes == _weight_bytes(model)
    ids = _ids(device)
    assert torch.equal(_run(model, ids), _run(reference, ids))
    assert ot.stats(model).peak_device_bytes <= s.budget_bytes


def test_offloaded_weights_carry_their_names_into_reprs_and_budget_errors(device):
    model = _model()
    ot.wrap_model(model, budget_gb=_budget_gb(model, 0.3), device=device)
    name, weight = next((n, p) for n, p in model.named_parameters() if isinstance(p, ot.OffloadedTensor))
    assert repr(name) in repr(weight) and repr(name) in repr(weight.t())  # a view names its weight
    copy_of = copy.deepcopy(model)
    assert repr(name) in repr(dict(copy_of.named_parameters())[name])
    state_of(model).pager.budget_bytes = 1  # a budget shrunk under the model: paging must fail
    with pytest.raises(ot.BudgetError, match=re.escape(repr(name))):
        _run(model, _ids(device))


def test_budget_gb_and_offload_gb_together_raise(device):
    with pytest.raises(ValueError, match="budget_gb.*offload_gb|offload_gb.*budget_gb"):
        ot.wrap_model(_model(), budget_gb=1, offload_gb=1, device=device)


# ---------------------------------------------------------------------------- placement order and policy


def _class_bytes(model) -> dict:
    classes = {"experts": 0, "mlp": 0, "attn": 0}
    for name, p in model.named_parameters():
        for key, part in (("experts", ".experts."), ("mlp", ".mlp."), ("attn", ".self_attn.")):
            if part in name:
                classes[key] += p.numel() * p.element_size()
    return classes


@pytest.mark.parametrize("offloaded", [("experts",), ("experts", "mlp"), ("experts", "mlp", "attn")])
def test_default_order_offloads_experts_then_dense_mlp_then_attention_then_the_rest(device, offloaded):
    model = _model()
    sizes = _class_bytes(model)
    ot.wrap_model(model, offload_gb=sum(sizes[c] for c in offloaded) / GiB, device=device)
    names = _offloaded_names(model)
    for name, _ in model.named_parameters():
        cls = next((c for c, part in (("experts", ".experts."), ("mlp", ".mlp."), ("attn", ".self_attn.")) if part in name), None)
        assert (name in names) == (cls in offloaded), name


@pytest.mark.parametrize("tie", [False, True])
def test_an_embedding_table_read_only_by_rows_is_offloaded_before_dense_weights(device, tie):
    model = _model(tie=tie)
    reference = copy.deepcopy(model).to(device)
    sizes = _class_bytes(model)
    table = model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    ot.wrap_model(model, offload_gb=(sizes["experts"] + table) / GiB, device=device)
    names = _offloaded_names(model)
    experts = {n for n, _ in model.named_parameters() if ".experts." in n}
    if tie:
        # Tied to the LM head, the table is read whole every token: dense MLP weights go instead.
        assert "embed_tokens.weight" not in names and experts < names
        assert names - experts <= {n for n, _ in model.named_parameters() if ".mlp." in n}
        return
    assert names == experts | {"embed_tokens.weight"}  # the LM head and every dense weight stay resident
    ids = _ids(device)
    _run(model, ids)  # warm: the routed experts of these ids are cached now
    ot.reset_stats(model)
    assert torch.equal(_run(model, ids), _run(reference, ids))
    s = ot.stats(model)
    rows = ids.unique().numel() * HIDDEN * model.embed_tokens.weight.element_size()
    # A forward pages the looked-up rows of the table, never the table.
    table_bytes = s.bytes_h2d - sum(stack["bytes_h2d"] for stack in s.experts.values())
    assert 0 < table_bytes <= rows < table, (table_bytes, rows)


def test_policy_dict_offloads_and_keeps_by_pattern(device):
    model = _model()
    reference = copy.deepcopy(model).to(device)
    ot.wrap_model(model, budget_gb=_budget_gb(model, 0.6), device=device,
                  policy={"offload": ["*.experts.*"], "keep": ["*embed_tokens*"]})
    names = _offloaded_names(model)
    assert {n for n, _ in model.named_parameters() if ".experts." in n} <= names
    assert "embed_tokens.weight" not in names and model.embed_tokens.weight.device == resolve_device(device)
    ids = _ids(device)
    assert torch.equal(_run(model, ids), _run(reference, ids))


def test_policy_list_offloads_matching_weights_even_when_the_budget_would_hold_them(device):
    model = _model()
    ot.wrap_model(model, budget_gb=_budget_gb(model, 2.0), device=device, policy=["*.self_attn.*"])
    assert _offloaded_names(model) == {n for n, _ in model.named_parameters() if ".self_attn." in n}


def test_policy_callable_decides_per_name(device):
    model = _model()
    reference = copy.deepcopy(model).to(device)
    ot.wrap_model(model, budget_gb=_budget_gb(model, 2.0), device=device,
                  policy=lambda name: "offload" if name.endswith("o_proj.weight") else None)
    assert _offloaded_names(model) == {f"layers.{i}.self_attn.o_proj.weight" for i in range(2)}
    ids = _ids(device)
    assert torch.equal(_run(model, ids), _run(reference, ids))


def test_policy_keep_that_cannot_fit_raises_budget_error(device):
    model = _model()
    with pytest.raises(ot.BudgetError, match=r"the policy keeps 4\.60 MB \(4596736 bytes\) resident"):
        ot.wrap_model(model, budget_gb=_budget_gb(model, 0.3), device=device, policy={"keep": ["*"]})


def test_bad_policy_answer_raises(device):
    with pytest.raises(ValueError, match="policy"):
        ot.wrap_model(_model(), budget_gb=1, device=device, policy=lambda name: "maybe")
    with pytest.raises(ValueError, match="policy"):
        ot.wrap_model(_model(), budget_gb=1, device=device, policy={"evict": ["*"]})


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


# ---------------------------------------------------------------------------- stacked experts


class _Stack(nn.Module):
    """16 stacked experts of 16 KiB each (fp32), more than one op's working set (8 experts) holds."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.experts = nn.Module()
        self.experts.down_proj = nn.Parameter(torch.randn(16, 64, 64).to(dtype))


def test_grouped_mm_pages_only_the_experts_that_have_tokens(device):
    # grouped_mm takes only bfloat16 on CUDA
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    stack = _Stack(dtype)
    weight = stack.experts.down_proj.detach().clone().to(device)
    # Room for 10 of the 16 experts: more than one op's working set (8), less than the stack.
    ot.wrap_model(stack, budget_gb=weight.numel() * weight.element_size() * 10 / 16 / GiB, device=device)
    offloaded = stack.experts.down_proj
    assert isinstance(offloaded, ot.OffloadedTensor)
    x = torch.randn(7, 64, device=device, dtype=dtype)
    # Tokens 0-1 go to expert 1, 2-5 to expert 5, 6 to expert 15; every other expert has none.
    ends = [0, 2, 2, 2, 2, 6] + [6] * 9 + [7]
    offs = torch.tensor(ends, dtype=torch.int32, device=device)
    for w, expected_w in ((offloaded, weight), (offloaded.transpose(-2, -1), weight.transpose(-2, -1))):
        ot.reset_stats(stack)
        wrapped_state(stack).pager.clear()
        out = torch._grouped_mm(x, w, offs=offs)
        assert torch.equal(out, torch._grouped_mm(x, expected_w, offs=offs))
        assert ot.stats(stack).bytes_h2d == 3 * 64 * 64 * weight.element_size()
        assert ot.stats(stack).peak_device_bytes <= ot.stats(stack).budget_bytes


def test_selecting_more_experts_than_the_budget_holds_pages_them_in_chunks(device):
    stack = _Stack()
    weight = stack.experts.down_proj.detach().clone().to(device)
    ot.wrap_model(stack, budget_gb=160 * 1024 / GiB, device=device)
    offloaded = stack.experts.down_proj
    every = torch.arange(16, device=device).flip(0)
    assert torch.equal(offloaded[every], weight[every])
    assert torch.equal(offloaded.index_select(0, every), weight.index_select(0, every))
    s = ot.stats(stack)
    # Each expert is paged at least once; the second selection may hit the experts the budget
    # kept (registered expert stacks go through the expert cache, offtensor/moe).
    assert 16 * 64 * 64 * 4 <= s.bytes_h2d <= 2 * 16 * 64 * 64 * 4
    assert s.peak_device_bytes <= s.budget_bytes


# ---------------------------------------------------------------------------- prefetch


def _decode_like(model, steps: int):
    """Single-token forwards with fresh random tokens, so routing changes from step to step."""
    generator = torch.Generator().manual_seed(0)
    device = next(model.parameters()).device
    for _ in range(steps):
        _run(model, torch.randint(0, VOCAB, (1, 1), generator=generator).to(device))


def test_prefetch_hits_dense_weights_that_the_cache_cannot_keep(device):
    model = _model()
    mlp_bytes = 6 * INTER * HIDDEN * 4
    # Room for half of the offloaded MLP weights: every step pages them again.
    budget = _weight_bytes(model) - mlp_bytes // 2
    ot.wrap_model(model, budget_gb=budget / GiB, device=device,
                  policy=lambda name: "offload" if ".mlp." in name else "keep")
    _decode_like(model, 12)
    s = ot.stats(model)
    assert s.bytes_h2d > 2 * mlp_bytes
    assert s.prefetch_hits > 0
    assert s.prefetch_hits >= 0.9 * s.prefetches
    assert s.peak_device_bytes <= s.budget_bytes


def test_prefetch_does_not_chase_routed_experts(device):
    # Only experts are offloaded, so the first weight paged in a step is a routed expert slice:
    # passes must still be whole forwards, and experts that the router changes its mind about
    # must not be copied ahead of time.
    model = _model()
    ot.wrap_model(model, budget_gb=_budget_gb(model, 0.6), device=device, policy={"offload": ["*.experts.*"]})
    _decode_like(model, 24)
    s = ot.stats(model)
    assert s.prefetches - s.prefetch_hits <= max(2, s.prefetches // 4)
    assert s.peak_device_bytes <= s.budget_bytes


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
